"""The ``llmprobe`` command line."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from contextlib import contextmanager

from llmprobe.checks import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_USAGE,
    UsageError,
    is_out_of_memory,
    layer_spec,
    output_folder,
    parse_max_memory,
    positive_int,
)
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import probe, summary_table
from llmprobe.jobs.rerun import rerun
from llmprobe.model.batching import OutOfMemoryAtOne
from llmprobe.model.families import embedded, families, models_text
from llmprobe.model.loading import ModelLoadError
from llmprobe.report.render import compare, export
from llmprobe.settings import probe_arguments, resolve, settings_toml
from synthetic.analyze import add_analyze_parser
from synthetic.cli import add_parser as add_synth
from synthetic.executors import ray_map

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _arg(check):
    """An argparse ``type`` from a checks.* function (its UsageError becomes argparse's usage error, status 2)."""
    def convert(text):
        try:
            return check(text)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def positive(name: str):
    return _arg(lambda text: positive_int(text, name))


def _layers(text: str) -> str:
    layer_spec(text)
    return text


def _max_memory(text: str) -> str:
    try:
        parse_max_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    """Where the model's weights go (accelerate) and how they are stored; docs/devices.md."""
    parser.add_argument("--device-map", choices=["auto", "balanced", "balanced_low_0", "sequential"],
                        help="spread the model's blocks over GPUs, CPU and disk through accelerate (replaces --device)")
    parser.add_argument("--max-memory", action="append", type=_max_memory, metavar="DEVICE=SIZE",
                        help="memory per device for --device-map, e.g. cpu=2GiB or 0=70GiB,cpu=8GiB (repeatable)")
    parser.add_argument("--offload-folder", metavar="DIR",
                        help="folder for the weights that fit in no device's --max-memory (read at each pass)")
    parser.add_argument("--quantize", choices=["4bit", "8bit"],
                        help="load the weights quantised by bitsandbytes (needs the package and CUDA)")


def _add_model_args(parser: argparse.ArgumentParser, many: bool = False) -> None:
    parser.add_argument("model", nargs="*" if many else "?", default=None,
                        help="hub name, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
                             + ("; several: one report each and their compare page" if many else ""))
    parser.add_argument("--gguf-file", help="GGUF file inside the MODEL folder or hub repo")
    parser.add_argument("--relations", nargs="+", metavar="NAME_OR_PATH",
                        help="bundled relation names, files (our JSON, LRE JSON, CSV), folders or hf:DATASET")
    parser.add_argument("--layers", type=_arg(_layers), help="all | every:K | comma list like 0,6,12 | -1 "
                                                                "(default every:3)")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="(default auto)")
    parser.add_argument("--batch-size", type=positive("--batch-size"), help="(default 32)")
    parser.add_argument("--max-facts", type=positive("--max-facts"), help="keep the first N facts of each relation")
    parser.add_argument("--max-prompt-tokens", type=positive("--max-prompt-tokens"),
                        help="skip (and list in errors) facts whose prompt is longer (default: the model's context)")
    parser.add_argument("--seed", type=int, help="(default 0)")
    parser.add_argument("--threads", type=positive("--threads"), help="torch CPU threads")
    parser.add_argument("--resume", action="store_true",
                        help="take finished stages from --out when model and settings match, instead of recomputing")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="allow pickle weights (pytorch_model.bin, loaded with weights_only=True); default: "
                             "safetensors only")
    parser.add_argument("--protocol", choices=["strict", "lre"],
                        help="decoders: strict = zero-shot prompt, exact first token (default); lre = the LRE "
                             "reference's protocol (in-context examples, its bias and prefix rule), to compare "
                             "with published LRE tables")
    parser.add_argument("--n-icl", type=positive("--n-icl"), help="in-context examples of --protocol lre (default 5)")
    parser.add_argument("--jacobian-rank", type=_jacobian_rank, metavar="auto|full|K",
                        help="LRE Jacobians: full (exact, d_model backward passes per prompt), K (low-rank estimate "
                             "of rank K: K+10 products per prompt, then 2(K+10) per layer) or auto (default: "
                             "rank 128 where that costs less than exact, counting each product's blocks: exact "
                             "on SmolLM2, low-rank from d_model ~ 650 with 3 spread LRE layers; docs/analyses.md)")
    _add_settings_args(parser)
    _add_device_args(parser)


def _jacobian_rank(text: str) -> int | str:
    if text in ("auto", "full"):
        return text
    try:
        return positive_int(text, "--jacobian-rank")
    except UsageError as error:
        raise argparse.ArgumentTypeError(f"{error} (or auto, full)") from None


def _add_settings_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml",
                        help="settings file with [run], [analysis] and [controls] tables (docs/config.md lists every "
                             "key); --set and the flags above override it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                        help="one setting, e.g. --set analysis.n_splits=5 or --set 'analysis.ridge_alphas=[0.1, 1]' "
                             "(a TOML value; repeatable); flags override it")


