"""The matched controls' worker: ``synthetic.matched.train_matched`` in a spawned process (one torch thread)
while the main job runs the analyses."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch
from tqdm import tqdm

from llmprobe.io import reuse_freed_memory
from synthetic.matched import train_matched


class WorkerInterrupted(RuntimeError):
    """A worker stopped by SIGTERM (or SIGINT sent to it alone): not a failure; its finished units are on disk."""


INTERRUPTS = (signal.SIGTERM, signal.SIGINT)     # a worker ended by one of these was interrupted, not failed


class MatchedWorker:
    """``train_matched(*args, **kwargs)`` in one spawned process (one torch thread) whose result comes back
    through a pipe. A plain process, not a Pool: ``stop`` kills it outright, so an interrupt can never wait on a
    pool's internal locks, and the worker exits by itself when this process dies.

    ``on_progress``: called in this process, from a reader thread, with each progress line the worker's
    ``train_matched`` reports (so the lines can be written above this process's progress bars, not through
    them); None leaves ``kwargs["progress"]`` to run in the worker. ``on_done``: called with this worker, from
    the reader thread, once its result came or it died.

    SIGTERM stops the worker as an interrupt, not a failure (``timeout`` and service managers send it to a whole
    process group): it sends "interrupted" and exits; ``interrupted`` then names the signal and ``get`` raises
    :class:`WorkerInterrupted`. A worker killed by SIGTERM before it could say so counts the same."""

    def __init__(self, args: tuple, kwargs: dict, on_progress: Callable[[str], None] | None = None,
                 on_done: Callable[[MatchedWorker], None] | None = None):
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        self._result: tuple | None = None        # (ok, value) once the worker has sent it
        self.interrupted: str | None = None      # the signal that interrupted the worker ("SIGTERM"), if one did
        self._done = threading.Event()           # set when the result came or the pipe closed
        self.process = context.Process(target=_worker_main, args=(send, os.getpid(), args, kwargs,
                                                                  on_progress is not None),
                                       daemon=True, name="llmprobe-controls")
        self.process.start()
        send.close()
        self._reader = threading.Thread(target=self._read, args=(receive, on_progress, on_done), daemon=True,
                                        name="llmprobe-controls-reader")
        self._reader.start()

    def _read(self, receive, on_progress, on_done) -> None:
        """Relay the worker's progress lines until its result arrives or the pipe closes (the worker died)."""
        try:
            while True:
                kind, value = receive.recv()
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(value)
                    continue
                if kind == "interrupted":
                    self.interrupted = value
                else:
                    self._result = value
                break
        except (EOFError, OSError):
            pass
        finally:
            receive.close()
            if self._result is None and self.interrupted is None:      # it died: by an interrupt's signal?
                self.process.join(5)
                code = self.process.exitcode
                if code is not None and -code in INTERRUPTS:
                    self.interrupted = signal.Signals(-code).name
            self._done.set()
            if on_done is not None:
                on_done(self)

    def ready(self) -> bool:
        """Has the worker sent its result (or its failure), or died?"""
        return self._done.is_set()

    def failed(self) -> bool:
        """Has the worker sent a failure, or died (been stopped), other than by an interrupt?"""
        return self._done.is_set() and self.interrupted is None and (self._result is None or not self._result[0])

    def get(self) -> tuple[dict, float]:
        """Wait for (controls, seconds); WorkerInterrupted when an interrupt stopped the worker, RuntimeError naming
        the cause when it failed or died."""
        self._done.wait()
        self.process.join(5)
        if self.interrupted is not None:
            raise WorkerInterrupted(f"interrupted by {self.interrupted}")
        if self._result is None:
            raise RuntimeError(f"the controls worker died (exit code {self.process.exitcode})")
        ok, value = self._result
        if not ok:
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._done.wait(5)


def _worker_main(send, parent_pid: int, args: tuple, kwargs: dict, relay_progress: bool = False) -> None:
    """The worker process: set up, train and measure the controls, send ("result", (True, (controls, seconds)))
    or ("result", (False, "Type: message")), or ("interrupted", "SIGTERM") when SIGTERM stopped it (the units
    ``train_matched`` finished are on disk); with ``relay_progress`` every progress line first, as ("progress",
    line). SIGTERM is held while a message is sent, so that it never cuts one in half."""
    worker_setup(parent_pid)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if relay_progress:
        kwargs = {**kwargs, "progress": lambda message: _send(send, ("progress", message))}
    start = time.perf_counter()
    try:
        controls = train_matched(*args, **kwargs)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)           # trained: a SIGTERM now cuts nothing
        message = ("result", (True, (controls, round(time.perf_counter() - start, 1))))
    except KeyboardInterrupt as stop:                           # SIGTERM (its handler ignores a second one)
        message = ("interrupted", str(stop.args[0]) if stop.args else "SIGTERM")
    except Exception as error:  # noqa: BLE001 - reported to the parent, which records it in the report's errors
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        message = ("result", (False, f"{type(error).__name__}: {error}"))
    send.send(message)
    send.close()


