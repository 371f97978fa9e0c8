"""Calibration of a claim's measure on planted answers (layer 4): the measure and the verdict rule of
``llmprobe.report.claims`` run on worlds where the claim holds by construction and on worlds where it fails
(``llmprobe.geometry.planted``), at the shapes of a real run, over replicates: **power** (the fraction of
planted positives graded supported) and **false-positive rate** (the fraction of negatives graded supported or
weak). ``benchmarks/calibration.py`` prints the table at the real run's n (docs/measures.md, Calibration);
``tests/test_calibration.py`` runs a quick version that fails when the measure stops separating its worlds.

So far: the superposition line (held-out R^2 of h_s ~ c + sum_r W_r u_a(s)), graded against the nulls it had
before the lexical null (shuffled, random_attributes) and with it (shuffled, random_attributes, lexical). The
planted worlds have no model, so no random_init null: that null is the same in both sets.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.geometry import superposition_readout
from llmprobe.geometry.planted import lexical_world, planted_superposition, shuffled_superposition
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
    the lexical null's states ``E`` as the analysis measures them."""
    H = world.states(A, U, E, U[0].shape[1], seed)
    rep = superposition_readout(H, A, U, nulls={"lexical": E}, k=folds, seed=seed, decode=False,
                                jackknife_groups=jackknife_groups)
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
        for key, graded in grades.items():
            row[f"{key}_supported"] = sum(g == "supported" for g in graded) / replicates
            row[f"{key}_supported_or_weak"] = sum(g != "not shown" for g in graded) / replicates
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


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
