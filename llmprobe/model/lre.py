"""Model side of the linear relation decoder (LRE, Hernandez et al. 2023): states, batched Jacobians, edits.

Places (``docs/measures.md``):

* ``h`` = ``blocks.{l}.resid_post`` at the subject's last token (the subject state at layer ``l``);
* ``o`` = ``blocks.{L-1}.resid_post`` at the prompt's last token: the output of the *last block, before the final
  norm*. ``adapter.logits(o)`` (final norm + LM head) turns it into next-token logits, so faithfulness is scored
  through the model's own readout.

Jacobians ``J_i = d o_i / d h_i`` are computed for a whole batch of prompts at once. The subject state is replaced
by a leaf tensor (requiring grad) inside a forward hook, and the rows of a batch never interact (attention stays
within a row), so one backward pass of ``sum_i o_i[k]`` gives row ``k`` of every prompt's Jacobian; those backward
passes are themselves batched over blocks of output dimensions with ``is_grads_batched`` (vmap). With
``use_cache=True`` (default) the tokens before the subject's last token are run once without gradients and reused
through the KV cache, so the backward passes only cover the tokens from the subject's last token to the end of the
prompt. Low-rank Jacobians (``rank=K``) replace the d_out backward passes by a randomised range finder: about
3(K + 10) vector-Jacobian and Jacobian-vector products per prompt and layer (:func:`_lowrank_rows`), whose mean
over prompts is the best rank-K approximation of W up to the estimator's error (docs/measures.md).
``per_prompt_jacobians`` is the one-prompt-at-a-time ``torch.autograd.functional.jacobian`` reference (the
original LRE code's approach), kept for tests and the benchmark.

Objects are scored by their *first token* (``llmprobe.model.known.first_token_ids``); ``llmprobe.model.scoring`` offers
full-sequence log-probabilities.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import adapter_for, capture, hooks, module_device, patch
from llmprobe.model.subjects import EncodedPrompts, encode

__all__ = ["RelationStates", "JacobianResult", "output_name", "state_name", "relation_states", "subject_states",
           "subject_jacobians", "jacobian_cost", "per_prompt_jacobians", "logits_fn", "line_argmax",
           "next_token_predictions", "layer_sequences", "prefix_cached_predictions", "edited_predictions"]


def state_name(layer: int) -> str:
    """Hook name of the subject state at ``layer``."""
    return f"blocks.{layer}.resid_post"


def output_name(model) -> str:
    """Hook name of ``o``: the last block's output (before the final norm)."""
    return state_name(adapter_for(_module(model)).n_layers - 1)


def _module(model):
    return model.model if hasattr(model, "adapter") and hasattr(model, "tokenizer") else model


def _cpu(x: torch.Tensor) -> torch.Tensor:
    """Detached CPU copy in float64 for float64 models, else float32."""
    return x.detach().to("cpu", torch.float64 if x.dtype == torch.float64 else torch.float32)


def _filled(template: str | Sequence[str], subjects: list[str]) -> tuple[list[str], list[str]]:
    """(one template per subject, the filled prompts) for ``template``: one template or one per subject."""
    templates = [template] * len(subjects) if isinstance(template, str) else list(template)
    return templates, [t.replace("{}", s, 1) for t, s in zip(templates, subjects)]


# --------------------------------------------------------------------------------------------------- states
@dataclass
class RelationStates:
    """Clean states of one template filled with each subject.

    ``H[l]`` [n, d] subject states at layer l, ``O`` [n, d] last-block output at the prompt's last token,
    ``prompts`` the filled prompts, ``subjects`` in order.
    """

    subjects: list[str]
    prompts: list[str]
    H: dict[int, torch.Tensor]
    O: torch.Tensor


