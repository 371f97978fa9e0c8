"""The ``llmprobe`` command line."""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="hub name, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf-file", help="GGUF file inside the MODEL folder or hub repo")
    parser.add_argument("--relations", nargs="+", metavar="NAME_OR_PATH",
                        help="bundled relation names, files (our JSON, LRE JSON, CSV), folders or hf:DATASET")
    parser.add_argument("--layers", default="every:3", help="all | every:K | comma list like 0,6,12 | -1")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-facts", type=int, help="keep the first N facts of each relation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off)")


def _probe(args) -> int:
    from .probe import probe, summary_table

    analyses = tuple(a for a in (args.analyses or "").split(",") if a)
    report = probe(args.model, gguf_file=args.gguf_file, relations=args.relations, layers=args.layers,
                   analyses=analyses, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                   max_facts=args.max_facts, seed=args.seed, out=args.out, trust_remote_code=args.trust_remote_code)
    print(summary_table(report))
    for error in report["errors"]:
        print(f"warning: {error}", file=sys.stderr)
    print(f"report: {os.path.join(args.out, 'report.json')} ({report['wall_seconds']} s)")
    return 0


def _run(args) -> int:
    from .probe import summary_table
    from .run import run

    report = run(args.model, out=args.out, relations=args.relations, layers=args.layers,
                 analyses=tuple(a for a in args.analyses.split(",") if a), device=args.device, dtype=args.dtype,
                 max_facts=args.max_facts, seed=args.seed, controls=not args.no_controls,
                 at_model_width=not args.no_model_width, gguf_file=args.gguf_file,
                 trust_remote_code=args.trust_remote_code)
    print(summary_table(report))
    for control in report.get("controls", []):
        r2 = control["analyses"]["superposition"]["layers"]["0"]["r2"]
        print(f"{control['label']:<36} train acc {control['train']['accuracy']:.3f}  "
              f"bits/param {control['train']['bits_per_param']:.3g}  superposition R^2 {r2['value']:.3f} "
              f"(shuffled {r2['control']['value']:.3f})")
    for error in report["errors"]:
        print(f"warning: {error}", file=sys.stderr)
    print(f"report: {os.path.join(args.out, 'report.html')} (and report.json, report.md, metrics.csv; "
          f"{report['wall_seconds']} s)")
    return 0


def _formats(text: str) -> tuple[str, ...]:
    return tuple(f.strip() for f in text.split(",") if f.strip())


def _compare(args) -> int:
    from .report import compare

    for path in compare(args.dirs, args.out, _formats(args.format)):
        print(path)
    return 0


def _report(args) -> int:
    from .report import export

    for path in export(args.dir, _formats(args.format), args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmprobe", description="Measure how language models store facts.")
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("probe", help="known facts (and analyses) of a pretrained model -> report.json")
    _add_model_args(probe)
    probe.add_argument("--analyses", default="", help="comma list of lre,ridge,superposition (default: none)")
    probe.add_argument("--out", default="runs/probe", help="output folder")
    probe.set_defaults(func=_probe)
    run = commands.add_parser("run", help="the main job: probe + matched synthetic controls -> one report")
    _add_model_args(run)
    run.add_argument("--analyses", default="lre,ridge,superposition", help="comma list (default: all three)")
    run.add_argument("--no-controls", action="store_true", help="skip the matched synthetic controls")
    run.add_argument("--no-model-width", action="store_true",
                     help="train controls only at the threshold d*, not also at the model's d_model")
    run.add_argument("--out", default="runs/main", help="output folder")
    run.set_defaults(func=_run)
    compare = commands.add_parser("compare", help="side-by-side page of several report folders")
    compare.add_argument("dirs", nargs="+", help="report folders (each with report.json)")
    compare.add_argument("--out", required=True, help="output folder")
    compare.add_argument("--format", default="html,md,csv", help="comma list of html, md, json, csv")
    compare.set_defaults(func=_compare)
    report = commands.add_parser("report", help="export a report folder as html, md, json or csv")
    report.add_argument("dir", help="report folder (with report.json)")
    report.add_argument("--format", default="html,md,csv", help="comma list of html, md, json, csv")
    report.add_argument("--out", help="output folder (default: the report folder)")
    report.set_defaults(func=_report)

    from synthetic.analyze import add_analyze_parser
    from synthetic.cli import add_parser as add_synth

    synth = add_synth(commands)
    add_analyze_parser(synth.synth_subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    from .datasets import DatasetError
    from .loading import ModelLoadError

    try:
        return args.func(args) or 0
    except (ModelLoadError, DatasetError, ValueError, KeyError, FileNotFoundError) as error:
        print(f"llmprobe: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # CUDA out of memory included
        if "out of memory" not in str(error).lower():
            raise
        print(f"llmprobe: error: out of memory ({error}). Try a smaller --batch-size, --dtype bfloat16, fewer "
              f"--layers, or --device cpu. Results already written are kept.", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
