"""Every analysis of a pretrained model, in run order (layer 3): each module declares its record
(``llmprobe.analyses.record.Analysis``) once, and this list registers it. ``llmprobe.analyses.run`` takes the run
order and the parts of a run from it, ``llmprobe.jobs.workload`` and ``llmprobe.jobs.plan`` the work and the
stages; ``llmprobe.names.ANALYSES`` (the command line's vocabulary, read without torch) lists the same names,
which ``tests/test_analyses.py`` checks.
"""
from __future__ import annotations

from llmprobe.analyses.decoders import DECODERS
from llmprobe.analyses.multihop import MULTIHOP
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.selector import CROSSPATCH, SELECTOR
from llmprobe.analyses.superposition import SUPERPOSITION

REGISTRY: list[Analysis] = [DECODERS, SUPERPOSITION, CROSSPATCH, SELECTOR, MULTIHOP]   # run order


def register(analysis: Analysis) -> Analysis:
    """Add ``analysis`` at the end of the run order; ValueError if its name or a name that selects it is taken."""
    taken = {a.name for a in REGISTRY} | set(selectable())
    clash = ({analysis.name} | set(analysis.selects)) & taken
    if clash:
        raise ValueError(f"analysis {analysis.name!r}: {sorted(clash)} already registered")
    REGISTRY.append(analysis)
    return analysis


def selectable() -> tuple[str, ...]:
    """Every name ``--analyses`` can give, in run order."""
    return tuple(name for analysis in REGISTRY for name in analysis.selects)


def selected(analyses) -> list[Analysis]:
    """The registered analyses that ``analyses`` (names of :func:`selectable`) select, in run order; ValueError
    naming any name no analysis answers to."""
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in selectable()]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {list(selectable())}")
    return [a for a in REGISTRY if set(a.selects) & set(analyses)]


def by_name(name: str) -> Analysis:
    """The registered analysis called ``name`` (KeyError naming the registered ones)."""
    for analysis in REGISTRY:
        if analysis.name == name:
            return analysis
    raise KeyError(f"no analysis {name!r}; registered: {[a.name for a in REGISTRY]}")