# argparse dest -> the setting it sets (llmprobe.settings); None (not given) leaves the setting to --config/--set
FLAG_SETTINGS = {"model": "run.model", "gguf_file": "run.gguf_file", "relations": "run.relations",
                 "layers": "run.layers", "analyses": "run.analyses", "device": "run.device", "dtype": "run.dtype",
                 "batch_size": "run.batch_size", "max_facts": "run.max_facts",
                 "max_prompt_tokens": "run.max_prompt_tokens", "seed": "run.seed", "protocol": "analysis.protocol",
                 "n_icl": "analysis.n_icl", "jacobian_rank": "analysis.jacobian_rank", "device_map": "run.device_map",
                 "max_memory": "run.max_memory", "offload_folder": "run.offload_folder", "quantize": "run.quantize"}
SWITCH_SETTINGS = {"no_controls": "controls.enabled", "no_model_width": "controls.at_model_width"}  # set false


def _settings(args) -> dict:
    """The resolved settings: defaults <- --config <- --set <- the flags given (llmprobe.settings.resolve)."""
    flags = {key: getattr(args, dest) for dest, key in FLAG_SETTINGS.items()
             if getattr(args, dest, None) not in (None, [])}     # [] : run's MODEL... left out
    if "run.analyses" in flags:
        flags["run.analyses"] = [a.strip() for a in flags["run.analyses"].split(",") if a.strip()]
    flags.update({key: False for dest, key in SWITCH_SETTINGS.items() if getattr(args, dest, False)})
    return resolve(args.config, args.sets, flags)


def _probe(args) -> int:
    report = probe(**probe_arguments(_settings(args), "probe"), out=args.out,
                   trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle, resume=args.resume)
    print(summary_table(report))
    for error in report["errors"]:
        print(f"warning: {error}", file=sys.stderr)
    print(f"report: {os.path.join(args.out, 'report.json')} ({report['wall_seconds']} s)")
    return 0


def _run(args) -> int:
    models = args.model if isinstance(args.model, list) else [args.model]
    if len(models) > 1 or getattr(args, "executor", "process") == "ray":
        return _run_models(args, models or [None])
    args.model = models[0] if models else None

    report = run(**probe_arguments(_settings(args), "run"), out=args.out, trust_remote_code=args.trust_remote_code,
                 allow_pickle=args.allow_pickle, resume=args.resume)
    print(summary_table(report))
    for line in _control_lines(report.get("controls")):
        print(line)
    for error in report["errors"]:
        print(f"warning: {error}", file=sys.stderr)
    print(f"report: {os.path.join(args.out, 'report.html')} (and report.json, report.md, metrics.csv; "
          f"{report['wall_seconds']} s)")
    return 0


def _run_one(args) -> str:
    """One model of ``llmprobe run A B ...`` into its own ``args.out`` (a Ray task, or a plain call)."""
    _run(args)
    return args.out


def _run_models(args, models: list) -> int:
    """``llmprobe run A B ... [--executor ray]``: one report per model in OUT/<model>, run here one after the other
    or as Ray tasks (synthetic.executors.ray_map), then their compare page in OUT/compare."""
    jobs, names = [], []
    for model in models:
        text = str(model or "embedded").rstrip("/\\")
        text = os.path.basename(text) if os.path.exists(text) else text      # a local folder or file: its name
        name = re.sub(r"[^A-Za-z0-9_.-]+", "--", text).strip("-.") or "model"
        name = name if name not in names else f"{name}-{len(names)}"
        names.append(name)
        jobs.append(argparse.Namespace(**{**vars(args), "model": model, "executor": "process",
                                          "out": os.path.join(args.out, name)}))
    if args.executor == "ray":
        ray_map(_run_one, jobs, address=args.address)
    else:
        for job in jobs:
            _run_one(job)
    for path in compare([job.out for job in jobs], os.path.join(args.out, "compare")):
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
    print(json.dumps({"default": embedded(), "families": families()}, indent=1) if args.json else models_text())
    return 0


def _config(args) -> int:
    print(settings_toml(_settings(args)), end="")
    return 0


