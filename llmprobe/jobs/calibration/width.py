"""The multi-hop width line (:func:`calibrate_width`) calibrated on planted d*.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from llmprobe.report.claims import width_test

# ------------------------------------------------------------------------------------------- multi-hop width
GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)   # the sweep's widths


def planted_dstar(width: Callable, seed: int, noise: float = 0.25, cot: Callable = lambda k, R: 3 * R ** 0.2,
                  seeds: int = 3) -> dict:
    """d* per (k, chain-of-thought) cell of a planted world, as the multi-hop sweep measures it: ``width(k, R)``
    without CoT and ``cot(k, R)`` with it (default flat: 3 R^0.2), each times log-normal seed noise (sd ``noise``)
    and rounded up to the sweep's grid, ``seeds`` seeds at R = 2, 4, 8 and k = 1, 2, 3: {(k, cot): {R: (d*, ...)}}."""
    rng = random.Random(seed)

    def on_grid(d: float) -> int:
        noisy = d * math.exp(rng.gauss(0.0, noise))
        return next((g for g in GRID if g >= noisy), GRID[-1])
    return {(k, with_cot): {R: tuple(on_grid((cot if with_cot else width)(k, R)) for _ in range(seeds))
                            for R in (2, 4, 8)} for k in (1, 2, 3) for with_cot in (False, True)}


WIDTH_WORLDS = {"R^k (the paper's, holds)": (lambda k, R: 1.5 * R ** k, True),
                "R^(k/2) (holds, weaker)": (lambda k, R: 2 * R ** (k / 2), True),
                "k R (linear in k, fails)": (lambda k, R: 2 * k * R, False),
                "2^k R (exponential in k, not in R^k: fails)": (lambda k, R: 2 ** k * R, False),
                "flat, as with CoT (fails)": (lambda k, R: 3 * R ** 0.2, False)}


def calibrate_width(replicates: int, noise: float = 0.25, n_boot: int = 1000, on_row=None) -> list[dict]:
    """One row per world of :data:`WIDTH_WORLDS`: the mean beta without CoT and the fraction of ``replicates``
    planted draws (3 seeds each, CoT flat) graded supported and supported or weak by the width line's rule
    (``llmprobe.report.claims.width_test``)."""
    rows = []
    for name, (width, holds) in WIDTH_WORLDS.items():
        tests = [width_test(planted_dstar(width, seed, noise), n_boot=n_boot, seed=seed) for seed in range(replicates)]
        row = {"world": name, "claim_holds": holds, "replicates": replicates, "noise": noise,
               "beta": sum(t["metric"]["value"] for t in tests) / replicates,
               "supported": sum(t["grade"] == "supported" for t in tests) / replicates,
               "supported_or_weak": sum(t["grade"] in ("supported", "weak") for t in tests) / replicates}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_width_rows(rows: list[dict]) -> str:
    """The width calibration table as text."""
    out = [f"{'world (d* without CoT)':46s} {'holds':5s} {'reps':>4s} {'noise':>5s} {'beta':>6s}  supp / supp+weak"]
    for r in rows:
        out.append(f"{r['world']:46s} {'yes' if r['claim_holds'] else 'no':5s} {r['replicates']:4d} {r['noise']:5.2f} "
                   f"{r['beta']:6.2f}  {r['supported']:4.2f} / {r['supported_or_weak']:4.2f}")
    return "\n".join(out)
