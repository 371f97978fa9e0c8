"""The stage protocol of ``probe`` and ``run``, written once.

A report is computed in stages (``known_facts``, ``analyses``, ``matched``). Each has a record in
``report["stages"]``: ``{"key", "done", "resumed", ...}``, where the key (:func:`json_digest`) is a digest of
everything its numbers depend on (model hash, data, settings). With ``resume``, a stage whose key matches the
previous report's in the same folder (:func:`previous_report`, :func:`earlier_stage`) is taken over instead of
recomputed. Checkpoints (:func:`checkpoint`) rewrite report.json as stages finish; on an interrupt
(KeyboardInterrupt) :func:`mark_interrupted` says which stages are unfinished before the last checkpoint.

The folder is the run's own (:func:`claim_folder`): ``manifest.json`` names the weights a run measured and the
files it writes, so that no file of another run is left beside them (nor taken over by ``resume``); a folder
holding another result is refused unless ``overwrite`` (replace it) or ``resume`` (continue it) is given, and a
file llmprobe does not write is never deleted.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from llmprobe.analyses.saved import DECODERS_JSON, weights_id
from llmprobe.checks import UsageError
from llmprobe.io import MANIFEST, OUTPUTS, json_digest, read_manifest, remove_outputs, write_json
from llmprobe.report.schema import read_report

INTERRUPTED = "interrupted during"   # how the interrupt's entry in report["errors"] begins


def digests(parts: dict) -> dict[str, str]:
    """Part name -> the digest (:func:`json_digest`) of its JSON content: recorded in a stage beside the file that
    holds the parts (``known_facts.json``), so that ``resume`` takes over only the parts that file still holds
    unchanged."""
    return {name: json_digest(value) for name, value in parts.items()}


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


def results_in(out: Path) -> list[str]:
    """The files of a result in ``out`` (any command's, finished or partial): the names of ``OUTPUTS`` there."""
    return sorted(name for name in OUTPUTS if (out / name).is_file())


def _manifest(out: Path) -> dict:
    """``out``'s manifest.json ({} when there is none); UsageError when llmprobe did not write it (it is never
    replaced)."""
    manifest = read_manifest(out)
    if manifest is None:
        raise UsageError(f"--out {out}: {out / MANIFEST} was not written by llmprobe (not a manifest of the files "
                         f"llmprobe wrote there), and llmprobe would replace it; give another --out")
    return manifest


def refusal(out: Path, found: list[str], manifest: dict, how: str, other: str | None = None) -> UsageError:
    """The error of a folder holding the result ``found`` that this command may not touch: it names the folder,
    what wrote it (``manifest``), the weights it measured, its files, and the ways on (``how``); ``other``: why
    --resume cannot go on."""
    weights = ", ".join(sorted(map(str, _earlier_weights(out, manifest)))) or "not recorded"
    wrote = ", ".join(filter(None, (" ".join(filter(None, (manifest.get("command"), f"of {manifest['model']}"
                                                            if manifest.get("model") else None))),
                                    f"weights {weights}")))
    return UsageError(f"--out {out} holds the files of another run ({wrote}{f'; {other}' if other else ''}): "
                      f"{', '.join(found)}. {how}"[:1500])


def _earlier_weights(out: Path, manifest: dict) -> set:
    """The weights the result in ``out`` measured, as its manifest, report.json and decoders.json name them."""
    report, decoders = _read_json(out / "report.json"), _read_json(out / DECODERS_JSON)
    return {weights for weights in (manifest.get("weights"),
                                    weights_id(report["model"]) if isinstance(report.get("model"), dict) else None,
                                    (decoders.get("model") or {}).get("weights")
                                    if isinstance(decoders.get("model"), dict) else None) if weights}


WAYS_ON = ("--overwrite replaces them, --resume continues that run (the same model's); or give another --out "
           "(Python: overwrite=True, resume=True)")


def check_folder(out: str | Path, resume: bool, overwrite: bool, how: str = WAYS_ON) -> None:
    """Before a probe or run loads its model: refuse (UsageError, the ways on ``how``) an ``out`` holding another
    result (any command's, finished or partial) unless ``resume`` or ``overwrite``, and one whose manifest.json
    llmprobe did not write. :func:`claim_folder` checks the weights once the model is loaded."""
    out = Path(out)
    manifest = _manifest(out)
    found = results_in(out)
    if found and not (resume or overwrite):
        raise refusal(out, found, manifest, how)


def claim_folder(out: Path, command: str, info: dict, files: list[str], resume: bool, overwrite: bool) -> None:
    """Make ``out`` the folder of this run (``command`` of the model ``info``, which writes ``files``), then write
    its manifest.json. A result already there (the files of ``OUTPUTS`` found: any command's, any model's,
    finished or partial) is refused (UsageError naming the folder and the ways on) unless

    * ``resume``, for the same model (the weights its manifest, report.json or decoders.json name are this
      model's): its files are kept, and its finished stages taken over where their keys match;
    * ``overwrite``: the earlier run's files are removed, and only those its manifest.json names *and* that
      llmprobe writes (``OUTPUTS``): a file llmprobe did not write is never deleted, whatever a manifest lists.

    A manifest.json that llmprobe did not write is refused and never replaced."""
    manifest = _manifest(out)
    listed = {name for name in manifest.get("files", []) if name in OUTPUTS}
    found = results_in(out)
    weights = weights_id(info)
    same = _earlier_weights(out, manifest) == {weights}
    if found and not overwrite:
        if not resume:
            raise refusal(out, found, manifest, WAYS_ON)
        if not same:
            raise refusal(out, found, manifest, "--overwrite (Python: overwrite=True) replaces them, or give "
                          "another --out", f"this model's are {weights}: --resume continues only a run of the "
                          f"same model")
    kept = set()
    if found and resume and same:
        kept = listed
    else:
        remove_outputs(out, manifest)
    write_json(out / MANIFEST, {"format": 1, "command": command, "model": info.get("name"), "weights": weights,
                                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "files": sorted(set(files) | {name for name in kept if (out / name).is_file()})})


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


__all__ = ["OUTPUTS", "json_digest", "digests", "previous_report", "results_in", "check_folder", "claim_folder", "refusal", "start_stage", "earlier_stage", "checkpoint",
           "unfinished", "mark_interrupted"]
