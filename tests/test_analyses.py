"""run_analyses end to end on tiny models: documented keys, finite values and intervals, errors per relation,
and planted structure (an exactly linear toy model) that must beat its controls."""
import json
import math
import random

import pytest
import torch

from llmprobe.analyses import ANALYSES, default_layers, format_table, pick_layers, run_analyses
from llmprobe.datasets import Fact, Relation
from llmprobe.known import FactResult
from llmprobe.loading import load_model
from test_lre import linear_toy
from tiny_models import save_tiny

FAST = dict(n_boot=100, max_swap_subjects=4, folds=3, max_val_pairs=4, max_test_pairs=6)


def _ci_ok(m: dict) -> bool:
    lo, hi = m["ci"]
    return math.isfinite(m["value"]) and math.isfinite(lo) and math.isfinite(hi) and lo <= hi + 1e-12


def _relations(subjects, seed=0):
    rnd = random.Random(seed)
    values = {"capital": ["Paris", "Tokyo", "Berlin", "Rome", "Madrid", "Cairo"],
              "continent": ["Europe", "Asia", "Africa", "Oceania"],
              "language": ["Spanish", "French", "German"]}
    rels, known = [], {}
    for name, vals in values.items():
        facts = [Fact(s, rnd.choice(vals)) for s in subjects]
        template = f"The {name} of {{}} is"
        rels.append(Relation(name, [template], ["{}", "Tell me about {}."], facts, {"subject_type": "country"}))
        known[name] = [FactResult(f.subject, f.object, template.replace("{}", f.subject), f.object, True)
                       for f in facts]
    return rels, known


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny("llama", tmp_path_factory.mktemp("llama"))), device="cpu")


@pytest.fixture(scope="module")
def tiny_result(tiny):
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi"]
    rnd = random.Random(1)
    subjects = sorted({"".join(rnd.choice(syllables) for _ in range(3)).capitalize() for _ in range(60)})[:28]
    rels, known = _relations(subjects)
    known["language"] = known["language"][:3]                     # too few known facts
    rels.append(Relation("empty", ["The thing {} is"], ["{}"], [], {}))
    known["empty"] = []
    rels.append(Relation("unchecked", ["The moon of {} is"], ["{}"], [Fact(subjects[0], "Luna")], {}))
    return run_analyses(tiny, rels, known, [0, 1, 2], progress=False, **FAST)


def test_result_has_the_documented_keys_and_finite_values(tiny_result):
    res = tiny_result
    assert set(res) >= {"settings", "relations", "superposition", "table", "errors", "timing"}
    settings = res["settings"]
    assert settings["lre_layers"] == [0, 1] and settings["causality_layers"] == [0, 1]
    assert "before the final norm" in settings["o"] and "first token" in settings["objects"]
    for name in ("capital", "continent"):
        rel = res["relations"][name]
        assert rel["error"] is None and rel["n_used"] == 28 and len(rel["jacobian_subjects"]) == 3
        for layer in ("0", "1", "2"):
            entry = rel["layers"][layer]
            ridge = entry["ridge"]["faithfulness"]
            assert _ci_ok(ridge) and len(ridge["per_split"]) == 3 and ridge["control"]["name"] == "shuffled"
            if layer in ("0", "1"):
                lre = entry["lre"]
                assert _ci_ok(lre["faithfulness"]) and lre["faithfulness"]["control"]["name"] == "majority"
                assert _ci_ok(lre["causality"]) and _ci_ok(lre["causality"]["control"])
                assert set(lre["causality"]["controls"]) == {"random_direction", "full_patch"}
                assert {"beta", "rank", "edit_rank"} <= set(lre["chosen"][0])
                assert _ci_ok(entry["ridge"]["causality"])
            else:
                assert "lre" not in entry
        assert rel["selected"]["lre"]["layer"] in (0, 1)
    sup = res["superposition"]
    assert sup["relations"] == ["capital", "continent", "language"] and sup["subjects"] == 28
    for layer in ("0", "1", "2"):
        entry = sup["layers"][layer]
        assert _ci_ok(entry["r2"]) and set(entry["r2"]["controls"]) == {"shuffled", "random_init"}
        for name in sup["relations"]:
            m = entry["readout"][name]
            assert _ci_ok(m) and _ci_ok(m["controls"]["random_init"]) and 0 <= m["chance"] <= 1
    swap = sup["layers"]["0"]["swap"]
    assert _ci_ok(swap["success"]) and _ci_ok(swap["others_unchanged"]) and swap["n_edits"] > 0
    assert [b["scale"] for b in swap["by_scale"]] == list(settings["swap_scales"]) and swap["scale"] == 1.0
    assert swap["by_scale"][0]["success"] == swap["success"]      # the fitted edit is the first scale
    assert "swap" not in sup["layers"]["2"]
    json.dumps(res)                                               # JSON-ready (plain floats, lists, dicts)


def test_errors_name_the_relation_and_the_others_go_on(tiny_result):
    rels = tiny_result["relations"]
    assert "language" in rels["language"]["error"] and "3 known facts" in rels["language"]["error"]
    assert "empty" in rels["empty"]["error"] and "0 known facts" in rels["empty"]["error"]
    assert "unchecked" in rels["unchecked"]["error"]
    assert len(tiny_result["errors"]) == 3
    assert rels["capital"]["error"] is None


def test_table_rows_and_markdown(tiny_result):
    rows = tiny_result["table"]
    kinds = {(r["analysis"], r["metric"]) for r in rows}
    assert {("lre", "faithfulness"), ("lre", "causality"), ("ridge", "faithfulness"),
            ("superposition", "r2"), ("superposition", "readout_accuracy"),
            ("superposition", "swap_success")} <= kinds
    assert all(r["control"] for r in rows)
    text = format_table(tiny_result)
    assert "| capital | 0 |" in text and "error:" in text and "superposition R^2" in text


