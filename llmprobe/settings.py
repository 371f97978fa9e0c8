"""One settings object for ``llmprobe probe``, ``run`` and ``rerun`` (layer 5; imports no torch).

:class:`Settings` holds three sections, each a dataclass whose fields (name, type, default, comment) are the
settings, written nowhere else:

* ``run``: what to load and probe (:class:`RunSettings`: model, relations, layers, device, seed, ...);
* ``analysis``: every field of :class:`llmprobe.analyses.AnalysisSettings` but ``seed`` (the one seed is
  ``run.seed``);
* ``matched``: the matched synthetic controls of ``llmprobe run`` (:class:`MatchedSettings`).

They are resolved in this order, each overriding the one before: the defaults, ``--config FILE.toml`` (tables
``[run]``, ``[analysis]``, ``[matched]``), ``--set SECTION.KEY=VALUE`` (repeatable; VALUE is a TOML value, or
the text written where the setting takes text: ``run.layers=0,6``), then the explicit command-line flags
(``--layers``, ``--protocol``, ...; :func:`resolve`). The Python API's keywords (``probe(layers=..., max_facts=...,
analysis_options={...})``) go through the same checks (:func:`from_options`). TOML has no null: the string
``"none"`` stands for None where a setting allows it. An unknown key, a value of the wrong type or out of range,
or a malformed file raises :class:`UsageError` naming the key (or the file's line); :func:`check` is the one
place of the checks. ``probe`` and ``run`` record the settings in report.json (:meth:`Settings.record`), from
which ``llmprobe rerun`` reproduces the report (:func:`from_record`). ``docs/config.md`` shows every key with its
default (:func:`settings_toml`).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import sys
import types
import typing
import warnings
from pathlib import Path

import tomllib

from llmprobe.analyses.settings import AnalysisSettings, settings_from
from llmprobe.checks import (
    DEVICE_MAPS,
    DTYPES,
    QUANTIZE,
    UsageError,
    analysis_names,
    check_not_special,
    layer_spec,
    parse_max_memory,
)
from llmprobe.names import ANALYSES, MATCHED_FACTS, MATCHED_MODES, MATCHED_RECIPES


@dataclasses.dataclass
class RunSettings:
    """What ``probe`` and ``run`` load and check."""

    model: str | None = None                # hub name, local folder or .gguf file; none = embedded SmolLM2-135M
    gguf_file: str | None = None            # GGUF file inside the model folder or hub repo
    relations: tuple[str, ...] | None = None    # bundled names, files, folders, hf:DATASET or lre:NAME; none = all
                                                # bundled
    hf_kwargs: dict = dataclasses.field(default_factory=dict)   # keywords of datasets.load_dataset for the hf:
                                            # relations, e.g. {data_files = "facts.csv"} (--hf-kwargs: JSON)
    layers: str = "every:3"                 # all | every:K | comma list like "0,6,12" | "-1"
    analyses: tuple[str, ...] | None = None     # of lre, ridge, superposition; none = the command's default
                                                # (probe: lre, ridge, superposition; run: all; [] = none)
    device: str = "auto"                    # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                     # auto | float32 | bfloat16 | float16
    device_map: str | None = None           # auto | balanced | balanced_low_0 | sequential: blocks spread over
                                            # GPUs, CPU and disk by accelerate (replaces device); docs/devices.md
    max_memory: tuple[str, ...] | None = None   # memory per device for device_map, e.g. ["0=70GiB", "cpu=8GiB"]
    offload_folder: str | None = None       # folder for the weights that fit in no device's max_memory
    quantize: str | None = None             # 4bit | 8bit: weights quantised by bitsandbytes (needs CUDA)
    batch_size: int = 32                    # prompts per forward pass of the known-fact check
    max_facts: int | None = None            # keep the first N facts of each relation; none = all
    max_prompt_tokens: int | None = None    # skip facts with longer prompts; none = the model's context
    seed: int = 0                           # Python's and torch's RNGs, the analyses and the controls
    chat_template: bool = False             # true: every prompt in the model's chat template, as the open assistant
                                            # turn after a user turn "Complete the sentence." (llmprobe.model.chat)
    assume_known: bool | tuple[str, ...] = False    # true, or a list of relation names: their facts are taken as
                                            # known whatever the known-fact check finds (curated facts, smoke
                                            # tests); the report says so


@dataclasses.dataclass
class MatchedSettings:
    """The matched synthetic controls of ``llmprobe run`` (the job passes each to
    ``synthetic.matched.train_matched``)."""

    enabled: bool = True                    # false: skip the controls (--no-matched)
    at_model_width: bool = True             # false: train only at d*, not also up to the model's d_model
    max_steps: int | None = None            # step cap of every control's training (the bisection's too); none =
                                            # the recipe's (adam 2000, weight_decay 1000)
    d_max: int | None = None                # widest width the bisection tries; none = the model's d_model
    n_boot: int = 500                       # bootstrap resamples of the controls' R^2 intervals
    modes: tuple[str, ...] = MATCHED_MODES  # trainable and/or frozen subject embeddings
    n_seeds: int = 3                        # seeds (model init and subject order) of every point of the curve
    past_fit: int | None = None             # stopping rule: steps trained past the first 100% train accuracy; none =
                                            # the recipe's (adam 100; weight_decay: its whole schedule)
    recipe: str = "weight_decay"            # the graded control's: weight_decay (lr 0.03, wd 1e-3, its whole 1000-step
                                            # schedule: converges to the geometric solution at every width) or adam
                                            # (lr 0.1)
    facts: str = "known"                    # the graded control's table: known (the facts the model knows of the
                                            # superposition fit's table) or all (every fact of that table)
    all_facts: bool = False                 # also train the all-facts control, shown apart (not graded; +3 min)
    all_facts_recipe: str = "adam"          # the all-facts control's recipe (its step cap and rule: the recipe's)
    all_facts_n_seeds: int = 1              # the all-facts control's seeds per point


SECTIONS = {"run": RunSettings, "analysis": AnalysisSettings, "matched": MatchedSettings}
SHARED = {"analysis": ("seed",)}            # fields set through another section (analysis.seed is run.seed)
COMMAND_ANALYSES = {"probe": ("lre", "ridge", "superposition"), "run": ANALYSES}   # run.analyses = none
PLACEMENT = ("device_map", "max_memory", "offload_folder", "quantize")     # run settings that place the model
TRAINING = ("max_steps", "d_max", "n_boot", "modes", "n_seeds", "past_fit", "recipe")                       # control settings of the training
TABLES = ("facts", "all_facts", "all_facts_recipe", "all_facts_n_seeds")   # control settings of the tables (the job's)
# Python API keywords beside the run settings (which are keywords by their own names): keyword -> section (a
# dict of that section's settings) or "section.key"
# the words of llmprobe 0.1's first reports, still read (with a FutureWarning): section and run() keywords
RENAMED_SECTIONS = {"controls": "matched"}
RENAMED_KEYWORDS = {"controls": "matched", "control_options": "matched_options"}
API_KEYWORDS = {"probe": {"analysis_options": "analysis"},
                "run": {"analysis_options": "analysis", "matched": "matched.enabled", "at_model_width": "matched.at_model_width",
                        "matched_options": "matched"}}


@dataclasses.dataclass
class Settings:
    """Every setting of one ``probe`` or ``run``: ``settings.run.layers``, ``settings.analysis.n_splits``,
    ``settings.matched.max_steps`` (``analysis.seed`` is not one: ``run.seed`` is the seed)."""

    run: RunSettings = dataclasses.field(default_factory=RunSettings)
    analysis: AnalysisSettings = dataclasses.field(default_factory=AnalysisSettings)
    matched: MatchedSettings = dataclasses.field(default_factory=MatchedSettings)

    def section(self, name: str) -> dict:
        """{setting: value} of one section, in field order."""
        block = getattr(self, name)
        return {key: getattr(block, key) for key in field_types(name)}

    def changed(self, name: str) -> dict:
        """The settings of section ``name`` that differ from their defaults (the only ones in the stage keys, so
        that the resume keys of default settings stay as they were)."""
        default = Settings().section(name)
        return {k: v for k, v in self.section(name).items() if v != default[k]}

    def set(self, section: str, key: str, value, where: str) -> None:
        """Set ``section.key`` to ``value`` (checked and converted to the setting's type); UsageError naming
        ``where`` and the key otherwise."""
        hint = _known_key(section, key, where)
        setattr(getattr(self, section), key, coerce(f"{where}: {section}.{key}", value, hint))

    def update(self, tree: dict, where: str) -> Settings:
        """Set the settings of ``tree`` ({section: {setting: value}}, as a TOML file or report.json holds them);
        returns self."""
        for section, table in tree.items():
            section = renamed_section(section, where)
            if section not in SECTIONS and not isinstance(table, dict):
                raise UsageError(f"{where}: {section} is outside the sections; put each setting under "
                                 f"{', '.join(f'[{name}]' for name in SECTIONS)}")
            if section not in SECTIONS:
                _known_key(section, "", where)
            if not isinstance(table, dict):
                raise UsageError(f"{where}: {section} must be a table of settings ([{section}]), got "
                                 f"{json.dumps(table, default=str)}")
            for key, value in table.items():
                self.set(section, key, value, where)
        return self

    def analyses(self, command: str) -> tuple[str, ...]:
        """The analyses to run: ``run.analyses``, or the command's default when it is none."""
        names = self.run.analyses if self.run.analyses is not None else COMMAND_ANALYSES[command]
        return analysis_names(names, ANALYSES)

    def analysis_options(self) -> dict:
        """Keyword arguments of ``run_analyses`` beside ``seed``: the changed analysis settings, and
        ``run.batch_size`` as every analysis stage's batch size (at most the default 16 for the Jacobians) where
        the batch sizes are left at their defaults."""
        return {"batch_size": self.run.batch_size,
                "jacobian_batch_size": min(AnalysisSettings.jacobian_batch_size, self.run.batch_size),
                **self.changed("analysis")}

    def matched_arguments(self) -> dict:
        """Keyword arguments of ``synthetic.matched.train_matched`` that are settings (every one given)."""
        return {"seed": self.run.seed, "at_model_width": self.matched.at_model_width,
                **{key: getattr(self.matched, key) for key in TRAINING}}

    def record(self, command: str, model: str | None) -> dict:
        """The ``settings`` block of report.json: {"command", "run", "analysis", "matched"} with every setting of
        each section (``model`` as recorded; ``run.analyses`` the analyses run; ``analysis`` as the analyses
        used it; local paths absolute; ``matched`` null for ``probe``)."""
        run = {**self.section("run"), "model": _absolute(model), "analyses": self.analyses(command)}
        if run["offload_folder"] is not None:
            run["offload_folder"] = str(Path(run["offload_folder"]).expanduser().resolve())
        if run["relations"] is not None:
            run["relations"] = [_absolute(r) for r in run["relations"]]
        run["hf_kwargs"] = {key: _absolute_paths(value) if key in HF_KWARGS_PATHS else value
                            for key, value in run["hf_kwargs"].items()}
        analysis = {**self.section("analysis"), **self.analysis_options()}
        matched = self.section("matched") if command == "run" else None
        return {"command": command,
                **{name: None if block is None else {k: list(v) if isinstance(v, tuple) else v
                                                     for k, v in block.items()}
                   for name, block in (("run", run), ("analysis", analysis), ("matched", matched))}}


def field_types(section: str) -> dict:
    """Setting name -> type hint of one section (fields set through another section left out)."""
    hints = typing.get_type_hints(SECTIONS[section])
    return {f.name: hints[f.name] for f in dataclasses.fields(SECTIONS[section])
            if f.name not in SHARED.get(section, ())}


# ------------------------------------------------------------------------------------------------ values
def _options(hint) -> tuple:
    """``int | None`` -> (int, NoneType); ``int`` -> (int,)."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def type_name(hint) -> str:
    """``tuple[int | None, ...] | None`` -> 'list of (int or none ("none")) or none ("none")'."""
    names = []
    for option in _options(hint):
        if option is type(None):
            names.append('none ("none")')
        elif typing.get_origin(option) is tuple:
            item = type_name(typing.get_args(option)[0])
            names.append(f"list of {'(' + item + ')' if ' or ' in item else item}")
        else:
            names.append({bool: "true/false", str: "text", dict: "table (a JSON object)"}.get(
                option, getattr(option, "__name__", str(option))))
    return " or ".join(names)


def coerce(key: str, value, hint):
    """``value`` (from TOML, JSON, the command line or the Python API) as the type ``hint`` says (lists become
    tuples, ints become floats where floats are wanted, None or "none" where None is allowed); UsageError naming
    ``key``."""
    options = _options(hint)
    if (value is None or value == "none") and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(option)[0]
            return tuple(coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        if option is dict and isinstance(value, dict):
            return _json_value(key, value)
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} characters)"
    raise UsageError(f"{key}: expected {type_name(hint)}, got {shown}")


def _json_value(key: str, value):
    """A copy of ``value``, a table setting or a value in it, as JSON holds it (tuples as lists); UsageError naming
    ``key`` for a key that is not text, a null (TOML has none: leave the key out), a number that is not finite, or
    a value of another type."""
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str):
                raise UsageError(f"{key}: keys must be text, got {name!r}")
        return {name: _json_value(f"{key}.{name}", item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(f"{key}[{i}]", item) for i, item in enumerate(value)]
    if value is None:
        raise UsageError(f"{key}: a null value cannot be written in TOML; leave the key out")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{key}: must be a finite number, got {value!r}")
    if not isinstance(value, (str, bool, int, float)):
        raise UsageError(f"{key}: expected text, a number, true/false, a list or a table, got "
                         f"{type(value).__name__} {str(value)[:100]!r}")
    return value


def json_object(text: str, where: str) -> dict:
    """``text`` (a command-line value, e.g. of --hf-kwargs) read as a JSON object; UsageError naming ``where``."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise UsageError(f"{where}: not JSON ({error}); give a JSON object, e.g. '{{\"data_files\": "
                         f"\"facts.csv\"}}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a JSON object ({{...}}), got {json.dumps(value)[:200]}")
    return _json_value(where, value)


