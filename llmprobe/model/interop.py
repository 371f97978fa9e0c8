"""Bring your own model: probe a model object already in memory, not only a name or folder.

:func:`as_loaded_model` turns any of these into a :class:`~llmprobe.model.loading.LoadedModel`:

* a name or path (or None, the embedded default): :func:`~llmprobe.model.loading.load_model`;
* a ``LoadedModel``: returned as it is;
* a transformers ``PreTrainedModel``, with its tokenizer (or a local folder in ``model.name_or_path`` to read one
  from);
* a TransformerLens ``TransformerBridge``: the Hugging Face model it wraps, rebuilt unwrapped with the default
  attention implementation (the bridge switches the model to eager attention, which sums in another order), and
  the tokenizer from the model's folder (the bridge's own is a copy made to prepend BOS, which shifts every
  position; it is used, and noted, only without a folder or ``tokenizer=``), so the numbers equal a load of the
  same weights by path. A bridge whose weights were processed (``enable_compatibility_mode()`` folds norms and
  centres the residual stream, which changes every state) is reloaded from its local folder; with no folder it
  is an error;
* an nnsight ``TransformersModel(repo_id, task='text-generation')`` (what nnsight recommends) or its deprecated
  ``LanguageModel`` (while nnsight has it): the module it wraps (dispatched first if its weights are not loaded
  yet); one made for another task (``feature-extraction``, ...) wraps no language-model head and is refused.

transformer_lens and nnsight objects are recognised by their class's module, so neither package is imported
unless such an object is passed. The object is probed where it is (its device and dtype); it is put in eval mode.
``info`` records where it came from: ``source: "object"``, ``object_class``, ``path`` (its ``name_or_path``) and a
``weights_hash`` over its state dict, so a rerun can check it probes the same weights.
"""
from __future__ import annotations

import copy
import hashlib
import os
import time
from pathlib import Path

import torch
from torch import nn

from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.loading import (
    LoadedModel,
    ModelLoadError,
    _hub_commit,
    check_tokenizer_fits,
    is_transformers_model,
    load_model,
)

ACCEPTED = ("a model name or folder, a LoadedModel, a transformers PreTrainedModel (with its tokenizer), a "
            "TransformerLens TransformerBridge or an nnsight TransformersModel(repo_id, task='text-generation') (or its "
            "older LanguageModel)")
NNSIGHT_TASK = "text-generation"          # the nnsight TransformersModel task of a causal language model


def as_loaded_model(obj, tokenizer=None, **load_options) -> LoadedModel:
    """A :class:`LoadedModel` for ``obj`` (see the module docstring for what it may be).

    ``tokenizer``: the tokenizer of a model object (a bridge's or nnsight model's own is used when None).
    ``load_options`` (``device``, ``dtype``, ``gguf_file``, ...) go to ``load_model`` for a name or path and are
    ignored for an object, which stays on its device and dtype. Errors are :class:`ModelLoadError`."""
    if obj is None or isinstance(obj, (str, os.PathLike)):
        if tokenizer is not None:
            raise ModelLoadError("tokenizer= goes with a model object; a model name or folder loads its own tokenizer")
        return load_model(None if obj is None else str(obj), **load_options)
    if isinstance(obj, LoadedModel):
        return obj
    start = time.perf_counter()
    cls = type(obj)
    object_class = f"{cls.__module__}.{cls.__qualname__}"
    note = None
    if cls.__module__.startswith("transformer_lens"):
        if cls.__name__ == "HookedTransformer":
            raise ModelLoadError(
                "a HookedTransformer holds its weights in TransformerLens' layout, folded and centred by default, "
                "which changes the residual stream; llmprobe cannot map them back. Pass the Hugging Face model or its "
                "name/folder, or boot a TransformerBridge (TransformerBridge.boot_transformers) without "
                "enable_compatibility_mode()")
        if not hasattr(obj, "original_model"):
            raise ModelLoadError(f"cannot probe a {object_class}: expected {ACCEPTED}")
        if getattr(obj, "_weights_processed", False):
            return _reload_processed(obj, tokenizer, object_class, start)
        model = unwrap_bridge(obj.original_model)
        if tokenizer is None:
            tokenizer, note = _bridge_tokenizer(obj, model)
    elif cls.__module__.startswith("nnsight"):
        if not hasattr(obj, "_module"):
            raise ModelLoadError(f"cannot probe a {object_class}: expected {ACCEPTED}")
        task = getattr(obj, "task", None)            # LanguageModel pins text-generation; older nnsight has no task
        if task not in (None, NNSIGHT_TASK):
            raise ModelLoadError(f"this {object_class} was made for the {task!r} task, which has no language-model "
                                 f"head to probe; make it with TransformersModel(repo_id, task={NNSIGHT_TASK!r})")
        if not getattr(obj, "dispatched", True):
            obj.dispatch()          # a LanguageModel made from a name holds meta tensors until dispatched
        tokenizer = tokenizer or getattr(obj, "tokenizer", None)
        model = obj._module
    elif is_transformers_model(obj):
        model = unwrap_bridge(obj) if _is_bridged(obj) else obj
    else:
        raise ModelLoadError(f"cannot probe a {object_class}: expected {ACCEPTED}")
    if not is_transformers_model(model):
        raise ModelLoadError(f"{object_class} wraps a {type(model).__name__}, not a transformers PreTrainedModel")
    return _loaded(model, tokenizer or _folder_tokenizer(model), object_class, start, note)


