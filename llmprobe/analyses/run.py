"""``run_analyses``: per relation and layer: linear relation decoders (LRE, ridge) and superposition readouts, with
controls; the paper's mechanisms measured on the model itself.

``run_analyses`` is what ``llmprobe probe --analyses lre,ridge,superposition,...`` calls; the analyses it runs
are those of ``llmprobe.analyses.registry``, each declared once in its module (its record: ``compute``,
``workload``, stage, claims). One module per job: ``settings`` (options, places), ``splits`` (fixed test set,
re-fits, edit pairs), ``decoders`` (LRE and ridge), ``superposition`` (readouts, R^2, swap edits), ``selector``
(``crosspatch``: one subject state serves every relation; ``selector``: the MLP's gates), ``multihop`` (composed
relations with and without chain-of-thought). Every number is a typed metric (``llmprobe.metric``) in its JSON
form; ``docs/measures.md`` defines each measure.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from llmprobe.analyses.decoders import protocol_note
from llmprobe.analyses.registry import by_name, selected
from llmprobe.analyses.settings import (
    FIRST_TOKEN_NOTE,
    H_PLACE,
    O_PLACE,
    PREFIX_NOTE,
    AnalysisError,
    Log,
    layers_among,
    planned_lre_layers,
    settings_from,
)
from llmprobe.metric import LEVEL
from llmprobe.names import ANALYSES, FIRST_TOKEN


@dataclass
class Runner:
    """Where ``run_analyses`` computes its parts and whom it tells (everything but the science): this one computes
    each part here, in run order (the Python API's default); ``llmprobe.jobs.runner.SharedRunner`` shares them
    with helper processes and the cores of the matched controls. ``on_progress(result)``: called after each part
    with the result so far; ``done``: an earlier result whose parts are taken over; ``fitted``: receives the
    fitted decoders; ``planned``: part -> the plan's seconds (the progress bar's time left); see
    :func:`run_analyses`."""

    on_progress: Callable[[dict], None] | None = None
    done: dict | None = None
    fitted: dict | None = None
    planned: dict | None = None

    @property
    def processes(self) -> int:
        """Processes computing parts (this one and its helpers)."""
        return 1

    def start(self, parts: list) -> None:
        """The parts left to compute (not taken over), in run order."""

    def outcome(self, part, compute, on_wait=None) -> tuple[dict, bool]:
        """(the outcome of ``part``, computed here): ``compute(part)``."""
        return compute(part), True

    def finished_elsewhere(self) -> list:
        """[(part, outcome)] of parts finished in other processes and not handed over yet."""
        return []

    def close(self) -> None:
        """No more parts are handed out (a part in flight still comes back)."""

    def timing(self) -> dict:
        """The result's timing entries of the runner: processes, the parts other processes computed."""
        return {"processes": 1, "helper_parts": []}


