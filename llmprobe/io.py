"""Atomic file writes: results are written to a temp file beside the target, then renamed over it. And the
process's allocator setting (:func:`reuse_freed_memory`)."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import glob
import hashlib
import io
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

from llmprobe.checks import UsageError, parse_json

try:
    import fcntl
except ImportError:  # Windows: appends are not locked
    fcntl = None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory(mmap_below: int = 256 << 20, trim_above: int = 1 << 30) -> bool:
    """Ask glibc's malloc to serve blocks under ``mmap_below`` bytes from its heap and to return freed memory at
    the heap's top to the OS only beyond ``trim_above`` bytes. By default every block over 32 MB is a fresh mmap
    and freed memory goes back at once, so the next tensor of the same size faults its pages in again: a
    SmolLM2 run took 102 million minor page faults and 235 s of system time (8% of its CPU). The numbers do not
    change (the allocator only decides where a tensor lives). Returns False where there is no glibc
    (macOS, Windows, musl): nothing is changed there."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_below)) and bool(mallopt(M_TRIM_THRESHOLD, trim_above))


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one, never half). An OSError
    (a full disk: ENOSPC) names ``path``, not the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; results should read like any other file
        os.replace(tmp, path)
    except BaseException as error:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.filename in (None, tmp):    # a full disk: name the target
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise
    _remove_stale_tmp(path)
    return path


STALE_TMP_S = 600.0


def _remove_stale_tmp(path: Path) -> None:
    """Remove temp files of earlier writes of ``path`` that a killed process left behind (older than
    ``STALE_TMP_S``, so that another process still writing the same target keeps its own)."""
    cutoff = time.time() - STALE_TMP_S
    for tmp in glob.glob(os.path.join(glob.escape(str(path.parent)), f".{glob.escape(path.name)}.*.tmp")):
        try:
            if os.stat(tmp).st_mtime < cutoff:
                os.unlink(tmp)
        except OSError:  # removed by someone else meanwhile, or not ours to remove
            pass


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


# the bidirectional controls that reorder what a reader sees (a right-to-left override makes "cap<RLO>txt.exe" read
# "capexe.txt"), as their escapes: JSON files write them so (the same strings read back), and the report's md, html
# and csv too (llmprobe.report.render.HIDDEN)
BIDI_ESCAPES = {code: f"\\u{code:04x}" for code in (0x061c, 0x200e, 0x200f, *range(0x202a, 0x202f),
                                                    *range(0x2066, 0x206a))}


def json_digest(*parts) -> str:
    """"sha256:..." of ``parts`` as JSON (sorted keys; other objects by their ``str``): the key of a checkpointed
    stage or unit, equal whenever everything that sets its numbers is."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def write_json(path: str | Path, obj) -> Path:
    """JSON with sorted-free, indented output; NaN/inf become null so the file stays valid JSON; bidirectional
    controls in strings written as escapes (``BIDI_ESCAPES``: the same strings read back)."""
    return write_text(path, json.dumps(_finite(obj), indent=2, ensure_ascii=False).translate(BIDI_ESCAPES) + "\n")


def _finite(obj):
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """(figure, axes) like ``pyplot.subplots``, built without pyplot: the one plotting set-up of llmprobe and
    synthetic. No backend is chosen or switched (a notebook's stays as it is) and nothing is left open in pyplot's
    figure manager; ``kwargs`` go to ``Figure`` (figsize, ...) except ``squeeze``, ``sharex``, ``sharey``,
    ``width_ratios``, ``height_ratios``, ``gridspec_kw`` and ``subplot_kw``, which go to ``Figure.subplots``."""
    from matplotlib.figure import Figure  # matplotlib only where something is drawn (start-up time)

    layout = {k: kwargs.pop(k) for k in ("squeeze", "sharex", "sharey", "width_ratios", "height_ratios",
                                          "gridspec_kw", "subplot_kw") if k in kwargs}
    figure = Figure(**kwargs)
    return figure, figure.subplots(nrows, ncols, **layout)


def figure_png(figure, dpi: int = 110) -> bytes:
    """A matplotlib figure as PNG bytes (tight bounding box)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def write_figure(path: str | Path, figure, dpi: int = 110) -> Path:
    """Save a matplotlib figure as a PNG atomically."""
    return write_bytes(path, figure_png(figure, dpi))


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line and flush it to disk (for results that accumulate as runs finish); an exclusive
    lock keeps lines whole when several worker processes append to the same file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(_finite(record), ensure_ascii=False).translate(BIDI_ESCAPES) + "\n").encode("utf-8")
    with open(path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0, os.SEEK_END)
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":   # a torn last line (killed writer): end it, so this record stays whole
                line = b"\n" + line
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSON-lines file; a line that does not parse (torn by an interrupted write) is skipped with a
    warning that names it."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(parse_json(line, f"{path}: line {number}"))
        except UsageError:
            warnings.warn(f"{path}: line {number} is not valid JSON (torn by an interrupted write?); skipped",
                          stacklevel=2)
    return records


