"""The mechanism analyses of the pretrained model (``llmprobe.analyses.selector``: crosspatch, selector;
``llmprobe.analyses.multihop``) on planted models with known answers -- the paper's construction (a perfect
relation-conditioned selector) and a key-value memory whose MLP reads only the subject (no selector) -- and every
family's tiny model, taught a few facts, through every new analysis.

Each planted test was checked to fail when its measure is broken on purpose (a mutated copy of the module): a
transplant that copies the donor's whole activation instead of its gate (the construction keeps 0.25 of its
answers; kept in the suite as a test), gates read at the first token instead of the last (the construction's
same-relation transplant breaks, its relation share drops to 0), the relation share computed from subject means
(0), rows shuffled across subjects instead of relations within a subject (the shuffled control stays at 1), the
random-units control drawn among closed units (5 units off instead of 3), the same-relation transplant left out
(the key-value memory keeps 1.0)."""
import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import FAMILIES, save_tiny

import llmprobe.analyses.multihop as multihop_module
import llmprobe.analyses.selector as selector_module
import llmprobe.model.engine as engine_module
from llmprobe.analyses.multihop import chains, compositions, prompts_for
from llmprobe.analyses.registry import by_name
from llmprobe.analyses.run import Runner, run_analyses
from llmprobe.analyses.selector import (
    LRE_PAIR_ITEMS,
    PAIR_ITEMS,
    PromptSet,
    blocks_of,
    crosspatch_items,
    edited_predictions,
    fact_grid,
    gate_transplant,
    gating_index,
    last_gates,
    mlp_hooks,
    random_units,
    transplant_metrics,
)
from llmprobe.analyses.settings import Log, settings_from
from llmprobe.datasets import Fact, Relation, load_relations
from llmprobe.metric import iter_metrics
from llmprobe.model.capture import adapter_for, capture
from llmprobe.model.known import known_facts, object_split
from llmprobe.model.loading import load_model
from llmprobe.model.random_init import random_init
from llmprobe.model.scoring import first_token_targets
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.mechanisms import gate_transplant as synthetic_gate_transplant
from synthetic.tasks import random_functions

N, R, N_ATTR = 12, 3, 4


# --------------------------------------------------------------------------------------------- planted models
@pytest.fixture(scope="module")
def task():
    return random_functions(N, R, N_ATTR, seed=0)            # each relation its own 4 attributes


@pytest.fixture(scope="module")
def construction(task):
    """The paper's construction (block superposition, ReLU selector), the smallest block that answers all."""
    for b in range(2, 9):
        model = build_construction(task, b)
        if construction_accuracy(model, task) == 1.0:
            return model
    raise AssertionError("no construction answers every fact")


@pytest.fixture(scope="module")
def key_value(task):
    """A one-layer model whose MLP is a key-value memory reading only the subject
    (``synthetic.construction.build_subject_memory``: one ReLU unit per subject writes all of the subject's
    attributes; the relation embedding lifts the queried relation's attribute set). Answers every fact, and no
    gate depends on the relation."""
    model = build_subject_memory(task)
    assert construction_accuracy(model, task) == 1.0
    return model


def _sets(task, seed=0):
    """Every fact (s, r) with a donor s' whose answer under r differs, and a random other relation r'."""
    s, r, a = task.facts()
    gen = random.Random(seed)
    donors = torch.tensor([gen.choice([j for j in range(N) if task.table[j, q] != task.table[i, q]])
                           for i, q in zip(s.tolist(), r.tolist())])
    others = (r + torch.tensor([gen.randrange(1, R) for _ in r.tolist()])) % R
    rows = lambda subj, rel: PromptSet.of_ids(torch.stack([subj, N + rel], 1))  # noqa: E731
    return rows(s, r), rows(donors, r), rows(s, others), a


def _transplant(model, task):
    own, same, other, answers = _sets(task)
    return gate_transplant(model, own, same, other, answers, [0], torch.Generator().manual_seed(0))


