"""The capacity line (:func:`calibrate_capacity`) calibrated on planted sweeps.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from llmprobe.report.sweeps import CAPACITY_SWEEP, SCALING_FEATURES, capacity_scaling, line_fit


# ------------------------------------------------------------------------------------------------ capacity
@dataclass(frozen=True)
class CapacityWorld:
    """A planted world of the capacity line: d*(N, R) of the trainable and the frozen mode before noise;
    ``holds``: (trainable half, frozen half) true or false by construction (None: the frozen half is not planted
    against this trainable law)."""

    name: str
    trainable: Callable[[int, int], float]
    frozen: Callable[[int, int], float]
    holds: tuple[bool, bool | None]


def capacity_worlds(sweep: dict = CAPACITY_SWEEP) -> list[CapacityWorld]:
    """Worlds on the sweep's own cells: trainable d* proportional to R log2 N (the claim), to N (a vector per
    subject) or to N R (a vector per fact: key-value memory), each scaled to the sweep's mean trainable d*; frozen d*
    proportional to R sqrt N at 2.5 times the trainable mean (the frozen half holds), or the trainable law at 1.2
    times it (it fails: no growth beyond log N, no large factor); beside the memories the frozen half is not
    planted (their trainable d* is no longer the R log2 N law the factor is stated against)."""
    def scaled(feature: Callable[[int, int], float], factor: float = 1.0) -> Callable[[int, int], float]:
        points = [(n, r, d) for (n, r), ds in sweep["trainable"].items() for d in ds]
        mean_d = sum(d for *_, d in points) / len(points)
        mean_x = sum(feature(n, r) for n, r, _ in points) / len(points)
        return lambda n, r: factor * mean_d / mean_x * feature(n, r)

    log_n, sqrt_n = SCALING_FEATURES["R log2 N"], SCALING_FEATURES["R sqrt N"]
    frozen_holds, frozen_fails = scaled(sqrt_n, 2.5), scaled(log_n, 1.2)
    return [CapacityWorld("trainable ~ R log2 N, frozen ~ R sqrt N x2.5", scaled(log_n), frozen_holds,
                          (True, True)),
            CapacityWorld("trainable ~ R log2 N, frozen = trainable law x1.2", scaled(log_n),
                          frozen_fails, (True, False)),
            CapacityWorld("trainable ~ N (per-subject memory)", scaled(SCALING_FEATURES["N"]),
                          frozen_holds, (False, None)),
            CapacityWorld("trainable ~ N R (per-fact key-value memory)", scaled(SCALING_FEATURES["N R"]),
                          frozen_holds, (False, None))]


def sweep_noise(sweep: dict = CAPACITY_SWEEP) -> float:
    """The sweep's noise level, conservatively: the residual standard deviation of its trainable d* about the fit
    on R log2 N (the law's misfit included; :func:`seed_noise` is the seeds' part alone)."""
    points = [(n, r, d) for (n, r), ds in sweep["trainable"].items() for d in ds]
    ys = [d for *_, d in points]
    a, b, _ = line_fit([SCALING_FEATURES["R log2 N"](n, r) for n, r, _ in points], ys)
    residuals = [d - a - b * SCALING_FEATURES["R log2 N"](n, r) for n, r, d in points]
    return math.sqrt(sum(e * e for e in residuals) / (len(points) - 2))


def seed_noise(sweep: dict = CAPACITY_SWEEP) -> float:
    """The seeds' noise in the sweep: the pooled within-cell standard deviation of d* over both modes' cells."""
    cells = [ds for mode in ("trainable", "frozen") for ds in sweep[mode].values() if len(ds) > 1]
    within = sum(sum((d - sum(ds) / len(ds)) ** 2 for d in ds) for ds in cells)
    return math.sqrt(within / sum(len(ds) - 1 for ds in cells))


def planted_sweep(world: CapacityWorld, noise: float, seed: int, sweep: dict = CAPACITY_SWEEP) -> dict:
    """A sweep of ``sweep``'s cells and seeds whose d* are ``world``'s plus Gaussian noise of sd ``noise``,
    rounded to whole widths (at least 2), as a bisection reports them."""
    rng = random.Random(seed)
    law = {"trainable": world.trainable, "frozen": world.frozen}
    return {mode: {(n, r): tuple(max(2, round(law[mode](n, r) + rng.gauss(0.0, noise))) for _ in ds)
                   for (n, r), ds in sweep[mode].items()} for mode in ("trainable", "frozen")}


def calibrate_capacity(worlds: list[CapacityWorld], replicates: int, noise: float, n_boot: int,
                       sweep: dict = CAPACITY_SWEEP) -> list[dict]:
    """Per world: the fraction of ``replicates`` planted sweeps (the real sweep's cells and seeds, ``noise``)
    whose trainable and frozen halves :func:`llmprobe.report.sweeps.capacity_scaling` grades supported, and not
    shown (power where a half holds, false-positive rate where it fails)."""
    rows = []
    for k, world in enumerate(worlds):
        graded = [capacity_scaling(planted_sweep(world, noise, 1000 * k + i, sweep), n_boot=n_boot, seed=i)
                  for i in range(replicates)]
        row = {"world": world.name, "trainable_holds": world.holds[0], "frozen_holds": world.holds[1],
               "replicates": replicates, "noise": noise}
        for half in ("trainable", "frozen"):
            for grade_name in ("supported", "not shown"):
                row[f"{half}_{grade_name.replace(' ', '_')}"] = sum(
                    g[half]["verdict"] == grade_name for g in graded) / replicates
        rows.append(row)
    return rows


def format_capacity_rows(rows: list[dict]) -> str:
    """The capacity calibration as text: per world and half, whether it holds, the fractions graded supported
    and not shown."""
    out = [f"{'world':52s} {'reps':>4s}  {'trainable holds: supp / not shown':>34s}  "
           f"{'frozen holds: supp / not shown':>31s}"]
    for r in rows:
        holds = {True: "yes", False: "no", None: "-"}
        out.append(f"{r['world']:52s} {r['replicates']:4d}  {holds[r['trainable_holds']]:>15s}: "
                   f"{r['trainable_supported']:5.2f} / {r['trainable_not_shown']:9.2f}  "
                   f"{holds[r['frozen_holds']]:>12s}: {r['frozen_supported']:5.2f} / {r['frozen_not_shown']:9.2f}")
    return "\n".join(out)
