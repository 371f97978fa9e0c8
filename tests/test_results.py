"""Typed results (llmprobe.analyses.results): every entry of report.json's analyses block, and the blocks beside it
that the report reads (model, settings, the matched controls and each of them as a source), reads into its
dataclass and writes back the very JSON read; missing keys and nulls read as empty, as the report layer always
treated them; the report layer reads them without loading torch."""
import copy
import json
import subprocess
import sys
from pathlib import Path

from test_report import page_report

from llmprobe.analyses.results import (
    AnalysesResult,
    DecoderLayer,
    GateTransplant,
    MatchedBlock,
    MatchedSource,
    ModelInfo,
    MultihopPooled,
    RelationDecoders,
    SelectorResult,
    SuperpositionLayer,
    SwapScale,
    metric_nulls,
    metric_value,
    null_value,
)
from llmprobe.report.claims import capacity_line, claims_block, validation_layers
from llmprobe.report.render import (
    OWN_LAYOUT,
    matched_rows,
    measured_differences,
    selected_rows,
    superposition_rows,
    transplant_rows,
)
from llmprobe.report.schema import (
    analyses_of,
    matched_sources,
    matched_sources_of,
    missing_stages,
    model_of,
    settings_of,
)

# a SmolLM2-135M probe's analyses block, trimmed (the file's "note" says how): decoders, superposition, crosspatch,
# selector, multihop with the numbers as written
REAL = json.loads((Path(__file__).parent / "data" / "analyses_smollm2.json").read_text(encoding="utf-8"))


def test_the_real_block_reads_and_writes_back_the_same_json():
    block = REAL["analyses"]
    typed = AnalysesResult.from_dict(copy.deepcopy(block))
    assert typed.to_dict() == block
    assert json.dumps(typed.to_dict()) == json.dumps(block)                       # keys in their order too
    for name in ("superposition", "crosspatch", "selector", "multihop"):
        entry = getattr(typed, name)
        assert type(entry).from_dict(block[name]).to_dict() == block[name]
        assert entry and not entry.extra, f"{name}: keys the type does not cover: {sorted(entry.extra)}"


def test_the_real_block_reads_as_typed_attributes():
    block = REAL["analyses"]
    typed = AnalysesResult.from_dict(block)
    capital = typed.relations["country_capital"]
    assert capital.selection("lre").layer == 15 and capital.selection("lre").causality_layer == 6
    assert capital.at(15).lre.faithfulness["value"] == block["relations"]["country_capital"]["layers"]["15"]["lre"][
        "faithfulness"]["value"]
    assert capital.at(6).lre.causality is block["relations"]["country_capital"]["layers"]["6"]["lre"]["causality"]
    skipped = typed.relations["company_hq_city"]                  # an error: selected is null, no layers
    assert skipped.error.startswith("relation company_hq_city: 5 known facts")
    assert skipped.selected == {} and skipped.selection("lre").layer is None and skipped.at(15).lre.causality is None
    assert typed.superposition.at(6).r2 is block["superposition"]["layers"]["6"]["r2"]
    assert [s.scale for s in typed.superposition.at(6).swap.by_scale] == [
        s["scale"] for s in block["superposition"]["layers"]["6"]["swap"]["by_scale"]]
    assert typed.crosspatch.layers["15"].neutral["n"] == block["crosspatch"]["layers"]["15"]["neutral"]["n"]
    transplant = typed.selector.gate_transplant
    assert transplant.block == [0, 1, 2, 3, 4, 5]
    assert transplant.other_relation["value"] == block["selector"]["gate_transplant"]["other_relation"]["value"]
    assert set(transplant.by_relation) == set(block["selector"]["gate_transplant"]["by_relation"])
    assert sorted(typed.multihop.pooled) == sorted(block["multihop"]["pooled"])
    assert typed.multihop.compositions[0].name == block["multihop"]["compositions"][0]["name"]


