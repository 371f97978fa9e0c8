"""Benchmark: batched LRE Jacobians against the one-prompt-at-a-time approach of the original LRE code.

Same prompts, same layer, one run:

* reference: ``torch.autograd.functional.jacobian`` of o(h) per prompt (a full forward pass per evaluation, one
  backward per output dimension), as in Hernandez et al.'s code;
* batched: ``llmprobe.model.lre.subject_jacobians`` (all prompts in one padded batch, the tokens before the subject
  run once through the KV cache, ``chunk`` output dimensions per vmapped backward).

Prints both wall times, their ratio and the maximum relative difference of W (the mean Jacobian), i.e.
max |W_batched - W_reference| / max |W_reference|.

    python benchmarks/lre.py                      # embedded SmolLM2-135M, country_capital, 4 prompts, layer 8
    python benchmarks/lre.py --model PATH --layer 4 --n 8 --threads 2
"""
from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from llmprobe.datasets import load_relations  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402
from llmprobe.model.lre import per_prompt_jacobians, subject_jacobians  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--relation", default="country_capital", help="bundled relation whose first template to use")
    parser.add_argument("--n", type=int, default=4, help="number of prompts (the relation's first subjects)")
    parser.add_argument("--layer", type=int, default=8, help="subject-state layer")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--chunk", type=int, default=32, help="output dims per batched backward")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    relation = load_relations([args.relation])[0]
    template = relation.templates[0]
    subjects = [f.subject for f in relation.facts[:args.n]]
    layer = lm.adapter.layer_index(args.layer)
    print(f"model {lm.info['name']} ({lm.info['n_layers']} layers, d={lm.info['d_model']}, {lm.info['dtype']}), "
          f"torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}")
    print(f"prompts: {len(subjects)} x {template!r} ({', '.join(subjects)}); layer {layer}; "
          f"o = blocks.{lm.adapter.n_layers - 1}.resid_post at the last token")

    subject_jacobians(lm, template, subjects[:1], layer, chunk=args.chunk)          # warm-up (allocator, kernels)
    start = time.perf_counter()
    ref = per_prompt_jacobians(lm, template, subjects, layer)
    t_ref = time.perf_counter() - start
    start = time.perf_counter()
    fast = subject_jacobians(lm, template, subjects, layer, batch_size=args.batch_size, chunk=args.chunk)
    t_fast = time.perf_counter() - start
    start = time.perf_counter()
    plain = subject_jacobians(lm, template, subjects, layer, batch_size=args.batch_size, chunk=args.chunk,
                              use_cache=False)
    t_plain = time.perf_counter() - start

    W_ref, W_fast, W_plain = ref.W.double(), fast.W.double(), plain.W.double()
    scale = W_ref.abs().max()
    rel = float((W_fast - W_ref).abs().max() / scale)
    rel_plain = float((W_plain - W_ref).abs().max() / scale)
    fro = float((W_fast - W_ref).norm() / W_ref.norm())
    print(f"per-prompt torch.autograd.functional.jacobian: {t_ref:8.2f} s")
    print(f"batched (KV-cached prefix, vmap chunk {args.chunk}):   {t_fast:8.2f} s   speed-up x{t_ref / t_fast:.1f}")
    print(f"batched without the KV cache:                  {t_plain:8.2f} s   speed-up x{t_ref / t_plain:.1f}")
    print(f"max relative difference of W: {rel:.2e} (no cache: {rel_plain:.2e}); "
          f"relative Frobenius difference {fro:.2e}")
    return {"t_reference": t_ref, "t_batched": t_fast, "t_batched_no_cache": t_plain, "ratio": t_ref / t_fast,
            "max_rel_diff_W": rel}


if __name__ == "__main__":
    main()
