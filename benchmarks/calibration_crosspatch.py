"""Benchmark: the crosspatch line's measure ("one subject state serves every relation": the neutral state of s
patched into relation B's prompt of s' against the random_subject and random_vector patches) calibrated on planted
subject states at the real run's n.

Worlds (``llmprobe.jobs.calibration.crosspatch_worlds``; fresh Gaussian attribute vectors, token embeddings and
noise per replicate, d = 576 as SmolLM2) on the fact table of the default SmolLM2 run's crosspatch (its six
country relations, 193 subjects; ``crosspatch_table``), with the run's items at the line's layer
(``planted_patch_items``: up to ``LRE_PAIR_ITEMS`` = 7 per ordered relation pair, as the run patches at its LRE
layers, among which the line's layer is chosen: 210 items over 30 pairs, every pair filled in the SmolLM2 run of
2026-12-06 too), states where one state serves every relation by construction (the
paper's construction, whose state is the subject's embedding; a deep model's token + attribute sum at three noise
levels, one with B's own prompt adding to B's attribute), the lexical world where B looks the subject up by its
token identity (the claim holds literally, the state carries no attribute), and worlds where it fails
(relation-specific states, a shared state with half the relations, a fallback to B's commonest answer whenever
another prompt's state is patched in, equal rates). Each is measured by the run's own pooled metrics
(``llmprobe.analyses.selector._patch_metrics``) and graded by the report's own ``_crosspatch_tests`` with Bonferroni
over ``--family`` tests (the SmolLM2 report's Holm family) and its power there, by the line (every relation B, one
intersection-union test), the line before (pooled over pairs), the house form (per relation, the median shown) and
the pooled test with a candidate null (the token swap). Printed per world: the mean success of each patch and the fraction of
replicates graded supported, supported-or-weak and inconclusive (low power): power where the claim holds,
false-positive rate where it fails.

    python benchmarks/calibration_crosspatch.py                    # 100 replicates (~8 min, 1 core, busy host)

Then the world at SmolLM2's rate and the half-the-relations world again at ``--power-per-pair`` items per pair
(3: the other layers' profile and the run before 2026-12-06; 6 and 8 beside the run's 7: what the power costs).
    python benchmarks/calibration_crosspatch.py --replicates 20 --out runs/calibration_crosspatch.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.analyses.selector import LRE_PAIR_ITEMS  # noqa: E402
from llmprobe.jobs.calibration import (  # noqa: E402
    CROSSPATCH_FAMILY,
    calibrate_crosspatch,
    crosspatch_table,
    crosspatch_worlds,
    finish,
    format_crosspatch_rows,
    progress,
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=576, help="width of the planted states (SmolLM2: 576)")
    parser.add_argument("--replicates", type=int, default=100, help="replicates per planted world")
    parser.add_argument("--equal-rates-replicates", type=int, default=400,
                        help="replicates of the equal-rates world (no model; its false-positive rate is small)")
    parser.add_argument("--family", type=int, default=CROSSPATCH_FAMILY,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 27)")
    parser.add_argument("--per-pair", type=int, default=LRE_PAIR_ITEMS,
                        help="items per ordered pair (the run's at its LRE layers, where the line is graded)")
    parser.add_argument("--power-per-pair", type=int, nargs="*", default=[3, 6, 8],
                        help="items per ordered pair at which the SmolLM2-rate and half-the-relations worlds are "
                             "measured again: what the line's power costs")
    parser.add_argument("--power-replicates", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    A, names = crosspatch_table()
    print(f"{A.shape[0]} subjects x {len(names)} relations ({', '.join(names)}), d = {args.d}, "
          f"{args.per_pair} items per ordered pair, {args.replicates} replicates per world, Bonferroni over "
          f"{args.family} tests", flush=True)
    done = progress(t)
    worlds = crosspatch_worlds()
    planted, equal_rates = [w for w in worlds if "equal rates" not in w.name], [w for w in worlds if "equal rates"
                                                                               in w.name]
    rows = calibrate_crosspatch(planted, A, args.d, args.replicates, args.family, per_pair=args.per_pair,
                                on_row=done)
    rows += calibrate_crosspatch(equal_rates, A, args.d, args.equal_rates_replicates, args.family,
                                 per_pair=args.per_pair, on_row=done)
    table = format_crosspatch_rows(rows)
    power_worlds = [worlds[1], worlds[6]]       # token + attributes at SmolLM2's rate; half the relations
    for per_pair in args.power_per_pair:
        more = calibrate_crosspatch(power_worlds, A, args.d, args.power_replicates, args.family, per_pair=per_pair,
                                    on_row=done)
        table += f"\n{per_pair} items per ordered pair\n" + format_crosspatch_rows(more)
        rows += [{**row, "per_pair": per_pair} for row in more]
    return finish(rows, table, t, args.out)


if __name__ == "__main__":
    main()