def test_the_report_layer_reads_the_real_block():
    report = {"schema_version": REAL["schema_version"], "kind": "pretrained", "model": REAL["model"],
              "analyses": REAL["analyses"]}
    # LRE chose 15 (capital) and 6 (continent): the tie goes to the lower layer; the errored relation chose none
    assert validation_layers(report) == ({"country_capital": 15, "country_continent": 6}, 6)
    rows = selected_rows(report)
    assert [(r[1], r[2], r[3], r[6]) for r in rows] == [
        ("country_capital", "lre", 15, 6), ("country_capital", "ridge", 0, None),
        ("country_continent", "lre", 6, 6), ("country_continent", "ridge", 15, None)]
    assert [r[1] for r in superposition_rows(report)] == [0, 6, 15]
    assert [r[1] for r in transplant_rows(report)] == list(REAL["analyses"]["selector"]["gate_transplant"]["by_relation"])
    lines = {line["claim"]: line for line in claims_block(report)["lines"]}
    selector = lines["MLP a relation-conditioned selector"]
    other = REAL["analyses"]["selector"]["gate_transplant"]["other_relation"]["value"]
    assert selector["metric"]["value"] == 1.0 - other                      # the fraction the other gates break
    assert lines["one subject state serves every relation"]["layer"] == 6


def test_missing_keys_and_nulls_read_as_empty_and_write_back_as_read():
    old = {"relations": {"r": {"layers": {"3": {"lre": None}}, "selected": None}}, "superposition": None}
    typed = AnalysesResult.from_dict(old)
    assert typed.to_dict() == old
    r = typed.relations["r"]
    assert r.selected == {} and r.selection("lre").layer is None and r.at(3).lre.faithfulness is None
    assert not r.at(3).lre and not typed.superposition and typed.superposition.layers == {}
    assert typed.superposition.to_dict() is None                        # a null stays a null
    assert not typed.crosspatch and typed.crosspatch.to_dict() == {} and "crosspatch" not in typed.to_dict()
    assert typed.multihop.pooled == {} and typed.selector.gate_transplant.block == []
    empty = AnalysesResult.from_dict(None)
    assert not empty and empty.relations == {} and empty.selector.gate_transplant.by_relation == {}
    assert AnalysesResult.from_dict({}).to_dict() == {}


def test_keys_a_type_does_not_cover_are_kept_in_place():
    entry = {"r2": {"value": 0.5}, "lexical": {"value": 0.1}, "readout": {}, "swap": {"by_scale": [{"scale": 1.0,
                                                                                                     "new": 2}]}}
    typed = SuperpositionLayer.from_dict(entry)
    assert typed.extra == {"lexical": {"value": 0.1}} and typed.swap.by_scale[0].extra == {"new": 2}
    assert list(typed.to_dict()) == ["r2", "lexical", "readout", "swap"] and typed.to_dict() == entry
    block = {"relations": {}, "toy": {"score": {"value": 1.0}}}                # an analysis registered beside these
    assert AnalysesResult.from_dict(block).extra == {"toy": {"score": {"value": 1.0}}}


def test_entries_built_in_code_write_their_fields():
    scale = SwapScale(scale=4.0, success={"value": 0.5})
    assert scale.to_dict() == {"scale": 4.0, "success": {"value": 0.5}} and scale
    assert not SwapScale() and SwapScale().to_dict() == {}
    layer = DecoderLayer(faithfulness={"value": 1}, extra={"note": "x"})
    assert layer.to_dict() == {"faithfulness": {"value": 1}, "note": "x"}
    assert RelationDecoders(error="too few").to_dict() == {"error": "too few"}
    assert MultihopPooled.from_dict({"k": 2, "cot": None}).to_dict() == {"k": 2, "cot": None}


