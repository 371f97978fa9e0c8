"""Capture cost against a bare forward pass, in one run on the same model and prompts.

Methods: bare forward; llmprobe targeted capture (a few layers, subject-last token, early stop); the same for every
layer; ``output_hidden_states=True``; transformer-lens ``TransformerBridge.run_with_cache`` (when it loads
offline). Each method runs in its own subprocess so its peak memory (ru_maxrss above the RSS after loading) is its
own. Prints wall time and extra peak memory as ratios to the bare forward pass.

    python benchmarks/capture.py [--model PATH] [--prompts 64] [--batch-size 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
METHODS = ("bare", "targeted", "targeted_all_layers", "output_hidden_states", "transformer_lens")


def _rss_kb() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def run_one(method: str, model: str | None, n_prompts: int, batch_size: int, repeats: int, threads: int) -> dict:
    import torch

    from llmprobe.datasets import load_relations
    from llmprobe.model.capture import capture, forward
    from llmprobe.model.loading import load_model
    from llmprobe.model.subjects import encode

    torch.set_num_threads(threads)
    lm = load_model(model, device="cpu")
    relation = load_relations(["country_capital"])[0]
    subjects = [f.subject for f in relation.facts[:n_prompts]]
    batches = [encode(lm.tokenizer, relation.templates[0], subjects[i:i + batch_size])
               for i in range(0, len(subjects), batch_size)]
    n = lm.adapter.n_layers
    few = [f"blocks.{l}.resid_post" for l in (n // 6, n // 3, n // 2)]
    every = [f"blocks.{l}.resid_post" for l in range(n)]
    bridge = None
    if method == "transformer_lens":
        try:
            from transformer_lens.model_bridge import TransformerBridge
        except ImportError:
            raise SystemExit("the transformer_lens method needs transformer-lens: "
                             "pip install 'llmprobe[lens]'") from None

        bridge = TransformerBridge.boot_transformers(lm.info["path"], hf_model=lm.model, tokenizer=lm.tokenizer,
                                                     device="cpu")

    def step(batch):
        with torch.no_grad():
            if method == "bare":
                return forward(lm.model, batch.input_ids, batch.attention_mask)
            if method == "targeted":
                return capture(lm.model, few, batch.input_ids, batch.attention_mask, batch.subject_last[:, None])
            if method == "targeted_all_layers":
                return capture(lm.model, every, batch.input_ids, batch.attention_mask, batch.subject_last[:, None])
            if method == "output_hidden_states":
                return forward(lm.model, batch.input_ids, batch.attention_mask, output_hidden_states=True)
            return bridge.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask)

    kept = step(batches[0])  # warm-up
    del kept
    rss_loaded = _rss_kb()
    start = time.perf_counter()
    results = []
    for _ in range(repeats):
        results = [step(batch) for batch in batches]  # noqa: F841 - kept alive, as a user would keep them
    seconds = (time.perf_counter() - start) / repeats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": method, "seconds": seconds, "extra_peak_mb": max(peak - rss_loaded, 0) / 1024,
            "n_prompts": len(subjects), "model": lm.info["name"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model name/folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.prompts, args.batch_size, args.repeats, args.threads)))
        return
    rows = []
    for method in METHODS:
        cmd = [sys.executable, __file__, "--one", method, "--prompts", str(args.prompts),
               "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--threads", str(args.threads)]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"method": method, "error": last[:150]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"model: {base.get('model')}, {base.get('n_prompts')} prompts, batch {args.batch_size}, "
          f"{args.threads} threads, mean of {args.repeats} passes")
    print(f"{'method':<24} {'seconds':>8} {'x bare':>7} {'extra peak MB':>14} {'x bare':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['method']:<24} failed: {row['error']}")
            continue
        print(f"{row['method']:<24} {row['seconds']:>8.3f} {row['seconds'] / base['seconds']:>7.2f} "
              f"{row['extra_peak_mb']:>14.1f} {row['extra_peak_mb'] / max(base['extra_peak_mb'], 1e-9):>7.2f}")


if __name__ == "__main__":
    main()