def run_analyses(lm, relations, known: dict, layers, analyses=ANALYSES, n_splits: int = 3, seed: int = 0,
                 max_subjects: int = 90, progress: bool = True, runner: Runner | None = None, **options) -> dict:
    """Run the requested analyses on a loaded model; returns a JSON-ready dict.

    ``relations``: ``llmprobe.datasets.Relation`` list; ``known``: relation name -> list of
    ``llmprobe.model.known.FactResult`` (LRE and ridge use the known facts only); ``layers``: layer indices;
    ``analyses``: any of the names the registered analyses answer to (``llmprobe.analyses.registry``: ``ANALYSES``
    and any registered since). ``options``: any field of :class:`AnalysisSettings`. ``progress``: the bar and
    the lines on stderr. A relation that cannot be analysed gets an ``error`` entry and the others go on.

    The work is split into parts (:func:`parts_of`): each relation's decoders, then the superposition analysis
    and each mechanism analysis, in the registry's order. ``runner`` (:class:`Runner`, the default: every part
    here, in order) says where they are computed and whom to tell: ``llmprobe.jobs.runner.SharedRunner`` shares
    them with helper processes (the same model, arguments and torch thread count) and waits for the cores the
    matched controls hold. A part's numbers do not depend on which process computes it (below), so the result
    is the same with any runner; the report's order, errors and checkpoints are those of one process.

    Checkpoints and resuming: the result carries ``"partial": True`` while it is being built and
    ``"partial": False`` once every requested analysis is in it (the key is always there).
    ``runner.on_progress(result)``, if given, is called with the result so far (the same dict, ``partial`` true)
    after each part this process finishes or takes from a helper; ``llmprobe.jobs.probe`` writes report.json
    there, so an interrupt keeps the finished parts. ``runner.done``: an earlier result, partial or not, made with
    the same settings, model and known facts (the caller guarantees that; ``probe`` through its analyses stage
    key). Its ``relations`` entries (those of relations in ``relations``) and its entries of the other analyses,
    if there are any, are taken over as they are (their error messages re-listed in ``errors``) instead of
    recomputed; the rest is computed. Every relation's draws come from generators seeded by (seed, relation name,
    ...) and no analysis after the decoders reads a decoder result, so a part taken over, or computed in another
    process, has the numbers a fresh run would give it.
    ``timing``: each part's seconds in the process that computed it (``decoders_seconds`` their sum over the
    relations), the runner's ``processes`` and ``helper_parts`` (and ``core_wait_seconds`` where it waits for
    cores), and ``total_seconds`` (this call's wall time). ``runner.fitted``, if given, receives the fitted
    decoders of the relations computed here (not those taken over), see ``decoders.decoders_for_relation``.
    ``runner.planned``, if given: part (:func:`parts_of`) -> the plan's seconds of it
    (``llmprobe.jobs.plan.part_seconds``), which the progress bar's time left is scaled from.
    """
    analyses = tuple(analyses)
    chosen = selected(analyses)
    log = Log(progress)
    job = Analyses(lm, relations, known, layers, analyses, log, n_splits, seed, max_subjects, **options)
    start = time.perf_counter()
    result = {"settings": job.settings_record(), "partial": True, "relations": {}, "errors": [], "timing": {}}
    runner = runner if runner is not None else Runner()
    done = runner.done or {}
    done_relations = done.get("relations") or {}
    taken = {(a.name, r.name): done_relations[r.name] for a in chosen if a.per_relation for r in relations
             if isinstance(done_relations.get(r.name), dict)}
    taken.update({(a.name, None): done[a.name] for a in chosen
                  if not a.per_relation and isinstance(done.get(a.name), dict)})
    runner.start([p for p in parts_of(relations, analyses) if p not in taken])
    log.processes = runner.processes
    relation_seconds = []

    def merge(part, outcome) -> None:
        """A computed part's outcome into ``result`` (its error is listed at its turn, so in run order)."""
        kind, name = part
        if name is not None:
            result["relations"][name] = outcome["value"]
            relation_seconds.append(outcome["seconds"])
            if runner.fitted is not None and outcome.get("fitted"):
                runner.fitted[name] = outcome["fitted"]
        else:
            result[kind] = outcome["value"]
            result["timing"][f"{kind}_seconds"] = outcome["seconds"]

    def compute_here(part) -> dict:
        """``job.compute(part)``, its time in the progress bar counted from now (not from its turn: it may have
        waited for a core)."""
        log.started()
        return job.compute(part)

    def take(part) -> None:
        """Part ``part`` at its turn: taken over, computed here, or waited for from the helper computing it."""
        kind, name = part
        if part in taken:
            log(f"{name}: decoders taken over from the earlier result" if name else f"{kind}: taken over from "
                f"the earlier result")
            log.skip()                      # done in 0 s: not in the time-left estimate
            value = taken[part]
            if name is not None:
                result["relations"][name] = value
            else:
                result[kind], result["timing"][f"{kind}_seconds"] = value, 0.0
        else:
            outcome, here = runner.outcome(part, compute_here, on_wait=log.waiting)
            if here:
                merge(part, outcome)
            else:
                log.elsewhere(outcome["seconds"])
            value = outcome["value"]
        if value.get("error"):
            result["errors"].append(value["error"] if name is not None else f"{kind}: {value['error']}")
        for other, outcome in runner.finished_elsewhere():
            merge(other, outcome)
        if runner.on_progress is not None:
            runner.on_progress(result)

    try:
        order = parts_of(relations, analyses)
        plan = [runner.planned.get(part, 0.0) for part in order] if runner.planned else None
        for part in log.bar(order, "analyses", unit="part", planned=plan):
            take(part)
        if any(a.per_relation for a in chosen):
            result["relations"] = {r.name: result["relations"][r.name] for r in relations}
            result["timing"]["decoders_seconds"] = round(sum(relation_seconds), 1)
    finally:
        runner.close()
        for other, outcome in runner.finished_elsewhere():    # an interrupt keeps what the helpers finished
            merge(other, outcome)
    result["timing"].update(runner.timing())
    result["timing"]["total_seconds"] = round(time.perf_counter() - start, 1)
    result["partial"] = False
    return result


def parts_of(relations, analyses: tuple) -> list[tuple[str, str | None]]:
    """The parts of the work in run order (``llmprobe.analyses.registry``): (analysis, relation name) for each
    relation of a per-relation analysis (the decoders, with LRE or ridge), (analysis, None) for the others."""
    return [(a.name, r.name if a.per_relation else None) for a in selected(analyses)
            for r in (relations if a.per_relation else [None])]


