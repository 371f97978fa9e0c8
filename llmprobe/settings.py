"""One settings layer for ``llmprobe probe``, ``run`` and ``rerun``.

Settings come in three sections, each a dataclass whose fields (names, types, defaults) are the settings:

* ``run``: what to load and probe (:class:`RunSettings`: model, relations, layers, device, seed, ...);
* ``analysis``: every field of :class:`llmprobe.analyses.AnalysisSettings` but ``seed`` (the one seed is
  ``run.seed``);
* ``controls``: the matched synthetic controls of ``llmprobe run`` (:class:`ControlSettings`).

They are resolved in this order, each overriding the one before: the defaults, ``--config FILE.toml`` (tables
``[run]``, ``[analysis]``, ``[controls]``), ``--set SECTION.KEY=VALUE`` (repeatable; VALUE is a TOML value, or
the text written where the setting takes text: ``run.layers=0,6``), then the explicit command-line flags
(``--layers``, ``--protocol``, ...). TOML has no null: the string ``"none"`` stands for None where a setting
allows it. An unknown key, a value of the wrong type or a malformed file raises :class:`UsageError` naming the
key (or the file's line). ``probe`` and ``run`` record the resolved settings in report.json (``settings``), from
which :func:`rerun` reproduces the report. ``docs/config.md`` shows every key with its default
(:func:`settings_toml`).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from pathlib import Path

import tomllib

from llmprobe.analyses.settings import AnalysisSettings, settings_from
from llmprobe.checks import DEVICE_MAPS, DTYPES, QUANTIZE, UsageError, parse_max_memory
from llmprobe.names import CONTROL_MODES


@dataclasses.dataclass
class RunSettings:
    """What ``probe`` and ``run`` load and check (the arguments of ``llmprobe.jobs.probe.probe``)."""

    model: str | None = None                # hub name, local folder or .gguf file; none = embedded SmolLM2-135M
    gguf_file: str | None = None            # GGUF file inside the model folder or hub repo
    relations: tuple[str, ...] | None = None    # bundled names, files, folders or hf:DATASET; none = all bundled
    layers: str = "every:3"                 # all | every:K | comma list like "0,6,12" | "-1"
    analyses: tuple[str, ...] | None = None     # of lre, ridge, superposition; none = the command's default
                                                # (probe: no analyses; run: all three)
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


@dataclasses.dataclass
class ControlSettings:
    """The matched synthetic controls of ``llmprobe run`` (arguments of ``synthetic.controls.train_controls``)."""

    enabled: bool = True                    # false: skip the controls (--no-controls)
    at_model_width: bool = True             # false: train only at d*, not also up to the model's d_model
    max_steps: int = 2000                   # step cap of every control's training (the bisection's too)
    d_max: int | None = None                # widest width the bisection tries; none = the model's d_model
    n_boot: int = 500                       # bootstrap resamples of the controls' R^2 intervals
    modes: tuple[str, ...] = CONTROL_MODES  # trainable and/or frozen subject embeddings


SECTIONS = {"run": RunSettings, "analysis": AnalysisSettings, "controls": ControlSettings}
SHARED = {"analysis": ("seed",)}            # fields set through another section (analysis.seed is run.seed)
COMMAND_ANALYSES = {"probe": (), "run": ("lre", "ridge", "superposition")}   # run.analyses = none
PLACEMENT = ("device_map", "max_memory", "offload_folder", "quantize")     # run settings that place the model


def field_types(section: str) -> dict:
    """Setting name -> type hint of one section (fields set through another section left out)."""
    hints = typing.get_type_hints(SECTIONS[section])
    return {f.name: hints[f.name] for f in dataclasses.fields(SECTIONS[section])
            if f.name not in SHARED.get(section, ())}


def defaults() -> dict:
    """{section: {setting: default}} of every setting."""
    return {section: {name: getattr(cls(), name) for name in field_types(section)}
            for section, cls in SECTIONS.items()}


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
            names.append({bool: "true/false", str: "text"}.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(names)


def coerce(key: str, value, hint):
    """``value`` (from TOML, JSON or the command line) as the type ``hint`` says (lists become tuples, ints
    become floats where floats are wanted, None or "none" where None is allowed); UsageError naming ``key``."""
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
    raise UsageError(f"{key}: expected {type_name(hint)}, got {json.dumps(value, default=str)}")


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


def update(values: dict, tree: dict, where: str) -> dict:
    """Set the settings of ``tree`` ({section: {setting: value}}, as a TOML file or report.json holds them) in
    ``values`` (checked and converted); returns ``values``."""
    for section, table in tree.items():
        if section not in SECTIONS and not isinstance(table, dict):
            raise UsageError(f"{where}: {section} is outside the sections; put each setting under "
                             f"{', '.join(f'[{name}]' for name in SECTIONS)}")
        if section not in SECTIONS:
            _known_key(section, "", where)
        if not isinstance(table, dict):
            raise UsageError(f"{where}: {section} must be a table of settings ([{section}]), got "
                             f"{json.dumps(table, default=str)}")
        for key, value in table.items():
            values[section][key] = coerce(f"{where}: {section}.{key}", value, _known_key(section, key, where))
    return values


def read_toml(path: str | Path) -> dict:
    """A TOML settings file as a dict; UsageError naming the file (and the line of a syntax error)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--config {str(path)!r}: cannot read it ({getattr(error, 'strerror', None) or error})") \
            from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"--config {str(path)!r}: not valid TOML: {error}") from None


