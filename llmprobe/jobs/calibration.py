"""Calibration of a claim's measure on planted answers (layer 5: it uses the synthetic models and the analyses): the measure and the verdict rule of
``llmprobe.report.claims`` run on worlds where the claim holds by construction and on worlds where it fails
(``llmprobe.geometry.planted``), at the shapes of a real run, over replicates: **power** (the fraction of
planted positives graded supported) and **false-positive rate** (the fraction of negatives graded supported or
weak). ``benchmarks/calibration.py`` prints the table at the real run's n (docs/measures.md, Calibration);
``tests/test_calibration.py`` runs a quick version that fails when the measure stops separating its worlds.

The superposition line (held-out R^2 of h_s ~ c + sum_r W_r u_a(s)), graded against the nulls it had before the
lexical null (shuffled, random_attributes) and with it (shuffled, random_attributes, lexical). The planted worlds
have no model, so no random_init null: that null is the same in both sets.

The selector line (:func:`calibrate_selector`): one-layer models where the MLP is a relation-conditioned selector
by construction or by training (the paper's construction; a trained geometric model) and where it is a key-value
memory (frozen_all; a memory whose MLP reads only the subject), each measured by the pretrained run's own gate
transplant code at the run's number of test facts and graded by the report's rule
(``llmprobe.report.claims.selector_test``): the calibrated keep test, the break test it replaces, and the
redirection test (a candidate that was not adopted).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.selector import PromptSet, redirect_metrics, redirect_transplant, transplant_metrics
from llmprobe.analyses.selector import gate_transplant as run_transplant
from llmprobe.geometry import superposition_readout
from llmprobe.geometry.planted import lexical_world, planted_superposition, shuffled_superposition
from llmprobe.report.claims import (
    ALPHA,
    CAPACITY_SWEEP,
    MIN_EFFECT,
    SCALING_FEATURES,
    SELECTOR_BREAK,
    SUPERPOSITION,
    _informative,
    _line_fit,
    capacity_scaling,
    claim_test,
    difference,
    p_above,
    selector_test,
    swap_test,
    width_test,
)
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.mechanisms import redirection_items, transplant_items
from synthetic.model import FactRecallModel
from synthetic.swap import freeze_and_swap, new_table, train_subjects, with_subjects
from synthetic.tasks import FactTask, random_bijections, random_functions
from synthetic.train import TrainConfig, train

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
        row.update(graded_fractions(grades, replicates))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def graded_fractions(grades: dict[str, list[str]], replicates: int) -> dict[str, float]:
    """Per test (``grades``: test -> its grade in each replicate): the fraction graded supported and the fraction
    supported or weak (power where the claim holds, false-positive rate where it fails)."""
    out = {}
    for key, graded in grades.items():
        out[f"{key}_supported"] = sum(g == "supported" for g in graded) / replicates
        out[f"{key}_supported_or_weak"] = sum(g != "not shown" for g in graded) / replicates
    return out


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


# ------------------------------------------------------------------------------------------------ the selector
@dataclass(frozen=True)
class SelectorWorld:
    """A planted world of the selector line: ``build(seed)`` -> (a one-layer model, its fact task); ``holds``:
    whether the MLP is a relation-conditioned selector in it (None: neither by construction)."""

    name: str
    build: Callable
    holds: bool | None


def selector_worlds(n_subjects: int = 64, n_relations: int = 4, d_model: int = 16, steps: int = 1000
                    ) -> list[SelectorWorld]:
    """The selector line's worlds, each a one-layer model on a fresh random table per seed:

    * the paper's construction (``synthetic.construction.build_construction``, smallest block size that answers
      every fact): a selector by construction;
    * a trained geometric model (trainable subject embeddings; Adam lr 0.03, weight decay 1e-4, ``steps`` steps:
      ``synth analyze``'s recipe), and the same stopped at its first 100% step without weight decay (the matched
      controls' regime, where the superposition is not yet clean);
    * the key-value memory: subject embeddings *and* unembedding frozen at random (frozen_all, same recipe), so
      the MLP must store the facts; and a planted memory whose MLP reads only the subject
      (``build_subject_memory``: no gate depends on the relation);
    * ``frozen`` (subject embeddings frozen, unembedding learned) as a row of its own: neither by construction
      (the unembedding aligns with the random embeddings, docs/mechanisms.md);
    * last, the key-value memory at twice the width: room enough that its gates turn relation-driven (the keep
      test's known false positive, docs/measures.md, "The selector line")."""
    N, R = n_subjects, n_relations

    def construction(seed):
        task = random_bijections(N, R, seed)
        for b in range(1, 33):
            model = build_construction(task, b, seed=seed)
            if construction_accuracy(model, task) == 1.0:
                return model, task
        raise RuntimeError("no construction answers every fact")

    def trained(kw: dict, at_fit: bool = False, width: int = d_model):
        def build(seed):
            task = random_bijections(N, R, seed)
            cfg = (TrainConfig(progress=False) if at_fit else
                   TrainConfig(lr=0.03, max_steps=steps, weight_decay=1e-4, past_fit=10 ** 9, progress=False))
            return train(task, width, config=cfg, seed=seed, **kw).model, task
        return build

    def memory(seed):
        task = random_functions(N, R, max(2, N // 8), seed=seed)
        return build_subject_memory(task, seed), task

    frozen_all = {"frozen_subjects": True, "frozen_unembed": True}
    return [SelectorWorld("construction (paper's selector)", construction, True),
            SelectorWorld(f"trainable, d={d_model}, wd, {steps} steps", trained({}), True),
            SelectorWorld(f"trainable, d={d_model}, stopped at fit", trained({}, at_fit=True), True),
            SelectorWorld(f"key-value: frozen_all, d={d_model}, wd", trained(frozen_all), False),
            SelectorWorld("key-value: MLP reads the subject only", memory, False),
            SelectorWorld(f"frozen subjects, d={d_model}, wd", trained({"frozen_subjects": True}), None),
            SelectorWorld(f"key-value: frozen_all, d={2 * d_model}, wd", trained(frozen_all, width=2 * d_model), False)]


def grade_test(test: dict | None, family: int) -> str:
    """The verdict rule on one test of ``llmprobe.report.claims`` (``claim_test``'s p and p_zero), Bonferroni over
    ``family`` tests (Holm's strictest step, as :func:`grade`): supported / weak / not shown."""
    if test is None or test["missing_nulls"] or test["p"] is None:
        return "not shown"
    return ("supported" if min(1.0, family * test["p"]) < ALPHA else
            "weak" if min(1.0, family * test["p_zero"]) < ALPHA else "not shown")


def measure_selector_world(world: SelectorWorld, seed: int, n_items: int, n_boot: int = 1000) -> dict:
    """One draw of ``world``: its model measured by the pretrained run's gate transplant
    (:func:`transplant_test`: the run's code, ``n_items`` test facts the model answers) and by
    the redirection test (:func:`redirection`, as many items), each graded test with it:
    {"transplant", "redirection", "keep_test" (the calibrated line), "break_test" (the line before it),
    "redirect_test"}."""

    model, task = world.build(seed)
    metrics = transplant_test(model, task, n_items, seed=seed, n_boot=n_boot)
    redirect = redirection(model, task, n_items, seed=seed, n_boot=n_boot)
    old = {k: v for k, v in metrics.items() if k != "selector_keep"}
    redirect_test = None
    if redirect.get("redirect"):
        redirect_test = claim_test(SELECTOR_BREAK, "all relations", None, redirect["redirect"],
                              {"random_units": redirect["redirect"]["nulls"]["random_units"]},
                              {"random_units": _informative(redirect["redirect_minus_random"])})
    return {"transplant": metrics, "redirection": redirect, "keep_test": selector_test(metrics),
            "break_test": selector_test(old), "redirect_test": redirect_test}


def calibrate_selector(worlds: list[SelectorWorld], n_items: int, replicates: int, family: int,
                       n_boot: int = 1000, on_row=None) -> list[dict]:
    """One row per world: n, replicates, the mean keep rates (same relation, other relation, the random switch-offs
    by count and by count and norm), the mean redirection and its random null, and per test (``keep``: the
    calibrated line; ``break``: the line before it; ``redirect``) the fraction of replicates graded supported and
    supported or weak: power where the claim holds, false-positive rate (supported or weak) where it fails."""
    rows = []
    for world in worlds:
        grades = {"keep": [], "break": [], "redirect": []}
        sums: dict[str, float] = {}
        n_seen = []
        for seed in range(replicates):
            got = measure_selector_world(world, seed, n_items, n_boot)
            m, rd = got["transplant"], got["redirection"]
            n_seen.append(m["n_items"])
            values = {key: m[key]["value"] for key in ("same_relation", "other_relation", "random_units",
                                                      "random_units_matched")}
            if rd.get("redirect"):
                values.update(redirect=rd["redirect"]["value"],
                              redirect_random=rd["redirect"]["nulls"]["random_units"]["value"])
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + value / replicates
            for key in grades:
                grades[key].append(grade_test(got[f"{key}_test"], family))
        row = {"world": world.name, "claim_holds": world.holds, "n": min(n_seen), "replicates": replicates,
               "family": family, **{k: round(v, 4) for k, v in sums.items()}}
        row.update(graded_fractions(grades, replicates))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_selector_rows(rows: list[dict]) -> str:
    """The selector calibration table as text: keep rates, then per test supported / supported or weak (power
    where the claim holds, false-positive rate where it fails)."""
    holds = {True: "yes", False: "no", None: "-"}
    out = [f"{'world':40s} {'holds':5s} {'n':>3s} {'reps':>4s} {'same':>5s} {'other':>5s} {'rnd':>5s} {'rnd n':>5s} "
           f"{'redir':>5s} {'r rnd':>5s}  {'keep: supp / +weak':>18s}  {'break: supp / +weak':>19s}  "
           f"{'redirect: supp / +weak':>22s}"]
    for r in rows:
        out.append(f"{r['world']:40s} {holds[r['claim_holds']]:5s} {r['n']:3d} {r['replicates']:4d} "
                   f"{r['same_relation']:5.2f} {r['other_relation']:5.2f} {r['random_units']:5.2f} "
                   f"{r['random_units_matched']:5.2f} {r.get('redirect', float('nan')):5.2f} "
                   f"{r.get('redirect_random', float('nan')):5.2f}  "
                   f"{r['keep_supported']:8.2f} / {r['keep_supported_or_weak']:5.2f}  "
                   f"{r['break_supported']:9.2f} / {r['break_supported_or_weak']:5.2f}  "
                   f"{r['redirect_supported']:12.2f} / {r['redirect_supported_or_weak']:5.2f}")
    return "\n".join(out)


# ------------------------------------------------ the pretrained run's selector tests on the one-layer model
def transplant_test(model: FactRecallModel, task: FactTask, n_items: int | None = None, seed: int = 0,
                    n_boot: int = 1000) -> dict:
    """The pretrained run's gate transplant on the one-layer model, by its own code
    (:func:`llmprobe.analyses.selector.gate_transplant` at block [0], :func:`~llmprobe.analyses.selector.
    transplant_metrics`) on :func:`transplant_items`: the keep rates under another subject's gates of the same
    relation and under the subject's own gates of another relation, the random switch-offs (count; count and
    norm), and the selector line's test ``selector_keep`` with its paired margins. JSON-ready, with ``n_items``."""
    items = transplant_items(task, n_items, seed, model)
    if items["s"].numel() == 0:
        return {"n_items": 0, "error": "no fact with a donor"}
    N = task.n_subjects
    rows = lambda subj, rel: PromptSet.of_ids(torch.stack([subj, N + rel], 1))  # noqa: E731
    hits = run_transplant(model, rows(items["s"], items["r"]), rows(items["s_same"], items["r"]),
                          rows(items["s"], items["r_other"]), items["answer"], [0],
                          torch.Generator().manual_seed(seed + 53), batch_size=max(1, items["s"].numel()),
                          matched_gen=torch.Generator().manual_seed(seed + 59))
    return {"n_items": int(items["s"].numel()), **transplant_metrics(hits, n_boot=n_boot, seed=seed)}


def redirection(model: FactRecallModel, task: FactTask, n_items: int | None = None, seed: int = 0,
                n_boot: int = 1000, shuffled: bool = False) -> dict:
    """The selector's redirection test on the one-layer model, by the code that measures pretrained models
    (:func:`llmprobe.analyses.selector.redirect_transplant`, block [0]): each item (s, r) of
    :func:`redirection_items` runs with the ReLU on/off mask of (s'', r') -- another subject, another relation --
    and its own pre-activations. A relation-conditioned selector answers a_{r'}(s) (the gates pick the relation,
    the values carry the subject); a key-value memory keyed on (s, r) does not. Null: a random switch-off matched
    in count and norm (``random_units``). Returns :func:`llmprobe.analyses.selector.redirect_metrics` with
    ``n_items``."""
    items = redirection_items(task, n_items, seed, shuffled)
    if items["s"].numel() == 0:
        return {"n_items": 0, "redirect": None, "redirect_minus_random": None, "redirect_keeps_old": None}
    N = task.n_subjects
    rows = lambda subj, rel: PromptSet.of_ids(torch.stack([subj, N + rel], 1))  # noqa: E731
    preds = redirect_transplant(model, rows(items["s"], items["r"]), rows(items["s_cross"], items["r_new"]), [0],
                                torch.Generator().manual_seed(seed + 43), batch_size=max(1, items["s"].numel()))
    return {"n_items": int(items["s"].numel()),
            **redirect_metrics(preds, items["new"], items["old"], n_boot=n_boot, seed=seed)}


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
    a, b, _ = _line_fit([SCALING_FEATURES["R log2 N"](n, r) for n, r, _ in points], ys)
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
    whose trainable and frozen halves :func:`llmprobe.report.claims.capacity_scaling` grades supported, and not
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
# ------------------------------------------------------------------------------------------------ freeze-and-swap
@dataclass(frozen=True)
class SwapWorld:
    """A world of the freeze-and-swap line: ``build(seed)`` -> (a one-layer model, its fact task); ``holds``:
    whether the model reads a table from the geometry of its subject embeddings (None: neither by construction)."""

    name: str
    build: Callable
    holds: bool | None


def swap_zero_shot(model: FactRecallModel, task: FactTask, seed: int) -> dict:
    """Zero-shot accuracy (strict argmax, no training step) on a new table (``synthetic.swap.new_table(task,
    seed)``: each relation's column permuted across subjects) of ``model`` frozen, with new subject embeddings:
    ``swap`` (e'_s = c + sum_r W_r u_{a'_r(s)}, the superposition fit of its trained embeddings), and the nulls
    ``random_init`` (embeddings drawn as at initialisation), ``random_matched`` (random directions with the swap
    embeddings' norms) and ``old_embeddings`` (its own trained embeddings, which encode the old table). JSON-ready
    {condition: accuracy}."""
    out = freeze_and_swap(model, task, seed=seed, steps=(0,), conditions=("swap", "random_init", "random_matched"))
    old = train_subjects(with_subjects(model, model.subject_embeddings()), new_table(task, seed), steps=(0,))
    return {**out["zero_shot"], "old_embeddings": round(old["accuracy"][0], 4)}


def swap_worlds(n_subjects: int = 256, n_relations: int = 4, d_model: int = 28, steps: int = 1000
                ) -> list[SwapWorld]:
    """The freeze-and-swap line's worlds, each on a fresh random table per seed:

    * the paper's construction (smallest block size that answers every fact; bijections): the table is its
      subject embeddings' geometry by construction;
    * a trained geometric model (trainable subject embeddings; Adam lr 0.03, weight decay 1e-4, ``steps`` steps,
      bijections: the swap sweep's recipe, ``synthetic.swap.run_point``);
    * the key-value memory whose MLP reads only the subject (``build_subject_memory``: one unit per subject,
      one-hot keys; each relation its own attribute set), and frozen_all (subject embeddings and unembedding
      frozen at random, same recipe): the facts live in the MLP, not in the embeddings' geometry."""
    N, R = n_subjects, n_relations

    def construction(seed):
        task = random_bijections(N, R, seed)
        for b in range(1, 33):
            model = build_construction(task, b, seed=seed).float()
            if construction_accuracy(model, task) == 1.0:
                return model, task
        raise RuntimeError("no construction answers every fact")

    def trained(kw: dict):
        def build(seed):
            task = random_bijections(N, R, seed)
            cfg = TrainConfig(lr=0.03, max_steps=steps, weight_decay=1e-4, target_acc=1.01, progress=False)
            return train(task, d_model, config=cfg, seed=seed, **kw).model.eval(), task
        return build

    def memory(seed):
        task = random_functions(N, R, max(2, N // 8), seed=seed)
        return build_subject_memory(task, seed), task

    return [SwapWorld("construction (paper's)", construction, True),
            SwapWorld(f"trainable, d={d_model}, wd, {steps} steps", trained({}), True),
            SwapWorld("key-value: MLP reads the subject only", memory, False),
            SwapWorld(f"key-value: frozen_all, d={d_model}, wd", trained({"frozen_subjects": True,
                                                                          "frozen_unembed": True}), False)]


def calibrate_swap(worlds: list[SwapWorld], seeds: tuple[int, ...], offset: int = 1000, on_row=None) -> list[dict]:
    """One row per world: its seeds' zero-shot accuracies (:func:`swap_zero_shot`, new table seed = seed +
    ``offset``, as the swap sweep draws it) and the line's test on them (``llmprobe.report.claims.swap_test``:
    grade, difference against the hardest null, power)."""
    rows = []
    for world in worlds:
        per_seed = []
        for seed in seeds:
            model, task = world.build(seed)
            per_seed.append({"seed": seed, **swap_zero_shot(model, task, seed + offset)})
        test = swap_test(per_seed)
        row = {"world": world.name, "claim_holds": world.holds, "seeds": per_seed, "grade": test["grade"],
               "swap": test["metric"]["value"], "null_name": test["null_name"],
               "difference": test["difference"], "power": test["power"]}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_swap_rows(rows: list[dict]) -> str:
    """The freeze-and-swap calibration table as text: mean zero-shot accuracy per condition over seeds, the
    difference against the hardest null with its interval, the grade."""
    names = ("swap", "random_init", "random_matched", "old_embeddings")
    out = [f"{'world':40s} {'holds':5s} {'seeds':>5s} " + " ".join(f"{n:>14s}" for n in names)
           + f"  {'difference [95% t]':>24s}  grade"]
    holds = {True: "yes", False: "no", None: "-"}
    for r in rows:
        means = [sum(s[n] for s in r["seeds"]) / len(r["seeds"]) for n in names]
        diff = r["difference"]
        ci = diff["ci"] if diff else None
        shown = f"{diff['value']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if diff else "-"
        out.append(f"{r['world']:40s} {holds[r['claim_holds']]:5s} {len(r['seeds']):5d} "
                   + " ".join(f"{m:14.3f}" for m in means) + f"  {shown:>24s}  {r['grade']}")
    return "\n".join(out)


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