class Analyses:
    """What every part of one ``run_analyses`` call needs (the model, relations, known facts, layers, settings)
    and :meth:`compute`, which computes one part: the same in this process and in a helper process."""

    def __init__(self, lm, relations, known: dict, layers, analyses=ANALYSES, log=None, n_splits: int = 3,
                 seed: int = 0, max_subjects: int = 90, **options):
        self.lm, self.relations, self.known, self.analyses = lm, relations, known, tuple(analyses)
        self.log = log if log is not None else Log(False)
        self.cfg = settings_from(n_splits, seed, max_subjects, **options)
        self.layers = sorted({lm.adapter.layer_index(l) for l in layers})
        if not self.layers:
            raise ValueError("run_analyses needs at least one layer")
        self.lre_layers, self.causal_layers, self.swap_layers = _analysis_layers(
            self.layers, lm.adapter.n_layers, self.cfg, analyses)
        self.do_lre, self.do_ridge = "lre" in analyses, "ridge" in analyses

    def settings_record(self) -> dict:
        return _settings_record(self.cfg, self.analyses, self.layers, self.lre_layers, self.causal_layers,
                                self.swap_layers)

    def compute(self, part: tuple[str, str | None]) -> dict:
        """One part: {"value": its entry (a dict; a failure is ``{"error": message}``), "seconds": its time,
        "fitted": {decoder: fit} of a relation's decoders (``decoders.decoders_for_relation``)}."""
        kind, name = part
        t, log, analysis = time.perf_counter(), self.log, by_name(kind)
        if analysis.per_relation:
            relation = next(r for r in self.relations if r.name == name)
            fits: dict = {}
            value = _relation_part(analysis, relation, log, self.analyses,
                                   lambda: analysis.compute(self, relation, fits))
            return {"value": value, "seconds": round(time.perf_counter() - t, 1), "fitted": fits.get(name)}
        value = _analysis(kind, log, lambda: analysis.compute(self))
        return {"value": value, "seconds": round(time.perf_counter() - t, 1)}


def _analysis_layers(layers: list[int], n_layers: int, cfg, analyses: tuple) -> tuple[list, list, list]:
    """(LRE layers, causality layers, swap-edit layers): the settings' choices (default: ``planned_lre_layers`` for
    LRE, the LRE layers for the others) among ``layers``; causality only at LRE layers when LRE runs."""
    lre_layers = planned_lre_layers(cfg, layers, n_layers)
    causal = lre_layers if cfg.causality_layers is None else layers_among(cfg.causality_layers, layers, n_layers)
    causal_layers = [l for l in causal if l in lre_layers or "lre" not in analyses]
    swap_layers = lre_layers if cfg.swap_layers is None else layers_among(cfg.swap_layers, layers, n_layers)
    return lre_layers, causal_layers, swap_layers


def _settings_record(cfg, analyses: tuple, layers, lre_layers, causal_layers, swap_layers) -> dict:
    """The result's ``settings``: every field of ``cfg`` (tuples as lists), the places and the notes that say
    what the numbers are."""
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    settings.update({
        "analyses": list(analyses), "layers": layers, "lre_layers": lre_layers, "causality_layers": causal_layers,
        "swap_layers": swap_layers, "h": H_PLACE, "o": O_PLACE,
        "objects": (FIRST_TOKEN_NOTE if cfg.protocol == "strict" else PREFIX_NOTE) + (
            "" if cfg.scoring == FIRST_TOKEN else "; causality success = full-sequence log-prob of the target "
                                                  "object above that of the original object"),
        "protocol_note": protocol_note(cfg),
        "intervals": f"{LEVEL:.0%} Wilson intervals for proportions (n = test items); superposition R^2, readouts and "
                     f"their gains: a grouped jackknife over subjects ({cfg.jackknife_groups} groups, every fit redone "
                     f"without each), Wilson at its effective n for proportions; bootstrap over subjects "
                     f"({cfg.n_boot} resamples) elsewhere",
        "spread": "standard deviation over re-fits (decoders: re-drawn train/validation and Jacobian subjects on "
                  "the same test set; superposition: cross-fitting folds)"})
    return settings


def _relation_part(analysis, relation, log, analyses: tuple, compute) -> dict:
    """One relation's entry of a per-relation ``analysis`` (the decoders), ``compute()``; a failure becomes an
    ``{"error": message}`` entry and the other relations go on."""
    log(f"{relation.name}: {analysis.name} ({', '.join(a for a in analyses if a in analysis.selects)})")
    try:
        return compute()
    except Exception as error:  # noqa: BLE001 - one relation's failure must not stop the others
        text = str(error) if isinstance(error, (AnalysisError, ValueError)) else f"{type(error).__name__}: {error}"
        message = text if relation.name in text else f"relation {relation.name}: {text}"
        log(message)
        log.skip()                                  # refused (too few facts) or stopped: not in the rate
        return {"error": message}


def _analysis(name: str, log, compute) -> dict:
    """Analysis ``name``'s entry, ``compute()``; a failure becomes an ``{"error": message}`` entry (the other
    analyses' results are kept)."""
    try:
        return compute()
    except Exception as error:  # noqa: BLE001 - reported, the other analyses' results are kept
        error = error if isinstance(error, (AnalysisError, ValueError)) else f"{type(error).__name__}: {error}"
        log(f"{name}: {error}")
        return {"error": str(error)}
