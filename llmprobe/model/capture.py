"""Targeted activation capture and patching.

Only the requested names and token positions are kept; the forward pass stops after the last module that is
needed (when nothing later, such as the logits, is asked for). Works for Hugging Face models through
:class:`~llmprobe.model.adapters.ModelAdapter` and for any model that defines ``hook_points()``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmprobe.model.adapters import ModelAdapter, from_lens_name, is_lens_name
from llmprobe.model.subjects import tokenize


class _StopForward(Exception):
    """Raised inside the last needed hook to end the forward pass early."""


class NonFiniteStatesError(ValueError):
    """The model computed NaN or infinite values: NaN/inf weights, or a half-precision overflow."""

    def __init__(self, where: str, dtype: torch.dtype):
        dtype_name = str(dtype).replace("torch.", "")
        cure = ("its weights hold NaN/inf or values too large for float32: they are corrupt"
                if dtype in (torch.float32, torch.float64) else
                f"its weights hold NaN/inf, or {dtype_name} overflowed: load it in float32 (--dtype float32); if that "
                f"does not help, the weights are corrupt")
        super().__init__(f"the model's states at {where} hold NaN or infinite values ({dtype_name}): {cure}")


def check_finite(states: torch.Tensor, where: str) -> torch.Tensor:
    """``states`` unchanged, or NonFiniteStatesError naming ``where`` when any value is NaN or infinite. (Its
    smallest and largest values are finite exactly when all are: min and max propagate NaN; one pass, no
    [states]-sized boolean tensor as isfinite(states).all() makes.)"""
    if states.numel() and not torch.isfinite(torch.stack(torch.aminmax(states))).all():
        raise NonFiniteStatesError(where, states.dtype)
    return states


def adapter_for(model: nn.Module | ModelAdapter) -> ModelAdapter:
    """The adapter of ``model`` (cached on the module), or of a LoadedModel (its ``adapter``)."""
    if isinstance(model, ModelAdapter):
        return model
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "adapter", None), ModelAdapter):
        return model.adapter
    adapter = getattr(model, "_llmprobe_adapter", None)
    if adapter is None:
        adapter = ModelAdapter(model)
        object.__setattr__(model, "_llmprobe_adapter", adapter)
    return adapter


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate execution device when the model is dispatched with a
    ``device_map`` (weights offloaded to CPU or disk sit on the meta device and are loaded there for each call),
    else the device of its first parameter or buffer; CPU for a module without either."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def module_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module``'s parameter ``name`` with its values: read from accelerate's offload (CPU or disk) when the
    model is dispatched with a device map and the parameter sits on the meta device."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights is None or name not in weights:
        raise RuntimeError(f"{type(module).__name__}.{name} is on the meta device and no offload holds it")
    return weights[name]


def _tensor_of(value):
    """The hidden-state tensor inside a module's input/output (tensor, or first item of a tuple)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def _select(states: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """states [batch, seq, d] -> [batch, k, d] at positions [batch, k] (or all positions if None)."""
    if positions is None:
        return states
    index = positions.to(states.device).unsqueeze(-1).expand(-1, -1, states.shape[-1])
    return states.gather(1, index)


