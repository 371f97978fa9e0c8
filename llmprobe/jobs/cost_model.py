"""The fitted, measured and assumed constants of the cost model (layer 5), read once from ``cost_model.toml``
beside this module, where each has its provenance: the machine it was measured on (or "assumed"), the date, the
benchmark or run it comes from and a note of what it is and how it was fitted.

``llmprobe.jobs.workload`` and ``llmprobe.jobs.plan`` take their constants (``FITTED``, ``H200``,
``REFERENCE_RATE``, ``SMOLLM2_KNOWN``, ...) by the file's table names from :func:`constant` and :func:`group`, in
TOML's types (tables are dicts, arrays lists, keys strings), and convert them to their own.
"""
from __future__ import annotations

from pathlib import Path

import tomllib

PATH = Path(__file__).with_name("cost_model.toml")
PROVENANCE = ("machine", "date", "source", "note")   # every constant's fields beside its value
DATA = tomllib.loads(PATH.read_text(encoding="utf-8"))


def entries(data: dict = DATA) -> dict[str, dict]:
    """Every constant of the file by its name (``REFERENCE_RATE``; in a group ``FITTED.load``): its table, value
    and provenance."""
    out = {}
    for name, table in data.items():
        if "value" in table:
            out[name] = table
        else:
            out.update({f"{name}.{key}": entry for key, entry in table.items()})
    return out


def constant(name: str):
    """The value of the constant ``name`` (a top-level table of the file)."""
    return DATA[name]["value"]


def group(name: str) -> dict:
    """The values of a group's constants by key, in the file's order (``FITTED``: stage -> [rate, b])."""
    return {key: entry["value"] for key, entry in DATA[name].items()}