def _grid_gates(model, controls=None):
    ids = torch.tensor([[s, N + r] for s in range(N) for r in range(R)])
    gates, _ = last_gates(model, PromptSet.of_ids(ids), [0])
    control = {name: last_gates(m, PromptSet.of_ids(ids), [0])[0] for name, m in (controls or {}).items()}
    return gating_index(gates, N, R, control, n_boot=200)["0"]


def test_construction_is_a_perfect_selector(construction, task):
    hits = _transplant(construction, task)
    assert bool(hits["clean"].all()) and bool(hits["same_relation"].all())   # another subject's gates: kept
    assert float(hits["other_relation"].double().mean()) == 0.0       # another relation's gates: broken
    metrics = transplant_metrics(hits, n_boot=200)
    assert metrics["same_relation"]["value"] == 1.0 and metrics["same_relation"]["n"] == N * R
    assert metrics["same_minus_other"]["value"] == 1.0
    assert metrics["same_relation"]["ci"][0] > metrics["same_relation"]["nulls"]["other_relation_gate"]["ci"][1]
    assert set(metrics["same_relation"]["nulls"]) == {"other_relation_gate", "random_units"}


def test_key_value_memory_fails_the_selector_test(key_value, task):
    """Another subject's gates switch the subject's memory off (its own unit closed, the donor's open on values
    that are negative for this subject): the answer is lost, kept only where the queried relation's attributes
    tie; another relation's gates are the subject's own."""
    hits = _transplant(key_value, task)
    assert float(hits["same_relation"].double().mean()) < 0.4
    assert bool(hits["other_relation"].all())                         # the relation's gates change nothing
    metrics = transplant_metrics(hits, n_boot=200)
    assert metrics["same_minus_other"]["ci"][1] < -0.4 and metrics["same_relation"]["ci"][1] < 0.6


def test_the_calibrated_selector_test_passes_the_construction_and_fails_the_memory(construction, key_value, task):
    """The selector line's test (``selector_keep``: the same-relation keep rate against the other-relation gates
    and a switch-off matched in count and norm), by the pretrained run's code on both planted models."""
    from llmprobe.report.claims import ALPHA, selector_test
    got = {}
    for name, model in (("construction", construction), ("memory", key_value)):
        own, same, other, answers = _sets(task)
        hits = gate_transplant(model, own, same, other, answers, [0], torch.Generator().manual_seed(0),
                               matched_gen=torch.Generator().manual_seed(1))
        metrics = transplant_metrics(hits, n_boot=200)
        assert set(metrics["selector_keep"]["nulls"]) == {"other_relation_gate", "random_units_matched"}
        got[name] = (metrics, selector_test(metrics))
    metrics, test = got["construction"]
    assert metrics["random_units_matched"]["value"] < 0.3 and metrics["same_minus_random"]["value"] > 0.7
    assert test["measure"] == "keep" and test["p"] < ALPHA                   # supported even alone
    metrics, test = got["memory"]
    assert metrics["random_units_matched"]["value"] == 1.0       # its relation gates move no unit: nothing switched off
    assert test["p_zero"] > 0.5 and test["difference"]["value"] < -0.5


def test_a_transplant_of_the_whole_activation_would_fail_the_construction(construction, task, monkeypatch):
    """The mutation that keeps test_construction_is_a_perfect_selector honest: copy the donor's activation (values
    and gate) instead of its gate, and the construction no longer keeps its answers."""
    monkeypatch.setattr(selector_module, "gate_of", lambda pre, out, gated: out)
    monkeypatch.setattr(selector_module, "_with_gate", lambda pre, gate, gated: gate)
    assert float(_transplant(construction, task)["same_relation"].double().mean()) < 0.5


