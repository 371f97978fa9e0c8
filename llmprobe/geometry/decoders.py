"""Linear relation decoders: the LRE (mean Jacobian, Hernandez et al. 2023) and a ridge affine baseline.

Plain tensors in, plain tensors out; nothing here knows about models. Shapes: H [n, d_in] subject states,
O [n, d_out] final-layer last-token states, J [n, d_out, d_in] Jacobians dO/dH (or their mean [d_out, d_in]),
y [n] target token ids. ``logits_fn`` is any callable [n, d_out] -> [n, vocab] (the caller passes final norm + LM
head). Estimators follow scikit-learn: ``__init__`` stores settings, ``fit`` returns self, learned attributes end in
``_``, ``score`` returns one float, so ``sklearn.base.clone`` and ``stats.cross_val_score`` work on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from sklearn.base import BaseEstimator

from llmprobe.geometry.stats import as_float, as_tensor, check_rows, fit_ridge, pinv_rank, truncate_rank

__all__ = ["LinearRelationOperator", "LinearRelationDecoder", "RidgeDecoder", "topk_hits", "random_direction_like",
           "random_spectrum_like", "random_spectrum_factors"]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def topk_hits(logits: torch.Tensor, y: Any, k: int = 1) -> torch.Tensor:
    """BoolTensor [n]: is y[i] among the top-k of logits[i]? logits [n, vocab], y [n] token ids."""
    logits = torch.as_tensor(logits)
    y = as_tensor(y, "y", 1).to(logits.device)
    if logits.dim() != 2:
        raise ValueError(f"logits_fn must return [n, vocab], got shape {tuple(logits.shape)}")
    check_rows("logits", logits, "y", y)
    k = min(k, logits.shape[1])
    return (logits.topk(k, dim=1).indices == y[:, None]).any(1)


def random_direction_like(delta: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The random-direction control of an edit: rows of ``delta`` [n, d] replaced by random directions of the
    same norms (float64 draws, returned in delta's dtype)."""
    r = torch.randn(delta.shape, generator=generator, dtype=torch.float64)
    r = r / r.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (r * delta.double().norm(dim=-1, keepdim=True)).to(delta.dtype)


def _random_orthonormal(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).clamp(min=0).mul(2).sub(1)        # Haar: fix the signs of QR


