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

import numpy as np

from llmprobe.io import append_jsonl, read_jsonl, write_json, write_text
from llmprobe.metric import Metric, nan_metric
from synthetic.batched import train_batched
from synthetic.tasks import random_khop
from synthetic.train import TrainConfig, model_config_for, train

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


def _key(cfg, hops: int, cot: bool, d: int, d_mlp: int, seed: int, relations: int | None = None,
         task_seed: int | None = None) -> str:
    """Point id from the settings that change its training (``cfg``: a :class:`MultihopConfig` or
    :class:`SeedsConfig`; ``relations`` / ``task_seed`` default to ``cfg.relations`` / ``cfg.seed``)."""
    spec = {"N": cfg.subjects, "R": cfg.relations if relations is None else relations, "k": hops, "cot": cot,
            "d": d, "m": d_mlp, "seed": seed, "task_seed": cfg.seed if task_seed is None else task_seed,
            "attention": cfg.attention, "lr": cfg.lr, "steps": cfg.max_steps}
    if TrainConfig.flush_denormals:       # as synthetic.sweep.point_key: only when set (train_config's default)
        spec["ftz"] = True
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


def search_grid(grid, start: int | None = None):
    """The width search as a generator: yields the next grid value to try and receives whether it succeeded
    (``success = yield value``); returns (smallest succeeding value or None, values tried). Assumes monotone
    success: walk up from ``start`` (default the first value) until one succeeds, then bisect down to the last
    failure (walking down with growing steps first if ``start`` succeeds). Several searches can so be stepped in
    lockstep (one batched training per round, :func:`run_seeds`)."""
    grid = sorted(grid)
    tried, cache = [], {}

    def test(i):
        if i not in cache:
            cache[i] = bool((yield grid[i]))
            tried.append(grid[i])
        return cache[i]

    i = 0 if start is None else min(range(len(grid)), key=lambda j: abs(grid[j] - start))
    if (yield from test(i)):
        hi, lo = i, -1
        step = 1
        while hi > 0:                      # walk down with growing steps until a failure
            j = max(0, hi - step)
            if (yield from test(j)):
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
            if (yield from test(j)):
                hi = j
            elif j == len(grid) - 1:
                return None, tried
            else:
                lo = j
                step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (yield from test(mid)):
            hi = mid
        else:
            lo = mid
    return grid[hi], tried


def smallest_on_grid(ok, grid, start: int | None = None) -> tuple[int | None, list[int]]:
    """Smallest grid value v with ok(v) True (:func:`search_grid` driven by ``ok``). Returns (value or None,
    values tried)."""
    search = search_grid(grid, start)
    try:
        value = next(search)
        while True:
            value = search.send(bool(ok(value)))
    except StopIteration as stop:
        return stop.value


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
    d_mlp (same d), for the same k, CoT, seed (and R where rows carry it). Non-empty means the search's monotonicity assumption was hurt."""
    on_rule = lambda p: p["d_mlp"] == max(1, round(mlp_ratio * p["d"]))  # noqa: E731
    out = []
    for p in points:
        if p["success"]:
            continue
        for q in points:
            if not q["success"] or (q["hops"], q["cot"], q["seed"], q.get("R")) != (p["hops"], p["cot"], p["seed"],
                                                                                   p.get("R")):
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


# ------------------------------------------------------------------------------------------ seeds x R grid
SEEDS_FILE = "seeds.json"


@dataclass
class SeedsConfig:
    """The grid k x CoT x R x seed of :func:`run_seeds`; seed s draws the permutations (task seed s) *and* the
    initialisation (model seed s). Training recipe as :class:`MultihopConfig` (one model per point)."""

    subjects: int = 16
    relations: list[int] = field(default_factory=lambda: [2, 4, 8])
    hops: list[int] = field(default_factory=lambda: [1, 2, 3])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    attention: str = "learned"
    mlp_ratio: float = 4.0
    d_grid: list[int] = field(default_factory=lambda: list(D_GRID))
    lr: float = 0.03
    max_steps: int = 2000
    threads: int | None = None
    n_boot: int = 2000
    cot: list[bool] = field(default_factory=lambda: [False, True])   # which cells to search (no CoT, with CoT)
    train: bool = True                 # False: summarise the points there are; open searches end bracketed

    def to_dict(self) -> dict:
        return asdict(self)


