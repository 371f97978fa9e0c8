"""Report export and comparison: escaping, tables, CSV rows, errors on bad input."""
import csv
import json

import pytest

from llmprobe.metric import Metric, paired_difference, proportion
from llmprobe.report.claims import CLAIMS, claims_block, claims_text, summary_claims
from llmprobe.report.render import (
    LONG_TABLE,
    compare,
    export,
    matched_rows,
    measured_differences,
    metric_rows,
    render_html,
    render_markdown,
)
from llmprobe.report.schema import REPORT_SCHEMA_VERSION, matched_sources, missing_stages, read_report
from llmprobe.report.sweeps import CAPACITY_SWEEP, capacity_scaling


def _typed(value, controls=None, half=0.05):
    """A typed metric (JSON form) with n=10 and the named controls."""
    def one(v):
        return Metric(v, (v - half, v + half), 10, "wilson")
    return one(value).with_nulls({k: one(v) for k, v in (controls or {}).items()}).to_dict()


def _report(tmp_path, name, relation="capital<script>", known=0.5):
    report = {
        "schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained",
        "model": {"name": name, "n_layers": 5, "architecture": "X"},
        "relations": {relation: {"n_facts": 10, "n_known": int(10 * known), "known_rate": known}},
        "analyses": {"relations": {relation: {"layers": {
            str(layer): {"lre": {"faithfulness": _typed(0.1 * layer, {"shuffled": 0.1})}} for layer in (0, 2, 4)}}}},
        "errors": ["fact ('<b>x</b>', 'y') skipped"],
    }
    folder = tmp_path / name.replace("/", "_")
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_metric_rows_flatten_layers_and_controls(tmp_path):
    rows = metric_rows(read_report(_report(tmp_path, "m")))
    layered = [r for r in rows if r["measure"] == "lre.faithfulness"]
    values, controls = layered[0::2], layered[1::2]             # each value row, then its control's row
    assert [r["layer"] for r in values] == [0, 2, 4] and [r["layer"] for r in controls] == [0, 2, 4]
    assert [r["depth"] for r in values] == [0.0, 0.5, 1.0]
    assert all(r["null"] is None for r in values)
    assert all(r["null"] == "shuffled" and r["value"] == 0.1 and r["hi"] == pytest.approx(0.15) for r in controls)
    assert values[2]["value"] == pytest.approx(0.4) and values[2]["hi"] == pytest.approx(0.45)
    known = [r for r in rows if r["measure"] == "known_rate"]
    assert known[0]["value"] == 0.5 and known[0]["n"] == 10


