"""Parity of ``--protocol lre --set analysis.lre_selection=as-published`` with the LRE reference (Hernandez et al.
2023, github.com/evandez/relations), step for step, on tiny random models.

The reference's computation is written here again from its definitions, with the Hugging Face model alone (hooks
on its blocks, ``torch.autograd.functional.jacobian``, its own final norm and head; nothing of llmprobe's engine):
each training fact prompted with the others (``make_prompt``: the template filled, then the fact's object, one line
each, its own subject's lines left out, the start text before all) gives J_i = d z / d h (h: the subject's last
token at the layer, z: the last block's output at the prompt's last token) and b_i = z_i - J_i h_i; W = mean J_i,
b = mean b_i; the known test facts (sorted by subject) are prompted with all training lines; faithfulness: the
decoded top-1 token of head(beta W h + b), stripped and lower-cased, a non-empty prefix of the object, beta the
first best of the reference's grid; causality: h_s + pinv_r(W) (z_t - z_s) at the subject's last token of s's
prompt, the next token a prefix of t's object, r the first best of its rank grid. The same training facts and the
same edit pairs are fed to both (the reference draws them with Python's ``random``), and W, b, beta, the edit
rank, faithfulness and causality must agree within 1e-5. GPT-2 gets the reference's start text (its EOS) and grid
(beta 0..5, ranks 0..312); a ``LlamaForCausalLM`` its LLaMA grid (beta 0..10, ranks 0..504) and no start text (its
tokenizer adds BOS itself).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import save_tiny

import llmprobe.analyses.decoders as decoders_module
from llmprobe.analyses.settings import settings_from
from llmprobe.datasets import Fact, Relation, load_relations, lre_as_read
from llmprobe.model.known import CONTEXT, KNOWN, FactResult, context_draws, covering_order
from llmprobe.model.loading import load_model

TEMPLATE = "The capital of {} is"
TRAIN = [Fact("France", "Paris"), Fact("Japan", "Tokyo"), Fact("Brazil", "Brasilia")]
TEST_SUBJECTS = ["Germany", "Italy", "Spain", "Portugal", "Egypt", "Kenya", "Mexico", "Albert", "Marie", "Europe",
                 "Asia", "Africa"]
GRID = {"gpt2": (5.0, 320, "</s>"), "llama": (10.0, 512, "")}     # beta max, rank limit, start text


# ------------------------------------------------------------------------- the reference, from its definitions
def _blocks(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _head(model, z: torch.Tensor) -> torch.Tensor:
    norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
    return model.lm_head(norm(z))


def make_prompt(template: str, subject: str, examples: list[Fact], start: str) -> str:
    others = [x for x in examples if x.subject != subject]
    return start + "\n".join(template.format(x.subject) + f" {x.object}" for x in others) + "\n" + \
        template.format(subject)


def _encode(tok, prompt: str, subject: str) -> tuple[torch.Tensor, int]:
    enc = tok(prompt, return_offsets_mapping=True)
    lo = prompt.rindex(subject)
    hi = lo + len(subject)
    last = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo)
    return torch.tensor([enc["input_ids"]]), last


def _run(model, ids, layer: int, pos: int, h=None, delta=None) -> tuple[dict, torch.Tensor]:
    """Block outputs {l: [1, seq, d]} and the logits at the last token, h (or h + delta) put at (layer, pos)."""
    seen, hooks = {}, []

    def hook_of(l):
        def hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            if l == layer and (h is not None or delta is not None):
                x = x.clone()
                x[0, pos] = h if h is not None else x[0, pos] + delta
                output = (x, *output[1:]) if isinstance(output, tuple) else x
            seen[l] = x
            return output
        return hook
    for l, block in enumerate(_blocks(model)):
        hooks.append(block.register_forward_hook(hook_of(l)))
    try:
        logits = model(input_ids=ids).logits[0, -1]
    finally:
        for hk in hooks:
            hk.remove()
    return seen, logits


def prefix_hit(tok, token: int, target: str) -> bool:
    pred = tok.decode([token]).lower().strip()
    return len(pred) > 0 and target.lower().strip().startswith(pred)


def reference_trial(lm, layer: int, train: list[Fact], test: list[Fact], pairs: list[tuple[int, int]],
                    family: str, betas: list[float] | None = None, ranks: list[int] | None = None) -> dict:
    model, tok = lm.model, lm.tokenizer
    beta_max, rank_limit, start = GRID[family]
    last = len(_blocks(model)) - 1
    Js, bs = [], []
    for fact in train:
        ids, pos = _encode(tok, make_prompt(TEMPLATE, fact.subject, train, start), fact.subject)
        seen, _ = _run(model, ids, layer, pos)
        h0, z0 = seen[layer][0, pos].detach(), seen[last][0, -1].detach()
        J = torch.autograd.functional.jacobian(lambda h: _run(model, ids, layer, pos, h=h)[0][last][0, -1], h0)
        Js.append(J)
        bs.append(z0 - J @ h0)
    W, b = torch.stack(Js).mean(0), torch.stack(bs).mean(0)
    hs, zs, prompts = [], [], []
    for fact in test:
        ids, pos = _encode(tok, make_prompt(TEMPLATE, fact.subject, train, start), fact.subject)
        seen, _ = _run(model, ids, layer, pos)
        hs.append(seen[layer][0, pos])
        zs.append(seen[last][0, -1])
        prompts.append((ids, pos))
    betas = torch.linspace(0, beta_max, steps=21).tolist() if betas is None else betas
    faith = []
    for beta in betas:
        hits = [prefix_hit(tok, int(_head(model, beta * (W @ h) + b).argmax()), f.object) for h, f in zip(hs, test)]
        faith.append(sum(hits) / len(hits))
    U, S, Vh = torch.linalg.svd(W)
    ranks = list(range(0, rank_limit, 8)) if ranks is None else ranks
    causal, pinvs = [], []
    for r in ranks:
        pinv = Vh[:r].T @ torch.diag(1 / S[:r]) @ U[:, :r].T
        pinvs.append(pinv)
        hits = []
        for s, t in pairs:
            ids, pos = prompts[s]
            _, logits = _run(model, ids, layer, pos, delta=pinv @ (zs[t] - zs[s]))
            hits.append(prefix_hit(tok, int(logits.argmax()), test[t].object))
        causal.append(sum(hits) / len(hits))
    best_b = max(range(len(betas)), key=lambda i: (faith[i], -i))
    best_r = max(range(len(ranks)), key=lambda i: (causal[i], -i))
    return {"W": W, "b": b, "beta": betas[best_b], "faithfulness": faith[best_b], "edit_rank": ranks[best_r],
            "causality": causal[best_r], "curves": (faith, causal), "pinvs": pinvs}


# ------------------------------------------------------------------------------------------------ the test
@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request, tmp_path_factory):
    """The tiny model, its 2-d weights x 8 (at their init scale W is so small that beta and the edits change
    nothing and every choice would be the grid's first)."""
    family = request.param
    lm = load_model(str(save_tiny(family, tmp_path_factory.mktemp(family))), device="cpu", dtype=torch.float64)
    with torch.no_grad():
        for parameter in lm.model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(8.0)
    return family, lm


def _relation(lm, family: str) -> tuple[Relation, list[FactResult]]:
    """The training facts, then test facts whose objects are among the model's own 3 first answers under the
    reference's prompt (a random model answers nearly every prompt alike: the k-th answer of the k-th subject
    mod 3 varies them), given as known in one trial's draw (the filter is tested in test_lre_protocol)."""
    tok, start = lm.tokenizer, GRID[family][2]
    facts = list(TRAIN)
    with torch.no_grad():
        for k, subject in enumerate(TEST_SUBJECTS):
            ids, _ = _encode(tok, make_prompt(TEMPLATE, subject, TRAIN, start), subject)
            ranked = lm.model(input_ids=ids).logits[0, -1].argsort(descending=True)[:3].tolist()
            answer = tok.decode([ranked[k % 3]]).strip()
            if answer and "{" not in answer and "}" not in answer:
                facts.append(Fact(subject, answer))
    relation = Relation("parity", [TEMPLATE], ["{}"], facts)
    results = [FactResult(f.subject, f.object, "", f.object, True, None, [CONTEXT if i < len(TRAIN) else KNOWN])
               for i, f in enumerate(facts)]
    return relation, results


@pytest.mark.parametrize("grids", ["reference", "edits"])
def test_as_published_equals_the_reference_step_for_step(tiny, monkeypatch, grids):
    """"reference": the family's own grids; "edits": beta and rank grids without 0. On these random models an edit
    seldom moves the answer (causality is flat over the ranks), so the edit matrices pinv_r(W) themselves are
    compared as well, at every rank of the grid."""
    family, lm = tiny
    options = {} if grids == "reference" else {"lre_betas": (0.5, 1.0, 2.0, 4.0), "lre_edit_ranks": (8, 16, 24, 32)}
    relation, results = _relation(lm, family)
    assert len({f.object for f in relation.facts[len(TRAIN):]}) >= 3      # pairs exist; causality can vary
    used = []
    real_pairs = decoders_module.object_pairs

    def spy(subjects, objects, sources, gen):
        got = real_pairs(subjects, objects, sources, gen)
        used.append((list(subjects), got))
        return got
    monkeypatch.setattr(decoders_module, "object_pairs", spy)
    cfg = settings_from(protocol="lre", n_icl=len(TRAIN), n_splits=1, lre_selection="as-published", **options)
    fitted: dict = {}
    out = decoders_module.decoders_for_relation(lm, relation, results, [0, 1], [0, 1], [0, 1], True, False, cfg,
                                                lambda message: None, fitted)
    beta_max, rank_limit, start = GRID[family]
    assert out["jacobian_rank"] is None and out["start_text"] == start                       # exact; its start
    betas = list(options.get("lre_betas", torch.linspace(0, beta_max, steps=21).tolist()))
    ranks = list(options.get("lre_edit_ranks", range(0, rank_limit, 8)))
    assert list(out["grid"]["betas"]) == betas and list(out["grid"]["edit_ranks"]) == ranks
    test = sorted(relation.facts[len(TRAIN):], key=lambda f: f.subject)                     # as the reference
    assert out["trials"][0]["test_subjects"] == [f.subject for f in test]
    subjects, (src, tgt) = used[0]
    index = {f.subject: j for j, f in enumerate(test)}
    pairs = [(index[subjects[s]], index[subjects[t]]) for s, t in zip(src.tolist(), tgt.tolist())]
    assert len(pairs) == len(test) and all(test[s].object != test[t].object and s != t for s, t in pairs)
    varied = set()
    for layer in (0, 1):
        ref = reference_trial(lm, layer, TRAIN, test, pairs, family, betas, ranks)
        chosen = out["layers"][str(layer)]["lre"]["chosen"][0]
        assert chosen["beta"] == ref["beta"] and chosen["edit_rank"] == ref["edit_rank"], (layer, chosen, ref)
        assert abs(chosen["test_faithfulness"] - ref["faithfulness"]) <= 1e-5
        assert abs(chosen["test_causality"] - ref["causality"]) <= 1e-5
        varied |= {what for what, curve in zip(("beta", "rank"), ref["curves"]) if len(set(curve)) > 1}
        if layer == fitted["parity"]["lre"]["layer"]:
            fit = fitted["parity"]["lre"]
            scale = float(ref["W"].abs().max())
            assert float((fit["W"].double() - ref["W"]).abs().max()) <= 1e-5 * scale
            assert float((fit["b"].double() - ref["b"]).abs().max()) <= 1e-5 * float(ref["b"].abs().max())
            assert fit["beta"] == ref["beta"] and fit["edit_rank"] == ref["edit_rank"]
            svd = decoders_module.SVD(fit["W"])
            for r, pinv in zip(ranks, ref["pinvs"]):
                if r > svd.keep:      # GPT-2's W has a null direction (LayerNorm): its 1/s ~ 1e15 the reference
                    continue          # divides by and llmprobe leaves out; only at rank d (32 here, never <= 504)
                assert float((svd.pinv(r) - pinv).abs().max()) <= 1e-5 * max(1.0, float(pinv.abs().max()))
    assert "beta" in varied                                   # beta changes faithfulness: the choice is tested
    mean = out["layers"]["0"]["lre"]["reference_mean"]
    assert mean["n_trials"] == 1 and mean["dropped_trials"] == 0
    assert mean["faithfulness"] == out["layers"]["0"]["lre"]["chosen"][0]["test_faithfulness"]


def test_training_facts_cover_the_objects_first():
    """The reference's ``Relation.split``: after one shuffle, one fact of each distinct object (objects in the
    order they first come) before a second of any. 12 facts of 3 objects (A x 6, B x 4, C x 2), 5 drawn: every
    object among them, and at most 2 of any (a uniform draw of 5 misses C in 45% of draws)."""
    objects = ["A"] * 6 + ["B"] * 4 + ["C"] * 2
    assert covering_order([0, 6, 1, 2, 10, 7, 11], objects) == [0, 6, 10, 1, 7, 11, 2]
    for draw in context_draws(len(objects), 5, 20, 0, "cover", objects):
        got = [objects[i] for i in draw]
        assert set(got) == {"A", "B", "C"} and max(got.count(o) for o in "ABC") == 2
    uniform = context_draws(len(objects), 5, 20, 0, "cover")
    assert any("C" not in [objects[i] for i in d] for d in uniform)


def test_rows_as_the_reference_reads_them():
    """country_capital_city's file escapes two objects twice (``Bogot\\\\u00e1``): the reference's ``json.load``
    leaves the six characters ``\\u00e1`` in its prompts; ``lre:NAME`` reads the character (our reading) and
    remembers the file's text, which ``lre_as_read`` and ``lre:NAME:literal`` give back."""
    ours = load_relations("lre:country_capital_city")[0]
    literal = load_relations("lre:country_capital_city:literal")[0]
    objects = {f.object for f in ours.facts}
    assert {"Bogotá", "Brasília"} <= objects and not any("\\u" in o for o in objects)
    assert {"Bogot\\u00e1", "Bras\\u00edlia"} <= {f.object for f in literal.facts}
    assert lre_as_read(ours).facts == literal.facts and len(literal.facts) == len(ours.facts)
    assert sum(f != g for f, g in zip(ours.facts, literal.facts)) == 2
    adj = load_relations("lre:adj_comparative")[0]
    assert lre_as_read(adj) is adj and "as_read" not in adj.properties


def test_exact_jacobians_unless_a_rank_is_asked_and_then_the_edit_ranks_capped():
    """Protocol lre: "auto" and "full" are exact (auto's rank 128 moved W by 0.2 on SmolLM2); a rank K keeps the
    edit ranks up to K (every higher one gives the same pseudo-inverse). The grids by family: a LlamaForCausalLM
    gets the reference's LLaMA grid and its 200-row cap as published, any other model its default grid."""
    llama = SimpleNamespace(model=type("LlamaForCausalLM", (), {})())
    other = SimpleNamespace(model=type("Qwen2ForCausalLM", (), {})())
    for rank in ("auto", "full"):
        assert decoders_module.lre_jacobian_rank(settings_from(protocol="lre", jacobian_rank=rank)) is None
    cfg = settings_from(protocol="lre", jacobian_rank=64, lre_selection="as-published")
    assert decoders_module.lre_jacobian_rank(cfg) == 64
    grid = decoders_module.lre_grids(llama, cfg, 64)
    assert grid["edit_ranks"] == tuple(range(0, 72, 8)) and grid["test_cap"] == 200 and grid["betas"][-1] == 10.0
    grid = decoders_module.lre_grids(other, settings_from(protocol="lre"), None)
    assert grid["edit_ranks"][-1] == 312 and grid["betas"][-1] == 5.0 and grid["test_cap"] == 90   # validation
    assert decoders_module.lre_grids(other, cfg, None)["test_cap"] is None                  # as published: all
    mine = settings_from(protocol="lre", lre_betas=(1.0, 2.0), lre_edit_ranks=(4, 8))
    assert decoders_module.lre_grids(llama, mine, None)["betas"] == (1.0, 2.0)              # as asked


def test_trials_the_reference_would_drop():
    """The reference's sweep stops on a trial where some known test fact has no edit target (another subject
    and another object): ``reference_drops`` names them."""
    assert decoders_module.reference_drops(["a", "b", "c"], ["x", "x", "x"])
    assert not decoders_module.reference_drops(["a", "b", "c"], ["x", "x", "y"])
    assert decoders_module.reference_drops(["a", "a", "b"], ["x", "y", "x"])       # (a, y): only a has another