def parse_set(text: str) -> tuple[str, str, object]:
    """``"analysis.ridge_alphas=[0.1, 1]"`` -> ("analysis", "ridge_alphas", (0.1, 1.0)), checked and converted.
    The value is read as TOML; where the setting takes text, a value that is not of the setting's type is
    taken as the text written (``cpu``, ``0,6,12``, ``-1``), and ``none`` is None where None is allowed."""
    where = f"--set {text!r}"
    name, equals, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not equals or not dot or not key:
        raise UsageError(f"{where}: use --set SECTION.KEY=VALUE, e.g. --set analysis.n_splits=5 "
                         f"(sections: {', '.join(SECTIONS)})")
    hint = _known_key(section, key, where)
    raw = raw.strip()
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    try:
        return section, key, coerce(f"{where}: {section}.{key}", value, hint)
    except UsageError:
        if str not in _options(hint) or value == raw:
            raise
    return section, key, raw


def resolve(config: str | Path | None = None, sets=(), flags: dict | None = None) -> dict:
    """The settings: defaults <- ``config`` (a TOML file) <- ``sets`` (``SECTION.KEY=VALUE`` texts) <- ``flags``
    ({"section.key": value} given explicitly on the command line). Checked; returns {section: {setting: value}}."""
    values = defaults()
    if config is not None:
        update(values, read_toml(config), f"--config {str(config)!r}")
    for text in sets:
        section, key, value = parse_set(text)
        values[section][key] = value
    for name, value in (flags or {}).items():
        section, key = name.split(".")
        values[section][key] = coerce(name, value, _known_key(section, key, "command line"))
    check(values)
    return values


def check(values: dict) -> None:
    """Checks beyond the types: choices and ranges (UsageError naming the setting)."""
    run, controls = values["run"], values["controls"]
    for key, choices in (("dtype", DTYPES), ("device_map", DEVICE_MAPS), ("quantize", QUANTIZE)):
        if run[key] is not None and run[key] not in choices:
            raise UsageError(f"run.{key} must be one of {', '.join(choices)}, got {run[key]!r}")
    try:
        parse_max_memory(None if run["max_memory"] is None else list(run["max_memory"]))
    except ValueError as error:
        raise UsageError(f"run.max_memory: {error}") from None
    for key in ("batch_size", "max_facts", "max_prompt_tokens"):
        if run[key] is not None and run[key] < 1:
            raise UsageError(f"run.{key} must be at least 1, got {run[key]}")
    for key in ("max_steps", "d_max", "n_boot"):
        if controls[key] is not None and controls[key] < 1:
            raise UsageError(f"controls.{key} must be at least 1, got {controls[key]}")
    unknown = [m for m in controls["modes"] if m not in CONTROL_MODES]
    if unknown or not controls["modes"]:
        raise UsageError(f"controls.modes must be a non-empty list of {', '.join(CONTROL_MODES)}, got "
                         f"{list(controls['modes'])}")
    try:
        settings_from(seed=run["seed"], **values["analysis"])
    except (TypeError, ValueError) as error:
        raise UsageError(f"analysis settings: {error}") from None


def changed(values: dict, section: str) -> dict:
    """The settings of ``section`` that differ from their defaults (what ``probe``/``run`` take as options, so
    that the resume keys of default settings stay as they were)."""
    default = defaults()[section]
    return {k: v for k, v in values[section].items() if v != default[k]}


