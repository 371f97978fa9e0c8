"""``llmprobe rerun``: repeat a report's probe or run with its recorded settings and compare every number."""
from __future__ import annotations

import re
from pathlib import Path

from llmprobe.checks import UsageError, output_folder, read_json
from llmprobe.io import folder_lock
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import load_options, probe
from llmprobe.jobs.stages import check_folder
from llmprobe.model.loading import load_model
from llmprobe.report.schema import upgrade
from llmprobe.settings import from_record

TIME_KEY = re.compile(r"second|time|_s$")     # keys of wall-clock times, which a rerun does not reproduce


def numbers(report: dict) -> dict:
    """Every number a rerun should reproduce: {dotted path: value} of the int and float leaves of the report's
    ``relations``, ``analyses`` and ``matched`` (times left out; NaN written as null kept as None)."""
    found = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            for key, v in value.items():
                if not TIME_KEY.search(str(key)):
                    walk(v, f"{path}.{key}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            found[path] = value

    for block in ("relations", "analyses", "matched"):
        if block in report:
            walk(report[block], block)
    return found


def compare_numbers(old: dict, new: dict, tolerance: float = 1e-6) -> dict:
    """{"n_numbers", "max_abs_difference", "differences": [(path, old, new)], "match"} of two reports: every
    number of :func:`numbers`; a number differs when it is missing from one report, null in only one, or off by
    more than ``tolerance`` (absolute, or relative to its size)."""
    a, b = numbers(old), numbers(new)
    differences, largest = [], 0.0
    for path in sorted(set(a) | set(b)):
        x, y = a.get(path, "missing"), b.get(path, "missing")
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            gap = abs(x - y)
            largest = max(largest, gap)
            if gap <= tolerance * max(1.0, abs(x)):
                continue
        elif x == y:
            continue
        differences.append((path, x, y))
    return {"n_numbers": len(set(a) | set(b)), "max_abs_difference": largest, "differences": differences,
            "match": not differences}


def rerun(folder: str | Path, out: str | Path | None = None, allow_different_weights: bool = False,
          trust_remote_code: bool = False, allow_pickle: bool = False) -> dict:
    """Repeat the ``probe`` or ``run`` that wrote ``folder/report.json`` with its recorded settings into ``out``
    (default: ``<folder>-rerun``), and compare the numbers. ``out`` is locked while the rerun writes it (a second
    rerun into it raises UsageError) and must not hold another result (UsageError naming its files). The model is
    loaded first; a weights hash that differs from the recorded one raises UsageError unless
    ``allow_different_weights``. A recorded ``offload_folder``
    becomes ``out/offload`` (a report's path could point anywhere). Returns {"command", "out", "weights": "same" |
    "different" | "not recorded", "offload_folder" (None without offloading), "report", "comparison"
    (:func:`compare_numbers`)}."""
    folder = Path(folder)
    try:
        old = read_json(folder / "report.json", too_deep=" (not a report llmprobe wrote)")
    except OSError as error:
        raise UsageError(f"rerun: cannot read {folder / 'report.json'} ({error.strerror or error})") from None
    except UsageError as error:
        raise UsageError(f"rerun: {error}") from None
    if not isinstance(old, dict):
        raise UsageError(f"rerun: {folder / 'report.json'} is not a report (a JSON object)")
    old = upgrade(old)                              # a version-2 report in today's words
    command, settings = from_record(old.get("settings"), f"{folder / 'report.json'} settings")
    out = Path(out) if out is not None else folder.parent / f"{folder.resolve().name}-rerun"
    if out.resolve() == folder.resolve():
        raise UsageError(f"rerun: --out {str(out)!r} is the report's own folder; give another one")
    output_folder(out)
    with folder_lock(out):          # a second rerun into the same folder is refused while this one writes there
        check_folder(out, resume=False, overwrite=False, how="A rerun never replaces a result: remove them, or give "
                     "another --out")
        if settings.run.offload_folder is not None:     # the recorded path may be anywhere: offload inside out
            settings.run.offload_folder = str(out.resolve() / "offload")
        lm = load_model(settings.run.model, **load_options(settings.run), trust_remote_code=trust_remote_code,
                        allow_pickle=allow_pickle)
        recorded, loaded = (old.get("model") or {}).get("weights_hash"), lm.info.get("weights_hash")
        weights = "not recorded" if recorded is None else "same" if recorded == loaded else "different"
        if weights == "different" and not allow_different_weights:
            raise UsageError(f"rerun: the weights of {settings.run.model or lm.info['name']!r} differ from the "
                             f"report's ({loaded} now, {recorded} recorded); pass --allow-different-weights to "
                             f"rerun anyway")
        report = (probe if command == "probe" else run)(settings=settings, out=out, lm=lm)
    return {"command": command, "out": str(out), "weights": weights, "offload_folder": settings.run.offload_folder,
            "report": report,
            "comparison": compare_numbers(old, read_json(out / "report.json"))}

__all__ = ["rerun", "compare_numbers", "numbers"]
