"""Report export and comparison: escaping, tables, CSV rows, errors on bad input."""
import csv
import json

import pytest

from llmprobe.metric import Metric, proportion
from llmprobe.report.claims import summary_claims
from llmprobe.report.render import (
    LONG_TABLE,
    compare,
    export,
    metric_rows,
    render_html,
    render_markdown,
)
from llmprobe.report.schema import REPORT_SCHEMA_VERSION, read_report


def _typed(value, controls=None, half=0.05):
    """A typed metric (JSON form) with n=10 and the named controls."""
    def one(v):
        return Metric(v, (v - half, v + half), 10, "wilson")
    return one(value).with_controls({k: one(v) for k, v in (controls or {}).items()}).to_dict()


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
    layered = [r for r in rows if r["metric"] == "lre.faithfulness"]
    assert [r["layer"] for r in layered] == [0, 2, 4]
    assert [r["depth"] for r in layered] == [0.0, 0.5, 1.0]
    assert all(r["control"] == "shuffled" and r["control_value"] == 0.1 for r in layered)
    assert layered[2]["value"] == pytest.approx(0.4) and layered[2]["hi"] == pytest.approx(0.45)
    known = [r for r in rows if r["metric"] == "known_rate"]
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
        assert len(list(csv.DictReader(handle))) == 4


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
    (folder / "report.json").write_text(json.dumps({**pretrained, "controls": [control]}))
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


def _claims_report(causal: tuple[int, int], controls: dict[str, tuple[int, int]], superposition=True,
                   relation="capital") -> dict:
    """A pretrained report whose only LRE causality (``causal`` = hits, n) has the given controls."""
    causality = Metric.from_dict(_prop(*causal)).with_controls(
        {k: Metric.from_dict(_prop(*v)) for k, v in controls.items()}).to_dict()
    report = {"schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "model": {"name": "m<i>", "n_layers": 3},
              "relations": {relation: {"n_facts": 60, "n_known": 40, "known_rate": 2 / 3}},
              "analyses": {"relations": {relation: {"layers": {"2": {"lre": {"causality": causality}}},
                                                    "selected": {"lre": {"layer": 2, "causality_layer": 2}}}}},
              "errors": []}
    if superposition:
        readout = Metric.from_dict(_prop(30, 40)).with_controls({"shuffled": Metric.from_dict(_prop(4, 40))})
        r2 = Metric(0.2, (0.15, 0.25), 40, "bootstrap").with_controls({"shuffled": Metric(0.0, (-0.02, 0.02), 40,
                                                                                           "bootstrap")})
        report["analyses"]["superposition"] = {"layers": {"1": {"r2": r2.to_dict(),
                                                                "readout": {relation: readout.to_dict()}}}}
    return report


@pytest.mark.parametrize("causal, controls, expected", [
    ((40, 50), {"random_direction": (1, 50), "full_patch": (50, 50)}, "supported"),        # full_patch: a ceiling
    ((40, 50), {"random_direction": (0, 50), "random_operator": (38, 50)}, "not supported"),  # the strongest null
    ((5, 50), {"random_direction": (5, 50)}, "not supported"),
    ((30, 50), {"random_direction": (0, 50), "random_operator": (22, 50)}, "inconclusive"),   # intervals overlap
    ((6, 6), {"random_direction": (0, 6)}, "inconclusive"),                                    # n < MIN_N
])
def test_summary_verdicts_follow_the_stated_rule(causal, controls, expected):
    line = summary_claims(_claims_report(causal, controls))[1]
    assert line["claim"] == "LRE edits causal" and line["verdict"] == expected
    strongest = max((k for k in controls if k != "full_patch"), key=lambda k: controls[k][0])
    assert line["control_name"] == strongest
    assert line["metric"]["n"] == causal[1] and line["metric"]["value"] == pytest.approx(causal[0] / causal[1])


def test_summary_says_not_measured_where_the_report_has_no_data():
    lines = summary_claims(_claims_report((40, 50), {"random_direction": (1, 50)}, superposition=False))
    assert [line["verdict"] for line in lines] == ["not measured", "supported", "not measured", "not measured",
                                                   "not measured"]
    lines = summary_claims(_claims_report((40, 50), {"random_direction": (1, 50)}))
    assert lines[0]["verdict"] == "supported" and lines[0]["control_name"] == "shuffled"      # 0.75 vs 0.10
    assert lines[2]["verdict"] == "supported" and lines[2]["metric"]["value"] == 0.2


def test_summary_comes_first_in_html_and_markdown_and_escapes_user_strings(tmp_path):
    report = _claims_report((40, 50), {"random_direction": (1, 50)}, relation="<script>alert(1)</script>")
    page = render_html([report], "t")
    body = page.split("<body>", 1)[1]
    assert body.startswith("<section id='summary'>") and body.index("</section>") < body.index("<img")
    assert "<script>" not in page and "&lt;script&gt;" in page and "<i>" not in page
    assert "95% interval lies above the control" in page
    assert page.count("class='verdict supported'") == 3 and page.count("class='verdict not-measured'") == 2
    text = render_markdown([report], "t")
    assert text.index("## Summary: the paper's claims") < text.index("## Sources")
    assert "| LRE edits causal |" in text and "<script>" not in text


def test_long_tables_fold_into_details():
    report = _claims_report((40, 50), {"random_direction": (1, 50)})
    report["relations"] = {f"r{i}": {"n_facts": 10, "n_known": 5, "known_rate": 0.5} for i in range(LONG_TABLE + 1)}
    page = render_html([report], "t")
    assert f"<details><summary>{LONG_TABLE + 1} rows" in page
    report["relations"] = {f"r{i}": {"n_facts": 10, "n_known": 5, "known_rate": 0.5} for i in range(LONG_TABLE)}
    assert "<details><summary>" not in render_html([report], "t")