def _known_key(section: str, key: str, where: str):
    """The type hint of ``section.key``; UsageError naming the key (and the closest known ones) otherwise."""
    if section not in SECTIONS:
        raise UsageError(f"{where}: unknown section {section!r}; sections are {', '.join(SECTIONS)}")
    hints = field_types(section)
    if key not in hints:
        if key in SHARED.get(section, ()):
            raise UsageError(f"{where}: {section}.{key} is set as run.{key} (one seed for everything)")
        close = difflib.get_close_matches(key, hints, n=3)
        raise UsageError(f"{where}: unknown setting {section}.{key}"
                         + (f" (did you mean {', '.join(section + '.' + c for c in close)}?)" if close else "")
                         + "; docs/config.md lists every setting")
    return hints[key]


MAX_TOML_BYTES = 1 << 20     # a settings file's size bound (every setting written out is about 5 kB)


def read_toml(path: str | Path) -> dict:
    """A TOML settings file as a dict; UsageError naming the file (and the line of a syntax error). A FIFO,
    device or socket is refused unopened (reading one can wait for ever), as is a file over ``MAX_TOML_BYTES``."""
    check_not_special(path, "--config")
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0        # reading it says why
    if size > MAX_TOML_BYTES:
        raise UsageError(f"--config {str(path)!r}: {size:,} bytes; a settings file is at most {MAX_TOML_BYTES:,} "
                         f"bytes (`llmprobe config` prints every setting in a few kB)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--config {str(path)!r}: cannot read it ({getattr(error, 'strerror', None) or error})") \
            from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"--config {str(path)!r}: not valid TOML: {error}") from None


