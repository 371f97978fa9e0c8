"""The stage protocol of ``probe`` and ``run``, written once.

A report is computed in stages (``known_facts``, ``analyses``, ``controls``). Each has a record in
``report["stages"]``: ``{"key", "done", "resumed", ...}``, where the key (:func:`stage_key`) is a digest of
everything its numbers depend on (model hash, data, settings). With ``resume``, a stage whose key matches the
previous report's in the same folder (:func:`previous_report`, :func:`earlier_stage`) is taken over instead of
recomputed. Checkpoints (:func:`checkpoint`) rewrite report.json as stages finish; on an interrupt
(KeyboardInterrupt) :func:`mark_interrupted` says which stages are unfinished before the last checkpoint.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llmprobe.io import write_json

INTERRUPTED = "interrupted during"   # how the interrupt's entry in report["errors"] begins


def stage_key(*parts) -> str:
    """sha256 of ``parts`` as JSON (sorted keys; other objects by their ``str``)."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def previous_report(out: str | Path | None) -> dict:
    """report.json already in ``out`` (for ``resume``), or {} when there is none or it cannot be read."""
    if out is None:
        return {}
    try:
        report = json.loads((Path(out) / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def start_stage(report: dict, name: str, key: str, **extra) -> dict:
    """A new unfinished stage ``name`` in ``report["stages"]`` (with ``extra`` fields); returns its record."""
    stage = report["stages"][name] = {"key": key, "done": False, "resumed": False, **extra}
    return stage


def earlier_stage(previous: dict, name: str, key: str) -> dict | None:
    """The previous report's record of stage ``name`` when it has the same ``key`` (its work can be taken over),
    else None."""
    stage = (previous.get("stages") or {}).get(name) or {}
    return stage if stage.get("key") == key else None


def checkpoint(out: Path | None, report: dict, files: dict | None = None) -> None:
    """Write ``files`` ({name: JSON value}) and then report.json into ``out`` (nothing when ``out`` is None)."""
    if out is None:
        return
    for name, value in (files or {}).items():
        write_json(out / name, value)
    write_json(out / "report.json", report)


def mark_interrupted(report: dict) -> None:
    """After an interrupt: ``partial`` true while a stage is unfinished, and one entry in ``errors`` naming the
    unfinished stages (replacing an earlier one)."""
    unfinished = [name for name, stage in report["stages"].items() if not stage["done"]]
    report["partial"] = bool(unfinished)
    report["errors"][:] = [e for e in report["errors"] if not e.startswith(INTERRUPTED)]
    if unfinished:
        report["errors"].append(f"{INTERRUPTED} {', '.join(unfinished)}: finished stages are kept in this report; "
                                f"rerun with --resume to finish the rest")


__all__ = ["stage_key", "previous_report", "start_stage", "earlier_stage", "checkpoint", "mark_interrupted"]
