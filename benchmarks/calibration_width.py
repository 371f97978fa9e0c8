"""Benchmark: the multi-hop width line's rule calibrated on planted d* (``llmprobe.jobs.calibration.calibrate_width``).

Worlds: d* without chain-of-thought growing like R^k (the paper's prediction) and like R^(k/2), where the claim
holds, and linearly in k (k R), exponentially in k but not compounding R (2^k R) and flat, where it fails; with
CoT d* is flat (3 R^0.2) in every world. Each draw: 3 seeds at R = 2, 4, 8 and k = 1-3 with log-normal seed noise,
rounded up to the sweep's width grid (the stored sweep's design), graded by ``llmprobe.report.claims.width_test``.

    python benchmarks/calibration_width.py                  # 100 draws per world, noise 0.25 (~1 min)
    python benchmarks/calibration_width.py --noise 0.4 --replicates 50
"""
from __future__ import annotations

import argparse
import time

from llmprobe.jobs.calibration import calibrate_width, format_width_rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicates", type=int, default=100)
    parser.add_argument("--noise", type=float, default=0.25, help="sd of the log-normal seed noise of d*")
    parser.add_argument("--boot", type=int, default=1000)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = calibrate_width(args.replicates, args.noise, args.boot)
    print(f"{args.replicates} draws per world, noise {args.noise:g}, {args.boot} bootstrap resamples, "
          f"{time.perf_counter() - start:.0f} s")
    print(format_width_rows(rows))
    return rows


if __name__ == "__main__":
    main()
