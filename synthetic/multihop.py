"""Multi-hop recall with and without chain-of-thought: the smallest width that reaches 100%.

For k = 1, 2, 3, ... hops over R random permutations of N subjects (:func:`synthetic.tasks.random_khop`, all R^k
relation sequences per subject), train one-layer models (learned attention: word order matters once k >= 2) and
find by search on a grid of widths the smallest ``d`` at which training reaches 100% train accuracy:

* without chain-of-thought, ``(s, r1..rk) -> e_k`` in one step: the paper predicts d* growing like R^k (the model
  must act as a one-hop store for R^k composite relations);
* with chain-of-thought, ``(s, r1..rk, e1..e_{k-1})`` trained to emit every intermediate entity: each step is a
  one-hop lookup, so d* should stay flat in k (d ~ R + k up to log factors).

A second sweep fixes k and finds, for a few d, the smallest MLP width that reaches 100% (with and without CoT).

Success is "100% of train predictions are the argmax within ``max_steps``" on any of ``restarts`` seeds. The search
assumes success is monotone in the width (it is noisy near the threshold): it walks up the grid from ``start``
until one succeeds, then bisects between the last failure and that success; every trained point is kept in
``points.jsonl`` (resumable: a rerun skips points already there) so a reader can check monotonicity.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

from llmprobe.io import append_jsonl, read_jsonl, write_figure, write_json, write_text

from .tasks import random_khop
from .train import TrainConfig, train

POINTS = "points.jsonl"
D_GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
M_GRID = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class MultihopConfig:
    subjects: int = 64
    relations: int = 2
    hops: list[int] = field(default_factory=lambda: [1, 2, 3])
    seed: int = 0                      # task seed
    restarts: int = 1                  # model seeds tried per point (success = any)
    attention: str = "learned"
    mlp_ratio: float = 4.0             # d_mlp = round(mlp_ratio * d) in the d* search
    d_grid: list[int] = field(default_factory=lambda: list(D_GRID))
    width_hops: int = 2                # the MLP-width sweep: fixed k ...
    width_d: list[int] = field(default_factory=lambda: [8, 16, 32])   # ... these d (empty = skip)
    m_grid: list[int] = field(default_factory=lambda: list(M_GRID))
    lr: float = 0.03
    max_steps: int = 2000
    threads: int | None = None

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(lr=self.lr, max_steps=self.max_steps, seed=seed, progress=False, threads=self.threads)

    def to_dict(self) -> dict:
        return asdict(self)


def _key(cfg: MultihopConfig, hops: int, cot: bool, d: int, d_mlp: int, seed: int) -> str:
    spec = {"N": cfg.subjects, "R": cfg.relations, "k": hops, "cot": cot, "d": d, "m": d_mlp, "seed": seed,
            "task_seed": cfg.seed, "attention": cfg.attention, "lr": cfg.lr, "steps": cfg.max_steps}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


class _Runner:
    """Trains (or recalls from points.jsonl) one grid point."""

    def __init__(self, cfg: MultihopConfig, out_dir: str | None, log=print):
        self.cfg, self.out_dir, self.log = cfg, out_dir, log
        self.done = {}
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            for row in read_jsonl(os.path.join(out_dir, POINTS)):
                self.done[row["key"]] = row

    def success(self, hops: int, cot: bool, d: int, d_mlp: int) -> bool:
        for seed in range(self.cfg.restarts):
            if self.point(hops, cot, d, d_mlp, seed)["success"]:
                return True
        return False

    def point(self, hops: int, cot: bool, d: int, d_mlp: int, seed: int) -> dict:
        key = _key(self.cfg, hops, cot, d, d_mlp, seed)
        if key in self.done:
            return self.done[key]
        task = random_khop(self.cfg.subjects, self.cfg.relations, hops, cot=cot, seed=self.cfg.seed)
        res = train(task, d, config=self.cfg.train_config(seed), attention=self.cfg.attention, d_mlp=d_mlp,
                    seed=seed)
        row = {"key": key, "hops": hops, "cot": cot, "d": d, "d_mlp": d_mlp, "seed": seed,
               "accuracy": round(res.accuracy, 5), "success": bool(res.success), "steps": res.steps,
               "wall_s": res.wall_time_s, "n_sequences": len(task.data()), "n_trainable": res.n_trainable,
               "bits": res.bits, "bits_per_param": res.bits_per_param}
        self.log(f"  k={hops} cot={int(cot)} d={d:4d} m={d_mlp:4d} seed={seed}: acc={res.accuracy:.4f} "
                 f"steps={res.steps} ({res.wall_time_s:.1f} s)")
        self.done[key] = row
        if self.out_dir:
            append_jsonl(os.path.join(self.out_dir, POINTS), row)
        return row


def smallest_on_grid(ok, grid, start: int | None = None) -> tuple[int | None, list[int]]:
    """Smallest grid value v with ok(v) True, assuming monotone success: walk up from ``start`` (default the
    first value) until ok, then bisect down to the last failure (walking down first if ``start`` succeeds).
    Returns (value or None, values tried)."""
    grid = sorted(grid)
    tried, cache = [], {}

    def test(i):
        if i not in cache:
            cache[i] = bool(ok(grid[i]))
            tried.append(grid[i])
        return cache[i]

    i = 0 if start is None else min(range(len(grid)), key=lambda j: abs(grid[j] - start))
    if test(i):
        hi, lo = i, -1
        step = 1
        while hi > 0:                      # walk down with growing steps until a failure
            j = max(0, hi - step)
            if test(j):
                hi = j
                if j == 0:
                    break
                step *= 2
            else:
                lo = j
                break
    else:
        lo, hi, step = i, None, 1
        while hi is None:
            j = min(len(grid) - 1, lo + step)
            if test(j):
                hi = j
            elif j == len(grid) - 1:
                return None, tried
            else:
                lo = j
                step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            hi = mid
        else:
            lo = mid
    return grid[hi], tried


def run_multihop(cfg: MultihopConfig, out_dir: str | None = None, log=print) -> dict:
    """Both sweeps; writes ``summary.json`` and ``table.md`` into ``out_dir`` (and ``points.jsonl`` as it goes)."""
    t0 = time.perf_counter()
    runner = _Runner(cfg, out_dir, log)
    m_of = lambda d: max(1, round(cfg.mlp_ratio * d))  # noqa: E731
    d_star = {}
    for cot in (False, True):
        prev = d_star.get(("direct", min(cfg.hops))) if cot else None     # CoT starts from the one-hop width
        for k in cfg.hops:
            if cot and k == 1:
                d_star[("cot", k)] = d_star.get(("direct", 1))      # one hop: CoT = no CoT
                continue
            log(f"d* search: k={k} {'with' if cot else 'without'} chain-of-thought")
            d, tried = smallest_on_grid(lambda d: runner.success(k, cot, d, m_of(d)), cfg.d_grid, start=prev)
            d_star[("cot" if cot else "direct", k)] = d
            prev = d or prev
    width = {}
    for d in cfg.width_d:
        for cot in (False, True):
            if cot and cfg.width_hops == 1:
                continue
            log(f"MLP width search: k={cfg.width_hops} d={d} {'with' if cot else 'without'} chain-of-thought")
            m, _ = smallest_on_grid(lambda m: runner.success(cfg.width_hops, cot, d, m), cfg.m_grid)
            width[("cot" if cot else "direct", d)] = m
    N, R = cfg.subjects, cfg.relations
    rows = []
    for k in cfg.hops:
        rows.append({"hops": k, "d_star_direct": d_star.get(("direct", k)), "d_star_cot": d_star.get(("cot", k)),
                     "R^k": R ** k, "R+k": R + k, "R*log2N": round(R * math.log2(N), 1),
                     "R^k*log2N": round(R ** k * math.log2(N), 1)})
    wrows = [{"d": d, "d_mlp_direct": width.get(("direct", d)), "d_mlp_cot": width.get(("cot", d))}
             for d in cfg.width_d]
    points = sorted(runner.done.values(), key=lambda r: (r["hops"], r["cot"], r["d"], r["d_mlp"], r["seed"]))
    summary = {"config": cfg.to_dict(), "d_star": rows, "mlp_width": wrows, "points": points,
               "n_points": len(points), "train_wall_s": round(sum(p["wall_s"] for p in points), 1),
               "monotone_violations": _violations(points, cfg.mlp_ratio), "wall_s": round(time.perf_counter() - t0, 1)}
    if out_dir:
        write_json(os.path.join(out_dir, "summary.json"), summary)
        write_text(os.path.join(out_dir, "table.md"), table_markdown(summary))
    return summary


def _violations(points: list[dict], mlp_ratio: float) -> list[dict]:
    """Failed points although a smaller width succeeded: along d (points on the d_mlp = ratio * d rule) or along
    d_mlp (same d), for the same k, CoT and seed. Non-empty means the search's monotonicity assumption was hurt."""
    on_rule = lambda p: p["d_mlp"] == max(1, round(mlp_ratio * p["d"]))  # noqa: E731
    out = []
    for p in points:
        if p["success"]:
            continue
        for q in points:
            if not q["success"] or (q["hops"], q["cot"], q["seed"]) != (p["hops"], p["cot"], p["seed"]):
                continue
            if (q["d"] == p["d"] and q["d_mlp"] < p["d_mlp"]) or (on_rule(p) and on_rule(q) and q["d"] < p["d"]):
                out.append({"hops": p["hops"], "cot": p["cot"], "d": p["d"], "d_mlp": p["d_mlp"],
                            "smaller_success": {"d": q["d"], "d_mlp": q["d_mlp"]}})
                break
    return out


