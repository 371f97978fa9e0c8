"""The LRE causality line (:func:`calibrate_causal`) calibrated on planted relations.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.decoders import EDITS, SVD, causality_metric, lre_causality
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.analyses.splits import generator, relation_split
from llmprobe.jobs.calibration.common import grade_with_power, world_row
from llmprobe.report.claims import CAUSAL, MIN_EFFECT, _causality_tests, claim_test, difference, p_above

CAUSAL_BEFORE = ("random_direction", "random_operator")  # the causal line's nulls before scaled_patch


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
            measured, pairs = [], []
            for seed in range(replicates):
                metric = world.measure(n, d, seed)
                pairs.append(metric["n"])
                measured.append({"edit": metric["value"], **{name: m["value"] for name, m in metric["nulls"].items()},
                                 "edit_minus_scaled_patch": metric["margins"]["scaled_patch"]["value"]})
                for key, test in causal_tests(metric).items():
                    grades[key].append(grade_with_power(test, family))
            row = world_row(world, {"n_facts": n, "n": min(pairs), "n_max": max(pairs)}, replicates, family,
                            measured, grades)
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
