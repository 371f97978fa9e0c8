"""``llmprobe synth analyze RUN_DIR``: the mechanism analyses of a trained one-hop run, beside its controls.

:func:`analyze` loads the run (``synthetic.train.load_run``), trains the control models on the *same* fact table
with the run's own architecture and training settings, and measures all of them with the same code:

* ``trainable``: the run itself.
* ``frozen``: subject embeddings frozen at random init (the paper's frozen-embedding control; the unembedding still
  learns).
* ``frozen_all``: subject embeddings *and* unembedding frozen at random init (the associative memory of earlier
  work: only the MLP and relation embeddings learn, so the MLP must store the facts).
* ``untrained``: the same architecture at a fresh init (readout control only).

Analyses (see :mod:`synthetic.mechanisms` and :mod:`synthetic.swap`): superposition readouts of e_s with the
shuffled-table control and swap edits; MLP unit selectivity, relation-gating index, ablation matrix (with a
random-unit control), gate transplant and relation patch; logit attribution (own vs cross-relation components);
freeze-and-swap with random re-initialisation baselines.

Results: ``RUN_DIR/analysis.json`` (every number), ``RUN_DIR/analysis.md`` (side-by-side table) and PNG plots in
RUN_DIR (``analysis_readout.png``, ``analysis_selector.png``, ``analysis_ablation.png``, ``analysis_swap.png``);
with ``img_dir`` the plots are also written there with a ``mech_`` prefix (e.g. ``docs/img/mech_readout.png``).

If RUN_DIR holds no checkpoint, ``analyze(..., train_spec=...)`` (CLI: ``--subjects --relations --d``) trains the
run first with :func:`synthetic.train.train`, so one command reproduces a claim from nothing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from llmprobe.io import read_jsonl, write_figure, write_json, write_text
from synthetic import mechanisms as mech
from synthetic.model import FactRecallModel, ModelConfig
from synthetic.multihop import add_multihop_parser
from synthetic.swap import freeze_and_swap, plot_swap_sweep, summarize_sweep, swap_sweep, sweep_markdown, sweep_points
from synthetic.tasks import FactTask, KHopTask, random_bijections
from synthetic.train import STATE, TrainConfig, load_run, train

ANALYSIS = "analysis.json"
CONTROLS = ("frozen", "frozen_all")
PLOTS = ("readout", "selector", "ablation", "swap")

# Defaults of a run trained by ``analyze`` itself: past 100% with a small weight decay, which removes the random
# init from e_s (the superposition is then clean; see docs/mechanisms.md).
DEFAULT_TRAIN = {"lr": 0.03, "max_steps": 1000, "weight_decay": 1e-4, "target_acc": 1.01}


def control_config(config: ModelConfig, kind: str) -> ModelConfig:
    """The run's architecture with the control's frozen parts."""
    flags = {"frozen": {"frozen_subjects": True},
             "frozen_all": {"frozen_subjects": True, "frozen_unembed": True}}[kind]
    return ModelConfig.from_dict({**config.to_dict(), **flags})


def train_control(task: FactTask, config: ModelConfig, train_config: TrainConfig, kind: str
                  ) -> tuple[FactRecallModel, dict]:
    """Train a control model (``kind`` in CONTROLS) on ``task``; returns (model, summary of the run)."""
    res = train(task, model_config=control_config(config, kind), config=train_config)
    return res.model.eval(), _run_summary(res.to_dict())


def _run_summary(info: dict) -> dict:
    keys = ("accuracy", "steps", "wall_time_s", "n_params", "n_trainable", "bits", "bits_per_param",
            "loss", "d_model", "d_mlp", "frozen_subjects", "attention")
    out = {k: info.get(k) for k in keys}
    out["all_facts_correct"] = (info.get("accuracy") or 0.0) >= 1.0   # (train's "success" is relative to target_acc)
    return out


def train_run(run_dir: str, subjects: int, relations: int, d: int, seed: int = 0, d_mlp: int | None = None,
              attention: str = "uniform", train_config: TrainConfig | None = None) -> dict:
    """Train a one-hop run on R random bijections into ``run_dir`` (used when RUN_DIR is empty)."""
    task = random_bijections(subjects, relations, seed)
    cfg = train_config or TrainConfig(**DEFAULT_TRAIN, progress=False)
    res = train(task, d, config=cfg, out_dir=run_dir, d_mlp=d_mlp, attention=attention, seed=seed)
    return _run_summary(res.to_dict())


def analyze(run_dir: str, *, controls=CONTROLS, swap: bool = True, n_boot: int = 500, seed: int = 0,
            swap_steps=(0, 10, 25, 50, 100), swap_lr: float = 0.03, plots: bool = True,
            img_dir: str | None = None, train_spec: dict | None = None, progress: bool = True) -> dict:
    """All mechanism analyses of the one-hop run in ``run_dir``; writes ``analysis.json``, ``analysis.md`` and the
    plots (see module docstring) and returns the result dict."""
    t0 = time.perf_counter()
    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    trained_here = None
    if not os.path.exists(os.path.join(run_dir, STATE)):
        if not train_spec:
            raise ValueError(f"{run_dir} holds no trained run (no {STATE}); train one with `llmprobe synth train` "
                             f"or give --subjects, --relations and --d to train it here")
        tc = train_spec.get("train_config")
        log(f"training {run_dir}: N={train_spec['subjects']} R={train_spec['relations']} d={train_spec['d']}"
            + (f", lr={tc.lr:g}, {tc.max_steps} steps, weight decay {tc.weight_decay:g}" if tc else ""))
        trained_here = train_run(run_dir, **train_spec)
    model, task, info = load_run(run_dir)
    model.eval()
    if isinstance(task, KHopTask):
        raise ValueError("analyze needs a one-hop run; k-hop models are studied by `llmprobe synth multihop`")
    train_cfg = TrainConfig.from_dict({**(info.get("train") or {}), "progress": False})
    models = {"trainable": model}
    runs = {"trainable": _run_summary(info)}
    for kind in controls:
        log(f"training control '{kind}' (same table, d={model.config.d_model}, d_mlp={model.config.d_mlp})")
        models[kind], runs[kind] = train_control(task, model.config, train_cfg, kind)
    result = {"run_dir": os.path.abspath(run_dir), "task": {"kind": task.kind, "n_subjects": task.n_subjects,
                                                             "n_relations": task.n_relations,
                                                             "n_facts": task.n_facts, "seed": task.seed},
              "model_config": model.config.to_dict(), "train_config": train_cfg.to_dict(), "runs": runs,
              "trained_here": trained_here}

    log("superposition readouts (trainable, shuffled, controls, untrained)")
    readout_controls = {k: m for k, m in models.items() if k != "trainable"}
    readout_controls["untrained"] = mech.untrained_like(model)
    result["superposition"] = mech.superposition(model, task, controls=readout_controls, n_boot=n_boot, seed=seed)

    log("selector: unit selectivity, ablation matrix, gate transplant, relation patch")
    unit_stats = {}
    result["selector"] = {}
    for name, m in models.items():
        sel = mech.selector(m, task, seed=seed)
        unit_stats[name] = sel.pop("_unit_stats")
        result["selector"][name] = sel

    log("logit attribution (own vs cross-relation components)")
    result["logit_attribution"] = {}
    for name, m in models.items():
        if name == "frozen_all":
            continue                  # no superposition to attribute (R^2 ~ 0): the split is meaningless
        result["logit_attribution"][name] = mech.logit_attribution(m, task, seed=seed)

    if swap:
        log("freeze-and-swap")
        result["swap"] = {name: freeze_and_swap(m, task, seed=seed + 1, steps=swap_steps, lr=swap_lr,
                                                conditions=None if name == "trainable" else
                                                ("swap", "random_init", "old_table"))
                          for name, m in models.items()}

    table = {}
    sup = result["superposition"]
    for name in models:
        row = {"train_accuracy": runs[name]["accuracy"]}
        if name == "trainable":
            row.update(mech.key_numbers(sup, result["selector"][name]))
        else:
            s = sup["summary"].get(name, {})
            row.update({"readout_acc": s.get("readout_acc"), "superposition_r2": s.get("r2"),
                        "decode_acc": s.get("decode_acc")})
            row.update(mech.key_numbers(None, result["selector"][name]))
            se = sup.get(f"swap_edit_{name}")
            if se:
                row["swap_edit_success"] = se["success"]["value"]
        la = result["logit_attribution"].get(name)
        if la:
            row["relation_operator_r2"] = sum(la["operator_r2"]) / len(la["operator_r2"])
            row["logit_own"] = la["own"]
            row["logit_cross_trained_table"] = la["cross_total"]
            row["logit_cross_new_table"] = la["cross_total_new"]
        if swap:
            sw = result["swap"][name]
            row["swap_zero_shot"] = sw["zero_shot"]["swap"]
            row["random_init_zero_shot"] = sw["zero_shot"]["random_init"]
            k_mid = sorted(int(k) for k in sw["curves"]["swap"])
            k_mid = k_mid[min(2, len(k_mid) - 1)]
            row[f"swap_after_{k_mid}_steps"] = sw["curves"]["swap"][str(k_mid)]
            row[f"random_init_after_{k_mid}_steps"] = sw["curves"]["random_init"][str(k_mid)]
        table[name] = mech._round(row)
    table["untrained"] = mech._round({k: sup["summary"]["untrained"].get(k2) for k, k2 in
                                      (("readout_acc", "readout_acc"), ("superposition_r2", "r2"),
                                       ("decode_acc", "decode_acc"))})
    result["table"] = table
    result["table_md"] = mech.compare(table)
    result["plots"] = []
    if plots:
        result["plots"] = make_plots(run_dir, result, unit_stats, img_dir=img_dir)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(os.path.join(run_dir, ANALYSIS), result)
    write_text(os.path.join(run_dir, "analysis.md"), markdown(result))
    return result


def markdown(result: dict) -> str:
    """A short Markdown summary of an analysis (the side-by-side table and the ablation matrices)."""
    t = result["task"]
    mc = result["model_config"]
    lines = [f"# Mechanisms of {result['run_dir']}", "",
             f"N={t['n_subjects']} subjects, R={t['n_relations']} relations ({t['kind']}), d={mc['d_model']}, "
             f"d_mlp={mc['d_mlp']}, attention={mc['attention']}; analysis took {result.get('wall_s')} s.", "",
             result["table_md"], ""]
    for name, sel in result["selector"].items():
        for key, what in (("ablation_drop", "units assigned to relation r"),
                          ("exclusive_ablation_drop", "units exclusive to relation r"),
                          ("random_ablation_drop", "as many random live units")):
            mat = sel[key]
            lines += [f"Ablation drop matrix, {name}, {what} zeroed (row r; column: accuracy drop on r'):", "",
                      "| r \\ r' | " + " | ".join(str(i) for i in range(len(mat))) + " |", "|---|" + "---|" * len(mat)]
            lines += [f"| {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |" for i, row in enumerate(mat)]
            lines.append("")
    lines += [f"![{p}]({os.path.basename(p)})" for p in result.get("plots", [])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- plots
def make_plots(run_dir: str, result: dict, unit_stats: dict, img_dir: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name):
        path = os.path.join(run_dir, f"analysis_{name}.png")
        write_figure(path, fig)
        paths.append(path)
        if img_dir:
            os.makedirs(img_dir, exist_ok=True)
            shutil.copyfile(path, os.path.join(img_dir, f"mech_{name}.png"))

    sup = result["superposition"]
    conds = [c for c in ("real", "shuffled", "frozen", "frozen_all", "untrained") if c in sup["report"]["conditions"]]
    labels = {"real": "trainable", "shuffled": "trainable,\nshuffled table", "frozen": "frozen subj.",
              "frozen_all": "frozen_all\n(frozen subj.+unemb.)", "untrained": "untrained"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    rel_names = sup["report"]["settings"]["relations"]
    width = 0.8 / max(1, len(rel_names))
    for j, rel in enumerate(rel_names):
        vals, errs = [], [[], []]
        for c in conds:
            e = sup["report"]["conditions"][c]["readout_acc"][rel] or {"value": 0, "ci": [0, 0]}
            vals.append(e["value"])
            errs[0].append(max(0, e["value"] - e["ci"][0]))
            errs[1].append(max(0, e["ci"][1] - e["value"]))
        axes[0].bar([i + j * width for i in range(len(conds))], vals, width, yerr=errs, label=rel, capsize=2)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(conds))], [labels[c] for c in conds], fontsize=8)
    axes[0].set_ylabel("held-out readout accuracy")
    axes[0].set_title("linear readout of a_r(s) from e_s (per relation)")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=7, ncol=2)
    r2 = [sup["report"]["conditions"][c]["r2"] for c in conds]
    axes[1].bar(range(len(conds)), [x["value"] for x in r2],
                yerr=[[max(0, x["value"] - x["ci"][0]) for x in r2], [max(0, x["ci"][1] - x["value"]) for x in r2]],
                color="tab:gray", capsize=3)
    axes[1].set_xticks(range(len(conds)), [labels[c] for c in conds], fontsize=8)
    axes[1].set_ylabel("held-out R^2")
    axes[1].set_title("superposition fit e_s ~ c + sum_r W_r u_{a_r(s)}")
    axes[1].set_ylim(min(0, min(x["value"] for x in r2)), 1.05)
    save(fig, "readout")

    names = list(unit_stats)
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6), squeeze=False)
    for j, name in enumerate(names):
        st = unit_stats[name]
        order = torch.argsort(st["top"].double() * 10 - st["si"].double().nan_to_num(0))
        order = order[st["alive"][order]]
        im = axes[0, j].imshow(st["rate"][:, order].numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                               interpolation="nearest")
        axes[0, j].set_title(f"{name}: firing rate by relation", fontsize=9)
        axes[0, j].set_xlabel("live hidden units (sorted by top relation)")
        axes[0, j].set_ylabel("relation")
        fig.colorbar(im, ax=axes[0, j], fraction=0.04)
        gating = st["gating"][~torch.isnan(st["gating"])].numpy()
        axes[1, j].hist(gating, bins=20, range=(0, 1), color="tab:blue", alpha=0.8)
        axes[1, j].set_xlabel("relation-gating index I(gate; r)/H(gate)")
        axes[1, j].set_ylabel("units")
        sel = result["selector"][name]
        axes[1, j].set_title(f"mean {sel['relation_gating']['mean']:.2f}; gate transplant same-r "
                             f"{sel['gate_transplant']['same_relation']:.2f}", fontsize=9)
    fig.tight_layout()
    save(fig, "selector")

    mats = [(name, result["selector"][name]["ablation_drop"]) for name in names]
    first = result["selector"][names[0]]
    mats.append((f"{names[0]}: random units (control)", first["random_ablation_drop"]))
    mats.append((f"{names[0]}: exclusive units ({sum(first['exclusive_units_per_relation'])})",
                 first["exclusive_ablation_drop"]))
    fig, axes = plt.subplots(1, len(mats), figsize=(3.4 * len(mats), 3.2), squeeze=False)
    for j, (name, mat) in enumerate(mats):
        ax = axes[0, j]
        ax.imshow(mat, cmap="Reds", vmin=0, vmax=1)
        for (a, b), v in _cells(mat):
            ax.text(b, a, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(mat)))
        ax.set_yticks(range(len(mat)))
        ax.set_xlabel("accuracy drop on relation r'")
        ax.set_ylabel("units of relation r zeroed")
    fig.tight_layout()
    save(fig, "ablation")

    if "swap" in result:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        colors = {"trainable": "tab:blue", "frozen": "tab:orange", "frozen_all": "tab:purple"}
        styles = {"swap": "-", "random_init": "--", "random_matched": ":"}
        for name, sw in result["swap"].items():
            for cond in ("swap", "random_init", "random_matched"):
                if name != "trainable" and cond == "random_matched":
                    continue
                curve = sw["curves"][cond]
                xs = sorted(int(k) for k in curve)
                ax.plot(xs, [curve[str(x)] for x in xs], styles[cond], color=colors.get(name, "tab:gray"),
                        marker="o", ms=3, label=f"{name}: {cond}")
        ax.set_xlabel("steps of training the new subject embeddings alone (rest frozen)")
        ax.set_ylabel("accuracy on new random bijections")
        ax.set_title("freeze-and-swap")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        save(fig, "swap")
    return paths


def _cells(mat):
    for a, row in enumerate(mat):
        for b, v in enumerate(row):
            yield (a, b), v


# -------------------------------------------------------------------------------------------------------- CLI
def add_analyze_parser(synth_subparsers) -> None:
    """Register ``analyze`` and ``multihop`` on the ``synth`` group's subparsers (``parser.synth_subparsers``)."""
    p = synth_subparsers.add_parser(
        "analyze", help="mechanisms of a trained run: readouts, selector, freeze-and-swap, with controls",
        description="Superposition readouts of e_s, MLP selector interventions and freeze-and-swap for the run in "
                    "RUN_DIR, beside the frozen and frozen_all controls trained on the same table. Writes "
                    "RUN_DIR/analysis.json, analysis.md and plots. An empty RUN_DIR is trained first "
                    "(--subjects, --relations, --d).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--controls", default=",".join(CONTROLS),
                   help="comma list of frozen,frozen_all ('' = none; default %(default)s)")
    p.add_argument("--no-swap", action="store_true", help="skip freeze-and-swap")
    p.add_argument("--swap-steps", default="0,10,25,50,100", help="step counts to report (default %(default)s)")
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

    q = synth_subparsers.add_parser(
        "swap-sweep", help="freeze-and-swap over d/d*, seeds, encoders and training settings",
        description="Train one-hop models at d = ratio * d* (d* from docs/synthetic.md), freeze them and swap in "
                    "subject embeddings of new random bijections (encoders: least-squares fit, the construction's "
                    "rule, random re-init; plus the construction's own model). Resumable: OUT/results.jsonl; "
                    "OUT/summary.json; --img draws the figure.")
    q.add_argument("out", metavar="OUT")
    q.add_argument("--subjects", "-N", default="256", help="comma list (default %(default)s)")
    q.add_argument("--relations", "-R", default="4", help="comma list (default %(default)s)")
    q.add_argument("--ratios", default="1,2,4,8", help="d/d* values (default %(default)s)")
    q.add_argument("--seeds", default="0,1,2", help="table and init seeds (default %(default)s)")
    q.add_argument("--modes", default="trainable,frozen", help="trainable,frozen,frozen_unembed")
    q.add_argument("--attributes", type=int, default=None,
                   help="many-to-one maps onto this many shared attributes instead of bijections")
    q.add_argument("--weight-decay", type=float, default=DEFAULT_TRAIN["weight_decay"])
    q.add_argument("--max-steps", type=int, default=DEFAULT_TRAIN["max_steps"])
    q.add_argument("--stop-at-100", action="store_true")
    q.add_argument("--steps", default="0,10,25,50,100,300", help="embedding-training steps to report")
    q.add_argument("--swap-lr", type=float, default=0.03)
    q.add_argument("--no-control", action="store_true", help="skip the construction positive control")
    q.add_argument("--img", default=None, help="write the figure here (e.g. docs/img/mech_swap_ratio.png)")
    q.add_argument("--plot-only", action="store_true",
                   help="train nothing: re-summarise OUT/results.jsonl (and draw with --img)")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    q.set_defaults(func=cmd_swap_sweep)

    add_multihop_parser(synth_subparsers)


