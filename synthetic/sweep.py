"""Capacity sweeps: the threshold width d* per (N, R) by bisection on d, trainable and frozen subject embeddings.

For every cell (N, R, seed, mode) the sweep trains at a few widths d and finds the smallest d that reaches
100% train accuracy (``success``: every fact's answer is the argmax, within the step cap). It does not train a
full grid: it starts from a guess, walks up or down by a factor until it has one failing and one succeeding width
(``bracket``), then bisects the integer interval. It assumes success is monotone in d (noisy near the threshold;
every trained point is kept, so a reader can see any non-monotone one). Modes: ``trainable`` (every parameter
learns), ``frozen`` (subject embeddings frozen at random init, the paper's control) and ``frozen_all`` (subject
embeddings *and* the attribute unembedding frozen: only the relation embeddings and the MLP learn).

Every trained point is appended to ``results.jsonl`` (one JSON line per run, flushed and fsynced, under a file
lock so worker processes can share it). A point is keyed by (N, R, seed, mode, d, d_mlp rule, attention, training
config); a rerun of the same sweep reads the file first and skips every key already there, so an interrupted
sweep resumes where it stopped. :func:`summarize` fits ``d* = c * R * log2 N`` by least squares through the origin
with a bootstrap interval over cells (and a power law ``d* = a N^alpha R^beta`` in log space, which separates
logarithmic from polynomial growth in N), and :func:`plot` draws accuracy against d and d* against R log2 N.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch

from llmprobe.io import append_jsonl, read_jsonl, write_figure, write_json, write_text

from .train import TrainConfig, train
from .tasks import random_bijections

RESULTS = "results.jsonl"


@dataclass
class SweepConfig:
    subjects: list[int] = field(default_factory=lambda: [256, 512])    # a small grid (~4 min of CPU); the
    relations: list[int] = field(default_factory=lambda: [2, 4, 8])     # README's full grid is 256-1024 x 2-16
    seeds: list[int] = field(default_factory=lambda: [0])
    modes: list[str] = field(default_factory=lambda: ["trainable", "frozen"])
    mlp_ratio: float = 8.0               # d_mlp = round(mlp_ratio * d) (ignored when d_mlp is set)
    d_mlp: int | None = None
    attention: str = "uniform"
    d_min: int = 2
    d_max: int = 512
    workers: int = 1
    threads: int = 1                     # torch threads per worker
    train: TrainConfig = field(default_factory=lambda: TrainConfig(progress=False))


MODES = ("trainable", "frozen", "frozen_all")


def point_key(N: int, R: int, seed: int, mode: str, d: int, cfg: SweepConfig) -> str:
    """Identity of one trained point (what a resumed sweep looks up)."""
    t = cfg.train
    spec = {"N": N, "R": R, "seed": seed, "frozen": mode != "trainable", "d": d, "attention": cfg.attention,
            "d_mlp": cfg.d_mlp if cfg.d_mlp else f"x{cfg.mlp_ratio}", "lr": t.lr, "max_steps": t.max_steps,
            "batch": t.batch_size, "warmup": t.warmup_frac, "min_lr": t.min_lr_frac, "betas": list(t.betas),
            "sched": t.schedule, "target": t.target_acc}
    if mode not in ("trainable", "frozen"):
        spec["mode"] = mode
    if t.weight_decay:                    # only when set, so that keys of earlier sweeps stay valid
        spec["weight_decay"] = t.weight_decay
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def load_results(out_dir: str) -> list[dict]:
    """Every finished point of a sweep directory (a torn last line from a killed run is ignored)."""
    return read_jsonl(os.path.join(out_dir, RESULTS))


def initial_guess(N: int, R: int, mode: str, bits_per_subject: float | None = None) -> int:
    """Starting width from the measured rule of thumb d* ~ 0.2 * (bits of facts per subject), i.e. ~0.17 R log2 N
    for R random bijections (bits per subject = R log2(N!) / N), 1.5 times that for frozen subjects; for
    frozen_all the MLP must hold the facts: 16 d^2 * 2 bits ~ all the bits. ``bits_per_subject``: of a general
    fact table (``FactTask.bits() / n_subjects``; default: that of R bijections)."""
    if bits_per_subject is None:
        bits_per_subject = R * (math.lgamma(N + 1) / math.log(2)) / N
    if mode == "frozen_all":
        return max(2, int(round(math.sqrt(N * bits_per_subject / 32))))
    return max(2, int(round(0.2 * bits_per_subject * (1.5 if mode == "frozen" else 1.0))))


class _Cell:
    """Bisection state for one (N, R, seed, mode) cell, fed with cached or fresh results.

    From the start width it steps down after a success (up after a failure) by ~12% of d (by 1 when the start is
    another seed's d*), doubling the step on every further move in the same direction, until it holds a failing
    width below a succeeding one; then it bisects. With a good start this takes two or three runs.
    """

    def __init__(self, N, R, seed, mode, cfg: SweepConfig, start: int | None = None,
                 bits_per_subject: float | None = None):
        self.N, self.R, self.seed, self.mode, self.cfg = N, R, seed, mode, cfg
        self.prior = start is not None
        self.start = start or initial_guess(N, R, mode, bits_per_subject)
        self.ok: dict[int, bool] = {}
        self.order: list[int] = []

    def record(self, d: int, success: bool) -> None:
        self.ok[d] = success
        self.order.append(d)

    def next_d(self) -> int | None:
        """The next width to train, or None when d* is determined (or the range is exhausted)."""
        lo, hi = self.cfg.d_min, self.cfg.d_max
        succ = [d for d, s in self.ok.items() if s]
        fail = [d for d, s in self.ok.items() if not s]
        best = min(succ) if succ else None
        worst = max([d for d in fail if best is None or d < best], default=None)
        if best is None and worst is None:
            return min(max(self.start, lo), hi)
        if best is not None and worst is not None:
            return None if best - worst <= 1 else (best + worst) // 2
        going_up = best is None
        streak = 0                                  # consecutive moves in the current direction
        for d in reversed(self.order):
            if self.ok[d] == (not going_up):
                streak += 1
            else:
                break
        ref = worst if going_up else best
        base = 1 if self.prior else max(1, int(round(0.12 * ref)))
        step = base * 2 ** max(0, streak - 1)
        if going_up:
            return None if worst >= hi else min(hi, worst + step)
        return None if best <= lo else max(lo, best - step)

    def d_star(self) -> int | None:
        succ = [d for d, s in self.ok.items() if s]
        return min(succ) if succ else None


def _run_point(N, R, seed, mode, d, cfg: SweepConfig) -> dict:
    task = random_bijections(N, R, seed)
    d_mlp = cfg.d_mlp or max(1, int(round(cfg.mlp_ratio * d)))
    res = train(task, d, config=cfg.train, frozen_subjects=mode != "trainable",
                frozen_unembed=mode == "frozen_all", d_mlp=d_mlp, attention=cfg.attention, seed=seed)
    row = res.to_dict()
    row.pop("train", None)
    row["history"] = row["history"][-3:]
    row.update({"key": point_key(N, R, seed, mode, d, cfg), "seed": seed, "mode": mode,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return row


def _bisect_cell(N, R, seed, mode, cfg: SweepConfig, out_dir: str, cache: dict, start: int | None) -> dict:
    cell = _Cell(N, R, seed, mode, cfg, start)
    while True:
        d = cell.next_d()
        if d is None:
            break
        key = point_key(N, R, seed, mode, d, cfg)
        row = cache.get(key)
        if row is None:
            row = _run_point(N, R, seed, mode, d, cfg)
            append_jsonl(os.path.join(out_dir, RESULTS), row)
            print(f"[sweep] N={N} R={R} seed={seed} {mode} d={d}: "
                  f"acc={row['accuracy']:.4f} steps={row['steps']} {row['wall_time_s']:.0f}s", flush=True)
        cell.record(d, bool(row["success"]))
    return {"N": N, "R": R, "seed": seed, "mode": mode, "d_star": cell.d_star(),
            "tried": sorted(cell.ok.items())}


def _sweep_unit(args) -> list[dict]:
    """All seeds of one (N, R, mode), in order: each later seed starts from the previous seed's d*."""
    (N, R, mode, cfg, out_dir, cache) = args
    torch.set_num_threads(max(1, cfg.threads))
    out, start = [], None
    for seed in cfg.seeds:
        res = _bisect_cell(N, R, seed, mode, cfg, out_dir, cache, start)
        out.append(res)
        start = res["d_star"] or start
    return out


def run_sweep(cfg: SweepConfig, out_dir: str) -> dict:
    """Run (or resume) the sweep; returns :func:`summarize` of everything in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    cache = {r["key"]: r for r in load_results(out_dir) if "key" in r}
    bad = [m for m in cfg.modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown sweep modes {bad}; choose from {MODES}")
    units = [(N, R, mode) for N in cfg.subjects for R in cfg.relations for mode in cfg.modes]
    # cheap cells first: an interrupted sweep then has whole rows of the table, and a rerun finishes the rest
    units.sort(key=lambda u: (u[0] ** 2 * u[1]) * (1 if u[2] == "trainable" else 1.5))
    jobs = [(N, R, mode, cfg, out_dir, cache) for (N, R, mode) in units]
    if cfg.workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Pool(cfg.workers) as pool:
            for _ in pool.imap_unordered(_sweep_unit, jobs):
                pass
    else:
        for job in jobs:
            _sweep_unit(job)
    summary = summarize(out_dir, cfg)
    write_json(os.path.join(out_dir, "summary.json"), summary)
    write_text(os.path.join(out_dir, "table.md"), table_markdown(summary))
    try:
        plot(out_dir, summary)
    except ImportError:  # pragma: no cover - matplotlib missing
        pass
    return summary


# ----------------------------------------------------------------------------- analysis
def thresholds(rows: list[dict]) -> dict:
    """d* per (N, R, seed, mode): smallest successful d with d-1 observed failing (``exact``), from rows."""
    cells: dict[tuple, dict[int, bool]] = {}
    for r in rows:
        cells.setdefault((r["n_subjects"], r["n_relations"], r["seed"], r["mode"]), {})[r["d_model"]] = r["success"]
    out = {}
    for key, pts in cells.items():
        succ = [d for d, s in pts.items() if s]
        best = min(succ) if succ else None
        exact = best is not None and pts.get(best - 1) is False
        out[key] = {"d_star": best, "exact": exact, "max_failed": max([d for d, s in pts.items() if not s],
                                                                       default=None)}
    return out


def fit_constant(points: list[tuple[float, float]], n_boot: int = 2000, seed: int = 0) -> dict:
    """Least squares through the origin y = c x with a bootstrap 95% interval over points."""
    if not points:
        return {"c": None, "lo": None, "hi": None, "n": 0}

    def fit(pts):
        sxx = sum(x * x for x, _ in pts)
        return sum(x * y for x, y in pts) / sxx if sxx else float("nan")

    c = fit(points)
    rng = random.Random(seed)
    boots = sorted(fit([points[rng.randrange(len(points))] for _ in points]) for _ in range(n_boot))
    resid = [y - c * x for x, y in points]
    ss_res = sum(e * e for e in resid)
    mean_y = sum(y for _, y in points) / len(points)
    ss_tot = sum((y - mean_y) ** 2 for _, y in points)
    return {"c": c, "lo": boots[int(0.025 * n_boot)], "hi": boots[int(0.975 * n_boot) - 1], "n": len(points),
            "r2": 1 - ss_res / ss_tot if ss_tot else None}


def summarize(out_dir: str, cfg: SweepConfig | None = None) -> dict:
    """Thresholds per cell, mean over seeds per (N, R, mode), fitted constants, bits per parameter at d*."""
    rows = load_results(out_dir)
    th = thresholds(rows)
    d_max = cfg.d_max if cfg is not None else SweepConfig().d_max
    by_point = {(r["n_subjects"], r["n_relations"], r["seed"], r["mode"], r["d_model"]): r for r in rows}
    table: dict[tuple, dict] = {}
    for (N, R, seed, mode), t in th.items():
        entry = table.setdefault((N, R, mode), {"N": N, "R": R, "mode": mode, "d_star": [], "bits_per_param": [],
                                                 "steps": [], "time_s": [], "censored": 0, "pending": 0,
                                                 "upper_bounds": []})
        if t["d_star"] is None:
            if t["max_failed"] is not None and t["max_failed"] >= d_max:
                entry["censored"] += 1          # no width up to d_max reached 100%
            else:
                entry["pending"] += 1           # search not finished (interrupted sweep)
            continue
        if not t["exact"]:                      # d*-1 never tried: only an upper bound, kept out of the fits
            entry["upper_bounds"].append(t["d_star"])
            continue
        entry["d_star"].append(t["d_star"])
        r = by_point[(N, R, seed, mode, t["d_star"])]
        entry["bits_per_param"].append(r["bits_per_param"])
        entry["steps"].append(r["steps"])
        entry["time_s"].append(r["wall_time_s"])
    rows_out = []
    fits, powers = {}, {}
    modes = [m for m in MODES if any(k[2] == m for k in table)]
    for mode in modes:
        pts = [(N, R, d) for (N, R, m), e in sorted(table.items()) if m == mode for d in e["d_star"]]
        fits[mode] = fit_constant([(R * math.log2(N), d) for N, R, d in pts])
        powers[mode] = fit_power(pts)
    for (N, R, mode), e in sorted(table.items(), key=lambda kv: (MODES.index(kv[0][2]), kv[0][0], kv[0][1])):
        ds = e["d_star"]
        rows_out.append({
            "N": N, "R": R, "mode": mode, "d_star": ds, "d_star_mean": sum(ds) / len(ds) if ds else None,
            "R_log2N": R * math.log2(N),
            "bits_per_param": sum(e["bits_per_param"]) / len(ds) if ds else None,
            "steps": sum(e["steps"]) / len(ds) if ds else None,
            "time_s": sum(e["time_s"]) / len(ds) if ds else None,
            "censored": e["censored"], "pending": e["pending"], "upper_bounds": e["upper_bounds"]})
    total_time = sum(r.get("wall_time_s", 0) for r in rows)
    cpu_time = sum(r.get("cpu_time_s") or 0 for r in rows)
    return {"cells": rows_out, "fits": fits, "power_fits": powers, "n_runs": len(rows),
            "train_time_s": round(total_time, 1), "cpu_time_s": round(cpu_time, 1),
            "config": None if cfg is None else _cfg_dict(cfg)}


def fit_power(points: list[tuple[int, int, float]]) -> dict:
    """Least squares ``log d = log a + alpha log N + beta log R`` over (N, R, d) points (None when degenerate)."""
    import numpy as np

    if len(points) < 3:
        return {"a": None, "alpha": None, "beta": None}
    X = np.array([[1.0, math.log(N), math.log(R)] for N, R, _ in points])
    y = np.array([math.log(d) for _, _, d in points])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    if np.linalg.matrix_rank(X) < 3:
        return {"a": None, "alpha": None, "beta": None}
    return {"a": float(math.exp(coef[0])), "alpha": float(coef[1]), "beta": float(coef[2])}


def table_markdown(summary: dict) -> str:
    """Markdown table of d* per (N, R), one column group per mode, with the fits underneath."""
    fits = summary["fits"]
    d_max = (summary.get("config") or {}).get("d_max", SweepConfig().d_max)
    cells = {(c["N"], c["R"], c["mode"]): c for c in summary["cells"]}
    modes = [m for m in MODES if any(k[2] == m for k in cells)]
    head = "| N | R | R log2 N |"
    rule = "|---|---|---|"
    for m in modes:
        head += f" d* {m} | bits/param | steps |"
        rule += "---|---|---|"
    lines = [head, rule]

    def ds(c):
        if c is None:
            return "-"
        parts = [str(d) for d in c["d_star"]] + [f"<={d}" for d in c.get("upper_bounds", [])]
        parts += [f">{d_max}"] * c["censored"] + ["?"] * c.get("pending", 0)
        return ", ".join(parts) or "-"

    def fmt(v, p=2):
        return "-" if v is None else f"{v:.{p}f}"

    for N, R in sorted({(c["N"], c["R"]) for c in summary["cells"]}):
        line = f"| {N} | {R} | {R * math.log2(N):.0f} |"
        for m in modes:
            c = cells.get((N, R, m))
            line += f" {ds(c)} | {fmt(c and c['bits_per_param'])} | {fmt(c and c['steps'], 0)} |"
        lines.append(line)
    lines.append("")
    for mode in modes:
        fit = fits.get(mode) or {}
        if fit.get("c") is not None:
            r2 = "-" if fit.get("r2") is None else f"{fit['r2']:.3f}"
            pw = (summary.get("power_fits") or {}).get(mode) or {}
            extra = "" if pw.get("alpha") is None else \
                f"; power law d* = {pw['a']:.3f} N^{pw['alpha']:.2f} R^{pw['beta']:.2f}"
            lines.append(f"Fit {mode}: d* = {fit['c']:.3f} * R log2 N (95% bootstrap interval "
                         f"{fit['lo']:.3f}-{fit['hi']:.3f}, n={fit['n']}, R^2={r2}){extra}  ")
    return "\n".join(lines) + "\n"


def plot(out_dir: str, summary: dict | None = None, img_dir: str | None = None, prefix: str = "") -> list[str]:
    """``{prefix}accuracy_vs_d.png`` and ``{prefix}dstar_vs_RlogN.png`` in ``img_dir`` (default ``out_dir``),
    written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summary or summarize(out_dir)
    rows = load_results(out_dir)
    img_dir = img_dir or out_dir
    os.makedirs(img_dir, exist_ok=True)
    paths = []
    Ns = sorted({r["n_subjects"] for r in rows})
    Rs = sorted({r["n_relations"] for r in rows})
    if not rows:
        return paths
    fig, axes = plt.subplots(1, len(Ns), figsize=(4.2 * len(Ns), 3.4), squeeze=False, sharey=True)
    cmap = plt.get_cmap("viridis")
    for i, N in enumerate(Ns):
        ax = axes[0, i]
        for j, R in enumerate(Rs):
            color = cmap(j / max(1, len(Rs) - 1))
            for mode, style in (("trainable", "-o"), ("frozen", "--s"), ("frozen_all", ":^")):
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

    fig, ax = plt.subplots(figsize=(7.6, 4.0))
    markers = {N: m for N, m in zip(Ns, "os^Dv<>")}
    for mode, color in (("trainable", "tab:blue"), ("frozen", "tab:red"), ("frozen_all", "tab:gray")):
        for c in summary["cells"]:
            if c["mode"] != mode or not c["d_star"]:
                continue
            for d in c["d_star"]:
                ax.scatter(c["R_log2N"], d, color=color, marker=markers.get(c["N"], "o"), s=18, alpha=0.8)
        fit = summary["fits"].get(mode) or {}
        if fit.get("c") is not None and (fit.get("r2") is None or fit["r2"] >= 0.5):
            xs = [0, max(c["R_log2N"] for c in summary["cells"])]
            ax.plot(xs, [fit["c"] * x for x in xs], color=color, lw=1,
                    label=f"{mode}: d* = {fit['c']:.2f} R log2 N")
        elif fit.get("c") is not None:          # not linear in R log N: show the power law instead
            pw = (summary.get("power_fits") or {}).get(mode) or {}
            label = mode if pw.get("alpha") is None else \
                f"{mode}: d* ~ N^{pw['alpha']:.2f} R^{pw['beta']:.2f} (no linear fit)"
            ax.scatter([], [], color=color, s=18, label=label)
    for N, m in markers.items():
        ax.scatter([], [], color="gray", marker=m, s=18, label=f"N={N}")
    ax.set_xlabel("R log2 N")
    ax.set_ylabel("threshold width d*")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(str(write_figure(os.path.join(img_dir, f"{prefix}dstar_vs_RlogN.png"), fig)))
    return paths


def _cfg_dict(cfg: SweepConfig) -> dict:
    d = dict(cfg.__dict__)
    d["train"] = cfg.train.to_dict()
    return d
