"""Benchmark: how close to the dense-matmul ceiling the main job's two largest kinds of work can run on one CPU
thread while every number stays bit for bit the same.

1. **A matched control's training step** at the default run's largest point: three seeds of a trainable
   one-layer control of width d = 576 (MLP 8d) stacked as ``synthetic.batched`` trains them, on a random table of
   the shape of SmolLM2's controls table (193 subjects x 6 relations = 1158 facts, 577 output classes), denormals
   flushed as in training. Printed: the step's seconds against its matmul FLOPs at the measured one-thread rate
   (torch's ``FlopCounterMode``, in-place matmuls included), and the step's six MLP matmuls timed alone on the same shapes: what is left is
   the step's elementwise work (bias, ReLU and its backward, the softmax, Adam). The controls' training is chaotic
   (rounding moves the first step at 100% of a wide control), so those ops cannot be fused or reordered.
2. **The Jacobians' attention backward**: 48 one-hot-like cotangents through one attention layer of SmolLM2's
   shape at a Jacobian group's size (16 prompts, 9 heads of 64, 2 query tokens over 12 keys), as
   ``torch.autograd.grad(is_grads_batched=True)`` runs it (legacy vmap, which has no rule for the CPU
   flash-attention backward and loops over the cotangents), the same kernel called once per cotangent, the
   cotangents folded into the kernel's batch (the same bits: checked), and the math kernel under vmap (other bits:
   the largest difference printed).

    python benchmarks/step_ceilings.py [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from main_job_floor import counted  # noqa: E402  (torch's FLOP count, in-place matmuls included)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from llmprobe.jobs.plan import matmul_rate  # noqa: E402
from synthetic.batched import ModelStack  # noqa: E402
from synthetic.matched import RECIPES  # noqa: E402
from synthetic.model import FactRecallModel, ModelConfig, auto_chunk  # noqa: E402
from synthetic.tasks import random_functions  # noqa: E402
from synthetic.train import TrainConfig, denormals_flushed  # noqa: E402

ATTRIBUTES = [193, 6, 96, 96, 96, 90]      # SmolLM2's controls table: 193 subjects, 6 relations, 577 outputs


def best_seconds(fn, repeats: int) -> float:
    """The least wall seconds of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def control_step(rate: float, steps: int, d: int = 576, seeds: int = 3) -> dict[str, float]:
    """One stacked training step of ``seeds`` trainable controls of width d against its matmul floor; returns its
    seconds and torch-counted FLOPs, and the seconds and FLOPs of its six MLP matmuls timed alone."""
    tasks = [random_functions(193, len(ATTRIBUTES), ATTRIBUTES, seed=s) for s in range(seeds)]
    cfg = TrainConfig(chunk=auto_chunk(tasks[0].n_outputs, "cpu"), **RECIPES["adam"])
    models = [FactRecallModel(ModelConfig(t.n_subjects, t.n_relations, t.n_outputs, d, seed=i))
              for i, t in enumerate(tasks)]
    stack = ModelStack(models)
    datas = [t.data() for t in tasks]
    ids, targets = torch.stack([x.input_ids for x in datas]), torch.stack([x.targets for x in datas])
    pos = datas[0].target_pos

    def forward_backward():
        loss, _ = stack.loss(ids, pos, targets, chunk=cfg.chunk)
        loss.sum().backward()

    def step():
        forward_backward()
        stack.adam_step([cfg.lr] * seeds, cfg)

    def adam_alone() -> float:
        """One step's Adam update, timed apart from the forward and backward before it."""
        forward_backward()
        t = time.perf_counter()
        stack.adam_step([cfg.lr] * seeds, cfg)
        return time.perf_counter() - t

    with denormals_flushed(True):
        flops = counted(step)
        seconds = best_seconds(step, steps)
        adam = min(adam_alone() for _ in range(steps))
        m, facts = models[0].config.d_mlp, ids.shape[1]
        x, w_in = torch.randn(seeds, facts, d), torch.randn(seeds, d, m)
        h, w_out = torch.randn(seeds, facts, m), torch.randn(seeds, m, d)
        gemms = [lambda: torch.bmm(x, w_in), lambda: torch.bmm(h, w_out),              # forward
                 lambda: torch.bmm(x, w_out.transpose(1, 2)), lambda: torch.bmm(h.transpose(1, 2), x),  # W_out's
                 lambda: torch.bmm(h, w_in.transpose(1, 2)), lambda: torch.bmm(x.transpose(1, 2), h)]   # W_in's
        mlp = sum(best_seconds(g, steps) for g in gemms)
    mlp_flops = 6 * 2.0 * seeds * facts * d * m
    print(f"control step: {seeds} trainable seeds of d = {d} (MLP {m}) on {facts} facts, "
          f"{tasks[0].n_outputs} outputs, stacked")
    print(f"  step {seconds:.3f} s for {flops / 1e9:.1f} GFLOP of matmuls: {flops / seconds / 1e9:.0f} GFLOP/s, "
          f"{seconds * rate / flops:.2f} x its floor at the ceiling")
    print(f"  its six MLP matmuls alone {mlp:.3f} s ({mlp_flops / mlp / 1e9:.0f} GFLOP/s, "
          f"{mlp * rate / mlp_flops:.2f} x their floor); the rest of the step {seconds - mlp:.3f} s "
          f"({(seconds - mlp) / seconds:.0%}: softmax, bias, ReLU, Adam)")
    print(f"  of which Adam {adam:.3f} s ({adam / seconds:.0%} of the step: a fused Adam could save part of that "
          f"at most, and would change the controls' numbers)")
    return {"step_s": seconds, "adam_s": adam, "flops": flops, "mlp_s": mlp, "mlp_flops": mlp_flops, "facts": facts,
            "outputs": tasks[0].n_outputs}


