"""The report.json schema: its version, the one reader that checks a report before anything uses it (and reads
the version before it in today's words), a report's name, the stages a partial report lacks, its matched block
expanded into sources in the per-source layout, its blocks typed (:func:`analyses_of`, :func:`model_of`,
:func:`settings_of`, :func:`matched_sources_of`; :mod:`llmprobe.analyses.results`), and every measured number
flattened into tidy *metric rows* (what claims, figures and tables read)."""
from __future__ import annotations

import re
from pathlib import Path

from llmprobe.analyses.results import (
    AnalysesResult,
    DatasetInfo,
    MatchedSource,
    ModelInfo,
    ReportSettings,
)
from llmprobe.checks import read_json
from llmprobe.metric import is_metric, iter_metrics

REPORT_SCHEMA_VERSION = 3      # 2: typed metrics everywhere, test_subjects per relation, reference causality;
#                                3: one word per concept: a metric's ``nulls`` / ``primary_null`` (2: controls /
#                                   control), the matched synthetic models under ``matched`` (2: controls)
READABLE_SCHEMA_VERSIONS = (2, REPORT_SCHEMA_VERSION)    # 2 is read through upgrade()


def read_report(path: str | Path) -> dict:
    """Read ``DIR/report.json`` (or the JSON file itself) with a clear error when it is missing or malformed."""
    path = Path(path)
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no report.json at {path}")
    report = read_json(file, ValueError, "; not an llmprobe report", encoding="utf-8")
    if not isinstance(report, dict):
        raise ValueError(f"{file}: not an llmprobe report (a JSON {type(report).__name__}, expected an object)")
    if "schema_version" not in report:
        raise ValueError(f"{file}: not an llmprobe report (no 'schema_version')")
    supported = supported_schema_versions()
    version = report["schema_version"]
    if type(version) is not int or version not in supported:
        raise ValueError(f"{file}: schema_version {version!r} is not supported by this llmprobe (supported: "
                         f"{', '.join(map(str, supported))}); open it with the llmprobe version that wrote it, or "
                         f"run the model again")
    report = upgrade(report)
    check_shape(report, file)
    report.setdefault("_path", str(file.parent))
    return report