def renamed_section(section: str, where: str) -> str:
    """``section``, or its new name (with a FutureWarning naming ``where``) when it is an old one
    (:data:`RENAMED_SECTIONS`: ``[controls]`` is ``[matched]``)."""
    if section in RENAMED_SECTIONS:
        new = RENAMED_SECTIONS[section]
        warnings.warn(f"{where}: the section {section!r} is now {new!r}; read as {new!r}", FutureWarning,
                      stacklevel=3)
        return new
    return section


def parse_set(text: str) -> tuple[str, str, object]:
    """``"analysis.ridge_alphas=[0.1, 1]"`` -> ("analysis", "ridge_alphas", (0.1, 1.0)), checked and converted.
    The value is read as TOML; where the setting takes text, a value that is not of the setting's type is
    taken as the text written (``cpu``, ``0,6,12``, ``-1``), and ``none`` is None where None is allowed."""
    where = f"--set {text!r}" if len(text) <= 100 else f"--set {text[:100]!r}... ({len(text)} characters)"
    name, equals, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not equals or not dot or not key:
        raise UsageError(f"{where}: use --set SECTION.KEY=VALUE, e.g. --set analysis.n_splits=5 "
                         f"(sections: {', '.join(SECTIONS)})")
    section = renamed_section(section, where)
    hint = _known_key(section, key, where)
    raw = raw.strip()
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    except ValueError:           # an int of more digits than Python converts
        raise UsageError(f"{where}: {section}.{key}: a number of more than {sys.get_int_max_str_digits()} "
                         f"digits") from None
    try:
        return section, key, coerce(f"{where}: {section}.{key}", value, hint)
    except UsageError:
        if str not in _options(hint) or value == raw:
            raise
    return section, key, raw