def attention_backward(steps: int, k: int = 48, batch: int = 16, heads: int = 9, queries: int = 2,
                       keys: int = 12, dim: int = 64) -> dict[str, tuple[float, bool | None]]:
    """``k`` cotangents through one attention layer's backward, four ways; returns name -> (seconds, whether its
    gradients are bit for bit those of legacy vmap with the flash kernel; None for that one)."""
    gen = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(batch, heads, n, dim, generator=gen).requires_grad_()
                for n in (queries, keys, keys))
    mask = torch.zeros(batch, 1, queries, keys)
    mask[: batch // 4, :, :, : keys // 3] = float("-inf")          # left padding of a quarter of the rows
    scale = dim ** -0.5
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)
    cot = torch.randn(k, batch, heads, queries, dim, generator=gen)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def under_vmap(backend):
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, scale=scale)
        return lambda: torch.autograd.grad(o, (q, kk, v), cot, retain_graph=True, is_grads_batched=True)

    def loop():
        return [torch.stack(g) for g in zip(*(kernel(cot[i], q, kk, v, out, lse, 0.0, False, attn_mask=mask,
                                                      scale=scale) for i in range(k)))]

    def folded():
        rep = lambda t: t.detach().expand(k, *t.shape).reshape(k * t.shape[0], *t.shape[1:])  # noqa: E731
        grads = kernel(cot.reshape(k * batch, heads, queries, dim), rep(q), rep(kk), rep(v), rep(out), rep(lse),
                       0.0, False, attn_mask=rep(mask), scale=scale)
        return [g.reshape(k, batch, *g.shape[1:]) for g in grads]

    flash, math_ = under_vmap(SDPBackend.FLASH_ATTENTION), under_vmap(SDPBackend.MATH)
    reference = flash()
    same = lambda grads: all(torch.equal(a, b) for a, b in zip(grads, reference))  # noqa: E731
    worst = max(float((a - b).abs().max()) for a, b in zip(math_(), reference))
    flops = 4 * 2.0 * batch * heads * queries * keys * dim * k       # QK^T, PV and their input gradients
    print(f"attention backward: {k} cotangents, {batch} prompts x {heads} heads x {queries} queries over {keys} "
          f"keys (dim {dim})")
    base, results = best_seconds(flash, steps), {}
    for name, fn, bits in (("legacy vmap (is_grads_batched), flash kernel", flash, "the reference"),
                           ("the flash kernel once per cotangent, stacked", loop, same(loop())),
                           ("cotangents folded into the kernel's batch", folded, same(folded())),
                           ("legacy vmap, math kernel", math_, f"max |difference| {worst:.1e}")):
        seconds = base if fn is flash else best_seconds(fn, steps)
        print(f"  {name:48s} {seconds * 1e3:7.2f} ms  {flops / seconds / 1e9:5.1f} GFLOP/s  "
              f"{seconds / base:5.2f} x vmap  same bits: {bits}")
        results[name] = (seconds, bits if isinstance(bits, bool) else (False if fn is math_ else None))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed repeats of each measurement (the best is kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rate = matmul_rate(1, 1.0, time.thread_time)
    print(f"one thread: dense float32 matmul {rate / 1e9:.0f} GFLOP/s (the ceiling)")
    control_step(rate, args.steps)
    attention_backward(max(args.steps, 10))


if __name__ == "__main__":
    main()
