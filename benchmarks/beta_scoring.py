"""Benchmark: scoring every beta of an LRE decoder, one LM-head call per beta against ``line_argmax``.

The decoders choose beta by faithfulness: the top-1 token of logits(beta W h + b) for every beta of a grid (7 in
the strict protocol, 21 in the reference's). ``llmprobe.model.engine.line_argmax`` serves the whole grid with two
head calls where the final norm is an RMS norm (docs/analyses.md); this script times both on the model's own
states, in the same run, and checks that they give the same ids.

Rows: o at the last block (before the final norm) of a relation's prompts, A = o - mean(o) (the slope's
direction), B = mean(o) (the bias), as the decoders' beta W h + b.

    python benchmarks/beta_scoring.py                     # embedded SmolLM2-135M, country_capital, 60 rows
    python benchmarks/beta_scoring.py --model PATH --n 90 --threads 2
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from llmprobe.datasets import load_relations  # noqa: E402
from llmprobe.model.engine import line_argmax, logits_fn, relation_states  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402

GRIDS = {"strict (7 betas)": (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0),
         "lre (21 betas)": tuple(i / 4 for i in range(21))}


def best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (seconds)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--relation", default="country_capital", help="bundled relation whose prompts to use")
    parser.add_argument("--n", type=int, default=60, help="rows (the relation's first subjects)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the fastest is printed)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu")
    relation = load_relations([args.relation])[0]
    subjects = [f.subject for f in relation.facts[:args.n]]
    O = relation_states(lm, relation.templates[0], subjects, []).O.double()
    A, B = O - O.mean(0), O.mean(0).expand(len(O), -1)
    to_logits = logits_fn(lm)
    out = {}
    print(f"{len(O)} rows of {args.relation}, {args.threads} thread(s); fastest of {args.repeats}")
    print(f"{'grid':<18}{'one call per beta s':>21}{'line_argmax s':>15}{'speed-up':>10}  same ids")
    for name, betas in GRIDS.items():
        per_beta = lambda: torch.stack([to_logits(beta * A + B).argmax(-1) for beta in betas])  # noqa: E731
        lined = lambda: line_argmax(lm, A, B, betas)  # noqa: E731
        same = torch.equal(per_beta(), lined())
        t_per, t_line = best_of(per_beta, args.repeats), best_of(lined, args.repeats)
        print(f"{name:<18}{t_per:>21.3f}{t_line:>15.3f}{t_per / t_line:>9.1f}x  {same}")
        out[name] = {"per_beta_s": t_per, "line_argmax_s": t_line, "same_ids": same}
    return out


if __name__ == "__main__":
    main()