def resolve(config: str | Path | None = None, sets=(), flags: dict | None = None) -> Settings:
    """The settings: defaults <- ``config`` (a TOML file) <- ``sets`` (``SECTION.KEY=VALUE`` texts) <- ``flags``
    ({"section.key": value} given explicitly on the command line), checked."""
    settings = Settings()
    if config is not None:
        settings.update(read_toml(config), f"--config {str(config)!r}")
    for text in sets:
        section, key, value = parse_set(text)
        setattr(getattr(settings, section), key, value)
    for name, value in (flags or {}).items():
        section, key = name.split(".")
        settings.set(section, key, value, "command line")
    return check(settings)


def from_options(command: str, settings: Settings | None, options: dict) -> Settings:
    """The settings of a Python API call: a copy of ``settings`` (default: the defaults) with ``options``, the
    keywords of ``probe`` or ``run`` (``command``): every run setting by its name, and :data:`API_KEYWORDS`
    (``analysis_options={"n_splits": 2}``, ...); checked. The API's other forms of a value are taken too:
    ``layers`` a list of layers or None (all), ``analyses`` a comma list, ``max_memory`` a text or a dict, paths
    as ``os.PathLike``. An unknown keyword raises UsageError naming it."""
    settings = copy.deepcopy(settings) if settings is not None else Settings()
    where, run_keys, extra = f"{command}()", field_types("run"), API_KEYWORDS[command]
    if command == "run":
        for old in set(options) & set(RENAMED_KEYWORDS):
            warnings.warn(f"{where}: the keyword {old!r} is now {RENAMED_KEYWORDS[old]!r}", FutureWarning,
                          stacklevel=3)
        options = {RENAMED_KEYWORDS.get(keyword, keyword): value for keyword, value in options.items()}
    unknown = sorted(set(options) - set(run_keys) - set(extra))
    if unknown:
        raise UsageError(f"{where}: unknown keyword(s) {', '.join(unknown)}; the settings are "
                         f"{', '.join([*run_keys, *extra])} (docs/config.md)")
    for keyword, value in options.items():
        target = extra.get(keyword, f"run.{keyword}")
        if "." in target:
            section, key = target.split(".")
            settings.set(section, key, _api_form(key, value) if section == "run" else value, where)
        elif value is not None:
            if not isinstance(value, dict):
                raise UsageError(f"{where}: {keyword} must be a dict of {target} settings, got "
                                 f"{json.dumps(value, default=str)}")
            settings.update({target: value}, f"{where} {keyword}")
    return check(settings)