def cmd_analyze(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = None
    if args.subjects and args.relations and args.d:
        spec = {"subjects": args.subjects, "relations": args.relations, "d": args.d, "seed": args.seed,
                "d_mlp": args.mlp_width, "attention": args.attention,
                "train_config": TrainConfig(lr=args.lr, max_steps=args.max_steps, weight_decay=args.weight_decay,
                                            target_acc=1.0 if args.stop_at_100 else 1.01, progress=False)}
    controls = tuple(c for c in args.controls.split(",") if c)
    unknown = set(controls) - set(CONTROLS)
    if unknown:
        raise ValueError(f"unknown control(s) {sorted(unknown)}; choose from {', '.join(CONTROLS)}")
    result = analyze(args.run_dir, controls=controls, swap=not args.no_swap, n_boot=args.n_boot, seed=args.seed,
                     swap_steps=tuple(int(x) for x in args.swap_steps.split(",") if x), swap_lr=args.swap_lr,
                     plots=not args.no_plots, img_dir=args.img_dir, train_spec=spec)
    print(result["table_md"])
    print(f"analysis: {os.path.join(args.run_dir, ANALYSIS)} ({result['wall_s']} s)")
    return result


def cmd_swap_sweep(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    ints = lambda text: [int(x) for x in text.split(",") if x]
    if args.plot_only:
        summary = summarize_sweep(read_jsonl(os.path.join(args.out, "results.jsonl")))
        write_json(os.path.join(args.out, "summary.json"), summary)
    else:
        pts = sweep_points(ints(args.subjects), ints(args.relations), [float(x) for x in args.ratios.split(",") if x],
                           ints(args.seeds), [m for m in args.modes.split(",") if m], args.weight_decay,
                           args.max_steps, args.stop_at_100, args.attributes)
        summary = swap_sweep(args.out, pts, steps=tuple(ints(args.steps)), lr=args.swap_lr,
                             control_seeds=() if args.no_control else tuple(ints(args.seeds)))
    if args.img:
        plot_swap_sweep(summary, args.img)
        print(f"figure: {args.img}")
    print(sweep_markdown(summary))
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['n_rows']} rows)")
    return summary


def main(argv=None) -> int:
    """Stand-alone entry point: ``python -m synthetic.analyze analyze RUN_DIR ...``."""
    parser = argparse.ArgumentParser(prog="llmprobe synth")
    sub = parser.add_subparsers(dest="synth_command", required=True)
    add_analyze_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
