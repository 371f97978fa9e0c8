"""Superposition readouts from relation-free subject states.

Inputs are plain tensors: H [n_subjects, d] subject states; a fact table A LongTensor [n_subjects, n_relations] of
attribute indices (-1 = missing); attribute vectors U = list over relations of [n_attr_r, d_u_r] tensors (e.g.
unembedding rows of each attribute's first token, or a synthetic model's attribute embeddings). The same code
measures pretrained and synthetic models.

* ``RelationReadout``: per-relation linear map h -> u-space, answer = nearest of that relation's attributes.
* ``SuperpositionFit``: h_s ~ c + sum_r W_r u_{a_r(s)}; held-out R^2, components, swap edits, and ``decode``
  (recover every attribute from h using the fitted W_r).
* ``superposition_readout``: both of the above cross-fitted over subjects, beside the shuffled-table control and
  any supplied control states (e.g. a random-init model of the same architecture), with bootstrap CIs.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator

from llmprobe.geometry.stats import (
    ALPHA_GRID,
    as_float,
    as_tensor,
    check_rows,
    fit_ridge,
    kfold_indices,
    shuffle_table,
    truncate_rank,
)
from llmprobe.metric import Metric, bootstrap, paired_difference, proportion

__all__ = ["RelationReadout", "SuperpositionFit", "superposition_readout", "SuperpositionReport"]

_METRICS = ("cosine", "euclidean", "dot")


# ------------------------------------------------------------------------------------------------------ checking
def _check_labels(a: Any, n_attr: int, name: str = "a") -> torch.Tensor:
    a = as_tensor(a, name, 1)
    if a.is_floating_point() or a.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer attribute indices, got {a.dtype}")
    if a.numel() and (int(a.max()) >= n_attr or int(a.min()) < -1):
        raise ValueError(f"{name} holds indices outside [-1, {n_attr - 1}] (relation has {n_attr} attributes)")
    return a


def _check_table(A: Any, U: Sequence[Any] | None = None, n_rel: int | None = None) -> torch.Tensor:
    A = as_tensor(A, "A", 2)
    if A.is_floating_point() or A.dtype == torch.bool:
        raise ValueError(f"A must be an integer (Long) tensor of attribute indices, got {A.dtype}")
    if n_rel is not None and A.shape[1] != n_rel:
        raise ValueError(f"A has {A.shape[1]} relation columns but the fit has {n_rel} relations")
    if U is not None:
        if len(U) != A.shape[1]:
            raise ValueError(f"U has {len(U)} relations but A has {A.shape[1]} columns")
        for r, U_r in enumerate(U):
            _check_labels(A[:, r], U_r.shape[0], f"A[:, {r}]")
    return A


def _check_attrs(U: Sequence[Any]) -> list[torch.Tensor]:
    if U is None or len(U) == 0:
        raise ValueError("U (attribute vectors per relation) is empty")
    return [as_float(U_r, f"U[{r}]", 2) for r, U_r in enumerate(U)]


# ------------------------------------------------------------------------------------------------------- readout
class RelationReadout(BaseEstimator):
    """Per-relation linear readout: ridge map M: h [d] -> u-space [d_u], answer = nearest attribute vector.

    fit(H [n, d], a [n], U_r [n_attr, d_u]) (rows with a = -1 are skipped) sets ``M_`` [d_u, d], ``m_`` [d_u],
    ``U_`` (the prepared attribute vectors), ``alpha_``, ``majority_`` and ``chance_``.

    alpha: ridge penalty, or a sequence of them to choose from by exact leave-one-out error.

    metric: "cosine" (default; safe for unembedding rows, whose norms vary), "euclidean" or "dot".
    center: subtract the mean of the relation's attribute vectors first (removes the shared direction that
    unembedding rows have; the intercept absorbs it in the regression anyway). With metric "cosine" the regression
    targets are the unit-normalised (centred) vectors.
    chance_: accuracy of always answering the training majority attribute (not 1/n_attr for many-to-one relations).
    """

    def __init__(self, alpha: float = 1.0, metric: str = "cosine", center: bool = True):
        self.alpha = alpha
        self.metric = metric
        self.center = center

    def _prepare(self, U_r: torch.Tensor) -> torch.Tensor:
        U_r = U_r.to(torch.float64)
        if self.center and U_r.shape[0] > 1:
            U_r = U_r - U_r.mean(0)
        if self.metric == "cosine":
            U_r = F.normalize(U_r, dim=1, eps=1e-12)
        return U_r

    def fit(self, H: Any, a: Any, U_r: Any) -> "RelationReadout":
        if self.metric not in _METRICS:
            raise ValueError(f"metric must be one of {_METRICS}, got {self.metric!r}")
        H = as_float(H, "H", 2)
        U_r = as_float(U_r, "U_r", 2)
        a = _check_labels(a, U_r.shape[0])
        check_rows("H", H, "a", a)
        keep = a >= 0
        if not bool(keep.any()):
            raise ValueError("a has no present facts (all -1)")
        H, a = H[keep], a[keep]
        self.U_ = self._prepare(U_r)
        self.M_, self.m_, self.alpha_ = fit_ridge(H.to(torch.float64), self.U_[a.to(self.U_.device)], self.alpha)
        counts = torch.bincount(a.cpu(), minlength=U_r.shape[0])
        self.majority_ = int(counts.argmax())
        self.chance_ = float(counts.max()) / float(counts.sum())
        self.n_attr_ = U_r.shape[0]
        self.dtype_ = H.dtype
        return self

    def _check_fitted(self):
        if not hasattr(self, "M_"):
            raise RuntimeError("RelationReadout is not fitted; call fit first")

    def scores(self, H: Any) -> torch.Tensor:
        """H [n, d] -> similarity to each attribute [n, n_attr] (higher = nearer)."""
        self._check_fitted()
        H = as_float(H, "H", 2)
        if H.shape[1] != self.M_.shape[1]:
            raise ValueError(f"H has {H.shape[1]} columns but the readout was fitted on {self.M_.shape[1]}")
        Z = H.to(self.M_.device, torch.float64) @ self.M_.T + self.m_
        if self.metric == "cosine":
            return F.normalize(Z, dim=1, eps=1e-12) @ self.U_.T
        if self.metric == "euclidean":
            return -torch.cdist(Z, self.U_)
        return Z @ self.U_.T

    def predict(self, H: Any) -> torch.Tensor:
        """H [n, d] -> LongTensor [n] attribute indices."""
        return self.scores(H).argmax(1)

    def hits(self, H: Any, a: Any) -> torch.Tensor:
        """BoolTensor [n_present]: prediction == a over rows with a >= 0."""
        self._check_fitted()
        H = as_float(H, "H", 2)
        a = _check_labels(a, self.n_attr_)
        check_rows("H", H, "a", a)
        keep = a >= 0
        return self.predict(H[keep]).cpu() == a[keep].cpu()

    def score(self, H: Any, a: Any) -> float:
        """Accuracy over rows with a present attribute (a >= 0)."""
        h = self.hits(H, a)
        return float(h.double().mean()) if h.numel() else float("nan")

    def chance_score(self, a: Any) -> float:
        """Accuracy on labels a of always answering the training majority attribute."""
        self._check_fitted()
        a = _check_labels(a, self.n_attr_)
        a = a[a >= 0]
        return float((a == self.majority_).double().mean()) if a.numel() else float("nan")


# ------------------------------------------------------------------------------------------------ superposition
class SuperpositionFit(BaseEstimator):
    """Fit h_s ~ c + sum_r W_r u_{a_r(s)} by ridge on the concatenated features [u_{a_1(s)}, ..., u_{a_R(s)}].

    fit(H [n, d], A [n, R], U list of R tensors [n_attr_r, d_u_r]) sets ``W_`` (list of [d, d_u_r]), ``c_`` [d],
    ``v_`` [R, d] (component used where a fact is missing), ``h_mean_`` [d] (training mean, the R^2 reference),
    ``U_`` (the attribute vectors), ``alpha_``.

    Missing facts (-1): zero features plus a per-relation missing indicator whose coefficient is v_r (a learned
    "missing" component). Relations without missing entries in the training table get no indicator and
    v_r = W_r mean_a(u_a) over present training rows (mean fill). alpha penalises all features equally (raw scale);
    the intercept is not penalised; a sequence of alphas is chosen from by exact leave-one-out error (before any
    rank truncation). rank: optional rank-k SVD truncation of each W_r after the ridge fit, after
    which c is refitted as mean(H - sum_r component_r) on the training rows.
    """

    def __init__(self, alpha: float = 1.0, rank: int | None = None):
        self.alpha = alpha
        self.rank = rank

    # -- fitting
    def _features(self, A: torch.Tensor, U: list[torch.Tensor], indicator: list[bool]) -> torch.Tensor:
        cols = []
        for r, U_r in enumerate(U):
            a = A[:, r].to(U_r.device)
            present = a >= 0
            f = torch.zeros(A.shape[0], U_r.shape[1], dtype=torch.float64, device=U_r.device)
            f[present] = U_r[a[present]].to(torch.float64)
            cols.append(f)
            if indicator[r]:
                cols.append((~present).to(torch.float64)[:, None])
        return torch.cat(cols, 1)

    def fit(self, H: Any, A: Any, U: Sequence[Any]) -> "SuperpositionFit":
        H = as_float(H, "H", 2)
        U = _check_attrs(U)
        A = _check_table(A, U)
        check_rows("H", H, "A", A)
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {self.rank}")
        indicator = [bool((A[:, r] < 0).any()) for r in range(A.shape[1])]
        if any(bool((A[:, r] < 0).all()) for r in range(A.shape[1])):
            raise ValueError("a relation has no present facts in A (column all -1)")
        X = self._features(A, U, indicator)
        Hd = H.to(torch.float64)
        B, c, self.alpha_ = fit_ridge(X, Hd, self.alpha)                    # B [d, p], c [d]
        W, v, j = [], [], 0
        for r, U_r in enumerate(U):
            W_r = truncate_rank(B[:, j:j + U_r.shape[1]], self.rank)
            j += U_r.shape[1]
            W.append(W_r)
            if indicator[r]:
                v.append(B[:, j])
                j += 1
            else:
                v.append(W_r @ U_r.to(torch.float64)[A[:, r]].mean(0))
        self.W_, self.v_, self.c_ = W, torch.stack(v), c
        self.U_ = [U_r.to(torch.float64) for U_r in U]
        self.dtype_ = H.dtype
        self.n_relations_ = len(U)
        if self.rank is not None:
            self.c_ = (Hd - (self.predict(A).to(torch.float64) - self.c_)).mean(0)
        self.h_mean_ = Hd.mean(0)
        return self

    # -- applying
    def _check_fitted(self):
        if not hasattr(self, "W_"):
            raise RuntimeError("SuperpositionFit is not fitted; call fit first")

    def _check_H(self, H: Any) -> torch.Tensor:
        H = as_float(H, "H", 2)
        if H.shape[1] != self.c_.shape[0]:
            raise ValueError(f"H has {H.shape[1]} columns but the fit has d = {self.c_.shape[0]}")
        return H

    def component(self, A: Any, r: int) -> torch.Tensor:
        """A [n, R] -> relation r's component [n, d]: W_r u_{a_r(s)} (v_r where the fact is missing)."""
        self._check_fitted()
        A = _check_table(A, self.U_, self.n_relations_)
        if not 0 <= r < self.n_relations_:
            raise ValueError(f"relation index {r} out of range [0, {self.n_relations_})")
        a = A[:, r].to(self.c_.device)
        present = a >= 0
        P = self.U_[r] @ self.W_[r].T                                       # [n_attr, d]
        out = self.v_[r].expand(A.shape[0], -1).clone()
        out[present] = P[a[present]]
        return out.to(self.dtype_)

    def predict(self, A: Any) -> torch.Tensor:
        """A [n, R] -> H_hat [n, d] = c + sum_r component_r."""
        self._check_fitted()
        A = _check_table(A, self.U_, self.n_relations_)
        out = self.c_.expand(A.shape[0], -1).clone()
        for r in range(self.n_relations_):
            out += self.component(A, r).to(torch.float64)
        return out.to(self.dtype_)

    def residual_parts(self, H: Any, A: Any) -> torch.Tensor:
        """Per-subject [n, 2]: (SSE_s, SST_s) = (||h - h_hat||^2, ||h - h_mean_train||^2); R^2 = 1 - sum/sum."""
        self._check_fitted()
        H = self._check_H(H).to(torch.float64)
        A = _check_table(A, self.U_, self.n_relations_)
        check_rows("H", H, "A", A)
        sse = ((H - self.predict(A).to(torch.float64)) ** 2).sum(1)
        sst = ((H - self.h_mean_) ** 2).sum(1)
        return torch.stack([sse, sst], 1)

    def score(self, H: Any, A: Any) -> float:
        """Held-out R^2 = 1 - SSE/SST over all dims, SST relative to the training mean."""
        return _pooled_r2(self.residual_parts(H, A))

    def swap_edit(self, H: Any, A: Any, r: int, new_attr: Any) -> torch.Tensor:
        """H' = H + W_r (u_new - u_old): replace relation r's component. new_attr: int or LongTensor [n]."""
        self._check_fitted()
        H = self._check_H(H)
        A = _check_table(A, self.U_, self.n_relations_)
        check_rows("H", H, "A", A)
        new = torch.as_tensor(new_attr, dtype=torch.long)
        if new.dim() > 1 or (new.dim() == 1 and new.shape[0] != A.shape[0]):
            raise ValueError(f"new_attr must be an int or [n={A.shape[0]}], got shape {tuple(new.shape)}")
        new = new.expand(A.shape[0]).clone()
        if bool((new < 0).any()) or int(new.max()) >= self.U_[r].shape[0]:
            raise ValueError(f"new_attr outside [0, {self.U_[r].shape[0] - 1}] for relation {r}")
        A_new = A.clone()
        A_new[:, r] = new.to(A.device)
        delta = self.component(A_new, r).to(torch.float64) - self.component(A, r).to(torch.float64)
        return (H.to(torch.float64) + delta.to(H.device)).to(H.dtype)

    def decode(self, H: Any, n_iter: int = 10, n_restarts: int = 8, seed: int = 0) -> torch.Tensor:
        """Recover every attribute from H [n, d] with the fitted W_r -> A_hat LongTensor [n, R].

        Coordinate descent on ||h - c - sum_r W_r u_{a_r}||^2: repeatedly set a_r to the attribute whose component
        W_r u_a is nearest to h - c - (other components) until no answer changes (each step lowers the objective).
        The first start puts every relation at its mean component; n_restarts - 1 more start from random answers
        (seeded), and each subject keeps its lowest-objective answer (coordinate descent can stop in a local
        minimum when sum_r d_u_r > d). Never answers "missing".
        """
        self._check_fitted()
        H = self._check_H(H).to(self.c_.device, torch.float64)
        P = [U_r @ W_r.T for U_r, W_r in zip(self.U_, self.W_)]            # [n_attr_r, d]
        g = torch.Generator().manual_seed(seed)
        best, best_obj = None, None
        for start in range(max(1, n_restarts)):
            if start == 0:
                A_hat = torch.full((H.shape[0], self.n_relations_), -1, dtype=torch.long, device=H.device)
                comps = [p.mean(0).expand(H.shape[0], -1).clone() for p in P]
            else:
                A_hat = torch.stack([torch.randint(0, p.shape[0], (H.shape[0],), generator=g) for p in P], 1)
                A_hat = A_hat.to(H.device)
                comps = [p[A_hat[:, r]] for r, p in enumerate(P)]
            A_hat, obj = self._descend(H, P, A_hat, comps, n_iter)
            if best is None:
                best, best_obj = A_hat, obj
            else:
                better = obj < best_obj
                best[better], best_obj = A_hat[better], torch.minimum(obj, best_obj)
        return best

    def _descend(self, H, P, A_hat, comps, n_iter):
        total = self.c_ + sum(comps)
        for _ in range(max(1, n_iter)):
            changed = False
            for r, p in enumerate(P):
                resid = H - (total - comps[r])                              # [n, d]
                a = (resid @ p.T - 0.5 * (p * p).sum(1)).argmax(1)
                changed |= not torch.equal(a, A_hat[:, r])
                A_hat[:, r] = a
                total = total - comps[r] + p[a]
                comps[r] = p[a]
            if not changed:
                break
        return A_hat, ((H - total) ** 2).sum(1)

    def decode_hits(self, H: Any, A: Any, n_iter: int = 10) -> torch.Tensor:
        """BoolTensor [n, R]: decode(H) == A (False where A is missing; mask with A >= 0)."""
        A = _check_table(A, self.U_, self.n_relations_)
        H = self._check_H(H)
        check_rows("H", H, "A", A)
        return (self.decode(H, n_iter).cpu() == A.cpu()) & (A.cpu() >= 0)

    def decode_accuracy(self, H: Any, A: Any, n_iter: int = 10) -> torch.Tensor:
        """Per-relation accuracy [R] of ``decode`` over present facts."""
        A = _check_table(A, self.U_, self.n_relations_)
        hits = self.decode_hits(H, A, n_iter).double()
        present = (A.cpu() >= 0).double()
        return hits.sum(0) / present.sum(0)


