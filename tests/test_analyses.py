"""run_analyses end to end on tiny models: documented keys, typed metrics that bracket their values, errors per
relation, and planted models with known answers whose tests fail on a broken estimator (each was checked by
mutation: see the docstrings)."""
import json
import random
from types import SimpleNamespace

import pytest
import torch
from test_lre import linear_toy, word_tokenizer
from tiny_models import save_tiny
from torch import nn

import llmprobe.analyses.decoders as decoders_module
from llmprobe.analyses.run import run_analyses
from llmprobe.analyses.settings import pick_layers
from llmprobe.analyses.superposition import neutral_templates
from llmprobe.datasets import Fact, Relation
from llmprobe.geometry import random_spectrum_like
from llmprobe.metric import iter_metrics
from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.engine import next_token_predictions
from llmprobe.model.known import FactResult
from llmprobe.model.loading import LoadedModel, load_model
from llmprobe.names import ANALYSES

FAST = dict(n_boot=100, max_swap_subjects=4, folds=3, max_val_pairs=4, max_test_pairs=8)


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
        known[name] = _all_known(facts, template)
    return rels, known


def _all_known(facts, template):
    return [FactResult(f.subject, f.object, template.replace("{}", f.subject), f.object, True) for f in facts]


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


def test_result_has_the_documented_keys_and_typed_metrics(tiny_result):
    res = tiny_result
    assert set(res) >= {"settings", "relations", "superposition", "errors", "timing"}
    settings = res["settings"]
    assert settings["lre_layers"] == [0, 1] and settings["causality_layers"] == [0, 1]
    assert "before the final norm" in settings["o"] and "first token" in settings["objects"]
    assert settings["protocol"] == "strict" and "Wilson" in settings["intervals"]
    for name in ("capital", "continent"):
        rel = res["relations"][name]
        assert rel["error"] is None and rel["n_used"] == 28
        test = rel["test_subjects"]
        assert len(test) == round(28 / 3) and len(rel["refits"]) == 3
        for refit in rel["refits"]:                     # re-fits never draw from the fixed test set
            assert not set(refit["jacobian_subjects"]) & set(test) and len(refit["jacobian_subjects"]) == 3
            assert refit["n_selection"] == 28 - len(test) - 3 and refit["n_folds"] == 5
        assert len(rel["candidates"]["lre"]) == 21 and rel["candidates"]["edit_rank"] == [8, 32, 128]
        for layer in ("0", "1", "2"):
            entry = rel["layers"][layer]
            ridge = entry["ridge"]["faithfulness"]
            assert ridge["n"] == len(test) and set(ridge["nulls"]) == {"shuffled", "majority"}
            assert len(ridge["spread"]["values"]) == 3
            if layer in ("0", "1"):
                lre = entry["lre"]
                assert lre["faithfulness"]["primary_null"] == "majority" and lre["faithfulness"]["n"] == len(test)
                lexical = lre["faithfulness"]["nulls"]["lexical"]       # the operator on the block-0 state
                assert set(lre["faithfulness"]["nulls"]) == {"majority", "lexical"} and lexical["n"] == len(test)
                if layer == "0":                                         # there it is the state itself
                    assert lexical["value"] == lre["faithfulness"]["value"]
                causal = lre["causality"]
                assert causal["n"] == rel["n_test_pairs"] > 0 and causal["primary_null"] == "random_direction"
                assert set(causal["nulls"]) == {"random_direction", "random_operator", "scaled_patch",
                                                   "full_patch"}
                assert {"beta", "rank", "edit_rank", "n_candidates", "n_selection", "n_folds"} <= set(lre["chosen"][0])
                assert entry["ridge"]["causality"]["n"] == rel["n_test_pairs"]
                assert set(entry["ridge"]["causality"]["nulls"]) == {"random_direction", "scaled_patch"}
            else:
                assert "lre" not in entry
        assert rel["selected"]["lre"]["layer"] in (0, 1) and rel["selected"]["lre"]["causality_layer"] in (0, 1)
    sup = res["superposition"]
    assert sup["relations"] == ["capital", "continent", "language"] and sup["subjects"] == 28
    for layer in ("0", "1", "2"):
        entry = sup["layers"][layer]
        r2 = entry["r2"]
        assert r2["n"] == 28 and set(r2["nulls"]) == {"shuffled", "random_attributes", "random_init", "lexical"}
        assert r2["primary_null"] == "random_attributes" and r2["gain"] == r2["margins"]["random_attributes"]
        assert r2["interval"].startswith("jackknife") and len(r2["jackknife"]) == 20
        for name in sup["relations"]:
            m = entry["readout"][name]
            assert m["interval"] == "wilson (jackknife)" and 0 <= m["chance"] <= 1
            assert set(m["nulls"]) == {"shuffled", "random_attributes", "random_init", "lexical", "chance"}
            assert m["nulls"]["chance"]["value"] == m["chance"] and m["gain"]["n"] == m["n"]
    swap = sup["layers"]["0"]["swap"]
    assert [b["scale"] for b in swap["by_scale"]] == list(settings["swap_scales"]) and swap["n_edits"] > 0
    assert swap["by_scale"][0]["success"]["n"] == swap["n_edits"]
    assert "swap" not in sup["layers"]["2"]
    json.dumps(res)                                               # JSON-ready (plain floats, lists, dicts)


