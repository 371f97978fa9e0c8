"""The stage protocol of ``probe`` and ``run``, written once.

A report is computed in stages (``known_facts``, ``analyses``, ``matched``). Each has a record in
``report["stages"]``: ``{"key", "done", "resumed", ...}``, where the key (:func:`stage_key`) is a digest of
everything its numbers depend on (model hash, data, settings). With ``resume``, a stage whose key matches the
previous report's in the same folder (:func:`previous_report`, :func:`earlier_stage`) is taken over instead of
recomputed. Checkpoints (:func:`checkpoint`) rewrite report.json as stages finish; on an interrupt
(KeyboardInterrupt) :func:`mark_interrupted` says which stages are unfinished before the last checkpoint.

The folder is the run's own (:func:`claim_folder`): ``manifest.json`` names the weights a run measured and the
files it writes, so that no file of another run is left beside them (nor taken over by ``resume``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

from llmprobe.analyses.saved import DECODERS_JSON, weights_id
from llmprobe.checks import UsageError
from llmprobe.io import write_json
from llmprobe.report.schema import read_report

INTERRUPTED = "interrupted during"   # how the interrupt's entry in report["errors"] begins
MANIFEST = "manifest.json"           # what the run in a folder wrote, and for which weights
OUTPUTS = ("report.json", "known_facts.json", "decoders.json", "decoders.safetensors", "report.html", "report.md",
           "metrics.csv", "metrics.json")    # the files a probe or run (or an export of its report) writes


def stage_key(*parts) -> str:
    """sha256 of ``parts`` as JSON (sorted keys; other objects by their ``str``)."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def previous_report(out: str | Path | None) -> dict:
    """report.json already in ``out`` (for ``resume``), or {} when there is none; UsageError naming the file and
    what is wrong when it is not a report of the shape resuming reads (``llmprobe.report.schema.read_report``)."""
    if out is None or not (Path(out) / "report.json").is_file():
        return {}
    try:
        report = read_report(Path(out) / "report.json")
    except ValueError as error:
        raise UsageError(f"{error}; --resume takes the finished stages from it: remove it, or run without "
                         f"--resume") from None
    report.pop("_path", None)
    return report


def claim_folder(out: Path, command: str, info: dict, files: list[str], resume: bool, overwrite: bool) -> None:
    """Make ``out`` the folder of this run (``command`` of the model ``info``, which writes ``files``), then write
    its manifest.json. The files of an earlier run found there (those its manifest lists, and ``OUTPUTS``) are

    * another model's (the weights its manifest, report.json or decoders.json name differ, or none names any):
      refused (UsageError listing them) unless ``overwrite``, which removes them;
    * the same model's: removed unless ``resume`` takes their finished stages over, so that none is left beside
      this run's files (decoders of analyses not run again, an earlier export)."""
    manifest = _read_json(out / MANIFEST)
    listed = manifest.get("files") if isinstance(manifest.get("files"), list) else []
    found = sorted({name for name in [*OUTPUTS, *listed] if isinstance(name, str) and Path(name).name == name
                    and not name.startswith(".") and (out / name).is_file()})
    report, decoders = _read_json(out / "report.json"), _read_json(out / DECODERS_JSON)
    earlier = {weights for weights in (manifest.get("weights"),
                                       weights_id(report["model"]) if isinstance(report.get("model"), dict) else None,
                                       (decoders.get("model") or {}).get("weights")
                                       if isinstance(decoders.get("model"), dict) else None) if weights}
    weights = weights_id(info)
    if found and earlier != {weights} and not overwrite:
        raise UsageError(f"--out {out} holds the files of another run (weights "
                         f"{', '.join(sorted(map(str, earlier))) or 'not recorded'}; this model's are {weights}): "
                         f"{', '.join(found)}. Give another --out, or --overwrite (Python: overwrite=True) to clear "
                         f"them)"[:1000])
    if found and (earlier != {weights} or not resume):
        for name in found:
            (out / name).unlink()
    write_json(out / MANIFEST, {"format": 1, "command": command, "model": info.get("name"), "weights": weights,
                                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "files": sorted(set(files))})


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; {} when there is none or it cannot be read (a claim reads what it can)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


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


def unfinished(report: dict) -> list[str]:
    """The stages of ``report`` that are not done."""
    return [name for name, stage in report["stages"].items() if not stage["done"]]


def mark_interrupted(report: dict) -> None:
    """After an interrupt: ``partial`` true while a stage is unfinished, and one entry in ``errors`` naming the
    unfinished stages (replacing an earlier one)."""
    unfinished_stages = unfinished(report)
    report["partial"] = bool(unfinished_stages)
    report["errors"][:] = [e for e in report["errors"] if not e.startswith(INTERRUPTED)]
    if unfinished_stages:
        report["errors"].append(f"{INTERRUPTED} {', '.join(unfinished_stages)}: finished stages are kept in this "
                                f"report; rerun with --resume to finish the rest")


__all__ = ["stage_key", "previous_report", "claim_folder", "start_stage", "earlier_stage", "checkpoint",
           "unfinished", "mark_interrupted"]
