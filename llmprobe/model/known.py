"""Known facts and object tokens.

A fact (s, r, a) is *known* under the rule its protocol scores with, so that the model's own accuracy on its known
facts is 1 by construction:

* ``strict``: the greedy continuation opens with a's first token (the token strict scoring counts: the first
  token that differs when " " + a is appended to the prompt) and starts with a (case and leading space ignored:
  :func:`is_known`);
* ``lre`` (the LRE reference's rule, :func:`prefix_hit`): the top-1 next token, decoded, stripped and lower-cased,
  is a non-empty prefix of a (stripped, lower-cased).

Prompts are zero-shot (the relation's first template) or few-shot: ``n_icl`` facts of the relation drawn at random
(:func:`context_draws`) are written before the prompt, one filled template and its object per line
(:func:`icl_template`; a line whose subject is the queried one is left out, as the reference does). The strict
protocol draws once, uniformly, and never checks a fact whose subject is an in-context one; the lre protocol draws
once per trial of the reference (``n_draws``) by the reference's rule (one fact per distinct object first), each
trial's training samples being its in-context examples, checks every other fact (duplicates of a training row
included), and opens every prompt with the reference's start text (:func:`reference_start`). With draws, every
fact is also checked zero-shot (``FactResult.known_zero_shot``), so a report can say when a relation is known only
few-shot.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass, field

import torch

from llmprobe.model.batching import run_batched
from llmprobe.model.capture import NonFiniteStatesError, capture
from llmprobe.model.chat import chat_split
from llmprobe.model.engine import next_token_ids
from llmprobe.model.subjects import fill

KNOWN_RULES = {     # report.json "scoring": the known-fact rule of each protocol, which its scoring also uses
    "strict": "first token of the object; a fact is known when the greedy continuation opens with the object's "
              "first token and starts with the object (case and leading space ignored), so the model's own "
              "accuracy on its known facts is 1",
    "lre": "the LRE reference's prefix rule: known and correct when the decoded top-1 next token, stripped and "
           "lower-cased, is a non-empty prefix of the object",
}
DEFAULT_N_ICL = {"strict": 0, "lre": 5}    # in-context examples when none are asked for (lre: the reference's N)
CONTEXT, KNOWN, UNKNOWN, EXCLUDED = "context", "known", "unknown", "excluded"   # a fact's role in one draw


@dataclass
class FactResult:
    """One fact checked against the model.

    ``prompt`` and ``continuation`` are those of the first check (zero-shot, or the first draw in which the fact
    was checked); ``known``: known zero-shot, or with draws in at least one draw. ``draws``: per in-context draw
    the fact's role: "context" (an in-context example), "known" / "unknown" (checked with that draw's examples)
    or "excluded" (strict: its subject is an in-context one). ``known_zero_shot``: with draws, the same rule on the
    zero-shot prompt (None without draws)."""

    subject: str
    object: str
    prompt: str
    continuation: str
    known: bool
    known_zero_shot: bool | None = None
    draws: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(text: str) -> str:
    return " ".join(text.split()).casefold()


def is_known(continuation: str, obj: str) -> bool:
    """True when the continuation starts with the object, case and leading whitespace ignored (the text half of
    the strict rule: :func:`known_facts` passes an empty continuation when its first token is not the object's)."""
    target = _clean(obj)
    return bool(target) and _clean(continuation).startswith(target)


def prefix_hit(token_text: str, obj: str) -> bool:
    """The LRE reference's rule: the decoded token, stripped and lower-cased, is a non-empty prefix of the object
    (stripped and lower-cased)."""
    token = token_text.strip().lower()
    return bool(token) and obj.strip().lower().startswith(token)


def resolve_n_icl(protocol: str, n_icl: int | None) -> int:
    """In-context examples of ``protocol``: ``n_icl``, or the protocol's default (strict 0, lre 5) for None."""
    return DEFAULT_N_ICL[protocol] if n_icl is None else int(n_icl)


def seeded_generator(seed: int, *keys) -> torch.Generator:
    """A generator seeded by ``seed`` and ``keys`` (e.g. relation name, "test"): independent streams."""
    text = "/".join(str(k) for k in keys)
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(text.encode()))


def context_draws(n_facts: int, n_icl: int, n_draws: int, seed: int, name: str,
                  objects: list[str] | None = None) -> list[list[int]]:
    """``n_draws`` sets of ``n_icl`` fact indices out of ``n_facts`` (sorted), each from its own seeded stream
    (seed, relation ``name``, draw): the in-context examples of each draw (the reference's training samples).

    Uniform without ``objects`` (the strict protocol's draw). With the facts' ``objects`` (protocol lre), the LRE
    reference's ``Relation.split``: the facts in a random order, then one fact of each distinct object (objects in
    the order they first come) before a second of any, so the training facts cover as many objects as there are
    (:func:`covering_order`)."""
    if n_icl < 0 or n_icl >= n_facts:
        raise ValueError(f"relation {name}: {n_icl} in-context examples out of {n_facts} facts leave none to check")
    if objects is not None and len(objects) != n_facts:
        raise ValueError(f"relation {name}: {len(objects)} objects for {n_facts} facts")
    draws = []
    for k in range(n_draws):
        order = torch.randperm(n_facts, generator=seeded_generator(seed, name, "context", k)).tolist()
        if objects is not None:
            order = covering_order(order, objects)
        draws.append(sorted(order[:n_icl]))
    return draws


