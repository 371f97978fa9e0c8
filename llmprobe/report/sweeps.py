"""The synthetic sweeps three claim lines are graded from (``llmprobe.report.claims``: capacity, freeze-and-swap,
chain-of-thought width), the same in every report: their stored results and the statistics of them that involve no
claim (the capacity scaling fits with their bootstrap intervals, the growth per hop of d*'s exponent of R).
Torch-free, as the rest of ``llmprobe.report``."""
from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

# The capacity sweep's measured thresholds: exact d* (d*-1 failed with two initialisations) per (N, R) cell, one
# per seed (0, 1), R random bijections of N subjects, uniform attention, MLP 8d, a 500-step cap. Upper bounds are
# left out: frozen N = 1024, R = 16 (its confirmation unfinished) and N = 4096, R = 2 seed 1 (<= 12).
CAPACITY_SWEEP = {
    "source": "docs/synthetic.md, 'Measured thresholds' (N <= 1024, the confirmed re-run: N = 1024, R = 16 "
              "trainable seed 0 is 29) and 'The grid to N = 4096' (N = 2048, 4096 at R = 2)",
    "cite": "docs/synthetic.md", "date": "2026-12-01", "maps": "bijections", "max_steps": 500,
    "trainable": {(256, 2): (4, 4), (256, 4): (7, 7), (256, 8): (11, 11), (256, 16): (18, 18),
                  (512, 2): (4, 4), (512, 4): (8, 8), (512, 8): (14, 14), (512, 16): (24, 24),
                  (1024, 2): (5, 4), (1024, 4): (9, 9), (1024, 8): (17, 17), (1024, 16): (29, 30),
                  (2048, 2): (5, 5), (4096, 2): (6, 5)},
    "frozen": {(256, 2): (7, 7), (256, 4): (11, 11), (256, 8): (16, 16), (256, 16): (24, 24),
               (512, 2): (8, 8), (512, 4): (14, 14), (512, 8): (22, 22), (512, 16): (34, 34),
               (1024, 2): (10, 9), (1024, 4): (18, 19), (1024, 8): (29, 30),
               (2048, 2): (10, 10), (4096, 2): (12,)}}
# random many-to-one maps shaped like a fact table, trainable, exact d* per seed (0, 1): (n_subjects, n_relations,
# n_facts, step cap) -> their attribute counts, bits (seed 0, 1) and d* (docs/synthetic.md, "General maps at the
# controls' budget", 2026-12-01; shaped like SmolLM2's country table, attribute counts scaled by N / 193)
RANDOM_MAPS = {(193, 6, 1158, 2000): {"attributes": (193, 6, 73, 141, 191, 22), "bits": (5559.3, 5579.5),
                                      "d_star": (5, 5)},
               (96, 6, 576, 2000): {"attributes": (96, 3, 36, 70, 95, 11), "bits": (2201.1, 2221.5),
                                    "d_star": (4, 4)},
               (48, 6, 288, 2000): {"attributes": (48, 2, 18, 35, 48, 5), "bits": (831.9, 845.2),
                                    "d_star": (4, 4)}}
# what d* is fitted against (d* = a + b x): the claim's R log2 N, the key-value memories it must explain better
# (a vector per subject: N; per fact: N R), and a power of N that a 256-4096 range may not tell from log N
SCALING_FEATURES = {"R log2 N": lambda n, r: r * math.log2(n), "N": lambda n, r: float(n),
                    "N R": lambda n, r: float(n * r), "R sqrt N": lambda n, r: r * math.sqrt(n)}
MEMORY_FEATURES = ("N", "N R")
FROZEN_FACTOR = 2.0             # "far more": frozen d* at least this many times the trainable d* of the same cell
N_BOOT_CAPACITY = 2000          # bootstrap resamples of the sweep's cells (seeded: the same intervals every run)


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float | None] | None:
    """(intercept, slope, R^2) of the least-squares line ys = a + b xs; None when xs do not vary (or are none), R^2
    None when ys do not vary."""
    n = len(xs)
    if not n:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx > 0:
        return None
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return my - sxy / sxx * mx, sxy / sxx, sxy * sxy / (sxx * syy) if syy > 0 else None