def _train_points(cfg: SeedsConfig, R: int, hops: int, cot: bool, todo: list[tuple[int, int]]) -> list[dict]:
    """Train the points ``todo`` [(seed, d)] of one (R, k, CoT) cell at once (:func:`synthetic.batched.
    train_batched`: same data shape, models stacked and padded to the widest); one row per point, in order."""
    tasks = [random_khop(cfg.subjects, R, hops, cot=cot, seed=s) for s, _ in todo]
    mcfgs = [model_config_for(t, d, attention=cfg.attention, d_mlp=max(1, round(cfg.mlp_ratio * d)), seed=s)
             for t, (s, d) in zip(tasks, todo)]
    tcfg = TrainConfig(lr=cfg.lr, max_steps=cfg.max_steps, progress=False, threads=cfg.threads)
    rows = []
    for task, mc, (s, d), res in zip(tasks, mcfgs, todo, train_batched(tasks, mcfgs, tcfg)):
        rows.append({"key": _key(cfg, hops, cot, d, mc.d_mlp, s, relations=R, task_seed=s), "N": cfg.subjects,
                     "R": R, "hops": hops, "cot": cot, "d": d, "d_mlp": mc.d_mlp, "seed": s,
                     "accuracy": round(res.accuracy, 5), "success": bool(res.success), "steps": res.steps,
                     "wall_s": res.wall_time_s, "cpu_s": res.cpu_time_s, "batch_models": res.batch_models,
                     "n_sequences": len(task.data()), "n_trainable": res.n_trainable, "bits": res.bits})
    return rows


def _start(d_star: dict, cfg: SeedsConfig, hops: int, cot: bool, R: int) -> int | None:
    """First width tried in a cell: the previous R's d* (geometric mean over seeds) times the growth expected
    from it (2^(k/2) per doubling of R without CoT, the one-hop growth with CoT), else the previous k's d*
    (times sqrt(R) without CoT); None (the grid's bottom) for the first cell. Only the search's cost depends
    on it."""
    def gmean(k, c, r):
        ds = [d_star[(k, c, r, s)]["d_star"] for s in cfg.seeds if (k, c, r, s) in d_star]
        ds = [d for d in ds if d]
        return math.exp(sum(map(math.log, ds)) / len(ds)) if ds else None

    prev_r = max([r for r in cfg.relations if r < R], default=None)
    if prev_r and gmean(hops, cot, prev_r):
        one_hop = (gmean(1, False, R) or 0) / (gmean(1, False, prev_r) or 1)
        grow = (R / prev_r) ** (hops / 2) if not cot else max(1.0, one_hop)
        return round(gmean(hops, cot, prev_r) * grow)
    if gmean(hops - 1, cot if hops > 2 else False, R):
        return round(gmean(hops - 1, cot if hops > 2 else False, R) * (1.0 if cot else math.sqrt(R)))
    return None


