"""Planted worlds (layer 1): subject states built so that a claim holds, or fails, by construction, at the shapes
of a real run (its fact table A [n, R] and attribute vectors U), for calibrating a measure before it grades a
model (``benchmarks/calibration.py``, ``docs/measures.md``, Calibration). Pure tensor math, seeded.

* :func:`planted_superposition`: h_s = sum_r W_r u_{a_r(s)} + noise: the paper's geometry, exactly, with the
  very attribute vectors the measure names (random maps W_r [d, d_u], noise at signal-to-noise ``snr``);
* :func:`shuffled_superposition`: the same built from a table whose rows are permuted within each relation (every
  attribute is in the states, none at its subject): no superposition of *these* facts;
* :func:`lexical_world`: h_s = the subject's static token embedding (plus noise): what a lexical shortcut
  reads, nothing a transformer computes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _noise(shape: tuple[int, int], scale: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def planted_superposition(A: torch.Tensor, U: Sequence[torch.Tensor], d: int, snr: float, seed: int = 0
                          ) -> torch.Tensor:
    """States [n, d] = sum_r u_{a_r(s)} W_r^T (W_r [d, d_u_r] Gaussian / sqrt(d_u_r)) + isotropic noise whose
    total variance is the signal's over ``snr`` (``snr`` inf: no noise). A missing fact (-1) adds nothing."""
    gen = torch.Generator().manual_seed(seed)
    n, R = A.shape
    H = torch.zeros(n, d, dtype=torch.float64)
    for r, U_r in enumerate(U):
        U_r = U_r.to(torch.float64)
        W = torch.randn(d, U_r.shape[1], generator=gen, dtype=torch.float64) / U_r.shape[1] ** 0.5
        rows = A[:, r] >= 0
        H[rows] += U_r[A[rows, r]] @ W.T
    signal = float(H.var(0).sum())
    if snr == float("inf") or signal == 0.0:
        return H
    return H + _noise((n, d), (signal / snr / d) ** 0.5, gen)


def shuffled_superposition(A: torch.Tensor, U: Sequence[torch.Tensor], d: int, snr: float, seed: int = 0
                           ) -> torch.Tensor:
    """:func:`planted_superposition` of A with each relation's column permuted among the subjects that have the
    fact (seeded): the attributes' marginal counts kept, their subjects not."""
    gen = torch.Generator().manual_seed(seed + 1)
    shuffled = A.clone()
    for r in range(A.shape[1]):
        rows = torch.nonzero(A[:, r] >= 0).flatten()
        shuffled[rows, r] = A[rows[torch.randperm(len(rows), generator=gen)], r]
    return planted_superposition(shuffled, U, d, snr, seed)


def lexical_world(E: torch.Tensor, snr: float = float("inf"), seed: int = 0) -> torch.Tensor:
    """States [n, d] = E (each subject's static token embedding, e.g. ``superposition.lexical_states``) plus
    isotropic noise at signal-to-noise ``snr``."""
    E = E.to(torch.float64)
    if snr == float("inf"):
        return E.clone()
    gen = torch.Generator().manual_seed(seed)
    return E + _noise(tuple(E.shape), (float(E.var(0).sum()) / snr / E.shape[1]) ** 0.5, gen)
