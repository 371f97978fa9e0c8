"""Benchmark: the chain-of-thought line (CoT against the direct answer to the same chains, the compositions' most
common answers and the same prompt with another chain's bridge) calibrated on planted worlds at the real run's
chains.

Chains (``llmprobe.jobs.calibration.SMOLLM2_CHAINS``): the SmolLM2 default run's 75 two-hop chains whose every hop
is known, in its 9 compositions with their sizes and their most common answers. Worlds:

* outcome level (``cot_rate_worlds``; each chain's direct and CoT hits drawn, paired at the run's correlation):
  CoT right at the run's direct rate (0.52) plus +0.10, +0.20, +0.30, +0.36 (the run's own gain) and on every
  chain, where the claim holds (the model reading its bridge: with another chain's it gives that chain's answer);
  equal rates, CoT's bridges wrong (its last hop at chance), a CoT prompt that only names the answer's type (its
  composition's most common answer, the direct format missing) and CoT that composes in the longer prompt and
  ignores its bridge (as right with another chain's bridge; at the run's rates and on every chain), where it fails;
* one-layer two-hop models (``cot_model_worlds``; the stored multi-hop sweep's recipe, N = 16, R = 8): a one-pass
  and a chain-of-thought model at d = 8 and 12, where the single hops fit and the one-pass composition does not
  (holds), at d = 32, where the one-pass model composes, and at d = 8 with the bridges replaced (fails); each
  model's wrong-bridge hits from another chain's true bridge fed to its chain-of-thought model.

Each draw is built into the multi-hop analysis' entry by its own code (``llmprobe.analyses.multihop._accuracy``:
the paired bootstrap, the majority control) and graded by the report's rule with Bonferroni over ``--family``
tests (the SmolLM2 report's Holm family) and its power there, by four tests: the direct answer alone, the direct
answer and the pooled majority control, "before" (the direct answer and the compositions' majority,
``llmprobe.report.claims.composition_majority``: the line as it grades a report without the wrong-bridge control)
and the line (and ``wrong_bridge``, paired). Printed: mean rates (wrong: the chain's answer with another chain's
bridge; follw: that chain's answer), and per test the fraction of replicates graded supported / supported or
weak / inconclusive (low power).

    python benchmarks/calibration_cot.py                         # 50 + 21 replicates (~5 min, 1 core)
    python benchmarks/calibration_cot.py --replicates 20 --model-seeds 2 --draws 2 --out runs/calibration_cot.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.jobs.calibration import (  # noqa: E402
    COT_FAMILY,
    calibrate_cot,
    cot_model_worlds,
    cot_rate_worlds,
    finish,
    format_cot_rows,
    progress,
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicates", type=int, default=50, help="replicates of each outcome-level world")
    parser.add_argument("--model-seeds", type=int, default=3, help="trained model pairs per model world")
    parser.add_argument("--draws", type=int, default=7, help="chain draws per trained model pair")
    parser.add_argument("--family", type=int, default=COT_FAMILY,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 27)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    print(f"{args.replicates} replicates per outcome world, {args.model_seeds} x {args.draws} per model world, "
          f"Bonferroni over {args.family} tests", flush=True)
    done = progress(t)
    rows = calibrate_cot(cot_rate_worlds(), args.replicates, args.family, on_row=done)
    rows += calibrate_cot(cot_model_worlds(draws=args.draws), args.model_seeds * args.draws, args.family,
                          on_row=done)
    return finish(rows, format_cot_rows(rows), t, args.out)


if __name__ == "__main__":
    main()
