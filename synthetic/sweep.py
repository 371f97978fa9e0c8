"""Capacity sweeps: the threshold width d* per (N, R) by bisection on d, trainable and frozen subject embeddings.

For every cell (N, R, seed, mode) the sweep trains at a few widths d and finds the smallest d that reaches
100% train accuracy (``success``: every fact's answer is the argmax, within the step cap). It does not train a
full grid: it starts from a guess, walks up or down by a factor until it has one failing and one succeeding width
(``bracket``), then bisects the integer interval (:class:`Bisection`, :func:`find_threshold`: the public API the
matched controls use too). It assumes success is monotone in d but noisy near the threshold, so d* is called
exact only when d*-1 failed with two initialisations (another model seed, the same facts); every trained point is
kept, so a reader can see any non-monotone one. Modes: ``trainable`` (every parameter
learns), ``frozen`` (subject embeddings frozen at random init, the paper's control) and ``frozen_all`` (subject
embeddings *and* the attribute unembedding frozen: only the relation embeddings and the MLP learn). Maps
(``maps``): ``bijections`` (R random bijections of the N subjects, :func:`synthetic.tasks.random_bijections`, the
paper's) or ``functions`` (R random many-to-one maps with ``n_attributes`` values each,
:func:`synthetic.tasks.random_functions`: the kind of table a real fact table is, which the matched controls'
capacity line compares with); :func:`cell_task` builds a cell's table.

Every trained point is appended to ``results.jsonl`` (one JSON line per run, flushed and fsynced, under a file
lock so worker processes can share it). A point is keyed by (N, R, seed, mode, d, d_mlp rule, attention, training
config); a rerun of the same sweep reads the file first and skips every key already there, so an interrupted
sweep resumes where it stopped; each key is written once (:func:`append_once` checks under a lock), so a unit
rerun after its worker died adds nothing twice. Units run here, in a local process pool (``workers``) or as Ray
tasks (``executor="ray"``, :mod:`synthetic.executors`); with ``batched`` one unit is an (N, R) whose seed and mode
searches advance in lockstep, each round's widths (``per_round`` per search) trained together
(:mod:`synthetic.batched`).

:func:`summarize` fits ``d* = c * R * log2 N`` by least squares through the origin with a bootstrap interval over
cells, the same c per N and ``d* = c R (log2 N)^p`` with p free, and flags drift when c moves with N
(:func:`fit_trend`; a power law ``d* = a N^alpha R^beta`` in log space beside it);
:func:`synthetic.render.sweep_figures` draws accuracy against d and d* against R log2 N.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from llmprobe.io import append_jsonl, file_lock, read_jsonl, write_json, write_text
from llmprobe.metric import bootstrap, nan_metric
from llmprobe.names import SWEEP_MODES
from synthetic.batched import train_batched
from synthetic.executors import process_map, ray_map
from synthetic.model import ModelConfig, mode_flags
from synthetic.render import sweep_figures
from synthetic.tasks import random_bijections, random_functions
from synthetic.train import RunResult, TrainConfig, model_config_for, train

RESULTS = "results.jsonl"


@dataclass
class SweepConfig:
    subjects: list[int] = field(default_factory=lambda: [256, 512])    # a small grid (~4 min of CPU); the
    relations: list[int] = field(default_factory=lambda: [2, 4, 8])     # docs/runs.md's full grid is 256-1024 x 2-16
    seeds: list[int] = field(default_factory=lambda: [0])
    modes: list[str] = field(default_factory=lambda: ["trainable", "frozen"])
    mlp_ratio: float = 8.0               # d_mlp = round(mlp_ratio * d) (ignored when d_mlp is set)
    d_mlp: int | None = None
    attention: str = "uniform"
    d_min: int = 2
    d_max: int = 512
    workers: int = 1
    threads: int = 1                     # torch threads per worker
    batched: bool = True                 # train every (seed, mode) search of an (N, R) together (synthetic.batched;
                                         # 1.85x faster on 2 CPU cores, docs/synthetic.md); False: one at a time
    executor: str = "process"            # "process" (a local pool of ``workers``) | "ray" (Ray tasks)
    address: str | None = None           # Ray cluster address (None: start Ray on this machine)
    per_round: int = 1                   # batched: widths each search trains per round (Bisection.next_round)
    extrapolate: bool = False            # batched: start each search from d* extrapolated from smaller N
                                         # (:func:`extrapolated_guess`) instead of :func:`initial_guess`
    maps: str = "bijections"             # "bijections" | "functions" (random many-to-one maps, n_attributes)
    n_attributes: list[int] | None = None    # functions: values of relation r = n_attributes[r % len] (None: N)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(progress=False))


MODES = SWEEP_MODES          # in table and figure order
EXECUTORS = ("process", "ray")
MAPS = ("bijections", "functions")


def cell_task(N: int, R: int, seed: int, cfg: SweepConfig):
    """The fact table of cell (N, R, seed): R random bijections, or R random functions onto
    ``cfg.n_attributes[r % len]`` values each (own attribute ids per relation; N values when not given)."""
    if cfg.maps not in MAPS:
        raise ValueError(f"unknown kind of map {cfg.maps!r}; choose from {', '.join(MAPS)}")
    if cfg.maps == "bijections":
        return random_bijections(N, R, seed)
    counts = cfg.n_attributes or [N]
    return random_functions(N, R, [min(N, counts[r % len(counts)]) for r in range(R)], seed)


def cell_guess(N: int, R: int, mode: str, cfg: SweepConfig) -> int:
    """:func:`initial_guess` for the cell's own table (its bits per subject for functions)."""
    if cfg.maps == "bijections":
        return initial_guess(N, R, mode)
    return initial_guess(N, R, mode, cell_task(N, R, 0, cfg).bits() / N)


