"""Known facts and object tokens.

A fact (s, r, a) is *known* when the model's greedy continuation of the relation prompt starts with a (case and
leading space ignored). Objects are scored by their *first token* by default: the first token that differs when
" " + object is appended to the prompt.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import NonFiniteStatesError, capture
from llmprobe.model.subjects import fill


@dataclass
class FactResult:
    """One fact checked against the model's greedy continuation."""

    subject: str
    object: str
    prompt: str
    continuation: str
    known: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(text: str) -> str:
    return " ".join(text.split()).casefold()


def is_known(continuation: str, obj: str) -> bool:
    """True when the continuation starts with the object, case and leading whitespace ignored."""
    target = _clean(obj)
    return bool(target) and _clean(continuation).startswith(target)


class _FiniteScores:
    """A ``generate`` logits processor that passes the next-token scores [batch, vocab] on unchanged, after
    checking that none is NaN or +inf (NonFiniteStatesError for a model computing in ``dtype`` otherwise). Only
    the largest score is checked: the processors generate() runs before this one may set scores to -inf."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(scores.amax()):
            raise NonFiniteStatesError("the logits while generating", self.dtype)
        return scores


def greedy_continuations(lm, prompts: list[str], max_new_tokens: int | list[int] = 8,
                         batch_size: int = 32) -> list[str]:
    """Greedy continuation text of each prompt (left-padded batches, no sampling).

    ``max_new_tokens`` may be one number per prompt: prompts are then batched by length of continuation needed,
    and each batch generates only as many tokens as its longest need. Batches go through
    ``llmprobe.model.batching.run_batched`` (at most ``batch_size``, fewer under a memory budget or after an
    out-of-memory error). NaN or infinite logits raise NonFiniteStatesError naming the first place in the model
    where the prompts' last states stop being finite.
    """
    tok = lm.tokenizer
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i])))

    def generate(part: slice) -> list[str]:
        chunk = order[part]
        batch = tok([prompts[i] for i in chunk], return_tensors="pt", padding=True).to(lm.device)
        with torch.no_grad():
            try:
                out = lm.model.generate(**batch, max_new_tokens=max(budgets[i] for i in chunk), do_sample=False,
                                        pad_token_id=tok.pad_token_id, return_dict_in_generate=True,
                                        logits_processor=[_FiniteScores(lm.adapter.embed.weight.dtype)]).sequences
            except NonFiniteStatesError:          # which place first: capture raises naming it
                last = torch.full((len(chunk), 1), batch["input_ids"].shape[1] - 1)
                capture(lm.model, lm.adapter.names(), batch["input_ids"], batch["attention_mask"], positions=last)
                raise
        return tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    saved_side, tok.padding_side = tok.padding_side, "left"
    try:
        parts = run_batched(generate, len(order), batch_size, stage="known facts", lm=lm, prompts=prompts,
                            new_tokens=max(budgets, default=0))
    finally:
        tok.padding_side = saved_side
    texts: list[str] = [""] * len(prompts)
    for i, text in zip(order, (text for part in parts for text in part)):
        texts[i] = text
    return texts


def known_facts(lm, relation, template: str | None = None, max_new_tokens: int | None = None,
                batch_size: int = 32) -> list[FactResult]:
    """Check every fact of ``relation`` with its first (or the given) template.

    Each prompt generates one token more than its object has (or ``max_new_tokens``), enough to decide the
    prefix match.
    """
    template = template or relation.templates[0]
    prompts = [fill(template, fact.subject)[0] for fact in relation.facts]
    if max_new_tokens is None:
        budget = [min(len(seq) + 1, 16) for seq in object_token_sequences(
            lm.tokenizer, prompts, [f.object for f in relation.facts])]
    else:
        budget = max_new_tokens
    texts = greedy_continuations(lm, prompts, budget, batch_size)
    return [FactResult(f.subject, f.object, p, t, is_known(t, f.object))
            for f, p, t in zip(relation.facts, prompts, texts)]


def object_split(tokenizer, prompt: str, obj: str, add_special_tokens: bool = False) -> tuple[list[int], int]:
    """The tokens of ``prompt + " " + object`` and the index of the object's first token in them: the first token
    that differs from the prompt's own tokenization (so tokenizers that merge the space into the word, or not,
    are both handled). The one place objects are tokenized."""
    base = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    full = tokenizer(prompt + " " + obj.strip(), add_special_tokens=add_special_tokens)["input_ids"]
    cut = next((i for i, (a, b) in enumerate(zip(base, full)) if a != b), min(len(base), len(full)))
    if cut >= len(full) or (add_special_tokens and cut == 0):
        raise ValueError(f"object {obj!r} adds no token after prompt {prompt!r}")
    return full, cut


def object_token_sequences(tokenizer, prompts: list[str], objects: list[str]) -> list[list[int]]:
    """All tokens of each object as it follows its prompt (``object_split``)."""
    out = []
    for prompt, obj in zip(prompts, objects):
        full, cut = object_split(tokenizer, prompt, obj)
        out.append(full[cut:])
    return out


def first_token_ids(tokenizer, prompts: list[str], objects: list[str]) -> torch.Tensor:
    """Id of each object's first token as it would follow its prompt: LongTensor [n]."""
    return torch.tensor([seq[0] for seq in object_token_sequences(tokenizer, prompts, objects)], dtype=torch.long)