def _raise_interrupt(signum, frame):
    """The worker's SIGTERM handler: one interrupt (a second SIGTERM is ignored while the first one stops it)."""
    signal.signal(signum, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _send(connection, message) -> None:
    """Send ``message`` whole: a SIGTERM that comes meanwhile is held, and raised once it is written (where the
    system can hold a signal: ``pthread_sigmask``)."""
    hold = getattr(signal, "pthread_sigmask", None)
    held = hold(signal.SIG_BLOCK, {signal.SIGTERM}) if hold else None
    try:
        connection.send(message)
    finally:
        if hold:
            hold(signal.SIG_SETMASK, held)


def worker_setup(parent_pid: int | None = None, threads: int = 1) -> None:
    """Worker set-up: ``threads`` torch threads; Ctrl-C is left to the parent (which stops the worker); the
    worker exits on its own when the parent is gone (kill -9 of the parent leaves no orphan work on); and its
    progress bars lock with a thread lock: tqdm's default lock is a multiprocessing semaphore, which a spawned
    process registers with the parent's resource tracker and, killed, never unregisters (the parent then warned
    of a leaked semaphore at its exit)."""
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(threads)
    reuse_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                         name="llmprobe-parent-watch").start()


def _exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Block until the parent process is gone (its sentinel pipe closes, or our parent pid changes), then exit."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    while os.getppid() == parent_pid:
        if sentinel is not None:
            try:
                if wait([sentinel], timeout=poll_s):
                    break
                continue
            except OSError:
                sentinel = None
        time.sleep(poll_s)
    os._exit(1)


class CoreGate:
    """The CPU's cores shared by the controls' workers (one thread each) and the analyses' parts (``threads``
    each): a part starts only when the cores the alive workers leave hold its threads beside the parts already
    running (at least one part once every worker is done), so the workers train first, never crowded, and each
    core a finished worker frees goes to the analyses. A part that started runs to its end (the capacity only
    grows). ``patience_s``: a part that has waited this long goes in when no other part is running, workers or
    not (``llmprobe run``: the plan's seconds of the longer controls mode, x 1.25), so that on a busy machine, where
    the controls take far longer than planned, the analyses still make progress, one part at a time (where each
    part runs never changes its numbers). ``waited_s``: the seconds parts waited for a core, summed over the
    processes; ``overdue``: the parts that went in on patience. Thread-safe."""

    POLL_S = 0.5        # how often a waiting part looks at the workers again

    def __init__(self, cores: int, threads: int, workers: list, patience_s: float = float("inf")):
        self.cores, self.threads, self.workers, self.patience_s = cores, threads, workers, patience_s
        self.running = 0
        self.waited_s = 0.0
        self.overdue = 0
        self.changed = threading.Condition()

    def capacity(self) -> int:
        """The parts that may run now: the cores the alive workers leave, over each part's threads."""
        alive = sum(not worker.ready() for worker in self.workers)
        return max((self.cores - alive) // self.threads, 0 if alive else 1)

    @contextmanager
    def slot(self, on_wait: Callable[[], None] | None = None):
        """Hold one part's cores while the block runs; waits (polling the workers) until there is room, calling
        ``on_wait`` once first when it has to wait (outside the gate's lock: it may redraw a progress bar)."""
        t = time.perf_counter()
        with self.changed:
            full = self.running >= self.capacity()
        if full and on_wait is not None:
            on_wait()
        with self.changed:
            while self.running >= self.capacity():
                if self.running == 0 and time.perf_counter() - t >= self.patience_s:
                    self.overdue += 1
                    break
                self.changed.wait(self.POLL_S)
            self.running += 1
            self.waited_s += time.perf_counter() - t
        try:
            yield
        finally:
            with self.changed:
                self.running -= 1
                self.changed.notify_all()


__all__ = ["CoreGate", "MatchedWorker", "WorkerInterrupted", "worker_setup"]
