"""The chain-of-thought line (:func:`calibrate_cot`): the SmolLM2 run's two-hop chains (``SMOLLM2_CHAINS``) given
planted hits (paired rates, bridges wrong, a prompt that names only the answer's type, a model that composes in
the longer prompt and ignores its bridge) or the hits of one-layer two-hop models too narrow or wide enough to
compose in one pass, built into the multi-hop entry by the analysis' own code and graded by the report's line
(``llmprobe.report.claims._multihop_tests``), with and without its wrong-bridge control.

Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.multihop import _accuracy as multihop_accuracy
from llmprobe.analyses.multihop import bridge_partners
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.jobs.calibration.common import grade_with_power, world_row
from llmprobe.report.claims import MIN_EFFECT, MULTIHOP, _multihop_tests, composition_majority, difference, p_above
from synthetic.model import FactRecallModel
from synthetic.tasks import random_khop
from synthetic.train import TrainConfig, train

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
        measured, n_seen = [], []
        for seed in range(replicates):
            block = cot_block(world.draw(seed), n_boot, seed)
            pooled = block["pooled"]["k=2"]
            n_seen.append(pooled["n_items"])
            prior = composition_majority({"analyses": {"multihop": block}}, "k=2")
            measured.append({**{key: pooled[key]["value"] for key in ("direct", "cot", "ceiling", "cot_bridges",
                                                                      "wrong_bridge", "wrong_bridge_follows")},
                             "composition_majority": prior["value"]})
            for key, test in cot_tests(block).items():
                grades[key].append(grade_with_power(test, family))
        row = world_row(world, {"n": min(n_seen)}, replicates, family, measured, grades)
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