def _number(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def _control_lines(block) -> list[str]:
    """One summary line per trained matched control (the ``controls`` block of ``synthetic.controls``)."""
    lines = []
    for mode, entry in ((block or {}).get("modes") or {}).items() if isinstance(block, dict) else ():
        d_star = (entry.get("threshold") or {}).get("d_star")
        for point in entry.get("points") or []:
            r2, train = point.get("r2") or {}, point.get("train") or {}
            shuffled = ((r2.get("controls") or {}).get("shuffled") or {}).get("value")
            label = f"synthetic {mode} d={point.get('d')}" + (" (d*)" if point.get("d") == d_star else "")
            lines.append(f"{label:<36} train acc {_number(train.get('accuracy'))}  bits/param "
                         f"{_number(train.get('bits_per_param'), '.3g')}  superposition R^2 {_number(r2.get('value'))}"
                         f" (shuffled {_number(shuffled)})")
    return lines


def _formats(text: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    unknown = [f for f in formats if f not in ("html", "md", "json", "csv")]
    if unknown:
        raise UsageError(f"unknown report format(s) {', '.join(map(repr, unknown))}; choose from html, md, json, csv")
    return formats


def _compare(args) -> int:
    for path in compare(args.dirs, args.out, args.format):
        print(path)
    return 0


def _report(args) -> int:
    for path in export(args.dir, args.format, args.out):
        print(path)
    return 0


def build_parser(synth: bool = True) -> argparse.ArgumentParser:
    """The whole command line. ``synth=False`` puts a stub in place of the ``synth`` group, whose modules take
    seconds to import (torch, scikit-learn): main() builds the group only for ``llmprobe synth ...``, so the
    other commands check their options and output folder at once. (The analysis names are checked by
    ``probe``/``run`` themselves, after the output folder and before the model is loaded.)"""
    parser = argparse.ArgumentParser(prog="llmprobe", description="Measure how language models store facts.")
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("probe", help="known facts (and analyses) of a pretrained model -> report.json")
    _add_model_args(probe)
    probe.add_argument("--analyses", help="comma list of lre,ridge,superposition (default: none)")
    probe.add_argument("--out", default="runs/probe", help="output folder")
    probe.set_defaults(func=_probe)
    run = commands.add_parser("run", help="the main job: probe + matched synthetic controls -> one report")
    _add_model_args(run, many=True)
    run.add_argument("--analyses", help="comma list of lre,ridge,superposition (default: all three)")
    run.add_argument("--no-controls", action="store_true", help="skip the matched synthetic controls")
    run.add_argument("--no-model-width", action="store_true",
                     help="train controls only at the threshold d*, not also at the model's d_model")
    run.add_argument("--out", default="runs/main", help="output folder (with several models: one folder each in it, "
                                                        "and compare/)")
    run.add_argument("--executor", choices=["process", "ray"], default="process",
                     help="several models: one after the other here (default) or one Ray task each")
    run.add_argument("--address", help="with --executor ray: the Ray cluster to join (default: Ray on this machine)")
    run.set_defaults(func=_run)
    compare = commands.add_parser("compare", help="side-by-side page of several report folders")
    compare.add_argument("dirs", nargs="+", help="report folders (each with report.json)")
    compare.add_argument("--out", required=True, help="output folder")
    compare.add_argument("--format", default="html,md,csv", type=_arg(_formats),
                         help="comma list of html, md, json, csv")
    compare.set_defaults(func=_compare)
    report = commands.add_parser("report", help="export a report folder as html, md, json or csv")
    report.add_argument("dir", help="report folder (with report.json)")
    report.add_argument("--format", default="html,md,csv", type=_arg(_formats),
                        help="comma list of html, md, json, csv")
    report.add_argument("--out", help="output folder (default: the report folder)")
    report.set_defaults(func=_report)
    rerun = commands.add_parser("rerun", help="repeat the probe or run of a report folder with its recorded settings "
                                              "and say whether the numbers match (exit 1 when they differ)")
    rerun.add_argument("dir", help="report folder (with report.json)")
    rerun.add_argument("--out", help="output folder (default: DIR-rerun)")
    rerun.add_argument("--allow-different-weights", action="store_true",
                       help="rerun even when the model's weights hash differs from the recorded one")
    rerun.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off)")
    rerun.add_argument("--allow-pickle", action="store_true", help="allow pickle weights (off)")
    rerun.set_defaults(func=_rerun)
    models = commands.add_parser("models", help="supported model families, their hook places and what the tests "
                                                "check for each")
    models.add_argument("--json", action="store_true", help="JSON instead of text")
    models.set_defaults(func=_models)
    config = commands.add_parser("config", help="print the settings probe and run would use (defaults <- --config "
                                                "<- --set) as a TOML file")
    _add_settings_args(config)
    config.set_defaults(func=_config)

    if not synth:
        commands.add_parser("synth", help="synthetic factual recall: train, sweep, construct, bounds, analyze, "
                                          "multihop")
        return parser

    group = add_synth(commands)
    add_analyze_parser(group.synth_subparsers)
    return parser


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


def run_command(args) -> int:
    """Run a parsed command with the one error handler: 0 ok, 2 bad input or refused model, 3 out of memory,
    130 interrupted; any other exception is a bug and keeps its traceback (status 1). Results go to files; the
    command prints a short summary."""
    try:
        with interrupts_raise():
            check_outputs(args)
            if getattr(args, "threads", None):
                import torch

                torch.set_num_threads(args.threads)
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
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, ModelLoadError):
            print(f"llmprobe: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        if not is_out_of_memory(error):
            raise

        if isinstance(error, OutOfMemoryAtOne):   # the batches already went down to one item: its message says why
            print(f"llmprobe: error: {error} Results already written are kept.", file=sys.stderr)
            return EXIT_OUT_OF_MEMORY
        print(f"llmprobe: error: out of memory ({str(error).splitlines()[0][:300]}). Try a smaller --batch-size, "
              f"--max-prompt-tokens, --dtype bfloat16, fewer --layers, or --device cpu. Results already written "
              f"are kept.", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY


def main(argv: list[str] | None = None) -> int:
    """``llmprobe ...``: returns the exit status (argparse exits 2 itself on a bad option)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(synth=bool(argv) and argv[0] == "synth").parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
