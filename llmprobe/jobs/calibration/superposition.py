"""The superposition line (held-out R^2 of h_s ~ c + sum_r W_r u_a(s)), graded against the nulls it had before the
lexical null (shuffled, random_attributes) and with it (shuffled, random_attributes, lexical). The planted worlds
have no model, so no random_init null: that null is the same in both sets. Its minimal effect
(``MIN_EFFECT[SUPERPOSITION]``) comes from the worlds where it fails (:func:`null_gains`, :func:`minimal_effect`):
the smallest gain over random_attributes that none of them exceeds in 95% of its replicates.

Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.geometry import superposition_readout
from llmprobe.geometry.planted import lexical_world, planted_superposition, shuffled_superposition
from llmprobe.jobs.calibration.common import graded_fractions
from llmprobe.report.claims import ALPHA, MIN_EFFECT, SUPERPOSITION, difference, p_above

BEFORE = ("shuffled", "random_attributes")            # the superposition line's nulls before the lexical null
WITH_LEXICAL = ("shuffled", "random_attributes", "lexical")


@dataclass(frozen=True)
class World:
    """A planted world: ``states(A, U, E, d, seed)`` -> H [n, d]; ``holds``: whether the claim holds in it."""

    name: str
    states: Callable
    holds: bool


def superposition_worlds(snr: float) -> list[World]:
    """The superposition line's worlds at signal-to-noise ``snr``: an exact planted superposition of the named u
    vectors (alone, and on top of the subjects' own token embeddings), a superposition of a shuffled table, and
    the lexical world (the subjects' static token embeddings, nothing else)."""
    def mixed(A, U, E, d, seed):
        H = planted_superposition(A, U, d, snr, seed)
        return H + E.double() * (float(H.var(0).sum()) / float(E.double().var(0).sum())) ** 0.5
    return [World(f"planted superposition, snr {snr:g}", lambda A, U, E, d, seed: planted_superposition(
                A, U, d, snr, seed), True),
            World(f"planted superposition + lexical, snr {snr:g}", mixed, True),
            World(f"shuffled table, snr {snr:g}", lambda A, U, E, d, seed: shuffled_superposition(
                A, U, d, snr, seed), False),
            World("lexical only", lambda A, U, E, d, seed: lexical_world(E, 4.0, seed), False)]


def grade(r2: dict, margins: dict, nulls: tuple[str, ...], family: int) -> str:
    """The verdict rule of ``llmprobe.report.claims`` on one R^2 test: every null in ``nulls`` beaten by the
    minimal effect (supported) or by 0 (weak) at one-sided ALPHA after Bonferroni over ``family`` tests (Holm's
    strictest step: the calibration is conservative for tests Holm ranks later)."""
    diffs = [difference(r2, r2["nulls"][name], margins.get(name)) for name in nulls]
    p = min(1.0, family * max(p_above(d, MIN_EFFECT[SUPERPOSITION]) for d in diffs))
    p_zero = min(1.0, family * max(p_above(d, 0.0) for d in diffs))
    return "supported" if p < ALPHA else "weak" if p_zero < ALPHA else "not shown"


def measure_world(world: World, A: torch.Tensor, U: list, E: torch.Tensor, seed: int, folds: int = 5,
                  jackknife_groups: int = 20) -> tuple[dict, dict]:
    """(R^2 metric with its nulls, margins by null) of the superposition readout on one draw of ``world``, with
    the lexical null's states ``E`` as the analysis measures them (the R^2 alone: no readout)."""
    H = world.states(A, U, E, U[0].shape[1], seed)
    rep = superposition_readout(H, A, U, nulls={"lexical": E}, k=folds, seed=seed, decode=False,
                                jackknife_groups=jackknife_groups, readouts=False)
    r2 = rep.measure("r2", primary="random_attributes").to_dict()
    return r2, {name: m["r2"].to_dict() for name, m in rep.margins.items()}


def calibrate(worlds: list[World], A: torch.Tensor, U: list, E: torch.Tensor, replicates: int, family: int,
              folds: int = 5, jackknife_groups: int = 20, on_row=None) -> list[dict]:
    """One row per world: n, replicates, the means of R^2 and of its gains over random_attributes and lexical,
    and per null set (``BEFORE``, ``WITH_LEXICAL``) the fraction of replicates graded supported and supported or
    weak: power where the claim holds, false-positive rate (supported or weak) where it fails."""
    rows = []
    for world in worlds:
        grades = {"before": [], "with_lexical": []}
        r2s, gains, lexical = [], [], []
        for seed in range(replicates):
            r2, margins = measure_world(world, A, U, E, seed, folds, jackknife_groups)
            r2s.append(r2["value"])
            gains.append(margins["random_attributes"]["value"])
            lexical.append(margins["lexical"]["value"])
            grades["before"].append(grade(r2, margins, BEFORE, family))
            grades["with_lexical"].append(grade(r2, margins, WITH_LEXICAL, family))
        row = {"world": world.name, "claim_holds": world.holds, "n": int(A.shape[0]), "relations": int(A.shape[1]),
               "replicates": replicates, "family": family, "r2": sum(r2s) / replicates,
               "gain_random_attributes": sum(gains) / replicates, "gain_lexical": sum(lexical) / replicates}
        row.update(graded_fractions(grades, replicates))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def null_gains(worlds: list[World], A: torch.Tensor, U: list, E: torch.Tensor, replicates: int, folds: int = 5,
               jackknife_groups: int = 20) -> dict[str, list[float]]:
    """The superposition line's effect, its R^2 gain over random_attributes, in each replicate of each world where
    the claim fails (``holds`` False): {world: [gain per replicate]}."""
    return {world.name: [measure_world(world, A, U, E, seed, folds, jackknife_groups)[1]["random_attributes"]["value"]
                         for seed in range(replicates)]
            for world in worlds if not world.holds}


def minimal_effect(gains: dict[str, list[float]], level: float = 0.95) -> float:
    """The smallest gain that no negative world exceeds in ``level`` of its replicates: the largest over the
    worlds of each world's ``level`` quantile (the order statistic at ceil(level x replicates), conservative for
    few replicates), never below 0. The superposition line's ``MIN_EFFECT`` (docs/measures.md, Calibration)."""
    if not gains or not all(gains.values()):
        raise ValueError("minimal_effect needs at least one replicate of at least one negative world")
    quantiles = []
    for values in gains.values():
        ordered = sorted(values)
        quantiles.append(ordered[min(len(ordered), math.ceil(level * len(ordered))) - 1])
    return max(0.0, max(quantiles))


def format_rows(rows: list[dict]) -> str:
    """The calibration table as text: power where the claim holds, false-positive rate where it fails."""
    out = [f"{'world':46s} {'holds':5s} {'n':>4s} {'reps':>4s} {'R^2':>6s} {'gain rnd':>8s} {'gain lex':>8s}  "
           f"{'before: supp / supp+weak':>24s}  {'with lexical: supp / supp+weak':>31s}"]
    for r in rows:
        out.append(f"{r['world']:46s} {'yes' if r['claim_holds'] else 'no':5s} {r['n']:4d} {r['replicates']:4d} "
                   f"{r['r2']:6.3f} {r['gain_random_attributes']:8.3f} {r['gain_lexical']:8.3f}  "
                   f"{r['before_supported']:11.2f} / {r['before_supported_or_weak']:10.2f}  "
                   f"{r['with_lexical_supported']:15.2f} / {r['with_lexical_supported_or_weak']:13.2f}")
    return "\n".join(out)