def _api_form(key: str, value):
    """A run setting given to the Python API in another form, as the setting's own type takes it."""
    if isinstance(value, os.PathLike):
        return str(value)
    if key == "layers" and not isinstance(value, str):
        try:
            return "all" if value is None else ",".join(str(int(layer)) for layer in value)
        except (TypeError, ValueError):
            raise UsageError(f"layers: expected all, every:K, a comma list or a list of integers, got "
                             f"{value!r}") from None
    if key == "analyses" and isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if key == "relations" and isinstance(value, (list, tuple)):
        return [str(item) if isinstance(item, os.PathLike) else item for item in value]
    if key == "max_memory" and isinstance(value, (str, dict)):
        items = value.items() if isinstance(value, dict) else [(value, None)]
        return [f"{k}={v}" if v is not None else str(k) for k, v in items]
    return value


SEED_MAX = 2 ** 32 - 1     # the largest seed every generator takes (numpy's; derived seeds stay within int64)
# The allowed range of every number setting: key -> (lowest, highest, bounds excluded); None: no bound. A list
# setting's items must each lie in it, and the list must not be empty (``(None, None, False)``: only that); a
# setting that is none passes where its type allows none (:func:`check`).
RANGES = {
    "run.batch_size": (1, None, False), "run.max_facts": (1, None, False), "run.max_prompt_tokens": (1, None, False),
    "run.seed": (0, SEED_MAX, False),
    "analysis.n_splits": (1, None, False), "analysis.max_subjects": (1, None, False),
    "analysis.min_known": (1, None, False), "analysis.n_jacobian": (1, None, False),
    "analysis.test_fraction": (0, 1, True), "analysis.val_fraction": (0, 1, True),
    "analysis.selection_folds": (2, None, False), "analysis.betas": (0, None, True),
    "analysis.ranks": (1, None, False), "analysis.edit_ranks": (1, None, False),
    "analysis.max_val_pairs": (1, None, False), "analysis.max_test_pairs": (1, None, False),
    "analysis.ridge_alphas": (0, None, True), "analysis.n_icl": (0, None, False),
    "analysis.lre_betas": (0, None, False), "analysis.lre_edit_ranks": (0, None, False),
    "analysis.lre_layers": (None, None, False), "analysis.max_lre_layers": (1, None, False),
    "analysis.causality_layers": (None, None, False), "analysis.max_superposition_subjects": (1, None, False),
    "analysis.folds": (2, None, False), "analysis.swap_layers": (None, None, False),
    "analysis.max_swap_subjects": (1, None, False), "analysis.swap_scales": (0, None, True),
    "analysis.n_boot": (1, None, False), "analysis.jackknife_groups": (0, None, False),
    "analysis.batch_size": (1, None, False), "analysis.jacobian_batch_size": (1, None, False),
    "analysis.jacobian_chunk": (1, None, False), "analysis.jacobian_oversample": (0, None, False),
    "analysis.jacobian_rank": (1, None, False),     # its number K ("auto" and "full" are checked by the analyses)
    "matched.n_seeds": (1, None, False), "matched.past_fit": (0, None, False), "matched.all_facts_n_seeds": (1, None, False),
    "matched.max_steps": (1, None, False), "matched.d_max": (1, None, False), "matched.n_boot": (1, None, False),
}

