"""The cost model's pieces (benchmarks/scaling.py): the fit, the parameter count and the FLOPs it is fitted on."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scaling.py"


@pytest.fixture(scope="module")
def scaling():
    spec = importlib.util.spec_from_file_location("scaling_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_fit_recovers_planted_cost(scaling):
    gen = torch.Generator().manual_seed(0)
    a, b = 2.5e-11, 0.004                       # 40 GFLOP/s and 4 ms per pass
    rows = []
    for flops, calls in [(1e8, 3), (4e8, 30), (2e9, 10), (8e9, 70), (3e10, 20), (5e10, 40)]:
        noise = 1 + 0.01 * float(torch.randn(1, generator=gen))
        rows.append({"seconds": (a * flops + b * calls) * noise, "flops": flops, "calls": calls})
    fit = scaling.fit_stage(rows)
    assert fit["a"] == pytest.approx(a, rel=0.03)
    assert fit["b"] == pytest.approx(b, rel=0.3)
    assert fit["r2"] > 0.999 and fit["worst"] < 0.05


def test_fit_drops_a_negative_overhead(scaling):
    # time proportional to FLOPs with a little negative noise on the overhead: b is clipped to 0, a refitted
    rows = [{"seconds": 1e-10 * f - 1e-4, "flops": f, "calls": 1} for f in (1e9, 2e9, 4e9, 8e9)]
    fit = scaling.fit_stage(rows)
    assert fit["b"] == 0.0 and fit["a"] == pytest.approx(1e-10, rel=0.02)


def test_fit_refuses_too_few_measurements(scaling):
    with pytest.raises(ValueError, match="cannot fit"):
        scaling.fit_linear([[1.0, 1.0]], [1.0])


def test_parameter_count_matches_transformers_and_llama3(scaling):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = scaling.Shape("tiny", 128, 3, 384, 4, 2, vocab=500, tied=False)
    config = LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    assert shape.params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    llama3_8b = next(s for s in scaling.TARGETS if s.name.startswith("8B"))
    assert llama3_8b.params == 8_030_261_248    # Meta-Llama-3-8B's published parameter count


def test_forward_flops_match_torch_flop_counter(scaling):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = scaling.bench_shape(256, 2)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=shape.ff, num_hidden_layers=2,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
    model = LlamaForCausalLM(config).eval()
    rows, tokens = 4, 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model(input_ids=torch.randint(0, 1000, (rows, tokens)))       # the blocks, no LM head
    predicted = scaling.forward_work(shape, [(rows, tokens)], 2).flops
    assert predicted == pytest.approx(counter.get_total_flops(), rel=0.05)   # attention scores left out: < 5%


def test_jacobian_work_counts_each_product_through_the_blocks_it_reaches(scaling):
    shape = scaling.bench_shape(512, 8)
    prompts = [(5, 4), (6, 4), (5, 3)]
    full = scaling.jacobian_work(shape, prompts, [2, 4, 6])
    low = scaling.jacobian_work(shape, prompts, [2, 4, 6], rank=8)
    forward = sum(len(g) * (max(p for p, _ in g) + a) * 8 for a, g in
                  ((4, prompts[:2]), (3, prompts[2:]))) * shape.token_block_flops()
    tokens_after = 2 * 4 + 1 * 3
    back = tokens_after * shape.token_block_flops()        # one product through one block, all prompts
    # from o = blocks.7.resid_post to blocks.l.resid_post: blocks l+1 .. 7, 7 - l of them
    assert full.flops == pytest.approx(forward + 512 * (7 - 2) * back)   # d VJPs from o reach every layer
    k = 8 + 10                        # k shared VJPs to layer 2, then k JVPs + k VJPs to each layer's own state
    assert low.flops == pytest.approx(forward + k * (7 - 2) * back + 2 * k * ((7 - 2) + (7 - 4) + (7 - 6)) * back)
    assert scaling.jacobian_work(shape, prompts, [2, 4, 6], rank=600).flops == full.flops   # k >= d: exact


@pytest.fixture(scope="module")
def ceilings():
    spec = importlib.util.spec_from_file_location("step_ceilings_bench", SCRIPT.parent / "step_ceilings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_control_steps_flops_are_its_mlp_and_softmax_matmuls(ceilings):
    """step_ceilings counts a stacked control step's matmuls as torch does: the six MLP matmuls (forward, and the
    input and weight gradients of W_in and W_out) plus the softmax's three (logits, their input and weight
    gradients), and nothing else of the step is a matmul."""
    seeds, d = 2, 8
    got = ceilings.control_step(rate=1e9, steps=1, d=d, seeds=seeds)
    assert got["mlp_flops"] == 6 * 2 * seeds * got["facts"] * d * 8 * d
    assert got["flops"] == got["mlp_flops"] + 3 * 2 * seeds * got["facts"] * d * got["outputs"]
    assert got["step_s"] > 0 and got["mlp_s"] > 0


def test_the_attention_backward_gives_the_same_bits_per_cotangent_and_folded(ceilings):
    """The claims docs/scaling.md makes from step_ceilings: legacy vmap's loop over the cotangents, the flash
    kernel called once per cotangent, and the cotangents folded into the kernel's batch give the same bits; the
    math kernel does not."""
    got = ceilings.attention_backward(1, k=4, batch=4, heads=2, queries=2, keys=6, dim=8)
    same = {name: bits for name, (_, bits) in got.items()}
    assert same == {"legacy vmap (is_grads_batched), flash kernel": None,
                    "the flash kernel once per cotangent, stacked": True,
                    "cotangents folded into the kernel's batch": True,
                    "legacy vmap, math kernel": False}
