"""The paper's explicit solution, built without training, in :class:`synthetic.model.FactRecallModel`.

Layout of the residual stream (uniform attention, no positional embeddings, d = R*b + 2 for ``variant="erase"``):

* dims ``[q*b, (q+1)*b)``: block q holds the attribute code of relation q. Subject embedding
  ``e_s = sum_q P_q c_{a_q(s)}`` -- a *block superposition* of the subject's R attribute codes.
* 2 relation dims: relation r is the point ``rho_r = (cos 2 pi r/R, sin 2 pi r/R)`` on a circle.
* At the answer position the residual is ``mid = x_r + (x_s + x_r)/2 = e_s/2 + 3 e_r/2``.

The MLP is a relation-conditioned *selector* built from ReLU gates: for every block q and coordinate j there is a pair
of units ``relu(+mid_{q,j} + g_q) , relu(-mid_{q,j} + g_q)`` whose gate ``g_q = -lam (rho_q . rho_r - t)`` comes from
the relation dims. A pair's difference is ``2 mid_{q,j}`` when the gate is open (g >= max|mid|) and 0 when closed
(g <= -max|mid|). With ``variant="erase"`` (default, smallest d) the gates of every block *except* the queried
relation's are open and the MLP writes ``-mid_{q,j}``, so only block r survives; the unembedding row of attribute a
is its code repeated in every block, ``u_a = sum_q P_q c_a``, and the logit is ``c_a . c_{a_r(s)} / 2`` -- the argmax
is the right attribute whenever the codes are distinct unit vectors. With ``variant="extract"`` only block r's gate
is open and the MLP copies it into an extra output block of b dims that the unembedding reads (d = R*b + b + 2).

Codes: ``"binary"`` uses the ceil(log2 n) bits of the attribute index as +-1/sqrt(b) (works at any precision, so
d = R*ceil(log2 N) + 2 = O(R log N)); ``"sphere"`` uses n well-spread unit vectors in b dims (evenly spaced on the
circle for b=2, a Fibonacci lattice for b=3, repelled random points above), which needs fewer dims but relies on
precision. :func:`smallest_construction` finds the smallest b (hence d) at which the built model answers every
fact, optionally after quantising every weight row to ``precision_bits`` (symmetric, per row of each stored
matrix; rows of ``W_in`` are input dims). In float32 with sphere codes even b=2 can work for moderate N, which
is why a finite precision is the honest yardstick.
"""
from __future__ import annotations

import math

import torch

from synthetic.model import FactRecallModel, ModelConfig
from synthetic.tasks import FactTask, random_bijections


