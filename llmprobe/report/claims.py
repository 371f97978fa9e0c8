"""The summary of a pretrained report: one line per claim of the paper, each with its number, its control and the
verdict of the stated rule (``VERDICT_RULE``). Decides what a line says; draws and renders nothing."""
from __future__ import annotations

import math

from llmprobe.metric import Metric, pooled, pooled_readout, wilson
from llmprobe.report.schema import control_sources, source_name

MIN_N = 10                                  # fewer test items than this: inconclusive, whatever the numbers
NOT_NULL = ("full_patch",)                  # controls that are ceilings, not null controls
CAPACITY_LAW = (0.177, 0.165, 0.191)        # d* = c R log2 N: c [95% CI] of the capacity sweep (docs/synthetic.md)
VERDICT_RULE = (
    "Verdicts (docs/measures.md, Verdicts): supported when the 95% interval lies above the control's interval "
    "(lower end above the control's upper end); not supported when the interval reaches the control's value or "
    "lies below it; inconclusive otherwise (it excludes the control's value but overlaps its interval) or with "
    f"fewer than {MIN_N} test items; not measured when the report has no such number. The control is the claim's "
    "strongest null control (the highest one; full_patch is a ceiling, not a null) unless the line names another. "
    "Capacity: supported when d* / (R log2 N) of the trainable control is at most the upper end of the capacity "
    f"sweep's law d* = {CAPACITY_LAW[0]} [{CAPACITY_LAW[1]}, {CAPACITY_LAW[2]}] R log2 N, not supported when it "
    "is above it with an exact d*, inconclusive when above it and d* is only an upper bound.")
CLAIMS = ("attributes linearly decodable", "LRE edits causal", "subject states a superposition of attribute vectors",
          "MLP a relation-conditioned selector", "capacity O(R log N) in the matched controls")


def verdict(metric: dict | None, control: dict | None) -> str:
    """The summary's rule (``VERDICT_RULE``) for a typed metric (JSON form) against its control."""
    if not metric or metric.get("value") is None:
        return "not measured"
    lo = (metric.get("ci") or [None])[0]
    if not control or control.get("value") is None or lo is None or (metric.get("n") or 0) < MIN_N:
        return "inconclusive"
    control_hi = (control.get("ci") or [None, None])[1]
    if lo > (control["value"] if control_hi is None else control_hi):
        return "supported"
    return "not supported" if lo <= control["value"] else "inconclusive"


def _strongest_null(metric: dict | None) -> tuple[str | None, dict | None]:
    """(name, metric) of the highest null control of a typed metric; (None, None) when it has none."""
    nulls = {k: c for k, c in ((metric or {}).get("controls") or {}).items()
             if k not in NOT_NULL and c and c.get("value") is not None}
    if not nulls:
        return None, None
    name = max(nulls, key=lambda k: nulls[k]["value"])
    return name, nulls[name]


def _claim(claim: str, measure: str, metric: dict | None, control_name: str | None = None,
           control: dict | None = None, note: str = "", result: str | None = None) -> dict:
    """One summary line: the claim, what its number is, the number and its control (typed metrics, JSON form),
    the verdict (``result`` overrides the rule, for the capacity line) and a note."""
    if control is None and metric is not None:
        control_name, control = _strongest_null(metric)
    return {"claim": claim, "measure": measure, "metric": metric, "control_name": control_name,
            "control": control, "verdict": result or verdict(metric, control), "note": note}