def table_markdown(summary: dict) -> str:
    cfg = summary["config"]
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    lines = [f"N = {cfg['subjects']}, R = {cfg['relations']}, {cfg['attention']} attention, d_mlp = "
             f"{cfg['mlp_ratio']:g} d, {cfg['max_steps']} steps at lr {cfg['lr']:g}, {cfg['restarts']} seed(s) per "
             f"point; '-' = none on the grid up to {max(cfg['d_grid'])}.", "",
             "| k | d* without CoT | d* with CoT | R^k | R + k |", "|---|---|---|---|---|"]
    for r in summary["d_star"]:
        lines.append(f"| {r['hops']} | {fmt(r['d_star_direct'])} | {fmt(r['d_star_cot'])} | {r['R^k']} | "
                     f"{r['R+k']} |")
    if summary["mlp_width"]:
        lines += ["", f"Smallest MLP width reaching 100% at k = {cfg['width_hops']}:", "",
                  "| d | d_mlp without CoT | d_mlp with CoT |", "|---|---|---|"]
        for r in summary["mlp_width"]:
            lines.append(f"| {r['d']} | {fmt(r['d_mlp_direct'])} | {fmt(r['d_mlp_cot'])} |")
    bad = summary.get("monotone_violations") or []
    lines += ["", f"{summary['n_points']} trained points ({summary['train_wall_s']} s of training); "
              f"{len(bad)} failed although a smaller width succeeded (listed in summary.json)."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cfg = summary["config"]
    n_panels = 2 if summary["mlp_width"] else 1
    fig, axes = plt.subplots(1, n_panels, figsize=(5.2 * n_panels, 3.8), squeeze=False)
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
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
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
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("d")
        ax.set_ylabel("smallest MLP width reaching 100%")
        ax.set_title(f"MLP width vs d at k = {cfg['width_hops']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig)
    return path


# -------------------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def add_multihop_parser(synth_subparsers) -> None:
    p = synth_subparsers.add_parser(
        "multihop", help="k-hop: smallest d reaching 100%% with and without chain-of-thought",
        description="Trains one-layer models on k-hop queries and finds the smallest width d (and MLP width) that "
                    "reaches 100%, with and without chain-of-thought. Resumable (points.jsonl in --out).")
    p.add_argument("--subjects", "-N", type=int, default=64)
    p.add_argument("--relations", "-R", type=int, default=2)
    p.add_argument("--hops", default="1,2,3", help="comma list of k (default %(default)s)")
    p.add_argument("--d-grid", default=",".join(map(str, D_GRID)))
    p.add_argument("--mlp-ratio", type=float, default=4.0, help="d_mlp = ratio * d in the d* search")
    p.add_argument("--width-hops", type=int, default=2, help="k of the MLP-width sweep")
    p.add_argument("--width-d", default="8,16,32", help="d values of the MLP-width sweep ('' = skip)")
    p.add_argument("--m-grid", default=",".join(map(str, M_GRID)))
    p.add_argument("--attention", choices=["uniform", "learned"], default="learned")
    p.add_argument("--restarts", type=int, default=1, help="model seeds per point (success = any)")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--img-dir", default=None, help="also write the plot here as mech_multihop.png")
    p.add_argument("--out", required=True, help="output folder (points.jsonl, summary.json, table.md, plot)")
    p.set_defaults(func=cmd_multihop)


def cmd_multihop(args) -> dict:
    cfg = MultihopConfig(subjects=args.subjects, relations=args.relations, hops=_ints(args.hops), seed=args.seed,
                         restarts=args.restarts, attention=args.attention, mlp_ratio=args.mlp_ratio,
                         d_grid=_ints(args.d_grid), width_hops=args.width_hops, width_d=_ints(args.width_d),
                         m_grid=_ints(args.m_grid), lr=args.lr, max_steps=args.max_steps, threads=args.threads)
    summary = run_multihop(cfg, args.out)
    path = plot(summary, os.path.join(args.out, "multihop.png"))
    if args.img_dir:
        import shutil

        os.makedirs(args.img_dir, exist_ok=True)
        shutil.copyfile(path, os.path.join(args.img_dir, "mech_multihop.png"))
    print(table_markdown(summary))
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['wall_s']} s)")
    return summary
