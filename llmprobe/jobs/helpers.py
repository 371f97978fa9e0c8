"""Analysis helpers: spawned processes that load the same model and compute parts of the run beside the main process,
on the same torch thread count: a relation's known facts (``llmprobe.model.known.KnownFactsJob``), then parts of
``run_analyses`` (a relation's decoders, the superposition analysis, a mechanism analysis), so that no core sits
idle while the known facts are checked and the cores the controls' workers free when they finish do not either.

A part's numbers do not depend on the process that computes it (each part's draws are seeded by the run's seed and
its own name; every process runs the same weights on the same number of threads), so a run with helpers writes
the numbers of a run without (tests/test_helpers.py compares them).
"""
from __future__ import annotations

import multiprocessing
import os
import random
import threading

import torch
from transformers.utils import logging as transformers_logging

from llmprobe.analyses.run import Analyses
from llmprobe.analyses.saved import weights_id
from llmprobe.analyses.settings import Log
from llmprobe.jobs.matched import worker_setup
from llmprobe.model.interop import as_loaded_model
from llmprobe.model.known import KnownFactsJob


class AnalysisHelper:
    """One helper process. ``load``: the keyword arguments of ``as_loaded_model`` (a model *name or folder*:
    the helper loads its own copy), ``seed``: the run's seed, ``threads``: its torch threads (the main process's
    analysis threads), ``identity``: the main process's model (``weights_id`` of its info), which the helper's
    copy must match.

    :meth:`work` says what the next parts are; :meth:`compute` hands it one part and blocks until its outcome
    (None when the helper died, failed to load or loaded other weights: the part is then the main process's).
    ``on_line``: called with each progress line."""

    def __init__(self, load: dict, seed: int, threads: int, identity: str, on_line=None):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe(duplex=True)
        self.identity, self.on_line, self.ready, self.failed = identity, on_line, False, None
        self.threads = threads
        self.lock = threading.Lock()
        self.next_work = None                       # (kind, arguments) sent before the next part: work()
        self.process = context.Process(target=_helper_main, args=(child, os.getpid(), load, seed, threads),
                                       daemon=True, name="llmprobe-analyses-helper")
        self.process.start()
        child.close()

    def work(self, kind: str, arguments: dict) -> None:
        """The parts that follow are ``kind``'s: "known" (``KnownFactsJob(lm, **arguments)``) or "analyses"
        (``Analyses(lm, **arguments)``)."""
        with self.lock:
            self.next_work = (kind, arguments)

    def _receive(self):
        """The next message that is not a progress line: (kind, value), or None when the pipe closed."""
        try:
            while True:
                kind, value = self.connection.recv()
                if kind != "line":
                    return kind, value
                if self.on_line is not None:
                    self.on_line(value)
        except (EOFError, OSError):
            return None

    def compute(self, part) -> dict | None:
        with self.lock:
            if self.failed:
                return None
            if not self.ready:
                message = self._receive()
                if message is None:
                    self._fail("it stopped before loading the model")
                elif message[0] == "failed":
                    self._fail(f"it could not load the model: {message[1]}")
                elif message[1] != self.identity:
                    self._fail(f"it loaded other weights ({message[1]}, not {self.identity})")
                if self.failed:
                    return None
                self.ready = True
            try:
                if self.next_work is not None:
                    self.connection.send(("work", self.next_work))
                    self.next_work = None
                self.connection.send(("part", part))
            except OSError:
                message = None
            else:
                message = self._receive()
            if message is None or message[0] != "done":
                self._fail(f"it died (exit code {self.process.exitcode})")
                return None
            return message[1]

    def _fail(self, why: str) -> None:
        """Stop the helper for good, saying why (unless it was stopped on purpose: ``stop``)."""
        told = self.failed == "stopped"
        self.failed = self.failed or why
        self.stop()
        if self.on_line is not None and not told:
            self.on_line(f"helper stopped: {why}; the main process computes its parts")

    def stop(self) -> None:
        """Kill the process (a part in flight is lost; the main process computes it)."""
        self.failed = self.failed or "stopped"
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


def _helper_main(connection, parent_pid: int, load: dict, seed: int, threads: int) -> None:
    """The helper process: set up, load the model, say ("ready", its weights id), then compute each part it is
    sent with the job of the last ("work", (kind, arguments)) and send ("done", outcome), progress lines as
    ("line", text) before."""
    worker_setup(parent_pid, threads)
    transformers_logging.disable_progress_bar()     # the main process's terminal shows no second load bar
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        lm = as_loaded_model(**load)
    except Exception as error:  # noqa: BLE001 - the main process computes every part itself
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", weights_id(lm.info)))
    job = None
    while True:
        try:
            kind, message = connection.recv()
        except (EOFError, OSError):
            return
        if kind == "work":
            work, arguments = message
            job = KnownFactsJob(lm, **arguments) if work == "known" else \
                Analyses(lm, log=Log(False, write=lambda text: connection.send(("line", text))), **arguments)
        else:
            connection.send(("done", job.compute(tuple(message))))


__all__ = ["AnalysisHelper"]