# keys of run.hf_kwargs refused, and why
HF_KWARGS_REFUSED = {"split": "name the split in the relation, hf:NAME:SPLIT",
                     "trust_remote_code": "llmprobe runs no code that comes with a dataset"}

WIDTH_MAX = 2 ** 20        # ranks, widths and token counts: more than any model's width or context
LAYER_MAX = 10_000         # a layer index (negative from the last layer): more than any model's depth
MAX_ITEMS = 1000           # values in one list setting
# The stated bound of every number that RANGES leaves open: key -> (lowest, highest). A count far beyond any use
# costs hours before the model is reached (the plan counts the work it stands for), so each has a cap; a list
# setting holds at most MAX_ITEMS values. ``llmprobe config`` (docs/config.md) shows each setting's whole range.
CAPS = {
    "run.batch_size": (None, 65536), "run.max_facts": (None, 10 ** 9), "run.max_prompt_tokens": (None, WIDTH_MAX),
    "analysis.n_splits": (None, 100), "analysis.max_subjects": (None, 100_000),
    "analysis.min_known": (None, 100_000), "analysis.n_jacobian": (None, 1000),
    "analysis.selection_folds": (None, 100), "analysis.betas": (None, 10 ** 6),
    "analysis.ranks": (None, WIDTH_MAX), "analysis.edit_ranks": (None, WIDTH_MAX),
    "analysis.max_val_pairs": (None, 10_000), "analysis.max_test_pairs": (None, 100_000),
    "analysis.ridge_alphas": (None, 10 ** 12), "analysis.n_icl": (None, 100),
    "analysis.lre_betas": (None, 10 ** 6), "analysis.lre_edit_ranks": (None, WIDTH_MAX),
    "analysis.lre_layers": (-LAYER_MAX, LAYER_MAX), "analysis.max_lre_layers": (None, LAYER_MAX),
    "analysis.causality_layers": (-LAYER_MAX, LAYER_MAX), "analysis.max_superposition_subjects": (None, 10 ** 6),
    "analysis.folds": (None, 100), "analysis.swap_layers": (-LAYER_MAX, LAYER_MAX),
    "analysis.max_swap_subjects": (None, 10_000), "analysis.swap_scales": (None, 10 ** 6),
    "analysis.n_boot": (None, 100_000), "analysis.jackknife_groups": (None, 10_000),
    "analysis.batch_size": (None, 65536), "analysis.jacobian_batch_size": (None, 65536),
    "analysis.jacobian_chunk": (None, WIDTH_MAX), "analysis.jacobian_oversample": (None, WIDTH_MAX),
    "analysis.jacobian_rank": (None, WIDTH_MAX),
    "matched.n_seeds": (None, 100), "matched.past_fit": (None, 10 ** 6), "matched.all_facts_n_seeds": (None, 100),
    "matched.max_steps": (None, 10 ** 7), "matched.d_max": (None, WIDTH_MAX), "matched.n_boot": (None, 100_000),
}


