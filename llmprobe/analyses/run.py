"""``run_analyses``: per relation and layer: linear relation decoders (LRE, ridge) and superposition readouts, with
controls; the paper's mechanisms measured on the model itself.

``run_analyses`` is what ``llmprobe probe --analyses lre,ridge,superposition,...`` calls. One module per job:
``settings`` (options, places), ``splits`` (fixed test set, re-fits, edit pairs), ``decoders`` (LRE and ridge),
``superposition`` (readouts, R^2, swap edits), ``selector`` (``crosspatch``: one subject state serves every
relation; ``selector``: the MLP's gates), ``multihop`` (composed relations with and without chain-of-thought).
Every number is a typed metric (``llmprobe.metric``) in its JSON
form; ``docs/measures.md`` defines each measure.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import asdict

from llmprobe.analyses.decoders import decoders_for_relation, protocol_note
from llmprobe.analyses.multihop import multihop
from llmprobe.analyses.selector import crosspatch, selector
from llmprobe.analyses.settings import (
    FIRST_TOKEN_NOTE,
    H_PLACE,
    O_PLACE,
    PREFIX_NOTE,
    AnalysisError,
    Log,
    pick_layers,
    settings_from,
)
from llmprobe.analyses.superposition import superposition, superposition_table
from llmprobe.metric import LEVEL
from llmprobe.names import ANALYSES, FIRST_TOKEN

# the mechanism analyses on the pretrained model, in run order: name -> fn(lm, relations, known, layers, cfg, log)
MECHANISMS = {"crosspatch": crosspatch, "selector": selector, "multihop": multihop}
AFTER_DECODERS = ("superposition", *MECHANISMS)     # the analyses that are one part each, in run order


def run_analyses(lm, relations, known: dict, layers, analyses=ANALYSES, n_splits: int = 3, seed: int = 0,
                 max_subjects: int = 90, progress: bool = True, on_progress=None, done: dict | None = None,
                 fitted: dict | None = None, planned: dict | None = None, helpers=(), gate=None, **options) -> dict:
    """Run the requested analyses on a loaded model; returns a JSON-ready dict.

    ``relations``: ``llmprobe.datasets.Relation`` list; ``known``: relation name -> list of
    ``llmprobe.model.known.FactResult`` (LRE and ridge use the known facts only); ``layers``: layer indices;
    ``analyses``: any subset of ``ANALYSES``. ``options``: any field of :class:`AnalysisSettings`.
    A relation that cannot be analysed gets an ``error`` entry and the others go on.

    The work is split into parts (:func:`parts_of`): each relation's decoders, then the superposition analysis
    and each mechanism analysis (``MECHANISMS``), in that order. ``helpers``: processes that compute parts too
    (``llmprobe.jobs.helpers.AnalysisHelper``: the same model, the same arguments, the same torch thread count):
    this process takes the parts from the front, each helper from the back (:class:`Parts`), so the last parts are
    shared out whoever is free. A part's numbers do not depend on which process computes it (below), so the
    result is the same with or without helpers; the report's order, errors and checkpoints are those of one
    process.

    Checkpoints and resuming: the result carries ``"partial": True`` while it is being built and
    ``"partial": False`` once every requested analysis is in it (the key is always there).
    ``on_progress(result)``, if given, is called with the result so far (the same dict, ``partial`` true) after
    each part this process finishes or takes from a helper; ``llmprobe.jobs.probe`` writes report.json there, so
    an interrupt keeps the finished parts. ``done``: an earlier result, partial or not, made with the same
    settings, model and known facts (the caller guarantees that; ``probe`` through its analyses stage key). Its
    ``relations`` entries (those of relations in ``relations``) and its ``superposition``, ``crosspatch``,
    ``selector`` and ``multihop`` entries, if there are any, are taken over as they are (their error messages
    re-listed in ``errors``) instead of recomputed; the rest is computed. Every relation's draws come from
    generators seeded by (seed, relation name, ...) and no analysis after the decoders reads a decoder result,
    so a part taken over, or computed in another process, has the numbers a fresh run would give it.
    ``timing``: each part's seconds in the process that computed it (``decoders_seconds`` their sum over the
    relations), ``processes`` (1 + helpers), ``helper_parts`` (the relations and analyses a helper computed) and
    ``total_seconds`` (this call's wall time). ``gate``: see :class:`Parts`; with one, ``timing`` also has
    ``core_wait_seconds`` (the seconds parts waited for a core, summed over the processes).
    ``fitted``, if given, receives the fitted decoders of the relations computed here (not those taken over), see
    ``decoders.decoders_for_relation``. ``planned``, if given: part (:func:`parts_of`) -> the plan's seconds of it
    (``llmprobe.jobs.plan.part_seconds``), which the progress bar's time left is scaled from.
    """
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    log = Log(progress)
    job = Analyses(lm, relations, known, layers, analyses, log, n_splits, seed, max_subjects, **options)
    start = time.perf_counter()
    result = {"settings": job.settings_record(), "partial": True, "relations": {}, "errors": [], "timing": {}}
    done = done or {}
    done_relations = done.get("relations") or {}
    taken = {("decoders", r.name): done_relations[r.name] for r in relations
             if isinstance(done_relations.get(r.name), dict)}
    taken.update({(name, None): done[name] for name in AFTER_DECODERS if isinstance(done.get(name), dict)})
    parts = Parts([p for p in parts_of(relations, analyses) if p not in taken], helpers, gate)
    log.processes = 1 + parts.n_helpers
    relation_seconds = []

    def merge(part, outcome) -> None:
        """A computed part's outcome into ``result`` (its error is listed at its turn, so in run order)."""
        kind, name = part
        if kind == "decoders":
            result["relations"][name] = outcome["value"]
            relation_seconds.append(outcome["seconds"])
            if fitted is not None and outcome.get("fitted"):
                fitted[name] = outcome["fitted"]
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
            if kind == "decoders":
                result["relations"][name] = value
            else:
                result[kind], result["timing"][f"{kind}_seconds"] = value, 0.0
        else:
            outcome, here = parts.outcome(part, compute_here, on_wait=log.waiting)
            if here:
                merge(part, outcome)
            else:
                log.elsewhere(outcome["seconds"])
            value = outcome["value"]
        if value.get("error"):
            result["errors"].append(value["error"] if kind == "decoders" else f"{kind}: {value['error']}")
        for other, outcome in parts.finished_elsewhere():
            merge(other, outcome)
        if on_progress is not None:
            on_progress(result)

    try:
        order = parts_of(relations, analyses)
        plan = [planned.get(part, 0.0) for part in order] if planned else None
        for part in log.bar(order, "analyses", unit="part", planned=plan):
            take(part)
        if job.do_lre or job.do_ridge:
            result["relations"] = {r.name: result["relations"][r.name] for r in relations}
            result["timing"]["decoders_seconds"] = round(sum(relation_seconds), 1)
    finally:
        parts.close()
        for other, outcome in parts.finished_elsewhere():     # an interrupt keeps what the helpers finished
            merge(other, outcome)
    result["timing"]["processes"] = 1 + parts.n_helpers
    result["timing"]["helper_parts"] = [name or kind for kind, name in parts.order if (kind, name) in parts.outcomes]
    if gate is not None:
        result["timing"]["core_wait_seconds"] = round(gate.waited_s, 1)
    result["timing"]["total_seconds"] = round(time.perf_counter() - start, 1)
    result["partial"] = False
    return result


def parts_of(relations, analyses: tuple) -> list[tuple[str, str | None]]:
    """The parts of the work in run order: ("decoders", relation name) for each relation (with LRE or ridge), then
    (analysis, None) for the superposition analysis and each mechanism analysis requested."""
    parts = [("decoders", r.name) for r in relations] if {"lre", "ridge"} & set(analyses) else []
    return parts + [(name, None) for name in AFTER_DECODERS if name in analyses]


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
            lm, self.layers, lm.adapter.n_layers, self.cfg, analyses)
        self.do_lre, self.do_ridge = "lre" in analyses, "ridge" in analyses

    def settings_record(self) -> dict:
        return _settings_record(self.cfg, self.analyses, self.layers, self.lre_layers, self.causal_layers,
                                self.swap_layers)

    def compute(self, part: tuple[str, str | None]) -> dict:
        """One part: {"value": its entry (a dict; a failure is ``{"error": message}``), "seconds": its time,
        "fitted": {decoder: fit} of a relation's decoders (``decoders.decoders_for_relation``)}."""
        kind, name = part
        t, cfg, lm, log = time.perf_counter(), self.cfg, self.lm, self.log
        if kind == "decoders":
            relation = next(r for r in self.relations if r.name == name)
            fits: dict = {}
            value = _relation_decoders(relation, log, self.analyses, lambda: decoders_for_relation(
                lm, relation, self.known.get(name), self.layers, self.lre_layers, self.causal_layers, self.do_lre,
                self.do_ridge, cfg, log, fits))
            return {"value": value, "seconds": round(time.perf_counter() - t, 1), "fitted": fits.get(name)}
        if kind == "superposition":
            value = _analysis(kind, log, lambda: superposition(
                lm, superposition_table(lm.tokenizer, self.relations, self.known, cfg), self.layers,
                self.swap_layers, cfg, log))
        else:
            value = _analysis(kind, log, lambda: MECHANISMS[kind](lm, self.relations, self.known, self.layers, cfg,
                                                                 log))
        return {"value": value, "seconds": round(time.perf_counter() - t, 1)}


