"""The report.json schema: its version, the one reader that checks a report before anything uses it, a report's
name and its controls block expanded into sources in the per-source layout (what claims, figures and tables read)."""
from __future__ import annotations

import json
from pathlib import Path

REPORT_SCHEMA_VERSION = 2      # 2: typed metrics everywhere, test_subjects per relation, reference causality


def read_report(path: str | Path) -> dict:
    """Read ``DIR/report.json`` (or the JSON file itself) with a clear error when it is missing or malformed."""
    path = Path(path)
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no report.json at {path}")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{file}: not UTF-8 text ({error.reason} at byte {error.start})") from None
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
    for key, kinds in (("model", dict), ("relations", dict), ("analyses", dict), ("errors", list),
                       ("controls", (dict, list))):
        if report.get(key) is not None and not isinstance(report[key], kinds):
            raise ValueError(f"{file}: malformed report: {key!r} is a JSON {type(report[key]).__name__}, expected "
                             f"{'a list' if kinds is list else 'an object'}")
    report.setdefault("_path", str(file.parent))
    return report


def supported_schema_versions() -> tuple[int, ...]:
    """The report.json schema versions this llmprobe reads: the one it writes."""
    return (REPORT_SCHEMA_VERSION,)


def source_name(report: dict) -> str:
    """A short label for a report: the model name, or the synthetic control's description (``_label`` when
    ``llmprobe.report.render.compare`` had to tell two sources of one name apart)."""
    if report.get("_label"):
        return report["_label"]
    if report.get("kind") == "synthetic":
        return report.get("label") or "synthetic"
    return report.get("model", {}).get("name", "model")


def control_sources(block: dict | list | None, schema_version: int | None = None) -> list[dict]:
    """One synthetic source per trained control point of a report's controls block, in the per-source layout the
    tables and figures read (``analyses.superposition.layers["0"]``, ``analyses.selector``, ``train``,
    ``threshold``). A list (reports written before the block existed) is passed through."""
    if not block:
        return []
    if isinstance(block, list):
        return [dict(c, schema_version=schema_version) for c in block]
    out = []
    for mode, entry in (block.get("modes") or {}).items():
        threshold = entry.get("threshold") or {}
        for point in entry.get("points") or []:
            d = point["d"]
            label = f"synthetic {mode} d={d}" + (" (d*)" if d == threshold.get("d_star") else "")
            out.append({
                "schema_version": schema_version, "kind": "synthetic", "label": label,
                "model": {"name": label, "architecture": "FactRecallModel (one layer)", "n_layers": 1,
                          "d_model": d, "d_mlp": point.get("d_mlp"), "frozen_subjects": mode == "frozen"},
                "matched_to": block.get("table"), "threshold": threshold, "train": point.get("train") or {},
                "analyses": {"superposition": {"place": block.get("place"),
                                               "layers": {"0": {"r2": point.get("r2"),
                                                                "readout": point.get("readout") or {}}}},
                             "selector": point.get("selector") or {}},
                "wall_seconds": point.get("wall_seconds")})
    return out
