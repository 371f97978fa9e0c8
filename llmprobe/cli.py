"""The ``llmprobe`` command line: the parser (layer 6; the handlers are ``llmprobe.commands``).

Parsing and ``--help`` load no torch, scikit-learn or transformers: the handlers (``llmprobe.commands``), the
``synth`` group (``synthetic.cli``) and the plan's presets (``llmprobe.jobs.workload``) are imported by module name
(``importlib``, as ``llmprobe/__init__.py`` does) only when the command needs them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from llmprobe import __version__
from llmprobe.checks import (
    DEVICE_MAPS,
    DTYPES,
    QUANTIZE,
    UsageError,
    argparse_type,
    layer_spec,
    parse_max_memory,
    positive_int,
    report_formats,
)
from llmprobe.datasets import LRE_CATEGORIES, list_bundled
from llmprobe.names import ANALYSES, PROTOCOLS
from llmprobe.settings import COMMAND_ANALYSES, Settings, json_object

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "run.model"   # the dest of the MODEL argument (every setting's flag has its settings key as dest)
COMMANDS = "llmprobe.commands"        # the handlers and run_command: the jobs, torch (seconds to import)
SYNTH = "synthetic.cli"               # the synth group's parser: its experiments, torch, scikit-learn
WORKLOAD = "llmprobe.jobs.workload"   # the plan's presets (PRESETS): the analyses, torch


def handler(name: str):
    """A subcommand's ``func``: the handler ``name`` of ``llmprobe.commands``, imported when the command runs."""
    def run(args):
        return getattr(importlib.import_module(COMMANDS), name)(args)
    run.__name__ = run.__qualname__ = name
    return run


def positive(name: str):
    return argparse_type(lambda text: positive_int(text, name))


def _layers(text: str) -> str:
    layer_spec(text)
    return text


def _max_memory(text: str) -> str:
    try:
        parse_max_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _jacobian_rank(text: str) -> int | str:
    if text in ("auto", "full"):
        return text
    try:
        return positive_int(text, "--jacobian-rank")
    except UsageError as error:
        raise argparse.ArgumentTypeError(f"{error} (or auto, full)") from None


