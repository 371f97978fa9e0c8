"""The record each analysis of a pretrained model declares once, in its own module (layer 3): the ``--analyses``
names that select it, how it computes its entry of the report, how it counts its work for the plan, the plan's
stage it is priced in and the summary's claim lines its numbers feed. ``llmprobe.analyses.registry`` lists them in
run order; the run order, the parts of a run, the plan's stages and its workload are derived from that list
(docs/CONTRACTS.md, "How to add an analysis").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PRICED = ("passes", "decoders", "superposition")   # how the plan prices a workload (``Analysis.priced``)


@dataclass(frozen=True)
class Analysis:
    """One analysis.

    ``name``: its entry in the analyses result (``result[name]``; per relation: ``result["relations"][relation]``)
    and its part of a run (``(name, None)``, per relation ``(name, relation)``); ``selects``: the ``--analyses``
    names that run it (``llmprobe.names.ANALYSES`` holds every registered one's, for the command line's checks);
    ``compute(job)`` -> its entry, a JSON-ready dict (per relation: ``compute(job, relation, fits)``, ``fits``
    receiving the relation's fitted decoders), where ``job`` is ``llmprobe.analyses.run.Analyses`` (the model,
    relations, known facts, layers and settings of the run); ``workload(tok, relations, known, layers, n_layers,
    cfg, analyses)`` -> its passes counted with its own item builders (``llmprobe.analyses.passes``) on the facts
    ``known`` says are known; ``stage``: the plan's label of it; ``priced``: "passes" (priced by the analyses'
    pass fit, a stage of its own), or the dedicated pricing of "decoders" (Jacobians, fits, edits) or
    "superposition" (states, readouts, swap edits); ``claims``: the summary's claim lines its numbers feed
    (``llmprobe.report.claims.CLAIM_LINES``); ``result``: the typed form of its entry (``llmprobe.analyses.results``:
    ``from_dict`` / ``to_dict``), which the report layer reads; None: the report reads its metrics only (a table
    of them, ``llmprobe.report.render.other_analysis_rows``)."""

    name: str
    selects: tuple[str, ...]
    compute: Callable
    workload: Callable
    stage: str
    claims: tuple[str, ...] = ()
    per_relation: bool = False
    priced: str = "passes"
    result: type | None = None

    def __post_init__(self):
        if not self.name or not self.selects:
            raise ValueError(f"an analysis needs a name and the --analyses names that select it: {self!r}")
        if self.priced not in PRICED:
            raise ValueError(f"analysis {self.name!r}: priced {self.priced!r}; choose from {list(PRICED)}")
        if not callable(self.compute) or not callable(self.workload):
            raise ValueError(f"analysis {self.name!r}: compute and workload must be callables")
        if self.result is not None and not (hasattr(self.result, "from_dict") and hasattr(self.result, "to_dict")):
            raise ValueError(f"analysis {self.name!r}: its result type needs from_dict and to_dict")

    def __repr__(self) -> str:
        return f"Analysis({self.name!r}, selects={self.selects}, stage={self.stage!r})"
