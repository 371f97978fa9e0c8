"""The claims block of a pretrained report (:func:`claims_block`): one line per claim of the paper, each tested
against its nulls (``NULLS``) with a stated minimal effect (``MIN_EFFECT``) and a Holm correction over every test
of the report, graded by ``VERDICT_RULE``; the matched synthetic control stands beside a line as a comparison,
never as its null. Decides what a line says; draws and renders nothing."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from llmprobe.analyses.results import FactTable, MatchedBlock, MatchedSource, SuperpositionLayer, metric_nulls
from llmprobe.metric import LEVEL, Metric, wilson
from llmprobe.report.schema import analyses_of, matched_sources_of, model_of, source_name

CLAIMS = ("attributes linearly decodable", "LRE edits causal", "subject states a superposition of attribute vectors",
          "one subject state serves every relation", "MLP a relation-conditioned selector",
          "chain-of-thought breaks the multi-hop bottleneck", "capacity O(R log N) in the matched controls")
DECODABLE, CAUSAL, SUPERPOSITION, SERVES, SELECTOR, MULTIHOP, CAPACITY = CLAIMS
NULLS = {DECODABLE: ("shuffled", "random_init", "lexical"),           # every one must be measured and beaten
         CAUSAL: ("random_direction", "random_operator"),
         SUPERPOSITION: ("shuffled", "random_init", "random_attributes", "lexical"),
         SERVES: ("random_subject", "random_vector"),
         SELECTOR: ("other_relation_gate", "random_units_matched"),
         MULTIHOP: ("direct",)}
MIN_EFFECT = {DECODABLE: 0.10, CAUSAL: 0.10, SUPERPOSITION: 0.018, SERVES: 0.10, SELECTOR: 0.10,
              MULTIHOP: 0.10}                                  # accuracy / R^2 / success rate over the null
# SUPERPOSITION: the smallest R^2 gain over random_attributes that no planted negative (shuffled tables, the token
# embeddings alone) exceeds in 95% of its replicates, at SmolLM2's 193 subjects x its non-lexical relations, d = 576
# (benchmarks/calibration.py --minimal-effect; docs/measures.md, Calibration); it was 0.05 before, set by hand
# the selector line of reports without the calibrated test (no ``gate_transplant.selector_keep``): the share of
# answers another relation's gates break against a count-matched random switch-off (docs/measures.md, Calibration)
SELECTOR_BREAK = "MLP a relation-conditioned selector (gate-transplant break)"
NULLS[SELECTOR_BREAK] = ("random_units",)
MIN_EFFECT[SELECTOR_BREAK] = MIN_EFFECT[SELECTOR]
REFERENCES = {"scaled_patch": "a same-norm step toward h_t (scaled_patch)",     # LRE causality's comparison
              "full_patch": "the full patch h_s -> h_t (full_patch, a reference)"}
ALPHA = 0.025                   # one-sided familywise level (Holm): the one-sided level of the 95% intervals shown
GRADES = ("supported", "weak", "inconclusive (low power)", "not shown", "null not measured", "not measured")  # best first
POWER = 0.8                     # below this power to detect the minimal effect, "not shown" is "inconclusive (low power)"
# bits per trainable parameter at d* of every trainable cell of the capacity sweep (docs/synthetic.md, "Measured
# thresholds": N 256-4096, R 2-16, mean over seeds), by (kind of map, step cap); the tolerance is their range
# general maps: trainable cells shaped like the country table (N = 48, 96, 193; R = 6; the controls' 2000-step
# cap; mean over seeds; docs/synthetic.md, "General maps at the controls' budget")
CAPACITY_SWEEP = {("bijections", 500): (1.43, 1.51, 1.74, 1.81, 1.76, 1.66, 1.75, 1.80, 1.85, 1.77, 1.77, 1.83,
                                        1.87, 1.91),
                  ("general maps", 2000): (0.74, 1.14, 1.22)}
VERDICT_RULE = (
    "Verdicts (docs/measures.md, Verdicts): each claim is tested against every one of its nulls (attributes "
    "decodable: shuffled, random_init, lexical; LRE causal: random_direction, random_operator; superposition: "
    "shuffled, random_init, random_attributes, lexical (the subjects' static token embeddings in place of their "
    "states), on the R^2 over the relations the lexical rule does not flag (docs/measures.md; older reports: every "
    "relation); one state serves every relation: the crosspatch's random_subject and "
    "random_vector patches; selector: the keep rate under another subject's gates of the same relation against "
    "the subject's own gates of another relation (other_relation_gate) and a random switch-off matched in count "
    "and norm to that transplant (random_units_matched; older reports: the share another relation's gates break "
    "against switching off as many random units, random_units); chain-of-thought: the direct answer to the same chains) on the difference measure - null with "
    "its 95% interval (paired bootstrap where the report has it, else MOVER from the two intervals). supported: "
    f"the difference exceeds the minimal effect (+{MIN_EFFECT[DECODABLE]:g} accuracy, +{MIN_EFFECT[SUPERPOSITION]:g} "
    "R^2) against every null, Holm-adjusted over all tests of the report (claims x relations) at one-sided "
    f"{ALPHA:g}; weak: it exceeds 0 but is not shown to exceed the minimal effect; inconclusive (low power): "
    f"neither, and the test's power to find a true difference of the minimal effect (from its interval's width, at "
    f"one-sided {ALPHA:g} over the Holm family's size, its strictest step) is below {POWER:g}: it could not have "
    "shown the claim at this n; not shown: neither, with the power to; null not measured: a null is missing from "
    "the report. Layers, chosen on validation subjects only: LRE causality at its "
    "causality layer, each readout at its relation's LRE layer, the R^2 and the crosspatch at the layer most "
    "relations' LRE chose (with no decoder: every layer, all in the Holm family), the gate transplant at the block "
    "the selector chose on validation facts. A line shows the median relation: its verdict is the "
    "grade that at least half the relations reach. The matched control is a comparison (more than / as much as / less than), "
    "not a null; its word (more than / as much as / less than) comes from the paired difference where the report "
    "has one. Capacity: the table's bits per trainable parameter at d* against the range of the capacity "
    "sweep's cells for the same kind of map and step cap, two-sided: supported inside it, not shown outside it "
    "(inconclusive when d* is an upper bound and the lower bound it gives lies below the range's top, or when the "
    "narrowest curve width at which every seed fits falls on the other side of the range), not comparable when the "
    "sweep has no cells of that kind.")
_Z = NormalDist().inv_cdf(0.5 + LEVEL / 2)


def _compact(m: dict | None) -> dict | None:
    """value, ci, n, interval of a typed metric (JSON form); None when it has no value."""
    if not m or m.get("value") is None or (isinstance(m["value"], float) and math.isnan(m["value"])):
        return None
    return {k: m.get(k) for k in ("value", "ci", "n", "interval")}


def _bounds(m: dict) -> tuple[float, float]:
    """The metric's interval, an unknown end as infinitely far."""
    lo, hi = (m.get("ci") or [None, None])[:2]
    return (-math.inf if lo is None else lo), (math.inf if hi is None else hi)


