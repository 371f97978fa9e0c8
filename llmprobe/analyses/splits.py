"""Split discipline: one fixed held-out test set per relation; re-fits re-draw train, validation and Jacobian
subjects from the rest only, and cut the rest less the Jacobian subjects into the folds that choose the LRE's
(beta, rank); edit pairs drawn once (test) or once per re-fit (selection) and shared by every layer and every
decoder. Every draw has its own seeded generator, so turning one analysis on or off changes no other's numbers."""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from llmprobe.analyses.settings import AnalysisError, AnalysisSettings


def generator(cfg: AnalysisSettings, *keys) -> torch.Generator:
    """A generator seeded by the run's seed and ``keys`` (e.g. relation name, "test"): independent streams."""
    text = "/".join(str(k) for k in keys)
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(text.encode()))


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
    """The fixed test subjects, their edit pairs, the in-context subjects (protocol "lre"), and the re-fits."""

    test: torch.Tensor
    test_pairs: tuple[torch.Tensor, torch.Tensor]
    context: torch.Tensor
    refits: list[Refit]

    def jacobian_union(self) -> torch.Tensor:
        """Every subject whose Jacobian some re-fit averages (computed once, in one batched call)."""
        return torch.cat([r.jacobian for r in self.refits]).unique()


def relation_split(y: torch.Tensor, name: str, cfg: AnalysisSettings, n_context: int = 0) -> RelationSplit:
    """Split ``len(y)`` known facts of relation ``name``: the test set depends only on (seed, name, n), never
    on the number of re-fits or on which analyses run."""
    n = len(y)
    perm = torch.randperm(n, generator=generator(cfg, name, "test"))
    n_test = max(2, round(cfg.test_fraction * n))
    test, rest = perm[:n_test].sort().values, perm[n_test:]
    context, rest = rest[:n_context].sort().values, rest[n_context:]
    n_val = max(2, round(cfg.val_fraction * len(rest)))
    n_jac = max(1, min(cfg.n_jacobian, (len(rest) - n_val) // 2))
    if cfg.selection_folds < 2:
        raise AnalysisError(f"selection_folds must be at least 2, got {cfg.selection_folds}")
    if len(rest) - n_val < max(2, n_jac):
        raise AnalysisError(f"relation {name}: {n} known facts are too few for a test set of {n_test}, "
                            f"{n_context} in-context examples and train/validation re-fits")
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
    return RelationSplit(test, test_pairs, context, refits)


def candidate_grid(cfg: AnalysisSettings) -> list[tuple[float, int | None]]:
    """Every (beta, rank) candidate of the LRE, in the order that breaks ties (ranks as listed, then betas as
    listed): all of them are scored by K-fold cross-validation on the selection subjects, however few."""
    return [(b, k) for k in cfg.ranks for b in cfg.betas]
