"""The linear relation decoder's model side (LRE, Hernandez et al. 2023): batched Jacobians of the last block's
output with respect to the subject state, and their mean, the LRE operator W (layer 2).

Jacobians ``J_i = d o_i / d h_i`` (``h``, ``o``: ``llmprobe.model.engine``) are computed for a whole batch of
prompts at once. The subject state is replaced by a leaf tensor (requiring grad) inside a forward hook, and the
rows of a batch never interact (attention stays within a row), so one backward pass of ``sum_i o_i[k]`` gives row
``k`` of every prompt's Jacobian; those backward passes are themselves batched over blocks of output dimensions
with ``is_grads_batched`` (vmap). With ``use_cache=True`` (default) the tokens before the subject's last token are
run once without gradients and reused through the KV cache, so the backward passes only cover the tokens from the
subject's last token to the end of the prompt. Low-rank Jacobians (``rank=K``) replace the d_out backward passes
by a randomised range finder: about 3(K + 10) vector-Jacobian and Jacobian-vector products per prompt and layer
(:func:`_lowrank_rows`), whose mean over prompts is the best rank-K approximation of W up to the estimator's error
(docs/measures.md). ``per_prompt_jacobians`` is the one-prompt-at-a-time ``torch.autograd.functional.jacobian``
reference (the original LRE code's approach), kept for tests and the benchmark.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import adapter_for, capture, module_device
from llmprobe.model.engine import (
    StopForward,
    cache_kwarg,
    detached_cpu,
    filled_prompts,
    output_hooks,
    output_name,
    state_name,
)
from llmprobe.model.subjects import EncodedPrompts, encode

__all__ = ["JacobianResult", "subject_jacobians", "jacobian_cost", "per_prompt_jacobians"]


@dataclass
class JacobianResult:
    """Per-prompt Jacobians d o / d h at the clean ``H`` [n, d_in] and ``O`` [n, d_out] they were taken at.

    Exact (``rank`` None): ``J`` [n, d_out, d_in]. Low-rank (``rank`` K): per-prompt factors ``U`` [n, d_out, k]
    and ``Vt`` [n, k, d_in] with J_i ~ U_i Vt_i (k = K + oversampling), and every mean over prompts is truncated
    to its best rank-K approximation (:meth:`svd`)."""

    H: torch.Tensor
    O: torch.Tensor
    J: torch.Tensor | None = None
    U: torch.Tensor | None = None
    Vt: torch.Tensor | None = None
    rank: int | None = None

    def __post_init__(self):
        if self.J is None and (self.U is None or self.Vt is None):
            raise ValueError("a JacobianResult needs J, or the factors U and Vt")

    def svd(self, rows=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SVD (U [d_out, r], S [r], Vh [r, d_in], float64) of the mean Jacobian over ``rows`` (default: all):
        exact, or for low-rank factors the best rank-``rank`` approximation of the mean of the factored ones,
        from QR decompositions of the stacked factors (no d_out x d_in matrix is decomposed)."""
        rows = slice(None) if rows is None else rows
        if self.J is not None:
            return torch.linalg.svd(self.J[rows].double().mean(0), full_matrices=False)
        U, Vt = self.U[rows].double(), self.Vt[rows].double()
        m = U.shape[0]
        A = U.permute(1, 0, 2).reshape(U.shape[1], -1) / m                   # [d_out, m k]
        B = Vt.permute(2, 0, 1).reshape(Vt.shape[2], -1)                     # [d_in, m k]: mean = A B^T
        Qa, Ra = torch.linalg.qr(A)
        Qb, Rb = torch.linalg.qr(B)
        u, s, vh = torch.linalg.svd(Ra @ Rb.T)
        K = min(self.rank, s.numel())
        return Qa @ u[:, :K], s[:K], vh[:K] @ Qb.T

    @property
    def W(self) -> torch.Tensor:
        """Mean Jacobian [d_out, d_in] (low-rank: its best rank-``rank`` approximation)."""
        if self.J is not None:
            return self.J.mean(0)
        U, S, Vh = self.svd()
        return ((U * S) @ Vh).to(self.U.dtype)

    def apply(self, rows, h: torch.Tensor) -> torch.Tensor:
        """J_i h_i for the prompts ``rows`` and states h [m, d_in]: [m, d_out] (float64)."""
        if self.J is not None:
            return torch.einsum("noi,ni->no", self.J[rows].double(), h.double())
        return torch.einsum("nok,nk->no", self.U[rows].double(), torch.einsum("nki,ni->nk", self.Vt[rows].double(),
                                                                             h.double()))


