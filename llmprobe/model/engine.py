"""The forward and edit engine every analysis of a pretrained model runs on (layer 2): subject states, next-token
predictions through the model's own readout, and edited passes resumed from a layer (the prefix-cached edits).

Places (``docs/measures.md``):

* ``h`` = ``blocks.{l}.resid_post`` at the subject's last token (the subject state at layer ``l``);
* ``o`` = ``blocks.{L-1}.resid_post`` at the prompt's last token: the output of the *last block, before the final
  norm*. ``adapter.logits(o)`` (final norm + LM head) turns it into next-token logits, so faithfulness is scored
  through the model's own readout.

An edit adds ``delta`` [n, d] to ``h`` and reads the next token: :func:`edited_predictions` runs each distinct
prompt's tokens before the subject once and every edit only from the subject on (:func:`prefix_cached_predictions`),
its ids equal to the full resumed pass's (:func:`next_token_predictions` with ``resume``). The Jacobians and the
LRE operator are in ``llmprobe.model.lre``; objects are scored by their *first token*
(``llmprobe.model.known.first_token_ids``), ``llmprobe.model.scoring`` offers full-sequence log-probabilities.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import adapter_for, capture, hooks, module_device, patch
from llmprobe.model.subjects import EncodedPrompts, encode

__all__ = ["RelationStates", "output_name", "state_name", "relation_states", "subject_states", "logits_fn",
           "line_argmax", "next_token_predictions", "shared_prefix_logits", "next_token_ids", "layer_sequences",
           "prefix_cached_predictions",
           "edited_predictions", "detached_cpu", "filled_prompts", "StopForward", "output_hooks", "cache_kwarg"]


def state_name(layer: int) -> str:
    """Hook name of the subject state at ``layer``."""
    return f"blocks.{layer}.resid_post"


def output_name(model) -> str:
    """Hook name of ``o``: the last block's output (before the final norm)."""
    return state_name(adapter_for(_module(model)).n_layers - 1)


def _module(model):
    return model.model if hasattr(model, "adapter") and hasattr(model, "tokenizer") else model


def detached_cpu(x: torch.Tensor) -> torch.Tensor:
    """Detached CPU copy in float64 for float64 models, else float32."""
    return x.detach().to("cpu", torch.float64 if x.dtype == torch.float64 else torch.float32)


def filled_prompts(template: str | Sequence[str], subjects: list[str]) -> tuple[list[str], list[str]]:
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
    templates, prompts = filled_prompts(template, subjects)
    layers = [adapter.layer_index(l) for l in layers]
    out = output_name(model)
    names = list(dict.fromkeys([state_name(l) for l in layers] + [out]))

    def states(part: slice) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        enc = encode(tok, templates[part], subjects[part], padding_side="left")
        positions = torch.stack([enc.subject_last, enc.prompt_last], 1)
        got = capture(model, names, enc.input_ids, enc.attention_mask, positions=positions)
        return {l: detached_cpu(got[state_name(l)][:, 0]) for l in layers}, detached_cpu(got[out][:, 1])

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
            return {l: detached_cpu(got[state_name(l)][:, 0]) for l in layers}

        parts = run_batched(states, len(subjects), batch_size, stage="subject states", lm=lm,
                            prompts=filled_prompts(template, subjects)[1])
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
    templates, prompts = filled_prompts(template, subjects)
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


SHARED_PREFIX_MIN = 16     # tokens: below this common prefix the prompts run whole (nothing worth caching)