def full_range(key: str) -> tuple:
    """(lowest, highest, bounds excluded) of setting ``key``: RANGES with CAPS filling its open bounds."""
    low, high, excluded = RANGES[key]
    cap_low, cap_high = CAPS.get(key, (None, None))
    return (cap_low if low is None else low), (cap_high if high is None else high), excluded


def _bounds_text(bounds: tuple) -> str:
    """``(1, 100, False)`` -> '1 to 100'; ``(0, 1, True)`` -> 'above 0 and below 1'."""
    low, high, excluded = (*(f"{x:_}" if isinstance(x, int) else repr(x) for x in bounds[:2]), bounds[2])
    return f"above {low} and below {high}" if excluded else f"{low} to {high}"


def range_text(key: str) -> str:
    """The range of setting ``key`` (``"analysis.n_splits"``) in words, '' for a setting without one."""
    if key not in RANGES:
        return ""
    hint = field_types(key.split(".")[0])[key.split(".")[1]]
    is_list = any(typing.get_origin(option) is tuple for option in _options(hint))
    words = _bounds_text(full_range(key))
    return f"each {words}, 1 to {MAX_ITEMS:_} values" if is_list else words


def _check_range(key: str, value, bounds: tuple) -> None:
    """UsageError naming ``key`` and its allowed range (``RANGES``; its cap, ``CAPS``, where that is what the value
    passes) when ``value`` (a number, a list of numbers, or None) lies outside it; floats must also be finite."""
    low, high, excluded = bounds
    if value is None:
        return
    if isinstance(value, tuple) and not value:
        raise UsageError(f"{key} must list at least one value, got []")
    if isinstance(value, tuple) and len(value) > MAX_ITEMS:
        raise UsageError(f"{key} must list at most {MAX_ITEMS} values, got {len(value)}")
    cap_low, cap_high = CAPS.get(key, (None, None))
    for item in value if isinstance(value, tuple) else (value,):
        if item is None or isinstance(item, str):         # ranks' none; jacobian_rank's text is checked elsewhere
            continue
        finite = not isinstance(item, float) or math.isfinite(item)
        inside = ((low is None or (item > low if excluded else item >= low))
                  and (high is None or (item < high if excluded else item <= high)) and finite)
        capped = ((cap_low is None or item >= cap_low) and (cap_high is None or item <= cap_high))
        if not inside or not capped:
            shown_low, shown_high = low, high
            if inside:                                    # past a cap: the whole range is said
                shown_low, shown_high = (cap_low if low is None else low), (cap_high if high is None else high)
            where = f"each value of {key}" if isinstance(value, tuple) else key
            if excluded:
                parts = [f"above {shown_low}" if shown_low is not None else "",
                         f"below {shown_high}" if shown_high is not None else ""]
            else:
                parts = [f"at least {shown_low}" if shown_low is not None else "",
                         f"at most {shown_high}" if shown_high is not None else ""]
            kind = "a finite number " if isinstance(item, float) or excluded else ""
            shown = repr(item) if len(repr(item)) <= 40 else f"{repr(item)[:40]}... ({len(repr(item))} characters)"
            raise UsageError(f"{where} must be {kind}{' and '.join(p for p in parts if p)}, got {shown}; "
                             f"docs/config.md gives every setting's range")


