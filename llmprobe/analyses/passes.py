"""The passes an analysis makes, counted without a model (layer 3): batches of (rows, padded tokens) in the order
the project batches them, the prefix-cached edits' passes, greedy generation, the Jacobians' prompt lengths, and the
facts a plan assumes known. Each analysis counts its own work with these beside its code (its record's
``workload``, ``llmprobe.analyses.record``); ``llmprobe.jobs.workload`` adds them up and ``llmprobe.jobs.plan``
prices them.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmprobe.model.subjects import encode


def length_batches(lengths: list[int], batch_size: int) -> list[tuple[int, int]]:
    """(rows, padded tokens) of each batch of rows of these token ``lengths``, in order."""
    return [(len(lengths[i:i + batch_size]), max(lengths[i:i + batch_size]))
            for i in range(0, len(lengths), batch_size)]


def padded_batches(tok, prompts: list[str], batch_size: int) -> list[tuple[int, int]]:
    """(rows, padded tokens) of each batch, in the order the project batches them."""
    if not prompts:
        return []
    return length_batches([len(ids) for ids in tok(prompts)["input_ids"]], batch_size)


def cached_edit_batches(prompts: list[tuple[int, int]], rows: int, batch_size: int
                        ) -> list[tuple[list[tuple[int, int]], bool]]:
    """The passes of ``llmprobe.model.engine.edited_predictions`` for ``rows`` edits cycling through ``prompts``
    ((tokens before the subject's last, tokens from it to the end) per distinct prompt, :func:`jacobian_prompts`):
    each distinct prompt's tokens before the subject once, without the LM head, and each edit's tokens from the
    subject on, with it; as [(batches of (rows, padded tokens), head)] (the rare micro-batches run again near a tie
    are not counted)."""
    edited = [prompts[i % len(prompts)] for i in range(rows)] if prompts else []
    return [(length_batches([before for before, _ in prompts[:rows]], batch_size), False),
            (length_batches([after for _, after in edited], batch_size), True)]


def generation_batches(tok, prompts: list[str], budgets: list[int], batch_size: int = 32
                       ) -> list[tuple[int, int, int]]:
    """(rows, padded prompt tokens, generated tokens) per batch of ``llmprobe.model.known.greedy_tokens`` with
    these new-token ``budgets`` (one per prompt): its ordering, by budget and then prompt length."""
    if not prompts:
        return []
    lengths = [len(ids) for ids in tok(prompts)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i])))
    out = []
    for i in range(0, len(order), batch_size):
        chunk = order[i:i + batch_size]
        out.append((len(chunk), max(lengths[j] for j in chunk), max(budgets[j] for j in chunk)))
    return out


def jacobian_prompts(tok, template: str | list[str], subjects: list[str]) -> list[tuple[int, int]]:
    """(tokens before the subject's last token, tokens from it to the prompt's end) per prompt (one template, or
    one per subject)."""
    enc = encode(tok, template, subjects, padding_side="left")
    out = []
    for row in range(len(subjects)):
        n = int(enc.attention_mask[row].sum())
        pad = enc.input_ids.shape[1] - n
        s, last = int(enc.subject_last[row]) - pad, int(enc.prompt_last[row]) - pad
        out.append((s, last - s + 1))
    return out


@dataclass(frozen=True)
class PlannedFact:
    """A fact as the analyses read a known-facts result (``llmprobe.model.known.FactResult``'s fields they use)."""

    subject: str
    object: str
    known: bool


def assumed_known(relations: list, known_counts: dict | None) -> dict[str, list[PlannedFact]]:
    """Relation name -> its facts, the first ``known_counts[name]`` of them known (None: every fact): which
    facts a model knows is learnt only when it runs; the plan takes each relation's first ones."""
    return {rel.name: [PlannedFact(f.subject, f.object, known_counts is None or i < known_counts.get(rel.name, 0))
                       for i, f in enumerate(rel.facts)] for rel in relations}


def empty_passes() -> dict:
    """An empty count of an analysis' passes (:class:`Analysis.workload`'s form): forward passes [(batches, blocks,
    LM head)], prefix-cached edits (the same), greedy generation [(rows, prompt tokens, new tokens)], random twins
    built."""
    return {"forward": [], "edits": [], "generate": [], "twins": 0}


def filled_batches(tok, templates: list[str], subjects: list[str], batch_size: int) -> list[tuple[int, int]]:
    """:func:`padded_batches` of each template filled with its subject."""
    return padded_batches(tok, [t.replace("{}", s, 1) for t, s in zip(templates, subjects)], batch_size)