def relation_states(lm, template: str | Sequence[str], subjects: Sequence[str], layers: Sequence[int],
                    batch_size: int = 32) -> RelationStates:
    """One batched forward per ``batch_size`` prompts (``llmprobe.model.batching.run_batched``: fewer under a memory
    budget or after an out-of-memory error): subject states at ``layers`` and ``o`` (stops after the last block;
    the LM head is not run). ``template`` is one template or one per subject."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    subjects = list(subjects)
    templates, prompts = _filled(template, subjects)
    layers = [adapter.layer_index(l) for l in layers]
    out = output_name(model)
    names = list(dict.fromkeys([state_name(l) for l in layers] + [out]))

    def states(part: slice) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        enc = encode(tok, templates[part], subjects[part], padding_side="left")
        positions = torch.stack([enc.subject_last, enc.prompt_last], 1)
        got = capture(model, names, enc.input_ids, enc.attention_mask, positions=positions)
        return {l: _cpu(got[state_name(l)][:, 0]) for l in layers}, _cpu(got[out][:, 1])

    parts = run_batched(states, len(subjects), batch_size, stage="relation states", lm=lm, prompts=prompts)
    return RelationStates(subjects, prompts, {l: torch.cat([H[l] for H, _ in parts]) for l in layers},
                          torch.cat([O for _, O in parts]))


def subject_states(lm, templates: Sequence[str], subjects: Sequence[str], layers: Sequence[int],
                   batch_size: int = 64) -> dict[int, torch.Tensor]:
    """Subject states at ``layers``, averaged over ``templates`` (e.g. relation-free ones): {layer: [n, d]}."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    layers = [adapter.layer_index(l) for l in layers]
    names = [state_name(l) for l in layers]
    sums = {l: 0.0 for l in layers}
    subjects = list(subjects)
    for template in templates:
        def states(part: slice, template=template) -> dict[int, torch.Tensor]:
            enc = encode(tok, template, subjects[part], padding_side="left")
            got = capture(model, names, enc.input_ids, enc.attention_mask, positions=enc.subject_last[:, None])
            return {l: _cpu(got[state_name(l)][:, 0]) for l in layers}

        parts = run_batched(states, len(subjects), batch_size, stage="subject states", lm=lm,
                            prompts=_filled(template, subjects)[1])
        for l in layers:
            sums[l] = sums[l] + torch.cat([got[l] for got in parts])
    return {l: sums[l] / len(templates) for l in layers}


def logits_fn(lm) -> Callable[[torch.Tensor], torch.Tensor]:
    """o [n, d] -> next-token logits [n, vocab] through the model's final norm and LM head (float32, no grad)."""
    adapter = adapter_for(_module(lm))
    dtype = next(_module(lm).parameters()).dtype
    head = adapter.final_norm if adapter.final_norm is not None else adapter.lm_head
    device = module_device(head) if head is not None else module_device(_module(lm))

    def fn(o: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return adapter.logits(torch.as_tensor(o).to(device, dtype)).float().cpu()
    return fn


_SCALE_FREE_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its gain g, or None
_MARGIN = 2e-3     # logit units: a top-1 lead below this takes the real head's answer (the two paths differ by at
                   # most 5e-5 logits on SmolLM2's states: float32 sums and the norm's epsilon)


def _scale_free_gain(lm) -> torch.Tensor | None:
    """The gain g [d] when the final norm and LM head are, up to a positive factor per row, the linear map
    x -> lm_head(g * x) (an RMS norm and a head without bias, float32): then argmax logits(x) = argmax of that map.
    Checked on random rows against ``adapter.logits`` (LayerNorm's centring and bias, logit soft-capping or a
    half-precision head fail the check): None when it does not hold. Computed once per model."""
    model = _module(lm)
    if model in _SCALE_FREE_HEADS:
        return _SCALE_FREE_HEADS[model]
    adapter = adapter_for(model)
    gain = None
    head, norm = adapter.lm_head, adapter.final_norm
    if head is not None and getattr(head, "bias", None) is None and head.weight.dtype == torch.float32:
        device = module_device(head)
        x = torch.randn(8, adapter.d_model, generator=torch.Generator().manual_seed(0)).to(device) * 3
        with torch.no_grad():
            normed = norm(x.to(module_device(norm))).to(device) if norm is not None else x
            g = (normed * _rms(x) / x).mean(0)                       # RMS norm: normed = g * x / rms(x)
            exact = adapter.logits(x).float()
            fast = head(g * x).float()
        if torch.allclose(exact * _rms(x), fast, rtol=1e-4, atol=1e-4 * float(fast.abs().max())):
            gain = g
    _SCALE_FREE_HEADS[model] = gain
    return gain


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1, keepdim=True).sqrt()