def _names(text: str) -> tuple[str, ...]:
    """``"lre, ridge"`` -> ("lre", "ridge") (the names are checked with the settings)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


# Every flag that sets a setting: (flag, settings key, commands, argparse options). Its dest is the settings key
# (llmprobe.commands.settings_of reads them); a flag not given leaves its setting to --config/--set. The help ends with the
# setting's default.
SETTING_FLAGS = (
    ("--gguf-file", "run.gguf_file", ("probe", "run"), {"help": "GGUF file inside the MODEL folder or hub repo"}),
    ("--relations", "run.relations", ("probe", "run"), {
        "nargs": "+", "metavar": "NAME_OR_PATH",
        "help": f"bundled relation names ({', '.join(list_bundled())}), files (our JSON, LRE JSON, CSV, JSON lines), "
                f"folders, hf:DATASET[:SPLIT] (see --hf-kwargs), or the bundled LRE dataset: lre:all, "
                f"lre:{'|'.join(LRE_CATEGORIES)} or lre:NAME, NAME one of "
                f"{', '.join(name[4:] for name in list_bundled(include_lre=True) if name.startswith('lre:'))}"}),
    ("--hf-kwargs", "run.hf_kwargs", ("probe", "run"), {
        "type": argparse_type(lambda text: json_object(text, "--hf-kwargs")), "metavar": "JSON",
        "help": "keywords of datasets.load_dataset for the hf: relations, a JSON object, e.g. "
                "'{\"data_files\": \"facts.csv\"}' with --relations hf:csv"}),
    ("--layers", "run.layers", ("probe", "run"), {"type": argparse_type(_layers),
                                                  "help": "all | every:K | comma list like 0,6,12 | -1"}),
    ("--analyses", "run.analyses", ("probe", "run"), {
        "type": _names, "help": f"comma list of {','.join(ANALYSES)}; '' for known facts only"}),
    ("--device", "run.device", ("probe", "run"), {"help": "auto | cpu | cuda | cuda:N"}),
    ("--dtype", "run.dtype", ("probe", "run"), {"choices": DTYPES}),
    ("--batch-size", "run.batch_size", ("probe", "run"), {
        "type": positive("--batch-size"), "help": "prompts per forward pass of every batched stage"}),
    ("--max-facts", "run.max_facts", ("probe", "run"), {
        "type": positive("--max-facts"), "help": "keep the first N facts of each relation"}),
    ("--max-prompt-tokens", "run.max_prompt_tokens", ("probe", "run"), {
        "type": positive("--max-prompt-tokens"),
        "help": "skip (and list in errors) facts whose prompt is longer (default: the model's context)"}),
    ("--seed", "run.seed", ("probe", "run"), {"type": int}),
    ("--chat-template", "run.chat_template", ("probe", "run"), {
        "action": "store_const", "const": True,
        "help": "wrap every prompt in the model's chat template: a user turn asking to complete the sentence, then "
                "the prompt as the start of the assistant's answer (instruct models, prompted as they were trained)"}),
    ("--protocol", "analysis.protocol", ("probe", "run"), {
        "choices": PROTOCOLS,
        "help": "decoders: strict = zero-shot prompt, exact first token; lre = the LRE reference's protocol "
                "(in-context examples, its bias and prefix rule), to compare with published LRE tables"}),
    ("--n-icl", "analysis.n_icl", ("probe", "run"), {"type": positive("--n-icl"),
                                                     "help": "in-context examples of --protocol lre"}),
    ("--jacobian-rank", "analysis.jacobian_rank", ("probe", "run"), {
        "type": _jacobian_rank, "metavar": "auto|full|K",
        "help": "LRE Jacobians: full (exact, d_model backward passes per prompt), K (low-rank estimate of rank K: "
                "K+10 products per prompt, then 2(K+10) per layer) or auto (rank 128 where that costs less than "
                "exact, counting each product's blocks: exact on SmolLM2, low-rank from d_model ~ 650 with 3 "
                "spread LRE layers; docs/analyses.md); --protocol lre: exact unless K is given, as the reference"}),
    ("--device-map", "run.device_map", ("probe", "run"), {
        "choices": DEVICE_MAPS,
        "help": "spread the model's blocks over GPUs, CPU and disk through accelerate (replaces --device)"}),
    ("--max-memory", "run.max_memory", ("probe", "run"), {
        "action": "append", "type": _max_memory, "metavar": "DEVICE=SIZE",
        "help": "memory per device for --device-map, e.g. cpu=2GiB or 0=70GiB,cpu=8GiB (repeatable)"}),
    ("--offload-folder", "run.offload_folder", ("probe", "run"), {
        "metavar": "DIR", "help": "folder for the weights that fit in no device's --max-memory (read at each pass)"}),
    ("--quantize", "run.quantize", ("probe", "run"), {
        "choices": QUANTIZE, "help": "load the weights quantised by bitsandbytes (needs the package and CUDA)"}),
    ("--no-matched", "matched.enabled", ("run",), {"action": "store_const", "const": False,
                                                   "help": "skip the matched synthetic controls (also --no-controls)"}),
    ("--no-model-width", "matched.at_model_width", ("run",), {
        "action": "store_const", "const": False,
        "help": "train controls only at the threshold d*, not also at the model's d_model"}),
)

OLD_FLAGS = {"--no-matched": ("--no-controls",)}      # a flag's earlier spelling, still taken


def _default(command: str, key: str) -> str:
    """`` (default X)`` for a setting's help, from the settings' defaults ("" where there is none to say)."""
    section, name = key.split(".")
    value = COMMAND_ANALYSES[command] if key == "run.analyses" else getattr(getattr(Settings(), section), name)
    if isinstance(value, bool) or value is None:
        return ""
    return f" (default {','.join(value) or 'none'})" if isinstance(value, tuple) else f" (default {value})"


def _add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of SETTING_FLAGS that ``command`` takes, then --config and --set."""
    for flag, key, where, options in SETTING_FLAGS:
        if command in where:
            shown = {} if "choices" in options or "action" in options and "type" not in options else {
                "metavar": flag.lstrip("-").replace("-", "_").upper()}     # as argparse names a flag's value
            parser.add_argument(flag, *OLD_FLAGS.get(flag, ()), dest=key,
                                **{**shown, **options, "help": options.get("help", "") + _default(command, key)})
    _add_settings_args(parser, flags=True)


