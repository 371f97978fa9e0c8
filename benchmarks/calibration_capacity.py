"""Benchmark: the capacity line's scaling rule calibrated on planted sweeps of the real sweep's cells.

Worlds (``llmprobe.jobs.calibration.capacity_worlds``): trainable d* proportional to R log2 N (the claim holds),
to N (a vector per subject) or to N R (a vector per fact: a key-value memory), each scaled to the sweep's mean
trainable d*; frozen d* proportional to R sqrt N at 2.5 times it (the frozen half holds) or the trainable law at
1.2 times it (it fails). Each replicate draws the sweep's own cells and seeds (``CAPACITY_SWEEP``: 14 trainable
and 13 frozen (N, R) cells, 28 and 25 thresholds), adds Gaussian noise and rounds to whole widths, and grades the
sweep with ``llmprobe.report.sweeps.capacity_scaling`` (the report's rule). Noise levels: the sweep's residual
about its R log2 N fit (``sweep_noise``, the law's misfit included: conservative) and its seeds' spread
(``seed_noise``). Printed per world and noise: the fraction of replicates whose trainable and frozen halves are
graded supported and not shown (power where a half holds, false-positive rate where it fails).

    python benchmarks/calibration_capacity.py                     # 50 replicates, 500 resamples (~3 min, 1 core)
    python benchmarks/calibration_capacity.py --replicates 10 --n-boot 200 --out runs/calibration_capacity.json
"""
from __future__ import annotations

import argparse
import time

from llmprobe.jobs.calibration import (
    calibrate_capacity,
    capacity_worlds,
    finish,
    format_capacity_rows,
    seed_noise,
    sweep_noise,
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicates", type=int, default=50)
    parser.add_argument("--n-boot", type=int, default=500, help="bootstrap resamples of the cells per replicate")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    t = time.perf_counter()
    rows = []
    for name, noise in (("the sweep's residual about R log2 N", sweep_noise()), ("the seeds' spread", seed_noise())):
        print(f"noise sd {noise:.2f} ({name}), {args.replicates} replicates, {args.n_boot} resamples", flush=True)
        graded = calibrate_capacity(capacity_worlds(), args.replicates, noise, args.n_boot)
        print(format_capacity_rows(graded), flush=True)
        rows += graded
    return finish(rows, "", t, args.out)


if __name__ == "__main__":
    main()