def test_gating_index_is_all_relation_in_the_construction_and_all_subject_in_the_memory(construction, key_value):
    sel = _grid_gates(construction, {"random_init": random_init(construction, seed=3)})
    assert sel["relation_share"]["value"] > 0.99 and sel["subject_share"]["value"] < 0.01
    assert sel["relation_share"]["nulls"]["shuffled_relations"]["value"] < 0.5
    assert sel["relation_share"]["nulls"]["random_init"]["value"] < 0.99
    memory = _grid_gates(key_value)
    assert memory["relation_share"]["value"] < 0.01 and memory["subject_share"]["value"] > 0.99
    assert memory["subject_share"]["ci"][0] > 0.9 and memory["relation_share"]["n"] == N


def test_gates_are_the_synthetic_controls_relu_masks_and_both_worlds_agree(construction, key_value, task):
    """The gate of a ReLU MLP is the on/off mask synthetic.mechanisms.gate_transplant transplants, and its
    numbers give the same verdicts as ours on both planted models."""
    own, _, _, _ = _sets(task)
    gates, open_ = last_gates(construction, own, [0])
    mid = capture(construction, ["blocks.0.resid_mid"], own.ids)["blocks.0.resid_mid"][:, -1]
    mask = (mid @ construction.W_in + construction.b_in > 0).float()
    assert torch.equal(gates[0], mask) and torch.equal(open_[0], mask.bool())
    theirs = synthetic_gate_transplant(construction, task)
    assert theirs["same_relation"] == 1.0 and theirs["same_subject"] < 0.1
    theirs = synthetic_gate_transplant(key_value, task)
    assert theirs["same_relation"] < 0.5 and theirs["same_subject"] == 1.0


def test_an_interrupted_run_takes_the_mechanism_analyses_over(construction):
    """run_analyses' checkpoint: finished mechanism entries of an earlier result are kept as they are (their errors
    listed again), nothing is recomputed."""
    lm = SimpleNamespace(adapter=adapter_for(construction), tokenizer=None)
    done = {"crosspatch": {"layers": {"0": "kept"}, "error": None}, "selector": {"error": "too few facts"},
            "multihop": {"compositions": [], "error": None}}
    res = run_analyses(lm, [], {}, [0], analyses=("crosspatch", "selector", "multihop"), progress=False,
                       runner=Runner(done=done))
    assert all(res[name] is done[name] for name in done) and res["errors"] == ["selector: too few facts"]
    assert res["partial"] is False and {"crosspatch_seconds", "multihop_seconds"} <= set(res["timing"])


def test_random_units_switch_off_as_many_open_units_as_the_transplant_moves():
    own = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    other = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    keep = random_units(own, other, torch.Generator().manual_seed(0))
    assert keep[0].sum() == 3 and bool((keep[0][~own[0]] == 1).all())   # 3 units moved: 3 open units off
    assert bool((keep[1] == 1).all())                                   # nothing moved: nothing off


def test_blocks_cover_every_layer_once():
    assert blocks_of(30) == [list(range(k, k + 6)) for k in range(0, 30, 6)]
    assert blocks_of(3) == [[0], [1], [2]]


# ---------------------------------------------------------------------------------- compositions (prompts/)
def test_bundled_compositions_and_their_prompts():
    relations = load_relations()
    names = {c.name for c in compositions(relations)}
    assert {"landmark_country/country_capital", "company_hq_country/country_language",
            "person_citizenship/country_continent", "product_company/company_hq_country/country_capital"} <= names
    facts = {r.name: {f.subject: f.object for f in r.facts} for r in relations}
    comp = next(c for c in compositions(relations) if c.name == "product_company/company_hq_country/country_capital")
    chain = next(c for c in chains(comp, facts) if c.subject == "iPhone")
    assert chain.bridges == ["Apple", "United States"] and chain.answer == "Washington, D.C."
    prompts = prompts_for(comp, [chain], chain)
    assert prompts["cot"].count("iPhone is a product made by Apple. Apple is a company headquartered in the "
                                "country of United States. The capital of United States is Washington, D.C.") == 1
    assert prompts["direct"].endswith("?\nA:") and "Washington, D.C.\n\n" in prompts["direct"]
    assert len(chains(comp, facts)) > 20
    without = compositions([r for r in relations if r.name != "country_capital"])     # a hop missing: not listed
    assert not any("country_capital" in c.name for c in without) and "landmark_country/country_language" in {
        c.name for c in without}


