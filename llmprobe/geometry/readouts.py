"""Superposition readouts from relation-free subject states.

Inputs are plain tensors: H [n_subjects, d] subject states; a fact table A LongTensor [n_subjects, n_relations] of
attribute indices (-1 = missing); attribute vectors U = list over relations of [n_attr_r, d_u_r] tensors (e.g.
unembedding rows of each attribute's first token, or a synthetic model's attribute embeddings). The same code
measures pretrained and synthetic models.

* ``RelationReadout``: per-relation linear map h -> u-space, answer = nearest of that relation's attributes.
* ``SuperpositionFit``: h_s ~ c + sum_r W_r u_{a_r(s)}; held-out R^2, components, swap edits, and ``decode``
  (recover every attribute from h using the fitted W_r).
* ``superposition_readout``: both of the above cross-fitted over subjects, beside the shuffled-table control, the
  ``random_attributes`` control (random vectors of the true norms) and any supplied control states (e.g. a
  random-init model of the same architecture), with grouped-jackknife intervals that redo every fit.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
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
from llmprobe.metric import Metric, bootstrap, jackknife, paired_difference, proportion

__all__ = ["RelationReadout", "SuperpositionFit", "superposition_readout", "SuperpositionReport", "random_attributes",
           "merge_equal_attributes", "decode_components", "relation_contributions"]

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
        return decode_components(H, P, self.c_, n_iter, n_restarts, seed)

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


def decode_components(H: torch.Tensor, P: list[torch.Tensor], c: torch.Tensor, n_iter: int = 10,
                      n_restarts: int = 8, seed: int = 0) -> torch.Tensor:
    """``SuperpositionFit.decode`` given the components: H [n, d] (float64), P list of R [n_attr_r, d] (row a =
    W_r u_a), c [d] -> A_hat LongTensor [n, R] (the lowest objective over the starts)."""
    g = torch.Generator().manual_seed(seed)
    best, best_obj = None, None
    for start in range(max(1, n_restarts)):
        if start == 0:
            A_hat = torch.full((H.shape[0], len(P)), -1, dtype=torch.long, device=H.device)
            comps = [p.mean(0).expand(H.shape[0], -1).clone() for p in P]
        else:
            A_hat = torch.stack([torch.randint(0, p.shape[0], (H.shape[0],), generator=g) for p in P], 1)
            A_hat = A_hat.to(H.device)
            comps = [p[A_hat[:, r]] for r, p in enumerate(P)]
        A_hat, obj = _descend(H, P, c, A_hat, comps, n_iter)
        if best is None:
            best, best_obj = A_hat, obj
        else:
            better = obj < best_obj
            best[better], best_obj = A_hat[better], torch.minimum(obj, best_obj)
    return best


def _descend(H, P, c, A_hat, comps, n_iter):
    total = c + sum(comps)
    for _ in range(max(1, n_iter)):
        changed = False
        for r, p in enumerate(P):
            resid = H - (total - comps[r])                                  # [n, d]
            a = (resid @ p.T - 0.5 * (p * p).sum(1)).argmax(1)
            changed |= not torch.equal(a, A_hat[:, r])
            A_hat[:, r] = a
            total = total - comps[r] + p[a]
            comps[r] = p[a]
        if not changed:
            break
    return A_hat, ((H - total) ** 2).sum(1)



def _pooled_r2(parts) -> float:
    """1 - sum SSE / sum SST over subjects; parts [n, 2] (tensor or array; rows with NaN, left out, are dropped)."""
    x = np.asarray(parts, dtype=np.float64)
    x = x[~np.isnan(x).any(1)]
    sst = float(x[:, 1].sum())
    return 1.0 - float(x[:, 0].sum()) / sst if sst > 0 else float("nan")


def _r2_diff(parts) -> float:
    return _pooled_r2(parts[:, :2]) - _pooled_r2(parts[:, 2:])


# ------------------------------------------------------------------------------------- controls of the vectors
def random_attributes(U: Sequence[Any], seed: int = 0) -> list[torch.Tensor]:
    """The ``random_attributes`` control: per relation, Gaussian directions (seeded) with the norms of U's rows,
    [n_attr_r, d_u_r] each. W_r is a free map, so a fit on these keeps only which subjects share an attribute (an
    additive one-hot model where n_attr_r <= d_u_r): what the true vectors add is the gain over this control."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for U_r in _check_attrs(U):
        direction = F.normalize(torch.randn(U_r.shape, generator=g, dtype=torch.float64), dim=1)
        out.append((direction * U_r.to(torch.float64).norm(dim=1, keepdim=True)).to(U_r.dtype))
    return out