def random_spectrum_like(W: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The random-operator control: a matrix with W's singular values and random (Haar) singular vectors,
    W [m, n] -> [m, n] float64. An edit built from it has W's scale but none of its directions."""
    U, S, Vh = random_spectrum_factors(torch.linalg.svdvals(W.double()), W.shape, generator)
    return (U * S) @ Vh


def random_spectrum_factors(S: torch.Tensor, shape: tuple[int, int], generator: torch.Generator
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`random_spectrum_like` as its SVD, from the singular values S [k] of an [m, n] matrix: (U [m, k],
    S, Vh [k, n]) with Haar-random orthonormal U and V (no m x n decomposition; O((m + n) k^2))."""
    k = S.numel()
    U = _random_orthonormal(shape[0], k, generator)
    V = _random_orthonormal(shape[1], k, generator)
    return U, S.double(), V.T


def _as_2d(h: Any, name: str, d: int) -> tuple[torch.Tensor, bool]:
    h = as_float(h, name)
    squeeze = h.dim() == 1
    if squeeze:
        h = h[None]
    if h.dim() != 2:
        raise ValueError(f"{name} must be [n, {d}] or [{d}], got shape {tuple(h.shape)}")
    if h.shape[1] != d:
        raise ValueError(f"{name} has {h.shape[1]} columns but the operator expects {d}")
    return h, squeeze


# ------------------------------------------------------------------------------------------------------ operator
@dataclass(repr=False)
class LinearRelationOperator:
    """A fitted affine map o = beta * W h + b.

    W [d_out, d_in], b [d_out]; rank = the truncation rank of W (None = full), also the default rank of the
    pseudo-inverse used by ``edit_delta``. ``metadata``: free JSON-able notes (relation, layer, n_train, ...).
    """
    W: torch.Tensor
    b: torch.Tensor
    beta: float = 1.0
    rank: int | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.W.dim() != 2 or self.b.dim() != 1 or self.b.shape[0] != self.W.shape[0]:
            raise ValueError(f"need W [d_out, d_in] and b [d_out], got W {tuple(self.W.shape)}, "
                             f"b {tuple(self.b.shape)}")

    def __repr__(self) -> str:
        """One line, no tensors: its sizes, beta, rank and dtype."""
        return (f"LinearRelationOperator(d_in={self.d_in} -> d_out={self.d_out}, beta={self.beta:g}, "
                f"rank={self.rank}, dtype={str(self.W.dtype).removeprefix('torch.')})")

    @property
    def d_in(self) -> int:
        return self.W.shape[1]

    @property
    def d_out(self) -> int:
        return self.W.shape[0]

    def __call__(self, h: Any) -> torch.Tensor:
        """h [n, d_in] (or [d_in]) -> o [n, d_out] (or [d_out]) = beta * W h + b, in h's float dtype."""
        h, squeeze = _as_2d(h, "h", self.d_in)
        W, b = self.W.to(h.device, h.dtype), self.b.to(h.device, h.dtype)
        o = self.beta * (h @ W.T) + b
        return o[0] if squeeze else o

    def edit_delta(self, o_source: Any, o_target: Any, edit_rank: int | None = None) -> torch.Tensor:
        """The LRE reference's causal edit: delta_h [n, d_in] = W_k^+ (o_target - o_source), with o_source and
        o_target the model's *real* last-layer states of the two subjects' prompts. No division by beta (as in
        the reference): W (h + delta_h) moves by the projection of (o_target - o_source) onto W's top-k output
        subspace. k = edit_rank, else self.rank, else full rank."""
        o_s, sq = _as_2d(o_source, "o_source", self.d_out)
        o_t, _ = _as_2d(o_target, "o_target", self.d_out)
        if o_s.shape != o_t.shape:
            raise ValueError(f"o_source shape {tuple(o_s.shape)} != o_target shape {tuple(o_t.shape)}")
        k = edit_rank if edit_rank is not None else self.rank
        P = pinv_rank(self.W, k).to(o_s.device, o_s.dtype)              # [d_in, d_out]
        delta = (o_t - o_s) @ P.T
        return delta[0] if sq else delta

    def to_dict(self) -> dict:
        """Small JSON-able summary (not the matrices)."""
        S = torch.linalg.svdvals(self.W.double())
        return {"d_in": self.d_in, "d_out": self.d_out, "beta": float(self.beta), "rank": self.rank,
                "W_fro": float(S.norm()), "W_top_singular": float(S[0]) if S.numel() else 0.0,
                "b_norm": float(self.b.double().norm()), **self.metadata}


# ------------------------------------------------------------------------------------------------------ decoders
class _DecoderScoring:
    """predict/score shared by the LRE and the ridge decoder (both expose ``operator_``)."""

    def _check_fitted(self):
        if not hasattr(self, "operator_"):
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit first")

    def predict(self, H: Any) -> torch.Tensor:
        """H [n, d_in] -> O_hat [n, d_out]."""
        self._check_fitted()
        return self.operator_(H)

    def hits(self, H: Any, y: Any, logits_fn: LogitsFn, k: int = 1) -> torch.Tensor:
        """Per-item BoolTensor [n]: target y in the top-k of logits_fn(predict(H)) (for bootstrap CIs)."""
        H = as_float(H, "H", 2)
        y = as_tensor(y, "y", 1)
        check_rows("H", H, "y", y)
        if logits_fn is None:
            raise ValueError("logits_fn is required (a callable [n, d_out] -> [n, vocab])")
        return topk_hits(logits_fn(self.predict(H)), y, k)

    def score(self, H: Any, y: Any, logits_fn: LogitsFn = None) -> float:
        """Faithfulness: fraction of rows with argmax logits_fn(predict(H)) == y."""
        return float(self.hits(H, y, logits_fn, 1).double().mean())

    def score_topk(self, H: Any, y: Any, logits_fn: LogitsFn, k: int = 5) -> float:
        """Fraction of rows with y among the top-k of logits_fn(predict(H))."""
        return float(self.hits(H, y, logits_fn, k).double().mean())


class LinearRelationDecoder(_DecoderScoring, BaseEstimator):
    """LRE estimator: o ~ beta * W h + b with W = mean Jacobian dO/dH, optionally rank-k truncated (SVD).

    fit(H [n, d_in], O [n, d_out], J [n, d_out, d_in] or its mean [d_out, d_in]) sets
    ``W_`` [d_out, d_in], ``b_`` [d_out], ``operator_`` (a LinearRelationOperator), ``n_train_``.

    Bias choice: b_ = mean_i(o_i - W_ h_i) with W_ the *truncated* mean Jacobian (the operator's own W), and
    independent of beta (as in ``docs/measures.md`` and Hernandez et al., where beta rescales only the slope). So at beta = 1
    the operator is unbiased on the training rows. Hernandez et al. instead average the per-prompt biases
    o_i - J_i h_i with the untruncated J_i; the two agree when J is constant and rank is None.
    """

    def __init__(self, beta: float = 1.0, rank: int | None = None):
        self.beta = beta
        self.rank = rank

    def fit(self, H: Any, O: Any, J: Any) -> "LinearRelationDecoder":
        H = as_float(H, "H", 2)
        O = as_float(O, "O", 2)
        check_rows("H", H, "O", O)
        J = as_float(J, "J")
        if J.dim() == 3:
            check_rows("H", H, "J", J)
            W = J.sum(0, dtype=torch.float64) / J.shape[0]
        elif J.dim() == 2:
            W = J.to(torch.float64)
        else:
            raise ValueError(f"J must be [n, d_out, d_in] or [d_out, d_in], got shape {tuple(J.shape)}")
        if W.shape != (O.shape[1], H.shape[1]):
            raise ValueError(f"J is [.., {W.shape[0]}, {W.shape[1]}] but O has {O.shape[1]} columns and H has "
                             f"{H.shape[1]} (need J [n, d_out, d_in])")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {self.rank}")
        W = truncate_rank(W, self.rank)
        b = (O.to(torch.float64) - H.to(torch.float64) @ W.T).mean(0)
        self.W_, self.b_ = W.to(H.dtype), b.to(H.dtype)
        self.n_train_ = H.shape[0]
        self.operator_ = LinearRelationOperator(self.W_, self.b_, float(self.beta), self.rank,
                                                {"estimator": "lre", "n_train": self.n_train_})
        return self


class RidgeDecoder(_DecoderScoring, BaseEstimator):
    """Learned affine baseline O ~ W h + b by closed-form ridge (centred, intercept unpenalised).

    fit(H [n, d_in], O [n, d_out], J=None) sets ``W_`` [d_out, d_in], ``b_`` [d_out], ``operator_`` (beta = 1),
    ``alpha_``. alpha: a float, or a sequence of floats to choose from by exact leave-one-out error.
    J is accepted and ignored so the ridge decoder is a drop-in beside the LRE (same fit/predict/score).
    """

    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def fit(self, H: Any, O: Any, J: Any = None) -> "RidgeDecoder":
        H = as_float(H, "H", 2)
        O = as_float(O, "O", 2)
        check_rows("H", H, "O", O)
        self.W_, self.b_, self.alpha_ = fit_ridge(H, O, self.alpha)
        self.n_train_ = H.shape[0]
        self.operator_ = LinearRelationOperator(self.W_, self.b_, 1.0, None,
                                                {"estimator": "ridge", "alpha": self.alpha_,
                                                 "n_train": self.n_train_})
        return self
