"""The scheduling of a run's parts (layer 5): :class:`Parts` shares the parts of one stage (the known facts of
each relation, the parts of ``run_analyses``) between this process and its helper processes
(``llmprobe.jobs.helpers``), under a gate on the cores the matched controls' workers hold
(``llmprobe.jobs.matched.CoreGate``); :class:`SharedRunner` is the ``llmprobe.analyses.run.Runner`` that
``llmprobe probe`` and ``llmprobe run`` give ``run_analyses``. Scheduling only: a part's numbers do not depend on
where it is computed.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass

from llmprobe.analyses.run import Runner


class Parts:
    """The parts of one stage (a ``run_analyses`` call; ``llmprobe.jobs.probe``'s known facts) shared between this
    process (:meth:`claim` from the front, at each part's turn) and its helpers (each helper's thread claims from
    the back, hands the part to its process and files the outcome). ``gate``: None, or what holds a part's cores
    while it is computed, here or in a helper (``llmprobe.jobs.matched.CoreGate``: the controls' workers first);
    a part this process waits for from a helper holds none. Thread-safe."""

    def __init__(self, parts: list, helpers=(), gate=None):
        self.order = list(parts)
        self.gate = gate
        self.claimed: set = set()
        self.outcomes: dict = {}          # part -> its outcome, of the parts the helpers computed
        self.handed: set = set()          # the parts of ``outcomes`` finished_elsewhere has handed over
        self.lost: set = set()            # parts a helper claimed and could not finish (it died)
        self.changed = threading.Condition()
        self.closed = False
        self.threads = [threading.Thread(target=self._feed, args=(helper,), daemon=True,
                                         name="llmprobe-analyses-helper") for helper in helpers]
        self.n_helpers = len(self.threads)
        for thread in self.threads:
            thread.start()

    def claim(self, part) -> bool:
        """This process takes ``part`` unless a helper has."""
        with self.changed:
            if part in self.claimed and part not in self.lost:
                return False
            self.claimed.add(part)
            return True

    def _claim_last(self):
        with self.changed:
            left = [p for p in self.order if p not in self.claimed]
            if self.closed or not left:
                return None
            self.claimed.add(left[-1])
            return left[-1]

    def _feed(self, helper) -> None:
        """A helper's thread: claim parts from the back and have the helper compute them, until none is left or
        the helper fails (its part is then this process's to compute)."""
        while (part := self._claim_last()) is not None:
            try:
                with self.slot():
                    outcome = helper.compute(part)
            except Exception:  # noqa: BLE001 - never leave a claimed part unanswered: this process computes it
                outcome = None
            with self.changed:
                if outcome is None:
                    self.lost.add(part)
                else:
                    self.outcomes[part] = outcome
                self.changed.notify_all()
            if outcome is None:
                return

    def outcome(self, part, compute, on_wait=None) -> tuple[dict, bool]:
        """(the outcome of ``part``, computed here): ``compute(part)`` here unless a helper claimed it, else the
        helper's outcome once it is back (here again if that helper died). ``on_wait``: called once if the part
        has to wait for a core before it is computed here."""
        outcome = self.wait(part) if not self.claim(part) else None
        if outcome is not None:
            return outcome, False
        with self.slot(on_wait):
            return compute(part), True

    def slot(self, on_wait=None):
        """The gate's hold on a part's cores (nothing without a gate); ``on_wait`` as the gate's."""
        return self.gate.slot(on_wait) if self.gate is not None else nullcontext()

    def wait(self, part):
        """The outcome of ``part``, which a helper claimed, once it is back; None if that helper died (the part is
        then this process's)."""
        with self.changed:
            self.changed.wait_for(lambda: part in self.outcomes or part in self.lost)
            return self.outcomes.get(part)

    def finished_elsewhere(self) -> list:
        """The helpers' outcomes not handed over yet: [(part, outcome)], each handed over once."""
        with self.changed:
            got = [(part, outcome) for part, outcome in self.outcomes.items() if part not in self.handed]
            self.handed.update(part for part, _ in got)
            return got

    def close(self) -> None:
        """No more parts are handed to helpers (a part in flight still comes back)."""
        with self.changed:
            self.closed = True


@dataclass
class SharedRunner(Runner):
    """``run_analyses``' parts shared with ``helpers`` (``llmprobe.jobs.helpers.AnalysisHelper``: this process
    takes them from the front, each helper from the back) under ``gate`` (None, or the matched controls'
    ``CoreGate``: a part starts only on a core their workers leave)."""

    helpers: tuple = ()
    gate: object = None
    parts: Parts | None = None

    @property
    def processes(self) -> int:
        return 1 + len(self.helpers)

    def start(self, parts: list) -> None:
        self.parts = Parts(parts, self.helpers, self.gate)

    def outcome(self, part, compute, on_wait=None) -> tuple[dict, bool]:
        return self.parts.outcome(part, compute, on_wait=on_wait)

    def finished_elsewhere(self) -> list:
        return self.parts.finished_elsewhere() if self.parts is not None else []

    def close(self) -> None:
        if self.parts is not None:
            self.parts.close()

    def timing(self) -> dict:
        """processes, helper_parts (the relations and analyses a helper computed, in run order) and, with a gate,
        core_wait_seconds (the seconds parts waited for a core, summed over the processes)."""
        parts = self.parts
        done = [name or kind for kind, name in parts.order if (kind, name) in parts.outcomes] if parts else []
        out = {"processes": self.processes, "helper_parts": done}
        if self.gate is not None:
            out["core_wait_seconds"] = round(self.gate.waited_s, 1)
        return out


__all__ = ["Parts", "SharedRunner"]