def shared_prefix_logits(lm, template: str | Sequence[str], subjects: Sequence[str],
                         batch_size: int = 64) -> torch.Tensor | None:
    """Next-token logits [n, vocab] after each filled prompt, as :func:`next_token_predictions` computes them
    (``return_logits``, no edit) up to the order of float sums, with the tokens every prompt starts with (e.g. the
    in-context examples before the subject) run once: their KV cache is copied into each micro-batch of
    ``batch_size`` prompts, which runs only its own tokens after them (right-padded, positions continuing the
    prefix's). None where the prompts share fewer than :data:`SHARED_PREFIX_MIN` tokens (each keeps at least one
    of its own) or the model is driven through hook points without a KV cache API. :func:`next_token_ids` turns
    the logits into the full passes' ids bit for bit."""
    model, tok = lm.model, lm.tokenizer
    adapter = adapter_for(model)
    if adapter._points is not None or adapter.blocks is None or not len(subjects):
        return None
    templates, _ = filled_prompts(template, list(subjects))
    enc = encode(tok, templates, list(subjects), padding_side="right")
    ids, mask = enc.input_ids, enc.attention_mask
    lengths = mask.sum(1)
    same = (ids == ids[:1]).cumprod(1).sum(1)                 # each row's run of tokens equal to row 0's
    shared = int(min(int(same.min()), int(lengths.min()) - 1))
    if shared < SHARED_PREFIX_MIN:
        return None
    device = module_device(adapter.embed if adapter.embed is not None else model)
    out, to_logits, kwarg = output_name(model), logits_fn(lm), cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:1, :shared].to(device), attention_mask=mask[:1, :shared].to(device), use_cache=True,
              **{kwarg: cache})
    results = []
    for start in range(0, len(ids), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(ids)))
        width = int(lengths[rows].max()) - shared
        mine = _cache_rows(cache, torch.zeros(len(rows), dtype=torch.long, device=device))   # the prefix's row, repeated
        last = (lengths[rows] - 1 - shared)[:, None]
        positions = torch.arange(shared, shared + width).expand(len(rows), -1)
        o = capture(model, [out], ids[rows, shared:shared + width].to(device),
                    mask[rows, :shared + width].to(device), positions=last.to(device),
                    position_ids=positions.to(device), use_cache=True, **{kwarg: mine})[out][:, 0]
        results.append(to_logits(o))
    return torch.cat(results)


def next_token_ids(lm, template: str | Sequence[str], subjects: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """The ids of ``next_token_predictions(lm, template, subjects, batch_size=batch_size)``, bit for bit, mostly
    from :func:`shared_prefix_logits` (the prompts' common tokens run once): a row whose top-1 logit leads its
    runner-up there by less than ``_MARGIN`` has its micro-batch of the full pass run (as
    :func:`edited_predictions`). LongTensor [n]; prompts without a common prefix worth caching: the full pass."""
    logits = shared_prefix_logits(lm, template, subjects, batch_size)
    if logits is None:
        return next_token_predictions(lm, template, subjects, batch_size=batch_size)
    top = logits.float().topk(2, dim=-1)
    settled = (top.values[:, 0] - top.values[:, 1]) >= _MARGIN
    return next_token_predictions(lm, template, subjects, batch_size=batch_size,
                                  known=(top.indices[:, 0].cpu(), settled.cpu()))


def layer_sequences(lm, template: str | Sequence[str], subjects: Sequence[str], layer: int,
                    batch_size: int = 64) -> list[torch.Tensor]:
    """Clean ``blocks.{layer}.resid_post`` states of each filled prompt at every token, unpadded: [T_i, d]
    per prompt (what :func:`next_token_predictions` resumes from)."""
    model, tok = lm.model, lm.tokenizer
    subjects = list(subjects)
    templates, prompts = filled_prompts(template, subjects)
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
    templates, prompts = filled_prompts(template, subjects)
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
        raise StopForward
    kwargs = {"use_cache": True, cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    with torch.no_grad(), _resumed_at(adapter, layer, states), output_hooks(adapter, {output_name(model): get}):
        try:
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **kwargs)
        except StopForward:
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


class StopForward(Exception):
    """Raised in the last block's hook: nothing after it is needed."""


@contextlib.contextmanager
def output_hooks(adapter, fns: dict[str, Callable]) -> Iterator[None]:
    """Forward hooks on module outputs (``blocks.{l}.resid_post``); ``fn(states)`` may return new states."""
    for name in fns:
        if adapter.place(name).read_input:
            raise ValueError(f"{name!r} is read from a module input; Jacobians need a module output")
    with hooks(adapter, fns):
        yield


def cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
