"""The ``llmprobe`` commands: one handler per subcommand (``args.func``, set by ``llmprobe.cli``), the settings
of a parsed command line, and the one error handler (exit statuses) every command runs under (layer 6)."""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import sys
from contextlib import contextmanager

import torch

from llmprobe.checks import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_USAGE,
    UsageError,
    is_out_of_memory,
    output_folder,
    tcp_address,
)
from llmprobe.cli import MODEL
from llmprobe.io import folder_lock, reuse_freed_memory
from llmprobe.jobs.main import run
from llmprobe.jobs.plan import format_plan, plan, plan_devices
from llmprobe.jobs.probe import probe, summary_table
from llmprobe.jobs.rerun import rerun
from llmprobe.jobs.stages import check_folder
from llmprobe.model.batching import OutOfMemoryAtOne
from llmprobe.model.families import embedded, families, models_text
from llmprobe.model.loading import DEFAULT_MODEL, ModelLoadError, check_hub_reachable
from llmprobe.report.claims import claims_block, claims_text
from llmprobe.report.render import compare, export
from llmprobe.report.schema import train_over_seeds
from llmprobe.settings import Settings, resolve, settings_toml
from synthetic.executors import RayFailed, ray_map


def settings_of(args) -> Settings:
    """The resolved settings: defaults <- --config <- --set <- the setting flags given (their argparse dest is
    the settings key, ``run.layers``; ``llmprobe.cli.SETTING_FLAGS``)."""
    flags = {key: value for key, value in vars(args).items()
             if "." in key and value is not None and value != []}     # [] : run's MODEL... left out
    return resolve(args.config, args.sets, flags)


def _probe(args) -> int:
    report = probe(settings=settings_of(args), out=args.out, trust_remote_code=args.trust_remote_code,
                   allow_pickle=args.allow_pickle, resume=args.resume, overwrite=args.overwrite)   # + its exports
    print_summary(report, args.out)
    return finished(report)


def _run(args) -> int:
    models = getattr(args, MODEL)
    models = models if isinstance(models, list) else [models]
    if len(models) > 1 or getattr(args, "executor", "process") == "ray":
        return _run_models(args, models or [None])
    setattr(args, MODEL, models[0] if models else None)

    settings = settings_of(args)
    print_plan(settings, args.trust_remote_code)
    report = run(settings=settings, out=args.out, trust_remote_code=args.trust_remote_code,
                 allow_pickle=args.allow_pickle, resume=args.resume, overwrite=args.overwrite)
    print_summary(report, args.out)
    return finished(report)


def _plan(args) -> int:
    """``llmprobe plan [MODEL ...] [run options]``: each model's plan with the settings ``run`` would use."""
    for model in getattr(args, MODEL) or [None]:
        print(plan_text(settings_of(argparse.Namespace(**{**vars(args), MODEL: model})), args.trust_remote_code))
    return EXIT_OK


def plan_text(settings: Settings, trust_remote_code: bool) -> str:
    """The plan table (``llmprobe.jobs.plan``) of the run ``settings`` describe, on the devices ``--device``
    names (auto: this CPU and one H200)."""
    return format_plan([plan(None, settings, device=device, trust_remote_code=trust_remote_code)
                        for device in plan_devices(settings.run.device)])


def print_plan(settings: Settings, trust_remote_code: bool) -> None:
    """The plan of ``llmprobe plan`` at the start of ``run``, before the model loads (on stderr, with the
    progress); one line saying why when it cannot be made: the plan never stops the run."""
    try:
        text = plan_text(settings, trust_remote_code)
    except Exception as error:  # noqa: BLE001 - any failure of the plan is reported and the run goes on
        first = (str(error).splitlines() or [""])[0][:300]
        text = f"llmprobe: no plan of this run ({type(error).__name__}: {first})"
    print(text, file=sys.stderr, flush=True)


