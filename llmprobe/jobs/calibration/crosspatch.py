"""The crosspatch line (:func:`calibrate_crosspatch`) calibrated on planted subject states.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.results import CrosspatchLayer, metric_nulls
from llmprobe.analyses.selector import LRE_PAIR_ITEMS, PATCHES, _patch_metrics, pair_items
from llmprobe.analyses.settings import settings_from
from llmprobe.analyses.superposition import superposition_table
from llmprobe.datasets import load_relations
from llmprobe.geometry import random_direction_like
from llmprobe.jobs.calibration.common import grade_with_power, world_row
from llmprobe.metric import proportion
from llmprobe.model.loading import load_model
from llmprobe.report.claims import (
    GRADES,
    MIN_EFFECT,
    NULLS,
    SERVES,
    _crosspatch_tests,
    claim_test,
    crosspatch_targets,
    difference,
    p_above,
    pooled_crosspatch_test,
)

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
    fact) by the run's rule (``llmprobe.analyses.selector.pair_items``, as ``crosspatch_items`` draws them; every fact known and located): up to
    ``per_pair`` per ordered relation pair, s with a fact of B, a recipient s' and a random subject s'' of B with
    other answers than s's and each other's."""
    gen = random.Random(seed)
    R, A = A.shape[1], A.tolist()
    facts = {r: [i for i in range(len(A)) if A[i][r] >= 0] for r in range(R)}
    items = pair_items(R, facts, lambda a, i: A[i][a] >= 0, lambda b, i: A[i][b], per_pair, gen)
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
        measured, n_items, pairs = [], [], []
        for seed in range(replicates):
            got = measure_patch_world(world, A, d, seed, n_boot, per_pair)
            n_items.append(got["entry"]["neutral"]["n"])
            pairs.append(len({item[:2] for item in got["items"]}))
            measured.append({key: float(value.mean()) for key, value in got["hits"].items()})
            for key, test in got["tests"].items():
                grades[key].append(median_grade(test, family + len(test) - 1) if key == "median" else
                                   grade_with_power(test, family))
        row = world_row(world, {"n": min(n_items), "pairs": min(pairs)}, replicates, family, measured, grades)
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
