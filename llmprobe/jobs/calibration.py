"""Calibration of a claim's measure on planted answers (layer 5: it uses the synthetic models and the analyses): the measure and the verdict rule of
``llmprobe.report.claims`` run on worlds where the claim holds by construction and on worlds where it fails
(``llmprobe.geometry.planted``), at the shapes of a real run, over replicates: **power** (the fraction of
planted positives graded supported) and **false-positive rate** (the fraction of negatives graded supported or
weak). ``benchmarks/calibration.py`` prints the table at the real run's n (docs/measures.md, Calibration);
``tests/test_calibration.py`` runs a quick version that fails when the measure stops separating its worlds.

The superposition line (held-out R^2 of h_s ~ c + sum_r W_r u_a(s)), graded against the nulls it had before the
lexical null (shuffled, random_attributes) and with it (shuffled, random_attributes, lexical). The planted worlds
have no model, so no random_init null: that null is the same in both sets. Its minimal effect
(``MIN_EFFECT[SUPERPOSITION]``) comes from the worlds where it fails (:func:`null_gains`, :func:`minimal_effect`):
the smallest gain over random_attributes that none of them exceeds in 95% of its replicates.

The selector line (:func:`calibrate_selector`): one-layer models where the MLP is a relation-conditioned selector
by construction or by training (the paper's construction; a trained geometric model) and where it is a key-value
memory (frozen_all; a memory whose MLP reads only the subject), each measured by the pretrained run's own gate
transplant code at the run's number of test facts and graded by the report's rule
(``llmprobe.report.claims.selector_test``): the calibrated keep test, the break test it replaces, and the
redirection test (a candidate that was not adopted).

The chain-of-thought line (:func:`calibrate_cot`): the SmolLM2 run's two-hop chains (``SMOLLM2_CHAINS``) given
planted hits (paired rates, bridges wrong, a prompt that names only the answer's type, a model that composes in
the longer prompt and ignores its bridge) or the hits of one-layer two-hop models too narrow or wide enough to
compose in one pass, built into the multi-hop entry by the analysis' own code and graded by the report's line
(``llmprobe.report.claims._multihop_tests``), with and without its wrong-bridge control.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.decoders import EDITS, SVD, causality_metric, lre_causality
from llmprobe.analyses.multihop import _accuracy as multihop_accuracy
from llmprobe.analyses.multihop import bridge_partners
from llmprobe.analyses.results import CrosspatchLayer, metric_nulls
from llmprobe.analyses.selector import (
    LRE_PAIR_ITEMS,
    PATCHES,
    PromptSet,
    _patch_metrics,
    redirect_metrics,
    redirect_transplant,
    transplant_metrics,
)
from llmprobe.analyses.selector import gate_transplant as run_transplant
from llmprobe.analyses.settings import AnalysisSettings, settings_from
from llmprobe.analyses.splits import generator, relation_split
from llmprobe.analyses.superposition import attribute_vectors, lexical_states, superposition_table
from llmprobe.datasets import load_relations
from llmprobe.geometry import merge_equal_attributes, random_direction_like, superposition_readout
from llmprobe.geometry.planted import lexical_world, planted_superposition, shuffled_superposition
from llmprobe.io import write_json
from llmprobe.metric import proportion
from llmprobe.model.loading import load_model
from llmprobe.report.claims import (
    ALPHA,
    CAPACITY_SWEEP,
    CAUSAL,
    DECODABLE,
    GRADES,
    MIN_EFFECT,
    MULTIHOP,
    NOT_TESTABLE,
    NULLS,
    POWER,
    READOUT_MAX_ANSWERS_PER_SUBJECT,
    SCALING_FEATURES,
    SELECTOR_BREAK,
    SERVES,
    SUPERPOSITION,
    _causality_tests,
    _crosspatch_tests,
    _informative,
    _multihop_tests,
    capacity_scaling,
    claim_test,
    composition_majority,
    crosspatch_targets,
    difference,
    line_fit,
    p_above,
    pooled_crosspatch_test,
    power,
    selector_test,
    swap_test,
    width_test,
)
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.mechanisms import redirection_items, transplant_items
from synthetic.model import FactRecallModel
from synthetic.swap import freeze_and_swap, new_table, train_subjects, with_subjects
from synthetic.tasks import FactTask, random_bijections, random_functions, random_khop
from synthetic.train import TrainConfig, train

BEFORE = ("shuffled", "random_attributes")            # the superposition line's nulls before the lexical null
WITH_LEXICAL = ("shuffled", "random_attributes", "lexical")
CAUSAL_BEFORE = ("random_direction", "random_operator")  # the causal line's nulls before scaled_patch


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


def graded_fractions(grades: dict[str, list[str]], replicates: int) -> dict[str, float]:
    """Per test (``grades``: test -> its grade in each replicate): the fraction graded supported, the fraction
    supported or weak (power where the claim holds, false-positive rate where it fails) and the fraction
    "inconclusive (low power)"."""
    out = {}
    for key, graded in grades.items():
        out[f"{key}_supported"] = sum(g == "supported" for g in graded) / replicates
        out[f"{key}_supported_or_weak"] = sum(g in ("supported", "weak") for g in graded) / replicates
        out[f"{key}_low_power"] = sum(g == "inconclusive (low power)" for g in graded) / replicates
    return out

def world_row(world, sizes: dict, replicates: int, family: int, means: dict[str, float],
              grades: dict[str, list[str]]) -> dict:
    """One row of a calibration table: the world's name and whether the claim holds in it, its sample ``sizes``,
    the replicates and the Holm family graded in, each measure's mean over the replicates (``means``, rounded to
    4 places) and :func:`graded_fractions` of ``grades``."""
    return {"world": world.name, "claim_holds": world.holds, **sizes, "replicates": replicates, "family": family,
            **{k: round(v, 4) for k, v in means.items()}, **graded_fractions(grades, replicates)}


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
        row = world_row(world, {"n": min(n_seen)}, replicates, family, sums, grades)
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
    return "\n".join(out)


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


# ------------------------------------------------------------------------------------------------ decodable
# The default SmolLM2-135M-Instruct run's LRE sizes (known facts used, test subjects) of the superposition table's
# relations (strict protocol, seed 0; docs/runs.md): the n each relation's LRE faithfulness is measured at.
LRE_SIZES = {"country_capital": (49, 16), "country_continent": (90, 30), "country_currency": (25, 8),
             "country_demonym": (19, 6), "country_language": (79, 26), "country_subregion": (16, 5)}
READOUT_NULLS = ("shuffled", "lexical")   # the readout's nulls a planted world has (no model: no random_init)
LRE_NULLS = ("majority", "lexical")       # claims.NULLS[DECODABLE_LRE]
DECODABLE_FAMILY = 28     # the SmolLM2 report's Holm family with the LRE tests (10) and 4 testable readouts


@dataclass(frozen=True)
class DecodableWorld:
    """A world of the decodable line: ``kind`` "planted" (the state carries a linear code of every relation's
    attribute vectors on top of the subject's tokens), "shuffled" (the code of a shuffled table), "lexical" (the
    tokens carry the code and no block adds anything: the state after block 0 is the state) or "tokens" (the
    subjects' static token embeddings, nothing planted); ``holds``: whether the claim holds in it."""

    name: str
    kind: str
    snr: float
    holds: bool


def decodable_worlds(snr: float) -> list[DecodableWorld]:
    """The decodable line's worlds at signal-to-noise ``snr``."""
    return [DecodableWorld(f"planted linear code, snr {snr:g}", "planted", snr, True),
            DecodableWorld(f"shuffled table, snr {snr:g}", "shuffled", snr, False),
            DecodableWorld(f"lexical: the tokens carry the code, snr {snr:g}", "lexical", snr, False),
            DecodableWorld("token embeddings only", "tokens", snr, False)]


def decodable_states(world: DecodableWorld, A: torch.Tensor, U: list, E: torch.Tensor, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(H [n, d] the subject states at the decoders' layer, H0 [n, d] their tokens' component (the state after
    block 0, and the readout's lexical states), maps M_r [d, d_u]): the code is sum_r M_r u_{a_r(s)} with Gaussian
    M_r / sqrt(d_u), the tokens E scaled to the code's variance, isotropic noise at ``snr`` of the code's variance."""
    gen = torch.Generator().manual_seed(seed)
    n, d = E.shape
    maps = [torch.randn(d, U_r.shape[1], generator=gen, dtype=torch.float64) / U_r.shape[1] ** 0.5 for U_r in U]
    table = A
    if world.kind == "shuffled":
        table = A.clone()
        for r in range(A.shape[1]):
            table[:, r] = A[torch.randperm(n, generator=gen), r]
    code = sum(U_r.double()[table[:, r]] @ M.T for r, (U_r, M) in enumerate(zip(U, maps)))
    signal = float(code.var(0).sum())
    tokens = E.double() * (signal / float(E.double().var(0).sum())) ** 0.5
    noise = torch.randn(n, d, generator=gen, dtype=torch.float64) * (signal / world.snr / d) ** 0.5
    if world.kind == "tokens":
        return tokens.clone(), tokens, maps
    H = tokens + code + noise
    return H, (H if world.kind == "lexical" else tokens), maps


def lre_faithfulness(H: torch.Tensor, H0: torch.Tensor, a: torch.Tensor, U_r: torch.Tensor, M: torch.Tensor,
                     n_used: int, n_test: int, seed: int) -> dict:
    """LRE faithfulness of one relation on a planted world, the run's way at its sizes: ``n_used`` known facts
    (subjects drawn at random), the last ``n_test`` of them held out; the operator W = M^T (the reading map of
    the planted code, M^T M ~ I: what the mean Jacobian of a model that reads the code is), o_hat = W h + b with b
    fitted on the other known facts (the model's output o = u_a: it answers every fact); a hit when the object's
    vector is the nearest to o_hat among the relation's answers (cosine, both centred on the answers' mean: the
    readout's metric, standing in for the LM head). Nulls: ``majority`` (the fit facts' most common answer) and
    ``lexical`` (the same W on the tokens' component H0, b refitted). JSON metric (Wilson over the n_test
    subjects)."""
    gen = torch.Generator().manual_seed(seed)
    known = torch.randperm(len(a), generator=gen)[:n_used]
    fit, test = known[:n_used - n_test], known[n_used - n_test:]
    W, O = M.T, U_r.double()[a]
    merged, (U_r,), _ = merge_equal_attributes(a[:, None], [U_r.double()])    # one answer per first token
    a = merged[:, 0]
    centre = U_r.mean(0)                                        # the model's output O points at its answer
    answers = torch.nn.functional.normalize(U_r - centre, dim=1)

    def hits(states: torch.Tensor) -> list[float]:
        b = (O[fit] - states[fit] @ W.T).mean(0)
        o_hat = torch.nn.functional.normalize(states[test] @ W.T + b - centre, dim=1)
        return (o_hat @ answers.T).argmax(1).eq(a[test]).double().tolist()

    majority = torch.bincount(a[fit], minlength=U_r.shape[0]).argmax()
    nulls = {"majority": proportion(a[test].eq(majority).double().tolist()), "lexical": proportion(hits(H0))}
    return proportion(hits(H)).with_nulls(nulls, "majority").to_dict()


def answers_per_subject(a: torch.Tensor, U_r: torch.Tensor) -> float:
    """Distinct answers per subject of one relation (``a`` [n], equal rows of U_r merged, as the readout merges
    them): what ``claims.READOUT_MAX_ANSWERS_PER_SUBJECT`` bounds."""
    merged, _, _ = merge_equal_attributes(a[:, None], [U_r])
    return len(torch.unique(merged)) / len(a)


def grade_against(metric: dict, margins: dict, nulls: tuple[str, ...], family: int) -> str:
    """The verdict rule on one accuracy test against ``nulls`` (paired margins where given), Bonferroni over
    ``family`` tests (Holm's strictest step, as :func:`grade`): supported / weak / not shown."""
    diffs = [difference(metric, metric["nulls"][name], margins.get(name)) for name in nulls]
    p = min(1.0, family * max(p_above(d, MIN_EFFECT[DECODABLE]) for d in diffs))
    p_zero = min(1.0, family * max(p_above(d, 0.0) for d in diffs))
    return "supported" if p < ALPHA else "weak" if p_zero < ALPHA else "not shown"


def measure_decodable_world(world: DecodableWorld, A: torch.Tensor, U: list, E: torch.Tensor, names: list[str],
                            seed: int, sizes: dict | None = None, family: int = DECODABLE_FAMILY, folds: int = 5,
                            jackknife_groups: int = 20) -> dict:
    """One draw of ``world``: per relation {"readout", "lre" (values), "readout_grade" ("not testable here" above
    ``READOUT_MAX_ANSWERS_PER_SUBJECT``), "lre_grade", "grade" (the better: the line's grade of the relation)},
    and "line": the line's verdict (the grade at least half the relations reach). ``sizes``: {relation: (known
    facts, test subjects)} of the LRE (default ``LRE_SIZES``)."""
    sizes = sizes or LRE_SIZES
    H, H0, maps = decodable_states(world, A, U, E, seed)
    rep = superposition_readout(H, A, U, relation_names=names, nulls={"lexical": H0}, k=folds, seed=seed,
                                decode=False, jackknife_groups=jackknife_groups)
    out: dict = {"relations": {}}
    for r, name in enumerate(names):
        readout = rep.measure("readout_acc", name).to_dict()
        margins = {null: m["readout_acc"][name].to_dict() for null, m in rep.margins.items()}
        testable = answers_per_subject(A[:, r], U[r]) <= READOUT_MAX_ANSWERS_PER_SUBJECT
        lre = lre_faithfulness(H, H0, A[:, r], U[r], maps[r], *sizes[name], seed=seed + 1000 * r)
        grades = {"readout_grade": grade_against(readout, margins, READOUT_NULLS, family) if testable else
                  NOT_TESTABLE, "lre_grade": grade_against(lre, {}, LRE_NULLS, family)}
        best = min(grades.values(), key=GRADES.index)
        grades["lre_majority_grade"] = grade_against(lre, {}, ("majority",), family)   # without the lexical null
        out["relations"][name] = {"readout": readout["value"], "lre": lre["value"],
                                  "lre_lexical": lre["nulls"]["lexical"]["value"], **grades, "grade": best}
    ranked = sorted((v["grade"] for v in out["relations"].values()), key=GRADES.index)
    out["line"] = ranked[(len(ranked) - 1) // 2]
    return out


def calibrate_decodable(worlds: list[DecodableWorld], A: torch.Tensor, U: list, E: torch.Tensor, names: list[str],
                        replicates: int, sizes: dict | None = None, family: int = DECODABLE_FAMILY, folds: int = 5,
                        jackknife_groups: int = 20, on_row=None) -> list[dict]:
    """One row per world and relation (and one for the line): mean readout accuracy, LRE faithfulness and its
    lexical null, and per test (readout, lre, the relation's better one; the line) the fraction of replicates
    graded supported and supported or weak: power where the claim holds, false-positive rate where it fails;
    a readout the rule marks "not testable here" counts as neither."""
    rows = []
    for world in worlds:
        draws = [measure_decodable_world(world, A, U, E, names, seed, sizes, family, folds, jackknife_groups)
                 for seed in range(replicates)]
        for name in [*names, "line"]:
            got = [d["relations"][name] if name != "line" else {"grade": d["line"]} for d in draws]
            row = {"world": world.name, "claim_holds": world.holds, "relation": name, "replicates": replicates,
                   "family": family}
            for key in ("readout", "lre", "lre_lexical"):
                if name != "line":
                    row[key] = sum(g[key] for g in got) / replicates
            if name != "line":
                row["answers_per_subject"] = answers_per_subject(A[:, names.index(name)], U[names.index(name)])
                row["testable"] = got[0]["readout_grade"] != NOT_TESTABLE
            tests = {key: [g[f"{key}_grade"] for g in got] for key in ("readout", "lre", "lre_majority")
                     if name != "line"}
            tests["relation" if name != "line" else "line"] = [g["grade"] for g in got]
            row.update(graded_fractions(tests, replicates))
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


# ------------------------------------------------------------------------------------------------ LRE causality
@dataclass(frozen=True)
class PlantedRelation:
    """One planted relation with no language model: subject states H [N, d], the read o = ``read(h)`` ([m, d] ->
    [m, d], differentiable: the "last-block state") and the answer head U [K, d]: a state's answer is
    argmax U read(h), the model's own answer to its subject."""

    H: torch.Tensor
    read: Callable
    U: torch.Tensor

    def answers(self, h: torch.Tensor) -> torch.Tensor:
        """The answer ids [m] of states h [m, d]."""
        return (self.read(h) @ self.U.T).argmax(-1)


@dataclass(frozen=True)
class CausalWorld:
    """A planted world of the causal line: ``measure(n_facts, d, seed)`` -> the causality metric (JSON form, with
    its nulls and margins) of one relation with ``n_facts`` known facts; ``holds``: whether the LRE edit beats a
    step toward h_t of its norm by construction."""

    name: str
    measure: Callable
    holds: bool


def _orthonormal(d: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))[0]


def linear_relation(n_facts: int, d: int, seed: int, rank: int = 16, null_share: float = 3.0, n_objects: int = 10,
                    noise: float = 0.2) -> PlantedRelation:
    """An exactly linear relation o = A diag(sigma) B^T h of rank ``rank`` (A, B [d, rank] orthonormal, sigma in
    [0.5, 2]) read by a linear head U_j = A z_j (z_j random unit codes of ``n_objects`` answers): subject s of
    answer a(s) has B^T h_s = (z_a(s) + noise) / sigma, so its answer is a(s), plus a part in W's null space of
    ``null_share`` times the norm of its row-space part. The pseudo-inverse edit W^+ (o_t - o_s) moves o_s to
    o_t exactly; the step toward h_t of the same norm moves o by cos(theta) = 1 / sqrt(1 + null_share^2) of the
    way (0 null share: the same step as the edit)."""
    gen = torch.Generator().manual_seed(seed)
    A, B = _orthonormal(d, rank, gen), _orthonormal(d, rank, gen)
    sigma = 0.5 + 1.5 * torch.rand(rank, generator=gen, dtype=torch.float64)
    Z = torch.nn.functional.normalize(torch.randn(n_objects, rank, generator=gen, dtype=torch.float64), dim=1)
    a = torch.randint(n_objects, (n_facts,), generator=gen)
    codes = Z[a] + noise * torch.randn(n_facts, rank, generator=gen, dtype=torch.float64) / rank ** 0.5
    row = (codes / sigma) @ B.T
    null = torch.randn(n_facts, d, generator=gen, dtype=torch.float64)
    null = null - (null @ B) @ B.T
    null = null * (null_share * row.norm(dim=1, keepdim=True) / null.norm(dim=1, keepdim=True))
    return PlantedRelation(row + null, lambda h: ((h @ B) * sigma) @ A.T, Z @ A.T)


def memory_relation(n_facts: int, d: int, seed: int, n_objects: int = 10, beta: float = 8.0) -> PlantedRelation:
    """A key-value memory: o = sum_i softmax_i(beta <k_i, h>) v_i over every fact's key k_i = h_i / |h_i| (random
    unit states) and value v_i = U_a(i) (random unit answer vectors). The answer is a lookup of the nearest key,
    not linear in h: the LRE's mean Jacobian over its few prompts spans their keys, so its edit cannot reach a
    test subject's key, while a step toward h_t of its norm does whenever it is long enough."""
    gen = torch.Generator().manual_seed(seed)
    H = torch.nn.functional.normalize(torch.randn(n_facts, d, generator=gen, dtype=torch.float64), dim=1)
    U = torch.nn.functional.normalize(torch.randn(n_objects, d, generator=gen, dtype=torch.float64), dim=1)
    values = U[torch.randint(n_objects, (n_facts,), generator=gen)]
    return PlantedRelation(H, lambda h: torch.softmax(beta * h @ H.T, dim=-1) @ values, U)


def equal_rates_causality(n_facts: int, seed: int, refits: int = 3) -> dict:
    """The causality metric of a relation whose LRE edit and step toward h_t flip each test pair with the same
    probability p_i (uniform over the pairs), independently in each of ``refits`` re-fits (random_direction and
    random_operator never; the full patch always): the claim fails by construction, and the pairs' noise is as
    large as it gets. As many test pairs as the run's split makes of ``n_facts`` (a third), through
    :func:`~llmprobe.analyses.decoders.causality_metric`."""
    gen = torch.Generator().manual_seed(seed)
    n = max(2, round(n_facts / 3))
    rate = torch.rand(n, generator=gen)
    flips = lambda: [torch.rand(n, generator=gen) < rate for _ in range(refits)]  # noqa: E731
    never = [torch.zeros(n, dtype=torch.bool)] * refits
    return causality_metric({"edit": flips(), "scaled_patch": flips(), "random_direction": never,
                             "random_operator": never}, torch.ones(n, dtype=torch.bool))


def causal_worlds() -> list[CausalWorld]:
    """The causal line's worlds: an exactly linear low-rank relation whose states have a large part in W's null
    space (the step toward h_t moves o a third of the way: the claim holds, the null far below) and a moderate one
    (cos(theta) 0.55: the step flips some answers); the same relation with the states in W's row space (the
    step toward h_t *is* the edit: it fails; random_direction and random_operator pass it), a key-value memory
    (the edit does no better than the step: it fails) and equal rates (:func:`equal_rates_causality`: no model,
    the paired interval's test)."""
    def planted(build, **kw):
        return lambda n, d, seed: planted_causality(build(n, d, seed, **kw), seed)
    return [CausalWorld("linear rank 16, null share 3", planted(linear_relation), True),
            CausalWorld("linear rank 16, null share 1.5", planted(linear_relation, null_share=1.5), True),
            CausalWorld("linear rank 16, states in its row space", planted(linear_relation, null_share=0.0), False),
            CausalWorld("key-value memory", planted(memory_relation), False),
            CausalWorld("equal rates, independent flips", lambda n, d, seed: equal_rates_causality(n, seed), False)]


def planted_causality(planted: PlantedRelation, seed: int) -> dict:
    """LRE causality on one planted relation, measured by the pretrained run's code
    (``llmprobe.analyses.decoders``): the run's split of its facts (``relation_split``, default settings: 3
    re-fits, 3 Jacobian prompts each, edit ranks 8, 32, 128), W the mean Jacobian of the read at each re-fit's
    Jacobian subjects, :func:`~llmprobe.analyses.decoders.lre_causality` (edit rank on validation pairs, the edit
    and its controls on the test pairs) with the planted answers in place of a forward pass, and
    :func:`~llmprobe.analyses.decoders.causality_metric` (nulls and paired margins). Returns the metric (JSON)."""
    cfg = AnalysisSettings(seed=seed)
    H = planted.H
    O, y = planted.read(H), planted.answers(H)
    split = relation_split(y, "planted", cfg)

    def hits_of(deltas, src, tgt):
        return [planted.answers(H[src] + delta) == y[tgt] for delta in deltas]

    jacobian = torch.func.vmap(torch.func.jacrev(lambda h: planted.read(h[None])[0]))
    hits: dict[str, list[torch.Tensor]] = {name: [] for name in EDITS}
    for k, refit in enumerate(split.refits):
        svd = SVD(jacobian(H[refit.jacobian]).mean(0))
        got = lre_causality(H, O, svd, refit.val_pairs, split.test_pairs, cfg.edit_ranks,
                            generator(cfg, "planted", 0, k, "lre controls"), hits_of)
        for name in EDITS:
            hits[name].append(got["hits"][name])
    ts, tt = split.test_pairs
    return causality_metric(hits, planted.answers(H[tt]) == y[tt])


def causal_tests(metric: dict) -> dict[str, dict | None]:
    """The causal line's tests of one causality metric: ``paired`` (the line now: the report's own
    ``_causality_tests`` on a report holding this metric: scaled_patch, random_direction and random_operator,
    paired margins), ``mover`` (the same nulls from the two intervals: an older report without margins) and
    ``before`` (the line before scaled_patch: random_direction and random_operator, MOVER)."""
    report = {"analyses": {"relations": {"planted": {"selected": {"lre": {"causality_layer": 0}},
                                                     "layers": {"0": {"lre": {"causality": metric}}}}}}}
    paired = next(iter(_causality_tests(report)), None)
    mover = claim_test(CAUSAL, "planted", 0, metric)
    diffs = {name: difference(metric, metric["nulls"][name]) for name in CAUSAL_BEFORE}
    hardest = max(diffs, key=lambda name: p_above(diffs[name], MIN_EFFECT[CAUSAL]))
    before = {"missing_nulls": [], "difference": diffs[hardest], "min_effect": MIN_EFFECT[CAUSAL],
              "p": max(p_above(d, MIN_EFFECT[CAUSAL]) for d in diffs.values()),
              "p_zero": max(p_above(d, 0.0) for d in diffs.values())}
    return {"paired": paired, "mover": mover, "before": before}


def grade_with_power(test: dict | None, family: int) -> str:
    """The verdict rule on one test with Bonferroni over ``family`` tests (Holm's strictest step, as
    :func:`grade`), its power there too (``llmprobe.report.claims.power``): supported / weak / inconclusive (low
    power) / not shown."""
    if test is None or test["missing_nulls"] or test["p"] is None:
        return "not shown"
    if min(1.0, family * test["p"]) < ALPHA:
        return "supported"
    if min(1.0, family * test["p_zero"]) < ALPHA:
        return "weak"
    low = power(test["difference"], test["min_effect"], ALPHA / family) < POWER
    return "inconclusive (low power)" if low else "not shown"


def calibrate_causal(worlds: list[CausalWorld], n_facts: list[int], d: int, replicates: int, family: int,
                     on_row=None) -> list[dict]:
    """One row per world and number of known facts (the test pairs are about a third: the SmolLM2 run's
    relations had 10-90 known facts, 3-30 test pairs): the mean success rates of the edit and each control, the
    mean paired edit - scaled_patch, and per test of :func:`causal_tests` the fraction of replicates graded
    supported, supported or weak, and inconclusive (low power): power where the claim holds, false-positive
    rate (supported or weak) where it fails."""
    rows = []
    for world in worlds:
        for n in n_facts:
            grades: dict[str, list[str]] = {"paired": [], "mover": [], "before": []}
            sums: dict[str, float] = {}
            pairs = []
            for seed in range(replicates):
                metric = world.measure(n, d, seed)
                pairs.append(metric["n"])
                values = {"edit": metric["value"], **{name: m["value"] for name, m in metric["nulls"].items()},
                          "edit_minus_scaled_patch": metric["margins"]["scaled_patch"]["value"]}
                for key, value in values.items():
                    sums[key] = sums.get(key, 0.0) + value / replicates
                for key, test in causal_tests(metric).items():
                    grades[key].append(grade_with_power(test, family))
            row = world_row(world, {"n_facts": n, "n": min(pairs), "n_max": max(pairs)}, replicates, family, sums,
                            grades)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def format_decodable_rows(rows: list[dict]) -> str:
    """The decodable calibration table as text: per world and relation the readout accuracy, LRE faithfulness and
    its lexical null, then supported / supported or weak per test (the readout's "not testable here" written so),
    the relation's better test, and the LRE graded against majority alone (what the lexical null removes)."""
    out = [f"{'world':44s} {'holds':5s} {'relation':18s} {'ans/subj':>8s} {'readout':>7s} {'LRE':>5s} {'LRE lex':>7s}"
           f"  {'readout: supp / +weak':>21s}  {'LRE: supp / +weak':>17s}  {'better: supp / +weak':>20s}"
           f"  {'LRE vs majority only':>20s}"]
    for r in rows:
        if r["relation"] == "line":
            out.append(f"{r['world']:44s} {'yes' if r['claim_holds'] else 'no':5s} {'(the line)':18s} {'':>8s} "
                       f"{'':>7s} {'':>5s} {'':>7s}  {'':>21s}  {'':>17s}  {r['line_supported']:11.2f} / "
                       f"{r['line_supported_or_weak']:5.2f}")
            continue
        readout = (f"{r['readout_supported']:13.2f} / {r['readout_supported_or_weak']:5.2f}" if r["testable"] else
                   f"{'not testable':>21s}")
        out.append(f"{r['world']:44s} {'yes' if r['claim_holds'] else 'no':5s} {r['relation']:18s} "
                   f"{r['answers_per_subject']:8.2f} {r['readout']:7.3f} {r['lre']:5.2f} {r['lre_lexical']:7.2f}  "
                   f"{readout}  {r['lre_supported']:9.2f} / {r['lre_supported_or_weak']:5.2f}  "
                   f"{r['relation_supported']:12.2f} / {r['relation_supported_or_weak']:5.2f}  "
                   f"{r['lre_majority_supported']:12.2f} / {r['lre_majority_supported_or_weak']:5.2f}")
    return "\n".join(out)


def readout_testability(A: torch.Tensor, U: list, E: torch.Tensor, names: list[str], answers: list[int], snr: float,
                        replicates: int, family: int = DECODABLE_FAMILY, folds: int = 5, jackknife_groups: int = 20,
                        on_row=None) -> list[dict]:
    """Where the readout can test a relation at this n: relation 0 of the table replaced by a random map of the
    subjects onto k of its answers (every one used; vectors: k of its rows), planted with the other relations
    (:func:`planted_superposition` at ``snr``), its readout graded against shuffled and lexical (the subjects'
    token embeddings E). One row per k in ``answers``: answers per subject (k / n), the share of subjects alone
    with their answer, the mean readout accuracy and the fraction graded supported (``READOUT_MAX_ANSWERS_PER_
    SUBJECT`` is set where it falls below 0.8)."""
    n = A.shape[0]
    rows = []
    for k in answers:
        accuracy, alone, grades = [], [], []
        for seed in range(replicates):
            gen = torch.Generator().manual_seed(seed)
            column = torch.cat([torch.arange(k), torch.randint(0, k, (n - k,), generator=gen)])
            table = A.clone()
            table[:, 0] = column[torch.randperm(n, generator=gen)]
            vectors = [U[0][torch.randperm(U[0].shape[0], generator=gen)[:k]], *U[1:]]
            H = planted_superposition(table, vectors, E.shape[1], snr, seed)
            rep = superposition_readout(H, table, vectors, relation_names=names, nulls={"lexical": E}, k=folds,
                                        seed=seed, decode=False, jackknife_groups=jackknife_groups)
            readout = rep.measure("readout_acc", names[0]).to_dict()
            margins = {null: m["readout_acc"][names[0]].to_dict() for null, m in rep.margins.items()}
            accuracy.append(readout["value"])
            alone.append(float((torch.bincount(table[:, 0], minlength=k) == 1).sum()) / n)
            grades.append(grade_against(readout, margins, READOUT_NULLS, family))
        row = {"snr": snr, "answers": k, "answers_per_subject": k / n, "alone": sum(alone) / replicates,
               "readout": sum(accuracy) / replicates, "replicates": replicates,
               "supported": sum(g == "supported" for g in grades) / replicates}
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


def format_testability_rows(rows: list[dict]) -> str:
    """The readout's testability sweep as text."""
    out = [f"{'snr':>5s} {'answers':>7s} {'ans/subj':>8s} {'alone':>5s} {'readout':>7s} {'reps':>4s} {'supported':>9s}"]
    out += [f"{r['snr']:5g} {r['answers']:7d} {r['answers_per_subject']:8.2f} {r['alone']:5.2f} {r['readout']:7.3f} "
            f"{r['replicates']:4d} {r['supported']:9.2f}" for r in rows]
    return "\n".join(out)


def format_causal_rows(rows: list[dict]) -> str:
    """The causal calibration table as text: mean rates, then per test supported / supported or weak /
    inconclusive (low power)."""
    out = [f"{'world':40s} {'holds':5s} {'pairs':>5s} {'reps':>4s} {'edit':>5s} {'patch':>5s} {'rdir':>5s} "
           f"{'rop':>5s} {'full':>5s} {'e-p':>6s}  {'paired: supp / +weak / low':>26s}  "
           f"{'MOVER: supp / +weak / low':>25s}  {'before: supp / +weak / low':>26s}"]
    for r in rows:
        pairs = f"{r['n']}" if r["n"] == r["n_max"] else f"{r['n']}-{r['n_max']}"
        out.append(f"{r['world']:40s} {'yes' if r['claim_holds'] else 'no':5s} {pairs:>5s} {r['replicates']:4d} "
                   f"{r['edit']:5.2f} {r['scaled_patch']:5.2f} {r['random_direction']:5.2f} "
                   f"{r['random_operator']:5.2f} {r['full_patch']:5.2f} {r['edit_minus_scaled_patch']:6.2f}  "
                   + "  ".join(f"{r[f'{key}_supported']:{w}.2f} / {r[f'{key}_supported_or_weak']:5.2f} / "
                               f"{r[f'{key}_low_power']:4.2f}" for key, w in (("paired", 12), ("mover", 11),
                                                                              ("before", 12))))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ benchmarks
def smollm2_table() -> tuple:
    """The shapes the superposition and decodable calibrations plant into: (the embedded SmolLM2 on the CPU, the
    default analysis settings, its superposition table of the bundled relations (every fact), the u vectors of
    the table's attributes [per relation: attributes x d], the subjects' static token embeddings E [n, d])."""
    lm = load_model(device="cpu")
    cfg = settings_from()
    table = superposition_table(lm.tokenizer, load_relations(None), {}, cfg)
    U, _ = attribute_vectors(lm, table.attributes, cfg.attribute_vectors)
    return lm, cfg, table, U, lexical_states(lm, table.subjects)


def progress(started: float, label=lambda row: row["world"]):
    """A benchmark's ``on_row``: prints "  <label(row)>: done (<seconds since started> s)" as each row finishes."""
    return lambda row: print(f"  {label(row)}: done ({time.perf_counter() - started:.0f} s)", flush=True)


def finish(rows, table: str, started: float, out: str | None):
    """The end of a calibration benchmark: its table and seconds printed, its ``rows`` written to ``out`` as JSON
    (atomically) when given; returns ``rows``."""
    if table:
        print(table)
    print(f"({time.perf_counter() - started:.0f} s)")
    if out:
        write_json(out, rows)
    return rows


# ------------------------------------------------------------------------------------------------ the crosspatch
CROSSPATCH_FAMILY = 27      # the Holm family of the SmolLM2 report the line is graded in (default run, 2026-12-06)
CROSSPATCH_TESTS = ("every", "pooled", "median", "token")   # the line now, before, the house form, a candidate null


@dataclass(frozen=True)
class PatchWorld:
    """A planted world of the crosspatch line: ``hits(A, items, d, gen)`` -> the per-item hits of every patch
    (``PATCHES``, ``random_subject_follows`` and the candidate ``token``: [m] each, 1.0 = the answer became B's
    answer for s); ``holds``: whether one subject state serves every relation in it (None: literally, through a
    state that carries the subject's identity and no attribute)."""

    name: str
    hits: Callable
    holds: bool | None


def planted_patch_items(A: torch.Tensor, seed: int, per_pair: int = LRE_PAIR_ITEMS
                        ) -> list[tuple[int, int, int, int, int]]:
    """The crosspatch's items (A, B, s, s', s'') drawn from a fact table ``A`` [n, R] (attribute indices, -1 = no
    fact) by the run's rule (``llmprobe.analyses.selector.crosspatch_items``, every fact known and located): up to
    ``per_pair`` per ordered relation pair, s with a fact of B, a recipient s' and a random subject s'' of B with
    other answers than s's and each other's."""
    gen = random.Random(seed)
    R, A = A.shape[1], A.tolist()
    facts = {r: [i for i in range(len(A)) if A[i][r] >= 0] for r in range(R)}
    items = []
    for a in range(R):
        for b in range(R):
            if a == b:
                continue
            sources = [i for i in facts[b] if A[i][a] >= 0]
            gen.shuffle(sources)
            taken = 0
            for i in sources:
                recipients = [j for j in facts[b] if A[j][b] != A[i][b]]
                j = gen.choice(recipients) if recipients else None
                randoms = [k for k in facts[b] if j is not None and A[k][b] not in (A[i][b], A[j][b])]
                if randoms:
                    items.append((a, b, i, j, gen.choice(randoms)))
                    taken += 1
                if taken == per_pair:
                    break
    if not items:
        raise ValueError("no crosspatch item: every relation needs three subjects of different answers")
    return items


def _unit_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """n random unit vectors [n, d] (float64)."""
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def attribute_readout(V: list[torch.Tensor]) -> Callable:
    """answer(h [m, d], b [m], s' [m]) -> the attribute of relation b whose unit vector (``V[b]`` [attributes, d])
    has the largest inner product with h: relation B reads its attribute from the state."""
    def answer(h, b, recipients):
        out = torch.empty(len(h), dtype=torch.long)
        for r in b.unique().tolist():
            rows = b == r
            out[rows] = (h[rows] @ V[r].T).argmax(-1)
        return out
    return answer


def patch_hits(states: torch.Tensor, tokens: torch.Tensor, answer: Callable, A: torch.Tensor, items: list,
               gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The crosspatch's patches in a planted world: ``states`` [R + 1, n, d] (the subject state of each subject in
    each relation's prompt; index R: the relation-free prompt), ``tokens`` [n, d] (the part of each state its token
    embedding gives), ``answer`` as :func:`attribute_readout`. The recipient s' in B's prompt gets the state of s
    from the neutral prompt, A's prompt, B's prompt, the neutral state of s'', a random vector of the neutral
    state's norm (the run's donors), and the candidate ``token``: its own state with its token part swapped for
    s's. Hits [m] per patch, ``random_subject_follows``: the answer became B's answer for s''."""
    a, b, s, r, k = (torch.tensor(column) for column in zip(*items))
    R = A.shape[1]
    donors = {"neutral": states[R, s], "cross_relation": states[a, s], "same_relation": states[b, s],
              "random_subject": states[R, k]}
    donors["random_vector"] = random_direction_like(donors["neutral"], gen)
    donors["token"] = states[b, r] - tokens[r] + tokens[s]
    target = A[s, b]
    preds = {name: answer(h, b, r) for name, h in donors.items()}
    hits = {name: (pred == target).double() for name, pred in preds.items()}
    hits["random_subject_follows"] = (preds["random_subject"] == A[k, b]).double()
    return hits


def _planted_world(name: str, holds: bool | None, *, noise: float = 0.0, own: float = 0.0, shared: str = "all",
                   token: bool = True, readout: str = "attributes") -> PatchWorld:
    """A world of subject states h(s, P) = e_s (the token, when ``token``) + sum over the relations the shared
    state carries (``shared``: "all", "half" of them drawn per replicate, "none") of v_r(a_r(s)) + ``own`` x
    v_P(a_P(s)) in relation P's own prompt (a relation-specific lookup at the subject position; every relation
    the shared state lacks gets 1 in its own prompt) + noise of norm ~``noise`` per prompt; unit attribute vectors
    and token embeddings, Gaussian. ``readout``: "attributes" (relation B reads its attribute from the state,
    :func:`attribute_readout`), "key" (B looks s up by the nearest token embedding and answers its table entry:
    the state carries the identity only), "fallback" (a state of any subject from another prompt disrupts B's
    prompt, which answers B's commonest attribute; other vectors are read as "attributes")."""
    def hits(A, items, d, gen):
        n, R = A.shape
        V = [_unit_rows(int(A[:, r].max()) + 1, d, gen) for r in range(R)]
        E = _unit_rows(n, d, gen)
        carried = {"all": list(range(R)), "none": [],
                   "half": torch.randperm(R, generator=gen)[:R // 2].tolist()}[shared]
        attribute = torch.stack([V[r][A[:, r].clamp_min(0)] * (A[:, r] >= 0).unsqueeze(-1) for r in range(R)])
        base = attribute[carried].sum(0) + (E if token else 0)
        states = torch.stack([base + (own + (r not in carried)) * attribute[r] for r in range(R)] + [base])
        states = states + noise * torch.randn(states.shape, generator=gen, dtype=torch.float64) / d ** 0.5
        tokens = E if token else states[R]       # no token part: the state is the embedding (the construction)
        read = attribute_readout(V)
        if readout == "key":
            read = lambda h, b, recipients: A[(h @ E.T).argmax(-1), b]
        elif readout == "fallback":
            commonest = torch.stack([A[:, r][A[:, r] >= 0].mode().values for r in range(R)])
            subject_like = lambda h: (h / h.norm(dim=-1, keepdim=True) @ E.T).max(-1).values > 0.5
            attributes = attribute_readout(V)
            read = lambda h, b, recipients: torch.where(subject_like(h), commonest[b], attributes(h, b, recipients))
        return patch_hits(states, tokens, read, A, items, gen)
    return PatchWorld(name, hits, holds)


def equal_rates_patches(rate: float = 0.5) -> PatchWorld:
    """No model: every patch (the neutral state and each null alike) gives B's answer for s with probability
    ``rate``, independently per item and patch; the line's unpaired interval at the real n."""
    def hits(A, items, d, gen):
        out = {name: (torch.rand(len(items), generator=gen, dtype=torch.float64) < rate).double()
               for name in (*PATCHES, "token")}
        out["random_subject_follows"] = torch.zeros(len(items), dtype=torch.float64)
        return out
    return PatchWorld(f"equal rates {rate:g}, independent", hits, False)


def crosspatch_worlds(noisy: float = 9.0, faint: float = 18.0, own: float = 0.3) -> list[PatchWorld]:
    """The crosspatch line's worlds: where one state serves every relation by construction (the paper's one-layer
    construction: the state is the subject's embedding, the sum of its attribute vectors, the same in every
    prompt; a deep model's state, the token plus that sum, with per-prompt noise ``noisy`` (the neutral patch
    succeeds about as often as on SmolLM2, 0.60) and ``faint`` (0.2: a difference near twice the minimal
    effect), and with B's own prompt adding ``own`` x B's attribute);
    where it does not (relation-specific states: each prompt's state carries its own relation's attribute only,
    the neutral one none; the shared state carries half of the relations, the rest looked up in their own
    prompts; a patch from another prompt disrupts B, which falls back to its commonest answer (nearly noiseless
    states, so that every subject's state is recognisably one); equal rates);
    and the lexical world where B looks the subject up from its token identity (one state serves, literally,
    and carries no attribute)."""
    return [_planted_world("construction: the embedding, every prompt", True, token=False),
            _planted_world(f"token + attributes, noise {noisy:g}", True, noise=noisy),
            _planted_world(f"token + attributes + own x{own:g}, noise {noisy:g}", True, noise=noisy, own=own),
            _planted_world(f"token + attributes, noise {faint:g}", True, noise=faint),
            _planted_world("identity key, B looks it up (lexical)", None, noise=noisy, shared="none", readout="key"),
            _planted_world("relation-specific states", False, noise=noisy, shared="none"),
            _planted_world("shared state carries half the relations", False, noise=noisy, shared="half"),
            _planted_world("fallback: a foreign state -> commonest", False, noise=0.5, shared="none",
                           readout="fallback"),
            equal_rates_patches()]


def crosspatch_tests(entry: dict, hits: dict[str, torch.Tensor]) -> dict[str, dict | list[dict] | None]:
    """The crosspatch line's tests of one layer entry (the run's form, with ``pairs``): ``every`` (the line now:
    the report's own ``_crosspatch_tests`` on a report holding this entry: every relation B's neutral patch
    against random_subject and random_vector, one intersection-union test), ``pooled`` (the line before: the
    success pooled over pairs against the same nulls), ``median`` (the per-relation tests themselves, for the
    house form that shows the median relation) and ``token`` (the pooled test with the token swap as a third
    null, a candidate: the recipient's state with its token part swapped for s's)."""
    report = {"analyses": {"crosspatch": {"layers": {"0": entry}}}}
    every = next(iter(_crosspatch_tests(report)[0]), None)
    layer = CrosspatchLayer.from_dict(entry)
    pooled = pooled_crosspatch_test(0, layer)
    median = [claim_test(SERVES, target, 0, by["neutral"], {null: by.get(null) for null in NULLS[SERVES]})
              for target, by in crosspatch_targets(layer).items()]
    token = None
    if pooled is not None:
        nulls = {**metric_nulls(entry["neutral"]), "token": proportion(hits["token"].tolist()).to_dict()}
        diffs = {name: difference(entry["neutral"], nulls[name]) for name in (*NULLS[SERVES], "token")}
        hardest = max(diffs, key=lambda name: p_above(diffs[name], MIN_EFFECT[SERVES]))
        token = {"missing_nulls": [], "difference": diffs[hardest], "min_effect": MIN_EFFECT[SERVES],
                 "p": max(p_above(diff, MIN_EFFECT[SERVES]) for diff in diffs.values()),
                 "p_zero": max(p_above(diff, 0.0) for diff in diffs.values())}
    return {"every": every, "pooled": pooled, "median": [t for t in median if t], "token": token}


def median_grade(tests: list[dict], family: int) -> str:
    """The house form's line on per-relation tests: each graded by :func:`grade_with_power` over ``family`` tests,
    the line at the upper median relation (best first), as ``llmprobe.report.claims`` shows a line."""
    grades = sorted((grade_with_power(test, family) for test in tests), key=GRADES.index)
    return grades[(len(grades) - 1) // 2] if grades else "not shown"


def measure_patch_world(world: PatchWorld, A: torch.Tensor, d: int, seed: int, n_boot: int = 1000,
                        per_pair: int = LRE_PAIR_ITEMS) -> dict:
    """One draw of ``world`` on table ``A``: {"items", "hits" (per patch), "entry" (the run's pooled entry of one
    layer, ``llmprobe.analyses.selector._patch_metrics``), "tests" (:func:`crosspatch_tests`)}. The items are
    drawn afresh per replicate, as the run draws them per seed, ``per_pair`` per ordered pair (the run's 7 at the
    LRE layers, among which the line's layer is chosen; 3 at the others)."""
    items = planted_patch_items(A, seed, per_pair)
    hits = world.hits(A, items, d, torch.Generator().manual_seed(seed))
    entry = _patch_metrics(hits, settings_from(seed=seed, n_boot=n_boot))
    pair_of = [item[:2] for item in items]
    entry["pairs"] = [{"source": str(a), "target": str(b),                  # the run's per-pair numbers
                       **{patch: proportion([h for h, p in zip(hits[patch].tolist(), pair_of) if p == (a, b)]
                                            ).to_dict() for patch in PATCHES}} for a, b in dict.fromkeys(pair_of)]
    return {"items": items, "hits": hits, "entry": entry, "tests": crosspatch_tests(entry, hits)}


def calibrate_crosspatch(worlds: list[PatchWorld], A: torch.Tensor, d: int, replicates: int, family: int,
                         n_boot: int = 1000, per_pair: int = LRE_PAIR_ITEMS, on_row=None) -> list[dict]:
    """One row per world: items, ordered pairs, replicates, the mean success of each patch, and per test of
    :func:`crosspatch_tests` the fraction of replicates graded supported, supported or weak, and inconclusive
    (low power) with Bonferroni over ``family`` tests: power where the claim holds, false-positive rate
    (supported or weak) where it fails."""
    rows = []
    for world in worlds:
        grades: dict[str, list[str]] = {key: [] for key in CROSSPATCH_TESTS}
        sums: dict[str, float] = {}
        n_items, pairs = [], []
        for seed in range(replicates):
            got = measure_patch_world(world, A, d, seed, n_boot, per_pair)
            n_items.append(got["entry"]["neutral"]["n"])
            pairs.append(len({item[:2] for item in got["items"]}))
            for key, value in got["hits"].items():
                sums[key] = sums.get(key, 0.0) + float(value.mean()) / replicates
            for key, test in got["tests"].items():
                grades[key].append(median_grade(test, family + len(test) - 1) if key == "median" else
                                   grade_with_power(test, family))
        row = world_row(world, {"n": min(n_items), "pairs": min(pairs)}, replicates, family, sums, grades)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_crosspatch_rows(rows: list[dict]) -> str:
    """The crosspatch calibration table as text: mean success per patch, then per test supported / supported or
    weak / inconclusive (low power)."""
    holds = {True: "yes", False: "no", None: "-"}
    out = [f"{'world':44s} {'holds':5s} {'n':>3s} {'pairs':>5s} {'reps':>4s} {'neut':>5s} {'cross':>5s} "
           f"{'same':>5s} {'rsubj':>5s} {'follw':>5s} {'rvec':>5s} {'token':>5s}  "
           + "  ".join(f"{key + ': supp / +weak / low':>{w}s}" for key, w in zip(CROSSPATCH_TESTS, (25, 26, 26, 25)))]
    for r in rows:
        out.append(f"{r['world']:44s} {holds[r['claim_holds']]:5s} {r['n']:3d} {r['pairs']:5d} {r['replicates']:4d} "
                   + " ".join(f"{r[key]:5.2f}" for key in ("neutral", "cross_relation", "same_relation",
                                                           "random_subject", "random_subject_follows",
                                                           "random_vector", "token"))
                   + "  " + "  ".join(f"{r[f'{key}_supported']:{w}.2f} / {r[f'{key}_supported_or_weak']:5.2f} / "
                                      f"{r[f'{key}_low_power']:4.2f}" for key, w in zip(CROSSPATCH_TESTS,
                                                                                        (11, 12, 12, 11))))
    return "\n".join(out)


def crosspatch_table() -> tuple[torch.Tensor, list[str]]:
    """The crosspatch's fact table in the default SmolLM2 run: the shared-subject group's table (the country
    relations: attribute indices [n, R], -1 = no fact) and its relation names; the embedded model's tokenizer
    only (no forward pass)."""
    lm = load_model(device="cpu")
    table = superposition_table(lm.tokenizer, load_relations(None), {}, settings_from())
    return table.A, table.names


# ------------------------------------------------------------------------------------------------ chain-of-thought
COT_FAMILY = 27          # the SmolLM2 report's Holm family (the default run of 2026-12-06, /runs/smollm2)
# that run's k = 2 chains whose every hop is known, per composition: (name, chains, chains whose answer is the
# composition's most common one), from analyses.multihop.compositions (n_items, cot.nulls.majority x n_items)
SMOLLM2_CHAINS = (("company_hq_country/country_capital", 9, 3), ("company_hq_country/country_language", 6, 3),
                  ("company_hq_country/country_continent", 6, 6), ("landmark_country/country_capital", 16, 4),
                  ("landmark_country/country_language", 12, 4), ("landmark_country/country_continent", 11, 10),
                  ("person_citizenship/country_capital", 5, 2), ("person_citizenship/country_language", 5, 2),
                  ("person_citizenship/country_continent", 5, 5))
# its direct and CoT hit rates over those 75 chains, and their correlation over the chains (phi), read from its
# paired interval: cot_minus_direct 0.36 [0.227, 0.493] (paired bootstrap) is 31 chains right only with CoT, 4
# only directly, 35 both, 5 neither
SMOLLM2_DIRECT, SMOLLM2_COT, SMOLLM2_PHI = 0.52, 0.88, 0.06
# the tests: direct alone; + the pooled majority; direct and composition_majority (the line before the wrong-bridge
# control, as it grades older reports); the line (and wrong_bridge)
COT_TESTS = ("direct", "majority", "before", "line")
WRONG_BRIDGE_KEYS = ("n_without_wrong_bridge", "wrong_bridge", "wrong_bridge_follows", "cot_minus_wrong_bridge")


def chain_sizes(report: dict, k: int = 2) -> tuple[tuple[str, int, int], ...]:
    """A report's k-hop chains per composition as :data:`SMOLLM2_CHAINS`: (name, chains, chains answered by the
    composition's most common answer)."""
    out = []
    for comp in (report.get("analyses", {}).get("multihop") or {}).get("compositions") or []:
        if comp.get("k") == k:
            out.append((comp["name"], comp["n_items"],
                        round(comp["cot"]["nulls"]["majority"]["value"] * comp["n_items"])))
    if not out:
        raise ValueError(f"the report has no {k}-hop composition with chains (analyses.multihop.compositions)")
    return tuple(out)


@dataclass
class CotDraw:
    """One draw of a chain-of-thought world: per chain [n] its composition, its answer, and the hits
    ``direct``, ``cot``, ``ceiling``, ``cot_bridges`` (BoolTensors [n]), ``wrong_bridge`` and
    ``wrong_bridge_follows`` (float64 [n], NaN where the chain has no wrong bridge) as
    ``llmprobe.analyses.multihop`` scores them."""

    compositions: list[str]
    answers: list[str]
    hits: dict[str, torch.Tensor]


@dataclass(frozen=True)
class CotWorld:
    """A planted world of the chain-of-thought line: ``draw(seed)`` -> :class:`CotDraw`; ``holds``: whether
    chain-of-thought breaks a multi-hop bottleneck in it (CoT answers chains the direct pass cannot)."""

    name: str
    draw: Callable
    holds: bool


def planted_chains(sizes=SMOLLM2_CHAINS) -> tuple[list[str], list[str], torch.Tensor]:
    """The chains of ``sizes`` (:data:`SMOLLM2_CHAINS`' form): (composition per chain, answer per chain, whether
    the answer is its composition's most common one: BoolTensor [n]). The most common answer of a composition is
    named by its last relation (the answer's type: the continent compositions share theirs, as SmolLM2's share
    "Europe"); every other answer is its chain's own."""
    comps, answers, common = [], [], []
    for name, n, top in sizes:
        for i in range(n):
            comps.append(name)
            answers.append(f"{name.split('/')[-1]}: most common" if i < top else f"{name}: {i}")
            common.append(i < top)
    return comps, answers, torch.tensor(common)


def wrong_bridge_hits(partners: list[int | None], own: torch.Tensor, follows: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
    """``wrong_bridge`` (the chain's own answer given) and ``wrong_bridge_follows`` (the wrong bridge's answer
    given) as float64 [n] from BoolTensors ``own`` and ``follows`` [n]: NaN where ``partners`` has None (no other
    chain of the composition with another answer)."""
    missing = torch.tensor([j is None for j in partners])
    return {key: hit.double().masked_fill(missing, float("nan"))
            for key, hit in (("wrong_bridge", own), ("wrong_bridge_follows", follows))}


def planted_partners(comps: list[str], answers: list[str], seed: int) -> list[int | None]:
    """Each chain's wrong bridge: another chain of its composition with another answer, drawn as the analysis
    draws it (:func:`llmprobe.analyses.multihop.bridge_partners`)."""
    return bridge_partners(comps, answers, random.Random(seed))


def paired_hits(n: int, p_direct: float, p_cot: float, phi: float, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(direct, cot) BoolTensors [n]: each chain's two hits drawn jointly, rates ``p_direct`` and ``p_cot``,
    correlation ``phi`` over chains (clipped to what the two rates allow)."""
    spread = math.sqrt(p_direct * (1 - p_direct) * p_cot * (1 - p_cot))
    both = min(p_direct, p_cot, max(0.0, p_direct + p_cot - 1, p_direct * p_cot + phi * spread))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    cot = u < p_cot                                              # [0, p_cot): CoT right; [0, both): both right
    direct = (u < both) | ((u >= p_cot) & (u < p_cot + p_direct - both))
    return direct, cot


def cot_rate_worlds(sizes=SMOLLM2_CHAINS, direct: float = SMOLLM2_DIRECT, effects=(0.1, 0.2, 0.3, 0.36),
                    phi: float = SMOLLM2_PHI) -> list[CotWorld]:
    """Outcome-level worlds on the chains of ``sizes`` (no model: each chain's hits drawn). Where the claim holds:
    CoT right at ``direct`` + each of ``effects`` (the power curve; +0.36 is SmolLM2's 0.52 -> 0.88), paired with
    the direct hits at correlation ``phi``. Where it fails: equal rates (at ``direct`` and at SmolLM2's CoT rate);
    CoT's bridges wrong, so its last hop reads another chain's bridge of the same composition (right only where
    that chain has the same answer: chance); and CoT that only names the answer's type: the last statement ("The
    continent of ... is") answered with its composition's most common answer whatever the bridge, while the
    direct prompt's format misses (0.20): the gain a longer prompt naming the answer's type gives; and CoT that
    composes in the longer prompt and ignores its bridge: CoT right at SmolLM2's rates (and on every chain, direct
    on none), and as right with another chain's bridge in its place (``wrong_bridge`` = ``cot``, never following
    it). Last among the positives, CoT right and direct wrong on every chain (the paired interval of a constant
    difference is widened to [-1, 1]). Where the claim holds the model reads its bridge: with another chain's it
    gives that chain's answer where it knows the last hop (``wrong_bridge`` 0, ``wrong_bridge_follows`` = its
    ceiling)."""
    comps, answers, common = planted_chains(sizes)
    n = len(answers)
    none = torch.zeros(n, dtype=torch.bool)

    def rates(p_direct: float, p_cot: float, ignores_bridge: bool = False):
        def draw(seed):
            gen = torch.Generator().manual_seed(seed)
            d, c = paired_hits(n, p_direct, p_cot, phi, gen)
            wrong = wrong_bridge_hits(planted_partners(comps, answers, seed), c if ignores_bridge else none,
                                      none if ignores_bridge else c)
            return CotDraw(comps, answers, {"direct": d, "cot": c, "ceiling": c, "cot_bridges": c, **wrong})
        return draw

    def wrong_bridges(seed):
        gen = torch.Generator().manual_seed(seed)
        d, _ = paired_hits(n, direct, direct, phi, gen)
        cot = torch.zeros(n, dtype=torch.bool)
        for i in range(n):
            others = [j for j in range(n) if comps[j] == comps[i] and j != i]
            cot[i] = answers[others[int(torch.randint(len(others), (1,), generator=gen))]] == answers[i]
        ceiling = torch.rand(n, generator=gen) < SMOLLM2_COT
        return CotDraw(comps, answers, {"direct": d, "cot": cot, "ceiling": ceiling, "cot_bridges": none,
                                        **wrong_bridge_hits(planted_partners(comps, answers, seed), none, ceiling)})

    def answer_type(seed):
        gen = torch.Generator().manual_seed(seed)
        d = torch.rand(n, generator=gen) < 0.2
        partners = planted_partners(comps, answers, seed)            # the most common answer whatever the bridge
        follows = torch.tensor([j is not None and bool(common[j]) for j in partners])
        return CotDraw(comps, answers, {"direct": d, "cot": common.clone(), "ceiling": common.clone(),
                                        "cot_bridges": torch.rand(n, generator=gen) < 0.9,
                                        **wrong_bridge_hits(partners, common.clone(), follows)})

    worlds = [CotWorld(f"rates: direct {direct:.2f}, CoT +{e:.2f}", rates(direct, min(1.0, direct + e)), True)
              for e in effects] + [CotWorld("rates: direct 0, CoT 1 (every chain)", rates(0.0, 1.0), True)]
    return worlds + [CotWorld(f"rates: direct = CoT = {direct:.2f}", rates(direct, direct), False),
                     CotWorld(f"rates: direct = CoT = {SMOLLM2_COT:.2f}", rates(SMOLLM2_COT, SMOLLM2_COT), False),
                     CotWorld("CoT bridges wrong: last hop at chance", wrong_bridges, False),
                     CotWorld("CoT names the answer type only, direct 0.20", answer_type, False),
                     CotWorld(f"CoT ignores bridge: direct {direct:.2f}, CoT {SMOLLM2_COT:.2f}",
                              rates(direct, SMOLLM2_COT, ignores_bridge=True), False),
                     CotWorld("CoT ignores bridge: direct 0, CoT 1", rates(0.0, 1.0, ignores_bridge=True), False)]


def two_hop_hits(direct_model: FactRecallModel, cot_model: FactRecallModel, table: torch.Tensor,
                 s: torch.Tensor, rel: torch.Tensor, wrong_bridge: torch.Generator | None = None,
                 partners: list[int | None] | None = None) -> dict[str, torch.Tensor]:
    """The multi-hop analysis' hits on one-layer two-hop models (``synthetic.tasks.random_khop``'s sequences) for
    chains (s [n], rel [n, 2]) over the subject map ``table`` [N, R]: ``direct`` the one-pass model's answer at
    (s, r1, r2); ``cot`` the chain-of-thought model's own bridge at (s, r1, r2), fed back, and its answer after
    it; ``ceiling`` its answer after the true bridge; ``cot_bridges`` its bridge right. ``wrong_bridge``: a
    generator that replaces each bridge by another subject (the bridges wrong). ``partners`` (each chain's other
    chain, :func:`planted_partners`): the answer after that chain's true bridge, scored on the chain's answer
    (``wrong_bridge``) and on the other chain's (``wrong_bridge_follows``)."""
    N = table.shape[0]
    bridge, answer = table[s, rel[:, 0]], table[table[s, rel[:, 0]], rel[:, 1]]
    prefix = torch.stack([s, rel[:, 0] + N, rel[:, 1] + N], 1)
    direct = direct_model.predict(prefix, torch.tensor([2]))[:, 0] == answer
    said = cot_model.predict(torch.cat([prefix, bridge[:, None]], 1), torch.tensor([2]))[:, 0]
    if wrong_bridge is not None:
        said = (bridge + torch.randint(1, N, bridge.shape, generator=wrong_bridge)) % N
    cot = cot_model.predict(torch.cat([prefix, said[:, None]], 1), torch.tensor([3]))[:, 0] == answer
    ceiling = cot_model.predict(torch.cat([prefix, bridge[:, None]], 1), torch.tensor([3]))[:, 0] == answer
    hits = {"direct": direct, "cot": cot, "ceiling": ceiling, "cot_bridges": said == bridge}
    if partners is not None:
        other = torch.tensor([i if j is None else j for i, j in enumerate(partners)])
        given = cot_model.predict(torch.cat([prefix, bridge[other, None]], 1), torch.tensor([3]))[:, 0]
        hits.update(wrong_bridge_hits(partners, given == answer, given == answer[other]))
    return hits


def cot_model_worlds(sizes=SMOLLM2_CHAINS, n_subjects: int = 16, n_relations: int = 8, narrow: int = 8,
                     moderate: int = 12, wide: int = 32, draws: int = 4, steps: int = 2000) -> list[CotWorld]:
    """Worlds of one-layer two-hop models (the stored multi-hop sweep's recipe: ``random_khop`` over R random
    permutations of N subjects, learned attention, d_mlp = 4 d, Adam lr 0.03, to 100% train accuracy or
    ``steps``): per model seed (table and initialisation) a one-pass model and a chain-of-thought model of the
    same width. At N = 16, R = 8 the sweep's d* is 24 without CoT and 8-16 with it: at ``narrow`` and
    ``moderate`` widths every single hop fits and the one-pass composition does not (the claim holds); at
    ``wide`` the one-pass model composes too, and with its bridges replaced by other subjects CoT reads the
    wrong ones (it fails); every model reads the bridge it is given (``wrong_bridge`` from another chain's).
    Chains: as many compositions (relation pairs, drawn per draw) as ``sizes`` has, each
    with its number of chains, among the chains whose every hop the CoT model knows (both steps right with the
    true bridge). Seed ``seed`` is model seed ``seed // draws``, chain draw ``seed % draws``."""
    trained: dict[tuple[int, bool, int], FactRecallModel] = {}

    def model(width: int, cot: bool, seed: int) -> FactRecallModel:
        if (width, cot, seed) not in trained:
            task = random_khop(n_subjects, n_relations, 2, cot=cot, seed=seed)
            cfg = TrainConfig(lr=0.03, max_steps=steps, progress=False)
            trained[width, cot, seed] = train(task, width, config=cfg, attention="learned", d_mlp=4 * width,
                                              seed=seed).model
        return trained[width, cot, seed]

    def world(width: int, wrong: bool = False):
        def draw(seed):
            model_seed, gen = seed // draws, torch.Generator().manual_seed(seed)
            table = random_khop(n_subjects, n_relations, 2, seed=model_seed).base.table
            direct_model, cot_model = model(width, False, model_seed), model(width, True, model_seed)
            pairs = torch.randperm(n_relations ** 2, generator=gen)[:len(sizes)]
            comps, s, rel = [], [], []
            for (_, n, _), pair in zip(sizes, pairs.tolist()):
                subjects = torch.arange(n_subjects)
                relations = torch.tensor([[pair // n_relations, pair % n_relations]] * n_subjects)
                hops = two_hop_hits(direct_model, cot_model, table, subjects, relations)
                known = hops["ceiling"] & hops["cot_bridges"]
                chosen = subjects[known][torch.randperm(int(known.sum()), generator=gen)[:n]]
                comps += [f"r{pair // n_relations}/r{pair % n_relations}"] * len(chosen)
                s.append(chosen)
                rel.append(relations[:len(chosen)])
            s, rel = torch.cat(s), torch.cat(rel)
            answers = [f"e{int(a)}" for a in table[table[s, rel[:, 0]], rel[:, 1]]]
            hits = two_hop_hits(direct_model, cot_model, table, s, rel, gen if wrong else None,
                                planted_partners(comps, answers, seed))
            return CotDraw(comps, answers, hits)
        return draw

    where = f"N={n_subjects}, R={n_relations}"
    return [CotWorld(f"two-hop models, {where}, d={narrow}", world(narrow), True),
            CotWorld(f"two-hop models, {where}, d={moderate}", world(moderate), True),
            CotWorld(f"two-hop models, {where}, d={wide} (composes)", world(wide), False),
            CotWorld(f"two-hop models, d={narrow}, CoT bridges wrong", world(narrow, wrong=True), False)]


def cot_block(draw: CotDraw, n_boot: int = 1000, seed: int = 0) -> dict:
    """The multi-hop analysis' entry (``analyses.multihop``: ``compositions`` and ``pooled`` "k=2") of one draw,
    built by the analysis' own ``_accuracy`` (the typed metrics, the paired bootstrap, the majority control) per
    composition and pooled, as ``llmprobe.analyses.multihop.multihop`` builds it."""
    cfg = AnalysisSettings(n_boot=n_boot, seed=seed)
    out = {"compositions": [], "pooled": {}}
    for name in dict.fromkeys(draw.compositions):
        keep = torch.tensor([c == name for c in draw.compositions])
        entry = multihop_accuracy({k: h[keep] for k, h in draw.hits.items()},
                                  [a for a, x in zip(draw.answers, keep) if x], cfg)
        out["compositions"].append({"name": name, "hops": name.split("/"), "k": 2, **entry})
    out["pooled"]["k=2"] = multihop_accuracy(draw.hits, draw.answers, cfg)
    return out


def _against(metric: dict, nulls: dict[str, tuple[dict, dict | None]]) -> dict:
    """A test of ``metric`` against ``nulls`` ({name: (null metric, paired difference or None)}) by the verdict
    rule's difference (:func:`llmprobe.report.claims.difference`): the hardest null's difference, p and p_zero
    (every null beaten), for :func:`grade_with_power`."""
    diffs = {name: difference(metric, null, paired) for name, (null, paired) in nulls.items()}
    hardest = max(diffs, key=lambda name: p_above(diffs[name], MIN_EFFECT[MULTIHOP]))
    return {"missing_nulls": [], "difference": diffs[hardest], "min_effect": MIN_EFFECT[MULTIHOP],
            "p": max(p_above(d, MIN_EFFECT[MULTIHOP]) for d in diffs.values()),
            "p_zero": max(p_above(d, 0.0) for d in diffs.values())}


def without_wrong_bridge(block: dict) -> dict:
    """The multi-hop entry ``block`` as a report written before the wrong-bridge control holds it (no
    ``wrong_bridge`` keys in its compositions and pooled entries)."""
    def strip(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if k not in WRONG_BRIDGE_KEYS}
    return {**block, "compositions": [strip(c) for c in block["compositions"]],
            "pooled": {key: strip(entry) for key, entry in block["pooled"].items()}}


def cot_tests(block: dict) -> dict[str, dict | None]:
    """The chain-of-thought line's tests of one multi-hop entry: ``line`` (the report's own ``_multihop_tests`` on
    a report holding it: the direct answer, paired, :func:`~llmprobe.report.claims.composition_majority` and
    wrong_bridge, paired), ``before`` (the same on the entry without its wrong-bridge keys, as the line grades an
    older report: the direct answer and composition_majority), ``direct`` (the direct answer alone, paired) and
    ``majority`` (the direct answer and the pooled chains' most common answer, the ``majority`` control the report
    already had)."""
    pooled = block["pooled"]["k=2"]
    line = next(iter(_multihop_tests({"analyses": {"multihop": block}})), None)
    before = next(iter(_multihop_tests({"analyses": {"multihop": without_wrong_bridge(block)}})), None)
    direct = (pooled["direct"], pooled["cot_minus_direct"])
    return {"direct": _against(pooled["cot"], {"direct": direct}),
            "majority": _against(pooled["cot"], {"direct": direct,
                                                 "majority": (pooled["cot"]["nulls"]["majority"], None)}),
            "before": before, "line": line}


def calibrate_cot(worlds: list[CotWorld], replicates: int, family: int = COT_FAMILY, n_boot: int = 1000,
                  on_row=None) -> list[dict]:
    """One row per world: chains, replicates, the mean rates (direct, CoT, ceiling, bridges right, wrong bridge
    (the chain's answer; the wrong bridge's), the pooled chains' composition majority) and per test of :func:`cot_tests` the fraction of replicates graded supported,
    supported or weak, and inconclusive (low power), with Bonferroni over ``family`` tests (the report's Holm
    family, its strictest step): power where the claim holds, false-positive rate (supported or weak) where it
    fails."""
    rows = []
    for world in worlds:
        grades: dict[str, list[str]] = {key: [] for key in COT_TESTS}
        sums: dict[str, float] = {}
        n_seen = []
        for seed in range(replicates):
            block = cot_block(world.draw(seed), n_boot, seed)
            pooled = block["pooled"]["k=2"]
            n_seen.append(pooled["n_items"])
            prior = composition_majority({"analyses": {"multihop": block}}, "k=2")
            values = {**{key: pooled[key]["value"] for key in ("direct", "cot", "ceiling", "cot_bridges",
                                                               "wrong_bridge", "wrong_bridge_follows")},
                      "composition_majority": prior["value"]}
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + value / replicates
            for key, test in cot_tests(block).items():
                grades[key].append(grade_with_power(test, family))
        row = world_row(world, {"n": min(n_seen)}, replicates, family, sums, grades)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_cot_rows(rows: list[dict]) -> str:
    """The chain-of-thought calibration table as text: mean rates, then per test supported / supported or weak /
    inconclusive (low power)."""
    out = [f"{'world':44s} {'holds':5s} {'n':>3s} {'reps':>4s} {'direct':>6s} {'cot':>5s} {'ceil':>5s} "
           f"{'bridg':>5s} {'c.maj':>5s} {'wrong':>5s} {'follw':>5s}  {'direct: supp / +weak / low':>26s}  "
           f"{'+majority: supp / +weak / low':>29s}  {'before: supp / +weak / low':>26s}  "
           f"{'line: supp / +weak / low':>24s}"]
    for r in rows:
        out.append(f"{r['world']:44s} {'yes' if r['claim_holds'] else 'no':5s} {r['n']:3d} {r['replicates']:4d} "
                   f"{r['direct']:6.2f} {r['cot']:5.2f} {r['ceiling']:5.2f} {r['cot_bridges']:5.2f} "
                   f"{r['composition_majority']:5.2f} {r['wrong_bridge']:5.2f} {r['wrong_bridge_follows']:5.2f}  "
                   + "  ".join(f"{r[f'{key}_supported']:{w}.2f} / {r[f'{key}_supported_or_weak']:5.2f} / "
                               f"{r[f'{key}_low_power']:4.2f}" for key, w in (("direct", 12), ("majority", 15),
                                                                              ("before", 12), ("line", 10))))
    return "\n".join(out)
