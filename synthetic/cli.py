"""``llmprobe synth train|sweep|construct|bounds`` (``llmprobe/cli.py`` wires :func:`add_parser` in; ``analyze``
and ``multihop`` join the group through ``parser.synth_subparsers``)."""
from __future__ import annotations

import argparse
import os
import sys

from llmprobe import io as llmio
from llmprobe.checks import UsageError, positive_int
from synthetic.bounds import summary
from synthetic.construction import smallest_construction
from synthetic.sweep import SweepConfig, plot, run_sweep, summarize, table_markdown
from synthetic.tasks import load_facts, random_bijections, random_khop
from synthetic.train import TrainConfig, train


def _ints(text: str, minimum: int = 1) -> list[int]:
    """``"256,512"`` -> [256, 512]; every item a whole number >= ``minimum`` (UsageError otherwise)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"empty list {text!r}: give comma-separated whole numbers")
    return [positive_int(x, f"each value of {text!r}", minimum=minimum) for x in items]


def _positive(name: str):
    """argparse type: a whole number >= 1 (argparse's usage error, status 2, otherwise)."""
    def convert(text):
        try:
            return positive_int(text, name)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert


def _int_list(text: str) -> str:
    """argparse type checking a comma list of whole numbers >= 1 (kept as text for the commands)."""
    try:
        _ints(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _train_config_args(p: argparse.ArgumentParser, max_steps: int) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument("--max-steps", type=_positive("--max-steps"), default=max_steps,
                   help="step cap (default %(default)s)")
    g.add_argument("--batch-size", type=_positive("--batch-size"), default=None,
                   help="minibatch size (default: full batch)")
    g.add_argument("--warmup-frac", type=float, default=0.1)
    g.add_argument("--min-lr-frac", type=float, default=0.01)
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="Adam weight decay (default 0; 1e-4 makes the trained geometry readable, see docs/mechanisms.md)")
    g.add_argument("--target-acc", type=float, default=1.0, help="stop (and count success) at this train accuracy")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    g.add_argument("--threads", type=_positive("--threads"), default=None, help="torch CPU threads")


def _train_config(args, progress: bool):
    return TrainConfig(lr=args.lr, max_steps=args.max_steps, batch_size=args.batch_size,
                       warmup_frac=args.warmup_frac, min_lr_frac=args.min_lr_frac, target_acc=args.target_acc,
                       weight_decay=args.weight_decay,
                       device=args.device, threads=args.threads, progress=progress)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``synth`` command group to an argparse ``subparsers`` object; returns the group's parser.
    Its own sub-subparsers are at ``parser.synth_subparsers`` for later additions (e.g. ``analyze``)."""
    synth = subparsers.add_parser("synth", help="synthetic factual recall: train, sweep, construct, bounds",
                                  description="Synthetic factual-recall models (one-layer transformer).")
    sub = synth.add_subparsers(dest="synth_command", metavar="{train,sweep,construct,bounds,...}")
    synth.synth_subparsers = sub
    synth.set_defaults(func=lambda args: _missing_subcommand(synth))

    # ---------------------------------------------------------------- train
    p = sub.add_parser("train", help="train one model to 100%% train accuracy",
                       description="Train one model; resumes automatically when --out holds a checkpoint.")
    p.add_argument("--subjects", "-N", type=_positive("--subjects"), default=None, help="number of subjects N")
    p.add_argument("--relations", "-R", type=_positive("--relations"), default=None, help="number of relations R")
    p.add_argument("--d", type=_positive("--d"), required=True, help="embedding width d")
    p.add_argument("--mlp-width", type=_positive("--mlp-width"), default=None, help="MLP width m (default 8d)")
    p.add_argument("--attention", choices=["uniform", "learned"], default="uniform",
                   help="uniform causal mean (the paper's simplest case) or one learned softmax head")
    p.add_argument("--frozen-subjects", action="store_true", help="freeze subject embeddings at random init")
    p.add_argument("--frozen-unembed", action="store_true", help="also freeze the attribute unembedding")
    p.add_argument("--hops", type=_positive("--hops"), default=1, help="k-hop queries (s, r1..rk)")
    p.add_argument("--cot", action="store_true", help="chain-of-thought: emit every intermediate entity")
    p.add_argument("--sequences", type=_positive("--sequences"), default=None,
                   help="k-hop: number of relation sequences (default all)")
    p.add_argument("--facts", default=None,
                   help="fact table: task JSON, or relation names/paths for llmprobe's loaders (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --out and start over")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="run directory (checkpoints, run.json)")
    _train_config_args(p, max_steps=3000)
    p.set_defaults(func=cmd_train)

    # ---------------------------------------------------------------- sweep
    p = sub.add_parser("sweep", help="capacity sweep: threshold d* per (N, R) by bisection",
                       description="Bisection on d for every (N, R, seed, trainable/frozen); resumable.")
    p.add_argument("--subjects", default="256,512", type=_int_list,
                   help="comma-separated N values (default: a small grid, ~4 min of CPU; the README's full grid is "
                        "256,512,1024 x 2,4,8,16 x seeds 0,1, ~31 min on 2 cores with --workers 2)")
    p.add_argument("--relations", default="2,4,8", type=_int_list, help="comma-separated R values")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--frozen-subjects", action="store_true", help="only the frozen regime")
    p.add_argument("--trainable-only", action="store_true", help="only the trainable regime")
    p.add_argument("--modes", default=None,
                   help="comma-separated modes instead: trainable, frozen, frozen_all (subjects and unembedding)")
    p.add_argument("--mlp-ratio", type=float, default=8.0, help="MLP width = ratio * d (default %(default)s)")
    p.add_argument("--mlp-width", type=_positive("--mlp-width"), default=None,
                   help="fixed MLP width instead of a ratio")
    p.add_argument("--attention", choices=["uniform", "learned"], default="uniform")
    p.add_argument("--d-min", type=_positive("--d-min"), default=2)
    p.add_argument("--d-max", type=_positive("--d-max"), default=512)
    p.add_argument("--workers", type=_positive("--workers"), default=1, help="parallel worker processes")
    p.add_argument("--batched", action=argparse.BooleanOptionalAction, default=True,
                   help="train every (seed, mode) search of an (N, R) together, one batched model stack per round "
                        "(default; 1.85x faster on this CPU, docs/synthetic.md); --no-batched: one model at a time, "
                        "each later seed starting from the previous seed's d* (how the published grid was run)")
    p.add_argument("--per-round", type=_positive("--per-round"), default=1,
                   help="batched: widths each search trains per bisection round (default 1; more: fewer rounds, "
                        "more points -- pays where a round's models cost little more than one, e.g. a GPU)")
    p.add_argument("--extrapolate", action="store_true",
                   help="batched: start each (N, R, mode) search from d* extrapolated linearly in log2 N from the "
                        "smaller N already in --out (fewer points at large N; the search still confirms d*)")
    p.add_argument("--executor", choices=["process", "ray"], default="process",
                   help="run sweep units in local processes (default) or as Ray tasks (retried when a worker dies)")
    p.add_argument("--address", default=None,
                   help="with --executor ray: the Ray cluster to join (default: start Ray on this machine)")
    p.add_argument("--img-dir", default=None,
                   help="also write the plots here as synthetic_*.png (e.g. docs/img)")
    p.add_argument("--report-only", action="store_true", help="train nothing: summarise, tabulate and plot --out")
    p.add_argument("--out", required=True, help="sweep directory (results.jsonl, summary.json, table.md, plots)")
    _train_config_args(p, max_steps=500)
    p.set_defaults(func=cmd_sweep, threads=1)

    # ---------------------------------------------------------------- construct
    p = sub.add_parser("construct", help="explicit construction: smallest d reaching 100%% without training")
    p.add_argument("--subjects", default="256,512,1024", type=_int_list)
    p.add_argument("--relations", default="2,4,8,16", type=_int_list)
    p.add_argument("--codes", choices=["sphere", "binary"], default="sphere")
    p.add_argument("--variant", choices=["erase", "extract"], default="erase")
    p.add_argument("--precision-bits", type=int, default=8, help="quantise weights first (0 = float32)")
    p.add_argument("--out", default=None, help="write construction.json here")
    p.set_defaults(func=cmd_construct)

    # ---------------------------------------------------------------- bounds
    p = sub.add_parser("bounds", help="counting bounds: bits needed vs parameters")
    p.add_argument("--subjects", "-N", type=_positive("--subjects"), required=True)
    p.add_argument("--relations", "-R", type=_positive("--relations"), required=True)
    p.add_argument("--hops", type=_positive("--hops"), default=1)
    p.add_argument("--bits-per-param", type=float, default=2.0)
    p.set_defaults(func=cmd_bounds)
    return synth


# ----------------------------------------------------------------------------- commands
def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _task_from_args(args):
    if args.facts:
        if args.hops > 1:
            raise UsageError("--facts and --hops > 1 cannot be combined")
        return load_facts(args.facts)
    if not args.subjects or not args.relations:
        raise UsageError("give --subjects and --relations (or --facts)")
    if args.hops > 1:
        return random_khop(args.subjects, args.relations, args.hops, cot=args.cot, seed=args.seed,
                           n_sequences=args.sequences)
    return random_bijections(args.subjects, args.relations, args.seed)


def cmd_train(args) -> dict:
    task = _task_from_args(args)
    m = args.mlp_width or 8 * args.d
    # Ctrl-C / SIGTERM raise KeyboardInterrupt (llmprobe.cli.run_command): train() checkpoints, the CLI exits 130
    res = train(task, args.d, config=_train_config(args, progress=not args.no_progress), out_dir=args.out,
                resume=not args.fresh, frozen_subjects=args.frozen_subjects,
                frozen_unembed=args.frozen_unembed, d_mlp=m, attention=args.attention,
                seed=args.seed)
    out = res.to_dict()
    out.pop("history", None)
    out.pop("train", None)
    print(f"{'reached' if res.success else 'did not reach'} {args.target_acc:.0%} train accuracy: accuracy "
          f"{res.accuracy:.4f} after {res.steps} steps ({res.wall_time_s:.1f} s); d={res.d_model}, "
          f"m={res.d_mlp}, {res.n_trainable} trainable parameters, {res.bits_per_param:.3g} bits/param")
    print(f"run: {os.path.join(args.out, 'run.json')}")
    return out


def cmd_sweep(args) -> dict:
    modes = ["trainable", "frozen"]
    if args.modes:
        modes = [m for m in args.modes.split(",") if m]
    elif args.frozen_subjects:
        modes = ["frozen"]
    elif args.trainable_only:
        modes = ["trainable"]
    cfg = SweepConfig(subjects=_ints(args.subjects), relations=_ints(args.relations), seeds=_ints(args.seeds, minimum=0),
                      modes=modes, mlp_ratio=args.mlp_ratio, d_mlp=args.mlp_width, attention=args.attention,
                      d_min=args.d_min, d_max=args.d_max, workers=args.workers, threads=args.threads or 1,
                      batched=args.batched, executor=args.executor, address=args.address,
                      per_round=args.per_round, extrapolate=args.extrapolate, train=_train_config(args, progress=False))
    if args.address and args.executor != "ray":
        raise UsageError("--address is for --executor ray")
    if args.report_only:
        summary = summarize(args.out, cfg)
        plot(args.out, summary)
    else:
        summary = run_sweep(cfg, args.out)
    if args.img_dir:
        plot(args.out, summary, img_dir=args.img_dir, prefix="synthetic_")
    print(table_markdown(summary))
    return summary


def cmd_construct(args) -> list:
    rows = []
    for N in _ints(args.subjects):
        for R in _ints(args.relations):
            r = smallest_construction(N, R, codes=args.codes, variant=args.variant,
                                      precision_bits=args.precision_bits or None)
            rows.append(r)
            print(f"N={N:5d} R={R:3d}  b={r['b']}  d={r['d_model']}  m={r['d_mlp']}  acc={r['accuracy']:.4f}",
                  flush=True)
    if args.out:
        llmio.write_json(os.path.join(args.out, "construction.json"), rows)   # atomic
    return rows


def cmd_bounds(args) -> dict:
    out = summary(args.subjects, args.relations, hops=args.hops, bits_per_param=args.bits_per_param)
    for key, value in out.items():
        print(f"{key:<20} {value:.6g}" if isinstance(value, float) else f"{key:<20} {value}")
    return out
