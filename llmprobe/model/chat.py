"""Prompts in the model's chat template (``--chat-template``, run setting ``chat_template``).

An instruct model is prompted as it was trained: a user turn asks to complete the sentence (:data:`INSTRUCTION`)
and the assistant turn starts with the completion prompt, left open::

    tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION},
                                   {"role": "assistant", "content": PROMPT}],
                                  tokenize=False, continue_final_message=True)

The rendered text before the prompt does not depend on the prompt (:func:`chat_prefix`), so a relation's
templates are wrapped once, before the run (:func:`chat_relations`): ``prefix + template``. The prompt stays
verbatim at the end, so the subject's tokens are located as in a plain prompt, and every stage and analysis reads
the same wrapped prompts. In-context examples (protocol lre, ``n_icl``) go inside the assistant turn, after the
prefix (:func:`chat_split`). A rendered text that opens with the BOS token, for a tokenizer that adds BOS itself,
loses that BOS text (the tokenizer puts it back once).
"""
from __future__ import annotations

import dataclasses

from llmprobe.checks import UsageError
from llmprobe.datasets import Relation
from llmprobe.model.subjects import SLOT

INSTRUCTION = "Complete the sentence."   # the user turn before every prompt (recorded in report.json)
SENTINEL = "\ue000llmprobe prompt\ue000"   # stands for the prompt while the template renders (private-use chars)


def adds_bos(tokenizer) -> bool:
    """True when the tokenizer puts its BOS token before a text itself (``add_special_tokens=True``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return with_special[:1] == [bos] and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]


def render(tokenizer, prompt: str) -> str:
    """The chat-template text of ``prompt`` as the open assistant turn after the user's :data:`INSTRUCTION`
    (``apply_chat_template`` with ``continue_final_message``), exactly as transformers renders it."""
    messages = [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)


def chat_prefix(tokenizer, model: str) -> str:
    """The text before every wrapped prompt (system turn if the template adds one, the user turn, the assistant
    header): :func:`render` of a stand-in prompt, cut before it; its leading BOS text dropped when the tokenizer
    adds BOS itself. UsageError naming ``model`` when the tokenizer has no chat template, the template fails, does
    not end with the assistant's open turn, or writes a ``{}``."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat-template: the tokenizer of {model} has no chat template; probe it without "
                         f"--chat-template (plain completion prompts)")
    try:
        text = render(tokenizer, SENTINEL)
    except Exception as error:  # noqa: BLE001 - a template's Jinja can raise anything; the user learns which model
        raise UsageError(f"--chat-template: the chat template of {model} cannot wrap a prompt as an open "
                         f"assistant turn ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})") from None
    if not text.endswith(SENTINEL):
        raise UsageError(f"--chat-template: the chat template of {model} does not leave the assistant turn open "
                         f"after its message (rendered {text!r})")
    prefix = text[:-len(SENTINEL)]
    if SLOT in prefix:
        raise UsageError(f"--chat-template: the chat template of {model} writes {SLOT!r} before the prompt, which "
                         f"would be taken for the subject slot (rendered {prefix!r})")
    bos = getattr(tokenizer, "bos_token", None)
    if bos and prefix.startswith(bos) and adds_bos(tokenizer):
        prefix = prefix[len(bos):]
    return prefix


def chat_relations(tokenizer, relations: list[Relation], model: str) -> list[Relation]:
    """``relations`` with every template and neutral template wrapped: ``chat_prefix + template``."""
    prefix = chat_prefix(tokenizer, model)
    return [dataclasses.replace(r, templates=[prefix + t for t in r.templates],
                                neutral_templates=[prefix + t for t in r.neutral_templates]) for r in relations]


def chat_split(tokenizer, template: str) -> tuple[str, str]:
    """(chat prefix, the plain template) of a template :func:`chat_relations` wrapped; ("", ``template``) for any
    other (a tokenizer without a chat template, or a template that does not open with its prefix). In-context
    examples are written between the two, inside the assistant turn."""
    try:
        prefix = chat_prefix(tokenizer, "the model")
    except UsageError:
        return "", template
    return (prefix, template[len(prefix):]) if prefix and template.startswith(prefix) else ("", template)


def chat_record(tokenizer, relations: list[Relation], model: str) -> dict:
    """report.json's ``dataset.chat_template``: the user instruction, the prefix every prompt opens with, and the
    first relation's first template as wrapped (``relations`` already wrapped)."""
    return {"instruction": INSTRUCTION, "prefix": chat_prefix(tokenizer, model),
            "example": relations[0].templates[0] if relations else None}


__all__ = ["INSTRUCTION", "adds_bos", "render", "chat_prefix", "chat_relations", "chat_split", "chat_record"]