def point_key(N: int, R: int, seed: int, mode: str, d: int, cfg: SweepConfig, init: int = 0) -> str:
    """Identity of one trained point (what a resumed sweep looks up); ``init`` > 0: another initialisation."""
    t = cfg.train
    spec = {"N": N, "R": R, "seed": seed, "frozen": mode != "trainable", "d": d, "attention": cfg.attention,
            "d_mlp": cfg.d_mlp if cfg.d_mlp else f"x{cfg.mlp_ratio}", "lr": t.lr, "max_steps": t.max_steps,
            "batch": t.batch_size, "warmup": t.warmup_frac, "min_lr": t.min_lr_frac, "betas": list(t.betas),
            "sched": t.schedule, "target": t.target_acc}
    if init:                              # only when set, so that keys of earlier sweeps stay valid
        spec["init"] = init
    if mode not in ("trainable", "frozen"):
        spec["mode"] = mode
    if t.weight_decay:                    # only when set, so that keys of earlier sweeps stay valid
        spec["weight_decay"] = t.weight_decay
    if t.past_fit is not None:
        spec["past_fit"] = t.past_fit
    if t.flush_denormals:                 # only when set: points trained before it kept their denormals
        spec["ftz"] = True
    if cfg.maps != "bijections":
        spec["maps"], spec["n_attributes"] = cfg.maps, cfg.n_attributes
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def load_results(out_dir: str) -> list[dict]:
    """Every finished point of a sweep directory, once per key (a torn line from a killed run is skipped)."""
    rows, seen = [], set()
    for row in read_jsonl(os.path.join(out_dir, RESULTS)):
        if row.get("key") is None or row["key"] not in seen:
            seen.add(row.get("key"))
            rows.append(row)
    return rows


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


def extrapolated_guess(rows: list[dict], N: int, R: int, mode: str, config: str | None = None,
                       confirm: int = 2) -> int | None:
    """Starting width for (N, R, mode) from the exact d* already measured at smaller N (same R, mode and, when
    given, training config ``config``) in ``rows``: the least-squares line d* = a + b log2 N over those cells,
    evaluated at N and rounded. None when fewer than two smaller N have an exact d*. Only a start: the search
    still brackets and confirms its own d*."""
    rows = [r for r in rows if config is None or r.get("config") == config]
    pts = [(math.log2(n), t["d_star"]) for (n, r, _, m, _), t in thresholds(rows, confirm).items()
           if r == R and m == mode and n < N and t["exact"]]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return max(2, int(round(my + b * (math.log2(N) - mx))))


CONFIRM = 2          # initialisations that must fail at d*-1 before d* is called exact
INIT_OFFSET = 1000   # model seed of initialisation i: seed + i * INIT_OFFSET (the fact table keeps its seed)


