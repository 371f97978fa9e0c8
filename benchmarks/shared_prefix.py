"""Benchmark: the lre known-fact check with its in-context prefix run once, against the full pass per prompt.

Same prompts, one run: a relation's facts after ``--n-icl`` in-context examples (one draw of the reference's
protocol, the prompts ``llmprobe.model.known.known_facts(protocol="lre")`` checks):

* full: ``llmprobe.model.engine.next_token_predictions`` (every prompt's every token, left-padded batches);
* shared prefix: ``llmprobe.model.engine.next_token_ids`` (the tokens every prompt starts with run once, each
  micro-batch only its own tokens after them on a copy of their KV cache; rows near a tie take the full pass).

Prints both wall times, their ratio, the largest logit difference of the fast path and whether the ids agree.

    python benchmarks/shared_prefix.py                     # embedded SmolLM2-135M, country_capital, 96 prompts
    python benchmarks/shared_prefix.py --relation lre:company_hq --n 200 --threads 2
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
from llmprobe.model.engine import next_token_ids, next_token_predictions, shared_prefix_logits  # noqa: E402
from llmprobe.model.known import icl_template, reference_start  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--relation", default="country_capital", help="bundled relation (or lre:NAME)")
    parser.add_argument("--n", type=int, default=96, help="prompts checked (the facts after the examples)")
    parser.add_argument("--n-icl", type=int, default=5, help="in-context examples (the reference's 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per micro-batch (known_facts' 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    relation = load_relations([args.relation])[0]
    examples, rest = relation.facts[:args.n_icl], relation.facts[args.n_icl:args.n_icl + args.n]
    template = icl_template(relation.templates[0], examples, start=reference_start(lm.tokenizer))
    subjects = [f.subject for f in rest]

    t0 = time.perf_counter()
    full = next_token_predictions(lm, template, subjects, batch_size=args.batch_size, return_logits=True)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = next_token_ids(lm, template, subjects, batch_size=args.batch_size)
    t_fast = time.perf_counter() - t0
    fast = shared_prefix_logits(lm, template, subjects, batch_size=args.batch_size)
    result = {"model": lm.info["name"], "relation": relation.name, "prompts": len(subjects), "threads": args.threads,
              "full_s": round(t_full, 2), "shared_prefix_s": round(t_fast, 2), "speedup": round(t_full / t_fast, 2),
              "max_logit_difference": float((fast - full).abs().max()),
              "ids_equal": bool(torch.equal(ids, full.argmax(-1))), "machine": platform.processor() or platform.machine()}
    print(f"{result['model']}, {result['relation']}: {result['prompts']} prompts after {args.n_icl} examples, "
          f"{args.threads} thread(s)")
    print(f"  full pass      {t_full:7.2f} s")
    print(f"  shared prefix  {t_fast:7.2f} s   ({result['speedup']:.2f}x; largest logit difference "
          f"{result['max_logit_difference']:.1e}; ids equal: {result['ids_equal']})")
    return result


if __name__ == "__main__":
    main()