# ------------------------------------------------------------------------------------------ every family
COUNTRIES = ["France", "Japan", "Brazil", "Egypt", "Kenya", "Mexico", "Italy", "Spain"]


def _taught_relations():
    """Three country relations (four answers each, distinct first tokens in the tiny tokenizer), a landmark ->
    country relation that composes with two of them, and a guide -> landmark relation that composes with both
    (three hops)."""
    out = []
    for name, template, objects in (("capital", "The capital of {} is", ["Paris", "Tokyo", "Brasilia", "Madrid"]),
                                    ("continent", "{} is located in", ["Europe", "Asia", "Oceania", "Portugal"]),
                                    ("language", "The official language of {} is", ["Spanish", "French", "Italy",
                                                                                     "Egypt"])):
        out.append(Relation(name, [template], ["{} is a country."],
                            [Fact(s, objects[i % 4]) for i, s in enumerate(COUNTRIES)], {"subject_type": "country"}))
    composed = {"capital": ["Capital of {}'s land?"], "continent": ["Continent of {}'s land?"]}
    marks = ["Eiffel", "Big Ben", "Louvre", "Sphinx", "Alhambra", "Fuji"]
    out.append(Relation("landmark_country", ["{} is in"], ["Tell me about {}."],
                        [Fact(m, COUNTRIES[i]) for i, m in enumerate(marks)],
                        {"subject_type": "landmark", "composed_templates": composed}))
    guides = ["Ann", "Bob", "Cy", "Dee", "Eve", "Fay"]                    # k = 3: guide -> landmark -> country -> capital
    out.append(Relation("guide_landmark", ["{} shows"], ["{}."], [Fact(g, m) for g, m in zip(guides, marks)],
                        {"subject_type": "guide", "composed_templates": {
                            "landmark_country/capital": ["Capital via {}?"]}}))
    return out