def _pooled_r2(parts) -> float:
    """1 - sum SSE / sum SST over subjects; parts [n, 2] (tensor or array)."""
    sst = float(parts[:, 1].sum())
    return 1.0 - float(parts[:, 0].sum()) / sst if sst > 0 else float("nan")


def _r2_diff(parts) -> float:
    return _pooled_r2(parts[:, :2]) - _pooled_r2(parts[:, 2:])


# -------------------------------------------------------------------------------------- measurement with controls
@dataclass
class SuperpositionReport:
    """Cross-fitted superposition readouts per condition ("real", "shuffled", supplied controls) and the margins
    real - control with paired bootstrap intervals over subjects; every number a :class:`llmprobe.metric.Metric`.

    ``conditions[name]``: {"r2": Metric, "readout_acc": {relation: Metric | None}, "decode_acc": {...} | None,
    "chance": {...}, "alpha_per_fold": [...]}; ``margins[control]``: {"r2": Metric, "readout_acc": {...},
    "decode_acc": {...} | None}."""
    conditions: dict = field(default_factory=dict)
    margins: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "conditions": _as_json(self.conditions), "margins": _as_json(self.margins)}

    def measure(self, key: str, relation: str | None = None, primary: str = "shuffled") -> Metric | None:
        """The real condition's ``key`` ("r2", "readout_acc", "decode_acc"; per ``relation`` for the last two)
        with every other condition attached as a named control (``primary`` shown beside it)."""
        def pick(condition):
            entry = self.conditions[condition].get(key)
            return entry.get(relation) if relation is not None and entry is not None else entry
        real = pick("real")
        if real is None:
            return None
        controls = {name: m for name in self.conditions if name != "real" for m in [pick(name)] if m is not None}
        return copy.copy(real).with_controls(controls, primary if primary in controls else None)


