"""Counting bounds: bits a model must store against bits its parameters can hold.

* One hop. R independent random bijections on N items carry ``R * log2(N!)`` bits (about ``N R log2(N/e)``): any
  model answering every (s, r) must be able to reproduce them, so its parameters must hold at least that much.
  At ``p`` bits per parameter it needs ``R log2(N!) / p`` parameters.
* k hops *with* chain-of-thought. Every step is a one-hop lookup, so the same ``R log2(N!)`` bits suffice (the
  answers of all k-hop queries are a function of the R maps).
* k hops *without* chain-of-thought (the regime of the paper's Thm 4.2). The answer to (s, r1..rk) must be read off
  one hidden state computed from e_s and the relation tokens. When the shared network (MLP, attention,
  unembedding) is too small to hold the maps themselves -- it would need about ``R log2(N!)`` bits, i.e. MLP width
  of order N*R -- all subject-specific information sits in e_s, which then has to determine s's whole *evaluation
  tree*: its answers to the R^k relation sequences. For random maps with R^k <= N those leaves are (nearly) distinct
  uniformly random entities, so the tree carries about ``log2(N! / (N - L)!)`` bits with ``L = min(R^k, N)``, and
  e_s (d numbers of p bits) needs ``d >= log2(N!/(N-L)!) / p`` -- exponential in k, as in the theorem. This is a
  simple, honest counting bound in the spirit of Thm 4.2 (it ignores leaf collisions, which only matter once R^k
  approaches N), not a reproduction of its proof. :func:`bits_needed` with ``hops > 1, cot=False`` returns the
  total over subjects, ``N * log2(N!/(N-L)!)``.

Parameter counts of :class:`synthetic.model.FactRecallModel` (uniform attention, no biases on the unembedding, no
positional embeddings): ``N d`` subject embeddings, ``R d`` relation embeddings, ``2 d m + m + d`` MLP and ``n_out d``
unembedding; with frozen subject embeddings the first term is not trainable.
"""
from __future__ import annotations

import math


def log2_factorial(n: int) -> float:
    """log2(n!) via lgamma (exact enough for any n)."""
    return math.lgamma(n + 1) / math.log(2)


def log2_falling(n: int, k: int) -> float:
    """log2(n! / (n-k)!)."""
    k = min(k, n)
    return log2_factorial(n) - log2_factorial(n - k)


def bits_needed(n_subjects: int, n_relations: int, hops: int = 1, cot: bool = False) -> float:
    """Bits a model must store to answer every query (see module docstring).

    hops=1 or cot=True: ``R * log2(N!)``. hops=k>1 without chain-of-thought: ``N * log2(N!/(N-L)!)``, L = min(R^k, N),
    the evaluation-tree requirement that applies when the MLP is too narrow to hold the maps.
    """
    N, R = n_subjects, n_relations
    if hops <= 1 or cot:
        return R * log2_factorial(N)
    leaves = min(R ** hops, N)
    return N * log2_falling(N, leaves)


def bits_available(n_params: int, bits_per_param: float = 2.0) -> float:
    """Bits that ``n_params`` parameters hold at ``bits_per_param`` (2 ~ what trained models reach, 32 = float32)."""
    return n_params * bits_per_param


def min_params(n_subjects: int, n_relations: int, hops: int = 1, cot: bool = False,
               bits_per_param: float = 2.0) -> int:
    """Fewest parameters whose bits cover :func:`bits_needed`."""
    return math.ceil(bits_needed(n_subjects, n_relations, hops, cot) / bits_per_param)


def trainable_params(n_subjects: int, n_relations: int, d: int, d_mlp: int | None = None, n_outputs: int | None = None,
                     frozen_subjects: bool = False) -> int:
    """Trainable parameters of the uniform-attention model (``d_mlp`` None = 8d as in the model's default,
    ``n_outputs`` None = N)."""
    m = 8 * d if d_mlp is None else d_mlp
    n_out = n_subjects if n_outputs is None else n_outputs
    count = n_relations * d + 2 * d * m + m + d + n_out * d
    return count if frozen_subjects else count + n_subjects * d


def min_d(n_subjects: int, n_relations: int, bits_per_param: float = 2.0, frozen_subjects: bool = False,
          mlp_ratio: float = 8.0, hops: int = 1, cot: bool = False) -> int:
    """Smallest d whose trainable parameters (MLP width ``mlp_ratio * d``) can hold the facts' bits at
    ``bits_per_param``. For k hops without CoT this is the per-subject evaluation-tree bound
    ``d >= log2(N!/(N-L)!) / p`` instead (the subject embedding alone must carry the tree)."""
    N, R = n_subjects, n_relations
    if hops > 1 and not cot:
        return math.ceil(log2_falling(N, min(R ** hops, N)) / bits_per_param)
    need = bits_needed(N, R)
    d = 1
    while trainable_params(N, R, d, int(round(mlp_ratio * d)), frozen_subjects=frozen_subjects) * bits_per_param < need:
        d += 1
    return d


def summary(n_subjects: int, n_relations: int, hops: int = 1, bits_per_param: float = 2.0) -> dict:
    """All of the above for one (N, R): bits, and the capacity-implied d for trainable/frozen embeddings."""
    N, R = n_subjects, n_relations
    return {
        "n_subjects": N, "n_relations": R, "hops": hops,
        "bits_one_hop": bits_needed(N, R),
        "bits_khop_no_cot": bits_needed(N, R, hops, cot=False) if hops > 1 else None,
        "min_params": min_params(N, R, bits_per_param=bits_per_param),
        "min_d_trainable": min_d(N, R, bits_per_param),
        "min_d_frozen": min_d(N, R, bits_per_param, frozen_subjects=True),
        "min_d_khop_no_cot": min_d(N, R, bits_per_param, hops=hops) if hops > 1 else None,
        "bits_per_param": bits_per_param,
    }


def capacity_reference(cells: list[dict], bits_per_param: float, mlp_ratio: float = 8.0) -> dict:
    """The width at which the trainable model's parameters hold the facts' bits at ``bits_per_param``
    (:func:`min_d`), for every (N, R) of ``cells`` (dicts with "N" and "R"): {N: [(R log2 N, d), ...] sorted by R}."""
    out: dict = {}
    for N, R in sorted({(c["N"], c["R"]) for c in cells}):
        out.setdefault(N, []).append((R * math.log2(N), min_d(N, R, bits_per_param, mlp_ratio=mlp_ratio)))
    return out