def test_export_escapes_user_strings_and_writes_all_formats(tmp_path):
    folder = _report(tmp_path, "evil<img src=x onerror=alert(1)>")
    written = export(folder)
    assert {p.name for p in written} == {"report.html", "report.md", "metrics.csv"}
    page = (folder / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<img src=x" not in page and "<b>x</b>" not in page
    assert page.count("data:image/png;base64,") == 1  # one metric plot
    with open(folder / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len([r for r in rows if not r["measure"].startswith("claim: ")]) == 1 + 3 * 2 and len(rows) == 7 + len(CLAIMS)


def test_compare_aligns_sources(tmp_path):
    a, b = _report(tmp_path, "model-a", known=0.2), _report(tmp_path, "model-b", known=0.8)
    compare([a, b], tmp_path / "cmp")
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "model-a" in text and "model-b" in text
    rows = list(csv.DictReader(open(tmp_path / "cmp" / "metrics.csv")))
    assert {r["source"] for r in rows} == {"model-a", "model-b"}


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no report.json"):
        read_report(tmp_path)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_report(tmp_path)
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(ValueError, match="schema_version"):
        read_report(tmp_path)
    with pytest.raises(ValueError, match="unknown report format"):
        export(_report(tmp_path, "ok"), formats=("pdf",))


def _metric(value, shuffled=0.0):
    return _typed(value, {"shuffled": shuffled}, half=0.1)


def test_run_page_shows_selected_layers_controls_capacity_and_ablations(tmp_path):
    """The validation-selected layer (not the best test layer) is what the decoder table shows; a run with
    matched controls gets the pretrained-vs-synthetic bars, the capacity curve and the ablation heatmaps."""
    layers = {str(l): {"lre": {"faithfulness": _metric(v), "causality": _metric(v - 0.1)}} for l, v in ((0, 0.9), (2, 0.4))}
    pretrained = {
        "schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "model": {"name": "m", "n_layers": 3},
        "relations": {"capital": {"n_facts": 10, "n_known": 5, "known_rate": 0.5}},
        "analyses": {"relations": {"capital": {"layers": layers, "selected": {"lre": {
            "layer": 2, "causality_layer": 2}}}},
                     "superposition": {"layers": {"1": {"r2": _metric(0.2), "readout": {"capital": _metric(0.5)}}}}},
        "errors": [],
    }
    control = {
        "schema_version": REPORT_SCHEMA_VERSION, "kind": "synthetic", "label": "synthetic trainable d=4 (d*)",
        "model": {"name": "synthetic trainable d=4 (d*)", "d_model": 4, "frozen_subjects": False},
        "threshold": {"d_star": 4, "tried": [{"d": 3, "success": False, "accuracy": 0.8, "steps": 10},
                                             {"d": 4, "success": True, "accuracy": 1.0, "steps": 9}]},
        "train": {"accuracy": 1.0, "steps": 9, "bits_per_param": 1.5},
        "analyses": {"superposition": {"layers": {"0": {"r2": _metric(0.7), "readout": {"capital": _metric(0.9)}}}},
                     "selector": {"relations": ["capital", "continent"], "ablation_drop": [[0.9, 0.1], [0.0, 0.8]],
                                  "random_ablation_drop": [[0.1, 0.0], [0.0, 0.1]],
                                  "gate_transplant": {"same_relation": 0.95, "same_subject": 0.1},
                                  "relation_gating": {"mean": 0.8}}},
        "errors": [],
    }
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({**pretrained, "matched": [control]}))
    compare([folder], tmp_path / "out")
    page = (tmp_path / "out" / "report.html").read_text()
    for caption in ("layer chosen on validation", "Pretrained vs synthetic", "Capacity of the matched controls",
                    "MLP ablations of the matched controls", "Matched synthetic controls"):
        assert caption in page
    text = (tmp_path / "out" / "report.md").read_text()
    selected = [line for line in text.splitlines() if line.startswith("| m | capital | lre")]
    assert selected == ["| m | capital | lre | 2 | 0.400 [0.30, 0.50] (n=10) | shuffled 0.000 | 2 | "
                        "0.300 [0.20, 0.40] (n=10) | shuffled 0.000 |"]
    assert "| synthetic trainable d=4 (d*) | 4 | 4 | 1.000 | 9 | 1.5 | 0.700 [0.60, 0.80] (n=10) |" in text


# ---------------------------------------------------------------------------------------------- the summary
def _prop(hits: int, n: int) -> dict:
    """A proportion (JSON form): ``hits`` of ``n`` items, Wilson interval."""
    return proportion([1.0] * hits + [0.0] * (n - hits)).to_dict()


def _with(metric: dict, controls: dict[str, dict]) -> dict:
    return Metric.from_dict(metric).with_nulls({k: Metric.from_dict(v) for k, v in controls.items()}).to_dict()


def _r2(value, lo, hi, controls=None) -> dict:
    """An R^2 (JSON form, n = 40 subjects) with the given controls {name: (value, lo, hi)}."""
    return _with(Metric(value, (lo, hi), 40, "bootstrap").to_dict(),
                 {k: Metric(*v[:1], v[1:], 40, "bootstrap").to_dict() for k, v in (controls or {}).items()})


R2_NULLS = {"shuffled": (0.0, -0.001, 0.001), "random_init": (0.0, -0.001, 0.001),
            "random_attributes": (0.0, -0.001, 0.001), "lexical": (0.0, -0.001, 0.001)}


def _claims_report(causal: dict[str, tuple] | None = None, superposition: dict | None = None, d_model=8,
                   controls: dict | None = None, relation="capital") -> dict:
    """A pretrained report. ``causal``: {relation: (hits, n, {control: (hits, n)})}, LRE causality at the causality
    layer 2 chosen on validation (faithfulness layer 1); ``superposition``: {layer: {"r2": metric, "readout":
    {relation: metric}}}; ``controls``: a report's controls block."""
    causal = {relation: (40, 50, {"scaled_patch": (0, 50), "random_direction": (1, 50), "random_operator": (2, 50)})
              } if causal is None \
        else causal
    relations = {name: {"layers": {"2": {"lre": {"causality": _with(_prop(h, n), {k: _prop(*v) for k, v in c.items()})}}},
                        "selected": {"lre": {"layer": 1, "causality_layer": 2}}} for name, (h, n, c) in causal.items()}
    report = {"schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained",
              "model": {"name": "m<i>", "n_layers": 3, "d_model": d_model},
              "relations": {relation: {"n_facts": 60, "n_known": 40, "known_rate": 2 / 3}},
              "analyses": {"relations": relations}, "errors": []}
    if superposition is not None:
        report["analyses"]["superposition"] = {"relations": [relation], "layers": superposition}
    if controls is not None:
        report["matched"] = controls
    return report


def _readout(hits, n=40, shuffled=4, random_init=4, lexical=4) -> dict:
    return _with(_prop(hits, n), {"shuffled": _prop(shuffled, n), "random_init": _prop(random_init, n),
                                  "lexical": _prop(lexical, n)})


def _line(report, claim):
    return next(line for line in summary_claims(report) if line["claim"] == claim)


@pytest.mark.parametrize("lre, controls, expected", [
    ((40, 50), {"scaled_patch": (3, 50), "random_direction": (1, 50), "random_operator": (2, 50),
                "full_patch": (50, 50)}, "supported"),
    ((40, 50), {"scaled_patch": (0, 50), "random_direction": (0, 50), "random_operator": (38, 50)},  # every null
     "inconclusive (low power)"),                     # counts; 50 pairs cannot show +0.10 over Holm: not "not shown"
    ((40, 50), {"scaled_patch": (38, 50), "random_direction": (0, 50), "random_operator": (0, 50)},
     "inconclusive (low power)"),                                                 # the step toward h_t counts too
    ((24, 50), {"scaled_patch": (0, 50), "random_direction": (0, 50), "random_operator": (12, 50)}, "weak"),
    ((5, 50), {"scaled_patch": (5, 50), "random_direction": (5, 50), "random_operator": (5, 50)},
     "inconclusive (low power)"),
    ((500, 5000), {"scaled_patch": (500, 5000), "random_direction": (500, 5000), "random_operator": (500, 5000)},
     "not shown"),                                                                                      # powered
    ((40, 50), {"scaled_patch": (1, 50), "random_direction": (1, 50)}, "null not measured"),  # no random_operator
])
def test_causality_is_graded_against_every_null_with_a_minimal_effect(lre, controls, expected):
    line = _line(_claims_report({"capital": (*lre, controls)}), "LRE edits causal")
    assert line["verdict"] == expected and line["layer"] == 2
    assert line["metric"]["n"] == lre[1] and line["metric"]["value"] == pytest.approx(lre[0] / lre[1])
    nulls = {k: v for k, v in controls.items() if k != "full_patch"}        # full_patch: a reference, not a null
    hardest = max(nulls, key=lambda k: nulls[k][0])
    assert line["null_name"] == hardest and line["null"]["value"] == pytest.approx(nulls[hardest][0] / lre[1])
    assert line["difference"]["value"] == pytest.approx((lre[0] - nulls[hardest][0]) / lre[1])
    if expected in ("inconclusive (low power)", "not shown"):
        assert (line["power"] < 0.8) == (expected == "inconclusive (low power)")
    assert line["difference"]["interval"] == "MOVER (unpaired)" and line["min_effect"] == 0.10
    if expected == "null not measured":
        assert line["missing_nulls"] == ["random_operator"] and "random_operator" in line["note"]
    if "full_patch" in controls:
        assert line["comparison"]["name"].startswith("the full patch") and line["comparison"]["word"] == "less than"


def test_a_small_r2_gain_is_weak_not_supported():
    """The review's planted R^2: 0.012 [0.008, 0.016] against nulls at 0 is an effect, below the minimal one."""
    report = _claims_report(superposition={"1": {"r2": _r2(0.012, 0.008, 0.016, R2_NULLS)}})
    line = _line(report, "subject states a superposition of attribute vectors")
    assert line["verdict"] == "weak" and line["min_effect"] == 0.018
    assert line["p_zero_holm"] < 0.025 < line["p_holm"]
    report = _claims_report(superposition={"1": {"r2": _r2(0.17, 0.15, 0.19, R2_NULLS)}})
    assert _line(report, "subject states a superposition of attribute vectors")["verdict"] == "supported"


def test_holm_over_relations_changes_a_borderline_verdict():
    """30/50 against a null of 15/50 clears +0.10 alone (one-sided p 0.022); among 12 relations it does not."""
    one = {"scaled_patch": (0, 50), "random_direction": (0, 50), "random_operator": (15, 50)}
    alone = _line(_claims_report({"capital": (30, 50, one)}), "LRE edits causal")
    many = _line(_claims_report({f"r{i}": (30, 50, one) for i in range(12)}), "LRE edits causal")
    assert (alone["verdict"], many["verdict"]) == ("supported", "weak")
    assert alone["p_holm"] == pytest.approx(0.022, abs=0.001) and many["p_holm"] == pytest.approx(12 * alone["p_holm"])
    assert many["counts"] == {"weak": 12} and "12 weak of 12 relations" in many["note"]
    block = claims_block(_claims_report({f"r{i}": (30, 50, one) for i in range(12)}))
    assert block["n_tests"] == 12 and len(block["tests"]) == 12


def test_a_claim_whose_null_is_missing_says_so():
    nulls = {k: v for k, v in R2_NULLS.items() if k != "random_attributes"}    # a report before random_attributes
    report = _claims_report({"capital": (40, 50, {})}, superposition={"1": {"r2": _r2(0.17, 0.15, 0.19, nulls)}})
    lines = summary_claims(report)
    assert lines[2]["verdict"] == "null not measured" and lines[2]["missing_nulls"] == ["random_attributes"]
    before = _claims_report(superposition={"1": {"r2": _r2(0.17, 0.15, 0.19, {k: v for k, v in R2_NULLS.items()
                                                                            if k != "lexical"})}})
    line = summary_claims(before)[2]                          # a report before the lexical null
    assert line["verdict"] == "null not measured" and line["missing_nulls"] == ["lexical"]
    assert "not measured: random_attributes" in lines[2]["note"]
    assert lines[1]["verdict"] == "null not measured" and lines[1]["missing_nulls"] == ["scaled_patch",
                                                                                          "random_direction",
                                                                                          "random_operator"]
    assert claims_block(report)["n_tests"] == 0               # a test without its nulls is not in the Holm family


def test_the_matched_control_is_a_comparison_not_the_null():
    """The pretrained R^2 beats its nulls; the matched control at the same width explains more: the verdict stays,
    the comparison says less than."""
    control = {"table": {"n_subjects": 40, "relations": ["capital"], "n_facts": 40, "bits": 100.0},
               "training": {"max_steps": 2000},
               "modes": {"trainable": {"threshold": {"d_star": 8, "exact": True},
                                       "points": [{"d": 8, "train": {"bits_per_param": 1.0},
                                                   "r2": _r2(0.5, 0.45, 0.55), "readout": {}}]}}}
    report = _claims_report(superposition={"1": {"r2": _r2(0.17, 0.15, 0.19, R2_NULLS)}}, controls=control)
    line = _line(report, "subject states a superposition of attribute vectors")
    assert line["verdict"] == "supported" and line["null_name"] in R2_NULLS
    assert line["comparison"]["word"] == "less than" and "at this width (d=8)" in line["comparison"]["name"]
    assert line["comparison"]["metric"]["value"] == 0.5


def test_superposition_layers_are_chosen_on_validation_not_on_the_numbers_shown():
    """The decoders chose layer 1 on validation; layer 2 has the higher R^2 and readout: the claims use layer 1."""
    layers = {"1": {"r2": _r2(0.12, 0.10, 0.14, R2_NULLS), "readout": {"capital": _readout(20)}},
              "2": {"r2": _r2(0.30, 0.28, 0.32, R2_NULLS), "readout": {"capital": _readout(38)}}}
    lines = summary_claims(_claims_report(superposition=layers))
    assert (lines[0]["metric"]["value"], lines[2]["metric"]["value"]) == (0.5, 0.12)
    assert lines[0]["layer"] == lines[2]["layer"] == 1
    assert "layer 1, the one most LRE decoders chose on validation" in lines[2]["measure"]


SELECTOR, SERVES, MULTIHOP = ("MLP a relation-conditioned selector", "one subject state serves every relation",
                              "chain-of-thought breaks the multi-hop bottleneck")


def _hits(k: int, n: int) -> list[float]:
    return [1.0] * k + [0.0] * (n - k)


def _selector_report(same: int, other: int, random: int, n=64, controls: dict | None = None) -> dict:
    """A pretrained report with a gate transplant (analyses.selector.gate_transplant) of ``n`` test facts:
    ``same``, ``other``, ``random`` of them answered with the same-relation gates, the other-relation gates and
    the random-units switch-off (the first hits of each list: paired items)."""
    hits = {"same": _hits(same, n), "other": _hits(other, n), "random": _hits(random, n)}
    same_m, other_m, random_m = (proportion(hits[k]) for k in ("same", "other", "random"))
    transplant = {"block": [3, 4, 5], "n_items": n, "clean": proportion(_hits(n, n)).to_dict(),
                  "same_relation": same_m.with_nulls({"other_relation_gate": other_m,
                                                         "random_units": random_m}).to_dict(),
                  "other_relation": other_m.with_nulls({"random_units": random_m}).to_dict(),
                  "random_units": random_m.to_dict(),
                  "same_minus_other": paired_difference(hits["same"], hits["other"]).to_dict(),
                  "random_minus_other": paired_difference(hits["random"], hits["other"]).to_dict()}
    report = _claims_report(controls=controls)
    report["analyses"]["selector"] = {"relations": ["capital"], "gate_transplant": transplant}
    return report


MATCHED_SELECTOR = {"table": {"n_subjects": 40, "relations": ["capital"], "n_facts": 80, "bits": 100.0},
                    "training": {"max_steps": 2000},
                    "modes": {"trainable": {"threshold": {"d_star": 8, "exact": True},
                                            "points": [{"d": 8, "train": {"bits_per_param": 1.0}, "readout": {},
                                                        "selector": {"gate_transplant": {"same_relation": 1.0,
                                                                                         "same_subject": 0.0}}}]}}}


@pytest.mark.parametrize("same, other, random, expected", [
    (64, 0, 60, "supported"),       # another relation's gates break every answer, a random edit of their size few
    (64, 0, 0, "inconclusive (low power)"),   # as much broken by random units, on a paired interval of [-1, 1]
    (64, 15, 18, "not shown"),      # SmolLM2's measured sizes: other relation keeps 0.23, random units 0.28
    (64, 0, 10, "weak"),            # breaks more than the random edit, not shown to by +0.10
])
def test_the_selector_line_is_measured_on_the_model_against_random_units(same, other, random, expected):
    line = _line(_selector_report(same, other, random, controls=MATCHED_SELECTOR), SELECTOR)
    assert line["verdict"] == expected and line["null_name"] == "random_units" and line["min_effect"] == 0.10
    assert line["metric"]["value"] == pytest.approx(1 - other / 64)          # the fraction the other gates break
    assert line["null"]["value"] == pytest.approx(1 - random / 64)
    assert line["difference"]["interval"] == "paired bootstrap"
    assert line["difference"]["value"] == pytest.approx((random - other) / 64)
    assert "layers 3-5 (the block chosen on validation facts)" in line["measure"]
    assert line["comparison"]["metric"]["value"] == 1.0 and "the matched control" in line["comparison"]["name"]


def _calibrated_selector_report(same: int, other: int, matched: int, n=64, controls: dict | None = None) -> dict:
    """A pretrained report whose gate transplant has the calibrated keep test (``selector_keep``): ``same``,
    ``other``, ``matched`` of ``n`` test facts kept under the same-relation gates, the other-relation gates and
    the switch-off matched in count and norm (paired: the first hits of each list), ``random_units`` as matched."""
    import torch

    from llmprobe.analyses.selector import transplant_metrics
    hits = {"clean": torch.ones(n, dtype=torch.bool),
            **{k: torch.tensor(_hits(v, n)).bool() for k, v in (("same_relation", same), ("other_relation", other),
                                                                 ("random_units", matched),
                                                                 ("random_units_matched", matched))}}
    report = _claims_report(controls=controls)
    report["analyses"]["selector"] = {"relations": ["capital"], "gate_transplant": {
        "block": [3, 4, 5], "n_items": n, **transplant_metrics(hits, 1000, 0)}}
    return report


@pytest.mark.parametrize("same, other, matched, expected", [
    (64, 0, 0, "supported"),        # the construction: kept by every other subject's gates, broken by the rest
    (63, 18, 20, "supported"),      # SmolLM2's sizes (same 0.98, other 0.28, random units 0.31)
    (50, 60, 1, "inconclusive (low power)"),   # subject-keyed gates: r' of s keeps more than r of s'
    (5, 3, 2, "not shown"),         # a key-value memory: another subject's gates break the answer
    (14, 4, 3, "weak"),             # above both nulls, not shown to be by +0.10
])
def test_the_calibrated_selector_line_keeps_against_both_nulls(same, other, matched, expected):
    line = _line(_calibrated_selector_report(same, other, matched, controls=MATCHED_SELECTOR), SELECTOR)
    assert line["verdict"] == expected and line["min_effect"] == 0.10 and line["missing_nulls"] == []
    assert line["metric"]["value"] == pytest.approx(same / 64)                # the same-relation keep rate
    assert line["null_name"] in ("other_relation_gate", "random_units_matched")
    assert "kept with another subject's MLP gates of the same relation" in line["measure"]
    assert f"the subject's own gates of another relation keep {other / 64:.2f}" in line["measure"]
    assert line["comparison"]["metric"]["value"] == 1.0                       # the control's same-relation keep


def test_a_perfect_selectors_widened_paired_interval_gives_way_to_mover():
    """Every item kept by the same-relation gates and lost by the other-relation ones: the paired bootstrap has
    no spread and is widened to [-1, 1]; the difference then comes from the two Wilson intervals (MOVER)."""
    report = _calibrated_selector_report(64, 0, 0)
    transplant = report["analyses"]["selector"]["gate_transplant"]
    assert transplant["same_minus_other"]["ci"] == [-1.0, 1.0]
    line = _line(report, SELECTOR)
    assert line["difference"]["interval"] == "MOVER (unpaired)" and line["difference"]["ci"][0] > 0.85
    assert line["verdict"] == "supported"


def test_the_gate_transplant_is_shown_per_relation_beside_the_pooled_line(tmp_path):
    """The selector line pools the transplant's test facts; the report also shows each relation's share (the
    same metrics on its own facts, from analyses.selector.gate_transplant.by_relation), one with too few facts
    with its count and why it has no numbers."""
    import torch

    from llmprobe.analyses.selector import transplant_metrics
    planted = {"capital": (10, 9, 1, 8), "language": (10, 10, 9, 9)}    # n, same, other, random kept
    by_relation = {}
    for name, (n, same, other, random) in planted.items():
        hits = {"clean": torch.ones(n, dtype=torch.bool),
                **{k: torch.tensor(_hits(v, n)).bool() for k, v in
                   (("same_relation", same), ("other_relation", other), ("random_units", random))}}
        by_relation[name] = {"n_items": n, **transplant_metrics(hits, 200, 0), "error": None}
    by_relation["demonym"] = {"n_items": 2, "error": "2 test facts; its own numbers need at least 5"}
    report = _selector_report(19, 10, 17, n=22)
    report["analyses"]["selector"]["gate_transplant"]["by_relation"] = by_relation
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    text = render_markdown([read_report(path)], "t")
    rows = {line.split(" | ")[1]: line for line in text.splitlines()
            if line.startswith("| ") and "MLP gate transplant" not in line and " | 3-5 | " in line}
    assert set(rows) == {"capital", "language", "demonym"}
    assert "| 0.100 [" in rows["capital"] and "| 0.800 [" in rows["capital"] and "+0.700 [" in rows["capital"]
    assert "+0.000 [" in rows["language"] or "-0.000 [" in rows["language"]
    assert "2 test facts; its own numbers need at least 5" in rows["demonym"]
    assert "MLP gate transplant per relation" in text


def test_the_matched_control_alone_does_not_measure_the_selector():
    """An old report: the matched control's transplant only. The line is not measured, not the control's verdict."""
    report = _claims_report(controls=MATCHED_SELECTOR)
    assert _line(report, SELECTOR)["verdict"] == "not measured" and claims_block(report)["n_tests"] == 1
    report = _claims_report()
    report["analyses"]["selector"] = {"gate_transplant": {"error": "too few known facts with a donor"}}
    assert _line(report, SELECTOR)["verdict"] == "not measured"


def _crosspatch_report(layers: dict[int, tuple]) -> dict:
    """A pretrained report with a crosspatch of 45 items: {layer: (neutral, same_relation, random_subject,
    random_vector) hits}; the LRE decoder chose layer 1 on validation (``_claims_report``)."""
    report = _claims_report()
    entries = {}
    for layer, (neutral, same, subject, vector) in layers.items():
        controls = {"random_subject": Metric.from_dict(_prop(subject, 45)),
                    "random_vector": Metric.from_dict(_prop(vector, 45))}
        entries[str(layer)] = {"neutral": Metric.from_dict(_prop(neutral, 45)).with_nulls(controls).to_dict(),
                               "same_relation": _prop(same, 45), "random_subject": _prop(subject, 45),
                               "random_vector": _prop(vector, 45)}
    report["analyses"]["crosspatch"] = {"relations": ["capital"], "n_items": 45, "layers": entries}
    return report


def test_one_state_serves_every_relation_at_the_layer_chosen_on_validation():
    """Layer 2 has the best neutral patch; the LRE decoder chose layer 1 on validation: the line uses layer 1."""
    line = _line(_crosspatch_report({1: (36, 40, 2, 1), 2: (44, 44, 2, 1)}), SERVES)
    assert (line["layer"], line["verdict"], line["null_name"]) == (1, "supported", "random_subject")
    assert line["metric"]["value"] == pytest.approx(36 / 45) and "layer 1, the one most" in line["measure"]
    assert line["comparison"]["word"] == "as much as" and line["comparison"]["metric"]["value"] == pytest.approx(40 / 45)
    assert line["comparison"]["difference"]["interval"] == "MOVER (unpaired)"
    report = _crosspatch_report({1: (36, 40, 2, 1), 2: (44, 44, 2, 1)})      # the paired difference decides the word
    report["analyses"]["crosspatch"]["layers"]["1"]["neutral_minus_same"] = {"value": -4 / 45, "ci": [-0.16, -0.02],
                                                                             "n": 45, "interval": "bootstrap"}
    comparison = _line(report, SERVES)["comparison"]
    assert (comparison["word"], comparison["difference"]["interval"]) == ("less than", "paired bootstrap")
    line = _line(_crosspatch_report({1: (36, 40, 2, 34), 2: (44, 44, 2, 1)}), SERVES)
    assert (line["verdict"], line["null_name"]) == ("inconclusive (low power)", "random_vector")  # every null counts
    assert _line(_claims_report(), SERVES)["verdict"] == "not measured"


def _multihop_report(cot: int, direct: int, ceiling: int, n=60) -> dict:
    """A pretrained report with the 2-hop chains pooled (analyses.multihop.pooled["k=2"]) of ``n`` known chains."""
    hits = {"cot": _hits(cot, n), "direct": _hits(direct, n), "ceiling": _hits(ceiling, n)}
    entry = {"n_items": n, **{k: proportion(v).to_dict() for k, v in hits.items()},
             "cot_minus_direct": paired_difference(hits["cot"], hits["direct"]).to_dict()}
    report = _claims_report()
    one = {"name": "a/b", "hops": ["a", "b"], "k": 2, **entry,    # one composition; every answer its own (majority)
           "cot": proportion(hits["cot"]).with_nulls({"majority": proportion(_hits(1, n))}).to_dict()}
    report["analyses"]["multihop"] = {"compositions": [one], "pooled": {"k=2": entry}}
    return report


@pytest.mark.parametrize("cot, direct, expected", [(40, 10, "supported"), (22, 20, "not shown"),
                                                   (20, 40, "inconclusive (low power)")])
def test_chain_of_thought_is_graded_against_the_direct_answer_to_the_same_chains(cot, direct, expected):
    line = _line(_multihop_report(cot, direct, 50), MULTIHOP)
    assert (line["verdict"], line["relation"], line["null_name"]) == (expected, "k=2", "direct")
    assert line["difference"]["interval"] == "paired bootstrap"
    assert line["difference"]["value"] == pytest.approx((cot - direct) / 60)
    assert line["comparison"]["name"].startswith("the ceiling") and line["comparison"]["metric"]["value"] == 50 / 60
    assert _line(_claims_report(), MULTIHOP)["verdict"] == "not measured"


def _capacity_report(n=193, r=6, steps=2000, d_star=3, exact=True, joint=5019.0) -> dict:
    """A report whose trainable control has d* = ``d_star`` on an n x r table (every subject has every fact) with
    5425.6 bits summed over relations (``joint``: counted jointly; None: an older report without it), 2499
    trainable parameters at d*, and a frozen control at d* = 8."""
    table = {"n_subjects": n, "relations": [f"r{i}" for i in range(r)], "n_facts": n * r, "bits": 5425.6}
    if joint is not None:
        table["bits_joint"] = joint
    control = {"table": table, "training": {"max_steps": steps},
               "modes": {"trainable": {"threshold": {"d_star": d_star, "exact": exact}, "points": [
                   {"d": d_star, "train": {"bits_per_param": 2.171, "n_trainable": 2499}, "readout": {}}]},
                         "frozen": {"threshold": {"d_star": 8, "exact": True}, "points": [
                             {"d": 8, "train": {"bits_per_param": 0.94, "n_trainable": 5760}, "readout": {}}]}}}
    return _claims_report(controls=control)


@pytest.mark.parametrize("d_star, word", [(3, "fewer dimensions than"), (5, "as many dimensions as"),
                                          (7, "more dimensions than")])
def test_the_capacity_line_is_graded_from_the_sweep_beside_random_maps_of_the_tables_shape(d_star, word):
    """The verdict is the sweep's scaling (trainable d* against R log2 N and the key-value memories), the same for
    any one table; the table's d* stands beside the random maps of its shape (193 x 6, 2000 steps: d* 5, 5) and
    its number is its joint bits per trainable parameter at d*."""
    line = _line(_capacity_report(d_star=d_star), "capacity O(R log N) in the matched controls")
    scaling = capacity_scaling(CAPACITY_SWEEP)
    assert line["verdict"] == scaling["trainable"]["verdict"] == "supported"
    assert line["scaling"]["frozen"]["verdict"] == scaling["frozen"]["verdict"] == "not shown"
    assert line["metric"]["value"] == pytest.approx(5019.0 / 2499)
    assert "table bits 5019 counted jointly (sum over relations 5425.6)" in line["measure"]
    assert line["comparison"]["word"] == word and line["comparison"]["metric"]["value"] == 5.0
    assert line["comparison"]["difference"]["value"] == d_star - 5
    assert f"this table: d* = {d_star}: {word} random maps of its shape (d* 5, 5)" in line["note"]
    assert "one table cannot test a scaling law" in line["note"] and "frozen not shown" in line["note"]
    assert f"frozen d* 8 = {8 / d_star:.1f}x (one table, not graded)" in line["note"]


def test_the_capacity_line_of_an_older_report_or_another_shape():
    """A report without joint bits reads the per-relation sum and says so; a table of a shape the sweep has no
    random maps of gets no comparison, and a report without a trainable control is not measured."""
    older = _line(_capacity_report(joint=None), "capacity O(R log N) in the matched controls")
    assert older["metric"]["value"] == pytest.approx(5425.6 / 2499)
    assert "(sum over relations; joint not recorded in this report)" in older["measure"]
    other = _line(_capacity_report(n=100), "capacity O(R log N) in the matched controls")
    assert other["comparison"] is None and "no random-map cell of this table's shape (100 subjects x 6" in other["note"]
    assert other["verdict"] == "supported"
    assert _line(_claims_report(), "capacity O(R log N) in the matched controls")["verdict"] == "not measured"


def test_summary_says_not_measured_where_the_report_has_no_data():
    lines = summary_claims(_claims_report())
    assert [line["verdict"] for line in lines] == ["not measured", "supported"] + ["not measured"] * (len(CLAIMS) - 2)
    text = claims_text(claims_block(_claims_report()))
    assert "LRE edits causal: supported -- capital layer 2: 0.800" in text and "(1 tests, Holm" in text


def test_summary_comes_first_in_html_and_markdown_and_escapes_user_strings(tmp_path):
    report = _claims_report({"<script>alert(1)</script>": (40, 50, {"scaled_patch": (0, 50), "random_direction": (1, 50),
                                                                    "random_operator": (2, 50)})},
                            superposition={"1": {"r2": _r2(0.17, 0.15, 0.19, R2_NULLS),
                                                 "readout": {"<script>alert(1)</script>": _readout(30)}}},
                            relation="<script>alert(1)</script>")
    page = render_html([report], "t")
    body = page.split("<body>", 1)[1]
    assert body.startswith("<section id='summary'>") and body.index("</section>") < body.index("<img")
    assert "<script>" not in page and "&lt;script&gt;" in page and "<i>" not in page
    assert "Holm-adjusted over all tests" in page
    assert page.count("class='verdict supported'") == 3 and page.count("class='verdict not-measured'") == len(CLAIMS) - 3
    text = render_markdown([report], "t")
    assert text.index("## Summary: the paper's claims") < text.index("## Sources")
    assert "| LRE edits causal |" in text and "<script>" not in text


def test_metrics_csv_has_one_row_per_claim(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(_claims_report()))
    export(folder, formats=("csv",))
    rows = [r for r in csv.DictReader(open(folder / "metrics.csv")) if r["measure"].startswith("claim: ")]
    assert [r["verdict"] for r in rows] == ["not measured", "supported"] + ["not measured"] * (len(CLAIMS) - 2)
    causal = rows[1]
    assert causal["measure"] == "claim: LRE edits causal" and causal["relation"] == "capital" and causal["layer"] == "2"
    assert float(causal["value"]) == 0.8 and causal["hardest_null"] == "random_operator" and causal["n_tests"] == "1"
    assert causal["null"] == "" and float(causal["hardest_null_value"]) == pytest.approx(0.04)
    assert float(causal["difference"]) == pytest.approx(0.76) and float(causal["difference_lo"]) > 0.1
    assert causal["min_effect"] == "0.1" and float(causal["p_holm"]) < 0.025


def test_long_tables_fold_into_details():
    report = _claims_report()
    report["relations"] = {f"r{i}": {"n_facts": 10, "n_known": 5, "known_rate": 0.5} for i in range(LONG_TABLE + 1)}
    page = render_html([report], "t")
    assert f"<details><summary>{LONG_TABLE + 1} rows" in page
    report["relations"] = {f"r{i}": {"n_facts": 10, "n_known": 5, "known_rate": 0.5} for i in range(LONG_TABLE)}
    assert "<details><summary>" not in render_html([report], "t")


# ------------------------------------------------------------------------------ presentation (issue 25)
def page_report(name, relations, n_layers=4, widths=(4, 8, 16, 32), n_facts=30, n_boot=100):
    """A finished ``run`` report of model folder ``name``: per relation and layer LRE faithfulness and causality,
    superposition R^2 and readouts per layer, and a controls block of both modes at ``widths`` (d* the first),
    each point with readouts and MLP ablations. Numbers are made up but every one has its interval and n."""
    def m(value, **controls):
        return _typed(value, controls, half=0.05)

    layers = {str(l): {"lre": {"faithfulness": m(0.2 + 0.1 * l, shuffled=0.1),
                               "causality": m(0.1 + 0.05 * l, random_direction=0.02)}} for l in range(n_layers)}
    relation_entries = {r: {"layers": layers, "selected": {"lre": {"layer": 1, "causality_layer": 2}}}
                        for r in relations}
    superposition = {str(l): {"r2": m(0.1 + 0.05 * l, shuffled=0.0), "readout": {r: m(0.3 + 0.02 * i + 0.05 * l,
                                                                                        shuffled=0.1)
                                                                              for i, r in enumerate(relations)}}
                     for l in range(n_layers)}
    k = len(relations)

    def point(d, mode):
        drop = [[0.9 if i == j else 0.1 for j in range(k)] for i in range(k)]
        fall = 1 / (1 + d / widths[-1])                       # readouts fall with width, from 1 to 1/2
        return {"d": d, "d_over_dstar": d / widths[0], "d_mlp": 4 * d, "r2": m(0.8 * fall, shuffled=0.0),
                "readout": {r: m(0.9 * fall) for r in relations}, "readout_mean": m(0.9 * fall),
                "train": {"accuracy": 1.0, "steps": 100, "bits_per_param": 1.6},
                "selector": {"relations": list(relations), "ablation_drop": drop, "random_ablation_drop": drop,
                             "gate_transplant": {"same_relation": 0.9, "same_subject": 0.1},
                             "relation_gating": {"mean": 0.8}}}

    block = {"compared_with": "made-up controls", "place": "e_s", "d_model": widths[-1],
             "table": {"n_subjects": n_facts, "relations": list(relations), "n_facts": n_facts * k, "bits": 100.0},
             "training": {"max_steps": 500},
             "modes": {mode: {"threshold": {"d_star": widths[0], "exact": True},
                              "points": [point(d, mode) for d in widths]} for mode in ("trainable", "frozen")}}
    return {"schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "partial": False,
            "model": {"name": name, "n_layers": n_layers, "d_model": widths[-1], "architecture": "X"},
            "dataset": {"relations": list(relations)},
            "relations": {r: {"n_facts": n_facts, "n_known": n_facts // 2, "known_rate": 0.5} for r in relations},
            "settings": {"command": "run", "run": {"analyses": ["lre", "superposition"], "layers": "all", "seed": 0,
                                                   "max_facts": n_facts},
                         "analysis": {"n_boot": n_boot, "folds": 3}, "matched": {"enabled": True, "max_steps": 500}},
            "stages": {s: {"key": "k", "done": True, "resumed": False} for s in ("known_facts", "analyses", "matched")},
            "analyses": {"relations": relation_entries, "superposition": {"relations": list(relations),
                                                                          "layers": superposition}},
            "matched": block, "errors": []}


def write_report(folder, report):
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_a_partial_report_says_at_the_top_which_stages_are_missing(tmp_path):
    """An interrupted run: the known facts done, the analyses cut after one of three relations (no superposition),
    the controls never finished. The page and the Markdown say so first, one line per missing stage."""
    report = page_report("/runs/models/tiny", ["capital", "continent", "language"])
    report.update(partial=True, errors=["interrupted during analyses, controls: ..."])
    report["stages"]["analyses"]["done"] = report["stages"]["matched"]["done"] = False
    del report["matched"], report["analyses"]["superposition"]
    for relation in ("continent", "language"):
        del report["analyses"]["relations"][relation]
    folder = write_report(tmp_path / "run", report)
    export(folder)
    page = (folder / "report.html").read_text()
    banner = page[page.index("class='partial'"):page.index("Summary: the paper")]
    items = banner.split("<li>")[1:]
    assert len(items) == 2
    assert items[0].startswith("analyses not finished: decoders done for 1 of 3 relations (done: capital); superposition "
                               "readouts missing")
    assert items[1].startswith("matched controls not finished: no matched synthetic models")
    text = (folder / "report.md").read_text()
    assert text.index("**Partial report**") < text.index("## Summary") and "- analyses not finished" in text
    report["stages"].pop("matched")                      # never started: still named, as not started
    assert [line.split(":")[0] for line in missing_stages(report)] == ["analyses not finished", "matched controls not started"]
    finished = write_report(tmp_path / "done", page_report("/runs/models/tiny", ["capital"]))
    export(finished)
    assert "Partial report" not in (finished / "report.html").read_text()


def test_the_compare_page_puts_claims_side_by_side_and_warns_of_every_difference(tmp_path):
    """Two runs that measured different relations, facts and bootstrap settings: short names in the title (no
    synthetic widths, no paths), one column per model in the summary (its path on hover), and one warning line
    per difference; two runs of the same measurement warn of nothing."""
    a = write_report(tmp_path / "a", page_report("/data/models/llama-tiny", ["capital", "continent", "subregion"]))
    b = write_report(tmp_path / "b", page_report("/data/models/qwen-tiny", ["capital", "continent", "language"],
                                                 n_facts=20, n_boot=500))
    compare([a, b], tmp_path / "cmp")
    page = (tmp_path / "cmp" / "report.html").read_text()
    title = page[page.index("<h1>") + 4:page.index("</h1>")]
    assert title == "llmprobe comparison: llama-tiny vs qwen-tiny (and 16 matched synthetic controls)"
    summary = page[page.index("<section id='summary'>"):page.index("</section>")]
    head = summary[summary.index("<thead>"):summary.index("</thead>")]
    assert head == ("<thead><tr><th>claim</th><th title='/data/models/llama-tiny'>llama-tiny</th>"
                    "<th title='/data/models/qwen-tiny'>qwen-tiny</th></tr>")
    body = summary[summary.index("<tbody>"):summary.index("</tbody>")]
    assert body.count("<tr>") == len(CLAIMS) and all(row.count("<td") == 3 for row in body.split("<tr>")[1:])
    warnings = [w.split("</li>")[0] for w in summary.split("<li class='warn'>")[1:]]
    assert warnings == [
        "relations differ: in all: capital, continent; only in llama-tiny: subregion; only in qwen-tiny: language",
        "facts differ: capital has 30 vs 20 facts; continent has 30 vs 20 facts (llama-tiny vs qwen-tiny)",
        "run.max_facts differ: llama-tiny: 30; qwen-tiny: 20",
        "analysis.n_boot differ: llama-tiny: 100; qwen-tiny: 500",
        "matched controls differ: llama-tiny: trainable d = 4, 8, 16, 32; frozen d = 4, 8, 16, 32 on 30 subjects x 3 "
        "relations (90 facts); qwen-tiny: trainable d = 4, 8, 16, 32; frozen d = 4, 8, 16, 32 on 20 subjects x 3 "
        "relations (60 facts)"]
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "| claim | llama-tiny | qwen-tiny |" in text and "- relations differ: in all: capital" in text
    same = write_report(tmp_path / "c", page_report("/other/llama-tiny", ["capital", "continent", "subregion"]))
    compare([a, same], tmp_path / "same")
    page = (tmp_path / "same" / "report.html").read_text()
    assert "class='warn'" not in page and "<th title='/other/llama-tiny'>llama-tiny (c)</th>" in page
    probed = page_report("/data/models/probe-tiny", ["capital", "continent", "subregion"])   # a probe: no matched
    probed["settings"]["command"], probed["settings"]["matched"] = "probe", None
    probed.pop("matched")
    lines = measured_differences([read_report(a), read_report(write_report(tmp_path / "p", probed))])
    assert [line for line in lines if line.startswith("matched")] == [
        "matched controls differ: llama-tiny: trainable d = 4, 8, 16, 32; frozen d = 4, 8, 16, 32 on 30 subjects x 3 "
        "relations (90 facts); probe-tiny: none"], lines          # once, not once per matched setting


def test_metrics_csv_and_to_frame_share_one_tidy_schema(tmp_path):
    """metrics.csv and Report.to_frame have the same columns (``measure``, not ``metric``); a measure's value row
    and each control's row are distinct: the control row holds the control's own value, interval and n."""
    pd = pytest.importorskip("pandas")
    from llmprobe.report.notebook import Report
    from llmprobe.report.render import CLAIM_FIELDS
    from llmprobe.report.schema import ROW_FIELDS

    folder = write_report(tmp_path / "run", page_report("/m/tiny", ["capital"]))
    export(folder, formats=("csv",))
    with open(folder / "metrics.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == ROW_FIELDS + CLAIM_FIELDS
    at = [r for r in rows if r["source"] == "tiny" and r["measure"] == "lre.faithfulness" and r["layer"] == "3"]
    assert [(r["null"], float(r["value"]), float(r["hi"])) for r in at] == [
        ("", pytest.approx(0.5), pytest.approx(0.55)), ("shuffled", 0.1, pytest.approx(0.15))]
    frame = Report(read_report(folder)).to_frame()
    assert tuple(frame.columns) == ROW_FIELDS and len(frame) == len([r for r in rows if not r["verdict"]])
    at = frame[(frame.source == "tiny") & (frame.measure == "lre.faithfulness") & (frame.layer == 3)]
    assert at.null.isna().tolist() == [True, False] and at.null.iloc[1] == "shuffled"
    assert at.value.tolist() == pytest.approx([0.5, 0.1]) and at.hi.tolist() == pytest.approx([0.55, 0.15])
    assert pd.api.types.is_float_dtype(frame.value)


def _seed_rows(fits: list[bool], steps: int = 200) -> list[dict]:
    return [{"fit_step": steps - 100 if fit else None, "steps": steps if fit else 2000,
             "accuracy": 1.0 if fit else 0.99} for fit in fits]


@pytest.mark.parametrize("seeds_at_dstar", [[True, True, True], [False, True, False]])
def test_the_capacity_line_says_when_d_star_rests_on_one_initialisation(seeds_at_dstar):
    """d* is the sweep's rule (one initialisation fitting suffices), the rule of the random maps it stands beside;
    when not every curve seed fits at d*, the note names the narrowest width where every seed fits."""
    report = _capacity_report(d_star=6)
    report["matched"]["modes"]["trainable"]["points"] = [
        {"d": 6, "train": {"bits_per_param": 1.60}, "readout": {}, "seeds": _seed_rows(seeds_at_dstar)},
        {"d": 12, "train": {"bits_per_param": 0.5}, "readout": {}, "seeds": _seed_rows([True] * 3)}]
    line = _line(report, "capacity O(R log N) in the matched controls")
    assert line["verdict"] == "supported"
    if all(seeds_at_dstar):
        assert "sturdy" not in line and "one initialisation" not in line["note"]
    else:
        assert line["sturdy"] == {"d": 12, "bits_per_param": 0.5, "seeds": "3 of 3"}
        assert line["note"].endswith("every seed of the curve fits first at d = 12 (3 of 3)")


def test_the_controls_table_shows_training_over_every_seed_not_seed_0():
    """A point whose seed 0 lost accuracy after fitting (0.916) while the others ended at 1.0 shows the mean,
    the minimum and how many seeds fit, and the range of steps."""
    rows = [{"fit_step": 308, "steps": 408, "accuracy": 0.916}, {"fit_step": 86, "steps": 186, "accuracy": 1.0},
            {"fit_step": None, "steps": 2000, "accuracy": 0.99}]
    block = {"table": {}, "modes": {"frozen": {"threshold": {"d_star": 8}, "points": [
        {"d": 128, "train": {"accuracy": 0.916, "steps": 408, "bits_per_param": 0.016}, "seeds": rows}]}}}
    (source,) = matched_sources(block)
    assert source["train"]["over_seeds"] == {"n": 3, "n_fit": 2, "accuracy_min": 0.916,
                                             "accuracy_mean": pytest.approx((0.916 + 1.0 + 0.99) / 3),
                                             "steps": [186, 2000]}
    row = matched_rows(source)[0]
    assert row[3] == "0.969 (min 0.916); 2/3 seeds fit" and row[4] == "186-2000"


def test_the_errors_section_counts_its_messages_in_words():
    """One message is "1 message", two are "2 messages" (a newcomer read "1 messages")."""
    from llmprobe.report.render import render_html
    report = _claims_report()
    report["errors"] = ["capital: one fact skipped"]
    assert "<summary>1 message</summary>" in render_html([report], "t")
    report["errors"].append("continent: another")
    assert "<summary>2 messages</summary>" in render_html([report], "t")