def finished(report: dict) -> int:
    """The exit status of a probe or run that returned: 0; 2 when no fact could be measured (every relation was
    skipped: no prompt fits, no subject located); 1 when its report is partial (a stage failed, e.g. the controls
    worker died); said on stderr."""
    if not report.get("relations"):
        skipped = [e for e in report["errors"] if ") skipped: " in e] or [e for e in report["errors"]
                                                                           if e.endswith("relation skipped")]
        why = (f"{len(skipped)} fact{'s' if len(skipped) != 1 else ''} skipped, the first as {skipped[0]}"
               if skipped else "no relation had a fact to check")
        print(f"llmprobe: error: no fact could be measured: every relation was skipped ({why}); report.json's "
              f"errors list each one", file=sys.stderr)
        return EXIT_USAGE
    if not report.get("partial"):
        return EXIT_OK
    unfinished = [name for name, stage in report["stages"].items() if not stage["done"]]
    print(f"llmprobe: error: the report is partial: {', '.join(unfinished)} did not finish (see the warnings); "
          f"rerun with --resume to finish it", file=sys.stderr)
    return EXIT_FAILURE


MAX_WARNINGS = 10    # warnings printed at the end of a probe or run; report.json's errors hold them all


def print_summary(report: dict, out: str) -> None:
    """The end of ``probe`` and ``run``: known-fact rates, the matched controls, the warnings (on stderr, at most
    ``MAX_WARNINGS``), one line per claim with its number, interval, null and verdict, and report.html's path."""
    print(summary_table(report))
    for line in _matched_lines(report.get("matched")):
        print(line)
    errors = report["errors"]
    for error in errors[:MAX_WARNINGS]:
        print(f"warning: {error}", file=sys.stderr)
    if len(errors) > MAX_WARNINGS:
        print(f"warning: ... and {len(errors) - MAX_WARNINGS} more (report.json, \"errors\")", file=sys.stderr)
    sys.stderr.flush()
    print(claims_text(report.get("claims") or claims_block(report)))
    print(f"report: {os.path.abspath(os.path.join(out, 'report.html'))} (and report.json, report.md, metrics.csv "
          f"beside it; {report['wall_seconds']} s)")


def _run_one(args) -> str:
    """One model of ``llmprobe run A B ...`` into its own ``args.out`` (a Ray task, or a plain call)."""
    _run(args)
    return args.out


COMPARE = "compare"    # the folder of ``llmprobe run A B ...``'s compare page, beside one folder per model


def model_folders(out: str, models: list) -> list[str]:
    """The folder of each model of ``llmprobe run A B ... --out OUT``: OUT/<its name> (a local folder or file: its
    base name), unique, and never OUT/compare (the compare page's)."""
    names: list[str] = []
    for model in models:
        text = str(model or "embedded").rstrip("/\\")
        text = os.path.basename(text) if os.path.exists(text) else text      # a local folder or file: its name
        base = re.sub(r"[^A-Za-z0-9_.-]+", "--", text).strip("-.") or "model"
        name, number = base, 0
        while name in names or name == COMPARE:
            number += 1
            name = f"{base}-{number}"
        names.append(name)
    return [os.path.join(out, name) for name in names]


def _run_models(args, models: list) -> int:
    """``llmprobe run A B ... [--executor ray]``: one report per model in OUT/<model>, run here one after the other
    or as Ray tasks (synthetic.executors.ray_map), then their compare page in OUT/compare."""
    jobs = [argparse.Namespace(**{**vars(args), MODEL: model, "executor": "process", "out": folder})
            for model, folder in zip(models, model_folders(args.out, models), strict=True)]
    if args.executor == "ray":
        if args.address:
            tcp_address(args.address, "--address", "start the Ray cluster there first (ray start --head), or leave "
                                                    "--address out for a local one")
        try:
            ray_map(_run_one, jobs, address=args.address)
        except Exception as error:
            if not isinstance(error, RayFailed) and not type(error).__module__.startswith("ray."):
                raise
            text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            why = error.why if isinstance(error, RayFailed) else f"{type(error).__name__}: {text}"
            finished = (f" (finished: {', '.join(os.path.basename(out) for out in error.results) or 'none'})"
                        if isinstance(error, RayFailed) else "")
            print(f"llmprobe: error: Ray failed ({why}); the models that finished have their reports in "
                  f"{args.out}/<model>{finished}; run again with --resume to finish the others", file=sys.stderr)
            return EXIT_USAGE
    else:
        for job in jobs:
            _run_one(job)
    for path in compare([job.out for job in jobs], os.path.join(args.out, COMPARE)):
        print(path)
    return 0