def covering_order(order: list[int], objects: list[str]) -> list[int]:
    """``order`` (fact indices) re-ordered the reference's way: grouped by object (groups in the order their first
    fact comes, each group in ``order``), then taken round by round, one fact of every group left per round."""
    groups: dict[str, list[int]] = {}
    for i in order:
        groups.setdefault(objects[i], []).append(i)
    out, depth = [], 0
    while len(out) < len(order):
        out += [g[depth] for g in groups.values() if depth < len(g)]
        depth += 1
    return out


def icl_template(template: str, examples, subject: str | None = None, start: str = "") -> str:
    """``template`` after the in-context ``examples`` (facts with ``subject`` and ``object``), one filled template
    and its object per line; an example whose subject is ``subject`` is left out (the reference's rule); ``start``
    (protocol lre: :func:`reference_start`) opens the prompt."""
    lines = [fill(template, f.subject)[0] + " " + f.object.strip() for f in examples if f.subject != subject]
    return start + "".join(line + "\n" for line in lines) + template


def reference_start(tokenizer) -> str:
    """The text the LRE reference puts before every prompt (``models.maybe_prefix_eos``): the tokenizer's EOS
    token for GPT-2-style tokenizers, else nothing.

    The reference asks ``isinstance(tokenizer, GPT2TokenizerFast | GPTNeoXTokenizerFast)``; under transformers 5
    those names are ``GPT2Tokenizer`` and ``GPTNeoXTokenizer`` (GPT-2, GPT-J, GPT-NeoX/Pythia and SmolLM2 load
    them from their hub files), every other named class (Llama, Qwen2, CodeGen/Phi, Gemma, ...) gets nothing. A
    tokenizer whose class was lost (the generic ``TokenizersBackend``, e.g. read from a GGUF file as the embedded
    SmolLM2's is; or a hub ``PreTrainedTokenizerFast`` as Llama 3's) gets the EOS when it adds no start token of
    its own: the reference's answer for every such model it runs (SmolLM2: its hub class is GPT2Tokenizer; Llama
    3: it adds ``<|begin_of_text|>``, nothing prepended)."""
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        return ""
    names = {cls.__name__ for cls in type(tokenizer).__mro__}
    if names & {"GPT2Tokenizer", "GPT2TokenizerFast", "GPTNeoXTokenizer", "GPTNeoXTokenizerFast"}:
        return eos
    if type(tokenizer).__name__ not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return ""
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return eos if probe == tokenizer("a", add_special_tokens=False)["input_ids"] else ""


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


def greedy_tokens(lm, prompts: list[str], max_new_tokens: int | list[int] = 8, batch_size: int = 32
                  ) -> list[list[int]]:
    """Greedy continuation of each prompt as token ids (left-padded batches, no sampling; padding after an end
    of sequence included).

    ``max_new_tokens`` may be one number per prompt: prompts are then batched by length of continuation needed,
    and each batch generates only as many tokens as its longest need. Batches go through
    ``llmprobe.model.batching.run_batched`` (at most ``batch_size``, fewer under a memory budget or after an
    out-of-memory error). NaN or infinite logits raise NonFiniteStatesError naming the first place in the model
    where the prompts' last states stop being finite.
    """
    tok = lm.tokenizer
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i])))

    def generate(part: slice) -> list[list[int]]:
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
        return out[:, batch["input_ids"].shape[1]:].tolist()

    saved_side, tok.padding_side = tok.padding_side, "left"
    try:
        parts = run_batched(generate, len(order), batch_size, stage="known facts", lm=lm, prompts=prompts,
                            new_tokens=max(budgets, default=0))
    finally:
        tok.padding_side = saved_side
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, ids in zip(order, (ids for part in parts for ids in part)):
        tokens[i] = ids
    return tokens


def greedy_continuations(lm, prompts: list[str], max_new_tokens: int | list[int] = 8,
                         batch_size: int = 32) -> list[str]:
    """Greedy continuation text of each prompt (:func:`greedy_tokens`, decoded without special tokens)."""
    return lm.tokenizer.batch_decode(greedy_tokens(lm, prompts, max_new_tokens, batch_size),
                                     skip_special_tokens=True)