def attribute_codes(n: int, b: int, kind: str = "sphere", seed: int = 0) -> torch.Tensor:
    """``n`` distinct unit vectors in ``b`` dims [n, b] (see module docstring)."""
    if kind == "binary":
        need = max(1, math.ceil(math.log2(max(n, 2))))
        if b < need:
            raise ValueError(f"binary codes for {n} attributes need b >= {need}")
        bits = (torch.arange(n)[:, None] >> torch.arange(b)[None, :]) & 1
        return (bits.double() * 2 - 1) / math.sqrt(b)
    if kind != "sphere":
        raise ValueError("codes must be 'sphere' or 'binary'")
    if b == 1:
        return torch.tensor([[1.0], [-1.0]], dtype=torch.float64)[:n] if n <= 2 else \
            torch.linspace(-1, 1, n, dtype=torch.float64)[:, None]          # not unit: fails for n > 2, as it must
    if b == 2:
        ang = 2 * math.pi * torch.arange(n, dtype=torch.float64) / n
        return torch.stack([ang.cos(), ang.sin()], dim=1)
    if b == 3:
        i = torch.arange(n, dtype=torch.float64) + 0.5
        phi = torch.acos(1 - 2 * i / n)
        theta = math.pi * (1 + 5 ** 0.5) * i
        return torch.stack([phi.sin() * theta.cos(), phi.sin() * theta.sin(), phi.cos()], dim=1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, b, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    for _ in range(30 if n <= 8192 else 0):   # push the closest pairs apart
        gram = x @ x.T
        gram.fill_diagonal_(-2)
        near = gram.argmax(dim=1)
        x = x - 0.1 * (x[near] - (x * x[near]).sum(1, keepdim=True) * x)
        x = x / x.norm(dim=1, keepdim=True)
    return x


def build_construction(task: FactTask, b: int, codes: str = "sphere", variant: str = "erase", seed: int = 0,
                       margin: float = 1.5) -> FactRecallModel:
    """A :class:`FactRecallModel` (uniform attention) whose weights realise the block-superposition / ReLU-selector
    solution for ``task`` with ``b`` dims per relation block. No training."""
    if variant not in ("erase", "extract"):
        raise ValueError("variant must be 'erase' or 'extract'")
    N, R, n_out = task.n_subjects, task.n_relations, task.n_outputs
    C = attribute_codes(n_out, b, codes, seed)                     # [n_out, b]
    rel0 = R * b
    d = R * b + 2 + (b if variant == "extract" else 0)
    out0 = rel0 + 2
    m = 2 * R * b
    cfg = ModelConfig(n_subjects=N, n_relations=R, n_outputs=n_out, d_model=d, d_mlp=m, max_len=2,
                      attention="uniform", pos_embed=False, seed=seed)
    model = FactRecallModel(cfg)
    E = torch.zeros(N, d, dtype=torch.float64)
    for q in range(R):
        col = task.table[:, q]
        ok = col >= 0
        E[ok, q * b:(q + 1) * b] = C[col[ok]]
    ang = 2 * math.pi * torch.arange(R, dtype=torch.float64) / max(R, 1)
    rho = torch.stack([ang.cos(), ang.sin()], dim=1)                 # [R, 2]
    Erel = torch.zeros(R, d, dtype=torch.float64)
    Erel[:, rel0:rel0 + 2] = rho
    # gates: rho_q . rho_r is 1 for r = q and <= cos(2 pi / R) otherwise; threshold t halfway
    cos_next = math.cos(2 * math.pi / R) if R > 1 else -1.0
    t = (1 + cos_next) / 2
    big = 0.5 * float(C.abs().max())                                 # max |mid| in a code block
    lam = margin * big / ((1 - cos_next) / 2)
    sign = -1.0 if variant == "erase" else 1.0                       # erase: open for r != q; extract: r == q
    W_in = torch.zeros(d, m, dtype=torch.float64)
    b_in = torch.zeros(m, dtype=torch.float64)
    W_out = torch.zeros(m, d, dtype=torch.float64)
    for q in range(R):
        for j in range(b):
            for s_i, s in enumerate((1.0, -1.0)):
                k = 2 * (q * b + j) + s_i
                W_in[q * b + j, k] = s
                W_in[rel0:rel0 + 2, k] = sign * lam * rho[q] / 1.5     # mid holds 1.5 * e_r
                b_in[k] = -sign * lam * t
                if variant == "erase":
                    W_out[k, q * b + j] = -0.5 * s                   # pair difference 2*mid -> write -mid
                else:
                    W_out[k, out0 + j] = 0.5 * s * 2.0               # write 2*mid = the code c into the output block
    U = torch.zeros(n_out, d, dtype=torch.float64)
    if variant == "erase":
        for q in range(R):
            U[:, q * b:(q + 1) * b] = C
    else:
        U[:, out0:out0 + b] = C
    with torch.no_grad():
        model.subject_embed.copy_(E)
        model.relation_embed.copy_(Erel)
        model.W_in.copy_(W_in)
        model.b_in.copy_(b_in)
        model.W_out.copy_(W_out)
        model.b_out.zero_()
        model.unembed_weight.copy_(U)
    return model


def build_subject_memory(task: FactTask, seed: int = 0) -> FactRecallModel:
    """A one-layer key-value memory whose MLP reads only the subject (no selector): one ReLU unit per subject (its
    key a subject dimension) writes every attribute of the subject at once; the relation embedding lifts the
    queried relation's attribute set in the unembedding. Answers every fact when each relation has attributes of
    its own (e.g. :func:`synthetic.tasks.random_functions`); no gate depends on the relation. (uniform attention,
    d = N + R + n_outputs, d_mlp = N.)"""
    N, R, n_out = task.n_subjects, task.n_relations, task.n_outputs
    d = N + R + n_out
    model = FactRecallModel(ModelConfig(N, R, n_out, d_model=d, d_mlp=N, pos_embed=False, seed=seed))
    E, E_rel = torch.zeros(N, d), torch.zeros(R, d)
    E[range(N), range(N)] = 2.0                        # the answer position holds e_s / 2 + 3 e_r / 2
    E_rel[range(R), [N + r for r in range(R)]] = 1.0
    W_in, W_out, U = torch.zeros(d, N), torch.zeros(N, d), torch.zeros(n_out, d)
    W_in[range(N), range(N)] = 2.0
    for s in range(N):
        known = task.table[s][task.table[s] >= 0]
        W_out[s, N + R + known] = 1.0
    for r in range(R):
        for a in task.relation_attributes(r).tolist():
            U[a, N + R + a], U[a, N + r] = 1.0, 1.0
    with torch.no_grad():
        for param, value in ((model.subject_embed, E), (model.relation_embed, E_rel), (model.W_in, W_in),
                             (model.b_in, -torch.ones(N)), (model.W_out, W_out), (model.b_out, torch.zeros(d)),
                             (model.unembed_weight, U)):
            param.copy_(value)
    return model


def quantize_(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """Round every parameter in place to ``bits``-bit symmetric levels, per row of 2-D tensors (per tensor for 1-D)."""
    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for p in model.parameters():
            w = p.data
            scale = (w.abs().amax(dim=-1, keepdim=True) if w.dim() > 1 else w.abs().max()) / levels
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            p.data.copy_((w / scale).round() * scale)
    return model


def construction_accuracy(model: FactRecallModel, task: FactTask) -> float:
    data = task.data()
    pred = model.predict(data.input_ids, data.target_pos)
    return float((pred == data.targets).float().mean())


def smallest_construction(n_subjects: int | None = None, n_relations: int | None = None, *,
                          task: FactTask | None = None, codes: str = "sphere", variant: str = "erase",
                          precision_bits: int | None = 8, seed: int = 0, b_max: int = 64) -> dict:
    """Smallest block size b (and d) at which the construction reaches 100% on every fact.

    ``precision_bits`` None = float32 weights as built; otherwise weights are quantised first. Returns a dict with
    n_subjects, n_relations, b, d_model, d_mlp, accuracy, codes, variant, precision_bits (b = None if none fits).
    """
    task = task or random_bijections(n_subjects, n_relations, seed)
    N, R = task.n_subjects, task.n_relations
    start = max(1, math.ceil(math.log2(max(task.n_outputs, 2)))) if codes == "binary" else 1
    acc = 0.0
    for b in range(start, b_max + 1):
        model = build_construction(task, b, codes=codes, variant=variant, seed=seed)
        if precision_bits:
            quantize_(model, precision_bits)
        acc = construction_accuracy(model, task)
        if acc == 1.0:
            return {"n_subjects": N, "n_relations": R, "b": b, "d_model": model.config.d_model,
                    "d_mlp": model.config.d_mlp, "accuracy": acc, "codes": codes, "variant": variant,
                    "precision_bits": precision_bits, "n_params": model.n_params()["total"]}
    return {"n_subjects": N, "n_relations": R, "b": None, "d_model": None, "d_mlp": None, "accuracy": acc,
            "codes": codes, "variant": variant, "precision_bits": precision_bits}