def probe_arguments(values: dict, command: str) -> dict:
    """Keyword arguments of ``llmprobe.jobs.probe.probe`` (``command="probe"``) or ``llmprobe.jobs.main.run`` (``"run"``)."""
    run = values["run"]
    arguments = {k: run[k] for k in ("model", "gguf_file", "layers", "device", "dtype", "batch_size", "max_facts",
                                      "max_prompt_tokens", "seed", "offload_folder")}
    arguments.update(device_map=run["device_map"], quantize=run["quantize"],
                     max_memory=None if run["max_memory"] is None else list(run["max_memory"]))
    arguments["relations"] = list(run["relations"]) if run["relations"] is not None else None
    arguments["analyses"] = run["analyses"] if run["analyses"] is not None else COMMAND_ANALYSES[command]
    arguments["analysis_options"] = changed(values, "analysis")
    if command == "run":
        controls = values["controls"]
        arguments.update(controls=controls["enabled"], at_model_width=controls["at_model_width"],
                         control_options={k: v for k, v in changed(values, "controls").items()
                                          if k not in ("enabled", "at_model_width")})
    return arguments


# ----------------------------------------------------------------------------------------- report.json
def _json_ready(value):
    return list(value) if isinstance(value, tuple) else value


def _absolute(name: str | None) -> str | None:
    """A local path as an absolute path (so a rerun from another folder finds it); other names as given."""
    if name is None:
        return None
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def settings_record(command: str, run: dict, analysis_options: dict | None,
                    control_options: dict | None = None) -> dict:
    """The ``settings`` block of report.json: {"command", "run", "analysis", "controls"} with every setting of
    each section (defaults filled in; local paths made absolute; ``controls`` null for ``probe``)."""
    run = {**defaults()["run"], **run}
    if isinstance(run["max_memory"], (str, dict)):   # the Python API takes "0=70GiB,cpu=8GiB" and dicts too
        items = run["max_memory"].items() if isinstance(run["max_memory"], dict) else [(run["max_memory"], None)]
        run["max_memory"] = [f"{k}={v}" if v is not None else str(k) for k, v in items]
    if run["offload_folder"] is not None:
        run["offload_folder"] = str(Path(run["offload_folder"]).expanduser().resolve())
    if not isinstance(run["layers"], str):          # the Python API takes a list of layers too
        run["layers"] = "all" if run["layers"] is None else ",".join(str(int(l)) for l in run["layers"])
    run["model"], run["relations"] = _absolute(run["model"]), (None if run["relations"] is None else
                                                              [_absolute(r) for r in run["relations"]])
    analysis = {**defaults()["analysis"], **{k: v for k, v in (analysis_options or {}).items() if k != "seed"}}
    controls = None if control_options is None else {**defaults()["controls"], **control_options}
    return {"command": command,
            **{name: None if block is None else {k: _json_ready(v) for k, v in block.items()}
               for name, block in (("run", run), ("analysis", analysis), ("controls", controls))}}


def from_record(block: dict, where: str = "report.json settings") -> tuple[str, dict]:
    """(command, settings) from a report's ``settings`` block, checked like a settings file."""
    if not isinstance(block, dict) or block.get("command") not in COMMAND_ANALYSES:
        raise UsageError(f"{where}: no recorded settings of probe or run (reports written before settings were "
                         f"recorded cannot be rerun)")
    values = update(defaults(), {k: v for k, v in block.items() if k != "command" and v is not None}, where)
    check(values)
    return block["command"], values


# ------------------------------------------------------------------------------------------------ TOML
def _toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
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


def settings_toml(values: dict | None = None) -> str:
    """``values`` (default: the defaults) as a TOML settings file, every setting with its comment; reading it
    back gives the same settings."""
    values = values or defaults()
    lines = []
    for section, cls in SECTIONS.items():
        comments = _comments(cls)
        lines += ["" if lines else None, f"[{section}]"]
        for key, value in values[section].items():
            note = comments.get(key)
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(line for line in lines if line is not None) + "\n"


__all__ = ["RunSettings", "ControlSettings", "SECTIONS", "defaults", "resolve", "parse_set", "read_toml",
           "update", "coerce", "changed", "probe_arguments", "settings_record", "from_record", "settings_toml"]
