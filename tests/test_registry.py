"""The analysis registry: each analysis declared once (its record beside its code), the command line's names, the
run order, the plan's stages and its workload derived from the list; a toy analysis added as a user adds one (a
module, tests/toy_analysis.py, and one ``register`` line) runs, is planned and is rendered."""
import pytest
from test_analyses import _relations
from tiny_models import save_tiny
from toy_analysis import TOY, TOY_CLAIM

from llmprobe.analyses import registry
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.run import parts_of, run_analyses
from llmprobe.analyses.settings import settings_from
from llmprobe.jobs.plan import CPU_FITS, part_seconds, predict_on, priced_by_passes, stages
from llmprobe.jobs.workload import run_workload, shape_from_config
from llmprobe.model.loading import load_model
from llmprobe.names import ANALYSES
from llmprobe.report import claims
from llmprobe.report.claims import CAPACITY, CLAIMS, STORED, claims_block
from llmprobe.report.render import render_html, render_markdown

SUBJECTS = ["Kalomi", "Neruta", "Vozika", "Lomine", "Rutavo", "Zikalo", "Minevo", "Tavozi", "Kaneru", "Lovota"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny("llama", tmp_path_factory.mktemp("llama"))), device="cpu")


@pytest.fixture
def toy_registered():
    """TOY registered for one test (the registry is the same list every module reads)."""
    registry.register(TOY)
    claims.register_line(TOY_CLAIM)
    try:
        yield TOY
    finally:
        registry.REGISTRY.remove(TOY)
        claims.unregister_line(TOY_CLAIM)


def test_every_registered_analysis_has_every_part_and_the_vocabulary_is_the_registrys():
    assert registry.selectable() == ANALYSES          # the command line's names (read without torch) are these
    names = [a.name for a in registry.REGISTRY]
    assert names == ["decoders", "superposition", "crosspatch", "selector", "multihop"]
    fed = set()
    for analysis in registry.REGISTRY:
        assert callable(analysis.compute) and callable(analysis.workload) and analysis.stage
        assert analysis.result is not None and analysis.result.from_dict({}).to_dict() == {}
        assert set(analysis.claims) <= {line.claim for line in claims.CLAIM_LINES}, analysis
        fed |= set(analysis.claims)
    assert [line.claim for line in claims.CLAIM_LINES] == list(CLAIMS)   # the paper's claims, in the block's order
    assert fed == set(CLAIMS) - {CAPACITY, *STORED}    # every claim line but the controls' and the stored ones is fed by an analysis
    assert list(stages()) == ["load", "known_facts", "jacobians", "decoders_other", "superposition", "crosspatch",
                              "selector", "multihop", "matched"]
    assert priced_by_passes() == ["crosspatch", "selector", "multihop"]


def test_a_record_missing_a_part_or_clashing_is_refused():
    with pytest.raises(ValueError, match="needs a name"):
        Analysis("nothing", (), TOY.compute, TOY.workload, "x")
    with pytest.raises(ValueError, match="callables"):
        Analysis("halfway", ("halfway",), TOY.compute, None, "x")
    with pytest.raises(ValueError, match="from_dict and to_dict"):
        Analysis("untyped", ("untyped",), TOY.compute, TOY.workload, "x", result=dict)
    with pytest.raises(ValueError, match="priced"):
        Analysis("odd", ("odd",), TOY.compute, TOY.workload, "x", priced="flops")
    with pytest.raises(ValueError, match=r"\['lre'\] already registered"):
        registry.register(Analysis("lre2", ("lre",), TOY.compute, TOY.workload, "x"))
    with pytest.raises(ValueError, match="unknown analyses"):
        registry.selected(("toy",))
    with pytest.raises(ValueError, match="already registered"):
        claims.register_line(claims.CLAIM_LINES[0])
    with pytest.raises(ValueError, match="nulls and minimal effect"):
        claims.ClaimLine("untested", TOY_CLAIM.tests)
    with pytest.raises(ValueError, match="one of them"):
        claims.ClaimLine("both", TOY_CLAIM.tests, line=lambda report: {}, nulls=("x",), min_effect=0.1)


def test_a_toy_analysis_runs_is_planned_and_is_rendered(tiny, toy_registered):
    rels, known = _relations(SUBJECTS)
    n_known = sum(f.known for facts in known.values() for f in facts)
    assert parts_of(rels, ("lre", "toy")) == [("decoders", r.name) for r in rels] + [("toy", None)]
    result = run_analyses(tiny, rels, known, [0, 1, 2], analyses=("toy",), progress=False)
    agreement = result["toy"]["agreement"]
    assert result["toy"]["n_facts"] == agreement["n"] == n_known == 30 and not result["errors"]
    assert 0.0 <= agreement["value"] <= 1.0 and "mlp_zeroed" in agreement["nulls"]
    assert result["timing"]["toy_seconds"] >= 0 and "relations" not in result or not result["relations"]
    # an analysis that fails is an error entry, the others go on
    nothing = {name: [] for name in known}
    failed = run_analyses(tiny, rels, nothing, [0], analyses=("toy",), progress=False)
    assert failed["toy"] == {"error": "no known fact"} and failed["errors"] == ["toy: no known fact"]

    # planned: its own workload, priced by its passes, a stage of its own
    cfg = settings_from()
    work = run_workload(tiny.tokenizer, 3, None, cfg, rels, "all", analyses=("toy",), matched_modes=())
    passes = work["mechanisms"]["toy"]["forward"]
    assert len(passes) == 2 and sum(rows for rows, _ in passes[0][0]) == n_known
    shape = shape_from_config(tiny.model.config, "tiny")
    seconds = predict_on(shape, work, CPU_FITS, "cpu", None)
    assert seconds["toy"] > 0 and stages()["toy"] == "toy agreement"
    assert seconds["analyses"] == pytest.approx(sum(seconds[s] for s in ("jacobians", "decoders_other",
                                                                          "superposition", *priced_by_passes())))
    planned = part_seconds(tiny, rels, known, [0, 1, 2], cfg, ("toy",))
    assert list(planned) == [("toy", None)] and planned[("toy", None)] > 0

    # rendered: a table of its metrics in every format, until it has a layout of its own
    report = {"kind": "pretrained", "model": {"name": "tiny", "n_layers": 3}, "relations": {}, "analyses": result}
    value = f"{agreement['value']:.3f}"
    for page in (render_markdown([report], "toy"), render_html([report], "toy")):
        assert "Analysis toy: its metrics" in page and "agreement" in page and value in page

    # its claim line: graded in the report's Holm family, after the paper's claims
    block = claims_block(report)
    line = block["lines"][-1]
    assert [entry["claim"] for entry in block["lines"]] == [*CLAIMS, TOY_CLAIM.claim]
    assert line["metric"]["value"] == agreement["value"] and line["null_name"] == "mlp_zeroed"
    assert line["verdict"] != "not measured" and block["n_tests"] == 1 and line["p_holm"] is not None
    for page in (render_markdown([report], "toy"), render_html([report], "toy")):
        assert TOY_CLAIM.claim in page
    assert claims_block({**report, "analyses": {}})["lines"][-1]["verdict"] == "not measured"
