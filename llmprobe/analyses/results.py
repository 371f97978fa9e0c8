"""Typed results: each entry of report.json's ``analyses`` block (``docs/report_schema.md``) as a dataclass, the way
the report layer reads it. ``AnalysesResult.from_dict(report["analyses"])`` reads the whole block. The report's
other blocks the report layer reads are typed the same way: ``model`` (:class:`ModelInfo`), ``dataset``,
``relations.<relation>`` (the known facts), ``settings``, ``matched`` (:class:`MatchedBlock`) and a matched control
as a source of the page (:class:`MatchedSource`: its model, fact table, threshold width, training).

Every type reads with ``from_dict(d)`` and writes with ``to_dict()``:

* ``from_dict`` is tolerant of what older, partial and failed reports lack: a missing key (or a null where an
  object is expected) reads as None, an empty container or an empty entry (whose every attribute is again None or
  empty), as the readers' ``(d.get(k) or {}).get(...)`` treated it. An empty entry is falsy, like an empty dict.
* ``to_dict`` gives back the JSON the analyses wrote: ``from_dict(d).to_dict() == d``, keys in their order, the
  keys a type does not cover kept in its ``extra`` (an analysis may add keys; nothing is lost), a missing key still
  missing and a null still null.

Metrics stay in their JSON form (``llmprobe.metric.Metric.to_dict``; ``Metric.from_dict`` reads one): the report
reads their extra keys (``margins``, ``gain``, ``chance``) and writes their numbers as they are. A field typed
``Any`` holds a metric on the pretrained model and a plain number in a matched control's selector.

Torch-free: layer 3 by place, it imports nothing of llmprobe (the report layer reads it without loading torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

__all__ = ["AnalysesResult", "ControlOverSeeds", "CrosspatchLayer", "CrosspatchResult", "DatasetInfo", "DecoderLayer", "FactTable",
           "GateTransplant", "GatingResult", "LayerDecoders", "MatchedBlock", "MatchedSource", "MatchedTraining",
           "MetricJSON", "ModelInfo", "MultihopPooled", "MultihopResult", "RelationDecoders", "RelationFacts",
           "RelationGating", "ReportSettings", "Result", "Selection", "SelectorResult", "SuperpositionLayer",
           "SuperpositionResult", "Swap", "SwapScale", "Threshold", "Training", "TransplantPart",
           "metric_nulls", "metric_value", "null_value"]

MetricJSON = dict          # a typed metric in its JSON form: {value, ci, n, interval, spread, primary_null, nulls...}
_NOT_READ = object()       # an entry built in code, not read from a non-object
_COVERED: dict[type, tuple[str, ...]] = {}


class _One:
    """A nested entry of type ``cls``."""

    def __init__(self, cls):
        self.cls = cls

    def fits(self, value) -> bool:
        return True                                        # a non-object reads as an empty entry (``_as_read``)

    def read(self, value):
        return self.cls.from_dict(value)

    def write(self, value):
        return value.to_dict()

    def empty(self):
        return self.cls()


class _Map(_One):
    """{key: entry} (relations, layers, ...), in the order read."""

    def fits(self, value) -> bool:
        return isinstance(value, dict)

    def read(self, value):
        return {key: self.cls.from_dict(item) for key, item in value.items()}

    def write(self, value):
        return {key: item.to_dict() for key, item in value.items()}

    def empty(self):
        return {}


class _List(_One):
    """[entry, ...]."""

    def fits(self, value) -> bool:
        return isinstance(value, list)

    def read(self, value):
        return [self.cls.from_dict(item) for item in value]

    def write(self, value):
        return [item.to_dict() for item in value]

    def empty(self):
        return []


class _Plain(_One):
    """A container of plain JSON (``list`` or ``dict``, e.g. a readout's metrics by relation), kept as read; a
    null reads as an empty one."""

    def fits(self, value) -> bool:
        return isinstance(value, self.cls)

    def read(self, value):
        return value

    def write(self, value):
        return value

    def empty(self):
        return self.cls()


@dataclass(kw_only=True)
class Result:
    """Base of the typed entries: the covered keys are the dataclass fields (``NESTED``: those holding entries),
    ``extra`` the others as read."""

    NESTED: ClassVar[dict[str, _One]] = {}
    extra: dict = field(default_factory=dict)               # keys this type does not cover, as read
    _order: tuple = field(default=(), repr=False, compare=False)     # every key read, in its order
    _raw: dict = field(default_factory=dict, repr=False, compare=False)   # covered keys read in another shape
    _as_read: Any = field(default=_NOT_READ, repr=False, compare=False)  # the non-object this entry was read from

    @classmethod
    def covered(cls) -> tuple[str, ...]:
        """The keys this type covers: its fields."""
        if cls not in _COVERED:
            _COVERED[cls] = tuple(f.name for f in fields(cls) if f.name != "extra" and not f.name.startswith("_"))
        return _COVERED[cls]

    @classmethod
    def from_dict(cls, d) -> "Result":
        """The entry ``d`` (a JSON object); None or another non-object reads as an empty entry."""
        if not isinstance(d, dict):
            return cls(_as_read=d)
        covered = set(cls.covered())
        values, raw = {}, {}
        for key, value in d.items():
            if key not in covered:
                continue
            spec = cls.NESTED.get(key)
            if spec is None:
                values[key] = value
            elif spec.fits(value):
                values[key] = spec.read(value)
            else:
                values[key], raw[key] = spec.empty(), value
        return cls(**values, extra={k: v for k, v in d.items() if k not in covered}, _order=tuple(d), _raw=raw)

    def to_dict(self):
        """The JSON form (see the module's doc): the keys read in their order, then the fields set in code; the
        non-object an entry was read from, as it was."""
        if self._as_read is not _NOT_READ:
            return self._as_read
        covered = self.covered()
        out = {}
        for key in self._order:
            if key in self._raw:
                out[key] = self._raw[key]
            elif key in covered:
                out[key] = self._write(key)
            elif key in self.extra:
                out[key] = self.extra[key]
        defaults = type(self)() if any(key not in out for key in covered) else None
        for key in covered:
            if key not in out and getattr(self, key) != getattr(defaults, key):
                out[key] = self._write(key)
        return out | {key: value for key, value in self.extra.items() if key not in out}

    def _write(self, key: str):
        spec = self.NESTED.get(key)
        return getattr(self, key) if spec is None else spec.write(getattr(self, key))

    def __bool__(self) -> bool:
        """False for an empty entry (read from nothing, a null or {}), as for an empty dict."""
        if self._as_read is not _NOT_READ:
            return False
        if self._order or self.extra:
            return True
        defaults = type(self)()
        return any(getattr(self, key) != getattr(defaults, key) for key in self.covered())


# ------------------------------------------------------------------------------------- decoders of a relation
@dataclass(kw_only=True)
class DecoderLayer(Result):
    """One decoder at one layer (``relations.<relation>.layers.<layer>.<decoder>``): test faithfulness and
    causality (metrics) and what each re-fit chose."""

    faithfulness: MetricJSON | None = None
    causality: MetricJSON | None = None
    chosen: list | None = None


@dataclass(kw_only=True)
class LayerDecoders(Result):
    """A relation's decoders at one layer (``relations.<relation>.layers.<layer>``)."""

    NESTED: ClassVar = {"lre": _One(DecoderLayer), "ridge": _One(DecoderLayer)}
    lre: DecoderLayer = field(default_factory=DecoderLayer)
    ridge: DecoderLayer = field(default_factory=DecoderLayer)

    def decoder(self, name: str) -> DecoderLayer:
        """The decoder ``name`` (``lre``, ``ridge``, or another one as read) at this layer; empty where it has
        none."""
        return getattr(self, name) if name in self.NESTED else DecoderLayer.from_dict(self.extra.get(name))


@dataclass(kw_only=True)
class Selection(Result):
    """A decoder's layers chosen on validation (``relations.<relation>.selected.<decoder>``)."""

    layer: int | None = None
    by: str | None = None
    causality_layer: int | None = None


@dataclass(kw_only=True)
class RelationDecoders(Result):
    """The decoders entry of one relation (``relations.<relation>``): its layers, the layers selected on
    validation, its re-fits and test subjects; only ``error`` when it could not be analysed."""

    NESTED: ClassVar = {"layers": _Map(LayerDecoders), "selected": _Map(Selection)}
    error: str | None = None
    template: str | None = None
    protocol: str | None = None
    n_known: int | None = None
    n_checked: int | None = None
    n_used: int | None = None
    model_accuracy: float | None = None
    first_token_collisions: int | None = None
    test_subjects: list | None = None
    context_subjects: list | None = None
    n_icl: int | None = None
    n_known_zero_shot: int | None = None
    known_only_few_shot: bool | None = None
    n_test_pairs: int | None = None
    refits: list | None = None
    candidates: dict | None = None
    jacobian_seconds: float | None = None
    jacobian_rank: int | None = None
    seconds: float | None = None
    layers: dict[str, LayerDecoders] = field(default_factory=dict)
    selected: dict[str, Selection] = field(default_factory=dict)

    def at(self, layer) -> LayerDecoders:
        """The decoders at ``layer`` (an int or its string key); empty where it was not measured."""
        return self.layers.get(str(layer)) or LayerDecoders()

    def selection(self, decoder: str) -> Selection:
        """``selected.<decoder>``; empty where the decoder chose nothing."""
        return self.selected.get(decoder) or Selection()


# ------------------------------------------------------------------------------------------ superposition
@dataclass(kw_only=True)
class SwapScale(Result):
    """The swap edit at one scale (``swap.by_scale[]``)."""

    scale: float | None = None
    success: MetricJSON | None = None
    others_unchanged: MetricJSON | None = None


@dataclass(kw_only=True)
class Swap(Result):
    """The swap edit at one layer (``superposition.layers.<layer>.swap``): the fitted scale first."""

    NESTED: ClassVar = {"by_scale": _List(SwapScale)}
    error: str | None = None
    n_edits: int | None = None
    n_subjects: int | None = None
    edit_norm_ratio: float | None = None
    by_scale: list[SwapScale] = field(default_factory=list)


@dataclass(kw_only=True)
class SuperpositionLayer(Result):
    """The superposition readouts at one layer (``superposition.layers.<layer>``; a matched control's e_s at
    ``"0"``): R^2, a readout per relation (metrics), the swap edit where it ran."""

    NESTED: ClassVar = {"swap": _One(Swap), "readout": _Plain(dict), "contributions": _Plain(dict)}
    r2: MetricJSON | None = None
    readout: dict[str, MetricJSON] = field(default_factory=dict)
    alpha_per_fold: list | None = None
    swap: Swap = field(default_factory=Swap)
    r2_non_lexical: MetricJSON | None = None         # the R^2 over the relations not flagged lexical
    contributions: dict = field(default_factory=dict)  # relation -> {gain_without, contribution}


@dataclass(kw_only=True)
class SuperpositionResult(Result):
    """The superposition analysis (``analyses.superposition``)."""

    NESTED: ClassVar = {"layers": _Map(SuperpositionLayer)}
    error: str | None = None
    relations: list | None = None
    subjects: int | None = None
    n_facts: int | None = None
    facts: str | None = None
    place: str | None = None
    neutral_templates: list | None = None
    neutral_templates_dropped: list | None = None
    attribute_vectors: str | None = None
    n_attributes: dict | None = None
    first_token_collisions: dict | None = None
    merged_attributes: dict | None = None
    lexical_overlap: dict | None = None
    lexical_relations: list | None = None       # None: a report from before the lexical rule
    graded_layers: list | None = None           # the layers with r2_non_lexical and contributions
    seconds: float | None = None
    layers: dict[str, SuperpositionLayer] = field(default_factory=dict)

    def at(self, layer) -> SuperpositionLayer:
        """The readouts at ``layer`` (an int or its string key); empty where it was not measured."""
        return self.layers.get(str(layer)) or SuperpositionLayer()


# ------------------------------------------------------------------------------------------- crosspatch
@dataclass(kw_only=True)
class CrosspatchLayer(Result):
    """The crosspatch at one layer (``crosspatch.layers.<layer>``): metrics pooled over relation pairs, then per
    pair (``pairs``, as read); ``n_items``: the items patched there (None: older reports, the same at every layer)."""

    n_items: int | None = None
    neutral: MetricJSON | None = None
    cross_relation: MetricJSON | None = None
    same_relation: MetricJSON | None = None
    random_subject: MetricJSON | None = None
    random_subject_follows: MetricJSON | None = None
    random_vector: MetricJSON | None = None
    neutral_minus_same: MetricJSON | None = None
    cross_relation_minus_same: MetricJSON | None = None
    pairs: list | None = None


@dataclass(kw_only=True)
class CrosspatchResult(Result):
    """The crosspatch analysis (``analyses.crosspatch``)."""

    NESTED: ClassVar = {"layers": _Map(CrosspatchLayer)}
    error: str | None = None
    relations: list | None = None
    neutral_template: str | None = None
    n_items: int | None = None
    recipients_clean: MetricJSON | None = None
    place: str | None = None
    seconds: float | None = None
    layers: dict[str, CrosspatchLayer] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- selector
@dataclass(kw_only=True)
class TransplantPart(Result):
    """The gate transplant's test facts of one relation (``gate_transplant.by_relation.<relation>``)."""

    error: str | None = None
    n_items: int | None = None
    clean: MetricJSON | None = None
    same_relation: MetricJSON | None = None
    other_relation: MetricJSON | None = None
    random_units: MetricJSON | None = None
    same_minus_other: MetricJSON | None = None
    random_minus_other: MetricJSON | None = None


@dataclass(kw_only=True)
class GateTransplant(Result):
    """Gate transplants (``selector.gate_transplant``): on the pretrained model metrics at the block chosen on
    validation facts, per relation in ``by_relation``; in a matched control's selector plain fractions
    (``own``, ``same_relation``, ``same_subject``)."""

    NESTED: ClassVar = {"by_relation": _Map(TransplantPart), "block": _Plain(list)}
    error: str | None = None
    block: list = field(default_factory=list)
    block_choice: dict | None = None
    n_items: int | None = None
    clean: MetricJSON | None = None
    own: float | None = None
    same_relation: Any = None
    same_subject: float | None = None
    other_relation: MetricJSON | None = None
    random_units: MetricJSON | None = None
    same_minus_other: MetricJSON | None = None
    random_minus_other: MetricJSON | None = None
    by_relation: dict[str, TransplantPart] = field(default_factory=dict)


@dataclass(kw_only=True)
class GatingResult(Result):
    """The pretrained model's gating index (``selector.gating``): ``layers.<layer>.relation_share`` and
    ``subject_share`` (metrics, as read)."""

    error: str | None = None
    relations: list | None = None
    n_subjects: int | None = None
    layers: dict | None = None


@dataclass(kw_only=True)
class RelationGating(Result):
    """A matched control's relation-gating index over its units (``selector.relation_gating``)."""

    mean: float | None = None
    median: float | None = None


@dataclass(kw_only=True)
class SelectorResult(Result):
    """The MLP-as-selector analysis (``analyses.selector``) of the pretrained model, and the same entry of a
    matched control (``matched.modes.<mode>.points[].selector``: units, ablations, relation gating, transplant)."""

    NESTED: ClassVar = {"gate_transplant": _One(GateTransplant), "gating": _One(GatingResult),
                        "relation_gating": _One(RelationGating)}
    error: str | None = None
    relations: list | None = None
    mlp: str | None = None
    gate: str | None = None
    matched_control: str | None = None
    seconds: float | None = None
    gating: GatingResult = field(default_factory=GatingResult)
    gate_transplant: GateTransplant = field(default_factory=GateTransplant)
    n_units: int | None = None
    n_alive: int | None = None
    units_per_relation: list | None = None
    relation_gating: RelationGating = field(default_factory=RelationGating)
    base_accuracy: list | None = None
    ablation_drop: list | None = None
    random_ablation_drop: list | None = None
    ablation: dict | None = None
    random_ablation: dict | None = None
    relation_patch: dict | None = None


# ----------------------------------------------------------------------------------------------- multihop
@dataclass(kw_only=True)
class MultihopPooled(Result):
    """The multi-hop accuracies over the chains of one composition (``multihop.compositions[]``: with ``name``,
    ``hops``, ``k``, ``question``) or of every composition of k hops (``multihop.pooled.k=<k>``)."""

    name: str | None = None
    hops: list | None = None
    k: int | None = None
    question: str | None = None
    n_items: int | None = None
    direct: MetricJSON | None = None
    cot: MetricJSON | None = None
    ceiling: MetricJSON | None = None
    cot_bridges: MetricJSON | None = None
    cot_minus_direct: MetricJSON | None = None
    ceiling_minus_cot: MetricJSON | None = None
    n_without_wrong_bridge: int | None = None     # the wrong-bridge control (absent from older reports)
    wrong_bridge: MetricJSON | None = None
    wrong_bridge_follows: MetricJSON | None = None
    cot_minus_wrong_bridge: MetricJSON | None = None


@dataclass(kw_only=True)
class MultihopResult(Result):
    """The multi-hop analysis (``analyses.multihop``)."""

    NESTED: ClassVar = {"compositions": _List(MultihopPooled), "pooled": _Map(MultihopPooled)}
    error: str | None = None
    few_shot: int | None = None
    scoring: str | None = None
    examples: str | None = None
    wrong_bridges: str | None = None
    note: str | None = None
    compositions: list[MultihopPooled] = field(default_factory=list)
    pooled: dict[str, MultihopPooled] = field(default_factory=dict)
    skipped: dict | None = None
    latent_bridge: dict | None = None
    seconds: float | None = None


# -------------------------------------------------------------------------------------------- the block
@dataclass(kw_only=True)
class AnalysesResult(Result):
    """report.json's ``analyses`` block (a matched control's in the per-source layout too): the settings, the
    decoders per relation, each analysis' entry; an analysis registered beside these is in ``extra``."""

    NESTED: ClassVar = {"relations": _Map(RelationDecoders), "superposition": _One(SuperpositionResult),
                        "crosspatch": _One(CrosspatchResult), "selector": _One(SelectorResult),
                        "multihop": _One(MultihopResult)}
    settings: dict | None = None
    partial: bool | None = None
    relations: dict[str, RelationDecoders] = field(default_factory=dict)
    errors: list | None = None
    timing: dict | None = None
    superposition: SuperpositionResult = field(default_factory=SuperpositionResult)
    crosspatch: CrosspatchResult = field(default_factory=CrosspatchResult)
    selector: SelectorResult = field(default_factory=SelectorResult)
    multihop: MultihopResult = field(default_factory=MultihopResult)


# ------------------------------------------------------------------------------------- metrics (JSON form)
def metric_value(m: MetricJSON | None):
    """A metric's value; None for no metric (None or {})."""
    return m.get("value") if m else None


def metric_nulls(m: MetricJSON | None) -> dict:
    """A metric's nulls by name, in its order; {} for none (or a null) or no metric."""
    return (m.get("nulls") if m else None) or {}


def null_value(m: MetricJSON | None, name: str):
    """The value of a metric's null ``name``; None where the metric, the null or its value is missing or null."""
    null = metric_nulls(m).get(name)
    return null.get("value") if null else None


# ------------------------------------------------------------------------------ the report's other blocks
@dataclass(kw_only=True)
class ModelInfo(Result):
    """report.json's ``model`` block (the other keys, as the loader wrote them, in ``extra``); a matched source's
    model in the per-source layout: its width, MLP width and whether its subject embeddings were frozen."""

    name: str | None = None
    architecture: str | None = None
    n_layers: int | None = None
    d_model: int | None = None
    d_mlp: int | None = None
    frozen_subjects: bool | None = None
    weights_hash: str | None = None


@dataclass(kw_only=True)
class DatasetInfo(Result):
    """report.json's ``dataset`` block: the relations asked for, the dataset's hash, the fact limits."""

    hash: str | None = None
    relations: list | None = None
    max_facts: int | None = None
    max_prompt_tokens: int | None = None
    chat_template: dict | None = None     # --chat-template: the instruction, the prefix and one wrapped template


@dataclass(kw_only=True)
class RelationFacts(Result):
    """The known facts of one relation (``relations.<relation>``)."""

    n_facts: int | None = None
    n_known: int | None = None
    known_rate: float | None = None
    templates: list | None = None
    template_used: str | None = None
    neutral_templates: list | None = None
    properties: dict | None = None
    source: str | None = None


@dataclass(kw_only=True)
class ReportSettings(Result):
    """report.json's ``settings`` block: the command, and its sections as read (``run``, ``analysis``,
    ``matched``: plain objects, a missing or null section reads as {})."""

    NESTED: ClassVar = {"run": _Plain(dict), "analysis": _Plain(dict), "matched": _Plain(dict)}
    command: str | None = None
    run: dict = field(default_factory=dict)
    analysis: dict = field(default_factory=dict)
    matched: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- matched synthetic controls
@dataclass(kw_only=True)
class FactTable(Result):
    """The fact table the matched controls were trained on (``matched.table``; a source's ``matched_to``)."""

    n_subjects: int | None = None
    relations: list | None = None
    n_facts: int | None = None
    bits: float | None = None
    bits_joint: float | None = None               # counted jointly (synthetic.tasks.FactTask.bits_joint); older: absent
    facts: str | None = None                      # "known" (the facts the model knows) or "all"; older: absent (all)


@dataclass(kw_only=True)
class Threshold(Result):
    """A matched mode's threshold width (``matched.modes.<mode>.threshold``; a source's ``threshold``): d*, whether
    it is exact (else an upper bound), the widths tried."""

    d_star: int | None = None
    exact: bool | None = None
    tried: list | None = None


@dataclass(kw_only=True)
class Training(Result):
    """A matched control's training (``matched.modes.<mode>.points[].train``); a source's ``train`` adds
    ``over_seeds``, its training over its seeds as ``llmprobe.report.schema.train_over_seeds`` computes it (``n``,
    ``n_fit``, ``accuracy_min``, ``accuracy_mean``, ``steps``: always all of them), or None without per-seed rows."""

    accuracy: float | None = None
    success: bool | None = None
    steps: int | None = None
    fit_step: int | None = None
    wall_time_s: float | None = None
    n_params: int | None = None
    n_trainable: int | None = None
    bits_per_param: float | None = None
    over_seeds: dict | None = None


@dataclass(kw_only=True)
class MatchedTraining(Result):
    """How every matched control was trained (``matched.training``): the step cap, the recipe, the steps past the
    first fit (the other settings in ``extra``)."""

    max_steps: int | None = None
    recipe: str | None = None
    past_fit: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    stopping_rule: str | None = None


@dataclass(kw_only=True)
class MatchedBlock(Result):
    """report.json's ``matched`` block (``run``): what the controls are compared with, where they are read, their
    fact table and training; ``modes`` (each mode's threshold and curve points) as read; ``all_facts`` the
    all-facts control shown apart (a block of the same form; None where not trained, and in older reports)."""

    NESTED: ClassVar = {"table": _One(FactTable), "training": _One(MatchedTraining)}
    compared_with: str | None = None
    place: str | None = None
    table: FactTable = field(default_factory=FactTable)
    d_model: int | None = None
    seed: int | None = None
    seeds: list | None = None
    training: MatchedTraining = field(default_factory=MatchedTraining)
    modes: dict | None = None
    all_facts: dict | None = None
    wall_seconds: float | None = None
    cpu_seconds: float | None = None

    def described(self) -> str:
        """The control in a few words: its table and recipe ("known facts, weight_decay recipe"; a report without
        the table's ``facts`` trained on every fact of the superposition table: "all facts")."""
        facts = self.table.facts or "all"
        recipe = f", {self.training.recipe} recipe" if self.training.recipe else ""
        seeds = f", {len(self.seeds)} seed{'s' if len(self.seeds) != 1 else ''}" if self.seeds else ""
        return f"{facts} facts{recipe}{seeds}"


@dataclass(kw_only=True)
class ControlOverSeeds(Result):
    """A matched control's end-of-training values over its seeds (a source's ``over_seeds``: ``r2`` the point's
    ``r2_final``, the rest its ``over_seeds``): ``r2``, ``readout`` {relation: metric}, ``readout_mean``,
    ``gate_transplant`` {"same_relation", "same_subject": metric}, each a metric over seeds (JSON form, Student-t
    interval) whose ``spread.values`` are the seeds' values. Absent (None, {}) in reports written before they were
    stored (the readouts and keep rates: seed 0's only, in the source's analyses)."""

    r2: MetricJSON | None = None
    readout: dict = field(default_factory=dict)
    readout_mean: MetricJSON | None = None
    gate_transplant: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class MatchedSource(Result):
    """A matched control as a source of the page (``llmprobe.report.schema.matched_sources``: one per trained point
    of the block, in the per-source layout; an older report's list entries as they are): its model, the fact table
    it was trained on, its mode's threshold width, its training, its analyses (superposition at ``"0"``, selector),
    its end values over seeds (``over_seeds``) and its per-seed rows as the block stores them (``seeds``: fit step,
    accuracy, end values per seed; None in reports without them). The keys the page adds (``_path``, ``_owner``, ``_label``) are in ``extra``."""

    NESTED: ClassVar = {"model": _One(ModelInfo), "matched_to": _One(FactTable), "threshold": _One(Threshold),
                        "train": _One(Training), "analyses": _One(AnalysesResult),
                        "over_seeds": _One(ControlOverSeeds)}
    schema_version: int | None = None
    kind: str | None = None
    label: str | None = None
    model: ModelInfo = field(default_factory=ModelInfo)
    matched_to: FactTable = field(default_factory=FactTable)
    threshold: Threshold = field(default_factory=Threshold)
    train: Training = field(default_factory=Training)
    analyses: AnalysesResult = field(default_factory=AnalysesResult)
    over_seeds: ControlOverSeeds = field(default_factory=ControlOverSeeds)
    seeds: list | None = None
    wall_seconds: float | None = None
