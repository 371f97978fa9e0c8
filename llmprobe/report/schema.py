"""The report.json schema: its version and the one reader that checks a report before anything uses it."""
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
