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

import time
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


def run_analyses(lm, relations, known: dict, layers, analyses=ANALYSES, n_splits: int = 3, seed: int = 0,
                 max_subjects: int = 90, progress: bool = True, on_progress=None, done: dict | None = None,
                 fitted: dict | None = None, planned: dict | None = None, **options) -> dict:
    """Run the requested analyses on a loaded model; returns a JSON-ready dict.

    ``relations``: ``llmprobe.datasets.Relation`` list; ``known``: relation name -> list of
    ``llmprobe.model.known.FactResult`` (LRE and ridge use the known facts only); ``layers``: layer indices;
    ``analyses``: any subset of ``ANALYSES``. ``options``: any field of :class:`AnalysisSettings`.
    A relation that cannot be analysed gets an ``error`` entry and the others go on.

    Checkpoints and resuming: the result carries ``"partial": True`` while it is being built and
    ``"partial": False`` once every requested analysis is in it (the key is always there).
    ``on_progress(result)``, if given, is called with the result so far (the same dict, ``partial`` true) after
    each relation's decoders (computed or taken over) and after the superposition analysis and each mechanism
    analysis (``MECHANISMS``); ``llmprobe.jobs.probe`` writes report.json there, so an interrupt keeps the
    finished parts. ``done``: an earlier result, partial or not, made with the same settings, model and known
    facts (the caller guarantees that; ``probe`` through its analyses stage key). Its ``relations`` entries
    (those of relations in ``relations``) and its ``superposition``, ``crosspatch``, ``selector`` and
    ``multihop`` entries, if there are any, are taken over as they are (their error messages re-listed in
    ``errors``) instead of recomputed; the rest is computed. Every relation's draws come from generators
    seeded by (seed, relation name, ...) and no analysis after the decoders reads a decoder result, so a part
    taken over has the numbers a fresh run would give it. ``timing`` counts this call's work only.
    ``fitted``, if given, receives the fitted decoders of the relations computed here (not those taken over), see
    ``decoders.decoders_for_relation``. ``planned``, if given: relation name -> the plan's seconds of its
    decoders (``llmprobe.jobs.plan.decoder_seconds``), which the progress bar's time left is scaled from.
    """
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    cfg = settings_from(n_splits, seed, max_subjects, **options)
    log = Log(progress)
    n_layers = lm.adapter.n_layers
    layers = sorted({lm.adapter.layer_index(l) for l in layers})
    if not layers:
        raise ValueError("run_analyses needs at least one layer")
    lre_layers, causal_layers, swap_layers = _analysis_layers(lm, layers, n_layers, cfg, analyses)
    start = time.perf_counter()
    settings = _settings_record(cfg, analyses, layers, lre_layers, causal_layers, swap_layers)
    result = {"settings": settings, "partial": True, "relations": {}, "errors": [], "timing": {}}
    done = done or {}
    done_relations = done.get("relations") or {}

    def progress_made() -> None:
        if on_progress is not None:
            on_progress(result)

    do_lre, do_ridge = "lre" in analyses, "ridge" in analyses
    if do_lre or do_ridge:
        plan = [planned.get(r.name, 0.0) for r in relations] if planned else None
        for relation in log.bar(relations, "decoders", planned=plan):
            result["relations"][relation.name] = _relation_decoders(
                relation, done_relations.get(relation.name), result["errors"], log, analyses,
                lambda: decoders_for_relation(lm, relation, known.get(relation.name), layers, lre_layers,
                                              causal_layers, do_lre, do_ridge, cfg, log, fitted))
            progress_made()
        result["timing"]["decoders_seconds"] = round(time.perf_counter() - start, 1)
    if "superposition" in analyses:
        _analysis(result, done, "superposition", log, lambda: superposition(
            lm, superposition_table(lm.tokenizer, relations, known, cfg), layers, swap_layers, cfg, log))
        progress_made()
    for name, analysis in MECHANISMS.items():
        if name not in analyses:
            continue
        _analysis(result, done, name, log, lambda: analysis(lm, relations, known, layers, cfg, log))
        progress_made()
    result["timing"]["total_seconds"] = round(time.perf_counter() - start, 1)
    result["partial"] = False
    return result


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


def _relation_decoders(relation, earlier, errors: list, log, analyses: tuple, compute) -> dict:
    """One relation's decoders entry: ``earlier`` (its entry in an earlier result) when that is a dict, else
    ``compute()``; a failure becomes an ``error`` entry (also appended to ``errors``) and the others go on."""
    if isinstance(earlier, dict):
        if earlier.get("error"):
            errors.append(earlier["error"])
        log(f"{relation.name}: decoders taken over from the earlier result")
        log.skip()                                  # done in 0 s: not in the time-left estimate
        return earlier
    log(f"{relation.name}: decoders ({', '.join(a for a in analyses if a != 'superposition')})")
    try:
        return compute()
    except Exception as error:  # noqa: BLE001 - one relation's failure must not stop the others
        text = str(error) if isinstance(error, (AnalysisError, ValueError)) else f"{type(error).__name__}: {error}"
        message = text if relation.name in text else f"relation {relation.name}: {text}"
        errors.append(message)
        log(message)
        log.skip()                                  # refused (too few facts) or stopped: not in the rate
        return {"error": message}


def _analysis(result: dict, done: dict, name: str, log, compute) -> None:
    """``result[name]``: ``done[name]`` when that is a dict, else ``compute()`` (a failure: an ``error`` entry, the
    other analyses' results kept); its error re-listed in ``result["errors"]``, its time in ``result["timing"]``."""
    t = time.perf_counter()
    if isinstance(done.get(name), dict):
        result[name] = done[name]
        if result[name].get("error"):
            result["errors"].append(f"{name}: {result[name]['error']}")
        log(f"{name}: taken over from the earlier result")
    else:
        try:
            result[name] = compute()
        except Exception as error:  # noqa: BLE001 - reported, the other analyses' results are kept
            error = error if isinstance(error, (AnalysisError, ValueError)) else f"{type(error).__name__}: {error}"
            result[name] = {"error": str(error)}
            result["errors"].append(f"{name}: {error}")
            log(f"{name}: {error}")
    result["timing"][f"{name}_seconds"] = round(time.perf_counter() - t, 1)