def pretrained_reference(report: dict, relations: list[str]) -> tuple[str, dict | None, dict | None] | None:
    """(layer, R^2, pooled readout over ``relations``) of the pretrained report's superposition readouts at the
    layer with the highest cross-fitted R^2; None when it has none."""
    layers = ((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}
    scored = {l: e for l, e in layers.items() if (e.get("r2") or {}).get("value") is not None}
    if not scored:
        return None
    layer = max(scored, key=lambda l: scored[l]["r2"]["value"])
    readout = {name: m for name, m in (scored[layer].get("readout") or {}).items() if name in relations}
    return layer, scored[layer]["r2"], pooled_readout(readout)


def summary_claims(report: dict) -> list[dict]:
    """One line per claim of the paper (``CLAIMS``) for a pretrained report, each with its verdict (``VERDICT_RULE``);
    a claim whose data the report lacks says "not measured"."""
    analyses = report.get("analyses") or {}
    superposition = (analyses.get("superposition") or {}).get("layers") or {}
    relations = sorted({n for e in superposition.values() for n in (e.get("readout") or {})})
    ref = pretrained_reference(report, relations)
    at = f"layer {ref[0]} (highest held-out R^2)" if ref else ""
    lines = [_claim(CLAIMS[0], f"superposition readout accuracy, pooled over relations, at {at}",
                    ref[2] if ref else None)]
    causal = {}
    for name, rel in (analyses.get("relations") or {}).items():
        layer = ((rel.get("selected") or {}).get("lre") or {}).get("causality_layer")
        if layer is not None:
            causal[name] = (((rel.get("layers") or {}).get(str(layer)) or {}).get("lre") or {}).get("causality")
    lines.append(_claim(CLAIMS[1], f"LRE causality (reference edit W^+ (o_t - o_s)) pooled over {len(causal)} "
                        "relations, each at its causality layer chosen on validation",
                        pooled(causal, "pooled over relations (each test pair once)")))
    sources = control_sources(report.get("controls"), report.get("schema_version"))
    trainable = [s for s in sources if not s.get("model", {}).get("frozen_subjects")]
    d_model = report.get("model", {}).get("d_model")
    same_width = next((s for s in trainable if s.get("model", {}).get("d_model") == d_model), None)
    control_r2 = ((((same_width or {}).get("analyses") or {}).get("superposition") or {}).get("layers") or {}) \
        .get("0", {}).get("r2")
    if control_r2 and control_r2.get("value") is not None:
        lines.append(_claim(CLAIMS[2], f"held-out R^2 of h_s ~ c + sum_r W_r u_a(s) at {at}", ref[1] if ref else None,
                            f"matched one-layer control at the same width (d={d_model})", control_r2))
    else:
        lines.append(_claim(CLAIMS[2], f"held-out R^2 of h_s ~ c + sum_r W_r u_a(s) at {at}", ref[1] if ref else None))
    at_star = next((s for s in trainable if (s.get("threshold") or {}).get("d_star") == s.get("model", {}).get(
        "d_model")), trainable[0] if trainable else None)
    transplant = (((at_star or {}).get("analyses") or {}).get("selector") or {}).get("gate_transplant") or {}
    n_facts = ((at_star or {}).get("matched_to") or {}).get("n_facts")
    if transplant.get("same_relation") is not None and transplant.get("same_subject") is not None and n_facts:
        as_metric = lambda v: Metric(v, wilson(v, n_facts), n_facts, "wilson").to_dict()
        lines.append(_claim(CLAIMS[3], f"matched control ({source_name(at_star)}): accuracy with another subject's "
                            "MLP gate of the same relation (not measured in the pretrained model)",
                            as_metric(transplant["same_relation"]), "gate of the same subject, another relation",
                            as_metric(transplant["same_subject"])))
    else:
        lines.append(_claim(CLAIMS[3], "MLP gate transplant in the matched controls", None))
    threshold = (at_star or {}).get("threshold") or {}
    table = (at_star or {}).get("matched_to") or {}
    n, r = table.get("n_subjects"), len(table.get("relations") or [])
    if threshold.get("d_star") and n and n > 1 and r:
        c = threshold["d_star"] / (r * math.log2(n))
        law = {"value": CAPACITY_LAW[0], "ci": list(CAPACITY_LAW[1:])}
        result = "supported" if c <= CAPACITY_LAW[2] else "not supported" if threshold.get("exact") else \
            "inconclusive"
        lines.append(_claim(CLAIMS[4], f"d* / (R log2 N) of the trainable control: d* = {threshold['d_star']}"
                            f"{'' if threshold.get('exact') else ' (upper bound)'}, N = {n}, R = {r}",
                            {"value": c, "ci": None, "n": None}, "the capacity sweep's law (docs/synthetic.md)",
                            law, "one table: consistent with the law or not; the scaling itself is measured by "
                            "llmprobe synth sweep", result))
    else:
        lines.append(_claim(CLAIMS[4], "threshold width d* of the matched controls", None))
    return lines