class Bisection:
    """The threshold search: the smallest width d in [lo, hi] at which training succeeds, assuming success is
    monotone in d (it is noisy near the threshold: one initialisation can fail where another succeeds).

    Feed it results with :meth:`record` and ask :meth:`next` for the next (d, init) to train, until it says None.
    From ``start`` it steps down after a success (up after a failure) by ~12% of d (by 1 with ``prior``: the start
    is another seed's d*), doubling the step on every further move in the same direction, until it holds a failing
    width below a succeeding one; then it bisects the integer interval. A width *succeeds* when any of its
    initialisations succeeded. When the bracket is one apart (d*-1 failing, d* succeeding), d*-1 is retrained with
    further initialisations (``init`` 1, 2, ...: another model seed, the same facts) until it has failed
    ``confirm`` times; a success there moves d* down and the search goes on. :attr:`exact` holds only then, so a
    single noisy failure at the true threshold cannot end in a wrong d* flagged exact.
    """

    def __init__(self, lo: int, hi: int, start: int | None = None, *, confirm: int = CONFIRM, prior: bool = False):
        if lo > hi:
            raise ValueError(f"empty width range [{lo}, {hi}]")
        self.lo, self.hi, self.confirm, self.prior = int(lo), int(hi), max(1, int(confirm)), prior
        self.start = min(max(int(start if start is not None else lo), self.lo), self.hi)
        self.results: dict[int, dict[int, bool]] = {}        # d -> {init: success}
        self.order: list[tuple[int, int, bool]] = []
        self.side = {True: None, False: None}               # next_round's side steps: {going up: below, down: above}

    def record(self, d: int, success: bool, init: int = 0) -> None:
        self.results.setdefault(int(d), {})[int(init)] = bool(success)
        self.order.append((int(d), int(init), bool(success)))

    def succeeded(self, d: int) -> bool | None:
        """True if any initialisation at d succeeded, False if all tried failed, None if d was not tried."""
        res = self.results.get(d)
        return None if not res else any(res.values())

    def _bracket(self) -> tuple[int | None, int | None]:
        best = min((d for d in self.results if self.succeeded(d)), default=None)
        worst = max((d for d in self.results if self.succeeded(d) is False and (best is None or d < best)),
                    default=None)
        return best, worst

    def next(self) -> tuple[int, int] | None:
        """The next (width, initialisation) to train, or None when d* is settled (or the range is exhausted)."""
        best, worst = self._bracket()
        if best is None and worst is None:
            return self.start, 0
        if best is not None and worst is not None:
            if best - worst > 1:
                return (best + worst) // 2, 0
            tried = self.results[worst]
            if len(tried) >= self.confirm:
                return None
            return worst, next(i for i in range(len(tried) + 1) if i not in tried)
        going_up = best is None
        streak = 0                                  # consecutive moves in the current direction
        for d, _, ok in reversed(self.order):
            if d == self.side[going_up]:            # next_round's side step away from this direction: no move
                continue
            if ok == (not going_up):
                streak += 1
            else:
                break
        ref = worst if going_up else best
        base = 1 if self.prior else max(1, int(round(0.12 * ref)))
        step = base * 2 ** max(0, streak - 1)
        if going_up:
            return None if worst >= self.hi else (min(self.hi, worst + step), 0)
        return None if best <= self.lo else (max(self.lo, best - step), 0)

    def next_round(self, k: int = 1) -> list[tuple[int, int]]:
        """Up to ``k`` (width, initialisation) to train together in one round (``[]`` when d* is settled): the
        start with one walk step on either side of it; while walking, the walk's next ``k`` widths as if each
        failed (going up) or succeeded (going down); while bisecting, ``k`` widths splitting the bracket into
        ``k + 1`` near-equal parts; a confirmation (another initialisation of d*-1) alone. ``k`` = 1 is
        :meth:`next`. The results of a round may be recorded in any order; d* and :attr:`exact` follow the same
        rule, so with success monotone in d every ``k`` ends at the same d*, in fewer rounds."""
        nxt = self.next()
        if nxt is None or k <= 1 or nxt[1] > 0:
            return [] if nxt is None else [nxt]
        best, worst = self._bracket()
        if best is not None and worst is not None:
            gap = best - worst
            return [(d, 0) for d in sorted({worst + round(gap * j / (k + 1)) for j in range(1, k + 1)})
                    if worst < d < best][:k]
        if best is None and worst is None:                # the start: one step on either side of it too
            step = 1 if self.prior else max(1, int(round(0.12 * self.start)))
            around = [self.start, max(self.lo, self.start - step), min(self.hi, self.start + step)][:k]
            self.side = {True: around[1] if around[1] < self.start else None,
                         False: around[2] if k > 2 and around[2] > self.start else None}
            return [(d, 0) for d in dict.fromkeys(around)]
        sim = Bisection(self.lo, self.hi, self.start, confirm=self.confirm, prior=self.prior)
        sim.results = {d: dict(r) for d, r in self.results.items()}
        sim.order, sim.side = list(self.order), dict(self.side)
        out = []
        while len(out) < k and (nxt := sim.next()) is not None and nxt[1] == 0 and nxt not in out:
            out.append(nxt)
            sim.record(nxt[0], best is not None)          # walking down: as if it succeeded; up: as if it failed
        return out

    @property
    def d_star(self) -> int | None:
        return self._bracket()[0]

    @property
    def exact(self) -> bool:
        """d* is known: d*-1 failed with ``confirm`` initialisations (and none succeeded)."""
        best = self.d_star
        res = self.results.get(best - 1) if best is not None else None
        return bool(res) and not any(res.values()) and len(res) >= self.confirm

    def tried(self) -> list[dict]:
        return [{"d": d, "init": i, "success": ok} for d, i, ok in self.order]


