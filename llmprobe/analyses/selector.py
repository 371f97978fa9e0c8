"""The paper's mechanism measured on the pretrained model itself (``docs/measures.md``, "Mechanisms on the
pretrained model"): ``crosspatch`` (one subject state serves every relation) and ``selector`` (the MLP as a
relation-conditioned selector at the prompt's last token), each with controls, intervals and n.

Both read the shared-subject group of relations (``superposition.shared_group``: the country relations of the
bundled set) and its known facts (:func:`fact_grid`). The measures themselves (:func:`last_gates`,
:func:`edited_predictions`, :func:`gating_index`, :func:`transplant_hits`) take any model llmprobe addresses: a
Hugging Face model, or a synthetic ``FactRecallModel`` (its facts as token-id rows, :meth:`PromptSet.of_ids`), so
the matched synthetic control and the paper's construction are measured by the same code
(``tests/test_pretrained_mechanisms.py``).

The gate (``llmprobe.model.adapters``): ``act(mlp_pre)`` of a gated MLP (SwiGLU: Llama, Qwen2/3, Mistral, Phi-3;
GeGLU: Gemma), whose values are ``up_proj x``; ``act(p) / p`` of a plain MLP (GELU: Phi-1/2, GPT-2; ReLU: the
synthetic model, where it is the on/off mask that ``synthetic.mechanisms.gate_transplant`` transplants), whose
values are ``p = mlp_pre``. A transplant replaces the gate and keeps the item's own values.
"""
from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from llmprobe.analyses.passes import cached_edit_batches, empty_passes, filled_batches, jacobian_prompts
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.results import CrosspatchResult, SelectorResult
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, Log, planned_lre_layers
from llmprobe.analyses.splits import generator
from llmprobe.analyses.superposition import neutral_templates, shared_group
from llmprobe.geometry import random_direction_like
from llmprobe.metric import bootstrap, paired_difference, proportion
from llmprobe.model.batching import run_batched
from llmprobe.model.capture import adapter_for, capture
from llmprobe.model.engine import edited_predictions as resumed_edit_ids
from llmprobe.model.engine import layer_sequences, logits_fn, output_name, relation_states
from llmprobe.model.random_init import random_init
from llmprobe.model.scoring import first_token_targets
from llmprobe.model.subjects import EncodedPrompts, encode, locate_errors

MIN_FACTS = 6               # known, locatable facts a relation needs to take part
GRID_SUBJECTS = 32          # at most this many subjects in the gating grid (each known in every grid relation)
MIN_GRID_SUBJECTS = 8       # relations are dropped from the grid until this many subjects are complete
TRANSPLANT_ITEMS = 64       # test facts of the gate transplant ...
VALIDATION_ITEMS = 24       # ... and validation facts that choose its block of layers
N_BLOCKS = 5                # candidate blocks: the model's layers cut into this many contiguous runs
VALIDATION_FRACTION = 1 / 3     # of the group's subjects: validation (block choice); the rest: test
PAIR_ITEMS = 3              # crosspatch items per ordered relation pair at every patched layer (the profile) ...
LRE_PAIR_ITEMS = 7          # ... and up to this many at the LRE layers, among which the claim's layer is chosen
MIN_RELATION_ITEMS = 5      # test facts of one relation for its own gate-transplant numbers (``by_relation``)
PATCHES = ("neutral", "cross_relation", "same_relation", "random_subject", "random_vector")
RANDOM_SEED = 12345         # the random-init control: the superposition analysis' model (seed + this)


# ------------------------------------------------------------------------------------------- gates, any model
def gate_of(pre: torch.Tensor, out: torch.Tensor, gated: bool) -> torch.Tensor:
    """The gate from the MLP's pre-activation ``pre`` and activation output ``out = act(pre)`` [..., d_mlp]:
    ``out`` for a gated MLP, ``out / pre`` (0 where pre = 0) for a plain one."""
    if gated:
        return out
    return torch.where(pre == 0, torch.zeros_like(out), out / torch.where(pre == 0, torch.ones_like(pre), pre))


def _with_gate(pre: torch.Tensor, gate: torch.Tensor, gated: bool) -> torch.Tensor:
    """The activation output that ``gate`` gives with the item's own values (gated: up_proj x, applied after)."""
    return gate if gated else pre * gate