def difference(metric: dict, other: dict, paired: dict | None = None) -> dict:
    """metric - other with a 95% interval: ``paired`` (the paired bootstrap margin the report computed over the
    same items) when given, else MOVER (Zou & Donner 2008) from the two intervals: lo = d - sqrt((a - a_lo)^2 +
    (b_hi - b)^2), hi = d + sqrt((a_hi - a)^2 + (b - b_lo)^2); exact for independent estimates and conservative
    when the two are non-negatively correlated over their items."""
    if _compact(paired) and None not in (paired.get("ci") or [None])[:2]:
        return {"value": paired["value"], "ci": list(paired["ci"][:2]), "interval": "paired bootstrap"}
    a, b = metric["value"], other["value"]
    (a_lo, a_hi), (b_lo, b_hi) = _bounds(metric), _bounds(other)
    return {"value": a - b, "ci": [a - b - math.hypot(a - a_lo, b_hi - b), a - b + math.hypot(a_hi - a, b - b_lo)],
            "interval": "MOVER (unpaired)"}


def p_above(diff: dict, threshold: float) -> float:
    """One-sided p of "difference <= threshold" from the difference's 95% interval (normal approximation: the
    half-width on the threshold's side is 1.96 standard errors)."""
    value, (lo, hi) = diff["value"], _bounds(diff)
    half = value - lo if value > threshold else hi - value
    if not half > 0:                                         # a zero-width interval: the value decides
        return 0.0 if value > threshold else 1.0
    return 1.0 - NormalDist().cdf((value - threshold) * _Z / half)


def power(diff: dict, effect: float, alpha: float) -> float:
    """Power of the one-sided test "difference > 0" at level ``alpha`` to find a true difference of ``effect``,
    from the difference's 95% interval (normal approximation: its standard error is the interval's width over
    2 x 1.96): what the test could have shown at its n, whatever it found."""
    lo, hi = _bounds(diff)
    se = (hi - lo) / (2 * _Z)
    if not se > 0:                                           # a zero-width interval: any effect is found
        return 1.0
    return NormalDist().cdf(effect / se - NormalDist().inv_cdf(1 - alpha))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (familywise error), in the order given."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def _word(diff: dict) -> str:
    lo, hi = _bounds(diff)
    return "more than" if lo > 0 else "less than" if hi < 0 else "as much as"


