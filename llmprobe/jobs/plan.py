"""The plan of ``llmprobe run`` (layer 5): the predicted seconds and peak memory of each stage, from the model's
config alone (no weights read), on this CPU and on one H200.

This is the cost model of ``benchmarks/scaling.py`` (docs/scaling.md); the benchmark measures and fits, this
module counts and predicts:

* :class:`Shape`: what the FLOPs and the memory depend on, read from a config (:func:`model_shape`: a local
  folder, a .gguf file, the embedded default, a preset of a published config, a hub name when online);
* :func:`run_workload`: what ``llmprobe run`` does with its settings in model-independent units (batches of
  rows x tokens, Jacobian prompts, fit counts), counted with the project's own code (splits, layer choice, the
  superposition table) on the SmolLM2 tokenizer's prompt lengths;
* :func:`known_work`, :func:`forward_work`, :func:`jacobian_work`: that workload in FLOPs and passes of a shape;
* :func:`predict`: seconds per stage. This CPU: ``CPU_FITS`` (seconds = a * work + b * passes, fitted once on
  the project's machine) times ``REFERENCE_RATE`` / this machine's one-thread matmul rate, measured now
  (:func:`measured_rate`); one H200: a roofline (``H200``).

:func:`plan` puts it together for one model and device, :func:`format_plan` prints it.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmprobe.analyses.decoders import AUTO_JACOBIAN_RANK, jacobian_rank_for
from llmprobe.analyses.multihop import bridge_budget, compositions, item_rows, reasoning, statement
from llmprobe.analyses.selector import (
    PATCHES,
    blocks_of,
    complete_rows,
    crosspatch_items,
    fact_grid,
    patch_layers_of,
    transplant_item_sets,
)
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, pick_layers, settings_from
from llmprobe.analyses.splits import relation_split
from llmprobe.analyses.superposition import superposition_table
from llmprobe.checks import UsageError, parse_layers
from llmprobe.datasets import load_relations
from llmprobe.model.known import object_token_sequences
from llmprobe.model.loading import (
    DEFAULT_INSTALL,
    DEFAULT_MODEL,
    ModelLoadError,
    _looks_like_path,
    check_hub_reachable,
    default_gguf,
    embedded_folder,
)
from llmprobe.model.scoring import first_token_targets
from llmprobe.model.subjects import encode
from llmprobe.names import ANALYSES
from llmprobe.settings import Settings
from synthetic.matched import curve_widths

# ------------------------------------------------------------------------------------------ shapes and FLOPs
VOCAB = 49152               # the SmolLM2 tokenizer's vocabulary (the benchmark models use it)
UNGATED = ("gpt2", "phi")   # model types whose MLP has two matrices (the others: gate, up, down)


@dataclass(frozen=True)
class Shape:
    """A decoder-only model's shape (what its FLOPs and memory depend on); head_dim None = d // heads."""

    name: str
    d: int
    layers: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int = VOCAB
    tied: bool = True
    head_dim: int | None = None
    mlp_matrices: int = 3

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block (attention, MLP, two norms)."""
        head = self.head_dim or self.d // self.heads
        kv = 2 * self.d * head * self.kv_heads
        return 2 * self.d * head * self.heads + kv + self.mlp_matrices * self.d * self.ff + 2 * self.d

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.d * (1 if self.tied else 2)
        return self.layers * self.block_params + embeddings + self.d

    def token_block_flops(self) -> float:
        """FLOPs of one token through one block (forward), or of one vector-Jacobian product through it."""
        return 2.0 * self.block_params

    def head_flops(self) -> float:
        """FLOPs of the LM head on one position."""
        return 2.0 * self.d * self.vocab


TARGETS = [   # published configs (vocab, MLP width, heads, tied embeddings)
    Shape("SmolLM2-135M", 576, 30, 1536, 9, 3, 49152, True),
    Shape("0.5B (Qwen2.5-0.5B)", 896, 24, 4864, 14, 2, 151936, True),
    Shape("1.5B (Qwen2.5-1.5B)", 1536, 28, 8960, 12, 2, 151936, True),
    Shape("8B (Llama-3-8B)", 4096, 32, 14336, 32, 8, 128256, False),
    Shape("70B (Llama-3-70B)", 8192, 80, 28672, 64, 8, 128256, False),
]


def preset_key(name: str) -> str:
    """``meta-llama/Meta-Llama-3-8B-Instruct`` -> ``llama-3-8b``: a hub name without owner, ``meta-`` and
    ``-instruct``, lower case."""
    key = name.strip().lower().split("/")[-1]
    return key.removeprefix("meta-").removesuffix("-instruct")


# preset key -> Shape: each target by its short label ("8b") and its model ("llama-3-8b"); Llama-3.1 has 3's shape
PRESETS = {preset_key(part.strip("()")): shape for shape in TARGETS for part in shape.name.split(" ")}
PRESETS.update({"llama-3.1-8b": TARGETS[3], "llama-3.1-70b": TARGETS[4]})


def shape_from_config(config, name: str) -> Shape:
    """The Shape of a transformers config (its text config for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d, heads = int(text.hidden_size), int(text.num_attention_heads)
    ff = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * d
    return Shape(name, d, int(text.num_hidden_layers), int(ff), heads,
                 int(getattr(text, "num_key_value_heads", None) or heads), int(text.vocab_size),
                 bool(getattr(config, "tie_word_embeddings", True)), getattr(text, "head_dim", None) or None,
                 2 if getattr(text, "model_type", "") in UNGATED else 3)


def _config_of(name: str | Path, trust_remote_code: bool = False, **kwargs):
    """transformers' config of a folder, GGUF file's folder (``gguf_file=``) or hub name: config.json only."""
    from transformers import AutoConfig  # lazy: start-up time: the CLI's checks and errors do not load transformers

    return AutoConfig.from_pretrained(str(name), trust_remote_code=trust_remote_code, **kwargs)


def model_shape(model=None, trust_remote_code: bool = False) -> tuple[Shape, str]:
    """(Shape, where it came from) of ``model``: None or the embedded default's name (its cached safetensors
    copy's config.json, else its GGUF file's metadata: no weights dequantised), a local folder (config.json) or
    .gguf file, a preset (``PRESETS``: ``meta-llama/Meta-Llama-3-8B``, ``Qwen/Qwen2.5-0.5B``, ...), a hub name
    (cached or online; remote code only with ``trust_remote_code``), a transformers config or a Shape.
    UsageError naming ``model`` when none of these reads it."""
    if isinstance(model, Shape):
        return model, "given shape"
    if model is not None and not isinstance(model, (str, os.PathLike)):
        return shape_from_config(model, getattr(model, "_name_or_path", "") or "config"), "given config"
    name = None if model is None else str(model)
    if name is None or name == DEFAULT_MODEL:
        try:
            gguf = default_gguf()
        except ModelLoadError:
            return PRESETS["smollm2-135m"], f"preset: the embedded model's shape (not installed: {DEFAULT_INSTALL})"
        folder = embedded_folder(gguf)
        if (folder / "config.json").is_file():
            return shape_from_config(_config_of(folder), DEFAULT_MODEL), "the embedded model's config.json"
        return shape_from_config(_config_of(gguf.parent, gguf_file=gguf.name), DEFAULT_MODEL), f"metadata of {gguf}"
    local = Path(os.path.expanduser(name))
    presets = ", ".join(sorted(PRESETS))
    if local.is_dir() and not (local / "config.json").is_file():
        raise UsageError(f"{name}: a folder without config.json; pass a model folder, a .gguf file, a hub name or "
                         f"a preset ({presets})")
    if local.is_dir() or (local.is_file() and name.lower().endswith(".gguf")):
        where, kwargs = (local, {}) if local.is_dir() else (local.parent, {"gguf_file": local.name})
        source = f"{local / 'config.json'}" if local.is_dir() else f"metadata of {local}"
    elif preset_key(name) in PRESETS:
        return PRESETS[preset_key(name)], f"preset {PRESETS[preset_key(name)].name}: its published config"
    elif local.exists() or _looks_like_path(name):
        raise UsageError(f"{name}: no model folder or .gguf file there, and not a preset ({presets})")
    else:
        where, kwargs, source = name, {}, f"the hub's config.json of {name}"
    try:
        if where == name:
            check_hub_reachable(name, None)
        return shape_from_config(_config_of(where, trust_remote_code, **kwargs), name), source
    except (ModelLoadError, OSError, ValueError, KeyError, AttributeError, TypeError) as error:
        first = (str(error).splitlines() or [""])[0]
        raise UsageError(f"{name}: no config to plan from ({type(error).__name__}: {first}); presets that work "
                         f"offline: {presets}") from None


# ------------------------------------------------------------------------------------- workload in FLOPs
@dataclass
class Work:
    """One stage's work: FLOPs (model, on the device) and passes (forward or backward calls)."""

    flops: float = 0.0
    passes: int = 0

    def add(self, flops: float, passes: int = 1) -> None:
        self.flops += flops
        self.passes += passes


def sum_work(parts) -> Work:
    total = Work()
    for wk in parts:
        total.add(wk.flops, wk.passes)
    return total


def known_work(shape: Shape, batches: list[tuple[int, int, int]]) -> Work:
    """known_facts: per batch (rows, padded prompt tokens, tokens generated): prefill + one step per further
    token, the LM head on one position per row and step."""
    w = Work()
    for rows, prompt, gen in batches:
        w.add(rows * ((prompt + gen - 1) * shape.layers * shape.token_block_flops() + gen * shape.head_flops()),
              gen)
    return w


def forward_work(shape: Shape, batches: list[tuple[int, int]], blocks: int, head: bool = False) -> Work:
    """Forward passes of (rows, padded tokens) batches through ``blocks`` blocks (+ LM head on one row each)."""
    w = Work()
    for rows, tokens in batches:
        w.add(rows * (tokens * blocks * shape.token_block_flops() + (shape.head_flops() if head else 0.0)))
    return w


def edit_work(shape: Shape, edits: list[tuple[list[tuple[int, int]], int, bool]]) -> Work:
    """The edits' passes: (batches, blocks, LM head) entries of ``run_workload``'s "edits"."""
    return sum_work(forward_work(shape, b, blocks, head) for b, blocks, head in edits)


def jacobian_work(shape: Shape, prompts: list[tuple[int, int]], layers: list[int], rank: int | None = None,
                  oversample: int = 10, batch_size: int = 16, chunk: int = AnalysisSettings.jacobian_chunk) -> Work:
    """subject_jacobians of prompts (tokens before the subject's last, tokens from it to the end) at the subject
    states of ``layers``, rows grouped by the second number: a prefix forward without grad, a forward with grad,
    then the products, each through the blocks after the layer it reaches (``chunk`` per batched backward): from
    o = blocks.{L-1}.resid_post to the state blocks.{l}.resid_post, blocks l+1 .. L-1 (L - 1 - l of them, as
    ``llmprobe.model.lre.jacobian_cost`` counts them; torch's FlopCounterMode agrees, tests/test_scaling_bench.py).

    Exact (``rank`` None, or k = rank + oversample >= d): d VJPs from o, through the blocks after min(layers)
    (one backward reaches every layer). Low-rank (``llmprobe.model.lre._lowrank_rows``): k VJPs through the blocks
    after min(layers) (shared by the layers), then per layer l k JVPs and k VJPs through the blocks after l."""
    k = None if rank is None or rank + oversample >= shape.d else rank + oversample
    first = min(layers)
    terms = [(shape.d, first)] if k is None else [(k, first)] + [(2 * k, l) for l in layers]
    w = Work()
    for start in range(0, len(prompts), batch_size):
        part = prompts[start:start + batch_size]
        for after in sorted({a for _, a in part}):
            group = [p for p in part if p[1] == after]
            rows, prefix = len(group), max(p for p, _ in group)
            w.add(rows * (prefix + after) * shape.layers * shape.token_block_flops(), 2)
            for products, layer in terms:
                w.add(products * rows * after * (shape.layers - 1 - layer) * shape.token_block_flops(),
                      math.ceil(products / chunk))
    return w


# -------------------------------------------------------------------------------------- the run's workload
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
    """The passes of ``llmprobe.model.lre.edited_predictions`` for ``rows`` edits cycling through ``prompts``
    ((tokens before the subject's last, tokens from it to the end) per distinct prompt, :func:`jacobian_prompts`):
    each distinct prompt's tokens before the subject once, without the LM head, and each edit's tokens from the
    subject on, with it; as [(batches of (rows, padded tokens), head)] (the rare micro-batches run again near a tie
    are not counted)."""
    edited = [prompts[i % len(prompts)] for i in range(rows)] if prompts else []
    return [(length_batches([before for before, _ in prompts[:rows]], batch_size), False),
            (length_batches([after for _, after in edited], batch_size), True)]


def known_batches(tok, prompts: list[str], objects: list[str], batch_size: int = 32) -> list[tuple[int, int, int]]:
    """(rows, padded prompt tokens, generated tokens) per batch of ``known_facts`` (its ordering and budgets)."""
    budgets = [min(len(s) + 1, 16) for s in object_token_sequences(tok, prompts, objects)]
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


# Known facts of SmolLM2-135M-Instruct per relation (measured: `llmprobe run`, report schema 2, README). The
# decoders use the first min(known, 90) of them; relations with fewer than 8 are skipped. Larger models know more
# facts: the prediction states this assumption and also gives the upper bound with every fact known.
SMOLLM2_KNOWN = {"company_hq_city": 5, "company_hq_country": 10, "country_capital": 49, "country_continent": 106,
                 "country_currency": 33, "country_demonym": 19, "country_language": 79, "country_subregion": 16,
                 "landmark_city": 18, "landmark_country": 22, "person_citizenship": 5, "person_occupation": 17,
                 "product_company": 1}
SMOLLM2_KNOWN_FRACTION = 380 / 1574   # of every bundled fact: assumed for a relation not in SMOLLM2_KNOWN
# the matched controls' table is the superposition table of the bundled relations (all facts), the same for any
# model; measured on it in the SmolLM2 run of 2026-12-01 (3 seeds, 100 steps past the fit, 2000-step cap):
MATCHED_D_STAR = {"trainable": 3, "frozen": 8}
CONTROL_STEPS = 200     # mean training steps per seed of the curve's points at d >= 48 (27 trainings, both modes)
CONTROL_POINT_STEPS = {"trainable": {3: 2000, 6: 262, 12: 190, 24: 165},     # narrower points: per seed, measured
                       "frozen": {8: 1767, 16: 298, 32: 199}}
MATCHED_SEARCH_S = {"trainable": 38.3, "frozen": 25.6}   # each mode's d* bisection (widths 2-8, model-independent)
PREDICT_RANK = AUTO_JACOBIAN_RANK   # the low rank ``--jacobian-rank auto`` takes (128)


def run_workload(tok, n_layers: int, known_counts: dict | None, cfg: AnalysisSettings | None = None,
                 relations: list | None = None, layers: str = "every:3", analyses=ANALYSES,
                 matched_modes=tuple(MATCHED_D_STAR), at_model_width: bool = True, known_results: dict | None = None
                 ) -> dict:
    """What ``llmprobe run`` does with these settings (default: its defaults), in model-independent units:
    batches of (rows, tokens), Jacobian prompts, CPU fit counts. ``relations`` None = every bundled relation;
    ``known_counts`` None = every fact known; the mechanism analyses count on ``known_results`` (relation name ->
    its known-facts results) when given, else on each relation's first ``known_counts`` facts. Without ``lre`` no Jacobians, LRE fits or causality edits; without
    ``ridge`` no ridge fits; without ``superposition`` no states, readouts or swap edits; ``matched_modes`` ()
    = no matched controls."""
    cfg = cfg or AnalysisSettings()
    relations = load_relations(None) if relations is None else relations
    do_lre, do_ridge, do_sup = ("lre" in analyses), ("ridge" in analyses), ("superposition" in analyses)
    layers = parse_layers(layers, n_layers)
    lre_layers = (sorted({l % n_layers for l in cfg.lre_layers} & set(layers)) if cfg.lre_layers is not None else
                  pick_layers(layers, cfg.max_lre_layers, n_layers))
    w: dict = {"layers": layers, "lre_layers": lre_layers, "known": [], "forward": [], "edits": [], "jacobian": [],
               "lre_fits": 0, "ridge_fits": 0, "head_rows": 0, "states": [], "readouts": len(layers) if do_sup else 0,
               "matched_modes": tuple(matched_modes), "at_model_width": at_model_width}
    for rel in relations:
        template = rel.templates[0]
        prompts = [template.replace("{}", f.subject, 1) for f in rel.facts]
        w["known"] += known_batches(tok, prompts, [f.object for f in rel.facts])
        known = len(rel.facts) if known_counts is None else known_counts.get(rel.name, 0)
        n = min(known, cfg.max_subjects)
        if n < cfg.min_known or not (do_lre or do_ridge):
            continue
        facts = rel.facts[:n]
        subjects = [f.subject for f in facts]
        y = first_token_targets(tok, prompts[:n], [f.object for f in facts])
        try:
            split = relation_split(y, rel.name, cfg)
        except AnalysisError:                                                    # too few facts: skipped
            continue
        batches = padded_batches(tok, prompts[:n], cfg.batch_size)
        w["forward"].append((batches, n_layers))                                  # relation_states
        if do_lre:
            union = split.jacobian_union().tolist()
            w["jacobian"].append(jacobian_prompts(tok, template, [subjects[i] for i in union]))
        n_test_pairs = len(split.test_pairs[0])
        for layer in layers:
            for refit in split.refits:
                if do_ridge:
                    w["ridge_fits"] += len(cfg.ridge_alphas) + 1
                    w["head_rows"] += len(cfg.ridge_alphas) * len(refit.val) + 2 * len(split.test)
                if do_lre and layer in lre_layers:
                    w["lre_fits"] += 1
                    w["head_rows"] += 21 * len(refit.val) + len(split.test)
        edits = sum(len(cfg.edit_ranks) * len(r.val_pairs[0]) + 3 * n_test_pairs + 2 * n_test_pairs
                    for r in split.refits) + n_test_pairs
        causal = cached_edit_batches(jacobian_prompts(tok, template, subjects), edits, cfg.batch_size) \
            if do_lre else []
        for layer in lre_layers if do_lre else []:                               # causality layers = LRE layers
            w["forward"].append((batches, layer + 1))                            # layer_sequences
            w["edits"] += [(b, n_layers - 1 - layer, head) for b, head in causal]
    assumed = known_results if known_results is not None else assumed_known(relations, known_counts)
    w["mechanisms"] = {name: count(tok, relations, assumed, layers, n_layers, cfg)
                       for name, count in MECHANISM_WORKLOADS.items() if name in analyses}
    try:
        table = superposition_table(tok, relations, {}, cfg) if do_sup or matched_modes else None
    except AnalysisError:                                # too few shared subjects: no readouts, no controls
        table, w["readouts"], w["matched_modes"] = None, 0, ()
    w["n_subjects"] = len(table.subjects) if table is not None else 0
    w["n_facts_table"] = int((table.A >= 0).sum()) if table is not None else 0
    if table is None or not do_sup:
        return w
    subjects = table.subjects
    for template in table.neutral:                                              # the model and its random twin
        neutral = [template.replace("{}", s, 1) for s in subjects]
        w["states"] += padded_batches(tok, neutral, cfg.batch_size * 2) * 2
    R = len(table.relations)
    m = min(cfg.max_swap_subjects, len(subjects)) * R                          # swap edits (at most)
    swap_templates = [table.relations[i % R].templates[0] for i in range(m)]
    swap_subjects = [subjects[i % len(subjects)] for i in range(m)]
    sample = padded_batches(tok, [t.replace("{}", s, 1) for t, s in zip(swap_templates, swap_subjects)],
                            cfg.batch_size)
    swapped = cached_edit_batches(jacobian_prompts(tok, swap_templates, swap_subjects), m * 4 * len(cfg.swap_scales),
                                  cfg.batch_size)
    for layer in lre_layers:
        w["edits"] += [(b, n_layers - 1 - layer, head) for b, head in swapped]
        w["forward"].append((sample, n_layers))                                 # clean answers
        w["forward"].append((sample, layer + 1))                                # layer_sequences
    return w


# --------------------------------------------------------------------------- the mechanism analyses' workload
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


def _mechanism() -> dict:
    """An empty workload of one mechanism analysis: forward passes [(batches, blocks, LM head)], prefix-cached
    edits (the same), greedy generation [(rows, prompt tokens, new tokens)], random twins built."""
    return {"forward": [], "edits": [], "generate": [], "twins": 0}


def _filled_batches(tok, templates: list[str], subjects: list[str], batch_size: int) -> list[tuple[int, int]]:
    return padded_batches(tok, [t.replace("{}", s, 1) for t, s in zip(templates, subjects)], batch_size)


def selector_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                      cfg: AnalysisSettings) -> dict:
    """The passes of ``llmprobe.analyses.selector.selector``: the gates of the gating grid's prompts up to the
    last probed layer (the model and its random twin), the donors' gates at every layer, two edited full passes
    per block of layers on the validation items, and on the test items the gates at the chosen block (its
    deepest layer assumed: the last block) and four full passes (transplants, random units, clean)."""
    work = _mechanism()
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
        work["forward"] += [(_filled_batches(tok, templates, subjects, batch), max(layers) + 1, False)] * copies
        work["twins"] += copies - 1
    val, test = transplant_item_sets(grid, cfg)
    if not val["answers"] or not test["answers"]:
        return work
    of = lambda items, key: _filled_batches(tok, [t for t, _ in items[key]], [s for _, s in items[key]], batch)
    work["forward"] += [(of(val, "same"), n_layers, False), (of(val, "other"), n_layers, False)]
    work["forward"] += [(of(val, "own"), n_layers, True)] * (2 * len(blocks_of(n_layers)))
    work["forward"] += [(of(test, key), n_layers, False) for key in ("own", "same", "other")]
    work["forward"] += [(of(test, "own"), n_layers, True)] * 4
    return work