def test_superposition_records_the_lexical_rule_and_each_relations_contribution(tiny_result):
    """At the LRE layers (where the claim's R^2 is graded): the fit without the relations the lexical rule flags
    (in the tiny tokenizer capitals and languages often open with the subject's first token: 9 and 6 of 28) and
    each relation's contribution to the gain over random_attributes, which adds back up to the readout's gain
    (the dual refits at its alphas equal its fits)."""
    sup = tiny_result["superposition"]
    overlap = sup["lexical_overlap"]
    assert sup["graded_layers"] == [0, 1] and set(overlap) == {"capital", "continent", "language"}
    assert sup["lexical_relations"] == [name for name in sup["relations"] if overlap[name]["lexical"]] == \
        ["capital", "language"]
    assert (overlap["capital"]["shared_first_token"], overlap["capital"]["n"]) == (9, 28)
    assert overlap["continent"] == {**overlap["continent"], "shared_first_token": 0, "lexical": False}
    for layer in ("0", "1"):
        entry = sup["layers"][layer]
        fit = entry["r2_non_lexical"]
        assert fit["relations"] == ["continent"] and fit["n"] == 28 and fit["value"] != entry["r2"]["value"]
        assert set(fit["nulls"]) == {"shuffled", "random_attributes", "random_init", "lexical"}
        assert fit["gain"] == fit["margins"]["random_attributes"] and fit["interval"].startswith("jackknife")
        assert set(entry["contributions"]) == set(sup["relations"])
        for part in entry["contributions"].values():
            assert part["gain_without"]["value"] + part["contribution"]["value"] == pytest.approx(
                entry["r2"]["gain"]["value"], abs=1e-9)
            assert part["contribution"]["interval"].startswith("jackknife")
    assert "contributions" not in sup["layers"]["2"] and "r2_non_lexical" not in sup["layers"]["2"]


def test_every_value_lies_inside_an_interval_of_nonzero_width(tiny_result):
    """The reviewer's check on a whole result: n >= 1 -> lo <= value <= hi and hi > lo, controls included."""
    seen = 0
    for path, m in iter_metrics(tiny_result):
        for metric in [m, *m["nulls"].values()]:
            if metric["n"] and metric["value"] is not None:
                lo, hi = metric["ci"]
                assert lo - 1e-12 <= metric["value"] <= hi + 1e-12 and hi > lo, (path, metric)
                seen += 1
    assert seen > 100


def test_errors_name_the_relation_and_the_others_go_on(tiny_result):
    rels = tiny_result["relations"]
    assert "language" in rels["language"]["error"] and "3 known facts" in rels["language"]["error"]
    assert "empty" in rels["empty"]["error"] and "0 known facts" in rels["empty"]["error"]
    assert "unchecked" in rels["unchecked"]["error"]
    assert len(tiny_result["errors"]) == 3
    assert rels["capital"]["error"] is None


