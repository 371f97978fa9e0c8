"""One error type per cause, the command line's exit codes, and the checks made before any expensive work.

* :class:`UsageError` (a ``ValueError``): a bad option, input or output folder -> exit status 2 (as are
  ``DatasetError`` and ``ModelLoadError``);
* out of memory (:func:`is_out_of_memory`: CUDA, a failed CPU allocation, ``MemoryError``) -> 3;
* ``KeyboardInterrupt``, which SIGINT and (under the command line) SIGTERM raise -> 130.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import stat
import sys
import tempfile
import types
import typing
from pathlib import Path

from llmprobe.names import REPORT_FILES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_OUT_OF_MEMORY, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(ValueError):
    """A bad option, input or output folder: the message says which and what is allowed."""


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA out-of-memory errors, a CPU allocator's failure ("can't allocate memory") and MemoryError."""
    if isinstance(error, MemoryError):
        return True
    try:
        import torch  # lazy: the checks (and the settings above them) must not load torch

        if isinstance(error, getattr(torch, "OutOfMemoryError", ())):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if isinstance(error, RuntimeError):
        text = str(error).lower()
        return any(s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory",
                                       "defaultcpuallocator", "failed to allocate"))
    return False


def output_folder(path: str | os.PathLike, what: str = "--out") -> Path:
    """Create the output folder now and check that files can be written in it; raises UsageError otherwise
    (an existing file, a read-only or unreachable folder). Returns it as a Path."""
    if path is None or str(path) == "":
        raise UsageError(f"{what} is empty: give an output folder")
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} {str(folder)!r} is a file, not a folder")
    try:
        make_writable_folder(folder)
    except OSError as error:
        raise UsageError(f"{what} {str(folder)!r} is not a writable folder ({error.strerror or error})") from None
    return folder


def make_writable_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) and write and remove a file in it: OSError when it cannot be."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".llmprobe-write-check.", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)


def positive_int(value, what: str, allow_none: bool = False, minimum: int = 1) -> int | None:
    """``value`` as an int >= ``minimum`` (None passes when ``allow_none``); raises UsageError naming the option."""
    if value is None and allow_none:
        return None
    try:
        number = int(value)
        ok = number >= minimum and float(value) == number
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UsageError(f"{what} must be a whole number of at least {minimum}, got {value!r}")
    return number


def int_list(text, what: str, minimum: int = 1) -> list[int]:
    """``"256,512"`` -> [256, 512]: a comma list of whole numbers >= ``minimum``, empty items ignored; raises
    UsageError naming ``what`` for an empty list or a bad item."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"{what}: empty list {text!r}; give comma-separated whole numbers")
    return [positive_int(x, f"each value of {what} ({text!r})", minimum=minimum) for x in items]


def analysis_names(spec, valid) -> tuple[str, ...]:
    """``"lre, ridge"`` or a sequence -> ('lre', 'ridge'); spaces and empty items ignored, unknown names listed
    at once beside the valid ones (UsageError)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or ())
    names = tuple(dict.fromkeys(str(a).strip() for a in items if str(a).strip()))
    unknown = [a for a in names if a not in valid]
    if unknown:
        raise UsageError(f"unknown analysis name(s) {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(valid)} (comma separated)")
    return names


def report_formats(formats) -> tuple[str, ...]:
    """``formats`` ("html,md" or a list of names) as a tuple of ``names.REPORT_FILES`` names, each once, in the
    order given; UsageError naming any other."""
    names = formats.split(",") if isinstance(formats, str) else list(formats)
    formats = tuple(dict.fromkeys(name.strip() for name in names if name.strip()))
    unknown = [name for name in formats if name not in REPORT_FILES]
    if unknown:
        raise UsageError(f"unknown report format(s) {unknown}; choose from {', '.join(REPORT_FILES)}")
    return formats


def layer_spec(spec) -> None:
    """Check the syntax of a ``--layers`` value (all | every:K with K >= 1 | comma list of integers) before the
    model is loaded; the range is checked against the model's layer count once it is."""
    if spec is None or spec == "all" or not isinstance(spec, str):
        return
    if spec.startswith("every:"):
        step = spec.split(":", 1)[1]
        if not step.strip().isdigit() or int(step) < 1:
            raise UsageError(f"--layers {spec!r}: every:K needs a whole number K of at least 1")
        return
    items = [s.strip() for s in spec.split(",")]
    for item in items:
        try:
            int(item)
        except ValueError:
            raise UsageError(f"bad layer {item!r} in --layers {spec!r}: use all, every:K, or integers "
                             f"like 0,6,-1") from None