def _percentiles(values: list[float]) -> list[float]:
    """The 95% percentile interval [2.5%, 97.5%] of bootstrap values."""
    ordered = sorted(values)
    return [ordered[int(0.025 * (len(ordered) - 1))], ordered[int(math.ceil(0.975 * (len(ordered) - 1)))]]


def _cell_statistics(sweep: dict, cells: list[tuple[int, int]]) -> dict | None:
    """Per mode, {feature: (intercept, slope, R^2)} of d* = a + b x over ``cells`` (each bringing all its seeds),
    and the geometric mean of frozen / trainable d* over the (cell, seed) pairs both modes have; None when a fit is
    degenerate (a resample of one N or one d*)."""
    out = {}
    for mode in ("trainable", "frozen"):
        points = [(n, r, d) for n, r in cells for d in sweep[mode].get((n, r), ())]
        fits = {name: line_fit([x(n, r) for n, r, _ in points], [d for *_, d in points])
                for name, x in SCALING_FEATURES.items()}
        if any(fit is None or fit[2] is None for fit in fits.values()):
            return None
        out[mode] = fits
    ratios = [math.log(f / t) for cell in cells
              for t, f in zip(sweep["trainable"].get(cell, ()), sweep["frozen"].get(cell, ()))]
    out["ratio"] = math.exp(sum(ratios) / len(ratios)) if ratios else None
    return out


def capacity_scaling(sweep: dict, n_boot: int = N_BOOT_CAPACITY, seed: int = 0) -> dict:
    """The capacity claim graded from a sweep's thresholds (``CAPACITY_SWEEP``'s form: {"trainable" | "frozen":
    {(N, R): (d* per seed)}}): per mode, d* = a + b x for each of ``SCALING_FEATURES`` (intercept, slope with its
    95% interval, R^2), R^2 differences with their intervals, the frozen / trainable ratio, and a verdict each
    (``VERDICT_RULE``). Intervals: percentile bootstrap over cells (a cell's seeds stay together; ``n_boot``
    resamples from ``seed``; degenerate resamples skipped)."""
    cells = sorted(set(sweep["trainable"]) | set(sweep["frozen"]))
    full = _cell_statistics(sweep, cells)
    if full is None:
        raise ValueError("capacity sweep: every mode needs cells of at least two N and two d* values")
    rng = random.Random(seed)
    boots = [b for b in (_cell_statistics(sweep, rng.choices(cells, k=len(cells))) for _ in range(n_boot)) if b]

    def interval(of: Callable[[dict], float | None]) -> list[float] | None:
        values = [v for v in map(of, boots) if v is not None]
        return _percentiles(values) if values else None

    def delta(mode: str, feature: str, other: str) -> dict:
        return {"value": full[mode][feature][2] - full[mode][other][2],
                "ci": interval(lambda b: b[mode][feature][2] - b[mode][other][2])}

    out = {"source": sweep.get("source"), "date": sweep.get("date"), "n_boot": len(boots)}
    for mode in ("trainable", "frozen"):
        out[mode] = {"n_cells": sum(1 for c in cells if sweep[mode].get(c)),
                     "n_points": sum(len(sweep[mode].get(c, ())) for c in cells),
                     "fits": {name: {"intercept": a, "slope": b, "r2": r2,
                                     "slope_ci": interval(lambda boot, name=name: boot[mode][name][1])}
                              for name, (a, b, r2) in full[mode].items()}}
    trainable, frozen = out["trainable"], out["frozen"]
    trainable["against"] = {other: delta("trainable", "R log2 N", other) for other in (*MEMORY_FEATURES, "R sqrt N")}
    slope_lo, slope_hi = trainable["fits"]["R log2 N"]["slope_ci"]
    memories = [trainable["against"][m]["ci"] for m in MEMORY_FEATURES]
    trainable["verdict"] = ("supported" if slope_lo > 0 and all(lo > 0 for lo, _ in memories) else
                            "not shown" if slope_hi <= 0 or any(hi < 0 for _, hi in memories) else "inconclusive")
    frozen["growth"] = delta("frozen", "R sqrt N", "R log2 N")
    frozen["ratio"] = {"value": full["ratio"], "ci": interval(lambda b: b["ratio"]), "factor": FROZEN_FACTOR}
    (g_lo, g_hi), ratio_ci = frozen["growth"]["ci"], frozen["ratio"]["ci"]
    frozen["verdict"] = ("inconclusive" if ratio_ci is None else
                         "supported" if g_lo > 0 and ratio_ci[0] >= FROZEN_FACTOR else
                         "not shown" if g_hi < 0 or ratio_ci[1] < FROZEN_FACTOR else "inconclusive")
    return out