def test_a_matched_controls_selector_reads_with_the_same_type():
    report = page_report("/runs/models/tiny", ["capital", "continent"])
    sources = matched_sources(report["matched"], report["schema_version"])
    for source in sources:
        typed = analyses_of(source)
        assert typed.to_dict() == source["analyses"]
        assert typed.selector.gate_transplant == GateTransplant(same_relation=0.9, same_subject=0.1)
        assert typed.selector.relation_gating.mean == 0.8 and typed.selector.relations == ["capital", "continent"]
        assert typed.superposition.at(0).r2 is source["analyses"]["superposition"]["layers"]["0"]["r2"]
    assert SelectorResult.from_dict(report["matched"]["modes"]["frozen"]["points"][0]["selector"]).ablation_drop == [
        [0.9, 0.1], [0.1, 0.9]]


def test_the_entries_with_a_layout_of_their_own_are_the_typed_ones():
    assert set(OWN_LAYOUT) == set(AnalysesResult.covered())


def test_the_report_layer_loads_no_torch():
    code = ("import sys, llmprobe.analyses.results, llmprobe.report.render, llmprobe.report.claims, "
            "llmprobe.report.figures; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _with_seeds(report):
    """``page_report`` with per-seed rows at the trainable widths 4 (d*: one seed of two fits) and 8 (both fit), a
    2000-step cap."""
    points = report["matched"]["modes"]["trainable"]["points"]
    points[0]["seeds"] = [{"accuracy": 1.0, "steps": 90, "fit_step": 60}, {"accuracy": 0.95, "steps": 100,
                                                                            "fit_step": None}]
    points[1]["seeds"] = [{"accuracy": 1.0, "steps": 70, "fit_step": 40}, {"accuracy": 1.0, "steps": 70,
                                                                            "fit_step": 50}]
    points[1]["train"]["bits_per_param"] = 0.8
    report["matched"]["training"]["max_steps"] = 2000                   # the capacity sweep's general maps' cap
    return report


def test_matched_sources_read_typed_and_write_back_as_read():
    report = _with_seeds(page_report("/runs/models/tiny", ["capital", "continent"]))
    raw = matched_sources(report["matched"], report["schema_version"])
    typed = matched_sources_of(report)
    assert [s.to_dict() for s in typed] == raw
    assert [json.dumps(s.to_dict()) for s in typed] == [json.dumps(s) for s in raw]        # keys in their order
    assert [(s.model.d_model, s.model.frozen_subjects) for s in typed] == [
        (4, False), (8, False), (16, False), (32, False), (4, True), (8, True), (16, True), (32, True)]
    assert {(s.threshold.d_star, s.threshold.exact, s.matched_to.bits, s.matched_to.n_facts) for s in typed} == {
        (4, True, 100.0, 60)}
    assert [s.train.bits_per_param for s in typed[:4]] == [1.6, 0.8, 1.6, 1.6]
    assert typed[0].train.over_seeds == {"n": 2, "n_fit": 1, "accuracy_min": 0.95, "accuracy_mean": 0.975,
                                         "steps": [90, 100]}
    assert typed[1].train.over_seeds["n_fit"] == 2 and typed[2].train.over_seeds is None   # no per-seed rows
    assert typed[0].analyses.selector.gate_transplant.same_relation == 0.9
    block = MatchedBlock.from_dict(report["matched"])
    assert block.training.max_steps == 2000 and block.table.relations == ["capital", "continent"]
    assert block.to_dict() == report["matched"]


def test_the_report_layer_reads_the_matched_sources_typed():
    report = _with_seeds(page_report("/runs/models/tiny", ["capital", "continent"]))
    line = capacity_line(report)
    # d* = 4 (bits per parameter 1.6; no joint bits: the sum), every seed fits first at d = 8; graded by the sweep
    assert line["metric"]["value"] == 1.6 and "table bits 100 (sum over relations; joint not recorded in this " \
        "report), 30 subjects x 2 relations" in line["measure"] and line["measure"].endswith("d* = 4, 2000-step cap")
    assert line["sturdy"] == {"d": 8, "bits_per_param": 0.8, "seeds": "2 of 2"}
    assert line["verdict"] == "supported" and line["comparison"] is None         # no random maps of 30 x 2
    rows = [matched_rows(s) for s in matched_sources(report["matched"], report["schema_version"])]
    # d, d*, train accuracy and steps over the seeds, bits per parameter
    assert rows[0][0][1:6] == [4, 4, "0.975 (min 0.950); 1/2 seeds fit", "90-100", "1.6"]
    assert rows[1][0][1:6] == [8, 4, "1.000; 2/2 seeds fit", "70", "0.8"]
    assert rows[2][0][1:6] == [16, 4, 1.0, 100, "1.6"]                    # no seeds: the one training's cells
    del report["matched"]["training"]                                      # an older block: no step cap recorded
    assert capacity_line(report)["measure"].endswith("d* = 4, None-step cap")


def test_missing_report_blocks_and_nulls_read_as_empty_and_write_back_as_read():
    source = {"kind": "synthetic", "model": None, "threshold": {}, "train": {"over_seeds": None}}
    typed = MatchedSource.from_dict(source)
    assert typed.model.d_model is None and not typed.model and typed.threshold.d_star is None
    assert typed.train.over_seeds is None and not typed.matched_to and typed.analyses.selector.gate_transplant.block == []
    assert typed.to_dict() == source and not MatchedSource.from_dict(None)
    assert model_of({}) == ModelInfo() and model_of({"model": {"d_model": 8, "dtype": "f32"}}).extra == {"dtype": "f32"}
    settings = settings_of({"settings": {"command": "run", "run": None}})
    assert settings.run == {} and settings.analysis == {} and settings.matched.get("enabled", True)
    assert settings.to_dict() == {"command": "run", "run": None}
    older = MatchedBlock.from_dict([{"kind": "synthetic"}])              # the list of controls of older reports
    assert older.training.max_steps is None and older.to_dict() == [{"kind": "synthetic"}]
    metric = {"value": 0.5, "nulls": {"shuffled": {"value": 0.1}, "random_init": None}}
    assert null_value(metric, "shuffled") == 0.1 and null_value(metric, "random_init") is None
    assert null_value(metric, "lexical") is None and null_value(None, "shuffled") is None
    assert null_value({"value": 0.5, "nulls": None}, "shuffled") is None
    assert list(metric_nulls(metric)) == ["shuffled", "random_init"] and metric_nulls(None) == {}
    assert metric_value(metric) == 0.5 and metric_value(None) is None and metric_value({}) is None


def test_settings_read_typed_in_what_a_report_lacks_and_what_two_differ_in():
    report = page_report("/runs/models/tiny", ["capital", "continent"])
    report.update(partial=True)
    report["stages"]["matched"]["done"] = False
    assert missing_stages(report) == ["matched controls not finished: no matched synthetic models: the selector and "
                                      "capacity claims are not measured and the readouts have no matched control "
                                      "beside them"]
    report["settings"]["matched"] = {"enabled": False}                   # --no-matched: not expected
    assert missing_stages(report) == ["matched controls not finished: no matched synthetic models: the selector and "
                                      "capacity claims are not measured and the readouts have no matched control "
                                      "beside them"]                     # recorded in stages: still listed
    del report["stages"]["matched"]
    assert missing_stages(report) == ["the report says partial: true, but records no unfinished stage"]
    report["settings"]["matched"] = None                                 # a null section reads as {}: expected
    assert missing_stages(report)[0].startswith("matched controls not started")
    a, b = page_report("/runs/a/tiny", ["capital"]), page_report("/runs/b/tiny", ["capital"])
    b["settings"]["run"]["seed"], b["settings"]["analysis"] = 1, None
    assert measured_differences([a, b]) == ["run.seed differ: tiny: 0; tiny: 1",
                                            "analysis.folds differ: tiny: 3; tiny: -",
                                            "analysis.n_boot differ: tiny: 100; tiny: -"]