def test_bad_arguments_fail_clearly(tiny):
    rels, known = _relations(["Aa", "Bb"])
    with pytest.raises(ValueError, match="unknown analyses"):
        run_analyses(tiny, rels, known, [0], analyses=("lre", "probing"))
    with pytest.raises(TypeError, match="unknown options"):
        run_analyses(tiny, rels, known, [0], n_bootstrap=3)
    with pytest.raises(ValueError, match="protocol"):
        run_analyses(tiny, rels, known, [0], protocol="icl")
    assert ANALYSES == ("lre", "ridge", "superposition", "crosspatch", "selector", "multihop")


def test_pick_layers():
    layers = [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    assert pick_layers(layers, 3, 30) == [6, 15, 24]
    assert pick_layers([0, 1, 2], 3, 3) == [0, 1]
    assert pick_layers([5], 3, 30) == [5]


# ------------------------------------------------------------------------------------------ planted structure
def _toy_relation(n_subjects=45, seed=2):
    """The exactly linear toy (o affine in the layer-0 subject state) with its own answers as the known facts."""
    subjects = [f"S{i}" for i in range(n_subjects)]
    lm = linear_toy(subjects, extra=[f"W{i}" for i in range(30)], seed=seed)
    template = "The capital of {} is"
    pred = next_token_predictions(lm, template, subjects)
    objects = lm.tokenizer.convert_ids_to_tokens(pred.tolist())
    facts = [Fact(s, o) for s, o in zip(subjects, objects) if o not in ("<s>", "<pad>", "</s>", "[UNK]")]
    assert len({f.object for f in facts}) >= 4 and len(facts) >= 30
    return lm, Relation("toy", [template], ["{}"], facts, {}), template


def _run_toy(lm, rel, template, **options):
    known = {"toy": _all_known(rel.facts, template)}
    return run_analyses(lm, [rel], known, [0, 1], analyses=options.pop("analyses", ("lre",)), progress=False,
                        **{**FAST, "max_test_pairs": 15, **options})["relations"]["toy"]


@pytest.fixture(scope="module")
def toy():
    return _toy_relation()


@pytest.fixture(scope="module")
def toy_lre(toy):
    return _run_toy(*toy, analyses=("lre", "ridge"))


def test_planted_lre_is_faithful_and_causal_beyond_its_controls(toy_lre):
    """On the exactly linear toy the LRE at layer 0 is exact: faithfulness and causality 1, above the majority,
    random-direction and random-operator controls; full patching (a reference) works too."""
    entry = toy_lre["layers"]["0"]["lre"]
    faith, causal = entry["faithfulness"], entry["causality"]
    assert faith["value"] == 1.0 and faith["ci"][0] > faith["nulls"]["majority"]["value"]
    # the toy's answer is affine in the state after block 0: a lexical world, which its lexical null reads in full
    assert faith["nulls"]["lexical"]["value"] == 1.0
    assert causal["value"] == 1.0 and causal["nulls"]["full_patch"]["value"] == 1.0
    for control in ("random_direction", "random_operator"):
        assert causal["ci"][0] > causal["nulls"][control]["ci"][1], control
    assert toy_lre["model_accuracy"] == 1.0


def test_causality_with_a_random_W_of_the_same_spectrum_drops_to_its_random_operator_control(toy, monkeypatch):
    """Mutation of the estimator: the Jacobians replaced by random matrices with W's singular values. The
    reference edit W^+ (o_t - o_s) then no longer reaches the target, and causality falls to its random_operator
    control. (The old edit, W^+ (op(h_t) - op(h_s)) / beta = a projection of h_t - h_s, kept 1.00 here.)"""
    real = decoders_module.subject_jacobians
    gen = torch.Generator().manual_seed(5)

    def random_jacobians(*args, **kwargs):
        out = real(*args, **kwargs)
        for result in out.values():
            result.J[:] = random_spectrum_like(result.J.double().mean(0), gen).to(result.J.dtype)
        return out
    monkeypatch.setattr(decoders_module, "subject_jacobians", random_jacobians)
    causal = _run_toy(*toy)["layers"]["0"]["lre"]["causality"]
    assert causal["value"] <= 0.4
    assert causal["ci"][0] <= causal["nulls"]["random_operator"]["value"] <= causal["ci"][1] + 0.1


def test_selections_never_look_at_the_test_labels(toy, toy_lre):
    """Permuting the objects of the test subjects changes test numbers only: beta, rank, edit rank, ridge alpha
    and the selected layers are chosen on validation subjects. (Choosing beta on the test subjects fails this.)"""
    lm, rel, template = toy
    test = set(toy_lre["test_subjects"])
    objects = {f.subject: f.object for f in rel.facts}
    order = sorted(test)
    rotated = dict(zip(order, order[1:] + order[:1]))
    facts = [Fact(f.subject, objects[rotated[f.subject]] if f.subject in test else f.object) for f in rel.facts]
    permuted = _run_toy(lm, Relation("toy", [template], ["{}"], facts, {}), template, analyses=("lre", "ridge"))
    assert permuted["test_subjects"] == toy_lre["test_subjects"]
    def selections(out, layer, method):
        return [{k: v for k, v in c.items() if k in ("beta", "rank", "edit_rank", "alpha", "val_faithfulness",
                                                      "val_causality")} for c in out["layers"][layer][method]["chosen"]]
    for layer, method in (("0", "lre"), ("0", "ridge"), ("1", "ridge")):   # layer 1 is the last: no LRE there
        assert selections(permuted, layer, method) == selections(toy_lre, layer, method)
    assert permuted["selected"] == toy_lre["selected"]
    assert permuted["layers"]["0"]["lre"]["faithfulness"]["value"] < 1.0     # the test numbers did change


def test_lre_numbers_do_not_change_when_ridge_is_switched_on(toy, toy_lre):
    alone = _run_toy(*toy)
    assert alone["layers"]["0"]["lre"] == toy_lre["layers"]["0"]["lre"] and "lre" not in alone["layers"]["1"]


def test_two_validation_subjects_still_choose_over_the_whole_grid(toy):
    """15 facts leave 2 validation subjects per re-fit. The (beta, rank) choice is cross-validated over train +
    validation (7 subjects outside the Jacobian prompts), so all 21 candidates are compared and the planted
    answer, beta = 1 with the full W (the toy's exact LRE), is found: test faithfulness 1. (The old thinned grid
    forced beta = 3 here, the only candidate, and reached 0.2; that beta alone still does.)"""
    lm, rel, template = toy
    small = Relation("toy", [template], ["{}"], rel.facts[:15], {})
    out = _run_toy(lm, small, template)
    assert all(r["n_val"] == 2 and r["n_selection"] == 7 and r["n_candidates"] == 21 for r in out["refits"])
    lre = out["layers"]["0"]["lre"]
    assert [(c["beta"], c["rank"], c["n_candidates"]) for c in lre["chosen"]] == [(1.0, None, 21)] * 3
    assert all(c["val_faithfulness"] == 1.0 for c in lre["chosen"]) and lre["faithfulness"]["value"] == 1.0
    forced = _run_toy(lm, small, template, betas=(3.0,))["layers"]["0"]["lre"]["faithfulness"]
    assert forced["value"] < 0.5


def test_causality_controls_have_the_edits_norm_pair_by_pair(toy, monkeypatch):
    """Every control edit beside a causality number (LRE: random_direction, random_operator, scaled_patch;
    ridge: random_direction, scaled_patch) has the edit's norm on each test pair, in the same batched call.
    (The unscaled random operator's edits were 3-6x smaller than the LRE's on SmolLM2.)"""
    calls = []
    real = decoders_module.causality_hits

    def spy(lm, data, layer, deltas, src, tgt, cfg):
        calls.append((deltas, src))
        return real(lm, data, layer, deltas, src, tgt, cfg)
    monkeypatch.setattr(decoders_module, "causality_hits", spy)
    out = _run_toy(*toy, analyses=("lre", "ridge"))
    test_calls = [deltas for deltas, src in calls if len(src) == out["n_test_pairs"] and len(deltas) > 1]
    assert sorted(len(d) for d in test_calls) == [3, 3, 3, 4, 4, 4]          # ridge, LRE: 3 re-fits each
    for deltas in test_calls:
        norms = deltas[0].double().norm(dim=1)
        assert norms.min() > 0
        for control in deltas[1:]:
            torch.testing.assert_close(control.double().norm(dim=1), norms, rtol=1e-9, atol=0)


def test_reference_protocol_uses_in_context_examples_and_the_prefix_rule(toy):
    lm, rel, template = toy
    out = _run_toy(lm, rel, template, protocol="lre", n_icl=3)
    assert out["protocol"] == "lre" and len(out["context_subjects"]) == 3
    assert out["template"].count("\n") == 3 and out["template"].endswith(template)
    assert not set(out["context_subjects"]) & set(out["test_subjects"])
    faith = out["layers"]["0"]["lre"]["faithfulness"]
    assert faith["value"] > faith["nulls"]["majority"]["value"]


def test_planted_superposition_beats_shuffled_and_random_init_controls():
    """Subject embeddings built as e_s = sum_r P_r v_{a_r(s)} (v = unembedding rows of the attributes): the
    readout and the superposition fit must beat the shuffled-attribute and random-init controls. With 3-4
    attributes per relation in 16 dims any vectors can be mapped onto the states, so random vectors of the same
    norms do as well: the gain over random_attributes is ~0. "square dark" opens with the token of "square" (one
    u vector) but moves the state differently: the two are merged into one answer and listed, so the random
    vectors, which would tell them apart, do not 'beat' the true ones."""
    n, d = 60, 16
    subjects = [f"S{i}" for i in range(n)]
    attrs = {"colour": ["red", "green", "blue", "white"], "shape": ["round", "square", "flat", "square dark"]}
    lm = linear_toy(subjects, extra="red green blue white round square flat dark Tell me about .".split(), d=d)
    tok, model = lm.tokenizer, lm.model
    gen = torch.Generator().manual_seed(0)
    table = {name: torch.randint(len(vals), (n,), generator=gen) for name, vals in attrs.items()}
    with torch.no_grad():
        emb = torch.zeros(n, d, dtype=torch.float64)
        for name, vals in attrs.items():
            P = torch.randn(d, d, generator=gen, dtype=torch.float64)
            V = model.head.weight[tok.convert_tokens_to_ids([v.split()[-1] for v in vals])]
            emb += V[table[name]] @ P.T
        emb += 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64)
        model.embed.weight[tok.convert_tokens_to_ids(subjects)] = emb
    rels = [Relation(name, [f"The {name} of {{}} is"], ["Tell me about {} ."],
                     [Fact(s, vals[int(a)]) for s, a in zip(subjects, table[name])], {"subject_type": "thing"})
            for name, vals in attrs.items()]
    res = run_analyses(lm, rels, {}, [0, 1], analyses=("superposition",), progress=False,
                       **{**FAST, "folds": 4, "n_boot": 200})
    assert res["errors"] == []
    sup = res["superposition"]
    assert {k: [sorted(g) for g in v] for k, v in sup["merged_attributes"].items()} == {
        "shape": [["square", "square dark"]]}
    assert sup["first_token_collisions"] == {"colour": 0, "shape": 2}
    for layer in ("0", "1"):
        entry = sup["layers"][layer]
        r2 = entry["r2"]
        assert r2["value"] > 0.7 and r2["ci"][0] > r2["nulls"]["shuffled"]["value"] + 0.3
        assert r2["value"] > r2["nulls"]["random_init"]["value"] + 0.3
        assert abs(r2["gain"]["value"]) < 0.05 and r2["gain"]["ci"][0] < 0.05
        for name in attrs:
            m = entry["readout"][name]
            assert m["value"] >= 0.9, (layer, name, m)
            assert m["ci"][0] > m["nulls"]["shuffled"]["value"] and m["ci"][0] > m["chance"]
            assert m["value"] > m["nulls"]["random_init"]["value"] + 0.2
            assert m["nulls"]["random_attributes"]["value"] <= m["value"] + 0.05


