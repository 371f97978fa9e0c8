"""The parts every line's calibration shares (:mod:`llmprobe.jobs.calibration`): the graded fractions of a world's
replicates and its table row (:func:`graded_fractions`, :func:`world_row`), a test graded with its power
(:func:`grade_with_power`), and the benchmarks' SmolLM2 table, progress line and output (:func:`smollm2_table`,
:func:`progress`, :func:`finish`).
"""
from __future__ import annotations

import time

from llmprobe.analyses.settings import settings_from
from llmprobe.analyses.superposition import attribute_vectors, lexical_states, superposition_table
from llmprobe.datasets import load_relations
from llmprobe.io import write_json
from llmprobe.model.loading import load_model
from llmprobe.report.claims import ALPHA, POWER, power


def graded_fractions(grades: dict[str, list[str]], replicates: int) -> dict[str, float]:
    """Per test (``grades``: test -> its grade in each replicate): the fraction graded supported, the fraction
    supported or weak (power where the claim holds, false-positive rate where it fails) and the fraction
    "inconclusive (low power)"."""
    out = {}
    for key, graded in grades.items():
        out[f"{key}_supported"] = sum(g == "supported" for g in graded) / replicates
        out[f"{key}_supported_or_weak"] = sum(g in ("supported", "weak") for g in graded) / replicates
        out[f"{key}_low_power"] = sum(g == "inconclusive (low power)" for g in graded) / replicates
    return out

def world_row(world, sizes: dict, replicates: int, family: int, measured: list[dict[str, float]],
              grades: dict[str, list[str]]) -> dict:
    """One row of a calibration table: the world's name and whether the claim holds in it, its sample ``sizes``,
    the replicates and the Holm family graded in, each measure's mean over the replicates (``measured``: each
    replicate's {measure: value}; a measure a replicate lacks counts 0 there; rounded to 4 places) and
    :func:`graded_fractions` of ``grades``."""
    means: dict[str, float] = {}
    for values in measured:
        for key, value in values.items():
            means[key] = means.get(key, 0.0) + value / replicates
    return {"world": world.name, "claim_holds": world.holds, **sizes, "replicates": replicates, "family": family,
            **{k: round(v, 4) for k, v in means.items()}, **graded_fractions(grades, replicates)}


def grade_with_power(test: dict | None, family: int) -> str:
    """The verdict rule on one test with Bonferroni over ``family`` tests (Holm's strictest step, as
    :func:`grade`), its power there too (``llmprobe.report.claims.power``): supported / weak / inconclusive (low
    power) / not shown."""
    if test is None or test["missing_nulls"] or test["p"] is None:
        return "not shown"
    if min(1.0, family * test["p"]) < ALPHA:
        return "supported"
    if min(1.0, family * test["p_zero"]) < ALPHA:
        return "weak"
    low = power(test["difference"], test["min_effect"], ALPHA / family) < POWER
    return "inconclusive (low power)" if low else "not shown"


# ------------------------------------------------------------------------------------------------ benchmarks
def smollm2_table() -> tuple:
    """The shapes the superposition and decodable calibrations plant into: (the embedded SmolLM2 on the CPU, the
    default analysis settings, its superposition table of the bundled relations (every fact), the u vectors of
    the table's attributes [per relation: attributes x d], the subjects' static token embeddings E [n, d])."""
    lm = load_model(device="cpu")
    cfg = settings_from()
    table = superposition_table(lm.tokenizer, load_relations(None), {}, cfg)
    U, _ = attribute_vectors(lm, table.attributes, cfg.attribute_vectors)
    return lm, cfg, table, U, lexical_states(lm, table.subjects)


def progress(started: float, label=lambda row: row["world"]):
    """A benchmark's ``on_row``: prints "  <label(row)>: done (<seconds since started> s)" as each row finishes."""
    return lambda row: print(f"  {label(row)}: done ({time.perf_counter() - started:.0f} s)", flush=True)


def finish(rows, table: str, started: float, out: str | None):
    """The end of a calibration benchmark: its table and seconds printed, its ``rows`` written to ``out`` as JSON
    (atomically) when given; returns ``rows``."""
    if table:
        print(table)
    print(f"({time.perf_counter() - started:.0f} s)")
    if out:
        write_json(out, rows)
    return rows