def check(settings: Settings) -> Settings:
    """The checks beyond the types: names, choices and ranges (UsageError naming the setting); returns the
    settings."""
    run, matched = settings.run, settings.matched
    for key, choices in (("dtype", DTYPES), ("device_map", DEVICE_MAPS), ("quantize", QUANTIZE)):
        value = getattr(run, key)
        if value is not None and value not in choices:
            raise UsageError(f"run.{key} must be one of {', '.join(choices)}, got {value!r}")
    try:
        parse_max_memory(None if run.max_memory is None else list(run.max_memory))
    except ValueError as error:
        raise UsageError(f"run.max_memory: {error}") from None
    layer_spec(run.layers)
    for key, why in HF_KWARGS_REFUSED.items():
        if key in run.hf_kwargs:
            raise UsageError(f"run.hf_kwargs: {key} is not taken: {why}")
    if run.analyses is not None:
        analysis_names(run.analyses, ANALYSES)
    for key, bounds in RANGES.items():
        section, name = key.split(".")
        _check_range(key, getattr(getattr(settings, section), name), bounds)
    for key in ("recipe", "all_facts_recipe"):
        if getattr(matched, key) not in MATCHED_RECIPES:
            raise UsageError(f"matched.{key} must be one of {', '.join(MATCHED_RECIPES)}, got "
                             f"{getattr(matched, key)!r}")
    if matched.facts not in MATCHED_FACTS:
        raise UsageError(f"matched.facts must be one of {', '.join(MATCHED_FACTS)}, got {matched.facts!r}")
    unknown = [m for m in matched.modes if m not in MATCHED_MODES]
    if unknown or not matched.modes:
        raise UsageError(f"matched.modes must be a non-empty list of {', '.join(MATCHED_MODES)}, got "
                         f"{list(matched.modes)}")
    try:
        settings_from(seed=run.seed, **settings.section("analysis"))
    except (TypeError, ValueError) as error:
        raise UsageError(f"analysis settings: {error}") from None
    return settings


# ----------------------------------------------------------------------------------------- report.json
def _absolute(name: str | None) -> str | None:
    """A local path as an absolute path (so a rerun from another folder finds it); other names as given."""
    if name is None:
        return None
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


HF_KWARGS_PATHS = ("data_files", "data_dir")     # keys of run.hf_kwargs that may name local files


def _absolute_paths(value):
    """The local paths in ``value`` (a text, or a list or table of them: ``data_files``) absolute (:func:`_absolute`)."""
    if isinstance(value, str):
        return _absolute(value)
    if isinstance(value, list):
        return [_absolute_paths(item) for item in value]
    if isinstance(value, dict):
        return {key: _absolute_paths(item) for key, item in value.items()}
    return value


def from_record(block: dict, where: str = "report.json settings") -> tuple[str, Settings]:
    """(command, settings) from a report's ``settings`` block, checked like a settings file."""
    if not isinstance(block, dict) or block.get("command") not in COMMAND_ANALYSES:
        raise UsageError(f"{where}: no recorded settings of probe or run (reports written before settings were "
                         f"recorded cannot be rerun)")
    settings = Settings().update({k: v for k, v in _older_matched(block).items() if k != "command" and v is not None},
                                 where)
    return block["command"], check(settings)


def _older_matched(block: dict) -> dict:
    """A run's settings block recorded before the controls' table was a setting (its ``matched`` without ``facts``):
    those controls trained on every fact, so a rerun repeats that (``facts = "all"``)."""
    matched = block.get("matched")
    if isinstance(matched, dict) and "facts" not in matched:
        return {**block, "matched": {**matched, "facts": "all"}}
    return block


# ------------------------------------------------------------------------------------------------ TOML
def _toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _comments(cls) -> dict:
    """Setting name -> the comment beside its field in ``cls``'s source (continuation lines joined)."""
    comments, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"\s+(\w+):[^#]*(?:#\s*(.*))?$", line)
        if field and field.group(1) in cls.__dataclass_fields__:
            last = field.group(1)
            comments[last] = (field.group(2) or "").strip()
        elif last and re.match(r"\s+#", line):
            comments[last] += " " + line.strip().lstrip("#").strip()
        else:
            last = None
    return comments


def settings_toml(settings: Settings | None = None) -> str:
    """``settings`` (default: the defaults) as a TOML settings file, every setting with its comment; reading it
    back gives the same settings."""
    settings = settings or Settings()
    lines = []
    for section, cls in SECTIONS.items():
        comments = _comments(cls)
        lines += ["" if lines else None, f"[{section}]"]
        for key, value in settings.section(section).items():
            bounds = range_text(f"{section}.{key}")
            note = " ".join(filter(None, (comments.get(key), f"(range: {bounds})" if bounds else "")))
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(line for line in lines if line is not None) + "\n"


__all__ = ["Settings", "RunSettings", "MatchedSettings", "SECTIONS", "resolve", "from_options", "check",
           "parse_set", "read_toml", "coerce", "json_object", "from_record", "settings_toml"]
