"""Micro-batches under a memory budget, halved and retried on out-of-memory: the one helper every batched stage
runs through.

``run_batched(fn, n, batch_size, stage=..., lm=None, prompts=None, new_tokens=0) -> list``

* ``fn(part: slice) -> result`` runs one micro-batch, items ``part.start .. part.stop - 1`` of ``n``; the
  results come back as a list, one per micro-batch, in order (the caller concatenates them).
* Micro-batches hold at most ``batch_size`` items. With ``lm`` and ``prompts`` (the items' prompt texts) on a
  CUDA model the first size is also capped by the free device memory (:func:`memory_batch_size`: a rough
  activation estimate from the model's width, depth and the longest prompt plus ``new_tokens``).
* On an out-of-memory error (:func:`llmprobe.checks.is_out_of_memory`: CUDA's ``torch.OutOfMemoryError``, a
  failed CPU allocation) the micro-batch size halves and the same micro-batch is run again; the rest of the
  stage keeps the smaller size, and later calls with the same ``stage`` name start from it. The halving is
  printed once per stage (stderr). At size 1 the error is raised again as :class:`OutOfMemoryAtOne` (a
  ``torch.OutOfMemoryError``) whose message names the stage and says what to try.

``fn`` must be a pure function of its slice (no state carried between calls), so a retried micro-batch gives
what an un-failed run gives.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from llmprobe.checks import is_out_of_memory
from llmprobe.model.capture import adapter_for

T = TypeVar("T")
MEMORY_FRACTION = 0.5          # of the free device memory that one micro-batch's activations may take

class OutOfMemoryAtOne(torch.OutOfMemoryError):
    """Out of memory with a micro-batch of one item: a smaller ``--batch-size`` cannot help (the message says
    what can)."""


_stage_size: dict[str, int] = {}    # stage -> micro-batch size that worked after a halving (this process)
_warned: set[str] = set()


def run_batched(fn: Callable[[slice], T], n: int, batch_size: int, *, stage: str, lm=None,
                prompts: Sequence[str] | None = None, new_tokens: int = 0) -> list[T]:
    """``fn`` over ``n`` items in micro-batches of at most ``batch_size``; see the module doc."""
    if batch_size < 1:
        raise ValueError(f"{stage}: batch size must be at least 1, got {batch_size}")
    size = min(batch_size, _stage_size.get(stage, batch_size))
    if lm is not None and prompts:
        size = min(size, memory_batch_size(lm, prompts, new_tokens))
    results: list[T] = []
    start = 0
    while start < n:
        part = slice(start, min(n, start + size))
        failed = None
        try:
            results.append(fn(part))
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error):
                raise
            failed = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        if failed is None:
            start = part.stop
            continue
        _free_cache()
        if size == 1:
            raise OutOfMemoryAtOne(
                f"{stage}: out of memory with a micro-batch of 1 ({failed}). A single item does not fit: spread or "
                f"offload the model (--device-map auto --max-memory ... --offload-folder DIR), load it in half "
                f"precision (--dtype bfloat16), or shorten the prompts (--max-prompt-tokens); --batch-size cannot "
                f"go lower")
        size = max(1, size // 2)
        _stage_size[stage] = size
        if stage not in _warned:
            _warned.add(stage)
            print(f"llmprobe: {stage}: out of memory; micro-batch size halved to {size} and retried (set "
                  f"--batch-size {size} to start there)", file=sys.stderr, flush=True)
    return results


def _free_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def item_bytes(lm, n_tokens: int) -> int:
    """Rough bytes one prompt of ``n_tokens`` needs in one forward pass: the KV cache of every block, one
    block's working activations (residual, attention, MLP hidden), the attention scores and a float32 row of
    logits per token."""
    config = getattr(lm.model, "config", None)
    adapter = adapter_for(lm.model)
    d, layers = adapter.d_model or 1, adapter.n_layers
    d_ff = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
    vocab = getattr(config, "vocab_size", None) or 0
    element = next(lm.model.parameters()).element_size()
    per_token = element * (2 * layers * d + 8 * d + 3 * d_ff + heads * n_tokens) + 4 * vocab
    return n_tokens * per_token


def memory_batch_size(lm, prompts: Sequence[str], new_tokens: int = 0) -> int:
    """How many prompts fit in ``MEMORY_FRACTION`` of the free memory of the model's fullest CUDA device
    (:func:`item_bytes` of the longest prompt plus ``new_tokens``); a very large number when the model has no
    CUDA device (CPU memory is not budgeted: the OOM retry covers it)."""
    devices = {p.device for p in lm.model.parameters() if p.device.type == "cuda"}
    if not devices:
        return sys.maxsize
    free = min(torch.cuda.mem_get_info(device)[0] for device in devices)
    longest = max(len(ids) for ids in lm.tokenizer(list(prompts))["input_ids"]) + new_tokens
    return max(1, int(free * MEMORY_FRACTION) // item_bytes(lm, longest))
