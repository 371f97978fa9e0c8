"""Scoring multi-token objects.

Default: **first-token scoring**. An object is represented by the first token it adds when ``" " + object`` follows
the prompt (``llmprobe.model.known.first_token_ids``), and a prediction counts as correct when the model's (or the
decoder's) argmax next token equals it. Objects that share their first token (``South Africa``/``South Korea``)
cannot be told apart this way; :func:`first_token_collisions` counts them so reports can say so.

Under the ``lre`` protocol a prediction counts when the decoded token is a non-empty prefix of the object
(``llmprobe.model.known.prefix_hit``, the LRE reference's rule). :class:`Scorer` applies either rule; the known-fact
filter (``llmprobe.model.known.known_facts``) uses the same one, so a model scores 1 on its own known facts.

Option: **full-sequence scoring**, the log-probability of all the object's tokens given the prompt (teacher
forcing), optionally with an edit patched into the forward pass (:func:`sequence_logprobs`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import forward, patch
from llmprobe.model.known import first_token_ids, object_split, prefix_hit
from llmprobe.model.subjects import encode
from llmprobe.names import FIRST_TOKEN, SCORING_MODES, SEQUENCE

__all__ = ["FIRST_TOKEN", "SEQUENCE", "SCORING_MODES", "Scorer", "first_token_targets", "first_token_collisions",
           "object_continuations", "sequence_logprobs", "attribute_token_ids"]


class Scorer:
    """Hits of predicted next tokens against objects under a protocol's rule: the exact first token ``y``
    (protocol "strict") or :func:`~llmprobe.model.known.prefix_hit` of the decoded token (protocol "lre")."""

    def __init__(self, tokenizer, y: torch.Tensor, objects: list[str], protocol: str):
        self.tokenizer, self.y, self.objects, self.protocol = tokenizer, y, objects, protocol
        self._text: dict[int, str] = {}

    def _decoded(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token])
        return self._text[token]

    def hits(self, predicted: torch.Tensor, objects: torch.Tensor) -> torch.Tensor:
        """predicted [m] token ids, objects [m] indices of the facts whose object is the target -> Bool [m]."""
        if self.protocol == "strict":
            return predicted.cpu() == self.y[objects]
        return torch.tensor([prefix_hit(self._decoded(int(p)), self.objects[i])
                             for p, i in zip(predicted.tolist(), objects.tolist())], dtype=torch.bool)


def first_token_targets(tokenizer, prompts: Sequence[str], objects: Sequence[str]) -> torch.Tensor:
    """LongTensor [n]: each object's first token as it follows its prompt."""
    return first_token_ids(tokenizer, list(prompts), list(objects))


def first_token_collisions(token_ids: Sequence[int], names: Sequence[str]) -> int:
    """How many distinct names share their first token with another distinct name."""
    by_token: dict[int, set] = {}
    for t, name in zip(token_ids, names):
        by_token.setdefault(int(t), set()).add(name)
    return sum(len(v) for v in by_token.values() if len(v) > 1)


def attribute_token_ids(tokenizer, attributes: Sequence[str]) -> list[list[int]]:
    """Tokens of each attribute written after a space (``" " + a``), without special tokens: the unembedding
    rows that stand for it (first token, or all of them for the mean)."""
    out = []
    for a in attributes:
        ids = tokenizer(" " + a.strip(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"attribute {a!r} tokenizes to nothing")
        out.append(ids)
    return out


def object_continuations(tokenizer, prompts: Sequence[str], objects: Sequence[str]) -> list[tuple[list[int], int]]:
    """For each (prompt, object): the token ids of ``prompt + " " + object`` (with the tokenizer's special
    tokens) and the index of the object's first token in them (``llmprobe.model.known.object_split``)."""
    return [object_split(tokenizer, prompt, obj, add_special_tokens=True) for prompt, obj in zip(prompts, objects)]


def sequence_logprobs(lm, templates: str | Sequence[str], subjects: Sequence[str], objects: Sequence[str], *,
                      layer: int | None = None, delta: torch.Tensor | None = None, batch_size: int = 32,
                      normalize: bool = False) -> torch.Tensor:
    """Full-sequence score of each object: sum over its tokens of log p(token | prompt, earlier object tokens).

    ``templates``: one template or one per row, filled with ``subjects``. With ``delta`` [n, d] the subject state
    at ``blocks.{layer}.resid_post`` (subject's last token) is shifted by it in the same forward pass (the edit
    is applied to the prompt part; object tokens come after it). ``normalize``: divide by the number of object
    tokens (mean log-probability). Returns FloatTensor [n].
    """
    tok = lm.tokenizer
    subjects, objects = list(subjects), list(objects)
    templates = [templates] * len(subjects) if isinstance(templates, str) else list(templates)
    if not len(templates) == len(subjects) == len(objects):
        raise ValueError(f"{len(templates)} templates, {len(subjects)} subjects, {len(objects)} objects")
    if delta is not None and layer is None:
        raise ValueError("delta needs the layer it is added at")
    # right padding keeps every prompt token at its unpadded position
    located = encode(tok, templates, subjects, padding_side="right")
    prompts = [t.replace("{}", s, 1) for t, s in zip(templates, subjects)]
    seqs = object_continuations(tok, prompts, objects)
    for i, (_, cut) in enumerate(seqs):
        if int(located.subject_last[i]) >= cut:
            raise ValueError(f"subject {subjects[i]!r} is not before the object in {prompts[i]!r}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def score(part: slice) -> list[torch.Tensor]:
        chunk = seqs[part]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (full, _) in enumerate(chunk):
            ids[row, :len(full)] = torch.tensor(full)
            mask[row, :len(full)] = 1
        edit = contextlib.nullcontext() if delta is None else patch(
            lm.model, f"blocks.{layer}.resid_post", located.subject_last[part], delta=delta[part])
        with torch.no_grad(), edit:
            logits = forward(lm.model, ids, mask).logits.float().cpu()
        logp = torch.log_softmax(logits, -1)
        scores = []
        for row, (full, cut) in enumerate(chunk):
            targets = torch.tensor(full[cut:])
            picked = logp[row, torch.arange(cut - 1, len(full) - 1), targets]
            scores.append(picked.mean() if normalize else picked.sum())
        return scores

    parts = run_batched(score, len(seqs), batch_size, stage="sequence scores", lm=lm, prompts=prompts,
                        new_tokens=max((len(full) - cut for full, cut in seqs), default=0))
    return torch.stack([s for part in parts for s in part])