class SelectorToy(nn.Module):
    """A planted geometric fact store. A subject's embedding is the sum of its attribute vectors, one block per
    relation (e_s = sum_r u_{a_r(s)}); a relation word's embedding is a one-hot relation code. Block 1 reads, at
    each position, the running sums of the subject blocks (S) and of the codes (C) and outputs block r of S scaled
    by C_r: the relation selects its block, so relation r's answer is a_r(s) and nothing else moves it."""

    def __init__(self, vocab: int, d_u: int, n_rel: int):
        super().__init__()
        self.d_u, self.n_rel = d_u, n_rel
        d = d_u * n_rel + n_rel
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.points = nn.ModuleList(nn.Identity() for _ in range(2))
        with torch.no_grad():
            self.embed.weight.zero_()
            self.head.weight.zero_()
        self.config = SimpleNamespace(d_model=d, model_type="selector_toy")

    def hook_points(self):
        return {f"blocks.{l}.resid_post": p for l, p in enumerate(self.points)}

    def forward(self, input_ids, **kwargs):
        x = self.points[0](self.embed(input_ids))
        k = self.d_u * self.n_rel
        S, C = x[..., :k].cumsum(1), x[..., k:].cumsum(1)
        gate = C.repeat_interleave(self.d_u, dim=-1)
        out = torch.cat([S * gate, torch.zeros_like(C)], -1)
        return SimpleNamespace(logits=self.head(self.points[1](out)))

    def unembed(self, resid):
        return self.head(resid)

    def get_output_embeddings(self):
        return self.head