def _as_json(tree):
    if isinstance(tree, Metric):
        return tree.to_dict()
    if isinstance(tree, dict):
        return {k: _as_json(v) for k, v in tree.items()}
    return tree


def _jsonable(alpha):
    return float(alpha) if isinstance(alpha, (int, float)) else [float(a) for a in alpha]


def _cross_fit(H, A, U, splits, alpha, rank, readout_kw, do_decode):
    """Out-of-fold per-subject values: parts [n, 2], readout hits [n, R], decode hits [n, R], chance hits [n, R]
    (NaN where the fact is missing or the relation had no training facts in that fold), the fold of each subject
    [n], and the chosen alphas."""
    n, R = A.shape
    parts = torch.zeros(n, 2, dtype=torch.float64)
    fold = torch.zeros(n, dtype=torch.long)
    alphas = []
    nan = torch.full((n, R), float("nan"), dtype=torch.float64)
    readout, decoded, chance = nan.clone(), nan.clone(), nan.clone()
    for f, (train, test) in enumerate(splits):
        fit = SuperpositionFit(alpha=alpha, rank=rank).fit(H[train], A[train], U)
        parts[test] = fit.residual_parts(H[test], A[test]).cpu()
        fold[test] = f
        alphas.append(fit.alpha_)
        if do_decode:
            dec = fit.decode_hits(H[test], A[test]).double()
            decoded[test] = torch.where(A[test].cpu() >= 0, dec, torch.nan)
        for r in range(R):
            a_tr, a_te = A[train, r], A[test, r]
            if int((a_tr >= 0).sum()) < 3:                                  # too few facts to fit a readout
                continue
            ro = RelationReadout(**readout_kw).fit(H[train], a_tr, U[r])
            present = (a_te >= 0).cpu()
            rows = test[present]
            if rows.numel():
                readout[rows, r] = ro.predict(H[test][present.to(H.device)]).cpu().eq(a_te[present].cpu()).double()
                chance[rows, r] = a_te[present].cpu().eq(ro.majority_).double()
    return parts, readout, decoded, chance, fold, alphas