def _rerun(args) -> int:
    result = rerun(args.dir, args.out, allow_different_weights=args.allow_different_weights,
                   trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle)
    comparison = result["comparison"]
    print(f"reran {result['command']} of {args.dir} into {result['out']} (weights: {result['weights']})")
    for path, old, new in comparison["differences"][:20]:
        print(f"  differs: {path}: {old} -> {new}")
    print(f"numbers {'match' if comparison['match'] else 'differ'}: {comparison['n_numbers']} compared, "
          f"{len(comparison['differences'])} differ, largest difference {comparison['max_abs_difference']:.3g}")
    return EXIT_OK if comparison["match"] else EXIT_FAILURE


def _models(args) -> int:
    width = max(60, shutil.get_terminal_size((100, 24)).columns)       # COLUMNS, else the terminal's, else 100
    print(json.dumps({"default": embedded(), "families": families()}, indent=1) if args.json else models_text(width))
    return 0


def _config(args) -> int:
    print(settings_toml(settings_of(args)), end="")
    return 0


def _compare(args) -> int:
    for path in compare(args.dirs, args.out, args.format, overwrite=args.overwrite):
        print(path)
    return 0


def _report(args) -> int:
    for path in export(args.dir, args.format, args.out, overwrite=args.overwrite):
        print(path)
    return 0


