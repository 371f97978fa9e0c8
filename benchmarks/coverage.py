"""Benchmark: coverage of every interval the superposition readouts report, on planted data with known truth.

A planted world shaped like SmolLM2's country table: n subjects (default 193), 6 relations with 6-60 attributes
drawn with Zipf frequencies (many-to-one), u vectors of d_u >= n_attr dims (as unembedding rows: every relation's
vectors are linearly independent), h_s = scale * sum_r W_r u_{a_r(s)} + noise with held-out R^2 ~ 0.2. Each
repetition draws a new sample of subjects and measures it with ``superposition_readout`` (5 folds) twice: with the
grouped jackknife with refits (the default) and with ``jackknife_groups=0`` (the old intervals: percentile
bootstrap of out-of-fold values, Wilson, paired bootstrap; they hold the fits fixed).

The truth is what a cross-fitted number estimates: the expected population value of the same fits trained on a
fold's training subjects (n - n/5), by Monte Carlo (``--truth-fits`` training samples, each scored on 4000 fresh
subjects), for the true vectors and for the ``random_attributes`` control. Printed per interval type, at the
report's n: coverage (fraction of repetitions whose interval contains the truth) and mean width.

* Wilson: readout accuracy per relation (min and mean over the 6 relations);
* R^2: held-out R^2 of the superposition fit;
* pooled: readout accuracy pooled over relations (``llmprobe.metric.pooled_readout``, n = n x 6 facts);
* differences: the gain over random_attributes of R^2 and of each relation's readout accuracy.

    python benchmarks/coverage.py                         # n = 193, 300 repetitions (~10 min on 2 cores)
    python benchmarks/coverage.py --n 100 --reps 200
    python benchmarks/coverage.py --groups 10,20 --reps 150    # fewer refits per condition: 10 under-covers
    python benchmarks/coverage.py --timing                # the intervals' cost on SmolLM2's shape (d = 576)
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from llmprobe.geometry import (  # noqa: E402
    ALPHA_GRID,
    RelationReadout,
    SuperpositionFit,
    random_attributes,
    superposition_readout,
)
from llmprobe.geometry.readouts import JACKKNIFE_GROUPS  # noqa: E402
from llmprobe.metric import pooled_readout  # noqa: E402

COUNTS = (6, 22, 40, 50, 60, 60)
K = 5


class World:
    """The planted generative model: subjects are i.i.d. draws of a fact-table row and a noisy state."""

    def __init__(self, d: int, scale: float, seed: int = 123):
        g = torch.Generator().manual_seed(seed)
        self.d = d
        self.U = [torch.randn(c, d, generator=g, dtype=torch.float64) for c in COUNTS]
        self.W = [torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5 for _ in COUNTS]
        self.probs = [torch.tensor([1 / (i + 1) for i in range(c)], dtype=torch.float64) for c in COUNTS]
        self.scale = scale

    def draw(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        A = torch.stack([torch.multinomial(p / p.sum(), n, replacement=True, generator=g) for p in self.probs], 1)
        H = self.scale * sum(U_r[A[:, r]] @ W_r.T for r, (U_r, W_r) in enumerate(zip(self.U, self.W)))
        return H + torch.randn(n, self.d, generator=g, dtype=torch.float64), A


def truth(world: World, n: int, n_fits: int, seed: int = 7) -> dict:
    """Expected population values of fits trained on n - ceil(n / K) subjects, true and random vectors."""
    g = torch.Generator().manual_seed(seed)
    m = n - math.ceil(n / K)
    H_test, A_test = world.draw(4000, g)
    out = {}
    for name, U in (("real", world.U), ("random_attributes", random_attributes(world.U, 1000))):
        r2, acc = [], []
        for _ in range(n_fits):
            H, A = world.draw(m, g)
            r2.append(SuperpositionFit(alpha=ALPHA_GRID).fit(H, A, U).score(H_test, A_test))
            acc.append([RelationReadout(alpha=ALPHA_GRID).fit(H, A[:, r], U[r]).score(H_test, A_test[:, r])
                        for r in range(len(U))])
        acc = np.mean(acc, 0)
        out[name] = {"r2": float(np.mean(r2)), "readout": acc, "pooled": float(acc.mean())}
    return out


def intervals(rep) -> dict:
    """The intervals a report shows: per relation readout, R^2, pooled readout, gains over random_attributes."""
    real = rep.conditions["real"]
    names = rep.settings["relations"]
    return {"wilson": [real["readout_acc"][nm].ci for nm in names], "r2": [real["r2"].ci],
            "pooled": [pooled_readout({nm: real["readout_acc"][nm].to_dict() for nm in names})["ci"]],
            "r2 gain": [rep.gain("r2").ci], "readout gain": [rep.gain("readout_acc", nm).ci for nm in names]}


def coverage(n: int, reps: int, d: int, scale: float, groups: list[int], n_fits: int) -> None:
    world = World(d, scale)
    t0 = time.perf_counter()
    true = truth(world, n, n_fits)
    real, rand = true["real"], true["random_attributes"]
    targets = {"wilson": list(real["readout"]), "r2": [real["r2"]], "pooled": [real["pooled"]],
               "r2 gain": [real["r2"] - rand["r2"]], "readout gain": list(real["readout"] - rand["readout"])}
    print(f"planted: n = {n}, d = d_u = {d}, relations with {list(COUNTS)} attributes; truth at {n - math.ceil(n / K)} "
          f"training subjects ({n_fits} fits): R^2 {real['r2']:.3f} (random_attributes {rand['r2']:.3f}), readout "
          f"{np.round(real['readout'], 3).tolist()} ({time.perf_counter() - t0:.0f} s)")
    kinds = {**{f"jackknife with refits (G = {G})": G for G in groups}, "old: fits held fixed": 0}
    hits = {kind: {key: np.zeros(len(v)) for key, v in targets.items()} for kind in kinds}
    width = {kind: {key: np.zeros(len(v)) for key, v in targets.items()} for kind in kinds}
    g = torch.Generator().manual_seed(99)
    t0 = time.perf_counter()
    for i in range(reps):
        H, A = world.draw(n, g)
        for kind, G in kinds.items():
            rep = superposition_readout(H, A, world.U, k=K, seed=i, decode=False, jackknife_groups=G, n_boot=500)
            for key, cis in intervals(rep).items():
                for j, (lo, hi) in enumerate(cis):
                    hits[kind][key][j] += lo <= targets[key][j] <= hi
                    width[kind][key][j] += hi - lo
    print(f"{reps} repetitions, {time.perf_counter() - t0:.0f} s; coverage of the 95% intervals (Monte Carlo "
          f"s.e. {math.sqrt(0.95 * 0.05 / reps):.3f}), mean width in brackets:")
    print(f"{'interval':34s} {'wilson (min/mean)':>22s} {'R^2':>14s} {'pooled':>14s} {'R^2 gain':>14s} "
          f"{'readout gain (min/mean)':>26s}")
    for kind in kinds:
        c = {key: v / reps for key, v in hits[kind].items()}
        w = {key: v.mean() / reps for key, v in width[kind].items()}
        print(f"{kind:34s} {c['wilson'].min():>8.3f}/{c['wilson'].mean():.3f} [{w['wilson']:.3f}] "
              f"{c['r2'][0]:>6.3f} [{w['r2']:.3f}] {c['pooled'][0]:>6.3f} [{w['pooled']:.3f}] "
              f"{c['r2 gain'][0]:>6.3f} [{w['r2 gain']:.3f}] "
              f"{c['readout gain'].min():>10.3f}/{c['readout gain'].mean():.3f} [{w['readout gain']:.3f}]")


def timing(groups: int) -> None:
    """Wall time of one superposition_readout on SmolLM2's table shape (193 subjects, d = 576, 6 relations with
    6-193 attributes, the random_init control): the old intervals against the jackknife with refits."""
    g = torch.Generator().manual_seed(0)
    n, d, counts = 193, 576, (6, 22, 73, 141, 191, 193)
    A = torch.stack([torch.randint(c, (n,), generator=g) for c in counts], 1)
    U = [torch.randn(c, d, generator=g) for c in counts]
    H = torch.randn(n, d, generator=g)
    for label, G, n_random in (("old (3 conditions, bootstrap/Wilson)", 0, 0),
                               ("+ random_attributes (4 conditions)", 0, 1),
                               (f"+ jackknife with refits (G = {groups})", groups, 1)):
        wall, cpu = [], []
        for _ in range(3):
            start, start_cpu = time.perf_counter(), time.process_time()
            superposition_readout(H, A, U, nulls={"random_init": (H.flip(0), U)}, decode=False,
                                  jackknife_groups=G, n_random=n_random)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(f"{label:40s} {min(wall):6.2f} s wall, {min(cpu):6.2f} s CPU (best of 3; "
              f"{torch.get_num_threads()} threads)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=193, help="subjects per sample (SmolLM2's table: 193)")
    parser.add_argument("--reps", type=int, default=300, help="samples (repetitions)")
    parser.add_argument("--d", type=int, default=64, help="state and attribute-vector width")
    parser.add_argument("--scale", type=float, default=0.35, help="signal scale (0.35: held-out R^2 ~ 0.2)")
    parser.add_argument("--groups", default=str(JACKKNIFE_GROUPS),
                        help="jackknife groups (refits per condition), comma-separated to compare several")
    parser.add_argument("--truth-fits", type=int, default=100, help="Monte Carlo fits for the truth")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing", action="store_true", help="only time the intervals on SmolLM2's shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",")]
    if args.timing:
        timing(groups[0])
    else:
        coverage(args.n, args.reps, args.d, args.scale, groups, args.truth_fits)


if __name__ == "__main__":
    main()
