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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.decoders import EDITS, SVD, causality_metric, lre_causality
from llmprobe.analyses.selector import PromptSet, redirect_metrics, redirect_transplant, transplant_metrics
from llmprobe.analyses.selector import gate_transplant as run_transplant
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.analyses.splits import generator, relation_split
from llmprobe.geometry import superposition_readout
from llmprobe.geometry.planted import lexical_world, planted_superposition, shuffled_superposition
from llmprobe.report.claims import (
    ALPHA,
    CAUSAL,
    MIN_EFFECT,
    POWER,
    SELECTOR_BREAK,
    SUPERPOSITION,
    _causality_tests,
    _informative,
    claim_test,
    difference,
    p_above,
    power,
    selector_test,
)
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.mechanisms import redirection_items, transplant_items
from synthetic.model import FactRecallModel
from synthetic.tasks import FactTask, random_bijections, random_functions
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
            row = {"world": world.name, "claim_holds": world.holds, "n_facts": n, "n": min(pairs),
                   "n_max": max(pairs), "replicates": replicates, "family": family,
                   **{k: round(v, 4) for k, v in sums.items()}}
            for key, graded in grades.items():
                row[f"{key}_supported"] = sum(g == "supported" for g in graded) / replicates
                row[f"{key}_supported_or_weak"] = sum(g in ("supported", "weak") for g in graded) / replicates
                row[f"{key}_low_power"] = sum(g == "inconclusive (low power)" for g in graded) / replicates
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


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
