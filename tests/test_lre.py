"""Model side of the LRE: batched Jacobians (against the per-prompt reference and finite differences), states,
faithfulness through adapter.logits, causality edits through real forward passes, full-sequence scoring."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import save_tiny
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch import nn
from transformers import PreTrainedTokenizerFast

import llmprobe.model.engine as engine_module
from llmprobe.geometry import LinearRelationDecoder, LinearRelationOperator
from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.capture import adapter_for, capture, forward, patch
from llmprobe.model.engine import (
    layer_sequences,
    line_argmax,
    logits_fn,
    next_token_predictions,
    output_name,
    relation_states,
    subject_states,
)
from llmprobe.model.known import first_token_ids
from llmprobe.model.loading import LoadedModel, load_model
from llmprobe.model.lre import per_prompt_jacobians, subject_jacobians
from llmprobe.model.random_init import random_init
from llmprobe.model.scoring import first_token_collisions, object_continuations, sequence_logprobs
from llmprobe.model.subjects import encode

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

TEMPLATES = ["The capital of {} is", "Tell me about {} now.", "{} is located in", "The capital of {} is",
             "In {}, people pay with the"]
SUBJECTS = ["France", "United Kingdom", "South Korea", "Japan", "Egypt"]


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("llama"))
    return load_model(str(folder), device="cpu", dtype=torch.float64)


# ------------------------------------------------------------------------------------------ a linear toy model
def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer (one token per whitespace-separated word, BOS prepended)."""
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "[UNK]"] + list(dict.fromkeys(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]")


class LinearToy(nn.Module):
    """x <- embed; per block x <- x + M_l (causal running mean of x); logits = head(x). Addressed through
    ``hook_points()``, like the synthetic model. M_0 = 0, so block 0's output is the embedding and no other
    position at layer 0 carries the subject: o (last block, last token) is then exactly affine in the layer-0
    subject state h, o = W h + b with W = M_1 / seq_len for a 2-block toy."""

    def __init__(self, vocab: int, d: int = 16, n_layers: int = 2, seed: int = 0, gain: float = 30.0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.points = nn.ModuleList(nn.Identity() for _ in range(n_layers))
        with torch.no_grad():
            self.mix[0].weight.zero_()
            for mix in self.mix[1:]:
                mix.weight.mul_(gain)  # the subject's share of the running mean matters for the answer
        self.config = SimpleNamespace(d_model=d, model_type="linear_toy")

    def hook_points(self):
        return {f"blocks.{l}.resid_post": p for l, p in enumerate(self.points)}

    def forward(self, input_ids, **kwargs):
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        for mix, point in zip(self.mix, self.points):
            x = point(x + mix(x.cumsum(1) / steps))
        return SimpleNamespace(logits=self.head(x))

    def unembed(self, resid):
        return self.head(resid)

    def get_output_embeddings(self):
        return self.head


def linear_toy(subjects, extra=(), d=16, n_layers=2, seed=0) -> LoadedModel:
    words = "The capital of is Tell me about now .".split() + list(subjects) + list(extra)
    tok = word_tokenizer(words)
    model = LinearToy(len(tok), d, n_layers, seed).double().eval().requires_grad_(False)
    return LoadedModel(model, tok, ModelAdapter(model), {"name": "linear_toy"})


# ------------------------------------------------------------------------------------------------- Jacobians
def test_batched_jacobian_equals_per_prompt_autograd_jacobian(llama64):
    """Batched (KV cache for the prefix, vmap over output blocks, several layers at once) == one prompt at a
    time with torch.autograd.functional.jacobian, with left padding and different templates in one batch."""
    batched = subject_jacobians(llama64, TEMPLATES, SUBJECTS, [0, 1], batch_size=3, chunk=8)
    for layer in (0, 1):
        reference = per_prompt_jacobians(llama64, TEMPLATES, SUBJECTS, layer)
        assert reference.J.abs().max() > 1e-3  # not trivially zero
        torch.testing.assert_close(batched[layer].J, reference.J, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(batched[layer].H, reference.H, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(batched[layer].O, reference.O, atol=1e-10, rtol=1e-8)


def test_jacobian_paths_agree(llama64):
    """Without the KV cache, one output dim per backward, one layer at a time: the same Jacobians."""
    fast = subject_jacobians(llama64, TEMPLATES, SUBJECTS, [0, 1], batch_size=5, chunk=32)
    plain = subject_jacobians(llama64, TEMPLATES, SUBJECTS, 1, batch_size=2, chunk=1, use_cache=False)
    torch.testing.assert_close(fast[1].J, plain.J, atol=1e-10, rtol=1e-8)
    assert fast[1].W.shape == (32, 32)
    torch.testing.assert_close(fast[1].W, fast[1].J.mean(0))


def test_jacobian_flops_are_those_the_plan_counts(llama64):
    """The plan's (and the floor benchmark's) FLOPs of subject_jacobians equal torch's count of what it runs: a
    product from o (the last block's output) to layer l's state crosses blocks l+1 .. L-1 only (counting the
    block of l itself too put 3 blocks where 2 run here). Attention scores are left out of the plan (under 1% at
    exact; the low-rank JVPs' math attention is bmm, compared apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    from llmprobe.analyses.passes import jacobian_prompts
    from llmprobe.jobs.workload import jacobian_work, shape_from_config

    shape = shape_from_config(llama64.model.config, "tiny llama")
    template = "The capital of {} is in the north of"
    prompts = jacobian_prompts(llama64.tokenizer, template, SUBJECTS)
    for layers, rank in (([0, 1], None), ([1], None), ([0, 1], 4)):
        with FlopCounterMode(display=False) as counter:
            subject_jacobians(llama64, template, SUBJECTS, layers, rank=rank, chunk=8)
        counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
        planned = jacobian_work(shape, prompts, layers, rank, chunk=8).flops
        assert planned == pytest.approx(counted["aten.mm"], rel=0.03), (layers, rank)


@pytest.fixture(scope="module")
def gpt2_64(tmp_path_factory):
    # GPT-2's LayerNorm runs in the input dtype (Llama's RMSNorm upcasts to float32, which would limit the
    # finite differences to float32 precision)
    folder = save_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))
    return load_model(str(folder), device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("layer", [0, 1])
def test_jacobian_matches_central_finite_differences(gpt2_64, layer):
    templates, subjects = TEMPLATES[:3], SUBJECTS[:3]
    result = subject_jacobians(gpt2_64, templates, subjects, layer)
    final = output_name(gpt2_64)
    eps = 1e-6
    d = result.H.shape[1]
    bumps = torch.cat([torch.eye(d), -torch.eye(d)]).double() * eps                  # [2d, d]
    n = bumps.shape[0]
    for row, (template, subject) in enumerate(zip(templates, subjects)):
        enc = encode(gpt2_64.tokenizer, template, [subject])
        ids, mask = enc.input_ids.expand(n, -1), enc.attention_mask.expand(n, -1)
        with patch(gpt2_64.model, f"blocks.{layer}.resid_post", enc.subject_last.expand(n), delta=bumps):
            o = capture(gpt2_64.model, [final], ids, mask, positions=enc.prompt_last.expand(n)[:, None])[final][:, 0]
        fd = ((o[:d] - o[d:]) / (2 * eps)).T                                       # [d_out, d_in]
        assert result.J[row].abs().max() > 1e-3
        torch.testing.assert_close(result.J[row], fd, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_batched_jacobian_other_families(family, tmp_path):
    lm = load_model(str(save_tiny(family, tmp_path / family)), device="cpu", dtype="float32")
    batched = subject_jacobians(lm, TEMPLATES, SUBJECTS, 1, batch_size=3, chunk=16)
    reference = per_prompt_jacobians(lm, TEMPLATES, SUBJECTS, 1)
    torch.testing.assert_close(batched.J, reference.J, atol=2e-5, rtol=1e-4)


def test_jacobian_at_the_last_layer_is_zero_when_the_subject_is_not_last(llama64):
    result = subject_jacobians(llama64, TEMPLATES[0], SUBJECTS[:2], 2)
    assert float(result.J.abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------------- states
def test_relation_states_and_logits_fn_reproduce_the_model(llama64):
    layers = [0, 2]
    states = relation_states(llama64, TEMPLATES, SUBJECTS, layers, batch_size=2)
    jac = subject_jacobians(llama64, TEMPLATES, SUBJECTS, layers)
    for layer in layers:
        torch.testing.assert_close(states.H[layer], jac[layer].H, atol=1e-10, rtol=1e-8)
    # o is the last block's output before the final norm; logits_fn = final norm + LM head = the model's logits
    enc = encode(llama64.tokenizer, TEMPLATES, SUBJECTS)
    real = forward(llama64.model, enc.input_ids, enc.attention_mask).logits[torch.arange(5), enc.prompt_last]
    torch.testing.assert_close(logits_fn(llama64)(states.O), real.float(), atol=1e-4, rtol=1e-4)
    assert states.prompts[1] == "Tell me about United Kingdom now."


def test_subject_states_average_over_templates(llama64):
    both = subject_states(llama64, ["{}", "Tell me about {}."], SUBJECTS[:3], [1])[1]
    one = subject_states(llama64, ["{}"], SUBJECTS[:3], [1])[1]
    two = subject_states(llama64, ["Tell me about {}."], SUBJECTS[:3], [1])[1]
    torch.testing.assert_close(both, (one + two) / 2)


def test_lre_faithfulness_goes_through_adapter_logits(llama64):
    """Faithfulness = argmax of adapter.logits(beta W h + b) (final norm + LM head), checked by hand."""
    jac = subject_jacobians(llama64, TEMPLATES[0], SUBJECTS, 1)
    dec = LinearRelationDecoder(beta=2.0).fit(jac.H, jac.O, jac.J)
    fn = logits_fn(llama64)
    y = fn(jac.O).argmax(-1)                       # the model's own next tokens
    by_hand = llama64.model.lm_head(llama64.model.model.norm(2.0 * jac.H @ dec.W_.T + dec.b_)).argmax(-1)
    assert torch.equal(dec.hits(jac.H, y, fn), by_hand == y)
    # at beta = 1, and evaluated at the training mean, the LRE reproduces the mean output exactly
    torch.testing.assert_close(dec.operator_.W, jac.W)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_resumed_edit_forward_equals_the_full_edited_forward(llama64, gpt2_64, layer):
    """Starting at block layer+1 from the clean layer states (+ the edit) gives the full forward's logits."""
    for lm in (llama64, gpt2_64):
        delta = torch.randn(5, lm.adapter.d_model, generator=torch.Generator().manual_seed(layer)).double() * 3
        full = next_token_predictions(lm, TEMPLATES, SUBJECTS, layer, delta, batch_size=3, return_logits=True)
        seqs = layer_sequences(lm, TEMPLATES, SUBJECTS, layer, batch_size=2)
        resumed = next_token_predictions(lm, TEMPLATES, SUBJECTS, layer, delta, batch_size=3, return_logits=True,
                                         resume=seqs)
        torch.testing.assert_close(resumed, full, atol=1e-5, rtol=1e-5)
        assert not any("forward" in vars(block) for block in lm.adapter.blocks)  # blocks restored


# --------------------------------------------------------------------------------------- linear toy: exactness
TOY_SUBJECTS = [f"S{i}" for i in range(12)]


def test_toy_jacobian_is_exact_and_lre_is_perfect():
    lm = linear_toy(TOY_SUBJECTS)
    template = "The capital of {} is"                                  # <s> The capital of S is: 6 tokens
    jac = subject_jacobians(lm, template, TOY_SUBJECTS, 0)
    expected = lm.model.mix[1].weight / 6                               # d o / d h = M_1 / seq_len
    for J in jac.J:
        torch.testing.assert_close(J.double(), expected, atol=1e-6, rtol=1e-6)
    fn = logits_fn(lm)
    y = fn(jac.O).argmax(-1)
    dec = LinearRelationDecoder(beta=1.0).fit(jac.H[:6], jac.O[:6], jac.J[:6])
    torch.testing.assert_close(dec.predict(jac.H[6:]), jac.O[6:].double(), atol=1e-5, rtol=1e-5)
    assert dec.score(jac.H[6:], y[6:], fn) == 1.0


def test_causality_edit_with_exact_W_reaches_the_target():
    """h -> h + W^+ (o' - o) patched into a real forward pass makes the model answer the target's object."""
    lm = linear_toy(TOY_SUBJECTS, seed=1)
    template = "The capital of {} is"
    jac = subject_jacobians(lm, template, TOY_SUBJECTS, 0)
    op = LinearRelationOperator(jac.W.double(), (jac.O - jac.H @ jac.W.T).mean(0).double())
    y = next_token_predictions(lm, template, TOY_SUBJECTS)
    src = torch.arange(12)
    tgt = torch.roll(src, 3)
    assert int((y[src] != y[tgt]).sum()) >= 6
    delta = op.edit_delta(op(jac.H[src]), op(jac.H[tgt]))
    edited = next_token_predictions(lm, template, TOY_SUBJECTS, layer=0, delta=delta)
    assert torch.equal(edited, y[tgt])
    unedited = next_token_predictions(lm, template, TOY_SUBJECTS, layer=0, delta=torch.zeros_like(delta))
    assert torch.equal(unedited, y)


# --------------------------------------------------------------------------------------------------- scoring
def test_sequence_logprobs_match_a_manual_computation(llama64):
    tok = llama64.tokenizer
    objects = ["Paris", "London town", "Seoul", "Tokyo", "Cairo"]
    scores = sequence_logprobs(llama64, TEMPLATES, SUBJECTS, objects, batch_size=2)
    prompts = [t.replace("{}", s) for t, s in zip(TEMPLATES, SUBJECTS)]
    for i, ((full, cut), score) in enumerate(zip(object_continuations(tok, prompts, objects), scores)):
        logits = llama64.model(torch.tensor([full])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        manual = sum(float(logp[t - 1, full[t]]) for t in range(cut, len(full)))
        assert abs(manual - float(score)) < 1e-4
    # the first object token is the one first_token_ids gives
    first = first_token_ids(tok, prompts, objects)
    assert first.tolist() == [full[cut] for full, cut in object_continuations(tok, prompts, objects)]
    # a zero edit changes nothing; a large one changes the scores
    d = llama64.adapter.d_model
    same = sequence_logprobs(llama64, TEMPLATES, SUBJECTS, objects, layer=1, delta=torch.zeros(5, d))
    torch.testing.assert_close(same, scores, atol=1e-6, rtol=1e-6)
    moved = sequence_logprobs(llama64, TEMPLATES, SUBJECTS, objects, layer=0, delta=torch.ones(5, d) * 5)
    assert not torch.allclose(moved, scores)


def test_first_token_collisions_counts_shared_first_tokens():
    assert first_token_collisions([5, 5, 7, 9], ["South Africa", "South Korea", "Peru", "Chile"]) == 2
    assert first_token_collisions([5, 5], ["Peru", "Peru"]) == 0


def test_random_like_keeps_the_architecture_and_the_global_rng(llama64):
    state = torch.random.get_rng_state()
    rand = random_init(llama64, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(rand.model) is type(llama64.model) and rand.adapter.n_layers == llama64.adapter.n_layers
    assert rand.tokenizer is llama64.tokenizer
    a, b = llama64.model.model.embed_tokens.weight, rand.model.model.embed_tokens.weight
    assert a.shape == b.shape and not torch.allclose(a, b)
    again = random_init(llama64, seed=3)
    torch.testing.assert_close(again.model.model.embed_tokens.weight, b)


def test_reinit_like_resets_every_parameter_or_refuses():
    from torch import nn


    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(3.0)                                  # "trained" weights that a re-init must not keep
    state = torch.random.get_rng_state()
    a, b = random_init(net, 7), random_init(net, 7)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, p), q, old in zip(a.named_parameters(), b.parameters(), net.parameters()):
        assert p.dtype == torch.float64 and torch.equal(p, q), name      # seeded, on the source's dtype
        assert not torch.equal(p, old), name
    assert not torch.equal(random_init(net, 8)[0].weight, a[0].weight)

    class Bare(nn.Module):                               # a parameter no reset_parameters() covers
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="scale"):
        random_init(Bare(), 0)


# ------------------------------------------------------------------------------------------- low-rank Jacobians
def planted_toy(spectrum, d=48, seed=0) -> LoadedModel:
    """The linear toy with d o / d h = M_1 / 6 = U diag(spectrum) V^T (random orthonormal U, V)."""
    lm = linear_toy(TOY_SUBJECTS, d=d, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    U = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    s = torch.zeros(d, dtype=torch.float64)
    s[:len(spectrum)] = torch.as_tensor(spectrum, dtype=torch.float64)
    with torch.no_grad():
        lm.model.mix[1].weight.copy_(6 * (U * s) @ V.T)
    return lm


def best_rank(W: torch.Tensor, K: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(W.double())
    return (U[:, :K] * S[:K]) @ Vh[:K]


def test_lowrank_jacobian_is_exact_when_W_has_rank_K():
    lm = planted_toy([9.0, 7.0, 5.0, 4.0])
    template = "The capital of {} is"
    full = subject_jacobians(lm, template, TOY_SUBJECTS[:5], 0)
    low = subject_jacobians(lm, template, TOY_SUBJECTS[:5], 0, rank=4, oversample=2)
    assert low.J is None and low.U.shape == (5, 48, 6) and low.Vt.shape == (5, 6, 48)  # the factors, not J
    torch.testing.assert_close(low.W.double(), full.W.double(), atol=1e-10, rtol=1e-8)
    h = low.H.double()
    torch.testing.assert_close(low.apply(slice(None), h), full.apply(slice(None), h), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("K", [4, 8])
def test_lowrank_jacobian_equals_the_best_rank_K_approximation_on_a_planted_spectrum(K):
    """W = U diag(s) V^T with K large singular values and a small full-rank tail (0.1 ... 0.003): the low-rank
    W equals the best rank-K approximation of the exact W (Eckart-Young) within 1%."""
    spectrum = [10.0 - i for i in range(K)] + [0.1 * 0.9 ** i for i in range(48 - K)]
    lm = planted_toy(spectrum)
    template = "The capital of {} is"
    W = subject_jacobians(lm, template, TOY_SUBJECTS[:3], 0).W.double()
    low = subject_jacobians(lm, template, TOY_SUBJECTS[:3], 0, rank=K, oversample=4)
    best = best_rank(W, K)
    assert float((low.W.double() - best).norm() / best.norm()) < 0.01


@pytest.mark.parametrize("oversample, bound", [(4, 1.10), (8, 1.03)])
def test_lowrank_jacobian_error_is_near_the_best_rank_K_error_without_a_gap(oversample, bound):
    """A slowly decaying spectrum (0.85^i, no gap after K = 8; rank-K subspaces are then ill-determined): the
    estimate's error ||W - W_low|| is near the best rank-K approximation's error ||W - W_K||. The bounds hold
    for the range finder with its power step (worst of 20 draws in a simulation: 1.08 and 1.01) and fail
    without it (best of 20 draws: 1.13 and 1.05)."""
    lm = planted_toy([10.0 * 0.85 ** i for i in range(48)])
    template = "The capital of {} is"
    W = subject_jacobians(lm, template, TOY_SUBJECTS[:3], 0).W.double()
    low = subject_jacobians(lm, template, TOY_SUBJECTS[:3], 0, rank=8, oversample=oversample)
    ratio = float((W - low.W.double()).norm() / (W - best_rank(W, 8)).norm())
    assert 1.0 - 1e-9 <= ratio < bound, ratio


def test_lowrank_jacobian_through_a_real_architecture(llama64):
    """Tiny Llama (d = 32, float64): the products are exact, so with k = d - 1 columns the rank-K mean is the
    best rank-K approximation of the exact mean up to the one direction each prompt's range leaves out."""
    full = subject_jacobians(llama64, TEMPLATES, SUBJECTS, [0, 1], batch_size=3, chunk=8)
    low = subject_jacobians(llama64, TEMPLATES, SUBJECTS, [0, 1], batch_size=3, chunk=8, rank=8, oversample=23)
    for layer in (0, 1):
        W = full[layer].W.double()
        best = best_rank(W, 8)
        assert float((low[layer].W.double() - best).norm() / best.norm()) < 0.02
        torch.testing.assert_close(low[layer].H, full[layer].H)
        torch.testing.assert_close(low[layer].O, full[layer].O)
    exact = subject_jacobians(llama64, TEMPLATES, SUBJECTS, 1, rank=32)  # k >= d: nothing to gain, exact
    assert exact.J is not None and exact.rank is None


def test_lowrank_jacobian_rejects_a_bad_rank(llama64):
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        subject_jacobians(llama64, TEMPLATES, SUBJECTS, 1, rank=0)


def test_jacobians_halve_their_batch_on_out_of_memory(llama64, monkeypatch, capsys):
    """An out-of-memory error in a micro-batch of more than 2 prompts: the batch halves, the same prompts are
    retried, the Jacobians equal an un-failed run's (exact and low-rank) and the halving is said once."""
    from llmprobe.model import batching, lre

    clean = {r: subject_jacobians(llama64, TEMPLATES, SUBJECTS, 1, batch_size=4, rank=r, oversample=4)
             for r in (None, 8)}
    real = lre._group_graph

    def failing(lm, ids, *args):
        if ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(lm, ids, *args)
    monkeypatch.setattr(lre, "_group_graph", failing)
    monkeypatch.setattr(batching, "_stage_size", {})
    monkeypatch.setattr(batching, "_warned", set())
    for rank, expected in clean.items():
        got = subject_jacobians(llama64, TEMPLATES, SUBJECTS, 1, batch_size=4, rank=rank, oversample=4,
                                use_cache=False)
        torch.testing.assert_close(got.W, expected.W, atol=1e-10, rtol=1e-8)
    assert capsys.readouterr().err.count("Jacobians: out of memory; micro-batch size halved") == 1


def test_auto_jacobian_rank_is_low_rank_only_where_it_costs_less():
    from llmprobe.analyses.decoders import AUTO_JACOBIAN_RANK, jacobian_rank_for
    from llmprobe.analyses.settings import AnalysisSettings
    from llmprobe.model.lre import jacobian_cost

    # exact: d VJPs through the blocks after the first layer; low-rank: k to the first layer, 2k to each layer
    assert jacobian_cost(576, [6, 15, 24], 30) == 576 * 23
    assert jacobian_cost(576, [6, 15, 24], 30, rank=128) == 138 * (23 + 2 * (23 + 14 + 5))
    assert jacobian_cost(100, [6, 15, 24], 30, rank=128) == jacobian_cost(100, [6, 15, 24], 30)   # k >= d: exact
    auto = AnalysisSettings()
    assert jacobian_rank_for(auto, 576, [6, 15, 24], 30) is None             # SmolLM2: exact costs less
    assert jacobian_rank_for(auto, 640, [6, 15, 24], 30) is None             # 640 x 23 = 14720 < 138 x 107
    assert jacobian_rank_for(auto, 700, [6, 15, 24], 30) == AUTO_JACOBIAN_RANK   # 700 x 23 = 16100 > 14766
    assert jacobian_rank_for(auto, 576, [6], 30) == AUTO_JACOBIAN_RANK       # one layer: 3 x 138 products < 576
    assert jacobian_rank_for(auto, None, [6], 30) is None                    # unknown width: exact
    assert jacobian_rank_for(AnalysisSettings(jacobian_rank="full"), 8192, [6], 80) is None
    assert jacobian_rank_for(AnalysisSettings(jacobian_rank=64), 576, [6], 30) == 64


# ------------------------------------------------------------------------------------- every beta in two head calls
@pytest.mark.parametrize("family, fast", [("llama", True), ("gemma", True), ("phi3", True), ("gemma2", False),
                                          ("gpt2", False)])
def test_line_argmax_gives_the_ids_of_one_head_call_per_beta(family, fast, tmp_path, monkeypatch):
    """``line_argmax`` = argmax of logits(beta A + B) per beta, by two head calls where the final norm is an RMS
    norm (a positive factor per row: Llama, Gemma's 1 + w, Phi-3) and one call per beta where it is not (Gemma-2's
    soft-capping, GPT-2's LayerNorm). Rows tied to float precision at the top (built by projecting out the top
    two tokens' difference) take the real head's answer: without that (``_MARGIN`` 0) about half of them differ."""
    lm = load_model(str(save_tiny(family, tmp_path / family)), device="cpu", dtype="float32")
    adapter = adapter_for(lm.model)
    with torch.no_grad():
        adapter.final_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))  # a gain to find
    gen = torch.Generator().manual_seed(1)
    A, B = (torch.randn(64, adapter.d_model, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    betas = [i / 4 for i in range(21)]
    one_call_each = torch.stack([logits_fn(lm)(beta * A + B).argmax(-1) for beta in betas])
    assert torch.equal(line_argmax(lm, A, B, betas), one_call_each)
    gain = engine_module._scale_free_gain(lm)
    assert (gain is not None) == fast
    if not fast:
        return
    E, g = adapter.lm_head.weight.double(), gain.double()
    X = torch.randn(200, adapter.d_model, generator=gen, dtype=torch.float64) * 2
    i, j = ((X * g) @ E.T).topk(2, -1).indices.T
    w = g * (E[i] - E[j])
    tied = X - ((w * X).sum(-1) / (w * w).sum(-1))[:, None] * w         # the top two equal in exact arithmetic
    zero = torch.zeros_like(tied)
    real = logits_fn(lm)(tied).argmax(-1)
    assert torch.equal(line_argmax(lm, zero, tied, [1.0])[0], real)
    monkeypatch.setattr(engine_module, "_MARGIN", 0.0)
    assert int((line_argmax(lm, zero, tied, [1.0])[0] != real).sum()) > 20


def test_beta_scoring_benchmark_runs_both_paths_to_the_same_ids(tmp_path):
    """benchmarks/beta_scoring.py on a tiny Llama: both grids timed, the same ids from both paths."""
    spec = importlib.util.spec_from_file_location("beta_scoring_bench", BENCHMARKS / "beta_scoring.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = bench.main(["--model", str(save_tiny("llama", tmp_path / "llama")), "--n", "8", "--repeats", "1"])
    assert set(got) == set(bench.GRIDS) and all(g["same_ids"] and g["line_argmax_s"] > 0 for g in got.values())