def crosspatch_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                        cfg: AnalysisSettings) -> dict:
    """The passes of ``llmprobe.analyses.selector.crosspatch``: the subject states of each relation B's sources
    and recipients (with the LM head), of the cross-relation sources and of the neutral prompts; per patched
    layer the recipients' clean states up to it and their five patches (prefix-cached edits, as the decoders')."""
    work = _mechanism()
    try:
        grid = fact_grid(tok, relations, known, cfg)
        neutral, items = crosspatch_items(tok, grid, cfg)
    except AnalysisError:
        return work
    batch, names = cfg.batch_size, grid.subjects
    for b in range(len(grid.relations)):
        subjects = sorted({i for x in items if x[1] == b for i in (x[2], x[3])})
        if subjects:
            work["forward"].append((_filled_batches(tok, [grid.relations[b].templates[0]] * len(subjects),
                                                    [names[i] for i in subjects], batch), n_layers, True))
    work["forward"].append((_filled_batches(tok, [grid.relations[a].templates[0] for a, *_ in items],
                                            [names[x[2]] for x in items], batch), n_layers, False))
    needed = sorted({x[2] for x in items} | {x[4] for x in items})
    work["forward"].append((_filled_batches(tok, [neutral] * len(needed), [names[i] for i in needed], batch),
                            n_layers, False))
    templates = [grid.relations[x[1]].templates[0] for x in items]
    recipients = [names[x[3]] for x in items]
    resumed = cached_edit_batches(jacobian_prompts(tok, templates, recipients), len(PATCHES) * len(items), batch)
    for layer in patch_layers_of(layers, n_layers):
        work["forward"].append((_filled_batches(tok, templates, recipients, batch), layer + 1, False))
        work["edits"] += [(b, n_layers - 1 - layer, head) for b, head in resumed]
    return work


