"""Statistics shared by the geometry estimators: ridge, R^2, splits, cross-validation, shuffled controls (intervals:
``llmprobe.metric``).

Pure torch (plus scikit-learn's ``clone``); every random step takes a seed and uses its own ``torch.Generator``,
so results are reproducible and independent of the global RNG state.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from sklearn.base import clone

__all__ = [
    "as_tensor",
    "ridge_fit",
    "ridge_fit_cv",
    "leave_one_out_errors",
    "fit_ridge",
    "ALPHA_GRID",
    "r2_score",
    "shuffle_table",
    "kfold_indices",
    "train_test_split",
    "cross_val_score",
]


# --------------------------------------------------------------------------------------------- validation helpers
def as_tensor(x: Any, name: str = "input", ndim: int | None = None, dtype: torch.dtype | None = None,
              allow_empty: bool = False) -> torch.Tensor:
    """``torch.as_tensor`` with checks: number of dims, non-empty, finite (for floats). Raises ``ValueError``."""
    if x is None:
        raise ValueError(f"{name} is None")
    t = torch.as_tensor(x)
    if dtype is not None:
        t = t.to(dtype)
    elif t.is_complex():
        raise ValueError(f"{name} must be real, got {t.dtype}")
    elif not (t.is_floating_point() or t.dtype == torch.bool):
        t = t.to(torch.int64)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return t


def as_float(x: Any, name: str = "input", ndim: int | None = None) -> torch.Tensor:
    """Float tensor (float32/float64 kept, anything else -> float32)."""
    t = as_tensor(x, name, ndim)
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    return t


def check_rows(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``a`` and ``b`` have the same number of rows."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{name_a} has {a.shape[0]} rows but {name_b} has {b.shape[0]}")


# --------------------------------------------------------------------------------------------------------- ridge
def ridge_fit(X: Any, Y: Any, alpha: float = 1.0, fit_intercept: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge regression Y ~ X W^T + b, solved in float64.

    X [n, p], Y [n, q] -> (W [q, p], b [q]) in X's float dtype. The intercept is not penalised (X, Y centred).
    Uses the primal (p x p) or dual (n x n) system, whichever is smaller; alpha = 0 gives the min-norm least-squares
    solution (pseudo-inverse).
    """
    X = as_float(X, "X", 2)
    Y = as_float(Y, "Y", 2)
    check_rows("X", X, "Y", Y)
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    out_dtype = X.dtype
    Xd, Yd = X.to(torch.float64), Y.to(Y.device, torch.float64)
    if fit_intercept:
        x_mean, y_mean = Xd.mean(0), Yd.mean(0)
        Xd, Yd = Xd - x_mean, Yd - y_mean
    n, p = Xd.shape
    if alpha == 0:
        B = torch.linalg.pinv(Xd) @ Yd                                   # [p, q]
    elif p <= n:
        G = Xd.T @ Xd
        G.diagonal().add_(alpha)
        B = torch.linalg.solve(G, Xd.T @ Yd)
    else:
        K = Xd @ Xd.T
        K.diagonal().add_(alpha)
        B = Xd.T @ torch.linalg.solve(K, Yd)
    W = B.T.contiguous()
    b = (y_mean - W @ x_mean) if fit_intercept else torch.zeros(W.shape[0], dtype=W.dtype, device=W.device)
    return W.to(out_dtype), b.to(out_dtype)


ALPHA_GRID = tuple(10.0 ** k for k in range(-4, 6))                    # 1e-4 ... 1e5