def find_threshold(train_fn, lo: int, hi: int, start: int | None = None, *, confirm: int = CONFIRM,
                   prior: bool = False, per_round: int = 1) -> dict:
    """Run a :class:`Bisection` with ``train_fn(d, init) -> success`` (a bool, or a (bool, anything) pair whose
    second part is kept). Returns {"d_star", "exact", "tried": [{"d", "init", "success"}] in training order,
    "results": {(d, init): the second part}, "rounds"}; d_star is None when no width up to ``hi`` succeeded.
    ``per_round``: widths per round (:meth:`Bisection.next_round`; a batched trainer trains a round at once)."""
    search = Bisection(lo, hi, start, confirm=confirm, prior=prior)
    kept, rounds = {}, 0
    while todo := search.next_round(per_round):
        rounds += 1
        for d, init in todo:
            out = train_fn(d, init)
            ok, payload = (out if isinstance(out, tuple) else (out, None))
            kept[(d, init)] = payload
            search.record(d, bool(ok), init)
    return {"d_star": search.d_star, "exact": search.exact, "tried": search.tried(), "results": kept,
            "rounds": rounds}


def config_key(cfg: SweepConfig) -> str:
    """Identity of a sweep's training config (everything of :func:`point_key` but the cell and the width)."""
    return point_key(0, 0, 0, "trainable", 0, cfg)


def width_config(task, mode: str, d: int, cfg: SweepConfig, seed: int = 0, init: int = 0) -> ModelConfig:
    """The model of one search point: width ``d``, the MLP width of ``cfg``'s rule, ``mode``'s frozen parts
    (:func:`synthetic.model.mode_flags`) and model seed ``seed + init * INIT_OFFSET`` (initialisation ``init``)."""
    return model_config_for(task, d, d_mlp=_d_mlp(d, cfg), attention=cfg.attention, seed=seed + INIT_OFFSET * init,
                            **mode_flags(mode))


def train_width(task, mode: str, d: int, cfg: SweepConfig, seed: int = 0, init: int = 0) -> RunResult:
    """Train the model of :func:`width_config` on ``task`` with ``cfg.train`` (the trained model at
    ``result.model``): one point of a threshold search, the sweep's and the matched controls'."""
    return train(task, model_config=width_config(task, mode, d, cfg, seed, init), config=cfg.train)


def _run_point(N, R, seed, mode, d, cfg: SweepConfig, init: int = 0) -> dict:
    res = train_width(cell_task(N, R, seed, cfg), mode, d, cfg, seed, init)
    return _point_row(res, N, R, seed, mode, d, cfg, init)


def _d_mlp(d: int, cfg: SweepConfig) -> int:
    return cfg.d_mlp or max(1, int(round(cfg.mlp_ratio * d)))


