"""What ``llmprobe run`` does, counted (layer 5): the shapes its FLOPs depend on, its workload in
model-independent units and that workload in FLOPs; ``llmprobe.jobs.plan`` prices it.

* :class:`Shape`: what the FLOPs and the memory depend on, read from a config (:func:`model_shape`: a local
  folder, a .gguf file, the embedded default, a preset of a published config, a hub name when online);
* :func:`run_workload`: what ``llmprobe run`` does with its settings in model-independent units (batches of
  rows x tokens, Jacobian prompts, fit counts), counted with the project's own code (splits, layer choice, the
  superposition table, the mechanism analyses' item builders) on the SmolLM2 tokenizer's prompt lengths;
* :func:`known_work`, :func:`forward_work`, :func:`jacobian_work`, :func:`mechanism_work`: that workload in
  FLOPs and passes of a shape.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from llmprobe.analyses.decoders import AUTO_JACOBIAN_RANK
from llmprobe.analyses.passes import assumed_known, generation_batches
from llmprobe.analyses.registry import selected
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, planned_lre_layers
from llmprobe.analyses.superposition import superposition_table
from llmprobe.checks import UsageError, parse_layers, special_file
from llmprobe.datasets import load_relations
from llmprobe.jobs.cost_model import constant
from llmprobe.model.families import PLAIN_MLP
from llmprobe.model.known import object_token_sequences
from llmprobe.model.loading import (
    DEFAULT_INSTALL,
    DEFAULT_MODEL,
    ModelLoadError,
    check_hub_reachable,
    default_gguf,
    looks_like_path,
    read_model_config,
    trusted_embedded_folder,
)
from llmprobe.names import ANALYSES

# ------------------------------------------------------------------------------------------ shapes and FLOPs
VOCAB = 49152               # the SmolLM2 tokenizer's vocabulary (the benchmark models use it)


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


def shape_from_config(config, name: str, source: str = "") -> Shape:
    """The Shape of a transformers config (its text config for a multimodal one); UsageError naming ``source``
    (the config's file; else ``name``) and the field when a size is missing or not a whole number >= 1."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def size(field: str, value):
        if type(value) is not int or value < 1:
            raise UsageError(f"{source or name}: field {field!r} must be a whole number of at least 1, got "
                             f"{value!r}; the config is corrupt or not a decoder-only model's")
        return value

    d = size("hidden_size", getattr(text, "hidden_size", None))
    heads = size("num_attention_heads", getattr(text, "num_attention_heads", None))
    ff = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * d
    head_dim = getattr(text, "head_dim", None)
    return Shape(name, d, size("num_hidden_layers", getattr(text, "num_hidden_layers", None)),
                 size("intermediate_size", ff), heads,
                 size("num_key_value_heads", getattr(text, "num_key_value_heads", None) or heads),
                 size("vocab_size", getattr(text, "vocab_size", None)),
                 bool(getattr(config, "tie_word_embeddings", True)), size("head_dim", head_dim) if head_dim else None,
                 2 if getattr(text, "model_type", "") in PLAIN_MLP else 3)


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
        folder = trusted_embedded_folder(gguf)     # a copy whose record does not check is not the embedded model
        if folder is not None:
            return shape_from_config(_config_of(folder), DEFAULT_MODEL), "the embedded model's config.json"
        return shape_from_config(_config_of(gguf.parent, gguf_file=gguf.name), DEFAULT_MODEL), f"metadata of {gguf}"
    local = Path(os.path.expanduser(name))
    presets = ", ".join(sorted(PRESETS))
    if special_file(local) or special_file(local / "config.json"):
        path = local if special_file(local) else local / "config.json"
        raise UsageError(f"{path} is {special_file(path)}, not a model folder, config or .gguf file; refused "
                         f"(reading it could wait for ever)")
    if local.is_dir() and not (local / "config.json").is_file():
        raise UsageError(f"{name}: a folder without config.json; pass a model folder, a .gguf file, a hub name or "
                         f"a preset ({presets})")
    if local.is_dir() or (local.is_file() and name.lower().endswith(".gguf")):
        where, kwargs = (local, {}) if local.is_dir() else (local.parent, {"gguf_file": local.name})
        source = f"{local / 'config.json'}" if local.is_dir() else f"metadata of {local}"
    elif preset_key(name) in PRESETS:
        return PRESETS[preset_key(name)], f"preset {PRESETS[preset_key(name)].name}: its published config"
    elif local.exists() or looks_like_path(name):
        raise UsageError(f"{name}: no model folder or .gguf file there, and not a preset ({presets})")
    else:
        where, kwargs, source = name, {}, f"the hub's config.json of {name}"
    if local.is_dir():
        try:
            read_model_config(local)       # its shape fields and layer_types checked, naming the file and field
        except ModelLoadError as error:
            raise UsageError(str(error)) from None
    try:
        if where == name:
            check_hub_reachable(name, None)
        config = _config_of(where, trust_remote_code, **kwargs)
    except Exception as error:  # noqa: BLE001 - transformers' config classes raise many types (its validators')
        first = (str(error).splitlines() or [""])[0]
        raise UsageError(f"{name}: no config to plan from ({type(error).__name__}: {first}); presets that work "
                         f"offline: {presets}") from None
    try:
        return shape_from_config(config, name, source), source
    except UsageError:
        raise
    except (ValueError, KeyError, AttributeError, TypeError) as error:
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
def known_batches(tok, prompts: list[str], objects: list[str], batch_size: int = 32) -> list[tuple[int, int, int]]:
    """:func:`generation_batches` of ``known_facts`` (its budgets: the object's tokens + 1, at most 16)."""
    budgets = [min(len(s) + 1, 16) for s in object_token_sequences(tok, prompts, objects)]
    return generation_batches(tok, prompts, budgets, batch_size)


# Known facts of SmolLM2-135M-Instruct per relation (measured; values and provenance in cost_model.toml). The
# decoders use the first min(known, 90) of them; relations with fewer than 8 are skipped. Larger models know more
# facts: the prediction states this assumption and also gives the upper bound with every fact known.
SMOLLM2_KNOWN = constant("SMOLLM2_KNOWN")
SMOLLM2_KNOWN_FRACTION = constant("SMOLLM2_KNOWN_FRACTION")   # of every bundled fact: for a relation not measured
# the matched controls on the default table (the same for any model), measured in SmolLM2 runs: each mode's d*,
# mean steps per seed at d >= 48, steps per seed of the narrower points (width -> steps), each mode's d* bisection
MATCHED_D_STAR = constant("MATCHED_D_STAR")
CONTROL_STEPS = constant("CONTROL_STEPS")
CONTROL_POINT_STEPS = {mode: {int(d): steps for d, steps in points.items()}
                       for mode, points in constant("CONTROL_POINT_STEPS").items()}
MATCHED_SEARCH_S = constant("MATCHED_SEARCH_S")
PREDICT_RANK = AUTO_JACOBIAN_RANK   # the low rank ``--jacobian-rank auto`` takes (128)


def run_workload(tok, n_layers: int, known_counts: dict | None, cfg: AnalysisSettings | None = None,
                 relations: list | None = None, layers: str = "every:3", analyses=ANALYSES,
                 matched_modes=tuple(MATCHED_D_STAR), at_model_width: bool = True, known_results: dict | None = None
                 ) -> dict:
    """What ``llmprobe run`` does with these settings (default: its defaults), in model-independent units:
    batches of (rows, tokens), Jacobian prompts, CPU fit counts. ``relations`` None = every bundled relation;
    ``known_counts`` None = every fact known. The known facts' generation, then each analysis that ``analyses``
    selects (``llmprobe.analyses.registry``) counted by its own record's ``workload`` on ``known_results``
    (relation name -> its known-facts results) when given, else on each relation's first ``known_counts`` facts:
    the decoders' and the superposition's work under their stages' keys ("forward", "edits", "jacobian",
    "states", fit counts), every other analysis' passes under "mechanisms"; the matched controls' table (its
    subjects and facts); ``matched_modes`` () = no matched controls."""
    cfg = cfg or AnalysisSettings()
    relations = load_relations(None) if relations is None else relations
    layers = parse_layers(layers, n_layers)
    w: dict = {"layers": layers, "lre_layers": planned_lre_layers(cfg, layers, n_layers), "known": [], "forward": [],
               "edits": [], "jacobian": [], "lre_fits": 0, "ridge_fits": 0, "head_rows": 0, "states": [],
               "readouts": 0, "readout_subjects": 0, "mechanisms": {}, "matched_modes": tuple(matched_modes),
               "at_model_width": at_model_width}
    for rel in relations:
        prompts = [rel.templates[0].replace("{}", f.subject, 1) for f in rel.facts]
        w["known"] += known_batches(tok, prompts, [f.object for f in rel.facts])
    assumed = known_results if known_results is not None else assumed_known(relations, known_counts)
    for analysis in selected(analyses):
        work = analysis.workload(tok, relations, assumed, layers, n_layers, cfg, tuple(analyses))
        if analysis.priced == "passes":
            w["mechanisms"][analysis.name] = work
            continue
        for key, value in work.items():                 # the decoders' and the superposition's stage keys
            w[key] += value
    try:
        table = superposition_table(tok, relations, {}, cfg) if matched_modes else None
    except AnalysisError:                                # too few shared subjects: no controls
        table, w["matched_modes"] = None, ()
    w["n_subjects"] = len(table.subjects) if table is not None else 0
    w["n_facts_table"] = int((table.A >= 0).sum()) if table is not None else 0
    return w


def mechanism_work(shape: Shape, work: dict) -> Work:
    """One mechanism analysis' workload in FLOPs and passes of ``shape``: its forward passes, edits and
    generation."""
    return sum_work([sum_work(forward_work(shape, b, blocks, head) for b, blocks, head in work["forward"]),
                     edit_work(shape, work["edits"]), known_work(shape, work["generate"])])