def _number(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def _matched_lines(block) -> list[str]:
    """One summary line per trained matched control (the ``matched`` block of ``synthetic.matched``)."""
    lines = []
    for mode, entry in ((block or {}).get("modes") or {}).items() if isinstance(block, dict) else ():
        d_star = (entry.get("threshold") or {}).get("d_star")
        for point in entry.get("points") or []:
            r2, train = point.get("r2") or {}, point.get("train") or {}
            shuffled = ((r2.get("nulls") or {}).get("shuffled") or {}).get("value")
            label = f"synthetic {mode} d={point.get('d')}" + (" (d*)" if point.get("d") == d_star else "")
            seeds = train_over_seeds(point)
            accuracy = (f"{_number(seeds['accuracy_mean'])} (min {_number(seeds['accuracy_min'])}, "
                        f"{seeds['n_fit']}/{seeds['n']} seeds fit)" if seeds else _number(train.get("accuracy")))
            lines.append(f"{label:<36} train acc {accuracy}  bits/param "
                         f"{_number(train.get('bits_per_param'), '.3g')}  superposition R^2 {_number(r2.get('value'))}"
                         f" (shuffled {_number(shuffled)})")
    return lines


# folders a command writes into: checked (created, writable, not a file) before any work starts
OUTPUT_ARGS = (("out", "--out"), ("run_dir", "RUN_DIR"), ("img_dir", "--img-dir"))


def check_outputs(args) -> None:
    """Create and check every output folder named in ``args`` (UsageError on a file or an unwritable folder).
    ``llmprobe report DIR`` without --out writes into DIR, which must then exist (it holds the input)."""
    for attr, flag in OUTPUT_ARGS:
        value = getattr(args, attr, None)
        if value is not None:
            output_folder(value, flag)
    if getattr(args, "command", None) == "report" and args.out is None and os.path.isdir(args.dir):
        output_folder(args.dir, "DIR")
    if getattr(args, "command", None) == "compare" and any(
            os.path.realpath(args.out) == os.path.realpath(folder) for folder in args.dirs):
        raise UsageError(f"compare: --out {args.out!r} is one of the compared folders: its own report.html, "
                         f"report.md and metrics.csv would be overwritten; give another folder")


def check_results(args) -> None:
    """``probe`` and ``run``: refuse (UsageError) an output folder holding another result (any command's, finished
    or partial) unless --overwrite or --resume, before the model loads (``llmprobe.jobs.stages.check_folder``;
    ``claim_folder`` checks the weights once it is loaded). Called holding the folder's lock, so that a command
    still writing there is named as such."""
    if getattr(args, "command", None) in ("probe", "run"):
        models = getattr(args, MODEL)
        many = isinstance(models, list) and (len(models) > 1 or getattr(args, "executor", "process") == "ray")
        for folder in model_folders(args.out, models or [None]) if many else [args.out]:
            check_folder(folder, args.resume, args.overwrite)


LOCKING = ("probe", "run", "compare", "report", "synth train", "synth construct")   # rerun locks its own folder


@contextmanager
def output_lock(args):
    """Hold the lock of the folder the command writes into (``--out``; ``report``'s DIR without it) for the
    command's duration: a second command into the same folder is refused (UsageError) instead of mixing its files
    with the first one's. ``synth sweep`` (and the other synth commands) share their folders by design; ``rerun``
    locks the folder it writes (``--out`` or DIR-rerun) itself."""
    command = " ".join(filter(None, (getattr(args, "command", None), getattr(args, "synth_command", None))))
    folder = getattr(args, "out", None) or (args.dir if command == "report" else None)
    if command not in LOCKING or folder is None:
        yield
        return
    with folder_lock(folder):
        yield


def check_models(args) -> None:
    """``probe`` and ``run``: fail (ModelLoadError) before any output folder is made when a MODEL (or the
    --config file's) is no embedded model, existing file or folder, nor a hub name that is cached or reachable.
    The settings are checked first (a bad one is the error to report)."""
    if getattr(args, "command", None) not in ("probe", "run"):
        return
    models = getattr(args, MODEL, None)
    models = [m for m in (models if isinstance(models, list) else [models]) if m is not None]
    settings = settings_of(argparse.Namespace(**{**vars(args), MODEL: models[0] if models else None}))
    for name in models or [settings.run.model]:
        if name is not None and name != DEFAULT_MODEL and not os.path.exists(os.path.expanduser(name)):
            check_hub_reachable(name, None)


@contextmanager
def interrupts_raise():
    """SIGTERM (and SIGINT, which background shells may ignore) raise KeyboardInterrupt in the main thread, so
    every command stops the same way: finished work written, child processes stopped, exit status 130."""
    def handler(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:       # not the main thread: leave signals alone
            break
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)   # a write failed for want of room (exit 2)


def run_command(args) -> int:
    """Run a parsed command with the one error handler: 0 ok, 2 bad input or refused model, 3 out of memory,
    130 interrupted; any other exception is a bug and keeps its traceback (status 1). Results go to files; the
    command prints a short summary."""
    try:
        with interrupts_raise():
            check_models(args)
            check_outputs(args)
            if getattr(args, "threads", None):
                torch.set_num_threads(args.threads)
            reuse_freed_memory()
            with output_lock(args):
                check_results(args)
                status = args.func(args)
        return status if isinstance(status, int) and not isinstance(status, bool) else EXIT_OK
    except KeyboardInterrupt as error:
        how = f" by {error.args[0]}" if error.args and str(error.args[0]).startswith("SIG") else ""
        where = getattr(args, "out", None) or getattr(args, "run_dir", None)
        print(f"llmprobe: interrupted{how}; finished work is kept" + (f" in {where}" if where else "") +
              (" (rerun with --resume to finish)" if getattr(args, "command", None) in ("run", "probe") else ""),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError) as error:
        # DatasetError is a ValueError
        print(f"llmprobe: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:
            print(f"llmprobe: error: a file or folder name is too long ({error.strerror}): "
                  f"{error.filename if error.filename is not None else 'a path given'}; give a shorter one",
                  file=sys.stderr)
            return EXIT_USAGE
        if error.errno not in FULL:
            raise
        print(f"llmprobe: error: {error.strerror}: cannot write {error.filename}; results already written are kept"
              + (" (make room, then rerun with --resume to finish)" if getattr(args, "command", None) in
                 ("run", "probe") else ""), file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, ModelLoadError):
            print(f"llmprobe: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        if not is_out_of_memory(error):
            raise

        if isinstance(error, OutOfMemoryAtOne):   # the batches already went down to one item: its message says why
            print(f"llmprobe: error: {error} Results already written are kept.", file=sys.stderr)
            return EXIT_OUT_OF_MEMORY
        why = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]   # a bare MemoryError has no text
        print(f"llmprobe: error: out of memory ({why}). Try a smaller --batch-size, "
              f"--max-prompt-tokens, --dtype bfloat16, fewer --layers, or --device cpu. Results already written "
              f"are kept.", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY


__all__ = ["run_command", "settings_of", "check_models", "check_outputs", "interrupts_raise", "print_summary",
           "print_plan"]
