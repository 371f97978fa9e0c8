"""What llmprobe shows on stderr while it works: progress bars and message lines (layer 0).

One switch for the process, read by every bar and every line where it is made: :func:`showing` (``llmprobe.probe``
and ``llmprobe.run`` hold it for their call with their ``progress=`` and ``verbose=``; outside it, the defaults).

* bars (:func:`bar`: a tqdm bar on stderr): drawn while ``progress`` is on; by default only when stderr is a
  terminal, so a log file, a pipe or a notebook's captured stderr gets no bar;
* lines (:func:`say`): records of the ``logging`` logger ``"llmprobe"`` (level INFO), which this module's handler
  writes on stderr above any bar (``tqdm.write``) while ``verbose`` is on (the default). The logger does not
  propagate to the root logger (transformers' does not either): add a handler of your own to
  ``logging.getLogger("llmprobe")`` to keep the lines elsewhere, and pass ``verbose=False`` to keep them off stderr.

A module setting rather than a context variable: the lines of the matched controls' workers are written from a
reader thread, which a context variable set in the calling thread would not reach.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

from llmprobe.checks import UsageError

LOGGER = logging.getLogger("llmprobe")
_SWITCH = {"progress": None, "verbose": True}     # progress None: bars when stderr is a terminal


def stderr_is_terminal() -> bool:
    """Is stderr a terminal (False for a closed or replaced stream without ``isatty``)?"""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


def bars_shown() -> bool:
    """Are progress bars drawn now: the switch's ``progress``, or (not set) whether stderr is a terminal."""
    progress = _SWITCH["progress"]
    return stderr_is_terminal() if progress is None else progress


def bar(iterable=None, *, enabled: bool = True, **options) -> tqdm:
    """A tqdm bar on stderr over ``iterable`` (``options``: tqdm's, e.g. ``total``, ``desc``, ``unit``), drawn only
    when ``enabled`` and :func:`bars_shown`; a bar not drawn still counts and iterates."""
    return tqdm(iterable, file=sys.stderr, disable=not (enabled and bars_shown()), **options)


class _StderrLines(logging.Handler):
    """Writes each record's message on stderr above any bar of this process while the switch's ``verbose`` is on."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _SWITCH["verbose"]:
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's rule: a handler that fails reports it and goes on
            self.handleError(record)


if not any(isinstance(handler, _StderrLines) for handler in LOGGER.handlers):
    LOGGER.addHandler(_StderrLines())
if LOGGER.level == logging.NOTSET:                 # a level the user set before stays
    LOGGER.setLevel(logging.INFO)
LOGGER.propagate = False


def say(message: str, prefix: str = "llmprobe:") -> None:
    """One message line, ``"{prefix} {message}"``, to the ``"llmprobe"`` logger (stderr while verbose)."""
    LOGGER.info("%s %s", prefix, message)


def _flag(name: str, value) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise UsageError(f"{name} must be True, False or None (the default), got {value!r}")
    return value


@contextmanager
def showing(progress: bool | None = None, verbose: bool | None = None) -> Iterator[None]:
    """Within the block: progress bars drawn (``progress`` True) or not (False), message lines on stderr
    (``verbose`` True) or not (False); None leaves each as it is (at first: bars when stderr is a terminal, lines
    on). The previous switch comes back at the end. UsageError for a value that is not a bool or None."""
    changes = {key: value for key, value in (("progress", _flag("progress", progress)),
                                             ("verbose", _flag("verbose", verbose))) if value is not None}
    before = dict(_SWITCH)
    _SWITCH.update(changes)
    try:
        yield
    finally:
        _SWITCH.clear()
        _SWITCH.update(before)


__all__ = ["LOGGER", "bar", "bars_shown", "say", "showing", "stderr_is_terminal"]