class Parts:
    """The parts of one stage (a ``run_analyses`` call; ``llmprobe.jobs.probe``'s known facts) shared between this
    process (:meth:`claim` from the front, at each part's turn) and its helpers (each helper's thread claims from
    the back, hands the part to its process and files the outcome). ``gate``: None, or what holds a part's cores
    while it is computed, here or in a helper (``llmprobe.jobs.matched.CoreGate``: the controls' workers first);
    a part this process waits for from a helper holds none. Thread-safe."""

    def __init__(self, parts: list, helpers=(), gate=None):
        self.order = list(parts)
        self.gate = gate
        self.claimed: set = set()
        self.outcomes: dict = {}          # part -> its outcome, of the parts the helpers computed
        self.handed: set = set()          # the parts of ``outcomes`` finished_elsewhere has handed over
        self.lost: set = set()            # parts a helper claimed and could not finish (it died)
        self.changed = threading.Condition()
        self.closed = False
        self.threads = [threading.Thread(target=self._feed, args=(helper,), daemon=True,
                                         name="llmprobe-analyses-helper") for helper in helpers]
        self.n_helpers = len(self.threads)
        for thread in self.threads:
            thread.start()

    def claim(self, part) -> bool:
        """This process takes ``part`` unless a helper has."""
        with self.changed:
            if part in self.claimed and part not in self.lost:
                return False
            self.claimed.add(part)
            return True

    def _claim_last(self):
        with self.changed:
            left = [p for p in self.order if p not in self.claimed]
            if self.closed or not left:
                return None
            self.claimed.add(left[-1])
            return left[-1]

    def _feed(self, helper) -> None:
        """A helper's thread: claim parts from the back and have the helper compute them, until none is left or
        the helper fails (its part is then this process's to compute)."""
        while (part := self._claim_last()) is not None:
            try:
                with self.slot():
                    outcome = helper.compute(part)
            except Exception:  # noqa: BLE001 - never leave a claimed part unanswered: this process computes it
                outcome = None
            with self.changed:
                if outcome is None:
                    self.lost.add(part)
                else:
                    self.outcomes[part] = outcome
                self.changed.notify_all()
            if outcome is None:
                return

    def outcome(self, part, compute, on_wait=None) -> tuple[dict, bool]:
        """(the outcome of ``part``, computed here): ``compute(part)`` here unless a helper claimed it, else the
        helper's outcome once it is back (here again if that helper died). ``on_wait``: called once if the part
        has to wait for a core before it is computed here."""
        outcome = self.wait(part) if not self.claim(part) else None
        if outcome is not None:
            return outcome, False
        with self.slot(on_wait):
            return compute(part), True

    def slot(self, on_wait=None):
        """The gate's hold on a part's cores (nothing without a gate); ``on_wait`` as the gate's."""
        return self.gate.slot(on_wait) if self.gate is not None else nullcontext()

    def wait(self, part):
        """The outcome of ``part``, which a helper claimed, once it is back; None if that helper died (the part is
        then this process's)."""
        with self.changed:
            self.changed.wait_for(lambda: part in self.outcomes or part in self.lost)
            return self.outcomes.get(part)

    def finished_elsewhere(self) -> list:
        """The helpers' outcomes not handed over yet: [(part, outcome)], each handed over once."""
        with self.changed:
            got = [(part, outcome) for part, outcome in self.outcomes.items() if part not in self.handed]
            self.handed.update(part for part, _ in got)
            return got

    def close(self) -> None:
        """No more parts are handed to helpers (a part in flight still comes back)."""
        with self.changed:
            self.closed = True
def _analysis_layers(lm, layers: list[int], n_layers: int, cfg, analyses: tuple) -> tuple[list, list, list]:
    """(LRE layers, causality layers, swap-edit layers): the settings' choices (default: ``pick_layers`` for LRE,
    the LRE layers for the others) among ``layers``; causality only at LRE layers when LRE runs."""
    def chosen(spec, default):
        picked = sorted({lm.adapter.layer_index(l) for l in spec}) if spec is not None else default
        return [l for l in picked if l in layers]
    lre_layers = chosen(cfg.lre_layers, pick_layers(layers, cfg.max_lre_layers, n_layers))
    causal_layers = [l for l in chosen(cfg.causality_layers, lre_layers) if l in lre_layers or "lre" not in analyses]
    swap_layers = chosen(cfg.swap_layers, lre_layers)
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


def _relation_decoders(relation, log, analyses: tuple, compute) -> dict:
    """One relation's decoders entry, ``compute()``; a failure becomes an ``{"error": message}`` entry and the other
    relations go on."""
    log(f"{relation.name}: decoders ({', '.join(a for a in analyses if a != 'superposition')})")
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