def claim_test(claim: str, relation: str, layer: int | None, metric: dict | None, nulls: dict | None = None,
          margins: dict | None = None, comparison: tuple | None = None) -> dict | None:
    """One test of ``claim`` on ``relation`` at ``layer``: the measure (typed metric, JSON form) against each null
    of the claim (``nulls``: {name: metric}, default the metric's controls; ``margins``: paired differences by
    null name). The null shown is the hardest one (largest p); ``comparison`` = (name, metric) or (name, metric,
    the paired difference metric - it) set beside it, its word from the paired difference when given."""
    if _compact(metric) is None:
        return None
    nulls = metric_nulls(metric) if nulls is None else nulls
    present = {name: nulls[name] for name in NULLS[claim] if _compact(nulls.get(name))}
    test = {"claim": claim, "relation": relation, "layer": layer, "metric": _compact(metric),
            "missing_nulls": [n for n in NULLS[claim] if n not in present], "null_name": None, "null": None,
            "difference": None, "min_effect": MIN_EFFECT[claim], "p": None, "p_zero": None, "p_holm": None,
            "p_zero_holm": None, "power": None, "comparison": None}
    against = {name: difference(metric, null, margins.get(name) if margins else None)
               for name, null in present.items()}
    if against:
        hardest = max(against, key=lambda n: (p_above(against[n], MIN_EFFECT[claim]), p_above(against[n], 0.0)))
        test.update(null_name=hardest, null=_compact(present[hardest]), difference=against[hardest],
                    p=max(p_above(d, MIN_EFFECT[claim]) for d in against.values()),       # every null beaten
                    p_zero=max(p_above(d, 0.0) for d in against.values()))
    if comparison and _compact(comparison[1]):
        diff = difference(metric, comparison[1], comparison[2] if len(comparison) > 2 else None)
        test["comparison"] = {"name": comparison[0], "metric": _compact(comparison[1]), "difference": diff,
                              "word": _word(diff)}
    return test


def _grade(test: dict) -> str:
    if test["missing_nulls"]:
        return "null not measured"
    if test["p_holm"] < ALPHA:
        return "supported"
    if test["p_zero_holm"] < ALPHA:
        return "weak"
    return "inconclusive (low power)" if test["power"] is not None and test["power"] < POWER else "not shown"


def _rank(test: dict) -> tuple:
    """Sort key, best first: grade, then the Holm-adjusted p of the minimal effect, then of any effect."""
    p, p_zero = (test["p"], test["p_zero"]) if test["p_holm"] is None else (test["p_holm"], test["p_zero_holm"])
    return GRADES.index(test["grade"]), 2.0 if p is None else p, 2.0 if p_zero is None else p_zero