def _point_row(res, N, R, seed, mode, d, cfg: SweepConfig, init: int) -> dict:
    """The results.jsonl row of one trained point (a :class:`synthetic.train.RunResult`)."""
    row = res.to_dict()
    row.pop("train", None)
    row["history"] = row["history"][-3:]
    row.update({"key": point_key(N, R, seed, mode, d, cfg, init), "seed": seed, "init": init, "mode": mode,
                "config": config_key(cfg), "maps": cfg.maps, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if cfg.maps != "bijections":
        row["n_attributes"] = cfg.n_attributes
    return row


def append_once(out_dir: str, row: dict) -> bool:
    """Append ``row`` to ``out_dir/results.jsonl`` unless a row with its key is there already (checked under a
    lock, so a retried or concurrent worker that trained the same point again does not write it twice).
    Returns whether it was written."""
    path = os.path.join(out_dir, RESULTS)
    with file_lock(os.path.join(out_dir, ".locks", "results.lock")):
        if any(r.get("key") == row["key"] for r in read_jsonl(path)):
            return False
        append_jsonl(path, row)
        return True


def _log_point(row: dict) -> None:
    print(f"[sweep] N={row['n_subjects']} R={row['n_relations']} seed={row['seed']} {row['mode']} "
          f"d={row['d_model']} init={row['init']}: acc={row['accuracy']:.4f} steps={row['steps']} "
          f"{row['wall_time_s']:.0f}s" + (f" (batch of {row['batch_models']})" if row.get("batch_models", 1) > 1
                                          else ""), flush=True)


def _bisect_cell(N, R, seed, mode, cfg: SweepConfig, out_dir: str, cache: dict, start: int | None) -> dict:
    def train_fn(d, init):
        key = point_key(N, R, seed, mode, d, cfg, init)
        row = cache.get(key)
        if row is None:
            row = _run_point(N, R, seed, mode, d, cfg, init)
            append_once(out_dir, row)
            _log_point(row)
        return bool(row["success"])

    found = find_threshold(train_fn, cfg.d_min, cfg.d_max, start or cell_guess(N, R, mode, cfg),
                           prior=start is not None)
    return {"N": N, "R": R, "seed": seed, "mode": mode, "d_star": found["d_star"], "exact": found["exact"],
            "tried": found["tried"]}


def _sweep_unit(args) -> list[dict]:
    """All seeds of one (N, R, mode), in order: each later seed starts from the previous seed's d* (a start only:
    its own d* is exact only when its own d*-1 failed with :data:`CONFIRM` initialisations)."""
    (N, R, mode, cfg, out_dir, cache) = args
    torch.set_num_threads(max(1, cfg.threads))
    out, start = [], None
    for seed in cfg.seeds:
        res = _bisect_cell(N, R, seed, mode, cfg, out_dir, cache, start)
        out.append(res)
        start = res["d_star"] or start
    return out


def _batched_unit(N: int, R: int, modes: tuple, cfg: SweepConfig, out_dir: str, cache: dict) -> list[dict]:
    """Every (seed, mode) search of one (N, R) in lockstep: each round trains the next width of every unfinished
    search together in one :func:`synthetic.batched.train_batched` call. Each search starts from
    :func:`initial_guess` (no seed hands its d* to the next: they run at once); d* and ``exact`` follow the same
    rule as the one-at-a-time sweep, and the points have the same keys, so either sweep resumes the other."""
    torch.set_num_threads(max(1, cfg.threads))
    def start(mode):
        guess = extrapolated_guess(list(cache.values()), N, R, mode, config_key(cfg)) if cfg.extrapolate else None
        return guess or cell_guess(N, R, mode, cfg)

    searches = {(seed, mode): Bisection(cfg.d_min, cfg.d_max, start(mode)) for seed in cfg.seeds for mode in modes}
    while True:
        wanted = [(cell, point) for cell, search in searches.items() for point in search.next_round(cfg.per_round)]
        if not wanted:
            break
        todo = [(seed, mode, d, init) for (seed, mode), (d, init) in wanted
                if point_key(N, R, seed, mode, d, cfg, init) not in cache]
        if todo:
            tasks = [cell_task(N, R, seed, cfg) for seed, _, _, _ in todo]
            configs = [width_config(task, mode, d, cfg, seed, init) for task, (seed, mode, d, init) in zip(tasks, todo)]
            for (seed, mode, d, init), res in zip(todo, train_batched(tasks, configs, cfg.train)):
                row = _point_row(res, N, R, seed, mode, d, cfg, init)
                append_once(out_dir, row)
                _log_point(row)
                cache[row["key"]] = row
        for (seed, mode), (d, init) in wanted:
            searches[seed, mode].record(d, bool(cache[point_key(N, R, seed, mode, d, cfg, init)]["success"]), init)
    return [{"N": N, "R": R, "seed": seed, "mode": mode, "d_star": s.d_star, "exact": s.exact, "tried": s.tried()}
            for (seed, mode), s in searches.items()]


def _locked_unit(args, block: bool = True) -> list[dict] | None:
    """One unit of a sweep -- :func:`_sweep_unit` for one (N, R, mode), or :func:`_batched_unit` when ``mode`` is
    a tuple of modes -- holding a lock on each of its (N, R, mode) in ``out_dir/.locks``, with the finished points
    re-read under the lock, so sweeps of one folder in several processes never train a point twice. None, at
    once, when ``block`` is false and another process holds a lock."""
    (N, R, mode, cfg, out_dir, cache) = args
    modes = (mode,) if isinstance(mode, str) else tuple(sorted(mode))       # one lock order: no deadlock
    with contextlib.ExitStack() as locks:
        for m in modes:
            if not locks.enter_context(file_lock(os.path.join(out_dir, ".locks", f"N{N}-R{R}-{m}.lock"),
                                                 block=block)):
                return None
        fresh = {r["key"]: r for r in load_results(out_dir) if "key" in r}
        if isinstance(mode, str):
            return _sweep_unit((N, R, mode, cfg, out_dir, {**cache, **fresh}))
        return _batched_unit(N, R, modes, cfg, out_dir, {**cache, **fresh})


def sweep_jobs(cfg: SweepConfig, out_dir: str) -> list[tuple]:
    """The units of a sweep, cheap ones first (an interrupted sweep then has whole rows of the table): one per
    (N, R, mode), or one per (N, R) with every mode when ``cfg.batched``. Each is an argument of
    :func:`_locked_unit`."""
    bad = [m for m in cfg.modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown sweep modes {bad}; choose from {MODES}")
    if cfg.maps not in MAPS:
        raise ValueError(f"unknown kind of map {cfg.maps!r}; choose from {', '.join(MAPS)}")
    if cfg.batched and cfg.train.batch_size:
        raise ValueError("a batched sweep trains full batch only: leave batch_size unset (--batch-size)")
    if cfg.batched:
        units = [(N, R, tuple(cfg.modes)) for N in cfg.subjects for R in cfg.relations]
        units.sort(key=lambda u: u[0] ** 2 * u[1])
    else:
        units = [(N, R, mode) for N in cfg.subjects for R in cfg.relations for mode in cfg.modes]
        units.sort(key=lambda u: (u[0] ** 2 * u[1]) * (1 if u[2] == "trainable" else 1.5))
    return [(N, R, modes, cfg, out_dir, {}) for (N, R, modes) in units]


def run_sweep(cfg: SweepConfig, out_dir: str) -> dict:
    """Run (or resume) the sweep; returns :func:`summarize` of everything in ``out_dir``. ``cfg.executor``:
    ``"process"`` runs units here (``workers`` > 1: a local process pool), ``"ray"`` as Ray tasks
    (:func:`synthetic.executors.ray_map`; a unit whose worker dies is retried)."""
    if cfg.executor not in EXECUTORS:
        raise ValueError(f"unknown executor {cfg.executor!r}; choose from {EXECUTORS}")
    os.makedirs(out_dir, exist_ok=True)
    jobs = sweep_jobs(cfg, out_dir)
    if cfg.executor == "ray":
        ray_map(_locked_unit, jobs, address=cfg.address, cpus_per_task=cfg.threads)
    elif cfg.workers > 1 and len(jobs) > 1:
        process_map(_locked_unit, jobs, cfg.workers)
    else:
        busy = [job for job in jobs if _locked_unit(job, block=False) is None]  # another process's: do them last
        for job in busy:
            _locked_unit(job)
    summary = summarize(out_dir, cfg)
    write_json(os.path.join(out_dir, "summary.json"), summary)
    write_text(os.path.join(out_dir, "table.md"), table_markdown(summary))
    try:
        sweep_figures(load_results(out_dir), summary, out_dir)
    except ImportError:  # pragma: no cover - matplotlib missing
        pass
    return summary


# ----------------------------------------------------------------------------- analysis
def thresholds(rows: list[dict], confirm: int = CONFIRM) -> dict:
    """d* per cell (N, R, seed, mode, config): the smallest width at which some initialisation succeeded, with
    ``exact`` when d*-1 failed with ``confirm`` or more initialisations (and none succeeded there).

    ``config`` is the training config's :func:`config_key` (``"unrecorded"`` for rows of sweeps older than it), so
    results of different step caps, learning rates or weight decays never overwrite each other."""
    cells: dict[tuple, dict[int, dict[int, bool]]] = {}
    for r in rows:
        key = (r["n_subjects"], r["n_relations"], r["seed"], r["mode"], r.get("config", "unrecorded"))
        cells.setdefault(key, {}).setdefault(r["d_model"], {})[int(r.get("init", 0))] = bool(r["success"])
    out = {}
    for key, pts in cells.items():
        ok = {d: any(res.values()) for d, res in pts.items()}
        best = min((d for d, s in ok.items() if s), default=None)
        below = pts.get(best - 1) if best is not None else None
        exact = bool(below) and not any(below.values()) and len(below) >= confirm
        out[key] = {"d_star": best, "exact": exact,
                    "inits_failed_below": len(below) if below and not any(below.values()) else 0,
                    "max_failed": max([d for d, s in ok.items() if not s], default=None)}
    return out


def _slope(parts) -> float:
    """Least-squares slope through the origin of rows (x, y)."""
    sxx = float((parts[:, 0] ** 2).sum())
    return float((parts[:, 0] * parts[:, 1]).sum()) / sxx if sxx else float("nan")


def _free_exponent(parts, which: int) -> float:
    """d* = c R (log2 N)^p from rows (log2 N, R, d*): c_N = the through-origin constant of each N (as ``c_by_n``),
    then log c_N = log c + (p - 1) log log2 N by least squares over the N. Returns p (which=1) or c (which=0);
    NaN with fewer than two distinct N. (Per-N linear fits weigh the large cells, where d*'s integer rounding
    matters least; a log-space fit over cells lets the rounding of d* = 3 or 4 fake a trend.)"""
    Ls = sorted(set(parts[:, 0].tolist()))
    if len(Ls) < 2:
        return float("nan")
    logc = []
    for L in Ls:
        rows = parts[parts[:, 0] == L]
        logc.append(math.log(_slope(np.stack([rows[:, 1] * L, rows[:, 2]], 1))))
    x, y = np.log(np.asarray(Ls)), np.asarray(logc)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return slope + 1 if which == 1 else float(math.exp(y.mean() - slope * x.mean()))


def fit_constant(points: list[tuple[float, float]], n_boot: int = 2000, seed: int = 0):
    """d* = c x (x = R log2 N) by least squares through the origin: a :class:`llmprobe.metric.Metric` whose
    interval is a percentile bootstrap over the points (cells); ``note`` carries the fit's R^2."""
    if not points:
        return nan_metric("bootstrap")
    parts = np.asarray(points, dtype=np.float64)
    m = bootstrap(parts, _slope, n_boot=n_boot, seed=seed, bounds=(0.0, math.inf))
    resid = parts[:, 1] - m.value * parts[:, 0]
    ss_tot = float(((parts[:, 1] - parts[:, 1].mean()) ** 2).sum())
    m.note = f"R^2 {1 - float((resid ** 2).sum()) / ss_tot:.3f}" if ss_tot else None
    return m


def fit_trend(points: list[tuple[int, int, int]], n_boot: int = 2000, seed: int = 0) -> dict:
    """The capacity fit with its trend, from exact d* per cell (N, R, d*), one point per (N, R, seed) cell.

    * ``c``: d* = c R log2 N through the origin over every cell (bootstrap over cells);
    * ``c_by_n``: the same constant fitted per N (bootstrap over that N's cells);
    * ``p`` and ``c_free``: d* = c R (log2 N)^p with the exponent free (log c_N against log log2 N over the N,
      bootstrap over cells; needs two or more N);
    * ``drift``: True when two ``c_by_n`` intervals do not overlap or ``p``'s interval excludes 1 -- the constant
      is then not constant over N, and ``c`` alone would hide it; ``drift_reason`` says which, in a sentence.
    Every number is a :class:`llmprobe.metric.Metric` in its JSON form."""
    c = fit_constant([(R * math.log2(N), d) for N, R, d in points], n_boot, seed)
    ys = np.asarray([d for _, _, d in points], dtype=np.float64)
    ss_tot = float(((ys - ys.mean()) ** 2).sum()) if len(ys) else 0.0
    ss_res = sum((d - c.value * R * math.log2(N)) ** 2 for N, R, d in points)
    out = {"n_cells": len(points), "c": c.to_dict(), "r2": 1 - ss_res / ss_tot if ss_tot else None}
    by_n = {}
    for N in sorted({N for N, _, _ in points}):
        pts = [(R * math.log2(N), d) for n, R, d in points if n == N]
        by_n[N] = bootstrap(np.asarray(pts, dtype=np.float64), _slope, n_boot=n_boot, seed=seed,
                            bounds=(0.0, math.inf))
    out["c_by_n"] = {str(N): m.to_dict() for N, m in by_n.items()}
    logs = np.asarray([(math.log2(N), R, d) for N, R, d in points], dtype=np.float64)
    if len(by_n) >= 2:
        p = bootstrap(logs, lambda a: _free_exponent(a, 1), n_boot=n_boot, seed=seed)
        c_free = bootstrap(logs, lambda a: _free_exponent(a, 0), n_boot=n_boot, seed=seed, bounds=(0.0, math.inf))
    else:
        p = c_free = nan_metric("bootstrap", "needs two or more N")
    out["p"], out["c_free"] = p.to_dict(), c_free.to_dict()
    reasons = []
    finite = {N: m for N, m in by_n.items() if m.n >= 2 and all(map(math.isfinite, m.ci))}
    apart = [(a, b) for a in finite for b in finite if a < b and (finite[a].ci[1] < finite[b].ci[0]
                                                                  or finite[b].ci[1] < finite[a].ci[0])]
    if apart:
        a, b = apart[0]
        reasons.append(f"c per N moves from {finite[a].value:.3f} [{finite[a].ci[0]:.3f}, {finite[a].ci[1]:.3f}] "
                       f"at N={a} to {finite[b].value:.3f} [{finite[b].ci[0]:.3f}, {finite[b].ci[1]:.3f}] at "
                       f"N={b} (intervals do not overlap)")
    if p.n and math.isfinite(p.value) and not p.ci[0] <= 1.0 <= p.ci[1]:
        reasons.append(f"the exponent of log2 N is p = {p.value:.2f} [{p.ci[0]:.2f}, {p.ci[1]:.2f}], whose interval "
                       f"excludes 1 (d* = c R log2 N assumes p = 1)")
    out["drift"] = bool(reasons)
    tested = (["the c per N intervals overlap"] if len(finite) >= 2 else []) + (
        [f"p's interval [{p.ci[0]:.2f}, {p.ci[1]:.2f}] contains 1"] if p.n and all(map(math.isfinite, p.ci)) else [])
    if reasons:
        out["drift_reason"] = "Drift: " + "; ".join(reasons) + "."
    elif len(by_n) < 2:
        out["drift_reason"] = "Not tested: one N only."
    elif tested:
        out["drift_reason"] = f"No drift detected over N = {', '.join(map(str, by_n))}: {' and '.join(tested)}."
    else:
        out["drift_reason"] = (f"Drift cannot be judged from {len(points)} cells: it needs two N with two or more "
                               f"cells each (c per N intervals) or a finite interval of p, the exponent of log2 N.")
    return out


def _row_config(row: dict, cfg: SweepConfig | None) -> str:
    """A row's training config key; rows written before configs were recorded belong to ``cfg``'s config when
    their point key is the one ``cfg`` gives them, else they stay "unrecorded"."""
    if "config" in row:
        return row["config"]
    if cfg is not None and row.get("key") == point_key(row["n_subjects"], row["n_relations"], row["seed"],
                                                       row["mode"], row["d_model"], cfg, int(row.get("init", 0))):
        return config_key(cfg)
    return "unrecorded"


def summarize(out_dir: str, cfg: SweepConfig | None = None, confirm: int = CONFIRM) -> dict:
    """Thresholds per cell, mean over seeds per (N, R, mode), the capacity fit with its trend (:func:`fit_trend`)
    per mode, bits per parameter at d*.

    Only rows of one training config are summarised: ``cfg``'s (:func:`config_key`), else the config with the
    most rows; the others are counted in ``other_configs``."""
    all_rows = [dict(r, config=_row_config(r, cfg)) for r in load_results(out_dir)]
    counts: dict[str, int] = {}
    for r in all_rows:
        counts[r.get("config", "unrecorded")] = counts.get(r.get("config", "unrecorded"), 0) + 1
    chosen = config_key(cfg) if cfg is not None else max(counts, key=counts.get, default=None)
    rows = [r for r in all_rows if r.get("config", "unrecorded") == chosen]
    th = thresholds(rows, confirm)
    d_max = cfg.d_max if cfg is not None else SweepConfig().d_max
    by_point = {}
    for r in rows:                        # the successful run at each width (the d* row)
        k = (r["n_subjects"], r["n_relations"], r["seed"], r["mode"], r["d_model"])
        if k not in by_point or (r["success"] and not by_point[k]["success"]):
            by_point[k] = r
    table: dict[tuple, dict] = {}
    for (N, R, seed, mode, _), t in th.items():
        entry = table.setdefault((N, R, mode), {"N": N, "R": R, "mode": mode, "d_star": [], "bits_per_param": [],
                                                 "steps": [], "time_s": [], "censored": 0, "pending": 0,
                                                 "upper_bounds": []})
        if t["d_star"] is None:
            if t["max_failed"] is not None and t["max_failed"] >= d_max:
                entry["censored"] += 1          # no width up to d_max reached 100%
            else:
                entry["pending"] += 1           # search not finished (interrupted sweep)
            continue
        if not t["exact"]:                      # d*-1 not seen failing twice: an upper bound, kept out of the fits
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
        fits[mode] = fit_trend(pts)
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
    return {"cells": rows_out, "fit": fits, "power_fits": powers, "n_runs": len(rows),
            "confirm_inits": confirm, "config_key": chosen,
            "other_configs": {k: n for k, n in counts.items() if k != chosen},
            "train_time_s": round(total_time, 1), "cpu_time_s": round(cpu_time, 1),
            "config": None if cfg is None else _cfg_dict(cfg)}


def fit_power(points: list[tuple[int, int, float]]) -> dict:
    """Least squares ``log d = log a + alpha log N + beta log R`` over (N, R, d) points (None when degenerate)."""
    if len(points) < 3:
        return {"a": None, "alpha": None, "beta": None}
    X = np.array([[1.0, math.log(N), math.log(R)] for N, R, _ in points])
    y = np.array([math.log(d) for _, _, d in points])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    if np.linalg.matrix_rank(X) < 3:
        return {"a": None, "alpha": None, "beta": None}
    return {"a": float(math.exp(coef[0])), "alpha": float(coef[1]), "beta": float(coef[2])}


MIN_INTERVAL_CELLS = 3   # fewer cells give no interval in the summary text (a bootstrap over 2 cells is their range)


def _ci_text(m: dict, digits: int = 3) -> str:
    if m.get("n") is not None and m["n"] < MIN_INTERVAL_CELLS:
        return f"no interval from {m['n']} cell{'s' if m['n'] != 1 else ''}"
    lo, hi = m.get("ci") or (None, None)
    fmt = lambda v: "inf" if v is None else f"{v:.{digits}f}"  # noqa: E731 - JSON null is an unbounded side
    return f"95% {m.get('interval', 'bootstrap')} interval {fmt(lo)}-{fmt(hi)} over cells"


def table_markdown(summary: dict) -> str:
    """Markdown table of d* per (N, R), one column group per mode, with the fits (c, c per N, the free exponent
    of log2 N and the drift test) underneath."""
    fits = summary["fit"]
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
        c = fit.get("c") or {}
        if c.get("value") is None or not math.isfinite(c["value"]):
            continue
        pw = (summary.get("power_fits") or {}).get(mode) or {}
        extra = "" if pw.get("alpha") is None else \
            f"; power law d* = {pw['a']:.3f} N^{pw['alpha']:.2f} R^{pw['beta']:.2f}"
        lines.append(f"Fit {mode}: d* = {c['value']:.3f} * R log2 N ({_ci_text(c)}, n={c['n']} cells, "
                     f"{c.get('note') or ''}){extra}  ")
        by_n = ", ".join(f"N={N}: {m['value']:.3f} ({_ci_text(m)}, n={m['n']})"
                         for N, m in (fit.get("c_by_n") or {}).items() if m.get("value") is not None)
        if by_n:
            lines.append(f"c per N ({mode}): {by_n}  ")
        p = fit.get("p") or {}
        if p.get("value") is not None and math.isfinite(p["value"]):
            lines.append(f"Exponent free ({mode}): d* = {fit['c_free']['value']:.3f} R (log2 N)^p with "
                         f"p = {p['value']:.2f} ({_ci_text(p, 2)})  ")
        lines.append(f"{fit.get('drift_reason', '')}  ")
    return "\n".join(lines) + "\n"


def _cfg_dict(cfg: SweepConfig) -> dict:
    d = dict(cfg.__dict__)
    d["train"] = cfg.train.to_dict()
    return d