@functools.cache
def sweep_scaling() -> dict:
    """:func:`capacity_scaling` of ``CAPACITY_SWEEP`` (computed once a process: ~0.5 s)."""
    return capacity_scaling(CAPACITY_SWEEP)


# The stored result the line reads (the report holds no swap of its own): zero-shot accuracy of each seed on a new
# table, printed by ``python benchmarks/calibration_swap.py --worlds trained`` (llmprobe.jobs.calibration.
# calibrate_swap; the swap sweep's cell of docs/mechanisms.md section 4, trainable d/d* = 4, rerun 2026-12-05).
SWAP_RESULT = {
    "setting": "the one-layer model trained on N = 256 subjects x R = 4 random bijections (trainable, d = 28 = "
               "4 d*, d_mlp = 8 d, Adam lr 0.03, weight decay 1e-4, 1000 full-batch steps), new table seed = "
               "seed + 1000",
    "source": "stored synthetic result (benchmarks/calibration_swap.py, 2026-12-05), the same in every report",
    "seeds": [
        {"seed": 0, "swap": 0.3213, "random_init": 0.0029, "random_matched": 0.0029, "old_embeddings": 0.0029},
        {"seed": 1, "swap": 0.3164, "random_init": 0.0039, "random_matched": 0.0, "old_embeddings": 0.0029},
        {"seed": 2, "swap": 0.2939, "random_init": 0.0059, "random_matched": 0.0059, "old_embeddings": 0.0029}],
}


# d* (smallest width on the grid reaching 100% train accuracy) per (k, chain-of-thought, R) and seed 0, 1, 2 of the
# stored multi-hop sweep docs/data/multihop/n16/points.jsonl (docs/multihop.md; llmprobe synth multihop-seeds -N 16
# -R 2,4,8 --hops 1,2,3 --seeds 0,1,2); None: the search is open (seed 1, R = 8, k = 3 without CoT: d* > 96). One
# hop with CoT is the same data as without. tests/test_calibration.py checks these against that file.
MULTIHOP_DSTAR = {
    "setting": "k-hop recall over R random permutations of N = 16 subjects, R = 2, 4, 8, k = 1-3, 3 seeds, "
               "learned attention, d_mlp = 4 d, 2000 Adam steps at lr 0.03",
    "source": "stored synthetic sweep (docs/data/multihop/n16/points.jsonl, docs/multihop.md), the same in every "
              "report",
    "cells": {(1, False): {2: (2, 4, 2), 4: (4, 3, 3), 8: (8, 6, 8)},
              (2, False): {2: (6, 12, 4), 4: (16, 12, 12), 8: (24, 24, 24)},
              (3, False): {2: (8, 12, 12), 4: (24, 24, 24), 8: (96, None, 64)},
              (1, True): {2: (2, 4, 2), 4: (4, 3, 3), 8: (8, 6, 8)},
              (2, True): {2: (4, 12, 4), 4: (8, 8, 8), 8: (8, 16, 8)},
              (3, True): {2: (12, 8, 12), 4: (12, 8, 8), 8: (12, 16, 12)}},
}
N_BOOT_WIDTH = 2000


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x over (x, y) points (:func:`line_fit`); None when x does not vary."""
    fit = line_fit([x for x, _ in points], [y for _, y in points])
    return fit[1] if fit else None


def hop_growth(cells: dict[int, dict[int, tuple]]) -> float | None:
    """beta, the growth per hop of the exponent of R in d*: b_k = the least-squares slope of log d* on log R at k
    hops (every seed a point; None = open, left out), beta = the least-squares slope of b_k on k. d* ~ R^(beta k)
    up to factors of k: beta = 1 for d* ~ R^k (the paper's prediction without CoT), 0 when d* = f(k) g(R) (linear
    or any other growth in k that does not compound R). ``cells``: {k: {R: (d* per seed)}}."""
    exponents = []
    for k, by_r in sorted(cells.items()):
        b = _slope([(math.log(R), math.log(d)) for R, ds in by_r.items() for d in ds if d])
        if b is not None:
            exponents.append((k, b))
    return _slope(exponents) if len(exponents) > 1 else None