def run_seeds(cfg: SeedsConfig, out_dir: str | None = None, log=print) -> dict:
    """d* (smallest width on ``cfg.d_grid`` reaching 100% train accuracy, d_mlp = ratio * d) for every k, CoT,
    R and seed. The seeds of a cell are searched in lockstep (:func:`search_grid`), each round's points trained
    together; every point goes to ``points.jsonl`` (resumable), the summary with the fits to ``seeds.json``.
    One-hop with CoT is the same data as without: its d* is copied (so one-hop without CoT is always searched;
    ``cfg.cot`` = [True] searches the CoT cells only, e.g. in a second process on the same ``points.jsonl``)."""
    t0 = time.perf_counter()
    path = os.path.join(out_dir, POINTS) if out_dir else None
    done = {row["key"]: row for row in read_jsonl(path)} if path else {}
    m_of = lambda d: max(1, round(cfg.mlp_ratio * d))  # noqa: E731
    d_star = {}
    for R in sorted(cfg.relations):
        for cot in (False, True):
            for k in cfg.hops:
                if cot not in cfg.cot and not (k == 1 and not cot):
                    continue
                if cot and k == 1:
                    for s in cfg.seeds:
                        d_star[(k, True, R, s)] = dict(d_star[(k, False, R, s)], copied_from="no CoT")
                    continue
                start = _start(d_star, cfg, k, cot, R)
                log(f"R={R} k={k} {'with' if cot else 'without'} CoT: seeds {cfg.seeds}, start d={start}")
                searches = {s: search_grid(cfg.d_grid, start) for s in cfg.seeds}
                pending = {s: next(g) for s, g in searches.items()}
                while pending:
                    todo = [(s, d) for s, d in pending.items()
                            if _key(cfg, k, cot, d, m_of(d), s, relations=R, task_seed=s) not in done]
                    if todo and not cfg.train:          # open search: d* bracketed by the points trained so far
                        for s, _ in todo:
                            mine = [p for p in done.values() if p.get("N") == cfg.subjects and (
                                p["R"], p["hops"], p["cot"], p["seed"]) == (R, k, cot, s)]
                            hi = min((p["d"] for p in mine if p["success"]), default=None)
                            fails = [p["d"] for p in mine if not p["success"] and (hi is None or p["d"] < hi)]
                            d_star[(k, cot, R, s)] = {"d_star": hi, "d_fail": max(fails, default=None),
                                                      "tried": sorted(p["d"] for p in mine), "open": True}
                            del pending[s]
                        todo = []
                    for row in (_train_points(cfg, R, k, cot, todo) if todo else []):
                        done[row["key"]] = row
                        if path:
                            append_jsonl(path, row)
                        log(f"  R={R} k={k} cot={int(cot)} seed={row['seed']} d={row['d']:4d}: "
                            f"acc={row['accuracy']:.4f} steps={row['steps']} ({row['cpu_s']:.0f} s cpu)")
                    nxt = {}
                    for s, d in pending.items():
                        ok = done[_key(cfg, k, cot, d, m_of(d), s, relations=R, task_seed=s)]["success"]
                        try:
                            nxt[s] = searches[s].send(ok)
                        except StopIteration as stop:
                            value, tried = stop.value
                            below = [v for v in tried if value is None or v < value]
                            d_star[(k, cot, R, s)] = {"d_star": value, "d_fail": max(below, default=None),
                                                      "tried": tried, "open": False}
                    pending = nxt
    rows = [{"hops": k, "cot": c, "R": R, "seed": s, **v} for (k, c, R, s), v in sorted(d_star.items())]
    points = sorted((p for p in done.values() if p.get("N") == cfg.subjects),
                    key=lambda r: (r["R"], r["hops"], r["cot"], r["seed"], r["d"]))
    summary = summarize_seeds(cfg, rows, points)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    if out_dir:
        write_json(os.path.join(out_dir, SEEDS_FILE), summary)
    return summary


def resample_within(strata, rng):
    """Bootstrap indices [n] that draw, for every distinct value of ``strata`` [n], as many items of that value
    (with replacement) as it has: resampling seeds within each R."""
    strata = np.asarray(strata)
    return np.concatenate([rng.choice(np.flatnonzero(strata == v), int((strata == v).sum()))
                           for v in np.unique(strata)])