@contextlib.contextmanager
def hooks(adapter: ModelAdapter, fns: dict[str, Callable]) -> Iterator[None]:
    """Register ``fn(tensor) -> tensor | None`` at each name; a returned tensor replaces the hidden state."""
    handles = []
    try:
        for name, fn in fns.items():
            place = adapter.place(name)
            if place.read_input:
                def pre_hook(module, args, kwargs, fn=fn):
                    if args:
                        new = fn(args[0])
                        return None if new is None else ((new, *args[1:]), kwargs)
                    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                    new = fn(kwargs[key])
                    return None if new is None else (args, {**kwargs, key: new})
                handles.append(place.module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            else:
                def hook(module, args, output, fn=fn):
                    new = fn(_tensor_of(output))
                    if new is None:
                        return None
                    return (new, *output[1:]) if isinstance(output, tuple) else new
                handles.append(place.module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _forward_order(adapter: ModelAdapter, names: list[str]) -> list[str]:
    order = {name: i for i, name in enumerate(adapter.names())}
    unknown = [n for n in names if n not in order]
    for name in unknown:
        adapter.place(name)  # raises a clear KeyError
    return sorted(names, key=lambda name: order[from_lens_name(name) if is_lens_name(name) else name])


def tokenized(texts: str | list[str], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """A text or a list of texts as one batch, tokenized as ``llmprobe.encode`` does (left padding, the tokenizer's
    special tokens added): (input_ids [batch, seq], attention_mask [batch, seq]). Padding only for several texts,
    so that one text needs no padding token."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise ValueError("capture: give the text as a string or a non-empty list of strings (or token ids as a "
                         "LongTensor [batch, seq])")
    batch = tokenize(tokenizer, texts, "left", padding=len(texts) > 1)
    return batch["input_ids"], batch["attention_mask"]


def capture(
    model: nn.Module | ModelAdapter,
    names: list[str],
    input_ids: torch.Tensor | str | list[str],
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    to_cpu: bool = True,
    stop_early: bool = True,
    *,
    tokenizer=None,
    **forward_kwargs,
) -> dict[str, torch.Tensor]:
    """Run ``model`` on ``input_ids`` [batch, seq] and keep the states at ``names``.

    ``model``: a LoadedModel (``llmprobe.load_model``), a module or its adapter. ``input_ids`` may instead be a
    text or a list of texts: they are tokenized with the LoadedModel's tokenizer (or ``tokenizer``; a module
    without one is a ValueError asking for it) as one left-padded batch with the tokenizer's special tokens, as
    :func:`tokenized` does, and the attention mask is the tokenizer's (so ``attention_mask`` must be None);
    ``positions`` then index that padded batch. ``positions`` [batch, k] selects token positions (None keeps
    all). Returns ``{name: [batch, k, d]}``, on CPU when ``to_cpu``. The name ``"logits"`` adds the output logits
    [batch, k, vocab] (and runs the whole model); otherwise, with ``stop_early``, the forward pass ends after the
    last requested module. A kept state with a NaN or infinite value raises :class:`NonFiniteStatesError` naming
    its place (the first in forward order).
    """
    adapter = adapter_for(model)
    if not torch.is_tensor(input_ids):
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"capture: text needs a tokenizer and this {type(model).__name__} has none: pass "
                             f"tokenizer=, or a LoadedModel (llmprobe.load_model, llmprobe.as_loaded_model), or "
                             f"token ids")
        if attention_mask is not None:
            raise ValueError("capture: with text, the attention mask is the tokenizer's; leave attention_mask out")
        input_ids, attention_mask = tokenized(input_ids, tokenizer)
    want_logits = "logits" in names
    names = _forward_order(adapter, [n for n in dict.fromkeys(names) if n != "logits"])
    if not names and not want_logits:
        raise ValueError("capture needs at least one hook name")
    last = None if want_logits or not stop_early else names[-1]
    kept: dict[str, torch.Tensor] = {}

    def keeper(name):
        def keep(states):
            selected = check_finite(_select(states, positions).detach(), name)
            kept[name] = selected.cpu() if to_cpu else selected
            if name == last:
                raise _StopForward
        return keep

    with torch.no_grad(), hooks(adapter, {name: keeper(name) for name in names}):
        try:
            output = forward(adapter, input_ids, attention_mask, **forward_kwargs)
        except _StopForward:
            output = None
    if want_logits:
        logits = _select(output.float() if torch.is_tensor(output) else output.logits.float(), positions)
        logits = check_finite(logits, "logits")
        kept["logits"] = logits.cpu() if to_cpu else logits
        names.append("logits")
    return {name: kept[name] for name in names}


def forward(model: nn.Module | ModelAdapter, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            **forward_kwargs):
    """One forward pass with position ids that follow the attention mask, so left padding changes nothing.

    input_ids, attention_mask [batch, seq]. Returns the model's output (``.logits`` [batch, seq, vocab]).
    """
    adapter = adapter_for(model)
    if adapter._points is not None:
        return adapter.model(input_ids)
    device = module_device(adapter.embed)
    inputs = {"input_ids": input_ids.to(device), **forward_kwargs}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask.to(device)
        inputs.setdefault("position_ids", (attention_mask.long().cumsum(-1) - 1).clamp(min=0).to(device))
    return adapter.model(**inputs)


@contextlib.contextmanager
def patch(
    model: nn.Module | ModelAdapter,
    name: str,
    positions: torch.Tensor,
    values: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> Iterator[None]:
    """Within the block, overwrite (``values``) or shift (``delta``) the state at ``name`` and ``positions``.

    ``positions`` [batch] (one position per row); ``values``/``delta`` [batch, d]. Applies to every forward pass
    run inside the ``with`` block whose batch matches.
    """
    if (values is None) == (delta is None):
        raise ValueError("patch needs exactly one of values= or delta=")
    adapter = adapter_for(model)
    change = values if values is not None else delta

    def edit(states):
        if states.shape[0] != positions.shape[0] or states.shape[1] <= int(positions.max()):
            return None  # e.g. later generation steps with a KV cache: nothing to patch there
        states = states.clone()   # on the device of the block that produced or reads it (device maps)
        new = change.to(states.device, states.dtype)
        pos = positions.to(states.device)
        rows = torch.arange(positions.shape[0], device=states.device)
        states[rows, pos] = new if values is not None else states[rows, pos] + new
        return states

    with hooks(adapter, {name: edit}):
        yield
