"""The figures of the synthetic experiments, drawn from their results (each module computes, this one draws).

Every figure is a matplotlib ``Figure`` made by :func:`llmprobe.io.subplots` (no pyplot, no backend switch) and
written atomically by :func:`llmprobe.io.write_figure`:

* :func:`sweep_figures`: the capacity sweep (:mod:`synthetic.sweep`), accuracy against d and d* against R log2 N;
* :func:`multihop_figure` and :func:`seeds_figure`: the k-hop searches (:mod:`synthetic.multihop`);
* :func:`swap_sweep_figure`: freeze-and-swap over d/d* (:mod:`synthetic.swap`);
* :func:`analysis_figures`: the mechanism analyses of one run (:mod:`synthetic.analyze`).
"""
from __future__ import annotations

import math
import os
import shutil

import torch

from llmprobe.io import subplots, write_figure
from llmprobe.names import SWEEP_MODES
from synthetic.bounds import capacity_reference

# the bits-per-parameter lines of the d* figure: (rate, line style, source)
CAPACITY_REFERENCES = ((2.0, "--", "Allen-Zhu & Li 2024"), (3.6, ":", "Morris et al. 2025"))


def sweep_figures(rows: list[dict], summary: dict, img_dir: str, prefix: str = "") -> list[str]:
    """A capacity sweep's figures, written atomically into ``img_dir``: ``{prefix}accuracy_vs_d.png`` (train
    accuracy against d per N, R and mode, from the sweep's ``rows``, :func:`synthetic.sweep.load_results`) and
    ``{prefix}dstar_vs_RlogN.png`` (d* against R log2 N with the fits of ``summary``, :func:`synthetic.sweep.
    summarize`, and the capacity lines of :data:`CAPACITY_REFERENCES`). Returns their paths."""
    import matplotlib  # matplotlib only where something is drawn (start-up time)

    os.makedirs(img_dir, exist_ok=True)
    paths = []
    Ns = sorted({r["n_subjects"] for r in rows})
    Rs = sorted({r["n_relations"] for r in rows})
    if not rows:
        return paths
    fig, axes = subplots(1, len(Ns), figsize=(4.2 * len(Ns), 3.4), squeeze=False, sharey=True)
    cmap = matplotlib.colormaps["viridis"]
    for i, N in enumerate(Ns):
        ax = axes[0, i]
        for j, R in enumerate(Rs):
            color = cmap(j / max(1, len(Rs) - 1))
            for mode, style in zip(SWEEP_MODES, ("-o", "--s", ":^")):
                pts: dict[int, list[float]] = {}
                for r in rows:
                    if r["n_subjects"] == N and r["n_relations"] == R and r["mode"] == mode:
                        pts.setdefault(r["d_model"], []).append(r["accuracy"])
                if pts:
                    xs = sorted(pts)
                    ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], style, color=color, ms=3, lw=1,
                            label=f"R={R} {mode}" if i == 0 else None)
        ax.set_xscale("log", base=2)
        ax.set_title(f"N={N}")
        ax.set_xlabel("d (embedding width)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("train accuracy")
    n_modes = len({r["mode"] for r in rows})
    fig.legend(loc="lower center", ncol=min(4, n_modes * len(Rs)), fontsize=7, frameon=False)
    n_rows_legend = math.ceil(n_modes * len(Rs) / 4)
    fig.tight_layout(rect=(0, min(0.4, 0.06 * n_rows_legend + 0.02), 1, 1))
    paths.append(str(write_figure(os.path.join(img_dir, f"{prefix}accuracy_vs_d.png"), fig)))

    fig, ax = subplots(figsize=(7.6, 4.0))
    markers = {N: m for N, m in zip(Ns, "os^Dv<>")}
    for mode, color in zip(SWEEP_MODES, ("tab:blue", "tab:red", "tab:gray")):
        for c in summary["cells"]:
            if c["mode"] != mode:
                continue
            for d in c["d_star"]:
                ax.scatter(c["R_log2N"], d, color=color, marker=markers.get(c["N"], "o"), s=18, alpha=0.8)
        for c in summary["cells"]:                  # unconfirmed d* (d*-1 not yet failed twice): hollow
            for d in c["upper_bounds"] if c["mode"] == mode else ():
                ax.scatter(c["R_log2N"], d, marker=markers.get(c["N"], "o"), s=22, facecolors="none",
                           edgecolors=color, linewidths=1)
        fit = summary["fit"].get(mode) or {}
        c = (fit.get("c") or {}).get("value")
        r2 = fit.get("r2")
        if c is not None and (r2 is None or r2 >= 0.5):
            xs = [0, max(c_["R_log2N"] for c_ in summary["cells"])]
            drift = " (drifts with N: see c per N)" if fit.get("drift") else ""
            ax.plot(xs, [c * x for x in xs], color=color, lw=1, label=f"{mode}: d* = {c:.2f} R log2 N{drift}")
        elif c is not None:                     # not linear in R log N: show the power law instead
            pw = (summary.get("power_fits") or {}).get(mode) or {}
            label = mode if pw.get("alpha") is None else \
                f"{mode}: d* ~ N^{pw['alpha']:.2f} R^{pw['beta']:.2f} (no linear fit)"
            ax.scatter([], [], color=color, s=18, label=label)
    ratio = (summary.get("config") or {}).get("mlp_ratio") or 8.0
    for bits, style, source in CAPACITY_REFERENCES:
        for i, (N, points) in enumerate(capacity_reference(summary["cells"], bits, ratio).items()):
            ax.plot(*zip(*points), color="black", ls=style, lw=0.8, alpha=0.7,
                    label=f"{bits} bits/param ({source}), trainable, per N" if i == 0 else None)
    for N, m in markers.items():
        ax.scatter([], [], color="gray", marker=m, s=18, label=f"N={N}")
    if any(c["upper_bounds"] for c in summary["cells"]):
        ax.scatter([], [], facecolors="none", edgecolors="gray", s=22, label="hollow: upper bound (not confirmed)")
    ax.set_xlabel("R log2 N")
    ax.set_ylabel("threshold width d*")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(str(write_figure(os.path.join(img_dir, f"{prefix}dstar_vs_RlogN.png"), fig)))
    return paths


def multihop_figure(summary: dict, path: str) -> str:
    """The figure of :func:`synthetic.multihop.run_multihop`'s ``summary`` at ``path`` (atomically): the smallest
    d reaching 100% against k, with and without chain-of-thought, beside R^k and R^(k/2) references, and (when
    swept) the smallest MLP width against d. Returns ``path``."""
    from matplotlib.ticker import ScalarFormatter  # matplotlib only where something is drawn (start-up time)

    cfg = summary["config"]
    n_panels = 2 if summary["mlp_width"] else 1
    fig, axes = subplots(1, n_panels, figsize=(5.2 * n_panels, 3.8), squeeze=False)
    ax = axes[0, 0]
    ks = [r["hops"] for r in summary["d_star"]]
    top = max(cfg["d_grid"]) * 1.5
    for key, label, style in (("d_star_direct", "without CoT", "o-"), ("d_star_cot", "with CoT", "s-")):
        ys = [r[key] if r[key] is not None else top for r in summary["d_star"]]
        ax.plot(ks, ys, style, label=label)
        for k, r in zip(ks, summary["d_star"]):
            if r[key] is None:
                ax.annotate("> grid", (k, top), fontsize=7)
    # reference curves, scaled to the one-hop point
    base = next((r["d_star_direct"] for r in summary["d_star"] if r["hops"] == min(ks)), None)
    if base:
        R = cfg["relations"]
        ax.plot(ks, [base * R ** (k - min(ks)) for k in ks], ":", color="gray", label="∝ R^k")
        ax.plot(ks, [base * R ** ((k - min(ks)) / 2) for k in ks], "--", color="lightgray",
                label="∝ R^(k/2) (params ∝ d² ∝ R^k)")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xticks(ks)
    ax.set_xlabel("hops k")
    ax.set_ylabel("smallest d reaching 100%")
    ax.set_title(f"k-hop recall, N={cfg['subjects']}, R={cfg['relations']}")
    ax.legend(fontsize=8)
    if summary["mlp_width"]:
        ax = axes[0, 1]
        ds = [r["d"] for r in summary["mlp_width"]]
        topm = max(cfg["m_grid"]) * 1.5
        for key, label, style in (("d_mlp_direct", "without CoT", "o-"), ("d_mlp_cot", "with CoT", "s-")):
            ax.plot(ds, [r[key] if r[key] is not None else topm for r in summary["mlp_width"]], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("d")
        ax.set_ylabel("smallest MLP width reaching 100%")
        ax.set_title(f"MLP width vs d at k = {cfg['width_hops']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig)
    return path


def seeds_figure(summary: dict, path: str) -> str:
    """d* against R (log-log), one panel per k: per-seed points (a triangle: d* above this width, no success
    yet), the mean over the seeds that succeeded and the fitted line d* = e^a R^b, with and without CoT, and R^k,
    R^(k/2) references through the no-CoT mean at the smallest R (:func:`synthetic.multihop.run_seeds`'s
    ``summary``), at ``path`` (atomically). Returns ``path``."""
    from matplotlib.ticker import ScalarFormatter  # matplotlib only where something is drawn (start-up time)

    cells = summary["cells"]
    ks = sorted({c["hops"] for c in cells.values()})
    fig, axes = subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for cot, color, marker in ((False, "C0", "o"), (True, "C1", "s")):
            c = cells.get(f"k{k}_{'cot' if cot else 'direct'}")
            if not c or (cot and k == 1):      # one hop with CoT is the same data (d* copied)
                continue
            Rs = sorted(int(R) for R in c["by_R"])
            shift = 1.04 if cot else 0.96
            for R in Rs:
                ds = [d for d in c["by_R"][str(R)]["d_star"] if d]
                ax.scatter([R * shift] * len(ds), ds, s=14, color=color, alpha=0.45, marker=marker)
                above = [f for d, f in zip(c["by_R"][str(R)]["d_star"], c["by_R"][str(R)]["d_fail"]) if not d and f]
                ax.scatter([R * shift] * len(above), above, s=30, color=color, marker="^")   # d* > this width
            Rs = [R for R in Rs if c["by_R"][str(R)]["mean"]]
            means = [c["by_R"][str(R)]["mean"] for R in Rs]
            b = c["b"]
            label = f"{'with' if cot else 'without'} CoT: b={b['value']:.2f} [{b['ci'][0]:.2f}, {b['ci'][1]:.2f}]"
            opened = [R for R in Rs if c["by_R"][str(R)].get("open")]
            label += f" (R={','.join(map(str, opened))} open)" if opened else ""
            ax.plot(Rs, means, marker=marker, color=color, linestyle="none", label=label)
            if b["value"] is not None and b.get("note", "").startswith("a="):
                a = float(b["note"].split()[0][2:])
                ax.plot(Rs, [math.exp(a) * R ** b["value"] for R in Rs], "-", color=color, lw=1)
            if not cot and means[0]:
                ax.plot(Rs, [means[0] * (R / Rs[0]) ** k for R in Rs], ":", color="gray", label="∝ R^k")
                ax.plot(Rs, [means[0] * (R / Rs[0]) ** (k / 2) for R in Rs], "--", color="lightgray",
                        label="∝ R^(k/2)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("relations R")
        ax.set_ylabel("d* (smallest d reaching 100%)")
        ax.set_title(f"k = {k}, N = {summary['config']['subjects']}, {len(summary['config']['seeds'])} seeds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(path, fig)
    return path


def swap_sweep_figure(summary: dict, path: str, N: int = 256, R: int = 4, weight_decay: float = 1e-4,
                    max_steps: int = 1000) -> None:
    """Figure of a sweep summary, default training recipe only: (1) zero-shot accuracy vs d/d* at (N, R) per encoder
    and mode, 95% t intervals over seeds, chance line, the construction control; (2) the ``swap`` encoder at every
    (N, R) in the summary; (3) few-step curves at (N, R), trainable mode (:func:`synthetic.swap.summarize_sweep`'s
    ``summary``). Written atomically to ``path``."""
    sets = list(summary["settings"].values())
    every = [g for g in sets if g["mode"] != "construction" and g["weight_decay"] == weight_decay
             and g["max_steps"] == max_steps and not g["stop_at_100"]]
    base = [g for g in every if not g.get("n_attributes")]

    def series(cells, mode, cond):
        cells = sorted((g for g in cells if g["mode"] == mode and cond in g["conditions"]), key=lambda g: g["ratio"])
        x = [g["ratio"] for g in cells]
        z = [g["conditions"][cond]["zero_shot"] for g in cells]
        y = [v["mean"] for v in z]
        err = [[v["mean"] - (v["ci"] or [v["mean"]] * 2)[0] for v in z], [(v["ci"] or [v["mean"]] * 2)[1] - v["mean"]
                                                                          for v in z]]
        return x, y, err

    fig, axes = subplots(1, 3, figsize=(17, 6.8))
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.13), "ncol": 2, "fontsize": 7}
    ax = axes[0]
    here = [g for g in base if g["N"] == N and g["R"] == R]
    colors = {"swap": "C0", "construction": "C1", "random_init": "C7"}
    labels = {"swap": "(a) least-squares fit", "construction": "(b) construction rule", "random_init": "(c) random re-init"}
    styles = {"trainable": ("-", "o"), "frozen": ("--", "s"), "frozen_unembed": (":", "^")}
    for mode, (ls, mk) in styles.items():
        for cond, col in colors.items():
            x, y, err = series(here, mode, cond)
            if x:
                ax.errorbar(x, y, yerr=err, color=col, ls=ls, marker=mk, capsize=3, label=f"{labels[cond]}, {mode}")
    ctrl = [g for g in sets if g["mode"] == "construction" and g["N"] == N and g["R"] == R]
    for g in ctrl:
        ax.plot([g["ratio"]], [g["conditions"]["native"]["zero_shot"]["mean"]], "k*", ms=13,
                label=f"construction's own model, new codes (d={g['d']})")
    if here:
        ax.axhline(here[0]["chance"], color="k", lw=0.8, ls=":", label=f"chance 1/{N}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("d / d*")
    ax.set_ylabel("zero-shot accuracy on new bijections")
    ax.set_title(f"freeze-and-swap, N={N}, R={R} (mean, 95% t CI over seeds)")
    ax.legend(**below)

    ax = axes[1]
    for i, (n, r, a) in enumerate(sorted({(g["N"], g["R"], g.get("n_attributes") or 0) for g in every})):
        for mode in ("trainable", "frozen"):
            x, y, err = series([g for g in every if (g["N"], g["R"], g.get("n_attributes") or 0) == (n, r, a)],
                               mode, "swap")
            if x:
                what = f"|A|={a} ({n // a} subjects/attribute)" if a else "bijections"
                ax.errorbar(x, y, yerr=err, color=f"C{i}", ls=styles[mode][0], marker=styles[mode][1], capsize=3,
                            label=f"N={n}, R={r}, {what}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("d / d*")
    ax.set_title("(a) least-squares encoder at each (N, R, |A|)")
    ax.legend(**{**below, "ncol": 1})

    ax = axes[2]
    tr = sorted((g for g in here if g["mode"] == "trainable"), key=lambda g: g["ratio"])
    for i, g in enumerate(tr):
        for cond, ls in (("swap", "-"), ("random_init", ":")):
            c = g["conditions"][cond]["curve"]
            ks = sorted(c, key=int)
            ax.plot([max(int(k), 1) for k in ks], [c[k]["mean"] for k in ks], color=f"C{i}", ls=ls, marker=".",
                    label=f"d/d*={g['ratio']:g}, {'(a) fit' if cond == 'swap' else '(c) re-init'}")
    if here:
        ax.axhline(here[0]["chance"], color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("steps of training the new embeddings alone (Adam lr 0.03; 0 plotted at 1)")
    ax.set_ylabel("accuracy on new bijections")
    ax.set_title(f"few-step curves, N={N}, R={R}, trainable")
    ax.legend(**below)
    fig.tight_layout()
    write_figure(path, fig)


def analysis_figures(run_dir: str, result: dict, unit_stats: dict, img_dir: str | None = None) -> list[str]:
    """The figures of :func:`synthetic.analyze.analyze`'s ``result``: ``RUN_DIR/analysis_{readout,selector,ablation,
    swap}.png`` (``unit_stats``: {model name: :func:`synthetic.mechanisms.unit_stats` tensors}), each also copied to
    ``img_dir/mech_<name>.png`` when given. Returns the paths in ``run_dir``."""
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
    fig, axes = subplots(1, 2, figsize=(11, 3.6))
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
    fig, axes = subplots(2, len(names), figsize=(4.2 * len(names), 6), squeeze=False)
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
    fig, axes = subplots(1, len(mats), figsize=(3.4 * len(mats), 3.2), squeeze=False)
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
        fig, ax = subplots(figsize=(6.5, 4))
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