def _add_model_args(parser: argparse.ArgumentParser, command: str) -> None:
    """MODEL (several for ``run``), the setting flags and the flags that are not settings."""
    many = command == "run"
    parser.add_argument(MODEL, metavar="MODEL", nargs="*" if many else "?", default=None,
                        help="hub name, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
                             + ("; several: one report each and their compare page" if many else ""))
    parser.add_argument("--threads", type=positive("--threads"), help="torch CPU threads")
    parser.add_argument("--resume", action="store_true",
                        help="take finished stages from --out when model and settings match, instead of recomputing")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the result --out holds (only the files llmprobe wrote there, as its manifest.json "
                             "names them) instead of refusing; --resume continues it instead")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="allow pickle weights (pytorch_model.bin, loaded with weights_only=True); default: "
                             "safetensors only")
    _add_setting_flags(parser, command)


def _add_settings_args(parser: argparse.ArgumentParser, flags: bool) -> None:
    """--config and --set; ``flags``: the command also has setting flags (--layers, ...), which override both."""
    parser.add_argument("--config", metavar="FILE.toml",
                        help="settings file with [run], [analysis] and [matched] tables (docs/config.md lists every "
                             "key); --set " + ("and the setting flags above override it" if flags else "overrides it"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                        help="one setting, e.g. --set analysis.n_splits=5 or --set 'analysis.ridge_alphas=[0.1, 1]' "
                             "(a TOML value; repeatable)" + ("; the setting flags override it" if flags else ""))


def build_parser(synth: bool = True, presets: bool = True) -> argparse.ArgumentParser:
    """The whole command line. ``synth=False`` puts a stub in place of the ``synth`` group, whose modules take
    seconds to import (torch, scikit-learn): main() builds the group only for ``llmprobe synth ...``, so the
    other commands check their options and output folder at once. ``presets=False`` leaves the presets' names out
    of the plan's description (``llmprobe plan --help``), for the same reason. The handlers are
    ``llmprobe.commands``', imported when a command runs (:func:`handler`)."""
    parser = argparse.ArgumentParser(prog="llmprobe", description="Measure how language models store facts.")
    parser.add_argument("--version", action="version", version=f"llmprobe {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("probe", help="known facts, decoders and readouts of a pretrained model -> "
                                              "report.html, report.json (no matched controls: see run)")
    _add_model_args(probe, "probe")
    probe.add_argument("--out", default="runs/probe", help="output folder (default runs/probe)")
    probe.set_defaults(func=handler("_probe"))
    run = commands.add_parser("run", help="the main job: probe + matched synthetic controls -> one report")
    _add_model_args(run, "run")
    run.add_argument("--out", default="runs/main", help="output folder (default runs/main; with several models: one "
                                                        "folder each in it, and compare/)")
    run.add_argument("--executor", choices=["process", "ray"], default="process",
                     help="several models: one after the other here (default) or one Ray task each")
    run.add_argument("--address", help="with --executor ray: the Ray cluster to join (default: Ray on this machine)")
    run.set_defaults(func=handler("_run"))
    plan = commands.add_parser("plan", help="the predicted time and peak memory of each stage of run, on this CPU and "
                                            "one H200, from the model's config (no weights read)",
                               description="Predict `llmprobe run` with the same options from the model's config "
                                           "(docs/scaling.md, 'A plan before it starts'). MODEL: as for run, or a "
                                           f"preset ({preset_names() if presets else 'llmprobe plan --help names them'})"
                                           ". --device cpu: this CPU only; h200 or cuda: one H200 only; auto (default): "
                                           "both. A run's whole command line is taken as it is: its --out, --executor "
                                           "and --address change nothing.")
    _add_model_args(plan, "run")
    # run's flags that say where and how to run, taken so that a run's command line can be planned as it is;
    # they change no prediction, so the help does not list them
    plan.add_argument("--out", dest="run_out", help=argparse.SUPPRESS)
    plan.add_argument("--executor", dest="run_executor", choices=["process", "ray"], help=argparse.SUPPRESS)
    plan.add_argument("--address", dest="run_address", help=argparse.SUPPRESS)
    plan.set_defaults(func=handler("_plan"))
    compare = commands.add_parser("compare", help="side-by-side page of several report folders")
    compare.add_argument("dirs", nargs="+", help="report folders (each with report.json)")
    compare.add_argument("--out", required=True, help="output folder")
    compare.add_argument("--format", default="html,md,csv", type=argparse_type(report_formats),
                         help="comma list of html, md, json, csv (default html,md,csv)")
    compare.add_argument("--overwrite", action="store_true",
                         help="replace the run --out holds (only the files llmprobe wrote there, as its "
                              "manifest.json names them) instead of refusing")
    compare.set_defaults(func=handler("_compare"))
    report = commands.add_parser("report", help="export a report folder as html, md, json or csv")
    report.add_argument("dir", help="report folder (with report.json)")
    report.add_argument("--format", default="html,md,csv", type=argparse_type(report_formats),
                        help="comma list of html, md, json, csv (default html,md,csv)")
    report.add_argument("--out", help="output folder (default: the report folder)")
    report.add_argument("--overwrite", action="store_true",
                        help="replace the run --out holds (only the files llmprobe wrote there, as its manifest.json "
                             "names them) instead of refusing")
    report.set_defaults(func=handler("_report"))
    rerun = commands.add_parser("rerun", help="repeat the probe or run of a report folder with its recorded settings "
                                              "and say whether the numbers match (exit 1 when they differ)")
    rerun.add_argument("dir", help="report folder (with report.json)")
    rerun.add_argument("--out", help="output folder (default: DIR-rerun)")
    rerun.add_argument("--allow-different-weights", action="store_true",
                       help="rerun even when the model's weights hash differs from the recorded one")
    rerun.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off)")
    rerun.add_argument("--allow-pickle", action="store_true", help="allow pickle weights (off)")
    rerun.set_defaults(func=handler("_rerun"))
    models = commands.add_parser("models", help="supported model families, their hook places and what the tests "
                                                "check for each")
    models.add_argument("--json", action="store_true", help="JSON instead of text")
    models.set_defaults(func=handler("_models"))
    config = commands.add_parser("config", help="print the settings probe and run would use (defaults <- --config "
                                                "<- --set) as a TOML file")
    _add_settings_args(config, flags=False)
    config.set_defaults(func=handler("_config"))

    if not synth:
        commands.add_parser("synth", help="synthetic factual recall: train, sweep, construct, bounds, analyze, "
                                          "multihop")
        return parser

    importlib.import_module(SYNTH).add_parser(commands)
    return parser


def preset_names() -> str:
    """The plan's presets (``llmprobe.jobs.workload.PRESETS``), comma separated."""
    return ", ".join(importlib.import_module(WORKLOAD).PRESETS)


def main(argv: list[str] | None = None) -> int:
    """``llmprobe ...``: returns the exit status (argparse exits 2 itself on a bad option)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    args = build_parser(synth=command == "synth", presets=command == "plan").parse_args(argv)
    return importlib.import_module(COMMANDS).run_command(args)


if __name__ == "__main__":
    sys.exit(main())
