"""Prompt encoding with subject location.

The subject's tokens are found from the fast tokenizer's offset mapping and verified by decoding them; where
offsets are unreliable (some Llama-3 style tokenizers), a token-subsequence search is the fallback. Positions are
returned in padded-batch coordinates, for left and right padding alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SLOT = "{}"


class SubjectNotFoundError(ValueError):
    """A subject could not be located in its prompt."""


@dataclass
class EncodedPrompts:
    """A padded batch with the positions that probes read.

    ``input_ids``/``attention_mask`` [batch, seq]; ``subject_first``/``subject_last``/``prompt_last`` [batch]:
    token indices in the padded sequence; ``located_by`` per row: "offsets" or "subsequence".
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    subject_first: torch.Tensor
    subject_last: torch.Tensor
    prompt_last: torch.Tensor
    located_by: list[str]

    def to(self, device) -> "EncodedPrompts":
        return EncodedPrompts(self.input_ids.to(device), self.attention_mask.to(device), self.subject_first,
                              self.subject_last, self.prompt_last, self.located_by)


def fill(template: str, subject: str) -> tuple[str, tuple[int, int]]:
    """Put ``subject`` into the template's ``{}`` slot; returns the prompt and the subject's character span."""
    if SLOT not in template:
        raise ValueError(f"template {template!r} has no '{{}}' subject slot")
    start = template.index(SLOT)
    prompt = template[:start] + subject + template[start + len(SLOT):]
    return prompt, (start, start + len(subject))


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _subsequence(haystack: list[int], needle: list[int]) -> int:
    """Start of the last occurrence of ``needle`` in ``haystack``, or -1."""
    for start in range(len(haystack) - len(needle), -1, -1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return -1


def locate(tokenizer, ids: list[int], offsets: list[tuple[int, int]], special: list[int],
           subject: str, span: tuple[int, int]) -> tuple[int, int, str]:
    """Token range [first, last] of ``subject`` in one unpadded token row; raises SubjectNotFoundError.

    ``offsets`` come from the fast tokenizer (char start, end per token), ``special`` marks special tokens.
    """
    start, end = span
    hits = [i for i, (a, b) in enumerate(offsets) if not special[i] and b > a and a < end and b > start]
    if hits and _norm(subject) in _norm(tokenizer.decode(ids[hits[0]:hits[-1] + 1])):
        return hits[0], hits[-1], "offsets"
    for variant in (" " + subject, subject):
        needle = tokenizer(variant, add_special_tokens=False)["input_ids"]
        first = _subsequence(ids, needle) if needle else -1
        if first >= 0:
            return first, first + len(needle) - 1, "subsequence"
    raise SubjectNotFoundError(f"subject {subject!r} not found in the prompt tokens {tokenizer.decode(ids)!r}")


def tokenize(tokenizer, texts: list[str], padding_side: str = "left", **options):
    """``tokenizer(texts, return_tensors="pt", **options)`` padded on ``padding_side`` for this call only (the
    tokenizer's own side is put back)."""
    saved_side, tokenizer.padding_side = tokenizer.padding_side, padding_side
    try:
        return tokenizer(texts, return_tensors="pt", **options)
    finally:
        tokenizer.padding_side = saved_side


def encode(tokenizer, templates: list[str] | str, subjects: list[str], padding_side: str = "left") -> EncodedPrompts:
    """Fill each template with its subject, tokenize as a padded batch and locate every subject.

    ``templates`` is one template for all rows or one per row. Raises SubjectNotFoundError naming the subject
    (the caller decides whether to skip that fact).
    """
    if isinstance(templates, str):
        templates = [templates] * len(subjects)
    if len(templates) != len(subjects):
        raise ValueError(f"{len(templates)} templates for {len(subjects)} subjects")
    filled = [fill(t, s) for t, s in zip(templates, subjects)]
    prompts = [p for p, _ in filled]
    batch = tokenize(tokenizer, prompts, padding_side, padding=True, return_offsets_mapping=True,
                     return_special_tokens_mask=True)
    mask = batch["attention_mask"]
    first, last, prompt_last, how = [], [], [], []
    for row, (subject, (_, span)) in enumerate(zip(subjects, filled)):
        keep = mask[row].bool()
        index = torch.nonzero(keep).squeeze(1)
        ids = batch["input_ids"][row][keep].tolist()
        offsets = [tuple(o) for o in batch["offset_mapping"][row][keep].tolist()]
        special = batch["special_tokens_mask"][row][keep].tolist()
        try:
            a, b, method = locate(tokenizer, ids, offsets, special, subject, span)
        except SubjectNotFoundError as error:
            raise SubjectNotFoundError(f"{error} (prompt {prompts[row]!r})") from None
        first.append(int(index[a]))
        last.append(int(index[b]))
        prompt_last.append(int(index[-1]))
        how.append(method)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return EncodedPrompts(batch["input_ids"], mask, as_long(first), as_long(last), as_long(prompt_last), how)


def locate_errors(tokenizer, template: str, subjects: list[str]) -> list[str | None]:
    """Per subject: None when its tokens can be located in the filled ``template``, else the reason it can't."""
    errors = []
    for subject in subjects:
        try:
            encode(tokenizer, template, [subject])
            errors.append(None)
        except SubjectNotFoundError as error:
            errors.append(str(error))
    return errors
