"""Every ``llmprobe synth`` subcommand: train, sweep, construct, bounds, analyze, swap-sweep, multihop,
multihop-seeds. ``llmprobe/cli.py`` calls :func:`add_parser` once; the parsing and the commands live here, the
experiments in their modules (no command line there) and their figures in :mod:`synthetic.render`."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from llmprobe import io as llmio
from llmprobe.checks import UsageError, argparse_type, int_list, positive_int, tcp_address
from synthetic.analyze import ANALYSIS, DEFAULT_TRAIN, NULLS, analyze
from synthetic.bounds import summary
from synthetic.construction import smallest_construction
from synthetic.multihop import (
    D_GRID,
    M_GRID,
    SEEDS_FILE,
    MultihopConfig,
    SeedsConfig,
    run_multihop,
    run_seeds,
    seeds_markdown,
)
from synthetic.multihop import table_markdown as multihop_markdown
from synthetic.render import multihop_figure, seeds_figure, swap_sweep_figure, sweep_figures
from synthetic.swap import summarize_sweep, swap_sweep, sweep_markdown, sweep_points
from synthetic.sweep import SweepConfig, load_results, run_sweep, summarize, table_markdown
from synthetic.tasks import load_facts, random_bijections, random_khop
from synthetic.train import TrainConfig, train


def _positive(name: str):
    """argparse type: a whole number >= 1."""
    return argparse_type(lambda text: positive_int(text, name))


def _int_text(name: str, minimum: int = 1):
    """argparse type: a comma list of whole numbers >= ``minimum`` (:func:`llmprobe.checks.int_list`), kept as
    text for the command, which reads it with the same function."""
    def check(text: str) -> str:
        int_list(text, name, minimum)
        return text
    return argparse_type(check)


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
    """Add the ``synth`` command group, with every subcommand, to an argparse ``subparsers`` object; returns the
    group's parser (its own sub-subparsers at ``parser.synth_subparsers``)."""
    synth = subparsers.add_parser("synth", help="synthetic factual recall: train, sweep, construct, bounds, analyze, "
                                                "swap-sweep, multihop, multihop-seeds",
                                  description="Synthetic factual-recall models (one-layer transformer).")
    sub = synth.add_subparsers(dest="synth_command", metavar="{train,sweep,construct,bounds,analyze,...}")
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
    p.add_argument("--subjects", default="256,512", type=_int_text("--subjects"),
                   help="comma-separated N values (default: a small grid, ~4 min of CPU; docs/runs.md's full grid is "
                        "256,512,1024 x 2,4,8,16 x seeds 0,1, over 38 min on 2 cores with --workers 2: docs/synthetic.md)")
    p.add_argument("--relations", default="2,4,8", type=_int_text("--relations"), help="comma-separated R values")
    p.add_argument("--seeds", default="0", type=_int_text("--seeds", minimum=0), help="comma-separated seeds")
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
    p.add_argument("--subjects", default="256,512,1024", type=_int_text("--subjects"))
    p.add_argument("--relations", default="2,4,8,16", type=_int_text("--relations"))
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
    _add_analyze(sub)
    _add_swap_sweep(sub)
    _add_multihop(sub)
    _add_multihop_seeds(sub)
    return synth


