"""Split discipline: one fixed held-out test set per relation; re-fits re-draw train, validation and Jacobian
subjects from the rest only, and cut the rest less the Jacobian subjects into the folds that choose the LRE's
(beta, rank); edit pairs drawn once (test) or once per re-fit (selection) and shared by every layer and every
decoder. Every draw has its own seeded generator, so turning one analysis on or off changes no other's numbers.

In-context draws (:func:`in_context_draws`): the facts written before the prompts, drawn by the known-fact stage
(``llmprobe.model.known.context_draws``) and never tested. The LRE reference's protocol has one draw per trial
(its training samples), the known facts of each trial cut by :func:`trial_split`, and its own pair rule
(:func:`object_pairs`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmprobe.analyses.settings import AnalysisError, AnalysisSettings
from llmprobe.model.known import CONTEXT, KNOWN, context_draws, seeded_generator


def generator(cfg: AnalysisSettings, *keys) -> torch.Generator:
    """A generator seeded by the run's seed and ``keys`` (e.g. relation name, "test"): independent streams."""
    return seeded_generator(cfg.seed, *keys)


@dataclass
class Draw:
    """One in-context draw of a relation: ``context`` the indices (into the known-fact results) of its in-context
    examples, ``known`` those of the facts known with them (never an in-context one)."""

    context: list[int]
    known: list[int]


def in_context_draws(results: list, protocol: str, n_icl: int, n_draws: int, seed: int, name: str) -> list[Draw]:
    """The in-context draws of a relation's known-fact ``results`` (``llmprobe.model.known.FactResult``): those the
    known-fact stage recorded (``FactResult.draws``), checked against ``n_icl`` and, for protocol "lre",
    ``n_draws``; or, for results checked without draws (zero-shot, or made by the caller), drawn here from the
    known facts with the same seeded draw (strict: once, uniformly, and facts sharing an in-context subject left
    out; lre: once per trial, one fact per distinct object first). Empty for zero-shot prompts (``n_icl`` 0)."""
    recorded = {len(r.draws) for r in results}
    if recorded - {0}:
        sizes = {sum(r.draws[k] == CONTEXT for r in results) for k in range(min(recorded))}
        wanted = n_draws if protocol == "lre" else 1
        if recorded != {wanted} or sizes != {n_icl}:
            raise AnalysisError(f"relation {name}: its known facts were checked with {sorted(sizes)} in-context "
                                f"examples in {sorted(recorded)} draws; the analyses ask for {n_icl} in "
                                f"{wanted}: check the known facts with the same protocol, n_icl and n_splits")
        return [Draw([i for i, r in enumerate(results) if r.draws[k] == CONTEXT],
                     [i for i, r in enumerate(results) if r.draws[k] == KNOWN]) for k in range(min(recorded))]
    if n_icl == 0:
        return []
    known = [i for i, r in enumerate(results) if r.known]
    if len(known) <= n_icl:
        raise AnalysisError(f"relation {name}: {len(known)} known facts leave none beside {n_icl} in-context "
                            f"examples")
    draws = []
    objects = [results[i].object for i in known] if protocol == "lre" else None
    for picked in context_draws(len(known), n_icl, n_draws if protocol == "lre" else 1, seed, name, objects):
        context = [known[j] for j in picked]
        shared = {results[i].subject for i in context} if protocol == "strict" else set()
        draws.append(Draw(context, [i for i in known if i not in context and results[i].subject not in shared]))
    return draws


def trial_split(known: list[int], name: str, trial: int, cfg: AnalysisSettings, as_published: bool
                ) -> tuple[list[int], list[int]]:
    """(validation, test) of one trial's known facts: as published (the reference) both are all of them;
    otherwise ``test_fraction`` of them (at least 2) are the test facts and the rest choose beta, the edit rank
    and the layer."""
    if as_published:
        return list(known), list(known)
    perm = torch.randperm(len(known), generator=generator(cfg, name, "lre trial", trial)).tolist()
    n_test = max(2, round(cfg.test_fraction * len(known)))
    return sorted(known[j] for j in perm[n_test:]), sorted(known[j] for j in perm[:n_test])