def _check(lm, protocol: str, templates: list[str], facts, batch_size: int,
           max_new_tokens: int | None) -> list[tuple[str, str, bool]]:
    """(prompt, continuation, known) of each fact under its template and ``protocol``'s rule (module doc)."""
    prompts = [fill(t, f.subject)[0] for t, f in zip(templates, facts)]
    if not prompts:
        return []
    if protocol == "lre":
        top = next_token_ids(lm, templates, [f.subject for f in facts], batch_size=batch_size).tolist()
        texts = [lm.tokenizer.decode([t]) for t in top]
        return [(p, t, prefix_hit(t, f.object)) for p, t, f in zip(prompts, texts, facts)]
    sequences = object_token_sequences(lm.tokenizer, prompts, [f.object for f in facts])
    budget = [min(len(seq) + 1, 16) for seq in sequences] if max_new_tokens is None else max_new_tokens
    tokens = greedy_tokens(lm, prompts, budget, batch_size)
    texts = lm.tokenizer.batch_decode(tokens, skip_special_tokens=True)
    # the strict rule: the first token is the object's (what strict scoring counts) and the text starts with it
    scored = [t if ids[:1] == seq[:1] else "" for t, ids, seq in zip(texts, tokens, sequences)]
    return [(p, t, is_known(s, f.object)) for p, t, s, f in zip(prompts, texts, scored, facts)]


def known_facts(lm, relation, template: str | None = None, max_new_tokens: int | None = None,
                batch_size: int = 32, *, protocol: str = "strict", n_icl: int | None = None, n_draws: int = 1,
                seed: int = 0) -> list[FactResult]:
    """Check every fact of ``relation`` with its first (or the given) template under ``protocol``'s rule (module
    doc), one result per fact in order.

    ``n_icl`` in-context examples (None: the protocol's default, :data:`DEFAULT_N_ICL`) drawn by
    :func:`context_draws` from ``seed``: once for strict, ``n_draws`` times for lre (the reference's trials; pass
    the analyses' ``n_splits``; a relation of no more facts than ``n_icl`` is checked zero-shot only). Strict
    prompts generate one token more than the object has (or ``max_new_tokens``), enough to decide the prefix
    match; lre prompts need the top-1 token only.
    """
    if protocol not in DEFAULT_N_ICL:
        raise ValueError(f"protocol must be one of {sorted(DEFAULT_N_ICL)}, got {protocol!r}")
    chat, template = chat_split(lm.tokenizer, template or relation.templates[0])   # examples: in the assistant turn
    facts = list(relation.facts)
    n_icl = resolve_n_icl(protocol, n_icl)
    start = (reference_start(lm.tokenizer) if protocol == "lre" else "") + chat
    zero_shot = _check(lm, protocol, [start + template] * len(facts), facts, batch_size, max_new_tokens)
    if n_icl == 0 or n_icl >= len(facts):       # zero-shot, or too few facts for the examples (none to check)
        return [FactResult(f.subject, f.object, p, t, k) for f, (p, t, k) in zip(facts, zero_shot)]
    draws = context_draws(len(facts), n_icl, n_draws if protocol == "lre" else 1, seed, relation.name,
                          [f.object for f in facts] if protocol == "lre" else None)
    roles: list[list[str]] = [[] for _ in facts]
    first: list[tuple[str, str] | None] = [None] * len(facts)
    for context in draws:
        examples = [facts[i] for i in context]
        subjects = {f.subject for f in examples}
        role = {i: CONTEXT for i in context}
        if protocol == "strict":
            role.update({i: EXCLUDED for i, f in enumerate(facts) if i not in role and f.subject in subjects})
        checked = [i for i in range(len(facts)) if i not in role]
        templates = [icl_template(template, examples, facts[i].subject, start) for i in checked]
        for i, (p, t, k) in zip(checked, _check(lm, protocol, templates, [facts[i] for i in checked], batch_size,
                                                max_new_tokens)):
            role[i] = KNOWN if k else UNKNOWN
            first[i] = first[i] or (p, t)
        for i in range(len(facts)):
            roles[i].append(role[i])
    return [FactResult(f.subject, f.object, *(first[i] or ("", "")), KNOWN in roles[i], zero_shot[i][2], roles[i])
            for i, f in enumerate(facts)]


class KnownFactsJob:
    """The known facts of relations by name, one part ("known", name) at a time, in any process (the main one or
    an analysis helper, ``llmprobe.jobs.helpers``): ``relations`` name -> Relation (its located facts),
    ``options``: :func:`known_facts`'s keywords. Each part's draws are seeded by the relation's name, so its
    results do not depend on which process checks it or in what order."""

    def __init__(self, lm, relations: dict, **options):
        self.lm, self.relations, self.options = lm, relations, options

    def compute(self, part: tuple[str, str]) -> dict:
        """{"value": [FactResult] of relation ``part[1]``, "seconds": its time}."""
        start = time.perf_counter()
        results = known_facts(self.lm, self.relations[part[1]], **self.options)
        return {"value": results, "seconds": round(time.perf_counter() - start, 1)}


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