def _add_analyze(sub) -> None:
    p = sub.add_parser(
        "analyze", help="mechanisms of a trained run: readouts, selector, freeze-and-swap, with controls",
        description="Superposition readouts of e_s, MLP selector interventions and freeze-and-swap for the run in "
                    "RUN_DIR, beside the frozen and frozen_all controls trained on the same table. Writes "
                    "RUN_DIR/analysis.json, analysis.md and plots. An empty RUN_DIR is trained first "
                    "(--subjects, --relations, --d).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--nulls", "--controls", dest="nulls", default=",".join(NULLS),
                   help="comma list of frozen,frozen_all ('' = none; default %(default)s)")
    p.add_argument("--no-swap", action="store_true", help="skip freeze-and-swap")
    p.add_argument("--swap-steps", default="0,10,25,50,100", type=_int_text("--swap-steps", minimum=0),
                   help="step counts to report (default %(default)s)")
    p.add_argument("--swap-lr", type=float, default=0.03)
    p.add_argument("--n-boot", type=int, default=500, help="bootstrap resamples for the intervals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--img-dir", default=None, help="also write the plots here as mech_*.png (e.g. docs/img)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g = p.add_argument_group("training an empty RUN_DIR first")
    g.add_argument("--subjects", "-N", type=int, default=None)
    g.add_argument("--relations", "-R", type=int, default=None)
    g.add_argument("--d", type=int, default=None)
    g.add_argument("--mlp-width", type=int, default=None, help="default 8d (the model default)")
    g.add_argument("--attention", choices=["uniform", "learned"], default="uniform")
    g.add_argument("--lr", type=float, default=DEFAULT_TRAIN["lr"])
    g.add_argument("--max-steps", type=int, default=DEFAULT_TRAIN["max_steps"])
    g.add_argument("--weight-decay", type=float, default=DEFAULT_TRAIN["weight_decay"])
    g.add_argument("--stop-at-100", action="store_true",
                   help="stop at 100%% train accuracy instead of training all --max-steps")
    p.set_defaults(func=cmd_analyze)


def _add_swap_sweep(sub) -> None:
    q = sub.add_parser(
        "swap-sweep", help="freeze-and-swap over d/d*, seeds, encoders and training settings",
        description="Train one-hop models at d = ratio * d* (d* from docs/synthetic.md), freeze them and swap in "
                    "subject embeddings of new random bijections (encoders: least-squares fit, the construction's "
                    "rule, random re-init; plus the construction's own model). Resumable: OUT/results.jsonl; "
                    "OUT/summary.json; --img draws the figure.")
    q.add_argument("out", metavar="OUT")
    q.add_argument("--subjects", "-N", default="256", type=_int_text("--subjects"),
                   help="comma list (default %(default)s)")
    q.add_argument("--relations", "-R", default="4", type=_int_text("--relations"),
                   help="comma list (default %(default)s)")
    q.add_argument("--ratios", default="1,2,4,8", help="d/d* values (default %(default)s)")
    q.add_argument("--seeds", default="0,1,2", type=_int_text("--seeds", minimum=0),
                   help="table and init seeds (default %(default)s)")
    q.add_argument("--modes", default="trainable,frozen", help="trainable,frozen,frozen_unembed")
    q.add_argument("--attributes", type=int, default=None,
                   help="many-to-one maps onto this many shared attributes instead of bijections")
    q.add_argument("--weight-decay", type=float, default=DEFAULT_TRAIN["weight_decay"])
    q.add_argument("--max-steps", type=int, default=DEFAULT_TRAIN["max_steps"])
    q.add_argument("--stop-at-100", action="store_true")
    q.add_argument("--steps", default="0,10,25,50,100,300", type=_int_text("--steps", minimum=0),
                   help="embedding-training steps to report")
    q.add_argument("--swap-lr", type=float, default=0.03)
    q.add_argument("--no-control", action="store_true", help="skip the construction positive control")
    q.add_argument("--img", default=None, help="write the figure here (e.g. docs/img/mech_swap_ratio.png)")
    q.add_argument("--plot-only", action="store_true",
                   help="train nothing: re-summarise OUT/results.jsonl (and draw with --img)")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    q.set_defaults(func=cmd_swap_sweep)


def _add_multihop(sub) -> None:
    p = sub.add_parser(
        "multihop", help="k-hop: smallest d reaching 100%% with and without chain-of-thought",
        description="Trains one-layer models on k-hop queries and finds the smallest width d (and MLP width) that "
                    "reaches 100%, with and without chain-of-thought. Resumable (points.jsonl in --out).")
    p.add_argument("--subjects", "-N", type=int, default=64)
    p.add_argument("--relations", "-R", type=int, default=2)
    p.add_argument("--hops", default="1,2,3", type=_int_text("--hops"), help="comma list of k (default %(default)s)")
    p.add_argument("--d-grid", default=",".join(map(str, D_GRID)), type=_int_text("--d-grid"))
    p.add_argument("--mlp-ratio", type=float, default=4.0, help="d_mlp = ratio * d in the d* search")
    p.add_argument("--width-hops", type=int, default=2, help="k of the MLP-width sweep")
    p.add_argument("--width-d", default="8,16,32", help="d values of the MLP-width sweep ('' = skip)")
    p.add_argument("--m-grid", default=",".join(map(str, M_GRID)), type=_int_text("--m-grid"))
    p.add_argument("--attention", choices=["uniform", "learned"], default="learned")
    p.add_argument("--restarts", type=int, default=1, help="model seeds per point (success = any)")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--img-dir", default=None, help="also write the plot here as mech_multihop.png")
    p.add_argument("--out", required=True, help="output folder (points.jsonl, summary.json, table.md, plot)")
    p.set_defaults(func=cmd_multihop)


def _add_multihop_seeds(sub) -> None:
    p = sub.add_parser(
        "multihop-seeds", help="k-hop: d* per k, CoT, R and seed, with the growth fit d* ~ R^b",
        description="d* (smallest d reaching 100%%) for every k x CoT x R x seed (seed = fact table + init; the "
                    "seeds of a cell trained together), then log d* = a + b log R per k with a bootstrap interval "
                    "over seeds within R. Resumable (points.jsonl in --out); writes seeds.json, seeds.md and the "
                    "figure.")
    p.add_argument("--subjects", "-N", type=int, default=16)
    p.add_argument("--relations", "-R", default="2,4,8", type=_int_text("--relations"),
                   help="comma list of R (default %(default)s)")
    p.add_argument("--hops", default="1,2,3", type=_int_text("--hops"), help="comma list of k (default %(default)s)")
    p.add_argument("--seeds", default="0,1,2", type=_int_text("--seeds", minimum=0),
                   help="comma list of seeds (default %(default)s)")
    p.add_argument("--d-grid", default=",".join(map(str, D_GRID)), type=_int_text("--d-grid"))
    p.add_argument("--mlp-ratio", type=float, default=4.0, help="d_mlp = ratio * d")
    p.add_argument("--attention", choices=["uniform", "learned"], default="learned")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cot", default="no,yes", help="which cells: no,yes (default), no or yes (one-hop without CoT "
                                                    "is always searched)")
    p.add_argument("--no-train", action="store_true", help="summarise the points in --out only (open searches "
                                                            "end bracketed by the points trained so far)")
    p.add_argument("--img", default=None, help="also write the figure to this path")
    p.add_argument("--out", required=True, help="output folder (points.jsonl, seeds.json, seeds.md, seeds.png)")
    p.set_defaults(func=cmd_multihop_seeds)


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
    # Ctrl-C / SIGTERM raise KeyboardInterrupt (llmprobe.commands.run_command): train() checkpoints, the CLI exits 130
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
    cfg = SweepConfig(subjects=int_list(args.subjects, "--subjects"), relations=int_list(args.relations, "--relations"),
                      seeds=int_list(args.seeds, "--seeds", minimum=0),
                      modes=modes, mlp_ratio=args.mlp_ratio, d_mlp=args.mlp_width, attention=args.attention,
                      d_min=args.d_min, d_max=args.d_max, workers=args.workers, threads=args.threads or 1,
                      batched=args.batched, executor=args.executor, address=args.address,
                      per_round=args.per_round, extrapolate=args.extrapolate, train=_train_config(args, progress=False))
    if args.address and args.executor != "ray":
        raise UsageError("--address is for --executor ray")
    if args.address and not args.report_only:      # Ray's own failure is minutes of warnings
        tcp_address(args.address, "--address", "start the Ray cluster there first (ray start --head) and give the "
                    "address it prints, or leave --address out to start Ray on this machine")
    if args.report_only:
        summary = summarize(args.out, cfg)
        sweep_figures(load_results(args.out), summary, args.out)
    else:
        summary = run_sweep(cfg, args.out)
    if args.img_dir:
        sweep_figures(load_results(args.out), summary, args.img_dir, prefix="synthetic_")
    print(table_markdown(summary))
    return summary


def cmd_construct(args) -> list:
    rows = []
    for N in int_list(args.subjects, "--subjects"):
        for R in int_list(args.relations, "--relations"):
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


def cmd_analyze(args) -> dict:
    spec = None
    if args.subjects and args.relations and args.d:
        spec = {"subjects": args.subjects, "relations": args.relations, "d": args.d, "seed": args.seed,
                "d_mlp": args.mlp_width, "attention": args.attention,
                "train_config": TrainConfig(lr=args.lr, max_steps=args.max_steps, weight_decay=args.weight_decay,
                                            target_acc=1.0 if args.stop_at_100 else 1.01, progress=False)}
    nulls = tuple(c for c in args.nulls.split(",") if c)
    unknown = set(nulls) - set(NULLS)
    if unknown:
        raise UsageError(f"unknown null model(s) {sorted(unknown)}; choose from {', '.join(NULLS)}")
    result = analyze(args.run_dir, nulls=nulls, swap=not args.no_swap, n_boot=args.n_boot, seed=args.seed,
                     swap_steps=tuple(int_list(args.swap_steps, "--swap-steps", minimum=0)), swap_lr=args.swap_lr,
                     plots=not args.no_plots, img_dir=args.img_dir, train_spec=spec)
    print(result["table_md"])
    print(f"analysis: {os.path.join(args.run_dir, ANALYSIS)} ({result['wall_s']} s)")
    return result


def cmd_swap_sweep(args) -> dict:
    if args.plot_only:
        summary = summarize_sweep(llmio.read_jsonl(os.path.join(args.out, "results.jsonl")))
        llmio.write_json(os.path.join(args.out, "summary.json"), summary)
    else:
        seeds = int_list(args.seeds, "--seeds", minimum=0)
        pts = sweep_points(int_list(args.subjects, "--subjects"), int_list(args.relations, "--relations"),
                           [float(x) for x in args.ratios.split(",") if x], seeds,
                           [m for m in args.modes.split(",") if m], args.weight_decay, args.max_steps,
                           args.stop_at_100, args.attributes)
        summary = swap_sweep(args.out, pts, steps=tuple(int_list(args.steps, "--steps", minimum=0)), lr=args.swap_lr,
                             control_seeds=() if args.no_control else tuple(seeds))
    if args.img:
        swap_sweep_figure(summary, args.img)
        print(f"figure: {args.img}")
    print(sweep_markdown(summary))
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['n_rows']} rows)")
    return summary


