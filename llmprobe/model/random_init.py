"""The random-init control of both worlds: the same architecture with fresh random weights, seeded.

One function, :func:`random_init`, serves a pretrained model (a :class:`~llmprobe.model.loading.LoadedModel`,
returned wrapped with the original tokenizer) and any ``nn.Module`` (a synthetic fact-recall model among them).
The global RNG state is left as it was."""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.capture import module_device
from llmprobe.model.loading import LoadedModel, is_transformers_model


def random_init(model, seed: int = 0):
    """``model`` (a LoadedModel or an nn.Module) at a fresh random init under ``seed``: a LoadedModel comes back
    as a LoadedModel (weights frozen, tokenizer shared, ``info`` naming the control), a module as a module."""
    if not isinstance(model, LoadedModel):
        return _random_module(model, seed)
    module = _random_module(model.model, seed).requires_grad_(False)
    info = {**model.info, "name": f"{model.info.get('name', 'model')} (random init, seed {seed})",
            "source": "random", "weights_hash": None}
    return LoadedModel(module, model.tokenizer, ModelAdapter(module), info)


def _random_module(module: nn.Module, seed: int) -> nn.Module:
    """``module``'s architecture at a fresh random init under ``seed``. Three kinds of module, each
    re-initialised by its own init scheme:

    * a ``transformers`` model: ``AutoModelForCausalLM.from_config(module.config)`` under ``seed``;
    * a module built from a seeded dataclass config (``module.config.seed``, e.g. ``FactRecallModel``, which draws
      its init from its own generator): ``type(module)(replace(module.config, seed=seed))``;
    * any other module: a copy with every sub-module's ``reset_parameters()`` called under ``seed``. A parameter
      that no ``reset_parameters`` covers would keep its trained value, so that is an error (ValueError).

    The result is on the source's device and dtype (a source split by a device map: the whole copy on the
    device where its embedding computes), in eval mode; the global RNG state is left as it was."""
    param = next(module.parameters(), None)
    device = None
    if param is not None:
        embed = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
        device = module_device(embed if isinstance(embed, nn.Module) else module)
    config = getattr(module, "config", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if is_transformers_model(module):
            model = AutoModelForCausalLM.from_config(config)
        elif dataclasses.is_dataclass(config) and hasattr(config, "seed"):
            model = type(module)(dataclasses.replace(config, seed=seed))
        else:
            model = copy.deepcopy(module)
            covered = set()
            for sub in model.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                    covered.update(id(p) for p in sub.parameters(recurse=False))
            kept = [name for name, p in model.named_parameters() if id(p) not in covered]
            if kept:
                raise ValueError(f"cannot re-initialise {type(module).__name__}: no reset_parameters() covers "
                                 f"{kept[:5]}{' ...' if len(kept) > 5 else ''} (they would keep their trained values)")
    if param is not None:
        model.to(device, param.dtype)
    return model.eval()


__all__ = ["random_init"]