def _teach(lm, relations, steps=120, lr=1e-2):
    """Teacher-forced Adam steps on every fact's object tokens after its prompt (a few seconds per family)."""
    tok, model = lm.tokenizer, lm.model
    seqs = [object_split(tok, r.templates[0].replace("{}", f.subject, 1), f.object, add_special_tokens=True)
            for r in relations for f in r.facts]
    width = max(len(full) for full, _ in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (full, cut) in enumerate(seqs):
        ids[i, :len(full)], mask[i, :len(full)] = torch.tensor(full), 1
        labels[i, cut:len(full)] = torch.tensor(full[cut:])
    model.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.requires_grad_(False)


def _taught(family: str, tmp_path_factory):
    lm = load_model(str(save_tiny(family, tmp_path_factory.mktemp(family))), device="cpu", dtype="float32")
    relations = _taught_relations()
    _teach(lm, relations)
    return lm, relations, {r.name: known_facts(lm, r) for r in relations}


@pytest.fixture(scope="module", params=FAMILIES)
def taught(request, tmp_path_factory):
    return _taught(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def taught_llama(tmp_path_factory):
    return _taught("llama", tmp_path_factory)


def test_crosspatch_goes_on_when_a_relation_has_no_item_as_the_receiving_one(taught_llama):
    """A relation whose known facts all share one answer gives states (A) but can receive none (B: no recipient of
    another answer); crosspatch failed on it ("torch.cat(): expected a non-empty list of Tensors"), as
    country_subregion did in a SmolLM2 run at --max-facts 60. Now it measures the other relations."""
    lm, relations, known = taught_llama
    one = next(f.object for f in known["capital"] if f.known)         # every known capital answered alike
    few = {**known, "capital": [dataclasses.replace(f, object=one) for f in known["capital"]]}
    grid = fact_grid(lm.tokenizer, relations, few, settings_from())
    assert "capital" in grid.names and not any(
        grid.names[b] == "capital" for _, b, *_ in crosspatch_items(lm.tokenizer, grid, settings_from())[1])
    res = run_analyses(lm, relations, few, [0, 1, 2], analyses=("crosspatch",), progress=False, n_boot=50)
    cross = res["crosspatch"]
    assert res["errors"] == [] and cross["n_items"] > 0
    pairs = cross["layers"]["0"]["pairs"]
    assert pairs and all(pair["target"] != "capital" for pair in pairs)


def test_crosspatch_patches_more_items_at_the_lre_layers(taught_llama):
    """The claim's layer is an LRE layer: there crosspatch patches up to ``LRE_PAIR_ITEMS`` items per ordered
    pair, at the other layers each pair's first ``PAIR_ITEMS`` of the same items (the per-layer profile), and
    each layer's entry says its n (``n_items``)."""
    lm, relations, known = taught_llama
    cfg = settings_from(3, 0, 90, n_boot=50, lre_layers=(1,))          # layers 0, 1 patched; LRE layer 1
    grid = fact_grid(lm.tokenizer, relations, known, cfg)
    _, items = crosspatch_items(lm.tokenizer, grid, cfg)
    per_pair = {pair: sum(x[:2] == pair for x in items) for pair in dict.fromkeys(x[:2] for x in items)}
    assert set(per_pair.values()) == {LRE_PAIR_ITEMS} and LRE_PAIR_ITEMS > PAIR_ITEMS    # every pair filled
    assert items[:3] == [x for x in items if x[:2] == items[0][:2]][:3]     # drawn pair by pair
    res = run_analyses(lm, relations, known, [0, 1, 2], analyses=("crosspatch",), progress=False, n_boot=50,
                       lre_layers=(1,))
    cross = res["crosspatch"]
    graded, profile = cross["layers"]["1"], cross["layers"]["0"]
    assert cross["n_items"] == graded["n_items"] == graded["neutral"]["n"] == len(items)
    assert profile["n_items"] == profile["neutral"]["n"] == sum(min(n, PAIR_ITEMS) for n in per_pair.values())
    assert {(p["source"], p["target"]): p["neutral"]["n"] for p in profile["pairs"]} == {
        (grid.names[a], grid.names[b]): min(n, PAIR_ITEMS) for (a, b), n in per_pair.items()}
    assert {(p["source"], p["target"]): p["neutral"]["n"] for p in graded["pairs"]} == {
        (grid.names[a], grid.names[b]): n for (a, b), n in per_pair.items()}


def test_every_family_runs_every_new_analysis(taught, monkeypatch):
    lm, relations, known = taught
    monkeypatch.setattr(multihop_module, "FEW_SHOT", 1)     # the tiny models read at most 128 tokens
    assert sum(f.known for f in known["capital"]) >= 6 and sum(f.known for f in known["landmark_country"]) >= 4
    assert sum(f.known for f in known["guide_landmark"]) >= 4
    res = run_analyses(lm, relations, known, [0, 1, 2], analyses=("crosspatch", "selector", "multihop"),
                       progress=False, n_boot=50, folds=3)
    assert res["errors"] == [] and {"crosspatch_seconds", "selector_seconds", "multihop_seconds"} <= set(res["timing"])
    cross = res["crosspatch"]
    assert set(cross["layers"]) == {"0", "1"} and cross["n_items"] > 0       # the last layer cannot reach the answer
    assert cross["recipients_clean"]["value"] > 0.5
    for entry in cross["layers"].values():
        assert entry["cross_relation"]["n"] == cross["n_items"] == sum(p["neutral"]["n"] for p in entry["pairs"])
        assert set(entry["cross_relation"]["nulls"]) == {"random_subject", "random_vector"}
    sel = res["selector"]
    assert sel["mlp"] == ("plain" if lm.adapter.model_type in ("phi", "gpt2") else "gated")
    assert set(sel["gating"]["layers"]) == {"0", "1", "2"}
    transplant = sel["gate_transplant"]
    assert transplant["error"] is None and transplant["block"] in [[0], [1], [2]] and transplant["n_items"] > 0
    assert transplant["clean"]["value"] > 0.5
    assert transplant["selector_keep"]["n"] == transplant["random_units_matched"]["n"] == transplant["n_items"]
    parts = transplant["by_relation"]        # the same test facts split by their own relation
    assert set(parts) <= {r.name for r in relations} and sum(p["n_items"] for p in parts.values()) == \
        transplant["n_items"]
    for part in parts.values():
        assert (part["error"] is None) == (part["n_items"] >= selector_module.MIN_RELATION_ITEMS)
        if part["error"] is None:
            assert part["same_relation"]["n"] == part["other_relation"]["n"] == part["n_items"]
    if all(p["error"] is None for p in parts.values()):
        for key in ("same_relation", "other_relation", "random_units", "clean"):
            assert math.isclose(sum(p[key]["value"] * p["n_items"] for p in parts.values()),
                                transplant[key]["value"] * transplant["n_items"], abs_tol=1e-9), key
    hop = res["multihop"]
    assert [c["name"] for c in hop["compositions"]] == ["landmark_country/capital", "landmark_country/continent",
                                                        "guide_landmark/landmark_country/capital"]
    assert hop["pooled"]["k=2"]["n_items"] == sum(c["n_items"] for c in hop["compositions"] if c["k"] == 2)
    assert hop["pooled"]["k=3"]["n_items"] == hop["compositions"][2]["n_items"] > 0 and hop["skipped"] == {}
    assert set(hop["latent_bridge"]["layers"]) == {"0", "1", "2"}
    assert set(hop["latent_bridge"]["layers"]["0"]["readout"]["nulls"]) == {"shuffled", "majority", "random_init"}
    seen = 0
    for path, metric in iter_metrics({k: res[k] for k in ("crosspatch", "selector", "multihop")}):
        if metric["n"] and metric["value"] is not None and not math.isnan(metric["value"]):
            lo, hi = metric["ci"]
            assert lo - 1e-12 <= metric["value"] <= hi + 1e-12, path
            seen += 1
    assert seen > 50


def test_bridge_partners_pair_each_item_with_another_answer_of_its_group():
    groups, answers = ["a", "a", "a", "b", "b", "c"], [1, 1, 2, 3, 3, 4]
    for seed in range(5):
        partners = multihop_module.bridge_partners(groups, answers, random.Random(seed))
        assert partners[:2] == [2, 2] and partners[2] in (0, 1) and partners[3:] == [None, None, None]
        assert partners == multihop_module.bridge_partners(groups, answers, random.Random(seed))   # seeded
    assert {multihop_module.bridge_partners(groups, answers, random.Random(s))[2] for s in range(20)} == {0, 1}


def test_the_wrong_bridge_prompt_carries_another_chains_bridge_scored_on_both_answers(taught_llama, monkeypatch):
    """Each chain's wrong-bridge prompt is its ceiling's prompt with the bridge of another chain of its composition
    whose answer's first token differs; its hits score the next token on that prompt (planted here: the chain's own
    answer on even chains, the other chain's on odd ones) against the chain's own answer and the other chain's, NaN
    where no such chain exists (a composition whose chains share one answer); the entry counts those chains and
    pairs cot_minus_wrong_bridge over the others."""
    lm, relations, known = taught_llama
    monkeypatch.setattr(multihop_module, "FEW_SHOT", 1)
    tok, cfg = lm.tokenizer, settings_from(3, 0, 90, n_boot=50, folds=3)
    rows, _ = multihop_module.item_rows(compositions(relations), relations, known, cfg)
    pairs = [(comp.name, c.answer) for comp, c, _ in rows]
    name, one = max(pairs, key=pairs.count)                  # a composition left with chains of one answer only
    rows = [r for r in rows if r[0].name != name or r[1].answer == one]
    assert sum(r[0].name == name for r in rows) >= 2
    ceiling = [multihop_module.ceiling_prompt(*r) for r in rows]
    first = first_token_targets(tok, ceiling, [c.answer for _, c, _ in rows]).tolist()
    partners, prompts = multihop_module.wrong_bridge_prompts(tok, rows, ceiling, cfg)
    for i, ((comp, chain, p), j) in enumerate(zip(rows, partners)):
        others = [k for k, r in enumerate(rows) if r[0].name == comp.name and first[k] != first[i]]
        if j is None:
            assert others == [] and prompts[i] is None
            continue
        assert j in others
        bridges = rows[j][1].bridges
        assert prompts[i] == p["cot"] + " " + multihop_module.statement(comp.hops[0], chain.subject) + "".join(
            f" {b}. " + multihop_module.statement(h, b) for h, b in zip(comp.hops[1:], bridges))
    missing = [j is None for j in partners]
    assert any(missing) and not all(missing)
    targets = {i: first_token_targets(tok, [prompts[i]] * 2, [rows[i][1].answer, rows[j][1].answer]).tolist()
               for i, j in enumerate(partners) if j is not None}
    planted = {prompts[i]: both[i % 2] for i, both in targets.items()}   # even: its own answer; odd: the other's
    real = multihop_module.last_token

    def next_tokens(model, texts, layers, batch_size=32):          # the model's, but on the wrong-bridge prompts
        said, states = real(model, texts, layers, batch_size)
        return torch.tensor([planted.get(t, int(x)) for t, x in zip(texts, said)]), states
    monkeypatch.setattr(multihop_module, "last_token", next_tokens)
    hits = multihop_module._chain_of_thought(lm, rows, cfg)
    assert torch.isnan(hits["wrong_bridge"]).tolist() == missing == torch.isnan(hits["wrong_bridge_follows"]).tolist()
    for i in targets:
        assert (hits["wrong_bridge"][i], hits["wrong_bridge_follows"][i]) == ((1.0, 0.0) if i % 2 == 0 else (0.0, 1.0))
    direct = torch.zeros(len(rows), dtype=torch.bool)
    entry = multihop_module._accuracy({**hits, "direct": direct}, [c.answer for _, c, _ in rows], cfg)
    paired = [i for i, m in enumerate(missing) if not m]
    assert entry["n_without_wrong_bridge"] == sum(missing) and entry["n_items"] == len(rows)
    assert entry["wrong_bridge"]["n"] == entry["wrong_bridge_follows"]["n"] == entry["cot_minus_wrong_bridge"]["n"] \
        == len(paired)
    assert entry["cot_minus_wrong_bridge"]["value"] == pytest.approx(
        sum(float(hits["cot"][i]) - float(hits["wrong_bridge"][i]) for i in paired) / len(paired))


def test_own_gates_change_nothing_and_other_gates_do(taught):
    """For every MLP type: transplanting a prompt's own gates (all layers) leaves its states as they were;
    another relation's gates move them; an all-ones scale is the identity."""
    lm, relations, _ = taught
    layers = list(range(lm.adapter.n_layers))
    own = PromptSet([relations[0].templates[0]] * 4, COUNTRIES[:4], lm.tokenizer)
    other = PromptSet([relations[2].templates[0]] * 4, COUNTRIES[:4], lm.tokenizer)
    gates, _ = last_gates(lm.model, own, layers)
    donor, _ = last_gates(lm.model, other, layers)
    enc, last = own.batch(slice(0, 4)), "blocks.2.resid_post"

    def put(pre, out, gate, gated):
        new = out.clone()
        new[:, -1] = selector_module._with_gate(pre[:, -1], gate.to(out.dtype), gated)
        return new

    def states(new=None):
        fns = {l: (lambda pre, out, l=l: put(pre, out, new[l], lm.adapter.mlp_gated(l))) for l in layers} if new else {}
        with mlp_hooks(lm.model, fns):
            return capture(lm.model, [last], enc.input_ids, enc.attention_mask)[last][:, -1]
    clean = states()
    torch.testing.assert_close(states(gates), clean, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(states(donor), clean, atol=1e-3)
    ones = {l: torch.ones_like(gates[l]) for l in layers}
    assert torch.equal(edited_predictions(lm.model, own, scale=ones), edited_predictions(lm.model, own))


# ------------------------------------------------------------------------------------------------- the plan
def _count_passes(model, counts: dict) -> list:
    """Hooks adding each block's (rows x tokens) to counts["token_blocks"] and the LM head's rows to
    counts["head_rows"]."""
    adapter, handles = adapter_for(model), []

    def block(module, args, kwargs):
        states = args[0] if args else kwargs["hidden_states"]
        counts["token_blocks"] += states.shape[0] * states.shape[1]

    def head(module, args):
        counts["head_rows"] += args[0].numel() // args[0].shape[-1]
    handles += [b.register_forward_pre_hook(block, with_kwargs=True) for b in adapter.blocks]
    handles.append(adapter.lm_head.register_forward_pre_hook(head))
    return handles


def _planned_passes(work: dict, n_layers: int) -> dict:
    """The same counts of a mechanism workload of ``llmprobe.jobs.plan``."""
    passes = work["forward"] + work["edits"]
    return {"token_blocks": sum(rows * tokens * blocks for batches, blocks, _ in passes for rows, tokens in batches)
            + sum(rows * (prompt + new - 1) * n_layers for rows, prompt, new in work["generate"]),
            "head_rows": sum(rows for batches, _, head in passes if head for rows, _ in batches)
            + sum(rows * new for rows, _, new in work["generate"])}


@pytest.mark.parametrize("analysis,lre_layers", [("crosspatch", None), ("crosspatch", (1,)), ("selector", None),
                                                 ("multihop", None)])
def test_the_plan_counts_the_passes_each_mechanism_analysis_runs(taught_llama, analysis, lre_layers, monkeypatch):
    """``llmprobe plan`` prices the crosspatch, selector and multihop analyses by the passes it counts for them
    (each analysis record's ``workload``, from the analyses' own item builders). Against the passes each
    analysis runs on a taught tiny Llama (hooks on every block and the LM head, of the model and its random
    twins; the near-tie reruns of the cached edits off): the LM-head rows are equal and the token-blocks within
    20% (the plan's upper bounds: the selector's test block as deep as the model, each bridge generated to its
    budget; the prefix-cached edits batched by length, not by group). A plan without the crosspatch's per-layer
    patches, the selector's random twin or the multihop's generation misses by more. The crosspatch also with one
    LRE layer of two patched (its items there, each pair's first three at the other)."""
    lm, relations, known = taught_llama
    monkeypatch.setattr(multihop_module, "FEW_SHOT", 1)      # as test_every_family_runs_every_new_analysis
    monkeypatch.setattr(engine_module, "_MARGIN", 0.0)          # every cached edit's id taken as it is
    counts = {"token_blocks": 0, "head_rows": 0}
    handles = _count_passes(lm.model, counts)
    twins = []

    def counted_twin(*args, **kwargs):
        twin = random_init(*args, **kwargs)
        twins.append(_count_passes(twin.model, counts))
        return twin
    monkeypatch.setattr(selector_module, "random_init", counted_twin)
    monkeypatch.setattr(multihop_module, "random_init", counted_twin)
    cfg = settings_from(3, 0, 90, n_boot=50, folds=3, lre_layers=lre_layers)
    layers, n_layers = [0, 1, 2], lm.adapter.n_layers
    run = {"crosspatch": selector_module.crosspatch, "selector": selector_module.selector,
           "multihop": multihop_module.multihop}[analysis]
    try:
        run(lm, relations, known, layers, cfg, Log(False))
    finally:
        for handle in handles + [h for hs in twins for h in hs]:
            handle.remove()
    work = by_name(analysis).workload(lm.tokenizer, relations, known, layers, n_layers, cfg, (analysis,))
    planned = _planned_passes(work, n_layers)
    assert counts["token_blocks"] > 0 and planned["head_rows"] == counts["head_rows"]
    assert 0.8 < planned["token_blocks"] / counts["token_blocks"] < 1.2, (planned, counts)
    assert work["twins"] == len(twins)