def line_argmax(lm, A: torch.Tensor, B: torch.Tensor, betas: Sequence[float]) -> torch.Tensor:
    """Top-1 next token of ``logits_fn(lm)(beta * A + B)`` for every beta: LongTensor [len(betas), n] (A, B [n, d]).

    The same ids as calling the head once per beta. Where the final norm is an RMS norm and the head has no bias
    (Llama, Qwen, Mistral, Gemma without soft-capping: :func:`_scale_free_gain`), logits(x) is a positive factor per
    row times lm_head(g * x), which is linear in x: two head calls serve every beta, and a row whose top-1 leads
    its runner-up by less than ``_MARGIN`` logits (far above float32 error) takes the real head's answer, from one
    call on all rows as the one-call-per-beta path makes it, so a near-tie is decided as that path decides it.
    Other heads: one call per beta."""
    to_logits = logits_fn(lm)
    gain = _scale_free_gain(lm)
    if gain is None:
        return torch.stack([to_logits(beta * A + B).argmax(-1) for beta in betas])
    head = adapter_for(_module(lm)).lm_head
    device = module_device(head)
    with torch.no_grad():
        FA, FB = (head(gain * torch.as_tensor(M).to(device, torch.float32)).double().cpu() for M in (A, B))
    out = []
    for beta in betas:
        o = beta * A + B
        top = torch.add(FB, FA, alpha=beta).topk(2, dim=-1)
        lead = (top.values[:, 0] - top.values[:, 1]) / (_rms(o).squeeze(-1).double().cpu() + 0.1)  # norm's eps
        ids = top.indices[:, 0].clone()
        close = lead < _MARGIN
        if bool(close.any()):                 # the rows as one call on all of them makes (a GEMM's sums, not a GEMV's)
            ids[close] = to_logits(o).argmax(-1)[close]
        out.append(ids)
    return torch.stack(out)


def next_token_predictions(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int | None = None,
                           delta: torch.Tensor | None = None, batch_size: int = 64, return_logits: bool = False,
                           resume: Sequence[torch.Tensor] | None = None,
                           known: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Greedy next token after each filled prompt, with ``delta`` [n, d] added to the subject state at ``layer``
    (a real forward pass with the edited state patched in). Returns LongTensor [n] (or logits [n, vocab]).

    ``resume``: the clean states of ``blocks.{layer}.resid_post`` for each row's whole prompt (unpadded [T_i, d],
    from :func:`layer_sequences`). The forward pass then starts at block ``layer + 1`` from those states plus
    the edit, skipping the blocks that an edit at ``layer`` cannot change (same result, fewer FLOPs).
    ``known``: (ids [n], settled [n] bool), ids already found for the settled rows: a micro-batch whose rows are
    all settled is not run and gives those ids (the others run as without ``known``, in the same micro-batches,
    so their ids are bit for bit those of a call without it)."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    subjects = list(subjects)
    templates, prompts = _filled(template, subjects)
    out = output_name(model)
    to_logits = logits_fn(lm)
    if resume is not None and (delta is None or adapter.blocks is None):
        resume = None

    def predict(part: slice) -> torch.Tensor:
        if known is not None and not return_logits and bool(known[1][part].all()):
            return known[0][part]
        enc = encode(tok, templates[part], subjects[part], padding_side="left")
        if resume is not None:
            o = _resumed_output(lm, enc, layer, delta[part], resume[part])
        else:
            edit = contextlib.nullcontext() if delta is None else \
                patch(model, state_name(layer), enc.subject_last, delta=delta[part])
            with edit:
                o = capture(model, [out], enc.input_ids, enc.attention_mask,
                            positions=enc.prompt_last[:, None])[out][:, 0]
        logits = to_logits(o)
        return logits if return_logits else logits.argmax(-1)

    return torch.cat(run_batched(predict, len(subjects), batch_size, stage="next-token predictions", lm=lm,
                                 prompts=prompts))