def unwrap_bridge(model: nn.Module) -> nn.Module:
    """A plain copy of a Hugging Face model that a TransformerBridge has wrapped: same class, config, generation
    config and weights, the default attention implementation (a path load's), on the same device and dtype. The
    bridge and its model are left as they are."""
    from transformers import (
        AutoModelForCausalLM,  # lazy: start-up time: the CLI's checks and errors do not load transformers
    )

    param = next(model.parameters())
    # from_dict drops the bridge's eager attention choice; a bridge booted from a name also sets output_attentions
    # (which would make generate return a dict with every attention pattern): off, as in a path load
    config = type(model.config).from_dict({**model.config.to_dict(), "output_attentions": False})
    with torch.random.fork_rng(devices=[]):         # random init, overwritten below: the caller's RNG is untouched
        plain = AutoModelForCausalLM.from_config(config, dtype=param.dtype)
    wanted = plain.state_dict()
    state = {key.replace("_original_component.", ""): value for key, value in model.state_dict().items()}
    missing = [key for key in wanted if key not in state]
    if missing:
        raise ModelLoadError(f"cannot unwrap the bridged {type(model).__name__}: its state dict lacks "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    plain.load_state_dict({key: state[key] for key in wanted})
    plain.generation_config = copy.deepcopy(model.generation_config)    # the folder's generation_config.json
    plain.name_or_path = plain.config.name_or_path = model.name_or_path
    return plain.to(param.device).eval()


def state_dict_hash(model: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes and bytes, in name order): one value per set of weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def _is_bridged(model: nn.Module) -> bool:
    """Whether a TransformerBridge has wrapped this model's modules (it does so in place)."""
    return any(type(module).__module__.startswith("transformer_lens") for module in model.modules())


def _bridge_tokenizer(bridge, model: nn.Module) -> tuple[object, str | None]:
    """(tokenizer, note) for a bridge passed without one: the model's own tokenizer, read from its folder.
    TransformerLens gives the bridge a copy that prepends BOS, which shifts every position against a path load;
    it is used (and noted) only when there is no folder."""
    if Path(getattr(model, "name_or_path", "") or "").is_dir():
        return _folder_tokenizer(model), None
    return bridge.tokenizer, ("the bridge's tokenizer (TransformerLens makes it prepend BOS); pass tokenizer= for "
                              "the model's own")


def _reload_processed(bridge, tokenizer, object_class: str, start: float) -> LoadedModel:
    """A bridge with processed weights: the raw weights again, from its local folder."""
    folder = getattr(bridge.original_model, "name_or_path", "") or ""
    if not Path(folder).is_dir():
        raise ModelLoadError(
            "this TransformerBridge's weights were processed (enable_compatibility_mode() folds the norms and "
            "centres the writing weights, which changes every residual state), and its model "
            f"{folder or '(no name)'!r} is not a local folder to reload the raw weights from. Boot the bridge "
            "without enable_compatibility_mode(), or pass the model's folder or name")
    param = next(bridge.original_model.parameters())
    lm = load_model(folder, device=str(param.device), dtype=param.dtype)
    return _loaded(lm.model, tokenizer or lm.tokenizer, object_class, start,
                   f"the bridge's weights were processed; raw weights reloaded from {folder}")


def _folder_tokenizer(model: nn.Module):
    """The tokenizer saved with the model, when ``model.name_or_path`` is a local folder."""
    folder = getattr(model, "name_or_path", "") or ""
    if not Path(folder).is_dir():
        raise ModelLoadError(
            f"a {type(model).__name__} object needs its tokenizer: pass tokenizer=... (its name_or_path "
            f"{folder!r} is not a local folder to load one from)")
    from transformers import AutoTokenizer  # lazy: start-up time: the CLI's checks and errors do not load transformers

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"no tokenizer given and none could be loaded from {folder}: {error}; pass "
                             f"tokenizer=...") from error


def _loaded(model: nn.Module, tokenizer, object_class: str, start: float, note: str | None = None) -> LoadedModel:
    """Wrap a transformers model (put in eval mode) and its tokenizer (given a pad token if it has none)."""
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_tokenizer_fits(tokenizer, model, f"given with the {object_class}")
    adapter = ModelAdapter(model)
    path = getattr(model, "name_or_path", "") or None
    info = {
        "name": path or type(model).__name__,
        "source": "object",
        "object_class": object_class,
        "path": path,
        "architecture": type(model).__name__,
        "model_type": adapter.model_type,
        "n_layers": adapter.n_layers,
        "d_model": adapter.d_model,
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(adapter.embed.weight.dtype).replace("torch.", ""),
        "device": str(adapter.embed.weight.device),
        "device_map": None,
        "revision": _hub_commit(model),
        "weights_hash": state_dict_hash(model),
        "load_seconds": round(time.perf_counter() - start, 2),
    }
    if note:
        info["note"] = note
    return LoadedModel(model, tokenizer, adapter, info)