def cmd_multihop(args) -> dict:
    cfg = MultihopConfig(subjects=args.subjects, relations=args.relations, hops=int_list(args.hops, "--hops"),
                         seed=args.seed, restarts=args.restarts, attention=args.attention, mlp_ratio=args.mlp_ratio,
                         d_grid=int_list(args.d_grid, "--d-grid"), width_hops=args.width_hops,
                         width_d=int_list(args.width_d, "--width-d") if args.width_d.strip() else [],
                         m_grid=int_list(args.m_grid, "--m-grid"), lr=args.lr, max_steps=args.max_steps,
                         threads=args.threads)
    summary = run_multihop(cfg, args.out)
    path = multihop_figure(summary, os.path.join(args.out, "multihop.png"))
    if args.img_dir:
        os.makedirs(args.img_dir, exist_ok=True)
        shutil.copyfile(path, os.path.join(args.img_dir, "mech_multihop.png"))
    print(multihop_markdown(summary))
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['wall_s']} s)")
    return summary


def cmd_multihop_seeds(args) -> dict:
    cot = {"no": False, "yes": True}
    wanted = [c.strip() for c in args.cot.split(",") if c.strip()]
    if not wanted or any(c not in cot for c in wanted):
        raise UsageError(f"--cot {args.cot!r}: give no, yes or no,yes")
    cfg = SeedsConfig(subjects=args.subjects, relations=int_list(args.relations, "--relations"),
                      hops=int_list(args.hops, "--hops"), seeds=int_list(args.seeds, "--seeds", minimum=0),
                      attention=args.attention, mlp_ratio=args.mlp_ratio, d_grid=int_list(args.d_grid, "--d-grid"),
                      lr=args.lr, max_steps=args.max_steps, threads=args.threads, cot=[cot[c] for c in wanted],
                      train=not args.no_train)
    summary = run_seeds(cfg, args.out)
    llmio.write_text(os.path.join(args.out, "seeds.md"), seeds_markdown(summary))
    seeds_figure(summary, os.path.join(args.out, "seeds.png"))
    if args.img:
        seeds_figure(summary, args.img)
    print(seeds_markdown(summary))
    print(f"summary: {os.path.join(args.out, SEEDS_FILE)} ({summary['wall_s']} s)")
    return summary