def parse_layers(spec: str | list[int] | None, n_layers: int) -> list[int]:
    """``all`` | ``0,6,12`` | ``-1`` | ``every:3`` -> sorted layer indices in 0..n_layers-1 (UsageError otherwise)."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    layer_spec(spec)
    if isinstance(spec, str) and spec.startswith("every:"):
        step = int(spec.split(":", 1)[1])
        return sorted(set(range(0, n_layers, step)) | {n_layers - 1})
    items = spec.split(",") if isinstance(spec, str) else spec
    layers = set()
    for item in items:
        try:
            layer = int(item)
        except (TypeError, ValueError):
            raise UsageError(f"bad layer {item!r} in --layers {spec!r}: use all, every:K, or integers") from None
        if not -n_layers <= layer < n_layers:
            raise UsageError(f"layer {layer} out of range: the model has {n_layers} layers")
        layers.add(layer % n_layers)
    return sorted(layers)


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
QUANTIZE = ("4bit", "8bit")


def parse_max_memory(spec: str | dict | list | None) -> dict | None:
    """``"cpu=2GiB,0=70GiB"`` (or a list of such items, or a dict) -> accelerate's ``max_memory`` dict
    ``{"cpu": "2GiB", 0: "70GiB"}``. Keys: ``cpu``, ``disk``, ``mps``, a GPU index ``N`` or ``cuda:N``; sizes
    like ``200MiB``, ``2GB`` or a number of bytes. ValueError naming the bad item."""
    if spec is None or isinstance(spec, dict) and not spec:
        return None
    from accelerate.utils import (
        convert_file_size_to_int,  # lazy: the checks (and the settings above them) must not load torch
    )

    items = spec.items() if isinstance(spec, dict) else [
        tuple(part.split("=", 1)) if "=" in part else (part, None)
        for text in ([spec] if isinstance(spec, str) else spec) for part in str(text).split(",") if part.strip()]
    out: dict = {}
    for key, size in items:
        key = str(key).strip()
        if key.startswith("cuda:"):
            key = key[5:]
        key = int(key) if key.isdigit() else key
        if not isinstance(key, int) and key not in ("cpu", "disk", "mps"):
            raise ValueError(f"--max-memory: unknown device {key!r}; use cpu, disk, mps, a GPU index N or cuda:N "
                             f"(e.g. cpu=2GiB,0=70GiB)")
        if size is None or not str(size).strip():
            raise ValueError(f"--max-memory: no size for {key!r}; write DEVICE=SIZE, e.g. cpu=2GiB")
        size = str(size).strip()
        value = int(size) if size.isdigit() else size
        try:
            if convert_file_size_to_int(value) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise ValueError(f"--max-memory: bad size {size!r} for {key!r}; use e.g. 200MiB, 2GiB, 2GB or a "
                             f"number of bytes") from None
        out[key] = value
    return out


def argparse_type(check):
    """An argparse ``type`` from a checks.* function (its UsageError becomes argparse's usage error, status 2)."""
    def convert(text):
        try:
            return check(text)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = getattr(check, "__name__", "value")
    return convert


# ------------------------------------------------------------------------------ input files
SPECIAL_FILES = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is a FIFO, a device or a socket (after symbolic links), else None (a plain file,
    a folder, or nothing there). Such a file is never opened: reading a FIFO or a device can block for ever."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((name for test, name in SPECIAL_FILES if test(mode)), None)


def check_not_special(path: str | os.PathLike, what: str = "", error: type[Exception] = UsageError) -> None:
    """``error`` naming ``path`` (and ``what`` it was given as) when it is a FIFO, a device or a socket: such
    files are refused before they are opened (a read could wait for ever)."""
    kind = special_file(path)
    if kind:
        raise error(f"{what + ' ' if what else ''}{str(path)!r} is {kind}, not a regular file; refused (reading it "
                    f"could wait for ever): give a regular file")


def tcp_address(address: str, what: str = "--address", hint: str = "", timeout: float = 3.0) -> None:
    """Check that ``address`` (``HOST:PORT`` or ``SCHEME://HOST:PORT``) accepts a TCP connection within
    ``timeout`` seconds; UsageError naming ``what`` (and ending with ``hint``: what would work) otherwise. Only
    that address is contacted; other forms (``auto``, ``local``, a host without a port) are left to the program
    they are for."""
    text = str(address).strip()
    rest = text.split("://", 1)[1] if "://" in text else text
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not colon or not host:
        return
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what} {text!r}: the port must be a number from 1 to 65535 (HOST:PORT, e.g. "
                         f"127.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        reason = "no answer within {:g} s".format(timeout) if isinstance(error, TimeoutError) else \
            (error.strerror or str(error) or type(error).__name__)
        raise UsageError(f"{what} {text!r}: cannot connect to {host}:{port} ({reason})"
                         + (f"; {hint}" if hint else "")) from None


# ------------------------------------------------------------------------------ JSON input files
def parse_json(text: str | bytes, source: str, error: type[Exception] = UsageError, too_deep: str = "",
               encoding: str | None = None):
    """``text`` (a file's contents, or JSON kept inside a file) parsed; ``error`` (UsageError unless a reader has
    its own class) naming ``source`` when it is not JSON, not text in its encoding, or nested too deeply to read
    (RecursionError; ``too_deep``: words added after that). ``encoding``: bytes are decoded with it first (else
    json.loads detects UTF-8, -16 or -32)."""
    try:
        return json.loads(text.decode(encoding) if encoding and isinstance(text, bytes) else text)
    except RecursionError:
        raise error(f"{source}: nested too deeply to read{too_deep}") from None
    except UnicodeDecodeError as e:
        name = "UTF-8" if e.encoding.replace("_", "-").lower() in ("utf-8", "utf-8-sig") else e.encoding
        raise error(f"{source}: not {name} text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{source}: not valid JSON ({e})") from None
    except ValueError as e:          # json's int conversion: more digits than sys.get_int_max_str_digits()
        detail = (f"a number of more than {sys.get_int_max_str_digits()} digits"
                  if "integer string conversion" in str(e) else str(e))
        raise error(f"{source}: not valid JSON ({detail})") from None


def read_json(path: str | os.PathLike, error: type[Exception] = UsageError, too_deep: str = "",
              encoding: str | None = None):
    """The JSON value in file ``path`` (:func:`parse_json`, the file named in its errors); a FIFO, device or
    socket is refused unopened."""
    check_not_special(path, error=error)
    return parse_json(Path(path).read_bytes(), str(path), error, too_deep, encoding)


def check_fields(obj, source: str, fields, required: tuple = ()) -> dict:
    """``obj`` when it is a JSON object whose ``fields`` have their types, else UsageError naming ``source``, the
    field and what it must be. ``fields``: {key: type or tuple of types}, None among them allowing null ("*": every
    key), or a dataclass (its fields' annotated types; those without a default are required); a missing field
    passes unless in ``required``. A float field takes an int, a tuple field a JSON list; an int is never a bool."""
    if dataclasses.is_dataclass(fields):
        hints = typing.get_type_hints(fields)
        required = tuple(required) + tuple(f.name for f in dataclasses.fields(fields) if f.default is
                                           dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        fields = {f.name: _json_types(hints[f.name]) for f in dataclasses.fields(fields)}
    if not isinstance(obj, dict):
        raise UsageError(f"{source}: expected a JSON object, got a JSON {_json_name(type(obj))}")
    missing = [key for key in required if key not in obj]
    if missing:
        raise UsageError(f"{source}: missing field(s) {', '.join(map(repr, missing))}")
    for key, value in obj.items():
        allowed = fields.get(key, fields.get("*"))
        if allowed is None:
            continue
        allowed = tuple(type(None) if t is None else t for t in (allowed if isinstance(allowed, tuple) else (allowed,)))
        ok = set(allowed) | ({int} if float in allowed else set()) | ({list} if tuple in allowed else set())
        if type(value) not in ok:
            names = " or ".join(_json_name(t) for t in allowed)
            raise UsageError(f"{source}: field {key!r} must be of type {names}, got {_json_name(type(value))} "
                             f"{json.dumps(value)[:60] if type(value) in (str, int, float, bool) else ''}".rstrip())
    return obj


def _json_types(hint) -> tuple:
    """The Python types a JSON value may have for an annotation (``int | None`` -> (int, NoneType))."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return tuple(typing.get_origin(a) or a for a in args)


def _json_name(kind: type) -> str:
    return {dict: "dict", list: "list", tuple: "list", str: "str", int: "int", float: "float", bool: "bool",
            type(None): "null"}.get(kind, kind.__name__)