def _line(claim: str, measure: str, tests: list[dict]) -> dict:
    """The claim's line: each relation at its best layer, the line at the median relation (upper median, best
    first), so that its verdict is the grade at least half the relations reach."""
    line = {"claim": claim, "measure": measure, "relation": None, "layer": None, "metric": None, "null_name": None,
            "null": None, "missing_nulls": [], "difference": None, "min_effect": MIN_EFFECT.get(claim), "p_holm": None,
            "p_zero_holm": None, "power": None, "verdict": "not measured", "counts": {}, "comparison": None,
            "note": ""}
    if not tests:
        return line
    best: dict[str, dict] = {}
    for test in tests:
        if test["relation"] not in best or _rank(test) < _rank(best[test["relation"]]):
            best[test["relation"]] = test
    ranked = sorted(best.values(), key=_rank)
    shown = ranked[(len(ranked) - 1) // 2]
    counts = {g: sum(t["grade"] == g for t in ranked) for g in GRADES if any(t["grade"] == g for t in ranked)}
    line.update({k: shown[k] for k in ("relation", "layer", "metric", "null_name", "null", "missing_nulls",
                                       "difference", "p_holm", "p_zero_holm", "power", "comparison")},
                verdict=shown["grade"], counts=counts)
    if shown.get("with_lexical"):                          # the superposition R^2 with the lexical relations
        line["with_lexical"] = shown["with_lexical"]
    layers = sorted({t["layer"] for t in tests if t["layer"] is not None})
    if len(ranked) > 1:
        line["note"] = f"{', '.join(f'{n} {g}' for g, n in counts.items())} of {len(ranked)} relations (shown: the median)"
    elif len(layers) > 1:
        line["note"] = f"the best of layers {', '.join(map(str, layers))} (all in the Holm family)"
    if shown["missing_nulls"]:
        line["note"] = "; ".join(filter(None, [line["note"], f"not measured: {', '.join(shown['missing_nulls'])}"]))
    return line


def _same_width_control(report: dict) -> MatchedSource | None:
    """The trainable matched control at the pretrained model's width, or None."""
    d_model = model_of(report).d_model
    return next((s for s in _trainable_controls(report) if s.model.d_model == d_model), None)


def _trainable_controls(report: dict) -> list[MatchedSource]:
    """The report's trainable matched controls, one synthetic source per curve point, in the block's order."""
    return [s for s in matched_sources_of(report) if not s.model.frozen_subjects]


def _at_dstar(report: dict) -> MatchedSource | None:
    """The trainable matched control at its threshold width d*, or None."""
    trainable = _trainable_controls(report)
    return next((s for s in trainable if s.threshold.d_star == s.model.d_model), trainable[0] if trainable else None)


def decoder_layers(report: dict, measured: set[int], relations: list[str] | None) -> tuple[dict[str, int], int | None]:
    """({relation: layer}, common layer) chosen on validation subjects only: each relation's LRE layer
    (``selected.lre.layer``, by validation faithfulness) where it is in ``measured``, and the one most of
    ``relations`` (every relation with a decoder when None) chose (ties: the lower layer); (_, None) when no decoder
    chose a measured layer."""
    chosen = {}
    for relation, entry in analyses_of(report).relations.items():
        layer = entry.selection("lre").layer
        if layer is not None and int(layer) in measured:
            chosen[relation] = int(layer)
    votes = [layer for relation, layer in chosen.items() if relation in (relations or chosen)]
    common = min(set(votes), key=lambda layer: (-votes.count(layer), layer)) if votes else None
    return chosen, common


def validation_layers(report: dict) -> tuple[dict[str, int], int | None]:
    """:func:`decoder_layers` of the superposition: its measured layers, its relations."""
    superposition = analyses_of(report).superposition
    measured = {int(layer) for layer in superposition.layers}
    return decoder_layers(report, measured, superposition.relations)


def _superposition_tests(report: dict) -> tuple[list[dict], list[dict], str]:
    """(readout tests, R^2 tests, where) of the pretrained superposition readouts at the layers of
    :func:`validation_layers` (every measured layer where no decoder chose one), each beside the trainable matched
    control at the same width."""
    layers = analyses_of(report).superposition.layers
    chosen, common = validation_layers(report)
    control = (_same_width_control(report) or MatchedSource()).analyses.superposition.layers.get("0") or \
        SuperpositionLayer()
    name = f"the paper's model (matched control, trainable) at this width (d={report.get('model', {}).get('d_model')})"
    readouts, r2s = [], []
    for layer, entry in sorted(layers.items(), key=lambda kv: int(kv[0])):
        for relation, metric in entry.readout.items():
            if common is None or chosen.get(relation, common) == int(layer):
                readouts.append(claim_test(DECODABLE, relation, int(layer), metric, margins=_margins(metric),
                                      comparison=(name, control.readout.get(relation))))
        if common is None or common == int(layer):
            r2s.append(_r2_test(report, int(layer), entry, (name, control.r2)))
    where = (f"at the layer its LRE decoder chose on validation (else layer {common}, the one most relations' "
             "decoders chose)" if common is not None else "at every measured layer (no decoder chose one), all in "
             "the Holm family")
    return [t for t in readouts if t], [t for t in r2s if t], where


def _r2_test(report: dict, layer: int, entry: SuperpositionLayer, comparison: tuple) -> dict | None:
    """The superposition R^2 test at ``layer``: over the relations the analysis did not flag lexical
    (``r2_non_lexical``; docs/measures.md, the lexical rule) where it flagged any, with the R^2 of every relation
    beside it (``with_lexical``); None at a layer without that fit (not one the decoders could choose) or where
    every relation is lexical. Reports from before the rule (no ``lexical_relations``): the R^2 of every relation."""
    superposition = analyses_of(report).superposition
    lexical = superposition.lexical_relations
    if not lexical or superposition.graded_layers is None:
        return claim_test(SUPERPOSITION, "all relations", layer, entry.r2, margins=_margins(entry.r2),
                          comparison=comparison)
    if layer not in superposition.graded_layers or not entry.r2_non_lexical:
        return None
    metric = entry.r2_non_lexical
    test = claim_test(SUPERPOSITION, "non-lexical relations", layer, metric, margins=_margins(metric),
                      comparison=comparison)
    if test:
        gain = (_margins(entry.r2) or {}).get("random_attributes")
        test["with_lexical"] = {"relations": list(metric.get("relations") or []), "lexical": list(lexical),
                                "r2": _compact(entry.r2), "gain": _compact(gain)}
    return test


def _margins(m: dict | None) -> dict | None:
    """The paired differences by null a metric carries (``margins``: the superposition readouts), or None."""
    return m.get("margins") if m else None


def _causality_tests(report: dict) -> list[dict]:
    """One test per relation: LRE causality at the causality layer the decoders chose on validation, beside the
    same-norm step toward h_t (``scaled_patch``; else the ``full_patch`` reference)."""
    tests = []
    for relation, entry in analyses_of(report).relations.items():
        layer = entry.selection("lre").causality_layer
        if layer is None:
            continue
        metric = entry.at(layer).lre.causality
        controls = metric_nulls(metric)
        reference = next((n for n in REFERENCES if _compact(controls.get(n))), None)
        tests.append(claim_test(CAUSAL, relation, int(layer), metric,
                           comparison=(REFERENCES[reference], controls[reference]) if reference else None))
    return [t for t in tests if t]


def _crosspatch_tests(report: dict) -> tuple[list[dict], str]:
    """(tests, where) of "one state serves every relation": the neutral (relation-free) state of s patched into
    relation B's prompt of s' (pooled over ordered pairs) against the random_subject and random_vector patches,
    beside B's own state of s (same_relation), at the layer most of the crosspatch's relations' LRE decoders chose
    on validation (:func:`decoder_layers`; the crosspatch itself chooses none); every layer when none did."""
    crosspatch = analyses_of(report).crosspatch
    layers = crosspatch.layers
    _, common = decoder_layers(report, {int(layer) for layer in layers}, crosspatch.relations)
    tests = [claim_test(SERVES, "all relations", int(layer), entry.neutral,
                   comparison=("the state from relation B's own prompt (same_relation)", entry.same_relation,
                               entry.neutral_minus_same))
             for layer, entry in sorted(layers.items(), key=lambda kv: int(kv[0]))
             if common is None or common == int(layer)]
    where = (f"layer {common}, the one most of its relations' LRE decoders chose on validation" if common is not None
             else "every patched layer (no decoder chose one), all in the Holm family")
    return [t for t in tests if t], where


def _broken(m: dict | None) -> dict | None:
    """1 - a keep rate (JSON form): the fraction of answers an edit breaks, its interval flipped."""
    if _compact(m) is None:
        return None
    lo, hi = _bounds(m)
    return {"value": 1.0 - m["value"], "ci": [1.0 - hi, 1.0 - lo], "n": m.get("n"), "interval": m.get("interval")}


def _informative(paired: dict | None) -> dict | None:
    """A paired bootstrap margin, or None where its interval was widened to the bounds [-1, 1] because every item
    gave the same difference (a perfect selector: every keep 1, every other 0): the difference then falls back to
    MOVER from the two Wilson intervals, which still know n."""
    if paired and paired.get("interval") == "bootstrap (widened)" and list(paired.get("ci") or [])[:2] == [-1.0, 1.0]:
        return None
    return paired


def selector_test(transplant: dict, comparison: tuple | None = None) -> dict | None:
    """The selector's test on one gate transplant (``selector.gate_transplant`` as JSON, or the same keys from
    :func:`llmprobe.analyses.selector.transplant_metrics`): with ``selector_keep`` (the calibrated test,
    docs/measures.md, Calibration) the keep rate under another subject's gates of the same relation against the
    subject's own gates of another relation (``other_relation_gate``, paired: ``same_minus_other``) and a random
    switch-off matched in count and norm to that transplant (``random_units_matched``, paired:
    ``same_minus_random``); without it (older reports) the share another relation's gates break (1 -
    ``other_relation``) against the share a count-matched random switch-off breaks (1 - ``random_units``, paired:
    ``random_minus_other``). The test's ``claim`` is :data:`SELECTOR` either way; ``measure`` names which. A
    paired margin widened to [-1, 1] (every item the same difference) gives way to MOVER (:func:`_informative`)."""
    keep = transplant.get("selector_keep")
    if _compact(keep):
        test = claim_test(SELECTOR, "all relations", None, keep, margins={
            "other_relation_gate": _informative(transplant.get("same_minus_other")),
            "random_units_matched": _informative(transplant.get("same_minus_random"))}, comparison=comparison)
        if test:
            test["measure"] = "keep"
        return test
    if _compact(transplant.get("other_relation")) is None:
        return None
    test = claim_test(SELECTOR_BREAK, "all relations", None, _broken(transplant.get("other_relation")),
                 {"random_units": _broken(transplant.get("random_units"))},
                 {"random_units": transplant.get("random_minus_other")}, comparison)
    if test:
        test.update(claim=SELECTOR, measure="break")
    return test


def _selector_tests(report: dict) -> tuple[list[dict], str]:
    """(tests, where) of the selector on the pretrained model's gate transplant (at the block chosen on validation
    facts, :func:`selector_test`): the calibrated keep test where the report has it, beside the trainable matched
    control's same-relation keep rate at the model's width (else at d*; Wilson, n = the table's facts); older
    reports: the share another relation's gates break against a count-matched random switch-off, beside the
    control's other-relation break at d* (1 - its same_subject keep rate)."""
    transplant = analyses_of(report).selector.gate_transplant
    as_json = transplant.to_dict()
    calibrated = _compact(as_json.get("selector_keep")) is not None
    if transplant.error or not (calibrated or _compact(transplant.other_relation)):
        return [], ""
    source = ((_same_width_control(report) or _at_dstar(report)) if calibrated else _at_dstar(report)) or \
        MatchedSource()
    control, n_facts = source.analyses.selector.gate_transplant, source.matched_to.n_facts
    comparison = None
    if control.same_subject is not None and isinstance(control.same_relation, (int, float)) and n_facts:
        value = control.same_relation if calibrated else control.same_subject
        kept = Metric(value, wilson(value, n_facts), n_facts, "wilson").to_dict()
        comparison = (f"the matched control ({source_name(source.to_dict())}; same-relation gate keeps "
                      f"{control.same_relation:.2f}, other-relation gate {control.same_subject:.2f})",
                      kept if calibrated else _broken(kept))
    test = selector_test(as_json, comparison)
    block = transplant.block
    shown = _compact(transplant.other_relation if calibrated else transplant.same_relation)
    where = (f"at layers {block[0]}-{block[-1]} (the block chosen on validation facts)" if block else "") + (
        (f"; the subject's own gates of another relation keep {shown['value']:.2f}" if calibrated else
         f"; another subject's gates of the same relation keep {shown['value']:.2f}") if shown else "")
    return [t for t in [test] if t], where


def _multihop_tests(report: dict) -> list[dict]:
    """One test per number of hops k: chain-of-thought accuracy over the k-hop chains whose every hop the model
    knows (pooled over compositions) against the direct answer to the same chains (paired: cot_minus_direct),
    beside the ceiling (the chain-of-thought prompt with the true bridges)."""
    pooled = analyses_of(report).multihop.pooled
    tests = [claim_test(MULTIHOP, key, None, entry.cot, {"direct": entry.direct}, {"direct": entry.cot_minus_direct},
                   ("the ceiling (the true bridges given)", entry.ceiling))
             for key, entry in sorted(pooled.items(), key=lambda kv: kv[0])]
    return [t for t in tests if t]


def table_kind(table: FactTable) -> str:
    """"bijections" when every relation is a bijection of the subjects (n_facts = N R and bits = R log2 N!), else
    "general maps"."""
    n, r = table.n_subjects or 0, len(table.relations or [])
    bijection_bits = r * math.lgamma(n + 1) / math.log(2)
    return "bijections" if n and table.n_facts == n * r and abs((table.bits or 0) - bijection_bits) < 0.5 \
        else "general maps"


def capacity_line(report: dict) -> dict:
    """The capacity line: the table's bits per trainable parameter at the trainable control's d* against the range
    of the capacity sweep's cells for the same kind of map and step cap (``CAPACITY_SWEEP``), two-sided."""
    line = {"claim": CAPACITY, "measure": "bits per trainable parameter at d* of the trainable control", "relation":
            None, "layer": None, "metric": None, "null_name": None, "null": None, "missing_nulls": [],
            "difference": None, "min_effect": None, "p_holm": None, "p_zero_holm": None, "power": None, "verdict": "not measured",
            "counts": {}, "comparison": None, "note": ""}
    at_star = _at_dstar(report) or MatchedSource()
    threshold, table, bits_per_param = at_star.threshold, at_star.matched_to, at_star.train.bits_per_param
    if not threshold.d_star or not table.bits or bits_per_param is None:
        return line
    kind = table_kind(table)
    steps = MatchedBlock.from_dict(report.get("matched")).training.max_steps
    exact = bool(threshold.exact)
    line.update(measure=f"{line['measure']}: table bits {table.bits:g} ({kind}, {table.n_subjects} "
                        f"subjects x {len(table.relations or [])} relations) / trainable parameters at d* = "
                        f"{threshold.d_star}{'' if exact else ' (an upper bound)'}, {steps}-step cap",
                metric={"value": bits_per_param, "ci": None, "n": None, "interval": None})
    cells = CAPACITY_SWEEP.get((kind, steps))
    if cells is None:
        swept = "; ".join(f"{k} at a {s}-step cap" for k, s in CAPACITY_SWEEP)
        line.update(verdict="not comparable", note=f"the capacity sweep measured {swept} only; this table is {kind} "
                                                   f"trained with a {steps}-step cap")
        return line
    lo, hi = min(cells), max(cells)
    mean = sum(cells) / len(cells)
    line.update(null_name=f"the capacity sweep's {len(cells)} cells ({kind}, {steps}-step cap): mean [range]",
                null={"value": mean, "ci": [lo, hi], "n": len(cells), "interval": "range of cells"},
                difference={"value": bits_per_param - mean, "ci": [bits_per_param - hi, bits_per_param - lo],
                            "interval": "against the range of cells"})
    def side_of(value: float) -> str:
        return "above" if value > hi else "below" if value < lo else "inside"

    side = side_of(bits_per_param)
    if exact:
        line["verdict"] = "supported" if side == "inside" else "not shown"
    else:                                   # d* an upper bound: the bits per parameter a lower bound
        line["verdict"] = "not shown" if side == "above" else "inconclusive"
    line["note"] = f"{side} the sweep's range" + ("" if exact else " (a lower bound: d* is an upper bound)")
    sturdy = _every_seed_fits(report)
    if sturdy is not None and sturdy["d"] != threshold.d_star:
        line["sturdy"] = sturdy
        moved = side_of(sturdy["bits_per_param"])
        line["note"] += (f"; at d = {sturdy['d']}, the smallest curve width where every seed fits "
                         f"({sturdy['seeds']}), {sturdy['bits_per_param']:.3g} bits/param: {moved} the range")
        if moved != side:
            line["verdict"] = "inconclusive"
            line["note"] += " (d* is marginal: the verdict depends on which rule of fit is taken)"
    return line


def _every_seed_fits(report: dict) -> dict | None:
    """{"d", "bits_per_param", "seeds"} of the trainable control's narrowest curve width at which every seed
    reached 100% train accuracy (``train.over_seeds``), or None when the report has no such point. d* itself is
    the sweep's rule (one initialisation of two fitting suffices), the rule of the cells it is compared with."""
    for source in sorted(_trainable_controls(report), key=lambda s: s.model.d_model):
        seeds, train = source.train.over_seeds, source.train
        if seeds and seeds["n_fit"] == seeds["n"] and train.bits_per_param is not None:
            return {"d": source.model.d_model, "bits_per_param": train.bits_per_param,
                    "seeds": f"{seeds['n_fit']} of {seeds['n']}"}
    return None


def _decodable(report: dict) -> tuple[list[dict], str]:
    readouts, _, where = _superposition_tests(report)
    return readouts, f"superposition readout accuracy (cross-fitted) of each relation, {where}"


def _causal(report: dict) -> tuple[list[dict], str]:
    return _causality_tests(report), ("LRE causality (reference edit W^+ (o_t - o_s)) of each relation at its "
                                      "causality layer chosen on validation")


def _superposition(report: dict) -> tuple[list[dict], str]:
    _, r2s, _ = _superposition_tests(report)
    apart = next((t["with_lexical"] for t in r2s if t.get("with_lexical")), None)
    over = "" if apart is None else (
        f" over the relations not flagged lexical ({', '.join(apart['relations'])}; left out as lexical by the rule "
        f"of docs/measures.md: {', '.join(apart['lexical'])}; with them: R^2 {_number(apart['r2'])}, gain over "
        f"random_attributes {_number(apart['gain'])})")
    return r2s, "held-out R^2 of h_s ~ c + sum_r W_r u_a(s)" + over + " at " + (
        f"layer {r2s[0]['layer']}, the one most LRE decoders chose on validation" if len(r2s) == 1 else
        "every measured layer, all in the Holm family")


def _serves(report: dict) -> tuple[list[dict], str]:
    serves, where = _crosspatch_tests(report)
    return serves, ("crosspatch: fraction of items whose answer to relation B's prompt of s' becomes B's answer for "
                    "s when s's state from a relation-free prompt is patched in (pooled over relation pairs), at "
                    f"{where}")


def _selector(report: dict) -> tuple[list[dict], str]:
    selector, where = _selector_tests(report)
    return selector, ("gate transplant: fraction of known test facts kept with another subject's MLP gates of the "
                      "same relation" if any(t.get("measure") == "keep" for t in selector) else
                      "gate transplant: fraction of known test facts that the same subject's MLP gates of another "
                      "relation break") + f", {where}"


def _multihop(report: dict) -> tuple[list[dict], str]:
    return _multihop_tests(report), ("chain-of-thought accuracy on the k-hop chains whose every hop is known "
                                     "(pooled over compositions), per k")


@dataclass(frozen=True)
class ClaimLine:
    """One line of the claims block. ``tests(report)`` -> (its tests, each made by :func:`claim_test`, all in the
    report's Holm family; the line's measure text); or ``line(report)`` -> the whole line, graded by a rule of
    its own outside the family (capacity). ``nulls``: the nulls its measure must beat; ``min_effect``: by how
    much. The analyses that feed it name it in their record (``llmprobe.analyses.record.Analysis.claims``)."""

    claim: str
    tests: Callable[[dict], tuple[list[dict], str]] | None = None
    line: Callable[[dict], dict] | None = None
    nulls: tuple[str, ...] = ()
    min_effect: float | None = None

    def __post_init__(self):
        if (self.tests is None) == (self.line is None):
            raise ValueError(f"claim line {self.claim!r}: give tests or line, one of them")
        if self.tests is not None and (not self.nulls or self.min_effect is None):
            raise ValueError(f"claim line {self.claim!r}: a tested line needs its nulls and minimal effect")


CLAIM_LINES: list[ClaimLine] = [
    ClaimLine(DECODABLE, _decodable, nulls=NULLS[DECODABLE], min_effect=MIN_EFFECT[DECODABLE]),
    ClaimLine(CAUSAL, _causal, nulls=NULLS[CAUSAL], min_effect=MIN_EFFECT[CAUSAL]),
    ClaimLine(SUPERPOSITION, _superposition, nulls=NULLS[SUPERPOSITION], min_effect=MIN_EFFECT[SUPERPOSITION]),
    ClaimLine(SERVES, _serves, nulls=NULLS[SERVES], min_effect=MIN_EFFECT[SERVES]),
    ClaimLine(SELECTOR, _selector, nulls=NULLS[SELECTOR], min_effect=MIN_EFFECT[SELECTOR]),
    ClaimLine(MULTIHOP, _multihop, nulls=NULLS[MULTIHOP], min_effect=MIN_EFFECT[MULTIHOP]),
    ClaimLine(CAPACITY, line=lambda report: capacity_line(report)),
]   # the block's order


def register_line(line: ClaimLine) -> ClaimLine:
    """Add ``line`` at the end of the claims block (docs/CONTRACTS.md, "How to add an analysis"); ValueError if
    its claim is taken. :func:`unregister_line` takes it out again."""
    if any(other.claim == line.claim for other in CLAIM_LINES):
        raise ValueError(f"claim line {line.claim!r} already registered")
    CLAIM_LINES.append(line)
    if line.tests is not None:
        NULLS[line.claim], MIN_EFFECT[line.claim] = line.nulls, line.min_effect
    return line


def unregister_line(line: ClaimLine) -> None:
    """Take a line added by :func:`register_line` out of the block."""
    CLAIM_LINES.remove(line)
    NULLS.pop(line.claim, None)
    MIN_EFFECT.pop(line.claim, None)


def claims_block(report: dict) -> dict:
    """The claims block of a pretrained report: ``rule`` (``VERDICT_RULE``), ``alpha``, ``n_tests`` (the Holm
    family), ``lines`` (one per line of ``CLAIM_LINES``: measure, relation and layer shown, number, null,
    difference with its interval, minimal effect, Holm-adjusted p, verdict, counts per grade, comparison, note)
    and ``tests`` (every test, graded). A claim whose data the report lacks says "not measured"."""
    built = {line.claim: line.tests(report) for line in CLAIM_LINES if line.tests is not None}
    tests = [test for line_tests, _ in built.values() for test in line_tests]
    family = [t for t in tests if not t["missing_nulls"]]
    for key in ("p", "p_zero"):
        for test, adjusted in zip(family, holm([t[key] for t in family])):
            test[key + "_holm"] = adjusted
    for test in tests:                   # power at Holm's strictest step: alpha over the family's size
        if test["difference"] is not None:
            test["power"] = power(test["difference"], test["min_effect"], ALPHA / max(len(family), 1))
        test["grade"] = _grade(test)
    lines = [_line(line.claim, built[line.claim][1], built[line.claim][0]) if line.tests is not None else
             line.line(report) for line in CLAIM_LINES]
    return {"rule": VERDICT_RULE, "alpha": ALPHA, "n_tests": len(family), "lines": lines,
            "tests": tests}


def summary_claims(report: dict) -> list[dict]:
    """The lines of :func:`claims_block`: one per claim of the paper, each with its verdict."""
    return claims_block(report)["lines"]


def _number(m: dict | None) -> str:
    if not m or m.get("value") is None:
        return "-"
    ci = m.get("ci")
    return f"{m['value']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci[:2] else "")


def claims_text(block: dict) -> str:
    """The claims block as terminal text: one line per claim (verdict, number, null, difference, comparison)."""
    out = [f"Claims ({block['n_tests']} tests, Holm at one-sided {block['alpha']:g}; rule: docs/measures.md, "
           "Verdicts):"]
    for line in block["lines"]:
        text = f"  {line['claim']}: {line['verdict']}"
        if line["metric"]:
            where = " ".join(filter(None, [line["relation"] if line["relation"] != "all relations" else None,
                                           f"layer {line['layer']}" if line["layer"] is not None else None]))
            text += f" -- {where + ': ' if where else ''}{_number(line['metric'])}"
        if line["null"]:
            text += f" vs {line['null_name']} {_number(line['null'])}, difference {_number(line['difference'])}"
        if line["min_effect"] is not None and line["p_holm"] is not None:
            text += f" (minimal effect {line['min_effect']:g}, Holm p {line['p_holm']:.2g})"
        if line["comparison"]:
            text += f"; {line['comparison']['word']} {line['comparison']['name']} {_number(line['comparison']['metric'])}"
        out.append(text + (f" [{line['note']}]" if line["note"] else ""))
    return "\n".join(out)