def object_pairs(subjects: list[str], objects: list[str], sources: torch.Tensor, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's edit pairs: each of ``sources`` (indices) with a random target among them of another
    subject and another object string (sources without one are left out). Returns (src, tgt) LongTensors [m]."""
    src, tgt = [], []
    pool = sources.tolist()
    for i in pool:
        options = [j for j in pool if subjects[j] != subjects[i] and objects[j] != objects[i]]
        if options:
            src.append(i)
            tgt.append(options[int(torch.randint(len(options), (1,), generator=gen))])
    return torch.tensor(src, dtype=torch.long), torch.tensor(tgt, dtype=torch.long)


def edit_pairs(y: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, gen: torch.Generator,
               limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For up to ``limit`` of ``sources`` (random) a target among ``targets`` whose object has another first
    token (an edit toward the same answer would prove nothing). Returns (src, tgt) LongTensors [m]."""
    src, tgt = [], []
    pool = targets.tolist()
    chosen = sources[torch.randperm(len(sources), generator=gen)[:limit]].sort().values
    for i in chosen.tolist():
        options = [j for j in pool if j != i and int(y[j]) != int(y[i])]
        if options:
            src.append(i)
            tgt.append(options[int(torch.randint(len(options), (1,), generator=gen))])
    return torch.tensor(src, dtype=torch.long), torch.tensor(tgt, dtype=torch.long)


@dataclass
class Refit:
    """One re-draw: Jacobian subjects (inside train), train, validation (ridge alpha), and the selection
    subjects of the LRE: train and validation less the Jacobian subjects, cut into ``folds`` (held-out index
    sets partitioning ``selection``); ``val_pairs`` the edit pairs among them that choose the edit rank."""

    jacobian: torch.Tensor
    train: torch.Tensor
    val: torch.Tensor
    val_pairs: tuple[torch.Tensor, torch.Tensor]
    selection: torch.Tensor
    folds: list[torch.Tensor]


@dataclass
class RelationSplit:
    """The fixed test subjects, their edit pairs, and the re-fits."""

    test: torch.Tensor
    test_pairs: tuple[torch.Tensor, torch.Tensor]
    refits: list[Refit]

    def jacobian_union(self) -> torch.Tensor:
        """Every subject whose Jacobian some re-fit averages (computed once, in one batched call)."""
        return torch.cat([r.jacobian for r in self.refits]).unique()


def relation_split(y: torch.Tensor, name: str, cfg: AnalysisSettings) -> RelationSplit:
    """Split ``len(y)`` known facts of relation ``name`` (in-context examples are none of them): the test set
    depends only on (seed, name, n), never on the number of re-fits or on which analyses run."""
    n = len(y)
    perm = torch.randperm(n, generator=generator(cfg, name, "test"))
    n_test = max(2, round(cfg.test_fraction * n))
    test, rest = perm[:n_test].sort().values, perm[n_test:]
    n_val = max(2, round(cfg.val_fraction * len(rest)))
    n_jac = max(1, min(cfg.n_jacobian, (len(rest) - n_val) // 2))
    if cfg.selection_folds < 2:
        raise AnalysisError(f"selection_folds must be at least 2, got {cfg.selection_folds}")
    if len(rest) - n_val < max(2, n_jac):
        raise AnalysisError(f"relation {name}: {n} known facts are too few for a test set of {n_test} and "
                            f"train/validation re-fits")
    test_pairs = edit_pairs(y, test, test, generator(cfg, name, "test pairs"), cfg.max_test_pairs)
    refits = []
    for k in range(cfg.n_splits):
        gen = generator(cfg, name, "refit", k)
        p = rest[torch.randperm(len(rest), generator=gen)]
        val, train = p[:n_val].sort().values, p[n_val:]
        jac = train[torch.randperm(len(train), generator=gen)[:n_jac]].sort().values
        selection = p[~torch.isin(p, jac)].sort().values
        pairs = edit_pairs(y, selection, selection, gen, cfg.max_val_pairs)
        fold_gen = generator(cfg, name, "selection folds", k)
        order = selection[torch.randperm(len(selection), generator=fold_gen)]
        folds = [f.sort().values for f in torch.tensor_split(order, min(cfg.selection_folds, len(selection)))]
        refits.append(Refit(jac, train.sort().values, val, pairs, selection, folds))
    return RelationSplit(test, test_pairs, refits)


def candidate_grid(cfg: AnalysisSettings) -> list[tuple[float, int | None]]:
    """Every (beta, rank) candidate of the LRE, in the order that breaks ties (ranks as listed, then betas as
    listed): all of them are scored by K-fold cross-validation on the selection subjects, however few."""
    return [(b, k) for k in cfg.ranks for b in cfg.betas]
