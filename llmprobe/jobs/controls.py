"""The matched controls' worker: ``synthetic.controls.train_controls`` in a spawned process (one torch thread)
while the main job runs the analyses."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch

from synthetic.controls import train_controls


class ControlsWorker:
    """``train_controls(*args, **kwargs)`` in one spawned process (one torch thread) whose result comes back
    through a pipe. A plain process, not a Pool: ``stop`` kills it outright, so an interrupt can never wait on a
    pool's internal locks, and the worker exits by itself when this process dies."""

    def __init__(self, args: tuple, kwargs: dict):
        context = multiprocessing.get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        self.process = context.Process(target=_worker_main, args=(send, os.getpid(), args, kwargs), daemon=True,
                                       name="llmprobe-controls")
        self.process.start()
        send.close()

    def ready(self) -> bool:
        """Has the worker sent its result (or its failure)?"""
        return self._receive.poll()

    def get(self) -> tuple[dict, float]:
        """Wait for (controls, seconds); RuntimeError naming the cause when the worker failed or died."""
        try:
            ok, value = self._receive.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the controls worker died (exit code {self.process.exitcode})") from None
        self.process.join(5)
        if not ok:
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._receive.close()


def _worker_main(send, parent_pid: int, args: tuple, kwargs: dict) -> None:
    """The worker process: set up, train and measure the controls, send (True, (controls, seconds)) or
    (False, "Type: message")."""
    _one_thread(parent_pid)
    start = time.perf_counter()
    try:
        result = (True, (train_controls(*args, **kwargs), round(time.perf_counter() - start, 1)))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which records it in the report's errors
        result = (False, f"{type(error).__name__}: {error}")
    send.send(result)
    send.close()


def _one_thread(parent_pid: int | None = None) -> None:
    """Worker set-up: one torch thread; Ctrl-C is left to the parent (which stops the worker); and the worker
    exits on its own when the parent is gone (kill -9 of the parent leaves no orphan training on)."""
    torch.set_num_threads(1)
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


__all__ = ["ControlsWorker"]