def fit_growth(points: list[tuple[float, float]], n_boot: int = 2000, seed: int = 0, level: float = 0.95):
    """log d = a + b log R by least squares over points (R, d) (one per seed; d None = not reached, dropped):
    a :class:`llmprobe.metric.Metric` for b whose interval is a percentile bootstrap that resamples the points
    *within each R* (the R values stay fixed); ``note`` carries "a=<log d at R = 1> R2=<the fit's R^2>"."""
    pts = np.asarray([(R, d) for R, d in points if d], dtype=np.float64).reshape(-1, 2)
    if len(pts) == 0 or len(set(pts[:, 0])) < 2:
        return nan_metric("bootstrap (seeds within R)", "needs d at two or more R")
    x, y = np.log(pts[:, 0]), np.log(pts[:, 1])

    def slope(i):
        xc = x[i] - x[i].mean()
        return float((xc * (y[i] - y[i].mean())).sum() / (xc ** 2).sum())

    everything = np.arange(len(pts))
    b = slope(everything)
    a = float(y.mean() - b * x.mean())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - a - b * x) ** 2).sum()) / ss_tot if ss_tot else float("nan")
    rng = np.random.default_rng(seed)
    boots = np.array([slope(resample_within(pts[:, 0], rng)) for _ in range(n_boot)])
    lo, hi = (float(q) for q in np.quantile(boots, [(1 - level) / 2, (1 + level) / 2]))
    return Metric(b, (min(lo, b), max(hi, b)), len(pts), "bootstrap (seeds within R)",
                  note=f"a={a:.4f} R2={r2:.3f}")


def summarize_seeds(cfg: SeedsConfig, rows: list[dict], points: list[dict]) -> dict:
    """Per (k, CoT): d* per R (mean, min, max over seeds), the exponent b of d* ~ R^b (:func:`fit_growth`) with
    its distance to k and k/2, the same fit on the largest failing width (d* is only known to lie in
    (d_fail, d*]) and on the trainable parameter count at d*, to be compared with k. A search left open
    (``train=False``) counts with its smallest success as d* (an upper bound) and its largest failure as
    d_fail (a lower bound, also where nothing succeeded yet). ``composite_bits_per_param``: N R^k log2 N (the
    bits of every composite answer, what a one-step store must hold) over the trainable parameters at d*.
    ``pooled_vs_Rk``: the same fit over all k against Q = R^k (strata = values of Q)."""
    cells = {}
    for k in cfg.hops:
        for cot in (False, True):
            mine = [r for r in rows if r["hops"] == k and r["cot"] == cot]
            if not mine:
                continue
            by_r = {}
            for R in sorted({r["R"] for r in mine}):
                ds = [r["d_star"] for r in mine if r["R"] == R]
                got = [d for d in ds if d]
                by_r[str(R)] = {"d_star": ds, "d_fail": [r["d_fail"] for r in mine if r["R"] == R],
                                "mean": sum(got) / len(got) if got else None, "min": min(got, default=None),
                                "max": max(got, default=None),
                                "not_reached": sum(r["d_star"] is None and not r.get("open") for r in mine
                                                   if r["R"] == R),
                                "open": sum(bool(r.get("open")) for r in mine if r["R"] == R)}
            params = {(p["R"], p["seed"], p["d"]): p["n_trainable"] for p in points
                      if p["hops"] == k and p["cot"] == (cot and k > 1)}
            for R, v in by_r.items():        # the N R^k composite answers (log2 N bits each) per parameter at d*
                bpp = [cfg.subjects * int(R) ** k * math.log2(cfg.subjects) / params[(int(R), r["seed"], r["d_star"])]
                       for r in mine if r["R"] == int(R) and (int(R), r["seed"], r["d_star"]) in params]
                v["composite_bits_per_param"] = sum(bpp) / len(bpp) if bpp else None
            b = fit_growth([(r["R"], r["d_star"]) for r in mine], cfg.n_boot)
            b_lo = fit_growth([(r["R"], r["d_fail"] if r["d_star"] or r.get("open") else None) for r in mine],
                              cfg.n_boot)
            b_par = fit_growth([(r["R"], params.get((r["R"], r["seed"], r["d_star"]))) for r in mine], cfg.n_boot)
            cells[f"k{k}_{'cot' if cot else 'direct'}"] = {
                "hops": k, "cot": cot, "by_R": by_r, "b": b.to_dict(), "b_on_d_fail": b_lo.to_dict(),
                "b_params": b_par.to_dict(),
                "b_d2": {"value": 2 * b.value, "ci": [2 * b.ci[0], 2 * b.ci[1]]},
                "k_in_ci": bool(b.ci[0] <= k <= b.ci[1]), "half_k_in_ci": bool(b.ci[0] <= k / 2 <= b.ci[1])}
    # all k pooled: d* against the number of composite relations Q = R^k (a one-step store of N Q answers)
    pooled = {("cot" if cot else "direct"): fit_growth([(r["R"] ** r["hops"], r["d_star"]) for r in rows
                                                        if r["cot"] == cot], cfg.n_boot).to_dict()
              for cot in (False, True)}
    return {"config": cfg.to_dict(), "cells": cells, "pooled_vs_Rk": pooled, "d_star": rows, "points": points,
            "n_points": len(points),
            "train_cpu_s": round(sum(p.get("cpu_s") or 0 for p in points), 1),
            "monotone_violations": _violations(points, cfg.mlp_ratio)}