@contextlib.contextmanager
def file_lock(path: str | Path, block: bool = True):
    """Hold an exclusive ``fcntl`` lock on ``path`` (created if missing) for the ``with`` block; yields True, or
    False without waiting when ``block`` is false and another process holds it. Locks are released when the
    holder exits, killed or not. Without ``fcntl`` (Windows) every lock is granted. A lock file that is a
    symbolic link is never followed (UsageError naming it): a link could make llmprobe create files anywhere."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.is_symlink():
            raise OSError(errno.ELOOP, "a symbolic link", str(path))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise UsageError(f"{path} is a symbolic link: llmprobe never follows a link to a lock file; remove "
                         f"it") from None
    with os.fdopen(fd, "r+b") as handle:
        if fcntl is None:
            yield True
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


LOCK = os.path.join(".locks", "llmprobe.lock")   # held in an output folder by the command writing into it


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "--out"):
    """Hold the lock of the output folder ``folder`` (``LOCK`` in it) for the ``with`` block: a second command
    writing into the same folder is refused (UsageError saying another run holds the lock) instead of mixing its
    files with the first one's. Neither the lock file nor its ``.locks`` folder may be a symbolic link."""
    lock = Path(folder) / LOCK
    if lock.parent.is_symlink():
        raise UsageError(f"{lock.parent} is a symbolic link: llmprobe never follows a link to a lock file; remove "
                         f"it")
    with file_lock(lock, block=False) as held:
        if not held:
            raise UsageError(f"{what} {folder} is in use by another llmprobe command: another run holds its lock "
                             f"({lock}); wait for it to finish, or choose another folder")
        yield


MANIFEST = "manifest.json"      # in an output folder: which files llmprobe wrote there (and for which weights)
OUTPUTS = ("report.json", "known_facts.json", "decoders.json", "decoders.safetensors", "report.html", "report.md",
           "metrics.csv", "metrics.json")    # the files a probe or run (or an export of its report) writes


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest.json llmprobe wrote in ``folder`` (a JSON object with ``format`` 1 and a ``files`` list of
    names); {} when there is none; None when there is a manifest.json llmprobe did not write (or cannot be read):
    such a file is never replaced."""
    path = Path(folder) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if (not isinstance(value, dict) or value.get("format") != 1 or not isinstance(value.get("files"), list)
            or not all(isinstance(name, str) for name in value["files"]) or path.is_symlink()):
        return None
    return value


def note_written(folder: str | Path, paths: list[str | Path], **fields) -> None:
    """Add the names of ``paths`` (written into ``folder``) to its manifest.json, or start one with ``fields``
    where there is none (none without ``fields``); a manifest.json llmprobe did not write is left alone."""
    manifest = read_manifest(folder)
    if manifest is None or not (manifest or fields):
        return
    manifest = manifest or {"format": 1, **fields, "files": []}
    write_json(Path(folder) / MANIFEST, {**manifest, "files": sorted({*manifest["files"],
                                                                      *(Path(p).name for p in paths)})})


def remove_outputs(folder: str | Path, manifest: dict) -> list[str]:
    """Delete the files of ``folder`` that its ``manifest`` (:func:`read_manifest`) names **and** that llmprobe
    writes (``OUTPUTS``): a file llmprobe did not write is never deleted, whatever a manifest lists. Returns the
    names deleted."""
    folder = Path(folder)
    names = sorted(name for name in set(manifest.get("files", [])) & set(OUTPUTS) if (folder / name).is_file())
    for name in names:
        (folder / name).unlink()
    return names