@contextlib.contextmanager
def mlp_hooks(model, fns: dict[int, Callable]) -> Iterator[None]:
    """At each layer ``l`` of ``fns``: ``fn(pre, out) -> new activation output or None`` ([batch, seq, d_mlp]),
    ``pre`` = ``blocks.{l}.mlp_pre``, ``out = act(pre)``. Hugging Face models: a forward hook on the activation
    module. A hook-point model (the synthetic one: one block, ``relu(resid_mid W_in + b_in)``): ``pre`` recomputed
    from ``blocks.0.resid_mid`` and ``out`` at ``blocks.0.mlp_hidden``."""
    adapter = adapter_for(model)
    handles = []
    try:
        if adapter.blocks is not None:
            for layer, fn in fns.items():
                act = adapter.place(f"blocks.{layer}.mlp_pre").module
                handles.append(act.register_forward_hook(lambda module, args, out, fn=fn: fn(args[0], out)))
        elif fns:
            points, module = adapter.model.hook_points(), adapter.model
            if set(fns) != {0} or "blocks.0.resid_mid" not in points or not hasattr(module, "W_in"):
                raise AnalysisError(f"{adapter.model_type}: no MLP pre-activation to read (a hook-point model needs "
                                    f"blocks.0.resid_mid and relu(resid_mid W_in + b_in))")
            seen = {}
            fn = fns[0]
            handles.append(points["blocks.0.resid_mid"].register_forward_hook(
                lambda m, args, out: seen.update(pre=out @ module.W_in + module.b_in)))
            handles.append(points["blocks.0.mlp_hidden"].register_forward_hook(
                lambda m, args, out: fn(seen["pre"], out)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class PromptSet:
    """Prompts, encoded a micro-batch at a time with left padding (the last token at -1): ``templates`` filled
    with ``subjects`` by ``tokenizer``, or rows of token ids ``ids`` [n, t] (a synthetic model's facts)."""

    templates: list[str]
    subjects: list[str]
    tokenizer: object = None
    ids: torch.Tensor | None = None

    @classmethod
    def of_ids(cls, ids: torch.Tensor) -> "PromptSet":
        return cls([], [], None, torch.as_tensor(ids, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.subjects)

    def texts(self) -> list[str] | None:
        return None if self.ids is not None else [t.replace("{}", s, 1) for t, s in zip(self.templates, self.subjects)]

    def batch(self, part: slice) -> EncodedPrompts:
        if self.ids is None:
            return encode(self.tokenizer, self.templates[part], self.subjects[part], padding_side="left")
        ids = self.ids[part]
        zero = torch.zeros(len(ids), dtype=torch.long)
        return EncodedPrompts(ids, torch.ones_like(ids), zero, zero, zero + ids.shape[1] - 1, ["ids"] * len(ids))


def last_gates(model, prompts: PromptSet, layers: list[int], batch_size: int = 32
               ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The MLP gate at each prompt's last token and which units are open there (``mlp_pre`` > 0):
    ({layer: [n, d_mlp]} float32, {layer: [n, d_mlp]} bool), on CPU."""
    adapter = adapter_for(model)
    gated = {l: adapter.mlp_gated(l) for l in layers}
    stop = f"blocks.{max(layers)}.resid_post"

    def run(part: slice) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        enc, got = prompts.batch(part), {}

        def keeper(layer):
            def keep(pre, out):
                got[layer] = (gate_of(pre[:, -1], out[:, -1], gated[layer]).detach().float().cpu(),
                              (pre[:, -1] > 0).cpu())
            return keep
        with torch.no_grad(), mlp_hooks(model, {l: keeper(l) for l in layers}):
            capture(model, [stop], enc.input_ids, enc.attention_mask, positions=enc.prompt_last[:, None])
        return got

    parts = run_batched(run, len(prompts), batch_size, stage="mlp gates", prompts=prompts.texts())
    return ({l: torch.cat([p[l][0] for p in parts]) for l in layers},
            {l: torch.cat([p[l][1] for p in parts]) for l in layers})


def edited_predictions(model, prompts: PromptSet, gates: dict[int, torch.Tensor] | None = None,
                       scale: dict[int, torch.Tensor] | None = None, batch_size: int = 32) -> torch.Tensor:
    """Greedy next token after each prompt (LongTensor [n]), with the MLP gate at the last token replaced by
    ``gates`` ({layer: [n, d_mlp]}: a transplant) or multiplied by ``scale`` ({layer: [n, d_mlp]}: an ablation) at
    each of their layers, in one forward pass; neither: the clean prediction."""
    adapter = adapter_for(model)
    edits, replace = (gates, True) if gates is not None else (scale or {}, False)
    name, to_logits = output_name(model), logits_fn(model)

    def run(part: slice) -> torch.Tensor:
        enc, fns = prompts.batch(part), {}
        for layer, rows in edits.items():
            def fn(pre, out, rows=rows[part], gated=adapter.mlp_gated(layer)):
                new = out.clone()
                gate = rows.to(out.device, out.dtype)
                if not replace:
                    gate = gate * gate_of(pre[:, -1], out[:, -1], gated)
                new[:, -1] = _with_gate(pre[:, -1], gate, gated)
                return new
            fns[layer] = fn
        with torch.no_grad(), mlp_hooks(model, fns):
            o = capture(model, [name], enc.input_ids, enc.attention_mask, positions=enc.prompt_last[:, None])[name]
        return to_logits(o[:, 0]).argmax(-1)

    return torch.cat(run_batched(run, len(prompts), batch_size, stage="gate edits", prompts=prompts.texts()))


def random_units(own_open: torch.Tensor, other_open: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Keep-masks [n, d_mlp] (0 = unit switched off) of the random-units control: per row as many units as the
    other-relation transplant switches (open in one of own / other, closed in the other; ``*_open`` bool
    [n, d_mlp]), drawn at random among the row's open units -- for 0/1 masks the same number of units moved."""
    count = (own_open != other_open).sum(1, keepdim=True)
    score = torch.rand(own_open.shape, generator=gen) + own_open.float()       # open units first, in random order
    rank = torch.argsort(torch.argsort(score, dim=1, descending=True), dim=1)
    return (~((rank < count) & own_open)).float()


def matched_switch_off(own_gate: torch.Tensor, new_gate: torch.Tensor, own_open: torch.Tensor, new_open: torch.Tensor,
                       gen: torch.Generator) -> torch.Tensor:
    """Gate multipliers [n, d_mlp] of a random switch-off matched in count AND norm to the transplant own -> new
    (gates [n, d_mlp], open masks bool [n, d_mlp]): per row as many units as the transplant moves (open in one,
    closed in the other), drawn at random among the row's open units, each multiplied by 1 - c, with c set so that
    the gate change has the transplant's L2 norm ||new - own|| (c = 1: switched off; c > 1: reversed, where the
    chosen units' gates are smaller than the change). For 0/1 gates (ReLU) c = 1: :func:`random_units`' edit."""
    count = (own_open != new_open).sum(1, keepdim=True)
    score = torch.rand(own_open.shape, generator=gen) + own_open.float()       # open units first, in random order
    rank = torch.argsort(torch.argsort(score, dim=1, descending=True), dim=1)
    chosen = ((rank < count) & own_open).float()
    target = (new_gate.float() - own_gate.float()).norm(dim=1, keepdim=True)
    have = (own_gate.float() * chosen).norm(dim=1, keepdim=True)
    c = torch.where(have > 0, target / torch.where(have > 0, have, torch.ones_like(have)), torch.zeros_like(have))
    return 1.0 - c * chosen


def redirect_transplant(model, own: PromptSet, cross: PromptSet, block: list[int], gen: torch.Generator,
                        batch_size: int = 32) -> dict[str, torch.Tensor]:
    """Redirection: the greedy next token [n] after each item (s, r) (``own``) with the gates at the last token
    replaced, at the layers ``block``, by those of another subject's prompt of another relation (s'', r')
    (``cross``; ``redirect``), and with a random switch-off matched in count and norm to that transplant
    (:func:`matched_switch_off`; ``random_units``). A selector answers a_{r'}(s): the gates pick the relation,
    the item's own values carry the subject. {"redirect", "random_units"}: LongTensor [n]."""
    own_g, own_open = last_gates(model, own, block, batch_size)
    cross_g, cross_open = last_gates(model, cross, block, batch_size)
    scale = {l: matched_switch_off(own_g[l], cross_g[l], own_open[l], cross_open[l], gen) for l in block}
    return {"redirect": edited_predictions(model, own, gates=cross_g, batch_size=batch_size),
            "random_units": edited_predictions(model, own, scale=scale, batch_size=batch_size)}


def redirect_metrics(preds: dict[str, torch.Tensor], new_answers: torch.Tensor, old_answers: torch.Tensor,
                     n_boot: int = 1000, seed: int = 0) -> dict:
    """Typed metrics (JSON form) of :func:`redirect_transplant`: ``redirect`` (the fraction answering a_{r'}(s),
    the answer of the gates' relation for the values' subject) with its null ``random_units`` (the same fraction
    under the matched switch-off), their paired difference ``redirect_minus_random`` (the selector line's test),
    and the fractions still answering a_r(s) (``redirect_keeps_old``, with ``random_units`` beside it)."""
    new = {k: (v == new_answers).double().tolist() for k, v in preds.items()}
    old = {k: (v == old_answers).double().tolist() for k, v in preds.items()}
    return {"redirect": proportion(new["redirect"]).with_nulls(
                {"random_units": proportion(new["random_units"])}).to_dict(),
            "redirect_minus_random": paired_difference(new["redirect"], new["random_units"], n_boot=n_boot,
                                                       seed=seed).to_dict(),
            "redirect_keeps_old": proportion(old["redirect"]).with_nulls(
                {"random_units": proportion(old["random_units"])}).to_dict()}


def transplant_hits(model, own: PromptSet, answers: torch.Tensor, same_gates: dict[int, torch.Tensor],
                    other_gates: dict[int, torch.Tensor], keep: dict[int, torch.Tensor] | None = None,
                    batch_size: int = 32) -> dict[str, torch.Tensor]:
    """Whether items (s, r) (``own``) keep their answers [n] (token ids) with the gates at the last token
    replaced, at the layers of ``same_gates``, by those of (s', r) (``same_gates``: another subject, the same
    relation) or of (s, r') (``other_gates``: the same subject, another relation), and with the units ``keep``
    marks 0 switched off (the random-units control, :func:`random_units`). {name: BoolTensor [n]}."""
    hits = {"same_relation": edited_predictions(model, own, gates=same_gates, batch_size=batch_size) == answers,
            "other_relation": edited_predictions(model, own, gates=other_gates, batch_size=batch_size) == answers}
    if keep is not None:
        hits["random_units"] = edited_predictions(model, own, scale=keep, batch_size=batch_size) == answers
    return hits


def gate_transplant(model, own: PromptSet, same_relation: PromptSet, other_relation: PromptSet,
                    answers: torch.Tensor, block: list[int], gen: torch.Generator,
                    batch_size: int = 32, matched_gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """:func:`transplant_hits` at the layers ``block`` with the gates of the prompts ``same_relation`` (s', r)
    and ``other_relation`` (s, r'), one row per item, and the random-units control of the other-relation
    transplant's size; ``clean``: the unedited prompts. With ``matched_gen`` also ``random_units_matched``: a
    random switch-off matched in count AND norm to the other-relation transplant (:func:`matched_switch_off`,
    its own generator, so ``random_units`` is drawn as without it). {"clean", "same_relation", "other_relation",
    "random_units"[, "random_units_matched"]}: BoolTensor [n], the answer given."""
    own_g, own_open = last_gates(model, own, block, batch_size)
    same_g, _ = last_gates(model, same_relation, block, batch_size)
    other_g, other_open = last_gates(model, other_relation, block, batch_size)
    keep = {l: random_units(own_open[l], other_open[l], gen) for l in block}
    hits = transplant_hits(model, own, answers, same_g, other_g, keep, batch_size)
    if matched_gen is not None:
        scale = {l: matched_switch_off(own_g[l], other_g[l], own_open[l], other_open[l], matched_gen) for l in block}
        hits["random_units_matched"] = edited_predictions(model, own, scale=scale, batch_size=batch_size) == answers
    return {"clean": edited_predictions(model, own, batch_size=batch_size) == answers, **hits}


def transplant_metrics(hits: dict[str, torch.Tensor], n_boot: int = 1000, seed: int = 0) -> dict:
    """Typed metrics (JSON form) of :func:`gate_transplant`: ``clean`` (no edit), ``same_relation`` with its controls
    ``other_relation_gate`` (the selector's null) and ``random_units``, each also on its own, and the paired
    differences ``same_minus_other`` and ``random_minus_other``; with ``random_units_matched`` in ``hits`` also
    :func:`_matched_metrics` (``selector_keep``, ``random_units_matched``, ``same_minus_random``,
    ``matched_minus_other``)."""
    as_list = {k: v.double().tolist() for k, v in hits.items()}
    other, rand = proportion(as_list["other_relation"]), proportion(as_list["random_units"])
    return {"clean": proportion(as_list["clean"]).to_dict(),
            "same_relation": proportion(as_list["same_relation"]).with_nulls(
                {"other_relation_gate": other, "random_units": rand}).to_dict(),
            "other_relation": proportion(as_list["other_relation"]).with_nulls(
                {"random_units": proportion(as_list["random_units"])}).to_dict(),
            "random_units": rand.to_dict(),
            "same_minus_other": paired_difference(as_list["same_relation"], as_list["other_relation"],
                                                  n_boot=n_boot, seed=seed).to_dict(),
            "random_minus_other": paired_difference(as_list["random_units"], as_list["other_relation"],
                                                    n_boot=n_boot, seed=seed).to_dict(),
            **(_matched_metrics(as_list, n_boot, seed) if "random_units_matched" in as_list else {})}


def _matched_metrics(as_list: dict[str, list], n_boot: int, seed: int) -> dict:
    """The selector line's test (docs/measures.md, Verdicts): ``selector_keep`` = the same-relation keep rate with
    its two nulls, ``other_relation_gate`` (the subject's own gates of another relation; paired:
    ``same_minus_other``) and ``random_units_matched`` (a random switch-off matched in count and norm to that
    transplant; paired: ``same_minus_random``), the matched switch-off's keep rate on its own, and the old test
    with the matched null (``matched_minus_other``)."""
    same, other, matched = as_list["same_relation"], as_list["other_relation"], as_list["random_units_matched"]
    pair = lambda a, b: paired_difference(a, b, n_boot=n_boot, seed=seed).to_dict()  # noqa: E731
    return {"random_units_matched": proportion(matched).to_dict(),
            "selector_keep": proportion(same).with_nulls({"other_relation_gate": proportion(other),
                                                          "random_units_matched": proportion(matched)}).to_dict(),
            "same_minus_random": pair(same, matched),
            "matched_minus_other": pair(matched, other)}


def _shares(x: np.ndarray, n_relations: int) -> tuple[float, float]:
    """(relation share, subject share) of the variance of gates x [S, R * k] (two-way decomposition, pooled
    over units)."""
    G = x.reshape(x.shape[0], n_relations, -1)
    grand = G.mean((0, 1))
    total = float(((G - grand) ** 2).sum())
    if total <= 0:
        return float("nan"), float("nan")
    rel = float(((G.mean(0) - grand) ** 2).sum()) * G.shape[0]
    subj = float(((G.mean(1) - grand) ** 2).sum()) * G.shape[1]
    return rel / total, subj / total


def _compact(G: torch.Tensor) -> np.ndarray:
    """Gates [S, R, m] -> [S, R * k] with k <= S R: coordinates of the centred rows in their own span (every
    mean and deviation of rows lies there, so the variance shares, resampled or not, are unchanged)."""
    S, R, m = G.shape
    rows = G.reshape(S * R, m).double()
    rows = rows - rows.mean(0)
    _, _, Vh = torch.linalg.svd(rows, full_matrices=False)
    return (rows @ Vh.T).reshape(S, -1).numpy()


def gating_index(gates: dict[int, torch.Tensor], n_subjects: int, n_relations: int,
                 controls: dict[str, dict[int, torch.Tensor]] | None = None, n_boot: int = 1000,
                 seed: int = 0) -> dict:
    """Per layer, the share of the gates' variance explained by the relation and by the subject (two-way
    decomposition over the subjects x relations grid; ``gates[l]`` [S R, d_mlp], rows subject-major), as
    bootstrap metrics over subjects, each with the controls ``shuffled_relations`` (relations permuted within each
    subject's row) and any model in ``controls`` (e.g. the random-init one: {name: gates of the same grid})."""
    S, R = n_subjects, n_relations
    perm = torch.stack([torch.randperm(R, generator=torch.Generator().manual_seed(seed + s)) for s in range(S)])
    share = lambda X, k: bootstrap(_compact(X), lambda a: _shares(a, R)[k], n_boot=n_boot, seed=seed,  # noqa: E731
                                   bounds=(0.0, 1.0))
    out = {}
    for layer, G in gates.items():
        G = G.reshape(S, R, -1)
        others = {name: c[layer].reshape(S, R, -1) for name, c in (controls or {}).items()}
        relation = share(G, 0).with_nulls({"shuffled_relations": share(G[torch.arange(S)[:, None], perm], 0),
                                              **{name: share(X, 0) for name, X in others.items()}})
        subject = share(G, 1).with_nulls({name: share(X, 1) for name, X in others.items()})
        out[str(layer)] = {"relation_share": relation.to_dict(), "subject_share": subject.to_dict()}
    return out


# ------------------------------------------------------------------------------------ the pretrained drivers
@dataclass
class FactGrid:
    """The shared-subject group: ``relations``, ``subjects``; per relation r and subject i ``answers[r][i]`` the
    known object (None: not known, or not locatable in the relation's first template), ``firsts[r][i]`` its first
    token after that prompt, ``located[r][i]`` whether the subject is found in it; ``validation`` the subjects
    that choose (the rest are test subjects)."""

    relations: list
    subjects: list[str]
    answers: list[list[str | None]]
    firsts: list[list[int | None]]
    located: list[list[bool]]
    validation: set[str]

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.relations]

    def known(self, r: int) -> list[int]:
        return [i for i, a in enumerate(self.answers[r]) if a is not None]


def fact_grid(tokenizer, relations, known: dict, cfg: AnalysisSettings) -> FactGrid:
    """The group's known facts (relations with at least ``MIN_FACTS``), its subjects cut once into validation and
    test by a generator of their own."""
    group = shared_group(relations)
    subjects = list(dict.fromkeys(f.subject for rel in group for f in (known.get(rel.name) or []) if f.known))
    kept, answers, firsts, located = [], [], [], []
    for rel in group:
        facts = {f.subject: f.object for f in (known.get(rel.name) or []) if f.known}
        ok = [e is None for e in locate_errors(tokenizer, rel.templates[0], subjects)]
        row = [facts.get(s) if found else None for s, found in zip(subjects, ok)]
        rows = [i for i, a in enumerate(row) if a is not None]
        if len(rows) < MIN_FACTS:
            continue
        first = first_token_targets(tokenizer, [rel.templates[0].replace("{}", subjects[i], 1) for i in rows],
                                    [row[i] for i in rows]).tolist()
        kept.append(rel)
        answers.append(row)
        firsts.append([dict(zip(rows, first)).get(i) for i in range(len(subjects))])
        located.append(ok)
    if len(kept) < 2:
        raise AnalysisError(f"needs two relations of one subject type with {MIN_FACTS} known facts each; "
                            f"{[r.name for r in group]} have fewer")
    order = torch.randperm(len(subjects), generator=generator(cfg, "mechanisms", "validation")).tolist()
    validation = {subjects[i] for i in order[:round(VALIDATION_FRACTION * len(subjects))]}
    return FactGrid(kept, subjects, answers, firsts, located, validation)


def complete_rows(grid: FactGrid) -> tuple[list[int], list[int]]:
    """Relations and subjects of the gating grid (subjects known in every grid relation): relations are dropped
    one by one, the one with the fewest known facts first, until ``MIN_GRID_SUBJECTS`` subjects are complete (or
    two relations are left); at most ``GRID_SUBJECTS`` of them are kept. A choice by known-fact counts only."""
    rels = list(range(len(grid.relations)))
    while True:
        rows = [i for i in range(len(grid.subjects)) if all(grid.answers[r][i] is not None for r in rels)]
        if len(rows) >= MIN_GRID_SUBJECTS or len(rels) == 2:
            return rels, rows[:GRID_SUBJECTS]
        rels.remove(min(rels, key=lambda r: len(grid.known(r))))


def selector(lm, relations, known: dict, layers: list[int], cfg: AnalysisSettings, log: Log) -> dict:
    """The MLP as a relation-conditioned selector (module docstring): gating index per layer, gate transplants at
    a block of layers chosen on validation subjects. JSON-ready dict of typed metrics."""
    t0 = time.perf_counter()
    tok, adapter = lm.tokenizer, lm.adapter
    grid = fact_grid(tok, relations, known, cfg)
    gated = adapter.mlp_gated(0)
    out = {"relations": grid.names, "mlp": "gated" if gated else "plain",
           "gate": ("act(gate_proj x) at the prompt's last token (values: up_proj x)" if gated else
                    "act(p) / p with p = fc1 x (GPT-2: c_fc x) at the prompt's last token (values: p)"),
           "matched_control": "controls.modes.<mode>.points[].selector.gate_transplant: the same transplant "
                              "(the donor's gate, the item's own values) on the matched controls' ReLU on/off mask",
           "error": None}
    rels, rows = complete_rows(grid)
    subjects = [grid.subjects[i] for i in rows]
    log(f"selector: gating grid {len(subjects)} subjects x {len(rels)} relations, {len(layers)} layers")
    if len(subjects) < 2:
        out["gating"] = {"error": f"fewer than 2 subjects known in two relations of {grid.names}"}
    else:
        grid_prompts = PromptSet([grid.relations[r].templates[0] for _ in subjects for r in rels],
                                 [s for s in subjects for _ in rels], tok)
        gates = last_gates(lm.model, grid_prompts, layers, cfg.batch_size)[0]
        controls = None
        if cfg.random_control:
            rlm = random_init(lm, seed=cfg.seed + RANDOM_SEED)
            controls = {"random_init": last_gates(rlm.model, grid_prompts, layers, cfg.batch_size)[0]}
            del rlm
        out["gating"] = {"relations": [grid.names[r] for r in rels], "n_subjects": len(subjects),
                         "layers": gating_index(gates, len(subjects), len(rels), controls, cfg.n_boot, cfg.seed),
                         "error": None}
    out["gate_transplant"] = _transplant(lm, grid, cfg, log)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _transplant_items(grid: FactGrid, split: bool, limit: int, gen: random.Random) -> dict:
    """Up to ``limit`` known facts (s, r) of one split (validation: True), each with a donor s' of the same split
    and relation whose answer has another first token, and a random other relation r' whose prompt holds s."""
    R = len(grid.relations)
    in_split = [(s in grid.validation) == split for s in grid.subjects]
    cand = [(i, r) for r in range(R) for i in grid.known(r) if in_split[i]]
    gen.shuffle(cand)
    items = {"own": [], "same": [], "other": [], "answers": [], "relation": []}
    for i, r in cand:
        donors = [j for j in grid.known(r) if j != i and in_split[j] and grid.firsts[r][j] != grid.firsts[r][i]]
        others = [q for q in range(R) if q != r and grid.located[q][i]]
        if not donors or not others:
            continue
        j, q = gen.choice(donors), gen.choice(others)
        template = grid.relations[r].templates[0]
        items["own"].append((template, grid.subjects[i]))
        items["same"].append((template, grid.subjects[j]))
        items["other"].append((grid.relations[q].templates[0], grid.subjects[i]))
        items["answers"].append(grid.firsts[r][i])
        items["relation"].append(grid.relations[r].name)
        if len(items["answers"]) == limit:
            break
    return items


def transplant_item_sets(grid: FactGrid, cfg: AnalysisSettings) -> tuple[dict, dict]:
    """The gate transplants' validation items (they choose the block) and test items (:func:`_transplant_items`)."""
    gen = random.Random(generator(cfg, "selector", "transplant items").initial_seed())
    return (_transplant_items(grid, True, VALIDATION_ITEMS, gen),
            _transplant_items(grid, False, TRANSPLANT_ITEMS, gen))


def _prompt_sets(tok, items: dict) -> tuple[PromptSet, PromptSet, PromptSet, torch.Tensor]:
    return (*(PromptSet([t for t, _ in items[k]], [s for _, s in items[k]], tok) for k in ("own", "same", "other")),
            torch.tensor(items["answers"], dtype=torch.long))


def blocks_of(n_layers: int, n_blocks: int = N_BLOCKS) -> list[list[int]]:
    """The model's layers cut into ``n_blocks`` contiguous runs (fewer for shallow models)."""
    return [b.tolist() for b in torch.tensor_split(torch.arange(n_layers), min(n_blocks, n_layers))]


def _transplant(lm, grid: FactGrid, cfg: AnalysisSettings, log: Log) -> dict:
    """Gate transplants: the block of layers with the largest (same - other) keep rate on validation facts,
    then every measure on test facts, pooled and per relation of the test facts (``by_relation``: the same items
    split by their own relation r; a relation with fewer than MIN_RELATION_ITEMS gets its count and an error)."""
    val, test = transplant_item_sets(grid, cfg)
    if not val["answers"] or not test["answers"]:
        return {"error": f"too few known facts with a donor ({len(val['answers'])} validation, "
                         f"{len(test['answers'])} test)"}
    blocks, scores = blocks_of(lm.adapter.n_layers), []
    own, same, other, answers = _prompt_sets(lm.tokenizer, val)
    every = list(range(lm.adapter.n_layers))
    same_g, other_g = (last_gates(lm.model, p, every, cfg.batch_size)[0] for p in (same, other))
    for block in blocks:
        hits = transplant_hits(lm.model, own, answers, {l: same_g[l] for l in block},
                               {l: other_g[l] for l in block}, batch_size=cfg.batch_size)
        scores.append(float((hits["same_relation"].double() - hits["other_relation"].double()).mean()))
    best = blocks[max(range(len(blocks)), key=lambda k: (scores[k], -k))]
    log(f"selector: gate transplant at layers {best[0]}-{best[-1]} (chosen on {len(val['answers'])} validation "
        f"facts), {len(test['answers'])} test facts")
    hits = gate_transplant(lm.model, *_prompt_sets(lm.tokenizer, test), best,
                           generator(cfg, "selector", "random units"), cfg.batch_size,
                           matched_gen=generator(cfg, "selector", "matched units"))
    by_relation = {}
    for name in dict.fromkeys(test["relation"]):
        rows = torch.tensor([k for k, r in enumerate(test["relation"]) if r == name])
        by_relation[name] = ({"n_items": len(rows), **transplant_metrics({k: v[rows] for k, v in hits.items()},
                                                                         cfg.n_boot, cfg.seed), "error": None}
                             if len(rows) >= MIN_RELATION_ITEMS else
                             {"n_items": len(rows), "error": f"{len(rows)} test facts; its own numbers need at "
                                                             f"least {MIN_RELATION_ITEMS} (they count in the pool)"})
    return {"block": best, "n_items": len(test["answers"]), "by_relation": by_relation,
            "block_choice": {"candidates": blocks, "validation_same_minus_other": [round(s, 4) for s in scores],
                             "n_validation": len(val["answers"]), "rule": "largest mean (same - other) keep rate "
                                                                          "on validation facts, earliest on ties"},
            **transplant_metrics(hits, cfg.n_boot, cfg.seed), "error": None}


# ---------------------------------------------------------------------------------------------- crosspatch
def patch_layers_of(layers: list[int], n_layers: int) -> list[int]:
    """The layers crosspatch patches: every layer of ``layers`` but the last block (no selection is made)."""
    return [l for l in layers if l < n_layers - 1] or list(layers)


def graded_layers_of(layers: list[int], n_layers: int, cfg: AnalysisSettings) -> list[int]:
    """The patched layers that get ``LRE_PAIR_ITEMS`` items per pair: the run's LRE layers
    (``planned_lre_layers``), among which the decoders choose the layer the claim is graded at."""
    lre = set(planned_lre_layers(cfg, layers, n_layers))
    return [l for l in patch_layers_of(layers, n_layers) if l in lre]


def pair_items(n_relations: int, facts: dict[int, list[int]], usable: Callable[[int, int], bool],
               answer: Callable[[int, int], object], per_pair: int, gen: random.Random
               ) -> list[tuple[int, int, int, int, int]]:
    """Crosspatch's item rule: for each ordered relation pair (A, B), A != B, the subjects s of ``facts[B]`` with
    ``usable(A, s)`` in ``gen``'s shuffled order, each with a recipient s' of ``facts[B]`` whose answer
    ``answer(B, s')`` differs from s's and a random s'' whose answer differs from both (both drawn by ``gen``):
    up to ``per_pair`` items (A, B, s, s', s'') per pair, pair by pair."""
    items = []
    for a in range(n_relations):
        for b in range(n_relations):
            if a == b:
                continue
            sources = [i for i in facts[b] if usable(a, i)]
            gen.shuffle(sources)
            taken = 0
            for i in sources:
                recipients = [j for j in facts[b] if answer(b, j) != answer(b, i)]
                j = gen.choice(recipients) if recipients else None
                randoms = [k for k in facts[b] if j is not None and answer(b, k) not in (answer(b, i), answer(b, j))]
                if randoms:
                    items.append((a, b, i, j, gen.choice(randoms)))
                    taken += 1
                if taken == per_pair:
                    break
    return items


def crosspatch_items(tok, grid: FactGrid, cfg: AnalysisSettings, per_pair: int = LRE_PAIR_ITEMS
                     ) -> tuple[str, list[tuple[int, int, int, int, int]]]:
    """The neutral template and crosspatch's items (A, B, s, s', s''): relation indices A != B and subject
    indices of ``grid``: up to ``per_pair`` per ordered pair (in their draw order, pair by pair), s known in B and
    located in A and in the neutral template, a recipient s' and a random subject s'' of B with other first answer
    tokens. AnalysisError when there is none."""
    neutral = neutral_templates(tok, grid.relations, cfg.neutral_templates)[0][0]
    in_neutral = [e is None for e in locate_errors(tok, neutral, grid.subjects)]
    R, first = len(grid.relations), grid.firsts
    facts = {r: [i for i in grid.known(r) if in_neutral[i]] for r in range(R)}
    gen = random.Random(generator(cfg, "crosspatch", "items").initial_seed())
    items = pair_items(R, facts, lambda a, i: grid.located[a][i], lambda b, i: first[b][i], per_pair, gen)
    if not items:
        raise AnalysisError(f"no item with a recipient and a random subject of other answers in {grid.names}")
    return neutral, items


def profile_rows(items: list[tuple], per_pair: int = PAIR_ITEMS) -> list[int]:
    """The indices of ``items`` that are each ordered pair's first ``per_pair`` (the items of every layer)."""
    seen: dict[tuple[int, int], int] = {}
    rows = []
    for k, item in enumerate(items):
        seen[item[:2]] = seen.get(item[:2], 0) + 1
        if seen[item[:2]] <= per_pair:
            rows.append(k)
    return rows


def layer_rows(items: list[tuple], layers: list[int], n_layers: int, cfg: AnalysisSettings) -> dict[int, list[int]]:
    """{patched layer: the indices of ``items`` patched there}: every item at the LRE layers
    (:func:`graded_layers_of`), each pair's first ``PAIR_ITEMS`` (:func:`profile_rows`) at the others."""
    graded, profile = set(graded_layers_of(layers, n_layers, cfg)), profile_rows(items)
    return {l: list(range(len(items))) if l in graded else profile for l in patch_layers_of(layers, n_layers)}


def crosspatch_design(tok, grid: FactGrid, layers: list[int], n_layers: int, cfg: AnalysisSettings
                      ) -> tuple[str, list[tuple[int, int, int, int, int]], dict[int, list[int]]]:
    """(neutral template, items, {layer: item indices}) of the crosspatch: up to ``LRE_PAIR_ITEMS`` per pair
    where an LRE layer is patched (else ``PAIR_ITEMS``: no layer would use more), :func:`layer_rows`."""
    per_pair = LRE_PAIR_ITEMS if graded_layers_of(layers, n_layers, cfg) else PAIR_ITEMS
    neutral, items = crosspatch_items(tok, grid, cfg, max(per_pair, PAIR_ITEMS))
    return neutral, items, layer_rows(items, layers, n_layers, cfg)


def crosspatch(lm, relations, known: dict, layers: list[int], cfg: AnalysisSettings, log: Log) -> dict:
    """One subject state serves every relation: the state of subject s at layer l, from a relation-free prompt
    (``neutral``) or from relation A's prompt (``cross_relation``), replaces the state of another subject s' at
    its last token in relation B's prompt (a real forward pass from layer l on); success = the model answers B's
    attribute of s. Beside it: the state from B's own prompt of s (``same_relation``, the reference), the neutral
    state of a random third subject s'' (``random_subject``; ``random_subject_follows``: it answers B of s'') and
    a random vector of the neutral state's norm (``random_vector``). Per layer (every layer but the last: no
    selection is made), pooled over pairs and per ordered pair (A, B): up to ``LRE_PAIR_ITEMS`` items per pair at
    the LRE layers (the claim's layer is one of them), each pair's first ``PAIR_ITEMS`` of them at the others
    (:func:`crosspatch_design`); each layer's ``n_items`` says how many."""
    t0 = time.perf_counter()
    tok, n_layers = lm.tokenizer, lm.adapter.n_layers
    grid = fact_grid(tok, relations, known, cfg)
    neutral, items, rows_at = crosspatch_design(tok, grid, layers, n_layers, cfg)
    patch_layers = list(rows_at)
    R, first = len(grid.relations), grid.firsts
    log(f"crosspatch: {len(items)} items over {R * (R - 1)} relation pairs, {len(patch_layers)} layers "
        f"({', '.join(f'{l}: {len(rows)}' for l, rows in rows_at.items())} items)")
    # subject states of relation B's prompts: the recipients' clean states and the same-relation sources
    states, answered = {}, {}
    for b in range(R):
        subjects = sorted({i for x in items if x[1] == b for i in (x[2], x[3])})
        if not subjects:                         # no item answers B (too few known facts of other answers)
            continue
        got = relation_states(lm, grid.relations[b].templates[0], [grid.subjects[i] for i in subjects],
                              patch_layers, batch_size=cfg.batch_size)
        pred = logits_fn(lm)(got.O).argmax(-1).tolist()
        for k, i in enumerate(subjects):
            states[(b, i)] = {l: got.H[l][k] for l in patch_layers}
            answered[(b, i)] = float(pred[k] == first[b][i])
    src_a = relation_states(lm, [grid.relations[a].templates[0] for a, *_ in items],
                            [grid.subjects[x[2]] for x in items], patch_layers, batch_size=cfg.batch_size).H
    needed = sorted({x[2] for x in items} | {x[4] for x in items})
    neutral_h = relation_states(lm, neutral, [grid.subjects[i] for i in needed], patch_layers,
                                batch_size=cfg.batch_size).H
    row = {i: k for k, i in enumerate(needed)}
    out = {"relations": grid.names, "neutral_template": neutral, "n_items": len(items),
           "recipients_clean": proportion([answered[(x[1], x[3])] for x in items]).to_dict(),
           "place": "blocks.{l}.resid_post at the subject's last token; relation prompts: each one's first template",
           "layers": {}, "error": None}
    for layer, rows in rows_at.items():
        at = [items[k] for k in rows]
        templates = [grid.relations[x[1]].templates[0] for x in at]
        recipients = [grid.subjects[x[3]] for x in at]
        target = torch.tensor([first[b][i] for _, b, i, _, _ in at])
        follow = torch.tensor([first[b][k] for _, b, _, _, k in at])
        pair_of = [(a, b) for a, b, *_ in at]
        clean_h = torch.stack([states[(x[1], x[3])][layer] for x in at])
        donors = {"neutral": neutral_h[layer][[row[x[2]] for x in at]],
                  "cross_relation": src_a[layer][rows],
                  "same_relation": torch.stack([states[(x[1], x[2])][layer] for x in at]),
                  "random_subject": neutral_h[layer][[row[x[4]] for x in at]]}
        donors["random_vector"] = random_direction_like(donors["neutral"], generator(cfg, "crosspatch", "random",
                                                                                     layer))
        deltas = torch.cat([donors[c] - clean_h for c in PATCHES]).float()
        resume = layer_sequences(lm, templates, recipients, layer, batch_size=cfg.batch_size)
        preds = resumed_edit_ids(lm, templates * len(PATCHES), recipients * len(PATCHES), layer, deltas,
                                 resume * len(PATCHES), batch_size=cfg.batch_size)
        preds = preds.view(len(PATCHES), len(at))
        hits = {c: (preds[k] == target).double() for k, c in enumerate(PATCHES)}
        hits["random_subject_follows"] = (preds[PATCHES.index("random_subject")] == follow).double()
        entry = {"n_items": len(at), **_patch_metrics(hits, cfg)}
        entry["pairs"] = [{"source": grid.names[a], "target": grid.names[b],
                           **{c: proportion([h for h, p in zip(hits[c].tolist(), pair_of) if p == (a, b)]).to_dict()
                              for c in PATCHES}} for a, b in dict.fromkeys(pair_of)]
        out["layers"][str(layer)] = entry
        log(f"crosspatch: layer {layer} ({len(at)} items): neutral {entry['neutral']['value']:.2f}, cross-relation "
            f"{entry['cross_relation']['value']:.2f}, same-relation {entry['same_relation']['value']:.2f}")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _patch_metrics(hits: dict[str, torch.Tensor], cfg: AnalysisSettings) -> dict:
    """Pooled metrics of one layer: ``neutral`` and ``cross_relation`` with the controls ``random_subject`` and
    ``random_vector``, the reference ``same_relation``, and their paired differences to it."""
    h = {k: v.tolist() for k, v in hits.items()}
    nulls = lambda: {"random_subject": proportion(h["random_subject"]), "random_vector": proportion(h["random_vector"])}
    out = {"neutral": proportion(h["neutral"]).with_nulls(nulls()).to_dict(),
           "cross_relation": proportion(h["cross_relation"]).with_nulls(nulls()).to_dict(),
           "same_relation": proportion(h["same_relation"]).with_nulls(nulls()).to_dict(),
           "random_subject": proportion(h["random_subject"]).to_dict(),
           "random_subject_follows": proportion(h["random_subject_follows"]).to_dict(),
           "random_vector": proportion(h["random_vector"]).to_dict()}
    for c in ("neutral", "cross_relation"):
        out[f"{c}_minus_same"] = paired_difference(h[c], h["same_relation"], n_boot=cfg.n_boot,
                                                   seed=cfg.seed).to_dict()
    return out


# ------------------------------------------------------------------------------------------------ their records
def selector_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                      cfg: AnalysisSettings, analyses: tuple = ()) -> dict:
    """The passes of ``llmprobe.analyses.selector.selector``: the gates of the gating grid's prompts up to the
    last probed layer (the model and its random twin), the donors' gates at every layer, two edited full passes
    per block of layers on the validation items, and on the test items the gates at the chosen block (its
    deepest layer assumed: the last block) and five full passes (transplants, random units, the switch-off matched
    in count and norm, clean)."""
    work = empty_passes()
    try:
        grid = fact_grid(tok, relations, known, cfg)
    except AnalysisError:
        return work
    rels, rows = complete_rows(grid)
    batch = cfg.batch_size
    if len(rows) >= 2:
        templates = [grid.relations[r].templates[0] for _ in rows for r in rels]
        subjects = [grid.subjects[i] for i in rows for _ in rels]
        copies = 2 if cfg.random_control else 1
        work["forward"] += [(filled_batches(tok, templates, subjects, batch), max(layers) + 1, False)] * copies
        work["twins"] += copies - 1
    val, test = transplant_item_sets(grid, cfg)
    if not val["answers"] or not test["answers"]:
        return work
    of = lambda items, key: filled_batches(tok, [t for t, _ in items[key]], [s for _, s in items[key]], batch)
    work["forward"] += [(of(val, "same"), n_layers, False), (of(val, "other"), n_layers, False)]
    work["forward"] += [(of(val, "own"), n_layers, True)] * (2 * len(blocks_of(n_layers)))
    work["forward"] += [(of(test, key), n_layers, False) for key in ("own", "same", "other")]
    work["forward"] += [(of(test, "own"), n_layers, True)] * 5
    return work


def crosspatch_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                        cfg: AnalysisSettings, analyses: tuple = ()) -> dict:
    """The passes of ``llmprobe.analyses.selector.crosspatch``: the subject states of each relation B's sources
    and recipients (with the LM head), of the cross-relation sources and of the neutral prompts; per patched
    layer the recipients' clean states up to it and their five patches (prefix-cached edits, as the decoders'),
    over that layer's items (:func:`crosspatch_design`)."""
    work = empty_passes()
    try:
        grid = fact_grid(tok, relations, known, cfg)
        neutral, items, rows_at = crosspatch_design(tok, grid, layers, n_layers, cfg)
    except AnalysisError:
        return work
    batch, names = cfg.batch_size, grid.subjects
    for b in range(len(grid.relations)):
        subjects = sorted({i for x in items if x[1] == b for i in (x[2], x[3])})
        if subjects:
            work["forward"].append((filled_batches(tok, [grid.relations[b].templates[0]] * len(subjects),
                                                    [names[i] for i in subjects], batch), n_layers, True))
    work["forward"].append((filled_batches(tok, [grid.relations[a].templates[0] for a, *_ in items],
                                            [names[x[2]] for x in items], batch), n_layers, False))
    needed = sorted({x[2] for x in items} | {x[4] for x in items})
    work["forward"].append((filled_batches(tok, [neutral] * len(needed), [names[i] for i in needed], batch),
                            n_layers, False))
    for layer, rows in rows_at.items():
        templates = [grid.relations[items[k][1]].templates[0] for k in rows]
        recipients = [names[items[k][3]] for k in rows]
        resumed = cached_edit_batches(jacobian_prompts(tok, templates, recipients), len(PATCHES) * len(rows), batch)
        work["forward"].append((filled_batches(tok, templates, recipients, batch), layer + 1, False))
        work["edits"] += [(b, n_layers - 1 - layer, head) for b, head in resumed]
    return work


def _crosspatch(job) -> dict:
    return crosspatch(job.lm, job.relations, job.known, job.layers, job.cfg, job.log)


def _selector(job) -> dict:
    return selector(job.lm, job.relations, job.known, job.layers, job.cfg, job.log)


CROSSPATCH = Analysis("crosspatch", ("crosspatch",), _crosspatch, crosspatch_workload, "crosspatch",
                      claims=("one subject state serves every relation",), result=CrosspatchResult)
SELECTOR = Analysis("selector", ("selector",), _selector, selector_workload, "selector",
                    claims=("MLP a relation-conditioned selector",), result=SelectorResult)