def ridge_fit_cv(X: Any, Y: Any, alphas: Sequence[float] = ALPHA_GRID,
                 fit_intercept: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Ridge with alpha chosen by exact leave-one-out error (closed form, as in scikit-learn's RidgeCV:
    :func:`leave_one_out_errors`), one alpha shared by all outputs. X [n, p], Y [n, q] -> (W [q, p], b [q],
    alpha); the first alpha of the smallest error wins a tie.

    The spectrum of the centred X comes from the eigendecomposition of the smaller of X X^T [n, n] and X^T X
    [p, p] (a few times faster than its SVD when n and p differ); the solution is the dual form
    W^T = X^T Q (Lambda + alpha)^-1 Q^T Y, with Q the left singular vectors, so no singular value is divided by.
    """
    alphas, (x_mean, y_mean, Xc, Yc, lam, Q) = _checked_cv(X, Y, alphas, fit_intercept)
    QtY = Q.T @ Yc                                                           # [k, q]
    errors = _loo_errors(Yc, QtY, lam, Q, alphas, fit_intercept)
    a, least = alphas[0], float("inf")
    for alpha, error in zip(alphas, errors):             # the first of the smallest (a NaN error never wins)
        if error < least:
            a, least = alpha, error
    W = (Q @ (QtY / (lam + a)[:, None])).T @ Xc                              # [q, p], row-major as it is made
    b = y_mean - W @ x_mean
    return W.to(X.dtype), b.to(X.dtype), a


def leave_one_out_errors(X: Any, Y: Any, alphas: Sequence[float] = ALPHA_GRID,
                         fit_intercept: bool = True) -> list[float]:
    """Per alpha, the summed squared error [len(alphas)] of predicting each row of Y [n, q] from X [n, p] by the
    ridge fitted on the other rows, in closed form (no refit): sum_i ||r_i / (1 - h_i)||^2, r the residuals and
    h the hat matrix's diagonal of the fit on all rows."""
    alphas, (_, _, _, Yc, lam, Q) = _checked_cv(X, Y, alphas, fit_intercept)
    return _loo_errors(Yc, Q.T @ Yc, lam, Q, alphas, fit_intercept)


def _checked_cv(X, Y, alphas, fit_intercept: bool) -> tuple[list[float], tuple[torch.Tensor, ...]]:
    """The alphas as floats and (x mean [p], y mean [q], centred X [n, p] and Y [n, q], the centred X's nonzero
    squared singular values [k] and left singular vectors [n, k]), in float64; ValueError on bad input."""
    X = as_float(X, "X", 2)
    Y = as_float(Y, "Y", 2)
    check_rows("X", X, "Y", Y)
    alphas = [float(a) for a in alphas]
    if not alphas or min(alphas) < 0:
        raise ValueError(f"alphas must be a non-empty sequence of values >= 0, got {alphas}")
    if X.shape[0] < 3:
        raise ValueError(f"leave-one-out alpha selection needs >= 3 rows, got {X.shape[0]}")
    Xd, Yd = X.to(torch.float64), Y.to(X.device, torch.float64)
    n, p = Xd.shape
    x_mean = Xd.mean(0) if fit_intercept else torch.zeros(p, dtype=torch.float64, device=Xd.device)
    y_mean = Yd.mean(0) if fit_intercept else torch.zeros(Yd.shape[1], dtype=torch.float64, device=Yd.device)
    Xc, Yc = Xd - x_mean, Yd - y_mean
    lam, vecs = torch.linalg.eigh(Xc @ Xc.T if n <= p else Xc.T @ Xc)         # eigenvalues = squared singular values
    keep = lam > lam.max().clamp_min(0) * max(n, p) * torch.finfo(torch.float64).eps
    lam, vecs = lam[keep], vecs[:, keep]
    Q = vecs if n <= p else (Xc @ vecs) / lam.sqrt()                          # left singular vectors [n, k]
    return alphas, (x_mean, y_mean, Xc, Yc, lam, Q)


def _loo_errors(Yc: torch.Tensor, QtY: torch.Tensor, lam: torch.Tensor, Q: torch.Tensor, alphas: list[float],
                fit_intercept: bool) -> list[float]:
    """Leave-one-out errors per alpha from the spectrum (``_checked_cv``) and QtY = Q^T Yc [k, q]. The residual
    at alpha is Yc - Q diag(f) QtY = P + Q diag(1 - f) QtY with P = Yc - Q QtY (outside Q's span, alpha-free),
    so its row norms come from n x k and k x k products made once: n k^2 per alpha, not n k q."""
    n = Yc.shape[0]
    P = Yc - Q @ QtY                                                         # [n, q]
    P_sq, PY, G = (P ** 2).sum(1), P @ QtY.T, QtY @ QtY.T                    # [n], [n, k], [k, k]
    Q_sq = Q ** 2
    errors = []
    for a in alphas:
        f = lam / (lam + a)                                                  # shrinkage factors [k]
        Qg = Q * (1 - f)                                                     # [n, k]
        resid_sq = P_sq + 2 * (Qg * PY).sum(1) + ((Qg @ G) * Qg).sum(1)      # ||residual row||^2 [n]
        h = Q_sq @ f + (1.0 / n if fit_intercept else 0.0)                   # hat-matrix diagonal [n]
        errors.append(float((resid_sq / (1 - h).clamp_min(1e-12) ** 2).sum()))
    return errors


def fit_ridge(X: Any, Y: Any, alpha: float | Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``ridge_fit`` for a scalar alpha, ``ridge_fit_cv`` (leave-one-out choice) for a sequence of alphas.
    Returns (W [q, p], b [q], the alpha used)."""
    if isinstance(alpha, (int, float)):
        W, b = ridge_fit(X, Y, float(alpha))
        return W, b, float(alpha)
    return ridge_fit_cv(X, Y, alpha)


def truncate_rank(W: torch.Tensor, rank: int | None) -> torch.Tensor:
    """Best rank-k approximation of W [m, n] (SVD, Eckart-Young); rank None or >= min(m, n) returns W unchanged."""
    if rank is None or rank >= min(W.shape):
        return W
    if rank < 0:
        raise ValueError(f"rank must be >= 0 or None, got {rank}")
    U, S, Vh = torch.linalg.svd(W.to(torch.float64), full_matrices=False)
    return ((U[:, :rank] * S[:rank]) @ Vh[:rank]).to(W.dtype)


def pinv_rank(W: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """Rank-k pseudo-inverse of W [m, n] -> [n, m] (top-k singular triplets; rank None = all above tolerance)."""
    U, S, Vh = torch.linalg.svd(W.to(torch.float64), full_matrices=False)
    tol = S.max().clamp_min(0) * max(W.shape) * torch.finfo(W.dtype).eps if S.numel() else 0.0
    keep = S > tol
    if rank is not None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {rank}")
        keep &= torch.arange(S.numel(), device=S.device) < rank
    U, S, Vh = U[:, keep], S[keep], Vh[keep]
    return ((Vh.T / S) @ U.T).to(W.dtype)


# ----------------------------------------------------------------------------------------------------------- R^2
def r2_score(y_true: Any, y_pred: Any, y_mean: Any | None = None) -> float:
    """R^2 = 1 - SSE/SST pooled over all dims. y_true, y_pred [n, d] (or [n]); y_mean [d] is the reference mean
    for SST (pass the *training* mean for held-out R^2; default: mean of y_true)."""
    y_true = as_float(y_true, "y_true")
    y_pred = as_float(y_pred, "y_pred").to(y_true.dtype)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"y_true shape {tuple(y_true.shape)} != y_pred shape {tuple(y_pred.shape)}")
    ref = y_true.mean(0) if y_mean is None else as_float(y_mean, "y_mean").to(y_true.dtype)
    sse = ((y_true - y_pred) ** 2).sum().double()
    sst = ((y_true - ref) ** 2).sum().double()
    if sst == 0:
        return float("nan")
    return float(1 - sse / sst)


# ------------------------------------------------------------------------------------------------------ controls
def shuffle_table(A: Any, seed: int = 0) -> torch.Tensor:
    """Shuffled control for a fact table A [n_subjects, n_relations] (LongTensor, -1 = missing).

    Within each relation independently, permutes the present attribute values across the subjects that have a fact
    for that relation; the missing pattern and each relation's attribute counts are kept, the pairing with subjects
    (and across relations) is destroyed.
    """
    A = as_tensor(A, "A", 2)
    if A.is_floating_point():
        raise ValueError(f"A must be an integer tensor, got {A.dtype}")
    g = torch.Generator().manual_seed(seed)
    out = A.clone()
    for r in range(A.shape[1]):
        rows = torch.nonzero(A[:, r] >= 0).flatten()
        perm = torch.randperm(rows.numel(), generator=g).to(rows.device)
        out[rows, r] = A[rows[perm], r]
    return out


# -------------------------------------------------------------------------------------------------------- splits
def kfold_indices(n: int, k: int = 5, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """k shuffled folds over n items: list of (train_idx, test_idx) LongTensors; test folds partition range(n)."""
    if not 2 <= k <= n:
        raise ValueError(f"need 2 <= k <= n, got k={k}, n={n}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    folds = torch.tensor_split(perm, k)
    out = []
    for i, test in enumerate(folds):
        train = torch.cat([f for j, f in enumerate(folds) if j != i])
        out.append((train.sort().values, test.sort().values))
    return out


def train_test_split(n: int, test_size: float = 0.25, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One shuffled split of range(n): (train_idx, test_idx), test_size a fraction in (0, 1) or a count."""
    n_test = int(round(test_size * n)) if isinstance(test_size, float) and test_size < 1 else int(test_size)
    if not 1 <= n_test < n:
        raise ValueError(f"test_size={test_size} leaves {n_test} of {n} items for testing")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    return perm[n_test:].sort().values, perm[:n_test].sort().values


def take(x: Any, idx: torch.Tensor) -> Any:
    """Rows ``idx`` of a tensor, array or list (None passes through)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x[idx.to(x.device)]
    if isinstance(x, np.ndarray):
        return x[idx.cpu().numpy()]
    return [x[i] for i in idx.tolist()]


def cross_val_score(estimator: Any, fit_data: Sequence[Any], splits: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    score_data: Sequence[Any] | None = None, fit_kwargs: dict | None = None,
                    score_kwargs: dict | None = None) -> list[float]:
    """Fit on each split's train rows, score on its test rows.

    estimator: an unfitted estimator (cloned per split with ``sklearn.base.clone``) or a zero-argument factory.
    fit_data / score_data: tuples of per-item arrays (rows = items), e.g. ``(H, O, J)`` and ``(H, y)``;
    score_data defaults to fit_data. fit_kwargs / score_kwargs: non-per-item arguments (e.g. ``U_r``,
    ``logits_fn``). splits: from ``kfold_indices`` or ``train_test_split``.
    """
    score_data = fit_data if score_data is None else score_data
    fit_kwargs, score_kwargs = fit_kwargs or {}, score_kwargs or {}
    scores = []
    for train, test in splits:
        est = clone(estimator) if hasattr(estimator, "get_params") else estimator()
        est.fit(*[take(x, train) for x in fit_data], **fit_kwargs)
        scores.append(float(est.score(*[take(x, test) for x in score_data], **score_kwargs)))
    return scores