def test_bad_arguments_fail_clearly(tiny):
    rels, known = _relations(["Aa", "Bb"])
    with pytest.raises(ValueError, match="unknown analyses"):
        run_analyses(tiny, rels, known, [0], analyses=("lre", "probing"))
    with pytest.raises(TypeError, match="unknown options"):
        run_analyses(tiny, rels, known, [0], n_bootstrap=3)
    assert ANALYSES == ("lre", "ridge", "superposition")


def test_layer_helpers():
    assert default_layers(30) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    assert pick_layers(default_layers(30), 3, 30) == [6, 15, 24]
    assert pick_layers([0, 1, 2], 3, 3) == [0, 1]
    assert pick_layers([5], 3, 30) == [5]


# ------------------------------------------------------------------------------------------ planted structure
def test_planted_lre_is_faithful_and_causal_beyond_its_controls():
    """On the exactly linear toy, with the model's own answers as the known facts, the LRE at layer 0 is exact:
    faithfulness and causality reach 1, above the majority and random-direction controls."""
    subjects = [f"S{i}" for i in range(40)]
    words = [f"W{i}" for i in range(30)]
    lm = linear_toy(subjects, extra=words, seed=2)
    template = "The capital of {} is"
    from llmprobe.lre import next_token_predictions
    pred = next_token_predictions(lm, template, subjects)
    objects = lm.tokenizer.convert_ids_to_tokens(pred.tolist())
    facts = [Fact(s, o) for s, o in zip(subjects, objects) if o not in ("<s>", "<pad>", "</s>", "[UNK]")]
    assert len({f.object for f in facts}) >= 4 and len(facts) >= 30
    rel = Relation("toy", [template], ["{}"], facts, {})
    known = {"toy": [FactResult(f.subject, f.object, template.replace("{}", f.subject), f.object, True)
                     for f in facts]}
    res = run_analyses(lm, [rel], known, [0, 1], analyses=("lre", "ridge"), progress=False, **FAST)
    entry = res["relations"]["toy"]["layers"]["0"]["lre"]
    faith, causal = entry["faithfulness"], entry["causality"]
    assert faith["value"] == 1.0 and faith["value"] > faith["control"]["value"]
    assert causal["value"] == 1.0 and causal["ci"][0] > causal["control"]["value"]
    assert res["relations"]["toy"]["model_first_token_accuracy"] == 1.0


def test_planted_superposition_beats_shuffled_and_random_init_controls():
    """Subject embeddings built as e_s = sum_r P_r u_{a_r(s)} (u = unembedding rows of the attributes): the
    readout and the superposition fit must beat the shuffled-attribute and random-init controls."""
    n, d = 48, 16
    subjects = [f"S{i}" for i in range(n)]
    attrs = {"colour": ["red", "green", "blue", "white"], "shape": ["round", "square", "flat"]}
    lm = linear_toy(subjects, extra=[a for v in attrs.values() for a in v] + ["Tell", "me", "about", "."], d=d)
    tok, model = lm.tokenizer, lm.model
    gen = torch.Generator().manual_seed(0)
    table = {name: torch.randint(len(vals), (n,), generator=gen) for name, vals in attrs.items()}
    with torch.no_grad():
        emb = torch.zeros(n, d, dtype=torch.float64)
        for name, vals in attrs.items():
            P = torch.randn(d, d, generator=gen, dtype=torch.float64)
            U = model.head.weight[tok.convert_tokens_to_ids(vals)]
            emb += U[table[name]] @ P.T
        emb += 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64)
        model.embed.weight[tok.convert_tokens_to_ids(subjects)] = emb
    rels = [Relation(name, [f"The {name} of {{}} is"], ["Tell me about {} ."],
                     [Fact(s, vals[int(a)]) for s, a in zip(subjects, table[name])], {"subject_type": "thing"})
            for name, vals in attrs.items()]
    res = run_analyses(lm, rels, {}, [0, 1], analyses=("superposition",), progress=False,
                       **{**FAST, "folds": 4, "n_boot": 200})
    assert res["errors"] == []
    for layer in ("0", "1"):
        entry = res["superposition"]["layers"][layer]
        r2 = entry["r2"]
        assert r2["value"] > 0.8 and r2["ci"][0] > r2["controls"]["shuffled"]["value"] + 0.3
        assert r2["value"] > r2["controls"]["random_init"]["value"] + 0.3
        for name in attrs:
            m = entry["readout"][name]
            assert m["value"] >= 0.9, (layer, name, m)
            assert m["ci"][0] > m["controls"]["shuffled"]["value"] and m["ci"][0] > m["chance"]
            assert m["value"] > m["controls"]["random_init"]["value"] + 0.2


def test_neutral_templates_that_open_with_the_subject_are_dropped_without_a_bos_token(tmp_path):
    """Without a leading special token the subject of "{}" sits at position 0 (the attention sink)."""
    from llmprobe.analyses import _neutral_templates
    gpt2 = load_model(str(save_tiny("gpt2", tmp_path / "gpt2")), device="cpu")  # no BOS
    rel = Relation("r", ["The capital of {} is"], ["{}", "{} is a country.", "Tell me about {}."],
                   [Fact("France", "Paris")], {})
    assert _neutral_templates(gpt2.tokenizer, [rel], None) == (["Tell me about {}."], ["{}", "{} is a country."])
    assert _neutral_templates(gpt2.tokenizer, [rel], ("{}",)) == (["{}"], [])