def _per_fold(values: torch.Tensor, fold: torch.Tensor, statistic) -> list[float]:
    """``statistic`` on each fold's subjects (the spread over the cross-fitting folds)."""
    return [float(statistic(values[fold == f])) for f in fold.unique().tolist()]


def _nanmean(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else float("nan")


def superposition_readout(H: Any, A: Any, U: Sequence[Any], *, controls: dict | None = None,
                          relation_names: Sequence[str] | None = None,
                          alpha: float | Sequence[float] = ALPHA_GRID,
                          rank: int | None = None, readout_alpha: float | Sequence[float] | None = None,
                          metric: str = "cosine",
                          k: int = 5, n_shuffles: int = 1, seed: int = 0, n_boot: int = 1000,
                          level: float = 0.95, decode: bool = True) -> SuperpositionReport:
    """Measure superposition readouts with their controls (``docs/measures.md``).

    H [n, d] relation-free subject states, A [n, R] fact table (-1 = missing), U list of R [n_attr_r, d_u_r].
    controls: {name: H_c} or {name: (H_c, U_c)}: states of the same subjects from a control model (e.g. the same
    architecture with random weights), measured identically (with U_c, else U). The shuffled-table control
    (``shuffle_table``, n_shuffles seeds, per-subject values averaged over seeds) is always included.

    k-fold cross-fitting over subjects gives every subject out-of-fold values; nothing is fitted on the rows it
    is scored on. Per condition: "r2" (pooled held-out R^2 of the superposition fit; percentile bootstrap over
    subjects), per relation "readout_acc" (RelationReadout), "decode_acc" (SuperpositionFit.decode), "chance"
    (training-majority answer): proportions with Wilson intervals, n = subjects with that fact. Spread: the
    statistic per cross-fitting fold. Margins: real minus each control, paired bootstrap over the same subjects.
    alpha / readout_alpha (default: alpha): ridge penalties, or sequences chosen from by leave-one-out error
    inside each training fold (default: the grid 1e-4 ... 1e5); the chosen superposition alphas per fold are
    reported as "alpha_per_fold".
    """
    H = as_float(H, "H", 2)
    U = _check_attrs(U)
    A = _check_table(A, U)
    check_rows("H", H, "A", A)
    n, R = A.shape
    names = list(relation_names) if relation_names is not None else [f"r{r}" for r in range(R)]
    if len(names) != R:
        raise ValueError(f"relation_names has {len(names)} names but A has {R} relations")
    readout_kw = {"alpha": alpha if readout_alpha is None else readout_alpha, "metric": metric}
    splits = kfold_indices(n, k, seed)

    conds: dict[str, tuple] = {}
    conds["real"] = _cross_fit(H, A, U, splits, alpha, rank, readout_kw, decode)
    shuf = [_cross_fit(H, shuffle_table(A, seed + 1 + i), U, splits, alpha, rank, readout_kw, decode)
            for i in range(n_shuffles)]
    conds["shuffled"] = tuple(torch.stack(x).mean(0) for x in list(zip(*shuf))[:4]) + tuple(shuf[0][4:])
    for name, ctrl in (controls or {}).items():
        H_c, U_c = (ctrl if isinstance(ctrl, (tuple, list)) else (ctrl, U))
        H_c = as_float(H_c, f"controls[{name!r}]", 2)
        check_rows("H", H, f"controls[{name!r}]", H_c)
        U_c = _check_attrs(U_c)
        _check_table(A, U_c)
        conds[name] = _cross_fit(H_c, A, U_c, splits, alpha, rank, readout_kw, decode)

    boot = dict(n_boot=n_boot, level=level, seed=seed)

    def per_relation(x: torch.Tensor, fold: torch.Tensor) -> dict:
        out = {}
        for r, nm in enumerate(names):
            col = x[:, r]
            keep = ~torch.isnan(col)
            out[nm] = proportion(col[keep].tolist(), refits=_per_fold(col, fold, _nanmean), level=level) \
                if bool(keep.any()) else None
        return out

    def margin(a: torch.Tensor, b: torch.Tensor) -> dict:
        return {nm: paired_difference(a[:, r].tolist(), b[:, r].tolist(), **boot)
                if bool((~torch.isnan(a[:, r] - b[:, r])).any()) else None for r, nm in enumerate(names)}

    report = SuperpositionReport(settings={"n_subjects": n, "n_relations": R, "relations": names, "k": k,
                                           "alpha": _jsonable(alpha), "rank": rank,
                                           "readout": {**readout_kw, "alpha": _jsonable(readout_kw["alpha"])},
                                           "n_shuffles": n_shuffles, "seed": seed, "n_boot": n_boot,
                                           "level": level})
    for name, (parts, readout, decoded, chance, fold, alphas) in conds.items():
        report.conditions[name] = {
            "alpha_per_fold": alphas,
            "r2": bootstrap(parts.numpy(), _pooled_r2, bounds=(-math.inf, 1.0),
                            refits=_per_fold(parts, fold, _pooled_r2), **boot),
            "readout_acc": per_relation(readout, fold),
            "decode_acc": per_relation(decoded, fold) if decode else None,
            "chance": per_relation(chance, fold),
        }
    real = conds["real"]
    for name, other in conds.items():
        if name == "real":
            continue
        report.margins[name] = {
            "r2": bootstrap(torch.cat([real[0], other[0]], 1).numpy(), _r2_diff, **boot),
            "readout_acc": margin(real[1], other[1]),
            "decode_acc": margin(real[2], other[2]) if decode else None,
        }
    return report
