"""Typed results (llmprobe.analyses.results): every entry of report.json's analyses block reads into its dataclass
and writes back the very JSON read; missing keys and nulls read as empty, as the report layer always treated them;
the report layer reads them without loading torch."""
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
    MultihopPooled,
    RelationDecoders,
    SelectorResult,
    SuperpositionLayer,
    SwapScale,
)
from llmprobe.report.claims import claims_block, validation_layers
from llmprobe.report.render import OWN_LAYOUT, selected_rows, superposition_rows, transplant_rows
from llmprobe.report.schema import analyses_of, matched_sources

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