def upgrade(report: dict) -> dict:
    """A version-2 report in version 3's words (a copy; a version-3 report is returned as it is): every metric's
    ``controls``/``control`` become ``nulls``/``primary_null``; the top-level ``controls`` block, its stage, its
    settings section and its timings (``controls_s``, ``controls_wait_s``) become ``matched``. Numbers unchanged."""
    if report.get("schema_version") != 2:
        return report

    def metric_words(node):
        if isinstance(node, list):
            return [metric_words(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {key: metric_words(value) for key, value in node.items()}
        if is_metric(out):
            if "controls" in out:
                out["nulls"] = out.pop("controls")
            if "control" in out:
                out["primary_null"] = out.pop("control")
        return out

    def renamed(block, old: str, new: str):
        return {new if key == old else key: value for key, value in block.items()} if isinstance(block, dict) \
            else block

    out = renamed(metric_words(report), "controls", "matched")
    for key in ("stages", "settings"):
        out[key] = renamed(out.get(key), "controls", "matched")
    if isinstance(out.get("timings"), dict):
        out["timings"] = {key.replace("controls_", "matched_", 1) if key.startswith("controls_") else key: value
                          for key, value in out["timings"].items()}
    out["schema_version"] = REPORT_SCHEMA_VERSION
    return out


# the types of report.json where its readers rely on them: dotted path ("*": every key) -> expected JSON type
SHAPES = (("model", dict), ("relations", dict), ("relations.*", dict), ("analyses", dict),
          ("analyses.relations", dict), ("analyses.relations.*", dict), ("analyses.relations.*.layers", dict),
          ("analyses.superposition", dict), ("analyses.superposition.layers", dict), ("errors", list),
          ("matched", (dict, list)), ("stages", dict), ("stages.*", dict), ("stages.*.done", bool),
          ("settings", dict), ("timings", dict))
LAYER_KEYED = ("analyses.relations.*.layers", "analyses.superposition.layers")    # keys: layer indices
JSON_TYPES = {dict: "object", list: "list", str: "str", int: "int", float: "float", bool: "bool"}


def check_shape(report: dict, file: Path) -> None:
    """ValueError naming ``file``, the path and what is wrong where ``report`` does not have the ``SHAPES`` (a
    null passes), a layer key is not a layer index, or a matched list holds other things than objects."""
    for path, kinds in SHAPES:
        for where, value in _at(report, path):
            if value is not None and not isinstance(value, kinds):
                wanted = {bool: "true or false", list: "a list", dict: "an object"}.get(kinds, "an object or a list")
                raise ValueError(f"{file}: malformed report: {where!r} is a JSON "
                                 f"{JSON_TYPES.get(type(value), type(value).__name__)}, expected {wanted}")
    for path in LAYER_KEYED:
        for where, layers in _at(report, path):
            bad = [key for key in layers or {} if not re.fullmatch(r"\d+", key, re.ASCII)]
            if bad:
                raise ValueError(f"{file}: malformed report: {where}: layer key {bad[0]!r} is not a layer index "
                                 f"(a whole number)"[:300])
    matched = report.get("matched")
    if isinstance(matched, list) and not all(isinstance(c, dict) for c in matched):
        kinds = sorted({JSON_TYPES.get(type(c), type(c).__name__) for c in matched if not isinstance(c, dict)})
        raise ValueError(f"{file}: malformed report: 'matched' is a list of {', '.join(kinds)}, expected a list of "
                         f"objects or an object")


def analyses_of(report: dict) -> AnalysesResult:
    """The report's ``analyses`` block typed (:mod:`llmprobe.analyses.results`): what the claims, tables and figures
    read; a report (or matched source) without one gives an empty block."""
    return AnalysesResult.from_dict(report.get("analyses"))


def model_of(report: dict) -> ModelInfo:
    """The report's (or a matched source's) ``model`` block typed; empty where it has none (or a null)."""
    return ModelInfo.from_dict(report.get("model"))


def settings_of(report: dict) -> ReportSettings:
    """The report's ``settings`` block typed; empty where it has none (or a null)."""
    return ReportSettings.from_dict(report.get("settings"))


def matched_sources_of(report: dict) -> list[MatchedSource]:
    """The report's matched controls, one typed source per trained point (:func:`matched_sources`)."""
    return [MatchedSource.from_dict(s) for s in matched_sources(report.get("matched"), report.get("schema_version"))]


def _at(report: dict, path: str) -> list[tuple[str, object]]:
    """(dotted path, value) of every value at ``path`` in ``report`` ("*": every key of an object)."""
    found = [("", report)]
    for part in path.split("."):
        found = [(f"{where}.{key}" if where else key, node[key]) for where, node in found if isinstance(node, dict)
                 for key in (node if part == "*" else [part] if part in node else [])]
    return found


def supported_schema_versions() -> tuple[int, ...]:
    """The report.json schema versions this llmprobe reads: the one it writes and the one before it (upgraded)."""
    return READABLE_SCHEMA_VERSIONS


def source_name(report: dict) -> str:
    """A short label for a report: the model's short name (:func:`short_model_name`), or the synthetic control's
    description (``_label`` when ``llmprobe.report.render.label_apart`` had to tell two sources of one name apart,
    or named a control's model on a compare page)."""
    if report.get("_label"):
        return report["_label"]
    if report.get("kind") == "synthetic":
        return report.get("label") or "synthetic"
    return short_model_name(report.get("model", {}).get("name", "model"))


def short_model_name(name: str) -> str:
    """The last part of a local path (``/runs/models/llama`` -> ``llama``); a hub id (``org/model``) as it is."""
    name = str(name)
    if name.count("/") == 1 and "\\" not in name and not name.startswith((".", "/", "~")):
        return name
    return re.split(r"[\\/]", name.rstrip("/\\"))[-1] or name


STAGE_WORDS = {"matched": "matched controls"}     # a stage's name in a sentence, where its key is too short


def missing_stages(report: dict) -> list[str]:
    """One line per stage a partial report lacks (``partial`` true, or a stage in ``stages`` not done): what is
    missing and which numbers that leaves out; [] for a finished report. Expected stages: ``known_facts``,
    ``analyses`` when ``settings.run.analyses`` asks for any, ``matched`` in an enabled ``run``."""
    stages = report.get("stages") or {}
    if not report.get("partial") and all(stage.get("done") for stage in stages.values()):
        return []
    settings = settings_of(report)
    requested = settings.run.get("analyses") or []
    expected = ["known_facts"] + (["analyses"] if requested else []) + (
        ["matched"] if settings.command == "run" and settings.matched.get("enabled", True) else [])
    lines = []
    for name in expected + [n for n in stages if n not in expected]:
        stage = stages.get(name)
        if stage is not None and stage.get("done"):
            continue
        state = "not started" if stage is None else "not finished"
        lines.append(f"{STAGE_WORDS.get(name, name)} {state}: {_what_is_missing(report, name, requested)}")
    return lines or ["the report says partial: true, but records no unfinished stage"]


def _what_is_missing(report: dict, stage: str, requested: list[str]) -> str:
    """What an unfinished ``stage`` of ``report`` leaves out (one sentence)."""
    relations = list(report.get("relations") or {})
    wanted = list(DatasetInfo.from_dict(report.get("dataset")).relations or relations)
    if stage == "known_facts":
        return (f"{len(relations)} of {len(wanted)} relations checked; no analysis or matched control ran, so every "
                f"claim is not measured")
    if stage == "analyses":
        analyses = analyses_of(report)
        done = [r for r in relations if r in analyses.relations]
        parts = []
        if {"lre", "ridge"} & set(requested):
            parts.append(f"decoders done for {len(done)} of {len(relations)} relations"
                         + (f" (done: {', '.join(done)})" if done else ""))
        if "superposition" in requested:
            parts.append("superposition readouts " + ("done" if analyses.superposition else "missing"))
        return "; ".join(parts) + "; claims on the missing parts are not measured or rest on the relations done"
    if stage == "matched":
        return ("no matched synthetic models: the selector and capacity claims are not measured and the readouts "
                "have no matched control beside them")
    return "its numbers are missing"


def train_over_seeds(point: dict) -> dict | None:
    """A control point's training over its seeds (``point["seeds"]``): {"n", "n_fit" (seeds that reached 100%
    train accuracy), "accuracy_min", "accuracy_mean" (train accuracy at the end: a seed can fit and then lose
    some), "steps": [fewest, most]}; None for a point without per-seed rows."""
    seeds = [s for s in point.get("seeds") or [] if s.get("accuracy") is not None]
    if not seeds:
        return None
    accuracy, steps = [s["accuracy"] for s in seeds], [s["steps"] for s in seeds]
    return {"n": len(seeds), "n_fit": sum(s.get("fit_step") is not None for s in seeds),
            "accuracy_min": min(accuracy), "accuracy_mean": sum(accuracy) / len(accuracy),
            "steps": [min(steps), max(steps)]}


def source_seeds(point: dict) -> dict:
    """A curve point's values over seeds in the source layout: ``over_seeds`` ({"r2": its ``r2_final``, and its
    ``over_seeds``: readouts, keep rates}) and ``seeds`` (its per-seed rows); neither where the point has none."""
    over = ({"r2": point["r2_final"]} if point.get("r2_final") else {}) | (point.get("over_seeds") or {})
    return ({"over_seeds": over} if over else {}) | ({"seeds": point["seeds"]} if point.get("seeds") else {})


def matched_sources(block: dict | list | None, schema_version: int | None = None, name: str = "synthetic") -> list[dict]:
    """One synthetic source per trained point of a report's matched block, in the per-source layout the
    tables and figures read (``analyses.superposition.layers["0"]``, ``analyses.selector``, ``train``,
    ``threshold``), labelled ``name`` MODE d=D. A list (reports written before the block existed) is passed
    through."""
    if not block:
        return []
    if isinstance(block, list):
        return [dict(c, schema_version=schema_version) for c in block]
    out = []
    for mode, entry in (block.get("modes") or {}).items():
        threshold = entry.get("threshold") or {}
        for point in entry.get("points") or []:
            d = point["d"]
            label = f"{name} {mode} d={d}" + (" (d*)" if d == threshold.get("d_star") else "")
            out.append({
                "schema_version": schema_version, "kind": "synthetic", "label": label,
                "model": {"name": label, "architecture": "FactRecallModel (one layer)", "n_layers": 1,
                          "d_model": d, "d_mlp": point.get("d_mlp"), "frozen_subjects": mode == "frozen"},
                "matched_to": block.get("table"), "threshold": threshold,
                "train": {**(point.get("train") or {}), **({"over_seeds": over_seeds}
                                                           if (over_seeds := train_over_seeds(point)) else {})},
                "analyses": {"superposition": {"place": block.get("place"),
                                               "layers": {"0": {"r2": point.get("r2_final") or point.get("r2"),
                                                                "readout": point.get("readout") or {}}}},
                             "selector": point.get("selector") or {}},
                **source_seeds(point), "wall_seconds": point.get("wall_seconds")})
    return out


# --------------------------------------------------------------------------------------------- metric rows
ROW_FIELDS = ("source", "kind", "relation", "layer", "depth", "measure", "null", "value", "lo", "hi", "n")
ALL_RELATIONS = "(all)"          # the relation of the measures over every relation (R^2, swap edit)


def metric_rows(report: dict) -> list[dict]:
    """Every measured number of a report as tidy rows with the keys in ``ROW_FIELDS``: a *value row* per measure
    (``null`` None; ``value``, ``lo``, ``hi``, ``n`` the measure's) followed by a *null row* per null of it
    (``null`` its name; ``value``, ``lo``, ``hi``, ``n`` the null's own), the primary null first.

    Known-fact rates are value rows with measure ``known_rate`` and no layer; every typed metric of the analyses
    (pretrained, or a synthetic control's readouts in the same layout) is found by its place in the report:
    ``relations.R.layers.L.DECODER.MEASURE``, ``superposition.layers.L.r2``, ``superposition.layers.L.readout.R``
    and the swap edit's scales (relation ``(all)`` for the measures over every relation).
    """
    source, kind = source_name(report), report.get("kind", "pretrained")
    n_layers = max(report.get("model", {}).get("n_layers") or 1, 1)
    rows = []
    for name, rel in report.get("relations", {}).items():
        rows.append(_row(source, kind, name, None, None, "known_rate", None, rel.get("known_rate"), None, None,
                         rel.get("n_facts")))
    analyses = report.get("analyses") or {}
    for path, m in iter_metrics(analyses):
        place = _metric_place(path, analyses)
        if place is None:
            continue
        relation, layer, measure = place
        where = (source, kind, relation, layer, layer / (n_layers - 1) if n_layers > 1 else 0.0, measure)
        rows.append(_row(*where, None, m["value"], *(m.get("ci") or [None, None])[:2], m.get("n")))
        nulls = m.get("nulls") or {}
        for null in sorted(nulls, key=lambda name: name != m.get("primary_null")):       # the primary first
            c = nulls[null]
            rows.append(_row(*where, null, c.get("value"), *(c.get("ci") or [None, None])[:2],
                             c.get("n", m.get("n"))))
    return rows


def _metric_place(path: tuple, analyses: dict) -> tuple[str, int, str] | None:
    """(relation, layer, measure name) of the metric at ``path`` in a report's analyses; None for metrics that are
    not per-layer rows."""
    if len(path) == 6 and path[0] == "relations" and path[2] == "layers":             # decoders
        return path[1], int(path[3]), f"{path[4]}.{path[5]}"
    if len(path) >= 4 and path[:2] == ("superposition", "layers"):
        layer, rest = int(path[2]), path[3:]
        if rest == ("r2",):
            return ALL_RELATIONS, layer, "superposition.r2"
        if len(rest) == 2 and rest[0] == "readout":
            return rest[1], layer, "superposition.readout_accuracy"
        if len(rest) == 4 and rest[:2] == ("swap", "by_scale"):            # x1 = the fitted edit, then x4, x16
            scale = analyses["superposition"]["layers"][path[2]]["swap"]["by_scale"][int(rest[2])]["scale"]
            return ALL_RELATIONS, layer, f"superposition.swap_{rest[3]}" + ("" if scale == 1 else f"_x{scale:g}")
    return None


def _row(*values) -> dict:
    return dict(zip(ROW_FIELDS, values, strict=True))
