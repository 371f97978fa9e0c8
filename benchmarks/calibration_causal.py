"""Benchmark: the causal line's measure (LRE causality against its nulls) calibrated on planted relations at the
real run's numbers of test pairs.

Worlds (``llmprobe.jobs.calibration.causal_worlds``; a fresh relation per replicate, d = 576 as SmolLM2): an
exactly linear rank-16 relation read by a linear head whose states have a large part in W's null space (the
pseudo-inverse edit flips the answer by construction, a step toward h_t of its norm moves o only
1 / sqrt(1 + share^2) of the way) at null shares 3 and 1.5, where the claim holds; the same relation with the
states in W's row space (the step toward h_t is the edit) and a key-value memory (a soft lookup of every fact's
key), where the edit does no better than the step; and equal rates (no model: the edit and the step flip each pair
with the same probability, independently), the paired interval's test at small n. Each is measured by the pretrained run's causality code
(``llmprobe.analyses.decoders.lre_causality`` and ``causality_metric``: the run's split, 3 re-fits, W the mean
Jacobian of 3 prompts, edit ranks 8, 32, 128 chosen on validation pairs) at ``--facts`` known facts (the SmolLM2
run's relations: 10-90, about a third of them test pairs) and graded with Bonferroni over ``--family`` tests (the
SmolLM2 report's Holm family) by three tests: the line now (nulls scaled_patch, random_direction,
random_operator; paired margins), the same nulls by MOVER (older reports) and the line before (random_direction,
random_operator). Printed per world and n: the mean rates and the fraction of replicates graded supported,
supported-or-weak and inconclusive (low power): power where the claim holds, false-positive rate where it fails.

    python benchmarks/calibration_causal.py                      # 20 replicates (~15 min, 1 core)
    python benchmarks/calibration_causal.py --facts 10 49 --replicates 5 --out runs/calibration_causal.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.jobs.calibration import calibrate_causal, causal_worlds, finish, format_causal_rows, progress  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--facts", type=int, nargs="+", default=[10, 19, 25, 49, 90],
                        help="known facts per planted relation (SmolLM2's: 10-90; test pairs about a third)")
    parser.add_argument("--d", type=int, default=576, help="width of the planted states (SmolLM2: 576)")
    parser.add_argument("--replicates", type=int, default=20, help="replicates per planted world and n")
    parser.add_argument("--equal-rates-replicates", type=int, default=400,
                        help="replicates of the equal-rates world (no model: fast; its false-positive rate is small)")
    parser.add_argument("--family", type=int, default=20,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    print(f"d = {args.d}, {args.facts} known facts, {args.replicates} replicates per world, Bonferroni over "
          f"{args.family} tests", flush=True)
    done = progress(t, lambda row: f"{row['world']}, {row['n']} pairs")

    worlds = causal_worlds()
    planted, equal_rates = [w for w in worlds if "equal rates" not in w.name], [w for w in worlds if "equal rates"
                                                                               in w.name]
    rows = calibrate_causal(planted, args.facts, args.d, args.replicates, args.family, on_row=done)
    rows += calibrate_causal(equal_rates, args.facts, args.d, args.equal_rates_replicates, args.family, on_row=done)
    return finish(rows, format_causal_rows(rows), t, args.out)


if __name__ == "__main__":
    main()