def _vjps(o: torch.Tensor, inputs: list[torch.Tensor], cotangents: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Vector-Jacobian products of independent rows: cotangents [k, B, d_out] -> for each x in ``inputs``
    [k, B, d_x] with out[j, b] = cotangents[j, b] @ d o[b] / d x[b]; ``chunk`` cotangents per batched (vmap)
    backward, one at a time where an op has no batching rule."""
    k = cotangents.shape[0]
    out = [torch.empty(k, *x.shape, dtype=x.dtype, device=x.device) for x in inputs]
    start, batched = 0, chunk > 1
    while start < k:
        stop = min(k, start + (chunk if batched else 1))
        if batched:
            try:
                grads = torch.autograd.grad(o, inputs, cotangents[start:stop], retain_graph=True,
                                            is_grads_batched=True)
            except RuntimeError:  # an op without a vmap rule for its backward: one at a time
                batched = False
                continue
        else:
            grads = [g[None] for g in torch.autograd.grad(o, inputs, cotangents[start], retain_graph=True)]
        for store, g in zip(out, grads):
            store[start:stop] = g
        start = stop
    return out


def _jvps(o: torch.Tensor, x: torch.Tensor, tangents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Jacobian-vector products of independent rows: tangents [k, B, d_x] -> [k, B, d_out] with
    out[j, b] = d o[b] / d x[b] @ tangents[j, b], by the double-backward trick: g(u) = J^T u is linear in u,
    so J v = d <g(u), v> / du (needs twice-differentiable ops: see :func:`_jacobian_context`)."""
    u = torch.zeros_like(o, requires_grad=True)
    (g,) = torch.autograd.grad(o, [x], u, retain_graph=True, create_graph=True)
    return _vjps(g, [u], tangents, chunk)[0]


def _orth(Y: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of each row's columns: [k, B, d] -> [B, d, k] (float64 QR)."""
    return torch.linalg.qr(Y.permute(1, 2, 0).double()).Q


def _exact_rows(o: torch.Tensor, zs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """Exact Jacobians [B, d_out, d_x] for each z in ``zs`` from d_out one-hot cotangents (shared by all z)."""
    B, d_out = o.shape
    dtype = torch.float64 if o.dtype == torch.float64 else torch.float32
    Js = [torch.empty(B, d_out, z.shape[1], dtype=dtype) for z in zs]
    for start in range(0, d_out, max(1, chunk)):
        k = min(max(1, chunk), d_out - start)
        v = torch.zeros(k, B, d_out, dtype=o.dtype, device=o.device)
        v[torch.arange(k), :, torch.arange(start, start + k)] = 1
        for J, g in zip(Js, _vjps(o, zs, v, chunk)):
            J[:, start:start + k] = g.permute(1, 0, 2).to("cpu", dtype)
    return Js


def _lowrank_rows(o: torch.Tensor, zs: list[torch.Tensor], k: int, chunk: int, seed: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Randomised range finder with one half power step, per row and per z (Halko et al. 2011, alg. 4.3 with
    q = 1/2): P = orth(J^T G) (k VJPs, shared by every z), Q = orth(J P) (k JVPs), J ~ Q (Q^T J) (k VJPs).
    Returns for each z (U [B, d_out, k] = Q, Vt [B, k, d_x] = Q^T J) on the CPU."""
    B, d_out = o.shape
    gen = torch.Generator().manual_seed(seed)          # the same G for every row and micro-batch
    G = torch.randn(k, 1, d_out, generator=gen, dtype=torch.float64).expand(k, B, d_out)
    rows = _vjps(o, zs, G.to(o.device, o.dtype).contiguous(), chunk)        # [k, B, d_x] per z: J^T G
    out = []
    for z, Z in zip(zs, rows):
        P = _orth(Z).to(o.dtype)                                            # [B, d_x, k]
        Q = _orth(_jvps(o, z, P.permute(2, 0, 1).contiguous(), chunk))      # [B, d_out, k] float64
        (QtJ,) = _vjps(o, [z], Q.to(o.dtype).permute(2, 0, 1).contiguous(), chunk)  # [k, B, d_x]
        dtype = torch.float64 if o.dtype == torch.float64 else torch.float32
        out.append((Q.to("cpu", dtype), QtJ.permute(1, 0, 2).to("cpu", dtype)))
    return out


@contextlib.contextmanager
def _jacobian_context(low_rank: bool) -> Iterator[None]:
    """Gradients on; for low-rank Jacobians attention through the math kernel (the fused CPU/flash kernels
    have no double backward, which the JVPs need)."""
    with torch.enable_grad():
        if not low_rank:
            yield
            return
        with sdpa_kernel([SDPBackend.MATH]):
            yield


def _group_graph(lm, input_ids, mask, subj_pos: torch.Tensor, last_pos: torch.Tensor, layers: list[int],
                 use_cache: bool) -> tuple[torch.Tensor, list[torch.Tensor], dict[int, torch.Tensor]]:
    """Forward pass of one group of left-padded rows with a zero tensor z_l [B, d] (requiring grad) added to the
    subject state at each layer in ``layers``: returns (o [B, d_out] with its graph, [z_l], {layer: clean h}).

    d o / d z_l is the Jacobian with respect to that layer's subject state (later layers recomputed, earlier
    ones fixed), and one backward pass from o reaches every z_l. With ``use_cache`` every row has the same
    subject position p: tokens [0, p) run once without gradients and feed the graph through the KV cache."""
    model = lm.model
    adapter = adapter_for(model)
    device = module_device(adapter.embed if adapter.embed is not None else model)   # inputs (not meta when offloaded)
    input_ids, mask = input_ids.to(device), mask.to(device)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    p = int(subj_pos[0]) if use_cache and adapter._points is None else 0
    kwargs = {}
    if p > 0:
        with torch.no_grad():
            pre_kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            pre = model(input_ids=input_ids[:, :p], attention_mask=mask[:, :p], position_ids=position_ids[:, :p],
                        use_cache=True, **pre_kw)
        cache = getattr(pre, "cache", None)
        if cache is None:
            cache = getattr(pre, "past_key_values", None)
        kwargs = {cache_kwarg(model): cache, "use_cache": True}
    zs: dict[int, torch.Tensor] = {}
    clean: dict[int, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}

    def put(layer):
        def fn(states):
            rows = torch.arange(states.shape[0], device=states.device)
            spos = subj_pos.to(states.device) - p
            clean[layer] = detached_cpu(states[rows, spos])
            z = torch.zeros(states.shape[0], states.shape[-1], dtype=states.dtype, device=states.device,
                            requires_grad=True)
            zs[layer] = z
            add = torch.zeros_like(states)
            add[rows, spos] = z
            return states + add
        return fn

    def get(states):
        seen["o"] = states[torch.arange(states.shape[0], device=states.device), last_pos.to(states.device) - p]
        raise StopForward

    final = output_name(model)
    fns = {state_name(l): put(l) for l in layers}
    if final in fns:  # o is read after the last layer's own perturbation
        last_put = fns[final]
        fns[final] = lambda s: get(last_put(s))
    else:
        fns[final] = get
    with output_hooks(adapter, fns):
        try:
            if adapter._points is not None:  # a model addressed through hook_points(): input ids only
                model(input_ids)
            else:
                model(input_ids=input_ids[:, p:], attention_mask=mask, position_ids=position_ids[:, p:], **kwargs)
        except StopForward:
            pass
    return seen["o"], [zs[l] for l in layers], clean


def jacobian_cost(d_out: int, layers: Sequence[int], n_blocks: int, rank: int | None = None,
                  oversample: int = 10) -> int:
    """Cost per prompt of :func:`subject_jacobians` at ``layers`` of an ``n_blocks``-block model, in products
    times the blocks each runs through (a product from o to layer l crosses blocks l+1 .. n_blocks-1).
    Exact (``rank`` None, or k = rank + oversample >= d_out): d_out VJPs reach every layer at once. Low-rank: k
    VJPs to the first layer (shared), then k JVPs and k VJPs to each layer. On SmolLM2 this predicts the
    measured speed-ups of K = 32, 64, 128 over exact (3.3x, 1.9x, 1.0x; measured 3.5x, 1.8x, 1.0x)."""
    first = n_blocks - 1 - min(layers)
    k = None if rank is None else rank + oversample
    if k is None or k >= d_out:
        return d_out * first
    return k * (first + 2 * sum(n_blocks - 1 - l for l in layers))


def _columns(rank: int, oversample: int, d: int) -> int | None:
    """Columns k = rank + oversample of the low-rank estimator, or None when k >= d (nothing to gain: exact)."""
    k = rank + oversample
    return k if k < d else None


def subject_jacobians(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int | Sequence[int], *,
                      batch_size: int = 16, chunk: int = 64, use_cache: bool = True, rank: int | None = None,
                      oversample: int = 10, seed: int = 0) -> JacobianResult | dict[int, JacobianResult]:
    """Jacobians d o / d h of every filled prompt, batched (see the module doc).

    ``layer``: subject-state layer (``blocks.{layer}.resid_post``), or a list of layers: all of them come from
    the same forward pass (and, for exact Jacobians, the same backward passes) and a dict {layer:
    JacobianResult} is returned. ``batch_size`` prompts per forward pass, ``chunk`` products per batched
    backward; ``use_cache`` reuses the tokens before the subject through the KV cache (rows are grouped by the
    number of tokens after the subject so that they share one position).

    ``rank`` K: low-rank estimator (:func:`_lowrank_rows`, k = K + ``oversample`` columns; its cost against the
    exact one in :func:`jacobian_cost`; random test vectors from ``seed``), exact when k >= d_model. Whether it is
    cheaper than the exact Jacobian is the caller's choice (``llmprobe.analyses.settings.jacobian_rank_for``).
    """
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    single = isinstance(layer, (int, str))
    layers = sorted({adapter.layer_index(l) for l in ([layer] if single else layer)})
    if not layers:
        raise ValueError("subject_jacobians needs at least one layer")
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"the Jacobian rank must be a positive integer or None, got {rank!r}")
    subjects = list(subjects)
    templates = filled_prompts(template, subjects)[0]
    if adapter._points is not None:  # synthetic models: no KV cache API
        use_cache = False
    n = len(subjects)
    if n == 0:
        raise ValueError("subject_jacobians needs at least one subject")
    # columns of the low-rank estimator (None: exact); a model of unknown width settles it at its first pass
    columns = {"k": None if rank is None else _columns(rank, oversample, adapter.d_model or rank + oversample + 1)}

    def one(part: slice) -> list[tuple[torch.Tensor, list[dict]]]:
        """(rows of ``subjects``, per layer {name: tensor}) for each group of one micro-batch."""
        enc = encode(tok, templates[part], subjects[part], padding_side="left")
        after = enc.prompt_last - enc.subject_last
        groups = [torch.nonzero(after == a).flatten() for a in after.unique()] if use_cache \
            else [torch.arange(len(after))]
        done = []
        for rows in groups:
            ids, mask = enc.input_ids[rows], enc.attention_mask[rows]
            keep = mask.bool().any(0)  # drop columns that are padding in every row of the group
            first = int(torch.nonzero(keep)[0])
            ids, mask = ids[:, first:], mask[:, first:]
            with _jacobian_context(columns["k"] is not None):
                o, zs, clean = _group_graph(lm, ids, mask, enc.subject_last[rows] - first,
                                            enc.prompt_last[rows] - first, layers, use_cache)
                if columns["k"] is not None and adapter.d_model is None:
                    columns["k"] = _columns(rank, oversample, o.shape[1])
                if columns["k"] is None:
                    factors = [{"J": J} for J in _exact_rows(o, zs, chunk)]
                else:
                    factors = [{"U": U, "Vt": Vt} for U, Vt in _lowrank_rows(o, zs, columns["k"], chunk, seed)]
            O = detached_cpu(o)
            done.append((torch.arange(part.start, part.stop)[rows],
                         [{**f, "H": clean[l], "O": O} for l, f in zip(layers, factors)]))
        return done

    out: dict[int, dict[str, torch.Tensor]] = {}
    for done in run_batched(one, n, batch_size, stage="Jacobians"):
        for index, per_layer in done:
            for l, parts in zip(layers, per_layer):
                store = out.setdefault(l, {name: torch.empty(n, *t.shape[1:], dtype=t.dtype)
                                           for name, t in parts.items()})
                for name, t in parts.items():
                    store[name][index] = t
    k = columns["k"]
    results = {l: JacobianResult(rank=None if k is None else rank, **out[l]) for l in layers}
    return results[layers[0]] if single else results


def per_prompt_jacobians(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int,
                         vectorize: bool = False) -> JacobianResult:
    """Reference: one prompt at a time with ``torch.autograd.functional.jacobian`` (as in the original LRE code):
    a full forward pass per evaluation of o(h), no padding, no cache."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    layer = adapter.layer_index(layer)
    subjects = list(subjects)
    templates = filled_prompts(template, subjects)[0]
    final = output_name(model)
    device = module_device(adapter.embed if adapter.embed is not None else model)   # not meta under offload
    Js, Hs, Os = [], [], []
    for template_i, subject in zip(templates, subjects):
        enc: EncodedPrompts = encode(tok, template_i, [subject])
        s, last = int(enc.subject_last[0]), int(enc.prompt_last[0])
        ids = enc.input_ids.to(device)
        got = capture(model, [state_name(layer), final], ids, positions=torch.tensor([[s, last]]))
        h0 = got[state_name(layer)][0, 0].to(device)
        o0 = got[final][0, 1]

        def o_of_h(h):
            seen = {}

            def put(states):
                states = states.clone()
                states[0, s] = h
                return states

            def get(states):
                seen["o"] = states[0, last]
                raise StopForward
            fns = {state_name(layer): put, final: get} if state_name(layer) != final else \
                {final: lambda st: get(put(st))}
            with output_hooks(adapter, fns):
                try:
                    model(ids)
                except StopForward:
                    pass
            return seen["o"]

        Js.append(detached_cpu(torch.autograd.functional.jacobian(o_of_h, h0, vectorize=vectorize)))
        Hs.append(detached_cpu(h0))
        Os.append(detached_cpu(o0))
    return JacobianResult(J=torch.stack(Js), H=torch.stack(Hs), O=torch.stack(Os))