def merge_equal_attributes(A: Any, U: Sequence[Any]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Attributes of a relation with equal vectors become one answer (no readout of u can tell them apart, e.g.
    attributes sharing the first token whose unembedding row is u): A [n, R] remapped to the merged attributes
    (numbered in order of first occurrence), U to their vectors, and per relation the map [n_attr_r] from each
    original attribute to its merged one (the identity where nothing merges)."""
    U = _check_attrs(U)
    A = _check_table(A, U).clone()
    merged_U, maps = [], []
    for r, U_r in enumerate(U):
        row_id = torch.unique(U_r.cpu(), dim=0, return_inverse=True)[1].tolist()   # equal rows, equal ids
        order: dict[int, int] = {}
        new = torch.tensor([order.setdefault(u, len(order)) for u in row_id], dtype=torch.long)
        keep = torch.tensor([row_id.index(u) for u in order], dtype=torch.long)     # first of each group
        merged_U.append(U_r[keep.to(U_r.device)])
        maps.append(new)
        present = A[:, r] >= 0
        A[present, r] = new.to(A.device)[A[present, r]]
    return A, merged_U, maps


def _merge_like(U_c: list[torch.Tensor], maps: list[torch.Tensor]) -> list[torch.Tensor]:
    """A control's vectors merged as the real ones were: the mean over each merged group."""
    out = []
    for U_r, new in zip(U_c, maps):
        m = int(new.max()) + 1
        summed = torch.zeros(m, U_r.shape[1], dtype=torch.float64).index_add_(0, new, U_r.cpu().to(torch.float64))
        out.append((summed / torch.bincount(new, minlength=m)[:, None]).to(U_r.device, U_r.dtype))
    return out


# ----------------------------------------------------------------------------------- refits in the dual form
def _centred(K: torch.Tensor, train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Kernel K [n, n] = X X^T -> the (train x train, test x train) kernels of X centred on the train rows' mean and
    the test rows' squared norms after that centring [n_test]."""
    Ktt, Ket = K[train][:, train], K[test][:, train]
    col, row = Ktt.mean(0), Ket.mean(1)
    mm = col.mean()
    return (Ktt - col[:, None] - col[None, :] + mm, Ket - row[:, None] - col[None, :] + mm,
            K[test, test] - 2 * row + mm)


def _smoother(Ktt: torch.Tensor, Ket: torch.Tensor, alpha: float) -> torch.Tensor:
    """S [n_test, n_train] = Ket (Ktt + alpha I)^-1: dual ridge predictions are mean + S (Y_train - mean) (the
    pseudo-inverse at alpha = 0, as ``ridge_fit``)."""
    if alpha == 0:
        return Ket @ torch.linalg.pinv(Ktt)
    G = Ktt.clone()
    G.diagonal().add_(alpha)
    L, info = torch.linalg.cholesky_ex(G)
    if int(info):                                                         # not numerically positive definite
        return torch.linalg.solve(G, Ket.T).T
    return torch.cholesky_solve(Ket.T, L).T


class _DualFits:
    """One condition's subjects in dual form, to redo every fit of the cross-fitting on any subset of subjects at
    given alphas with n x n systems (the estimators solve d x d ones): what the jackknife refits use. Equal to
    ``SuperpositionFit`` / ``RelationReadout`` at the same alphas (tests). rank truncation has no dual form."""

    def __init__(self, H: torch.Tensor, A: torch.Tensor, U: list[torch.Tensor], readout_kw: dict):
        H = H.to("cpu", torch.float64)
        self.H = H - H.mean(0)                                             # [n, d]; fits centre per train set
        self.KH = self.H @ self.H.T                                        # [n, n]
        self.A, self.present = A.cpu(), A.cpu() >= 0
        self.metric = readout_kw.get("metric", "cosine")
        prepare = RelationReadout(**readout_kw)._prepare
        self.U = [U_r.to("cpu", torch.float64) for U_r in U]
        targets = [prepare(U_r) for U_r in self.U]                         # readout targets [n_attr_r, d_u_r]
        self.KT = [T @ T.T for T in targets]                               # their Gram [n_attr_r, n_attr_r]
        self.complete = [bool(self.present[:, r].all()) for r in range(A.shape[1])]
        self.KX = {}                       # superposition features' kernel [n, n]: relations with missing facts
        self.KX_complete = torch.zeros_like(self.KH)                      # ... and the sum over the others
        for r, U_r in enumerate(self.U):
            a, p = self.A[:, r].clamp_min(0), self.present[:, r].to(torch.float64)
            K = (U_r @ U_r.T)[a][:, a] * (p[:, None] * p[None, :])
            if self.complete[r]:
                self.KX_complete += K
            else:
                self.KX[r] = K

    def cross_fit(self, rows: torch.Tensor, fold: torch.Tensor, alphas: list, readout_alphas: list,
                  decode: bool) -> torch.Tensor:
        """Out-of-fold values [len(rows), 2 + 3R] (as ``_cross_fit``) of the subjects ``rows`` with fold labels
        ``fold``, fold f fitted at alphas[f] and readout_alphas[f][r] (None: no readout)."""
        R = self.A.shape[1]
        out = torch.full((len(rows), 2 + 3 * R), float("nan"), dtype=torch.float64)
        for f in fold.unique().tolist():
            at = fold == f
            out[at] = self._fold(rows[~at], rows[at], alphas[f], readout_alphas[f], decode)
        return out

    def _fold(self, train, test, alpha, readout_alphas, decode):
        """One fold's values [n_test, 2 + 3R]. Everything in n x n and attribute space: the superposition fit's
        SSE from the centred kernel of H, a readout's scores from the Gram of its targets."""
        R = self.A.shape[1]
        Ktt, Ket, _ = _centred(self.KX_complete, train, test)
        indicator = [not bool(self.present[train, r].all()) for r in range(R)]
        for r, K in self.KX.items():
            kt, ke, _ = _centred(K, train, test)
            if indicator[r]:                                # the missing indicator (kernel of 1 - present)
                missing = (~self.present[:, r]).to(torch.float64)
                it, ie, _ = _centred(missing[:, None] * missing[None, :], train, test)
                kt, ke = kt + it, ke + ie
            else:                                           # no indicator: a missing test fact gets the train mean
                ke = ke * self.present[test, r].to(torch.float64)[:, None]
            Ktt, Ket = Ktt + kt, Ket + ke
        S = _smoother(Ktt, Ket, alpha)                                     # [n_test, m]
        Htt, Het, sst = _centred(self.KH, train, test)
        out = torch.full((len(test), 2 + 3 * R), float("nan"), dtype=torch.float64)
        out[:, 0] = sst - 2 * (S * Het).sum(1) + ((S @ Htt) * S).sum(1)  # ||h - mean - S (H_train - mean)||^2
        out[:, 1] = sst
        if decode:
            mean = self.H[train].mean(0)
            beta = _smoother(Ktt, torch.eye(len(train), dtype=torch.float64), alpha) @ (self.H[train] - mean)
            out[:, 2 + R:2 + 2 * R] = self._decode(train, test, beta, mean, indicator)
        for r in range(R):
            keep_train, keep = self.present[train, r], self.present[test, r]
            if readout_alphas[r] is None or int(keep_train.sum()) < 3 or not bool(keep.any()):
                continue
            if bool(keep_train.all()) and bool(keep.all()):
                kt, ke = Htt, Het
            else:
                kt, ke, _ = _centred(self.KH, train[keep_train], test[keep])
            a_tr, a_te = self.A[train[keep_train], r], self.A[test[keep], r]
            n_attr = self.KT[r].shape[0]
            S_r = _smoother(kt, ke, readout_alphas[r])                     # [n_te, m_r]
            freq = torch.bincount(a_tr, minlength=n_attr).to(torch.float64) / len(a_tr)
            # Z = sum_a M[., a] t_a: prediction in target space as weights over the targets t_a
            M = freq + torch.zeros(len(a_te), n_attr, dtype=torch.float64).index_add_(1, a_tr, S_r) \
                - S_r.sum(1, keepdim=True) * freq
            dots = M @ self.KT[r]                                          # Z . t_a  [n_te, n_attr]
            sq = (dots * M).sum(1, keepdim=True)                           # ||Z||^2
            if self.metric == "cosine":
                scores = dots / sq.clamp_min(0).sqrt().clamp_min(1e-12)
            elif self.metric == "euclidean":
                scores = 2 * dots - self.KT[r].diagonal()                  # -||Z - t_a||^2 + ||Z||^2
            else:
                scores = dots
            out[keep, 2 + r] = (scores.argmax(1) == a_te).to(torch.float64)
            out[keep, 2 + 2 * R + r] = (a_te == freq.argmax()).to(torch.float64)
        return out

    def _decode(self, train, test, beta, mean, indicator):
        """``SuperpositionFit.decode_hits`` from the dual coefficients: P_r = U_r Xc_r^T beta, c = intercept."""
        P, shift = [], torch.zeros(len(train), dtype=torch.float64)
        for r, U_r in enumerate(self.U):
            p = self.present[train, r].to(torch.float64)
            X = U_r[self.A[train, r].clamp_min(0)] * p[:, None]             # train features [m, d_u]
            x_mean = X.mean(0)
            P.append((U_r @ (X - x_mean).T) @ beta)                         # [n_attr_r, d]
            shift += (X - x_mean) @ x_mean
            if indicator[r]:
                shift += (1.0 - p - (1.0 - p).mean()) * (1.0 - p).mean()
        c = mean - beta.T @ shift
        hits = (decode_components(self.H[test], P, c) == self.A[test]).to(torch.float64)
        return torch.where(self.present[test], hits, torch.nan)


# -------------------------------------------------------------------------------------- measurement with controls
@dataclass
class SuperpositionReport:
    """Cross-fitted superposition readouts per condition ("real", "shuffled", "random_attributes", supplied
    controls) and the margins real - control over the same subjects; every number a
    :class:`llmprobe.metric.Metric`.

    ``conditions[name]``: {"r2": Metric, "readout_acc": {relation: Metric | None}, "decode_acc": {...} | None,
    "chance": {...}, "alpha_per_fold": [...]}; ``margins[control]``: {"r2": Metric, "readout_acc": {...},
    "decode_acc": {...} | None}. The reported effect of the attribute vectors is :meth:`gain`."""
    conditions: dict = field(default_factory=dict)
    margins: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "conditions": _as_json(self.conditions), "margins": _as_json(self.margins)}

    def measure(self, key: str, relation: str | None = None, primary: str = "shuffled") -> Metric | None:
        """The real condition's ``key`` ("r2", "readout_acc", "decode_acc"; per ``relation`` for the last two)
        with every other condition attached as a named null (``primary`` shown beside it); a readout also
        gets its chance rate (the training fold's majority answer) as the null ``chance``."""
        def pick(condition, name=key):
            entry = self.conditions[condition].get(name)
            return entry.get(relation) if relation is not None and entry is not None else entry
        real = pick("real")
        if real is None:
            return None
        nulls = {name: m for name in self.conditions if name != "real" for m in [pick(name)] if m is not None}
        if key == "readout_acc" and pick("real", "chance") is not None:
            nulls["chance"] = pick("real", "chance")
        return copy.copy(real).with_nulls(nulls, primary if primary in nulls else None)

    def gain(self, key: str = "r2", relation: str | None = None) -> Metric | None:
        """real - random_attributes (``key`` as in :meth:`measure`): what the attribute vectors explain beyond
        which subjects share an attribute, with the paired interval over the same subjects."""
        entry = self.margins.get("random_attributes", {}).get(key)
        return entry.get(relation) if relation is not None and entry is not None else entry


def _as_json(tree):
    if isinstance(tree, Metric):
        return tree.to_dict()
    if isinstance(tree, dict):
        return {k: _as_json(v) for k, v in tree.items()}
    return tree


def _jsonable(alpha):
    return float(alpha) if isinstance(alpha, (int, float)) else [float(a) for a in alpha]


def _cross_fit(H, A, U, splits, alpha, rank, readout_kw, do_decode):
    """Out-of-fold per-subject values [n, 2 + 3R]: parts (SSE, SST), readout hits [R], decode hits [R], chance hits
    [R] (NaN where the fact is missing or the relation had no training facts in that fold), and per fold the
    chosen superposition alpha and readout alphas (None: no readout; ``readout_kw`` None: no readout at all)."""
    n, R = A.shape
    out = torch.full((n, 2 + 3 * R), float("nan"), dtype=torch.float64)
    alphas, readout_alphas = [], []
    for train, test in splits:
        fit = SuperpositionFit(alpha=alpha, rank=rank).fit(H[train], A[train], U)
        out[test, :2] = fit.residual_parts(H[test], A[test]).cpu()
        alphas.append(fit.alpha_)
        if do_decode:
            dec = fit.decode_hits(H[test], A[test]).double()
            out[test, 2 + R:2 + 2 * R] = torch.where(A[test].cpu() >= 0, dec, torch.nan)
        chosen = []
        for r in range(R):
            a_tr, a_te = A[train, r], A[test, r]
            if readout_kw is None or int((a_tr >= 0).sum()) < 3:             # no readout, or too few facts
                chosen.append(None)
                continue
            ro = RelationReadout(**readout_kw).fit(H[train], a_tr, U[r])
            chosen.append(ro.alpha_)
            present = (a_te >= 0).cpu()
            rows = test[present]
            if rows.numel():
                out[rows, 2 + r] = ro.predict(H[test][present.to(H.device)]).cpu().eq(a_te[present].cpu()).double()
                out[rows, 2 + 2 * R + r] = a_te[present].cpu().eq(ro.majority_).double()
        readout_alphas.append(chosen)
    return out, alphas, readout_alphas


def _measure(H, A, U, splits, fold, groups, alpha, rank, readout_kw, decode):
    """One draw of one condition: out-of-fold values [n, 2 + 3R], and per jackknife group [G, n, 2 + 3R] the same
    with the group's subjects left out (NaN rows) and every fit redone at the fold's chosen alphas."""
    values, alphas, readout_alphas = _cross_fit(H, A, U, splits, alpha, rank, readout_kw, decode)
    if groups is None:
        return values, None, alphas
    dual = _DualFits(H, A, U, readout_kw or {})
    reps = torch.full((int(groups.max()) + 1, *values.shape), float("nan"), dtype=torch.float64)
    for g in range(reps.shape[0]):
        rows = torch.nonzero(groups != g).flatten()
        reps[g, rows] = dual.cross_fit(rows, fold[rows], alphas, readout_alphas, decode)
    return values, reps, alphas


def _per_fold(values: torch.Tensor, fold: torch.Tensor, statistic) -> list[float]:
    """``statistic`` on each fold's subjects (the spread over the cross-fitting folds)."""
    return [float(statistic(values[fold == f])) for f in fold.unique().tolist()]


def _nanmean(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else float("nan")


JACKKNIFE_GROUPS = 20       # refits per condition: coverage >= 0.93 at n = 193 (benchmarks/coverage.py), 10 is not


def superposition_readout(H: Any, A: Any, U: Sequence[Any], *, nulls: dict | None = None,
                          relation_names: Sequence[str] | None = None,
                          alpha: float | Sequence[float] = ALPHA_GRID,
                          rank: int | None = None, readout_alpha: float | Sequence[float] | None = None,
                          metric: str = "cosine",
                          k: int = 5, n_shuffles: int = 1, seed: int = 0, n_boot: int = 1000,
                          level: float = 0.95, decode: bool = True, n_random: int = 1,
                          jackknife_groups: int = JACKKNIFE_GROUPS, readouts: bool = True) -> SuperpositionReport:
    """Measure superposition readouts with their nulls (``docs/measures.md``).

    H [n, d] relation-free subject states, A [n, R] fact table (-1 = missing), U list of R [n_attr_r, d_u_r].
    Attributes of a relation with equal vectors are merged into one answer first (``merge_equal_attributes``;
    listed in ``settings["merged_attributes"]``). nulls: {name: H_c} or {name: (H_c, U_c)}: states of the same
    subjects from a null model (e.g. the same architecture with random weights), measured identically (with
    U_c, merged as U, else U). Always included: the shuffled table (``shuffle_table``, n_shuffles seeds; 0 =
    none) and ``random_attributes`` (n_random draws of :func:`random_attributes`; 0 = none); per-subject values are
    averaged over the draws.

    k-fold cross-fitting over subjects gives every subject out-of-fold values; nothing is fitted on the rows it
    is scored on. Per condition: "r2" (pooled held-out R^2 of the superposition fit), per relation "readout_acc"
    (RelationReadout), "decode_acc" (SuperpositionFit.decode), "chance" (training-majority answer); n = subjects
    (with that fact). Margins: real minus each control over the same subjects. Intervals: the grouped jackknife
    with refits (``llmprobe.metric.jackknife``): subjects cut into ``jackknife_groups`` groups, the whole
    cross-fitting redone without each group (at each fold's chosen alphas; proportions get Wilson at the
    effective n); jackknife_groups = 0: the percentile bootstrap of out-of-fold values (``n_boot``) and Wilson
    intervals, which hold the fits fixed and under-cover (``benchmarks/coverage.py``). Spread: the statistic per
    cross-fitting fold. alpha / readout_alpha (default: alpha): ridge penalties, or sequences chosen from by
    leave-one-out error inside each training fold (default: the grid 1e-4 ... 1e5); the chosen superposition
    alphas per fold are reported as "alpha_per_fold". readouts=False: the R^2 alone (every readout and chance
    rate None), about half the time.
    """
    H, A, U, names = _checked_inputs(H, A, U, relation_names, jackknife_groups, rank)
    n, R = A.shape
    A, U, maps = merge_equal_attributes(A, U)
    merged = _merged_attributes(names, maps)
    readout_kw = {"alpha": alpha if readout_alpha is None else readout_alpha, "metric": metric}
    splits = kfold_indices(n, k, seed)
    fold = _fold_labels(splits, n)
    groups = _jackknife_groups(n, jackknife_groups, seed) if jackknife_groups else None
    draws = _draws(H, A, U, maps, nulls, n_shuffles, n_random, seed)
    conds = {name: _condition(items, splits, fold, groups, alpha, rank, readout_kw if readouts else None, decode)
             for name, items in draws.items()}

    report = SuperpositionReport(settings={
        "n_subjects": n, "n_relations": R, "relations": names, "k": k, "alpha": _jsonable(alpha), "rank": rank,
        "readout": {**readout_kw, "alpha": _jsonable(readout_kw["alpha"])}, "n_shuffles": n_shuffles,
        "n_random": n_random, "seed": seed, "level": level, "jackknife_groups": jackknife_groups,
        "n_boot": None if jackknife_groups else n_boot, "merged_attributes": merged})
    stats = _Intervals(names, fold, level, dict(n_boot=n_boot, level=level, seed=seed), R)
    for name, (values, reps, alphas) in conds.items():
        report.conditions[name] = stats.condition(values, reps, alphas, decode)
    real, real_reps, _ = conds["real"]
    for name, (other, other_reps, _) in conds.items():
        if name != "real":
            report.margins[name] = stats.margins(real, real_reps, other, other_reps, n, decode)
    return report


def _checked_inputs(H: Any, A: Any, U: Sequence[Any], relation_names, jackknife_groups: int, rank) -> tuple:
    """(H [n, d] float, A [n, R], U, relation names) of a superposition fit, each checked (ValueError naming the
    argument), and the jackknife setting checked against ``rank``."""
    H = as_float(H, "H", 2)
    U = _check_attrs(U)
    A = _check_table(A, U)
    check_rows("H", H, "A", A)
    names = _relation_names(relation_names, A.shape[1])
    _check_jackknife(jackknife_groups, rank)
    return H, A, U, names


def relation_contributions(H: Any, A: Any, U: Sequence[Any], alphas: dict[str, list], *, k: int = 5, seed: int = 0,
                           jackknife_groups: int = JACKKNIFE_GROUPS, level: float = 0.95,
                           relation_names: Sequence[str] | None = None) -> dict[str, dict]:
    """What each relation's term adds to the R^2 gain over random_attributes of :func:`superposition_readout`
    (same H [n, d], A [n, R], U, k, seed, jackknife groups; ``alphas``: the alpha its "real" and
    "random_attributes" conditions chose per fold, ``alpha_per_fold``). Per relation r: ``gain_without``, the
    gain of the fit without r's term, refitted at those alphas (no new alpha search; dual n x n systems, as the
    jackknife refits), and ``contribution`` = the gain with every term - ``gain_without``, both recomputed the
    same way; each with its jackknife interval over the same groups (the same folds and groups pair them).
    ~0.2 s a relation at n = 193."""
    H, A, U, names = _checked_inputs(H, A, U, relation_names, jackknife_groups, None)
    n, R = A.shape
    A, U, _ = merge_equal_attributes(A, U)
    fold = _fold_labels(kfold_indices(n, k, seed), n)
    groups = _jackknife_groups(n, jackknife_groups, seed) if jackknife_groups else None
    vectors = {"real": U, "random_attributes": random_attributes(U, seed + 1000)}   # as superposition_readout's

    def gain(columns: list[int]) -> tuple[float, list[float]]:
        """The gain (real - random_attributes) of the fit on ``columns`` and its jackknife replicates."""
        r2 = {}
        for name, U_c in vectors.items():
            dual = _DualFits(H, A[:, columns], [U_c[q] for q in columns], {})
            parts = [torch.arange(n)] + ([torch.nonzero(groups != g).flatten() for g in range(int(groups.max()) + 1)]
                                         if groups is not None else [])
            no_readout = [[None] * len(columns)] * len(alphas[name])
            r2[name] = [_pooled_r2(dual.cross_fit(rows, fold[rows], alphas[name], no_readout, False)[:, :2])
                        for rows in parts]
        diff = [a - b for a, b in zip(r2["real"], r2["random_attributes"])]
        return diff[0], diff[1:]

    def metric(value: float, reps: list[float]) -> dict:
        if not reps:
            return Metric(value, (float("nan"), float("nan")), n, "none").to_dict()
        return jackknife(value, reps, n, level=level).to_dict()

    every, every_reps = gain(list(range(R)))
    out = {}
    for r, name in enumerate(names if R > 1 else []):
        without, reps = gain([q for q in range(R) if q != r])
        out[name] = {"gain_without": metric(without, reps),
                     "contribution": metric(every - without, [a - b for a, b in zip(every_reps, reps)])}
    return out


def _relation_names(relation_names: Sequence[str] | None, R: int) -> list[str]:
    """The R relations' names (default r0, r1, ...); ValueError when their count is not R."""
    names = list(relation_names) if relation_names is not None else [f"r{r}" for r in range(R)]
    if len(names) != R:
        raise ValueError(f"relation_names has {len(names)} names but A has {R} relations")
    return names


def _check_jackknife(jackknife_groups: int, rank: int | None) -> None:
    """ValueError unless ``jackknife_groups`` is 0 or >= 2, and 0 with a rank truncation (no refit for it)."""
    if jackknife_groups and rank is not None:
        raise ValueError("rank truncation has no refit (jackknife) interval; pass jackknife_groups=0")
    if jackknife_groups < 0 or jackknife_groups == 1:
        raise ValueError(f"jackknife_groups must be 0 (no refits) or >= 2, got {jackknife_groups}")


def _merged_attributes(names: list[str], maps: list[torch.Tensor]) -> dict:
    """{relation: [[old attribute indices merged into one answer], ...]} for the relations with a merge, from
    ``maps`` (per relation: old index [n_attr_r] -> new index)."""
    merged = {nm: [torch.nonzero(new == j).flatten().tolist() for j in range(int(new.max()) + 1)
                   if int((new == j).sum()) > 1] for nm, new in zip(names, maps)}
    return {nm: groups_ for nm, groups_ in merged.items() if groups_}


def _fold_labels(splits: list, n: int) -> torch.Tensor:
    """The cross-fitting fold of each subject: LongTensor [n], fold f = the test set of ``splits[f]``."""
    fold = torch.zeros(n, dtype=torch.long)
    for f, (_, test) in enumerate(splits):
        fold[test] = f
    return fold


def _jackknife_groups(n: int, jackknife_groups: int, seed: int) -> torch.Tensor:
    """The jackknife group of each subject: LongTensor [n] in 0 .. min(jackknife_groups, n) - 1, a seeded random
    cut of the subjects into groups of (near) equal size."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7))
    groups = torch.empty(n, dtype=torch.long)
    groups[perm] = torch.arange(n) % min(jackknife_groups, n)
    return groups


def _draws(H: torch.Tensor, A: torch.Tensor, U: list[torch.Tensor], maps: list[torch.Tensor],
           nulls: dict | None, n_shuffles: int, n_random: int, seed: int) -> dict[str, list]:
    """{condition: [(H [n, d], A [n, R], U [R x [n_attr_r, d_u_r]]) per draw]}: the real data, the shuffled
    tables, the random attribute vectors (``n_random`` > 0) and each supplied null model (its states checked, its
    U_c merged as U was by ``maps``)."""
    draws: dict[str, list] = {"real": [(H, A, U)]}
    if n_shuffles:
        draws["shuffled"] = [(H, shuffle_table(A, seed + 1 + i), U) for i in range(n_shuffles)]
    if n_random:
        draws["random_attributes"] = [(H, A, random_attributes(U, seed + 1000 + i)) for i in range(n_random)]
    for name, ctrl in (nulls or {}).items():
        H_c, U_c = (ctrl if isinstance(ctrl, (tuple, list)) else (ctrl, None))
        H_c = as_float(H_c, f"nulls[{name!r}]", 2)
        check_rows("H", H, f"nulls[{name!r}]", H_c)
        if U_c is None:
            U_c = U
        else:
            U_c = _check_attrs(U_c)
            if [U_r.shape[0] for U_r in U_c] != [new.numel() for new in maps]:
                raise ValueError(f"nulls[{name!r}]: U_c must have U's relations and attribute counts")
            U_c = _merge_like(U_c, maps)
        draws[name] = [(H_c, A, U_c)]
    return draws


def _condition(items: list, splits, fold, groups, alpha, rank, readout_kw, decode) -> tuple:
    """One condition measured on each of its draws ``items`` (``_measure``): (values [n, 2 + 3R] and reps
    [G, n, 2 + 3R] (None without groups) averaged over the draws, the first draw's alphas per fold)."""
    measured = [_measure(H_d, A_d, U_d, splits, fold, groups, alpha, rank, readout_kw, decode)
                for H_d, A_d, U_d in items]
    values = torch.stack([m[0] for m in measured]).mean(0)
    reps = torch.stack([m[1] for m in measured]).mean(0) if groups is not None else None
    return values, reps, measured[0][2]


@dataclass(frozen=True)
class _Intervals:
    """The metrics of one report from out-of-fold values [n, 2 + 3R] (columns: SSE, SST, readout hits [R], decode
    hits [R], chance hits [R]) and their jackknife replicates reps [G, n, 2 + 3R] (None: bootstrap and Wilson).
    ``names`` [R] relations, ``fold`` [n] each subject's cross-fitting fold, ``boot`` the bootstrap's keywords."""
    names: list
    fold: torch.Tensor
    level: float
    boot: dict
    R: int

    def column(self, key: str) -> int:
        """First column of ``key`` ("readout_acc", "decode_acc", "chance") in the values [n, 2 + 3R]."""
        return {"readout_acc": 2, "decode_acc": 2 + self.R, "chance": 2 + 2 * self.R}[key]

    def condition(self, values, reps, alphas, decode: bool) -> dict:
        """One condition's entry of ``SuperpositionReport.conditions``."""
        return {
            "alpha_per_fold": alphas,
            "r2": self.r2(values, reps),
            "readout_acc": self.per_relation(values, reps, self.column("readout_acc")),
            "decode_acc": self.per_relation(values, reps, self.column("decode_acc")) if decode else None,
            "chance": self.per_relation(values, reps, self.column("chance")),
        }

    def margins(self, real, real_reps, other, other_reps, n: int, decode: bool) -> dict:
        """real - ``other`` over the same subjects: one entry of ``SuperpositionReport.margins``."""
        decode_acc = self.column("decode_acc")
        return {
            "r2": self.r2_margin(real, real_reps, other, other_reps, n),
            "readout_acc": self.margin(real, real_reps, other, other_reps, self.column("readout_acc")),
            "decode_acc": self.margin(real, real_reps, other, other_reps, decode_acc) if decode else None,
        }

    def r2(self, values, reps) -> Metric:
        """The pooled held-out R^2 of the parts values[:, :2], spread over the folds."""
        refits = _per_fold(values[:, :2], self.fold, _pooled_r2)
        if reps is None:
            return bootstrap(values[:, :2].numpy(), _pooled_r2, bounds=(-math.inf, 1.0), refits=refits, **self.boot)
        return jackknife(_pooled_r2(values[:, :2]), [_pooled_r2(x[:, :2]) for x in reps],
                         int((~torch.isnan(values[:, :2]).any(1)).sum()), bounds=(-math.inf, 1.0), level=self.level,
                         refits=refits)

    def per_relation(self, values, reps, start: int) -> dict:
        """{relation: proportion of hits in column start + r (None: no subject has the fact)}."""
        out = {}
        for r, nm in enumerate(self.names):
            col = values[:, start + r]
            keep = ~torch.isnan(col)
            if not bool(keep.any()):
                out[nm] = None
                continue
            refits = _per_fold(col, self.fold, _nanmean)
            out[nm] = proportion(col[keep].tolist(), refits=refits, level=self.level) if reps is None else \
                jackknife(_nanmean(col), [_nanmean(x[:, start + r]) for x in reps], int(keep.sum()),
                          proportion=True, level=self.level, refits=refits)
        return out

    def margin(self, a, a_reps, b, b_reps, start: int) -> dict:
        """{relation: paired difference a - b of the hits in column start + r (None: no subject in both)}."""
        out = {}
        for r, nm in enumerate(self.names):
            x, y = a[:, start + r], b[:, start + r]
            keep = ~torch.isnan(x - y)
            if not bool(keep.any()):
                out[nm] = None
            elif a_reps is None:
                out[nm] = paired_difference(x.tolist(), y.tolist(), **self.boot)
            else:
                diff = a_reps[:, :, start + r] - b_reps[:, :, start + r]
                out[nm] = jackknife(_nanmean(x - y), [_nanmean(d) for d in diff], int(keep.sum()),
                                    bounds=(-1.0, 1.0), level=self.level)
        return out

    def r2_margin(self, real, real_reps, other, other_reps, n: int) -> Metric:
        """The pooled R^2 of ``real`` minus that of ``other`` over the same n subjects."""
        if real_reps is None:
            return bootstrap(torch.cat([real[:, :2], other[:, :2]], 1).numpy(), _r2_diff, **self.boot)
        return jackknife(_pooled_r2(real[:, :2]) - _pooled_r2(other[:, :2]),
                         [_pooled_r2(x[:, :2]) - _pooled_r2(y[:, :2]) for x, y in zip(real_reps, other_reps)],
                         n, level=self.level)