def test_swap_edit_through_a_real_forward_pass_on_a_planted_selector():
    """h + W_r (u_b - u_a), with W_r fitted from held-out subjects, makes relation r answer b and leaves the
    other relation's answer alone; a random direction of the same norm does neither."""
    n, d_u = 40, 8
    attrs = {"colour": [f"c{i}" for i in range(6)], "shape": [f"p{i}" for i in range(5)]}
    subjects = [f"S{i}" for i in range(n)]
    tok = word_tokenizer("The of is Tell me about . colour shape".split() + subjects
                         + [a for v in attrs.values() for a in v])
    model = SelectorToy(len(tok), d_u, 2).double().eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    table = {name: torch.randint(len(vals), (n,), generator=gen) for name, vals in attrs.items()}
    with torch.no_grad():
        for r, (name, vals) in enumerate(attrs.items()):
            V = torch.linalg.qr(torch.randn(d_u, d_u, generator=gen, dtype=torch.float64))[0][:len(vals)]
            model.head.weight[tok.convert_tokens_to_ids(vals), r * d_u:(r + 1) * d_u] = V
            model.embed.weight[tok.convert_tokens_to_ids(subjects), r * d_u:(r + 1) * d_u] = V[table[name]]
            model.embed.weight[tok.convert_tokens_to_ids(name), 2 * d_u + r] = 1.0
    lm = LoadedModel(model, tok, ModelAdapter(model), {"name": "selector_toy"})
    rels = [Relation(name, [f"The {name} of {{}} is"], ["Tell me about {} ."],
                     [Fact(s, vals[int(a)]) for s, a in zip(subjects, table[name])], {"subject_type": "thing"})
            for name, vals in attrs.items()]
    for rel in rels:                                             # the planted model knows every fact
        pred = next_token_predictions(lm, rel.templates[0], subjects)
        assert tok.convert_ids_to_tokens(pred.tolist()) == [f.object for f in rel.facts]
    res = run_analyses(lm, rels, {}, [0], analyses=("superposition",), progress=False,
                       **{**FAST, "folds": 4, "swap_layers": (0,), "max_swap_subjects": 16, "swap_scales": (1.0,),
                          "random_control": False})
    assert res["errors"] == []
    swap = res["superposition"]["layers"]["0"]["swap"]["by_scale"][0]
    success, others = swap["success"], swap["others_unchanged"]
    assert success["n"] >= 16 and success["value"] >= 0.9 and others["value"] >= 0.9
    assert success["ci"][0] > success["nulls"]["random_direction"]["ci"][1]


def test_neutral_templates_that_open_with_the_subject_are_dropped_without_a_bos_token(tmp_path):
    """Without a leading special token the subject of "{}" sits at position 0 (the attention sink)."""
    gpt2 = load_model(str(save_tiny("gpt2", tmp_path / "gpt2")), device="cpu")  # no BOS
    rel = Relation("r", ["The capital of {} is"], ["{}", "{} is a country.", "Tell me about {}."],
                   [Fact("France", "Paris")], {})
    assert neutral_templates(gpt2.tokenizer, [rel], None) == (["Tell me about {}."], ["{}", "{} is a country."])
    assert neutral_templates(gpt2.tokenizer, [rel], ("{}",)) == (["{}"], [])