def seeds_markdown(summary: dict) -> str:
    """The d* table (mean [min, max] over seeds) and the fits, as markdown."""
    cfg = summary["config"]
    Rs = sorted({int(R) for c in summary["cells"].values() for R in c["by_R"]})
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    lines = [f"N = {cfg['subjects']}, seeds {cfg['seeds']} (table + init), {cfg['attention']} attention, d_mlp = "
             f"{cfg['mlp_ratio']:g} d, {cfg['max_steps']} steps at lr {cfg['lr']:g}; d* = smallest width on the "
             f"grid reaching 100% train accuracy, mean [min, max] over seeds.", "",
             "| k | CoT | " + " | ".join(f"d* at R={R}" for R in Rs) + " | b (d* ~ R^b) [95% CI] | b on d_fail | "
             "b of params at d* | 2b (d*^2) | composite bits/param at d* (per R) |",
             "|---|---|" + "---|" * (len(Rs) + 5)]
    for c in summary["cells"].values():
        cols = []
        for R in Rs:
            v = c["by_R"].get(str(R))
            if v and v.get("open"):          # open searches: each seed's bracket (largest failure, smallest success]
                cols.append("open: " + ", ".join(f"({lo or '?'}, {hi or 'inf'}]" for lo, hi in zip(v["d_fail"],
                                                                                                v["d_star"])))
            else:
                cols.append("-" if not v or v["mean"] is None else f"{v['mean']:.3g} [{v['min']}, {v['max']}]"
                            + (f" ({v['not_reached']} not reached)" if v["not_reached"] else ""))
        b, bl, bp, b2 = c["b"], c["b_on_d_fail"], c["b_params"], c["b_d2"]
        ci = lambda m: f"{fmt(m['value'])} [{fmt(m['ci'][0])}, {fmt(m['ci'][1])}]"  # noqa: E731
        lines.append(f"| {c['hops']} | {'yes' if c['cot'] else 'no'} | " + " | ".join(cols) +
                     f" | {ci(b)} | {ci(bl)} | {ci(bp)} | {ci(b2)} | " + ", ".join(
                         fmt(c["by_R"][str(R)].get("composite_bits_per_param")) for R in Rs if str(R) in c["by_R"])
                     + " |")
    for name, m in (summary.get("pooled_vs_Rk") or {}).items():
        lines.append(f"\nAll k pooled, {'with' if name == 'cot' else 'without'} CoT: d* ~ (R^k)^b' with b' = "
                     f"{fmt(m['value'])} [{fmt(m['ci'][0])}, {fmt(m['ci'][1])}] ({m['n']} points).")
    bad = summary.get("monotone_violations") or []
    lines += ["", f"{summary['n_points']} trained points ({summary['train_cpu_s']} CPU s of training); {len(bad)} "
              f"failed although a smaller width succeeded (listed in {SEEDS_FILE})."]
    return "\n".join(lines) + "\n"
