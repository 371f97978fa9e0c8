"""Benchmark: the freeze-and-swap line's measure calibrated on planted one-layer models, and the stored result the
line reads.

Worlds (``llmprobe.jobs.calibration.swap_worlds``): the paper's construction and a trained geometric model, where
the table is the subject embeddings' geometry, and two key-value memories (an MLP that reads only the subject;
frozen_all), where it is not. Each seed draws a table and a model; the model is frozen and given subject
embeddings built from its superposition fit for a new table (each relation's column permuted across subjects,
new-table seed = seed + 1000, as the swap sweep draws it), and its zero-shot accuracy there is set against
random_init, random_matched and the model's own old embeddings (``calibrate_swap``), graded by the line's rule
(``llmprobe.report.claims.swap_test``). The trained row's per-seed numbers are ``SWAP_RESULT["seeds"]`` in
``llmprobe/report/claims.py``.

    python benchmarks/calibration_swap.py                      # N 256, R 4, d 28, seeds 0-2 (~2 min, 1 core)
    python benchmarks/calibration_swap.py --worlds trained --out runs/calibration_swap.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.io import write_json  # noqa: E402
from llmprobe.jobs.calibration import calibrate_swap, format_swap_rows, swap_worlds  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-N", type=int, default=256)
    parser.add_argument("-R", type=int, default=4)
    parser.add_argument("--d", type=int, default=28, help="width of the trained worlds (the swap sweep: 4 d* = 28)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--worlds", nargs="+", default=None,
                        help="first words of the worlds to run (construction, trained, key-value); default all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows (per-seed numbers) to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    worlds = swap_worlds(args.N, args.R, args.d, args.steps)
    if args.worlds:
        worlds = [w for w in worlds if any(w.name.startswith(k) for k in args.worlds)]
    start = time.perf_counter()
    rows = calibrate_swap(worlds, tuple(args.seeds), on_row=lambda r: print(r["world"], r["seeds"], flush=True))
    print(f"N = {args.N}, R = {args.R}, d = {args.d}, seeds {args.seeds}, {time.perf_counter() - start:.0f} s")
    print(format_swap_rows(rows))
    if args.out:
        write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