def _generation_batches(tok, prompts: list[str], new_tokens: int, batch_size: int) -> list[tuple[int, int, int]]:
    """(rows, padded prompt tokens, tokens generated) per batch of ``greedy_tokens`` with one budget."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    lengths = [len(ids) for ids in tok(prompts)["input_ids"]] if prompts else []
    return [(len(part), max(lengths[i] for i in part), new_tokens)
            for part in (order[k:k + batch_size] for k in range(0, len(order), batch_size))]


def multihop_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                      cfg: AnalysisSettings) -> dict:
    """The passes of ``llmprobe.analyses.multihop.multihop``: the direct prompts (the model and its random
    twin), each bridge generated greedily after the chain-of-thought prompt (to its full budget), and the
    chain-of-thought and ceiling prompts' next tokens. The model's own bridges are not known before it runs: the
    true ones stand in for them, and each chain-of-thought prompt is counted apart from its ceiling (as when a
    bridge is wrong)."""
    work = _mechanism()
    rows, _ = item_rows(compositions(relations), relations, known, cfg)
    if not rows:
        return work
    batch = cfg.batch_size
    direct = [p["direct"] for *_, p in rows]
    work["forward"].append((padded_batches(tok, direct, batch), n_layers, True))
    texts = [p["cot"] + " " + statement(comp.hops[0], c.subject) for comp, c, p in rows]
    for step in range(max(len(comp.hops) for comp, _, _ in rows) - 1):
        todo = [i for i, (comp, _, _) in enumerate(rows) if len(comp.hops) > step + 1]
        bridges = [rows[i][1].bridges[step] for i in todo]
        work["generate"] += _generation_batches(tok, [texts[i] for i in todo], bridge_budget(tok, bridges), batch)
        for i, bridge in zip(todo, bridges):
            texts[i] += f" {bridge}. " + statement(rows[i][0].hops[step + 1], bridge)
    ceiling = [p["cot"] + " " + reasoning(comp, c).rsplit(" " + c.answer + ".", 1)[0] for comp, c, p in rows]
    work["forward"].append((padded_batches(tok, texts + ceiling, batch), n_layers, True))
    bridges = {c.bridges[s] for _, c, _ in rows for s in range(len(c.bridges))}
    if cfg.random_control and sum(len(c.bridges) for _, c, _ in rows) >= 4 and len(bridges) >= 2:
        work["forward"].append((padded_batches(tok, direct, batch), n_layers, True))
        work["twins"] += 1
    return work


MECHANISM_WORKLOADS = {"crosspatch": crosspatch_workload, "selector": selector_workload,
                       "multihop": multihop_workload}


def mechanism_work(shape: Shape, work: dict) -> Work:
    """One mechanism analysis' workload in FLOPs and passes of ``shape``: its forward passes, edits and
    generation."""
    return sum_work([sum_work(forward_work(shape, b, blocks, head) for b, blocks, head in work["forward"]),
                     edit_work(shape, work["edits"]), known_work(shape, work["generate"])])


# ------------------------------------------------------------------------------------------------ predict
H200 = {"peak_flops": 989e12,        # bf16 dense tensor-core peak (NVIDIA H200 SXM datasheet)
        "efficiency": 0.25,          # assumed achieved fraction for these small batches (tens of tokens a pass)
        "hbm_bytes_per_s": 4.8e12,   # every pass reads the weights it uses once (a memory-bound floor)
        "launch_s_per_block": 1e-4,  # assumed eager-PyTorch overhead per block per pass (~10 kernels + hooks)
        "disk_bytes_per_s": 2e9,     # assumed safetensors read speed (load)
        "hbm_bytes": 139 * 2**30,    # usable GPU memory (what torch reports on the H200 machine)
        "bytes_per_param": 2,        # bfloat16 (``--dtype auto`` on CUDA)
        "fp32_flops": 67e12,         # float32 (no TF32) peak: the matched controls train in float32 on the GPU
        "matched_efficiency": 0.5,   # assumed for their full-batch steps (1158 rows x d x 8d matmuls)
        "matched_step_s": 1e-3}      # assumed overhead per training step (forward, backward, Adam: ~40 kernels)

# The fits of benchmarks/scaling.py on the project's 2-core CPU machine, one thread, CPU seconds (docs/scaling.md,
# "Measured", 2026-12-01, third session; as printed there: work per second 1/a to 3 digits, b to the ms):
# stage -> (work per second, seconds per pass). Work: FLOPs for the model stages, weight bytes for load,
# parameters for random_init, the operation counts of docs/scaling.md for the width-only CPU stages.
FITTED = {"load": (1.34e9, 0.313), "known_facts": (6.03e10, 0.052), "capture": (6.69e10, 0.042),
          "edits": (7.17e10, 0.073), "jacobians": (9.01e10, 0.023), "jacobians_lowrank": (9.96e10, 0.018),
          "random_init": (6.4e7, 0.332), "lre_fit": (4.26e8, 0.079), "lre_fit_lowrank": (7.49e8, 0.081),
          "ridge_fit": (3.88e9, 0.001), "readout": (3.98e6, 0.0), "matched_step": (1.18e11, 0.0031),
          "matched_measure": (8.48e5, 0.0), "mechanisms": (1.22e11, 0.0073)}
# jacobians and jacobians_lowrank were fitted on FLOPs that took each product through one block too many (3 blocks
# where 2 run at the benchmark's layer L-3: x 0.669 and x 0.541 of the work on its configs). Their rates are kept:
# at the run's depth (23 blocks after layer 6) SmolLM2's exact Jacobians, counted by torch, ran at 9.5e10 in these
# units (1.70 TFLOP in 31.4 s on one thread at 83 GFLOP/s matmul, x 145/83; 2026-12-03), and the low-rank/exact
# ratio of the two rates is the one the measured speed-ups at K = 32-128 confirm (docs/scaling.md). Refit left.
# matched_step is refitted on the 16 curve points of the SmolLM2 run of 2026-12-05 with denormals flushed in the
# controls' training (each point's CPU seconds in its one-thread worker x 188/145, the run's mean one-thread rate
# over REFERENCE_RATE, less matched_measure, against FLOPs x steps and steps over its 3 seeds, least squares
# weighted by 1/sqrt(seconds); widths 3-576: 676 s predicted for 682 measured), and MATCHED_SEARCH_S on its
# searches; the fit before it (8.12e10, 0.010; 71.4 / 69.2 s) priced the denormal steps past each fit.
# known_facts was (4.58e10, 0.069) from the benchmark; both numbers are now x 0.76, the measured / planned
# seconds of the SmolLM2 run of 2026-12-05 (35.9 s over its 2 processes, 94.6 one-thread seconds planned at its
# 181 GFLOP/s). mechanisms (crosspatch, selector, multihop: FLOPs and passes of mechanism_work) is fitted on that
# run's three analyses, counted with its own known facts (least squares of the relative errors, less the random
# twins' construction, at REFERENCE_RATE: 1.03, 0.91 and 1.05 of the measured 44.9, 17.1 and 57.6 s). Their
# passes are longer than the benchmark's (few-shot prompts, 5 patches per item), so they run faster than the
# capture fit says (it predicted 1.5-2x their time).
CPU_FITS = {stage: {"a": 1.0 / rate, "b": b} for stage, (rate, b) in FITTED.items()}
# the matched control's parameters at width d: 16 d^2 (its 8d MLP) + (193 subjects + 6 relations + 577 attributes
# + 9) d on the default table (counted by ``synthetic.matched.train_at``, as the benchmark's quadratic fit does)
CPU_FITS["matched_params"] = [16.0, 785.0, 0.0]
# one thread's dense float32 matmul rate per CPU second on the fit's machine (``measured_rate()``, five runs on
# 2026-12-02 at load average 1-2: 140-151 GFLOP/s): it over this machine's rate scales every CPU fit
REFERENCE_RATE = 145e9
PROCESS_BYTES = 0.5 * 2**30   # Python, torch and the tokenizer: the smallest benchmark model's peak RSS less its model


def h200_matched_step(flops: float) -> float:
    """Seconds of one full-batch training step of a matched control on the H200 (``llmprobe run`` trains them on
    the model's GPU): float32 FLOPs at the assumed efficiency plus a per-step overhead."""
    return flops / (H200["fp32_flops"] * H200["matched_efficiency"]) + H200["matched_step_s"]


def cpu_model_cost(fits: dict):
    """The fitted cost of model work on this machine: seconds = a FLOPs + b passes (low-rank Jacobians by the
    exact ones' fit when they were not measured)."""
    def cost(stage: str, wk: Work, shape: Shape) -> float:
        f = fits.get(stage) or fits[stage.replace("_lowrank", "")]
        return f["a"] * wk.flops + f["b"] * wk.passes
    return cost


def h200_model_cost(stage: str, wk: Work, shape: Shape) -> float:
    """Roofline of model work on one H200: FLOPs at an assumed efficiency, plus per pass the weights read from
    HBM once and a launch overhead per block."""
    weights = shape.params * H200["bytes_per_param"]
    per_pass = weights / H200["hbm_bytes_per_s"] + shape.layers * H200["launch_s_per_block"]
    return wk.flops / (H200["peak_flops"] * H200["efficiency"]) + wk.passes * per_pass


def auto_rank(shape: Shape, lre_layers: list[int], cfg: AnalysisSettings | None = None) -> int | None:
    """The Jacobian rank ``cfg.jacobian_rank`` (default ``auto``) takes for this shape (None: exact)."""
    return jacobian_rank_for(cfg or AnalysisSettings(), shape.d, lre_layers, shape.layers)


def matched_params(d: int, width_fits: dict = CPU_FITS) -> float:
    """Parameters of the matched control at width d: the quadratic through the measured widths' counts."""
    p2, p1, p0 = width_fits["matched_params"]
    return p2 * d * d + p1 * d + p0


def matched_step_flops(d: int, n_facts: int, width_fits: dict = CPU_FITS) -> float:
    """FLOPs of one full-batch training step of the matched control at width d on ``n_facts`` facts: 6 per
    parameter per fact (forward and backward)."""
    return 6.0 * matched_params(d, width_fits) * n_facts


def matched_curve(mode: str, d_model: int, at_model_width: bool = True, n_seeds: int = 3) -> list[tuple[int, float]]:
    """(width, training steps of all its seeds) of every point of ``mode``'s curve as planned: the widths of
    ``synthetic.matched.curve_widths`` from the measured d*, each seed's steps as measured on the default table
    (``CONTROL_POINT_STEPS``, else ``CONTROL_STEPS``)."""
    return [(d, CONTROL_POINT_STEPS[mode].get(d, CONTROL_STEPS) * n_seeds)
            for d in curve_widths(MATCHED_D_STAR[mode], d_model, at_model_width)]


def analyses_budget(threads: int, workers: int) -> tuple[int, int]:
    """(torch threads of each analysis process, analysis processes) of ``llmprobe run`` on ``threads`` threads
    beside ``workers`` one-thread controls workers: the threads the workers leave, max(1, threads - workers), in as
    many processes of that many threads as the threads hold (the cores the workers free when they finish)."""
    each = max(1, threads - workers)
    return each, max(1, threads // each) if workers else 1


def predict(shape: Shape, work: dict, model_cost, width_fits: dict, load_s: float, init_s: float,
            rank: int | None, matched_step=None, search_s: float = sum(MATCHED_SEARCH_S.values()),
            cores: int | None = None, helpers_fit: bool = True) -> dict:
    """Seconds per stage of ``llmprobe run`` for ``shape``: model work through ``model_cost(stage, Work, shape)``,
    the width-only CPU work (decoder fits, readouts, controls) from ``width_fits`` (it runs on the host CPU on any
    device), ``load_s`` and ``init_s`` (the random-init control's construction) given; the matched controls'
    training steps by ``matched_step(FLOPs)`` (default: the CPU fit), their threshold searches ``search_s`` (both
    modes) and measurements at the CPU fit's speed, ``n_seeds`` trainings per point, one worker per mode.
    wall = load + known facts over the analyses' processes + max(analyses over their processes, the longer mode's
    controls, all of that work over ``cores``) (the known facts' and analyses' seconds are one thread's, so on
    several cores this is an upper bound; their processes ``analyses_processes``: cores // the threads the workers
    leave, as ``llmprobe run`` starts them (the known facts are shared by the same processes before the workers),
    1 when ``helpers_fit`` is false (the helpers' model copies would not fit in half the memory);
    ``cores`` None, on a GPU: one process and the last term left out, the GPU's small-batch passes leaving room for
    the controls' steps beside them)."""
    def width_cost(stage: str, flops: float, count: float) -> float:
        f = width_fits[stage]
        return count * (f["a"] * flops + f["b"])

    fwd = sum_work(forward_work(shape, b, blocks) for b, blocks in work["forward"])
    edits = edit_work(shape, work["edits"])
    jac = sum_work(jacobian_work(shape, p, work["lre_layers"], rank) for p in work["jacobian"])
    heads = Work(work["head_rows"] * shape.head_flops(), 0)
    states = forward_work(shape, work["states"], shape.layers)
    out = {"load": load_s, "known_facts": model_cost("known_facts", known_work(shape, work["known"]), shape),
           "jacobians": model_cost("jacobians" if rank is None else "jacobians_lowrank", jac, shape)}
    factored = rank is not None and rank + 10 < shape.d and "lre_fit_lowrank" in width_fits   # as subject_jacobians
    lre_fits = (width_cost("lre_fit_lowrank", float(shape.d) ** 2 * rank, work["lre_fits"]) if factored else
                width_cost("lre_fit", float(shape.d) ** 3, work["lre_fits"]))
    out["decoders_other"] = (model_cost("capture", fwd, shape) + model_cost("edits", edits, shape)
                             + model_cost("capture", heads, shape) + lre_fits
                             + width_cost("ridge_fit", 45.0 * shape.d ** 2, work["ridge_fits"]))
    out["superposition"] = (model_cost("capture", states, shape) + init_s
                            + width_cost("readout", float(work["n_subjects"]) ** 2 * shape.d, work["readouts"]))
    per_mode = {}
    for mode in (m for m in work.get("matched_modes", MATCHED_D_STAR) if m in MATCHED_D_STAR):
        seconds = search_s * MATCHED_SEARCH_S[mode] / sum(MATCHED_SEARCH_S.values())
        for width, steps in matched_curve(mode, shape.d, work.get("at_model_width", True), work.get("n_seeds", 3)):
            flops = matched_step_flops(width, work["n_facts_table"], width_fits)
            seconds += (width_cost("matched_step", flops, steps) if matched_step is None else
                        steps * matched_step(flops))
            seconds += width_cost("matched_measure", float(work["n_subjects"]) ** 2 * width, 1)
        per_mode[mode] = seconds
    out["matched"] = max(per_mode.values(), default=0.0)          # one worker per mode, side by side
    out["matched_total"] = sum(per_mode.values())
    for name in MECHANISM_WORKLOADS:
        mechanism = work.get("mechanisms", {}).get(name) or _mechanism()
        out[name] = model_cost("mechanisms", mechanism_work(shape, mechanism), shape) + mechanism["twins"] * init_s
    out["analyses"] = sum(out[stage] for stage in ("jacobians", "decoders_other", "superposition",
                                                    *MECHANISM_WORKLOADS))
    # beside the workers the analyses run on the threads left, in as many processes of that many threads as the
    # cores hold (llmprobe.jobs.helpers); the workers and the analyses share the cores: no faster than their work
    # spread over every core
    out["analyses_processes"] = analyses_budget(cores, len(per_mode))[1] if cores and helpers_fit else 1
    shared = (out["analyses"] + out["matched_total"]) / cores if cores else 0.0
    out["wall"] = (out["load"] + out["known_facts"] / out["analyses_processes"]
                   + max(out["analyses"] / out["analyses_processes"], out["matched"], shared))
    return out


def scaled_fits(fits: dict, factor: float) -> dict:
    """``fits`` with every stage's a and b times ``factor`` (load, a disk read, and the control parameters kept)."""
    return {stage: f if stage in ("load", "matched_params") else {**f, "a": f["a"] * factor, "b": f["b"] * factor}
            for stage, f in fits.items()}


def predict_on(shape: Shape, work: dict, fits: dict, device: str, rank: int | None, cpu_scale: float = 1.0,
               helpers_fit: bool = True) -> dict:
    """:func:`predict` on ``device``: "cpu" by ``fits`` times ``cpu_scale`` (float32 weights read at the load
    fit's speed), "h200" by the roofline (bf16 weights read at ``H200["disk_bytes_per_s"]``), its host-CPU work
    (fits, readouts, the controls' searches, the random twin's construction) by ``fits`` as they are."""
    init = fits["random_init"]["a"] * shape.params + fits["random_init"]["b"] if work["readouts"] else 0.0
    if device == "cpu":
        here = scaled_fits(fits, cpu_scale)
        load = here["load"]["a"] * shape.params * 4 + here["load"]["b"]
        return predict(shape, work, cpu_model_cost(here), here, load, init * cpu_scale, rank,
                       search_s=sum(MATCHED_SEARCH_S.values()) * cpu_scale, cores=len(os.sched_getaffinity(0)),
                       helpers_fit=helpers_fit)
    load = shape.params * H200["bytes_per_param"] / H200["disk_bytes_per_s"]
    return predict(shape, work, h200_model_cost, fits, load, init, rank, h200_matched_step)


def memory(shape: Shape, work: dict, bytes_per_param: float) -> dict:
    """Peak bytes: on the model's device the model and its random-init twin (superposition); on the host the
    twin's construction (``from_config`` builds it on the CPU in the config's dtype, then it moves) and one
    relation's Jacobians (float32, every LRE layer) with the float64 copies and SVDs of one fit."""
    weights = shape.params * bytes_per_param
    d = shape.d
    jac_prompts = max((len(p) for p in work["jacobian"]), default=0)
    jacobians = jac_prompts * len(work["lre_layers"]) * d * d * 4 + (3 + 2 * 4) * d * d * 8
    return {"weights": weights, "device": 2 * weights, "host_init": weights, "host_jacobians": jacobians}


# ------------------------------------------------------------------------------------------------- the plan
def matmul_rate(threads: int = 1, seconds: float = 1.0, clock=time.perf_counter) -> float:
    """FLOP/s of float32 matmuls shaped like the run's GEMMs (rows x 576 by 576 x 1536, rows 256, 1024, 4096),
    the best of the shapes, each timed for ``seconds / 3`` of ``clock`` on ``threads`` torch threads (restored
    after). ``clock``: wall seconds, or ``time.thread_time`` (one thread only: its CPU seconds, which other
    processes' share of the cores does not inflate, as the fits' CPU seconds)."""
    before, gen = torch.get_num_threads(), torch.Generator().manual_seed(0)   # (torch's own RNG left alone)
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for rows in (256, 1024, 4096):
            a, b = torch.randn(rows, 576, generator=gen), torch.randn(576, 1536, generator=gen)
            a @ b
            n, t = 0, clock()
            while clock() - t < seconds / 3:
                a @ b
                n += 1
            best = max(best, 2.0 * rows * 576 * 1536 * n / (clock() - t))
        return best
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def measured_rate() -> float:
    """This machine's one-thread matmul rate (per CPU second), measured once per process (about a second)."""
    return matmul_rate(1, 1.0, time.thread_time)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The embedded SmolLM2 tokenizer (the cost model's prompt lengths): its cached copy's files, else its GGUF
    file's metadata (no weights read). UsageError when the embedded model is not installed."""
    from transformers import AutoTokenizer  # lazy: start-up time: the CLI's checks and errors do not load it

    try:
        gguf = default_gguf()
    except ModelLoadError as error:
        raise UsageError(f"the plan counts prompts with the embedded SmolLM2 tokenizer: {error}") from None
    folder = embedded_folder(gguf)
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


_WORKLOADS: dict = {}   # the workloads counted in this process, by their settings and depth


def settings_workload(settings: Settings, n_layers: int) -> tuple[dict, AnalysisSettings, dict]:
    """(workload, analysis settings, what it assumed) of ``llmprobe run`` with ``settings`` on an ``n_layers``-deep
    model: its relations (first ``max_facts`` facts), layers, analyses, analysis settings and controls; known
    facts: SmolLM2's counts (scaled to ``max_facts``; other relations at SmolLM2's overall fraction)."""
    run = settings.run
    cfg = settings_from(seed=run.seed, **settings.analysis_options())
    analyses = settings.analyses("run")
    modes = tuple(settings.matched.modes) if settings.matched.enabled else ()
    key = json.dumps([run.relations, run.max_facts, run.layers, n_layers, asdict(cfg), analyses, modes,
                      settings.matched.at_model_width, settings.matched.n_seeds], default=str)
    if key not in _WORKLOADS:
        every = load_relations(None if run.relations is None else list(run.relations))
        relations = [r.with_facts(r.facts[:run.max_facts]) for r in every] if run.max_facts else every
        known = {}
        for full, rel in zip(every, relations):
            share = SMOLLM2_KNOWN[rel.name] / len(full.facts) if rel.name in SMOLLM2_KNOWN else SMOLLM2_KNOWN_FRACTION
            known[rel.name] = round(share * len(rel.facts))
        work = run_workload(smollm2_tokenizer(), n_layers, known, cfg, relations, run.layers, analyses, modes,
                            settings.matched.at_model_width)
        work["n_seeds"] = settings.matched.n_seeds
        assumed = {"relations": len(relations), "facts": sum(len(r.facts) for r in relations),
                   "known": sum(known.values()), "layers": work["layers"], "lre_layers": work["lre_layers"],
                   "analyses": analyses, "matched_modes": work["matched_modes"]}
        _WORKLOADS[key] = (work, cfg, assumed)
    return _WORKLOADS[key]


STAGES = {"load": "load", "known_facts": "known facts", "jacobians": "Jacobians", "decoders_other": "decoders, rest",
          "superposition": "superposition", "crosspatch": "crosspatch", "selector": "selector",
          "multihop": "multihop", "matched": "matched controls"}
DEVICES = ("cpu", "h200")       # this CPU, one H200


def plan_devices(run_device: str) -> tuple[str, ...]:
    """The plan's devices for a run's ``--device``: auto both, cpu this CPU, h200 or cuda[:N] one H200."""
    if run_device == "auto":
        return DEVICES
    if run_device == "cpu":
        return ("cpu",)
    if run_device == "h200" or run_device.startswith("cuda"):
        return ("h200",)
    raise UsageError(f"plan: --device {run_device!r}: choose auto (this CPU and one H200), cpu, h200 or cuda")


def _bytes_per_param(settings: Settings, device: str) -> float:
    run = settings.run
    if device == "h200" and run.quantize:
        return {"4bit": 0.5, "8bit": 1.0}[run.quantize]
    dtype = run.dtype if run.dtype != "auto" else ("bfloat16" if device == "h200" else "float32")
    return 4.0 if dtype == "float32" else 2.0


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(model=None, settings: Settings | None = None, *, device: str = "cpu", rate: float | None = None,
         trust_remote_code: bool = False) -> dict:
    """The plan of ``llmprobe run`` of ``model`` (a name, folder, .gguf file, preset, transformers config or
    Shape: :func:`model_shape`; None = ``settings.run.model``) with ``settings`` on ``device``: "cpu" (this CPU)
    or "h200" (one H200). No weights are read.

    This CPU: every CPU fit (seconds = a * work + b * passes; load aside) times REFERENCE_RATE / ``rate``, where
    ``rate`` is one thread's float32 matmul FLOP/s per CPU second here (default :func:`measured_rate`: ~1 s, once
    per process) and REFERENCE_RATE the same on the machine the fits were made on: a core twice as fast halves
    the prediction. Both are one thread's: cores beyond one are not credited (SmolLM2's run on 2 idle cores took
    as long as the one-thread fit predicts; its passes are small). One H200: the roofline of ``H200``, its
    host-side work (fits, readouts, the controls' searches) at the fits' own speed.

    Returns {"model", "source", "shape", "device", "rate", "jacobian_rank", "assumed", "stages": {stage:
    {"seconds", "peak_bytes"}}, "total": {"seconds", "peak_bytes", "host_peak_bytes", "memory_bytes", "fits"}}:
    peak_bytes on the device (this CPU: process RSS; H200: GPU memory), total seconds the wall time (load + known
    facts + max(analyses over their processes, the longer control mode, all of that work over the cores): one
    controls worker per mode beside the analyses; ``total["matched_seconds"]`` both modes' seconds,
    ``total["analyses_processes"]`` the analyses' processes), its peak the most at any time (each analysis helper
    holds its own copy of the model)."""
    settings = settings or Settings()
    if device not in DEVICES:
        raise UsageError(f"plan: unknown device {device!r}; choose cpu (this CPU) or h200 (one H200)")
    model = settings.run.model if model is None else model
    shape, source = model_shape(model, trust_remote_code)
    work, cfg, assumed = settings_workload(settings, shape.layers)
    rank = auto_rank(shape, work["lre_layers"], cfg) if work["jacobian"] else None
    rate = (rate or measured_rate()) if device == "cpu" else None
    mem = memory(shape, work, _bytes_per_param(settings, device))
    helpers_fit = PROCESS_BYTES + mem["weights"] <= _ram_bytes() / 2     # ProbeJob.helpers: with the free memory
    seconds = predict_on(shape, work, CPU_FITS, device, rank, REFERENCE_RATE / rate if rate else 1.0, helpers_fit)
    weights, jacobians = mem["weights"], mem["host_jacobians"] if work["jacobian"] else 0
    twin = weights if work["readouts"] else 0                    # the random-init twin of the superposition
    control = 16 * matched_params(shape.d, CPU_FITS) if work["matched_modes"] else 0   # weights, grads, Adam
    on_host = device == "cpu"
    base = PROCESS_BYTES if on_host else 0          # the device's memory: this process's RSS, or the GPU's
    decoders = base + weights + (jacobians if on_host else 0)    # one relation's Jacobians and fits: on the host
    workers = len(work["matched_modes"])                          # one controls process per mode
    peaks = {"load": base + weights, "known_facts": base + weights, "jacobians": decoders, "decoders_other": decoders,
             "superposition": base + weights + twin, "matched": workers * (base + control) if control else 0}
    for name, mechanism in work.get("mechanisms", {}).items():              # selector, multihop: a random twin
        peaks[name] = base + weights * (1 + min(mechanism["twins"], 1)) if seconds[name] else 0
    for name in MECHANISM_WORKLOADS:
        peaks.setdefault(name, 0)
    helpers = seconds["analyses_processes"] - 1                   # analysis helpers, each with its copy
    analysis_peak = max(decoders, *(peaks[s] for s in ("superposition", *MECHANISM_WORKLOADS)))
    peak = max(peaks["known_facts"], analysis_peak * (1 + helpers) + peaks["matched"])
    host = peak if on_host else PROCESS_BYTES + max(mem["host_init"] if twin else 0, jacobians)
    limit = _ram_bytes() if on_host else H200["hbm_bytes"]
    label = DEFAULT_MODEL if model is None else str(model) if isinstance(model, (str, os.PathLike)) else shape.name
    return {"model": label, "source": source, "shape": {**asdict(shape), "params": shape.params}, "device": device,
            "rate": rate, "jacobian_rank": rank, "assumed": assumed,
            "stages": {stage: {"seconds": seconds[stage], "peak_bytes": peaks[stage]} for stage in STAGES},
            "total": {"seconds": seconds["wall"], "matched_seconds": seconds["matched_total"],
                      "analyses_processes": seconds["analyses_processes"], "peak_bytes": peak,
                      "host_peak_bytes": host,
                      "memory_bytes": limit, "fits": peak <= limit}}



def part_seconds(lm, relations: list, known: dict, layers: list[int], cfg: AnalysisSettings,
                 analyses=ANALYSES) -> dict[tuple[str, str | None], float]:
    """The plan's seconds of each part of ``run_analyses`` (``llmprobe.analyses.run.parts_of``) on the loaded
    model ``lm`` (its config and tokenizer; on a GPU the H200 roofline), counted on the facts it knows
    (``known``: relation name -> its known-facts results): ("decoders", relation name): Jacobians, LRE and ridge
    fits, causality edits (0 s for a relation skipped for too few facts); ("superposition", None) and each
    mechanism analysis. What the analyses' progress bar estimates the time left from."""
    shape = shape_from_config(lm.model.config, lm.info.get("name") or "model")
    device = "cpu" if lm.device.type == "cpu" else "h200"
    scale = REFERENCE_RATE / measured_rate() if device == "cpu" else 1.0
    counts = {name: sum(r.known for r in results) for name, results in known.items()}
    out = {}
    decoders = tuple(a for a in analyses if a in ("lre", "ridge"))
    for relation in relations if decoders else []:
        work = run_workload(lm.tokenizer, shape.layers, {relation.name: counts.get(relation.name, 0)}, cfg,
                            [relation], layers, decoders, matched_modes=())
        rank = auto_rank(shape, work["lre_layers"], cfg) if work["jacobian"] else None
        seconds = predict_on(shape, work, CPU_FITS, device, rank, scale)
        out[("decoders", relation.name)] = (seconds["jacobians"] + seconds["decoders_other"] if work["forward"]
                                            else 0.0)
    rest = tuple(a for a in analyses if a == "superposition" or a in MECHANISM_WORKLOADS)
    if rest:
        work = run_workload(lm.tokenizer, shape.layers, counts, cfg, relations, layers, rest, matched_modes=(),
                            known_results=known)
        seconds = predict_on(shape, work, CPU_FITS, device, None, scale)
        out.update({(name, None): seconds[name] for name in rest})
    return out


def matched_width_steps(mode: str, d: int, d_model: int, n_seeds: int = 3) -> float:
    """The plan's training steps (all seeds) of width ``d`` of ``mode``'s curve: :func:`matched_curve`'s at one
    of its widths (the curve up to max(d_model, d) from the measured d*), else interpolated linearly in log d
    between the two planned widths around it (beyond them: the nearest one's)."""
    curve = matched_curve(mode, max(d_model, d), True, n_seeds)
    if d <= curve[0][0]:
        return float(curve[0][1])
    for (d0, s0), (d1, s1) in zip(curve, curve[1:]):
        if d0 <= d <= d1:
            return s0 + (s1 - s0) * (math.log(d) - math.log(d0)) / (math.log(d1) - math.log(d0))
    return float(curve[-1][1])


def matched_width_seconds(d: int, *, mode: str, d_model: int, n_facts: int, n_subjects: int, n_seeds: int = 3,
                          device: str = "cpu", cpu_scale: float = 1.0, max_steps: int | None = None) -> float:
    """The plan's seconds of one point of ``mode``'s curve at width ``d`` on a table of ``n_facts`` facts over
    ``n_subjects`` subjects: :func:`matched_width_steps` steps (at most ``max_steps`` per seed, the run's step
    cap, when given) at :func:`matched_step_flops` each (this CPU:
    the matched_step fit times ``cpu_scale``; "h200": :func:`h200_matched_step`), and its measurement (the
    matched_measure fit), as :func:`predict` prices each point. Module-level, so a ``functools.partial`` of it
    reaches the controls' spawned worker."""
    fits = scaled_fits(CPU_FITS, cpu_scale) if device == "cpu" else CPU_FITS
    steps = matched_width_steps(mode, d, d_model, n_seeds)
    steps = steps if max_steps is None else min(steps, max_steps * n_seeds)
    flops = matched_step_flops(d, n_facts, fits)
    step = fits["matched_step"]["a"] * flops + fits["matched_step"]["b"] if device == "cpu" else h200_matched_step(flops)
    return steps * step + fits["matched_measure"]["a"] * float(n_subjects) ** 2 * d + fits["matched_measure"]["b"]


def matched_planned(mode: str, d_model: int, n_facts: int, n_subjects: int, at_model_width: bool = True,
                    n_seeds: int = 3, device: str = "cpu", cpu_scale: float = 1.0,
                    max_steps: int | None = None) -> dict | None:
    """The plan of one mode's matched controls, as ``synthetic.matched.train_matched(planned={mode: ...})``
    takes it for its progress lines' time left: {"search": the threshold search's seconds, "curve": the seconds
    of the curve's widths as planned (from the measured d*), "width": :func:`matched_width_seconds` of this
    table and device as a function of d (the actual widths are known only after the search)}. None for a mode
    the plan has no measurements of. ``device``: "cpu" (fits times ``cpu_scale``: REFERENCE_RATE /
    :func:`measured_rate`) or "h200" (one H200, its host work at the fits' speed), as :func:`predict_on`;
    ``max_steps``: the run's step cap per training (None: the plan's steps as they are)."""
    if mode not in MATCHED_D_STAR:
        return None
    width = functools.partial(matched_width_seconds, mode=mode, d_model=d_model, n_facts=n_facts,
                              n_subjects=n_subjects, n_seeds=n_seeds, device=device, cpu_scale=cpu_scale,
                              max_steps=max_steps)
    return {"search": MATCHED_SEARCH_S[mode] * (cpu_scale if device == "cpu" else 1.0),
            "curve": sum(width(d) for d, _ in matched_curve(mode, d_model, at_model_width, n_seeds)),
            "width": width}


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def duration(seconds: float) -> str:
    """Seconds as 12 s, 3.4 min, 5.6 h or 7.8 d."""
    for limit, unit, scale in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / scale:.0f} {unit}" if unit == "s" else f"{seconds / scale:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"


def format_plan(plans: dict | list[dict]) -> str:
    """A short table of one model's plans (one column pair per device: time, peak GiB), what it assumed, and
    how each column was predicted."""
    plans = [plans] if isinstance(plans, dict) else list(plans)
    first = plans[0]
    s, a = first["shape"], first["assumed"]
    rank = "exact" if first["jacobian_rank"] is None else f"rank {first['jacobian_rank']}"
    head = {"cpu": "this CPU", "h200": "one H200"}
    lines = [f"plan of llmprobe run: {first['model']} ({first['source']}; no weights read)",
             f"  {s['params'] / 1e9:.2f}B params, d_model {s['d']}, {s['layers']} layers, vocab {s['vocab']}; "
             f"{len(a['layers'])} layers probed, LRE layers {','.join(map(str, a['lre_layers'])) or 'none'}, "
             f"Jacobians {rank}",
             f"  {a['relations']} relations, {a['facts']} facts, {a['known']} known (SmolLM2-135M's measured counts: "
             f"a larger model knows more, costing more)",
             f"{'stage':<18}" + "".join(f"{head[p['device']]:>22}" for p in plans)]
    rows = [(label, [p["stages"][stage] for p in plans]) for stage, label in STAGES.items()]
    rows.append(("run (wall)", [p["total"] for p in plans]))
    for label, cells in rows:
        lines.append(f"{label:<18}" + "".join(f"{duration(c['seconds']):>11}{gib(c['peak_bytes']):>7} GiB"
                                              for c in cells))
    lines.append(f"{'fits in memory':<18}" + "".join(
        f"{('yes' if p['total']['fits'] else 'NO') + ' (' + gib(p['total']['memory_bytes']) + ' GiB)':>22}"
        for p in plans))
    for p in plans:
        if p["device"] == "cpu":
            lines.append(f"  this CPU: docs/scaling.md's fits x {REFERENCE_RATE / p['rate']:.2f} (one-thread matmul "
                         f"{p['rate'] / 1e9:.0f} GFLOP/s here, {REFERENCE_RATE / 1e9:.0f} at the fit)")
        else:
            lines.append(f"  one H200: roofline ({H200['peak_flops'] / 1e12:.0f} TFLOP/s bf16 x "
                         f"{H200['efficiency']:.0%}, {H200['hbm_bytes_per_s'] / 1e12:.1f} TB/s), host work at the "
                         f"fit's speed; host peak "
                         f"{gib(p['total']['host_peak_bytes'])} GiB")
    cpu = [p["total"]["analyses_processes"] for p in plans if p["device"] == "cpu"]
    lines.append("  wall = load + known facts and analyses each over their processes"
                 + (f" (this CPU: {cpu[0]})" if cpu else "") + ": known facts + max(analyses, the longer control mode "
                 "(one worker each), all of it over the cores)")
    return "\n".join(lines)