def layer_sequences(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int,
                    batch_size: int = 64) -> list[torch.Tensor]:
    """Clean ``blocks.{layer}.resid_post`` states of each filled prompt at every token, unpadded: [T_i, d]
    per prompt (what :func:`next_token_predictions` resumes from)."""
    model, tok = lm.model, lm.tokenizer
    subjects = list(subjects)
    templates, prompts = _filled(template, subjects)
    name = state_name(adapter_for(model).layer_index(layer))

    def sequences(part: slice) -> list[torch.Tensor]:
        enc = encode(tok, templates[part], subjects[part], padding_side="left")
        states = capture(model, [name], enc.input_ids, enc.attention_mask, to_cpu=False)[name]
        return [states[row][enc.attention_mask[row].bool().to(states.device)] for row in range(states.shape[0])]

    parts = run_batched(sequences, len(subjects), batch_size, stage="layer sequences", lm=lm, prompts=prompts)
    return [seq for part in parts for seq in part]


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def _resumed_at(adapter, layer: int, states: torch.Tensor) -> Iterator[None]:
    """Within it a forward pass skips blocks 0..``layer`` (they pass their input through) and block ``layer + 1``
    receives ``states`` instead of its input."""
    def replace(module, args, kwargs):
        if args:
            return (states, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": states}

    skipped = list(adapter.blocks[:layer + 1])
    own = [block.__dict__.get("forward") for block in skipped]   # accelerate's dispatch wrapper, if any
    handle = adapter.blocks[layer + 1].register_forward_pre_hook(replace, with_kwargs=True)
    try:
        for block in skipped:
            block.forward = _passthrough
        yield
    finally:
        handle.remove()
        for block, forward in zip(skipped, own):
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward


def _left_padded(seqs: Sequence[torch.Tensor], length: int, dtype, device) -> torch.Tensor:
    """Each of ``seqs`` ([n_i, d], n_i <= ``length``) right-aligned in zeros: [len(seqs), length, d]."""
    out = torch.zeros(len(seqs), length, seqs[0].shape[-1], dtype=dtype, device=device)
    for row, seq in enumerate(seqs):
        if seq.shape[0]:
            out[row, length - seq.shape[0]:] = seq.to(device, dtype)
    return out


def _resumed_output(lm, enc: EncodedPrompts, layer: int, delta: torch.Tensor, clean: Sequence[torch.Tensor]):
    """o for a batch whose layer-``layer`` states are ``clean`` + ``delta`` at the subject: blocks 0..layer
    pass their input through, and block ``layer + 1`` receives the given states instead."""
    model = lm.model
    adapter = adapter_for(model)
    dtype = next(model.parameters()).dtype
    device = clean[0].device     # where block ``layer`` wrote them (accelerate moves them on to the next block)
    B, T = enc.input_ids.shape
    for seq, n in zip(clean, enc.attention_mask.sum(1).tolist()):
        if seq.shape[0] != n:
            raise ValueError(f"resume states have {seq.shape[0]} tokens but the prompt has {n}")
    states = _left_padded(clean, T, dtype, device)
    rows = torch.arange(B, device=device)
    states[rows, enc.subject_last.to(device)] += delta.to(device, dtype)
    if layer == adapter.n_layers - 1:
        return states[rows, enc.prompt_last.to(device)]
    with _resumed_at(adapter, layer, states):
        out = output_name(model)
        return capture(model, [out], enc.input_ids, enc.attention_mask, positions=enc.prompt_last[:, None],
                       to_cpu=False, use_cache=False)[out][:, 0]


def prefix_cached_predictions(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int,
                              delta: torch.Tensor, resume: Sequence[torch.Tensor], batch_size: int = 64,
                              return_logits: bool = False) -> torch.Tensor:
    """What ``next_token_predictions(lm, template, subjects, layer, delta, resume=resume)`` computes, for edits at
    the subject's last token, with each prompt's tokens before the subject run once: an edit at position p
    changes no state before p, so the keys and values of tokens [0, p) at every block after ``layer`` are those
    of the clean prompt. The distinct filled prompts (e.g. one source prompt under several edits) are grouped by
    their number of tokens after the subject and left-padded; per group of ``batch_size`` prompts one pass over
    their tokens [0, p), resumed at block ``layer + 1`` from the clean states of ``resume``, fills a KV cache
    (blocks 0..``layer``, which the resumed passes skip, hold zeros of that length so the cache's length is
    right), then each ``batch_size`` of their edited rows runs only the tokens [p, end] from block ``layer + 1``
    on that cache. Logits [n, vocab] (or ids [n]): those of the full passes up to the order of float sums
    (attention over a cache and other padding; float64 logits to 1e-9 in tests/test_lre_protocol.py, float32 on
    SmolLM2 within 5e-5): :func:`edited_predictions` turns them into the full passes' ids bit for bit. Models
    without a KV cache API (``hook_points()``) and edits at the last block take :func:`next_token_predictions`."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    layer = adapter.layer_index(layer)
    if not _caches_prefix(adapter, layer):
        return next_token_predictions(lm, template, subjects, layer, delta, return_logits=return_logits,
                                      resume=resume)
    subjects = list(subjects)
    templates, prompts = _filled(template, subjects)
    dtype = next(model.parameters()).dtype
    device = module_device(adapter.embed if adapter.embed is not None else model)
    to_logits = logits_fn(lm)
    rows_of: dict[str, list[int]] = {}              # each distinct prompt's rows, in order of first appearance
    for i, prompt in enumerate(prompts):
        rows_of.setdefault(prompt, []).append(i)
    rows = list(rows_of.values())
    firsts = [r[0] for r in rows]
    enc = encode(tok, [templates[i] for i in firsts], [subjects[i] for i in firsts], padding_side="left")
    width = enc.input_ids.shape[1]
    n_tokens = enc.attention_mask.sum(1)
    after = enc.prompt_last - enc.subject_last                          # tokens after the subject's last
    before = n_tokens - 1 - after                                       # real tokens before it
    for j, first in enumerate(firsts):
        if resume[first].shape[0] != int(n_tokens[j]):
            raise ValueError(f"resume states have {resume[first].shape[0]} tokens but the prompt has "
                             f"{int(n_tokens[j])}")
    results: list[torch.Tensor | None] = [None] * len(prompts)
    for a in after.unique().tolist():
        group = torch.nonzero(after == a).flatten().tolist()
        for start in range(0, len(group), batch_size):
            part = group[start:start + batch_size]
            p = int(before[part].max())
            ids = enc.input_ids[part, width - (p + a + 1):].to(device)        # [g, p + a + 1], left-padded
            pre_mask = enc.attention_mask[part, width - (p + a + 1):width - (a + 1)].to(device)
            cache = _prefix_cache(lm, layer, ids[:, :p], pre_mask,
                                  [resume[firsts[j]][:int(before[j])] for j in part], dtype) if p else None
            edited = [(q, row) for q, j in enumerate(part) for row in rows[j]]
            for begin in range(0, len(edited), batch_size):
                chunk = edited[begin:begin + batch_size]
                which = torch.tensor([q for q, _ in chunk], device=device)
                mine = [row for _, row in chunk]
                states = torch.stack([resume[row][-(a + 1):] for row in mine]).to(device, dtype)
                states[:, 0] += delta[mine].to(device, dtype)
                mask = torch.cat([pre_mask[which], torch.ones(len(chunk), a + 1, dtype=pre_mask.dtype,
                                                              device=device)], 1)
                o = _run_resumed(lm, layer, states, ids[which, p:], mask, (mask.cumsum(-1) - 1)[:, p:],
                                 None if cache is None else _cache_rows(cache, which))
                logits = to_logits(o)
                got = logits if return_logits else logits.argmax(-1)
                for k, row in enumerate(mine):
                    results[row] = got[k]
    return torch.stack(results)


def _run_resumed(lm, layer: int, states: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                 position_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Blocks ``layer + 1``.. on ``states`` [B, t, d] (``ids`` [B, t] give the shapes; ``mask`` [B, past + t]
    covers the cache's tokens too): o at the last position [B, d_out]; ``cache`` is filled as it goes."""
    model = lm.model
    adapter = adapter_for(model)
    seen = {}

    def get(h):
        seen["o"] = h[:, -1]
        raise _Stop
    kwargs = {"use_cache": True, _cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    with torch.no_grad(), _resumed_at(adapter, layer, states), _output_hooks(adapter, {output_name(model): get}):
        try:
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **kwargs)
        except _Stop:
            pass
    return seen["o"]


def _prefix_cache(lm, layer: int, ids: torch.Tensor, mask: torch.Tensor, clean: list[torch.Tensor], dtype):
    """KV cache of the clean tokens ``ids`` [g, p] (left-padded, ``mask`` [g, p]) at the blocks after ``layer``,
    from their clean layer-``layer`` states ``clean`` ([p_i, d] each); blocks 0..``layer`` hold zeros of length p
    (never read: the resumed passes skip them; they give the cache its length)."""
    model = lm.model
    states = _left_padded(clean, ids.shape[1], dtype, ids.device)
    cache = DynamicCache(config=model.config)
    _run_resumed(lm, layer, states, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
    filled = cache.layers[layer + 1]
    for skipped in cache.layers[:layer + 1]:
        skipped.update(torch.zeros_like(filled.keys), torch.zeros_like(filled.values))
    return cache


def _cache_rows(cache, rows: torch.Tensor):
    """A copy of ``cache`` holding its batch rows ``rows`` (the original is left as it is)."""
    mine = copy.copy(cache)
    mine.layers = [copy.copy(layer) for layer in cache.layers]
    mine.batch_select_indices(rows)
    return mine


def _caches_prefix(adapter, layer: int) -> bool:
    """Can :func:`prefix_cached_predictions` run this model's blocks after ``layer`` on a KV cache (Hugging Face
    blocks, not hook points, and at least one block after it)?"""
    return adapter._points is None and adapter.blocks is not None and adapter.layer_index(layer) < adapter.n_layers - 1


def edited_predictions(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int,
                       delta: torch.Tensor, resume: Sequence[torch.Tensor], batch_size: int = 64) -> torch.Tensor:
    """The ids of ``next_token_predictions(lm, template, subjects, layer, delta, batch_size, resume=resume)``, bit
    for bit, mostly from :func:`prefix_cached_predictions` (the tokens before the subject run once per prompt):
    a row whose top-1 logit leads its runner-up by less than ``_MARGIN`` there (far above the two paths' float
    difference) is one whose id the order of float sums could flip, and its micro-batch of the full resumed pass
    is run (``known``) so that its id is that pass's. LongTensor [n]."""
    if not _caches_prefix(adapter_for(lm.model), layer):
        return next_token_predictions(lm, template, subjects, layer, delta, batch_size=batch_size, resume=resume)
    logits = prefix_cached_predictions(lm, template, subjects, layer, delta, resume, return_logits=True)
    top = logits.float().topk(2, dim=-1)
    settled = (top.values[:, 0] - top.values[:, 1]) >= _MARGIN
    return next_token_predictions(lm, template, subjects, layer, delta, batch_size=batch_size, resume=resume,
                                  known=(top.indices[:, 0].cpu(), settled.cpu()))


# ------------------------------------------------------------------------------------------------ Jacobians
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


class _Stop(Exception):
    """Raised in the last block's hook: nothing after it is needed."""


@contextlib.contextmanager
def _output_hooks(adapter, fns: dict[str, Callable]) -> Iterator[None]:
    """Forward hooks on module outputs (``blocks.{l}.resid_post``); ``fn(states)`` may return new states."""
    for name in fns:
        if adapter.place(name).read_input:
            raise ValueError(f"{name!r} is read from a module input; Jacobians need a module output")
    with hooks(adapter, fns):
        yield


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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
        kwargs = {_cache_kwarg(model): cache, "use_cache": True}
    zs: dict[int, torch.Tensor] = {}
    clean: dict[int, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}

    def put(layer):
        def fn(states):
            rows = torch.arange(states.shape[0], device=states.device)
            spos = subj_pos.to(states.device) - p
            clean[layer] = _cpu(states[rows, spos])
            z = torch.zeros(states.shape[0], states.shape[-1], dtype=states.dtype, device=states.device,
                            requires_grad=True)
            zs[layer] = z
            add = torch.zeros_like(states)
            add[rows, spos] = z
            return states + add
        return fn

    def get(states):
        seen["o"] = states[torch.arange(states.shape[0], device=states.device), last_pos.to(states.device) - p]
        raise _Stop

    final = output_name(model)
    fns = {state_name(l): put(l) for l in layers}
    if final in fns:  # o is read after the last layer's own perturbation
        last_put = fns[final]
        fns[final] = lambda s: get(last_put(s))
    else:
        fns[final] = get
    with _output_hooks(adapter, fns):
        try:
            if adapter._points is not None:  # a model addressed through hook_points(): input ids only
                model(input_ids)
            else:
                model(input_ids=input_ids[:, p:], attention_mask=mask, position_ids=position_ids[:, p:], **kwargs)
        except _Stop:
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
    templates = _filled(template, subjects)[0]
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
            O = _cpu(o)
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
    templates = _filled(template, subjects)[0]
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
                raise _Stop
            fns = {state_name(layer): put, final: get} if state_name(layer) != final else \
                {final: lambda st: get(put(st))}
            with _output_hooks(adapter, fns):
                try:
                    model(ids)
                except _Stop:
                    pass
            return seen["o"]

        Js.append(_cpu(torch.autograd.functional.jacobian(o_of_h, h0, vectorize=vectorize)))
        Hs.append(_cpu(h0))
        Os.append(_cpu(o0))
    return JacobianResult(J=torch.stack(Js), H=torch.stack(Hs), O=torch.stack(Os))
