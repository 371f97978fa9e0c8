"""The capacity grid's cost: widths per bisection round, trainer throughput, and the time of every cell.

Three parts, each printed and (``--json``) written:

* ``--per-round K``: the batched sweep of ``--cells`` run twice from empty folders in one process, one width per
  search per bisection round and K widths (:meth:`synthetic.sweep.Bisection.next_round`), with the CPU seconds
  (``time.process_time``), rounds (``train_batched`` calls), points, model-steps and d* of each.
* ``--throughput``: ``--steps`` full-batch steps of :func:`synthetic.batched.train_batched` per (N, R, d, M) of
  ``--shapes`` (M models of width d stacked), as model-steps, facts x steps and logits per CPU second.
* ``--predict RESULTS``: a cost model fitted to the CPU seconds of every point in a sweep's results.jsonl
  (CPU per model-step = a + b N^2 R + c N^2 R d, least squares in relative error), and the predicted time of every
  cell of the grid on this CPU (1 thread), on one H200 (the bandwidth/FLOP model of
  ``benchmarks/batched_training.py``) and on a Ray cluster of ``--nodes`` x ``--cores`` CPUs.

    python benchmarks/synthetic_grid.py --per-round 3 --cells 256x2,256x4
    python benchmarks/synthetic_grid.py --throughput --shapes 1024x2x8x1,4096x2x8x1,4096x2x8x4
    python benchmarks/synthetic_grid.py --predict /tmp/runs/grid/results.jsonl
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import synthetic.batched as batched  # noqa: E402
from benchmarks.batched_training import (  # noqa: E402
    BANDWIDTH_EFFICIENCY,
    FLOP_EFFICIENCY,
    H200_BYTES_PER_S,
    H200_FP32_FLOPS,
    OP_LAUNCH_S,
    step_cost,
)
from llmprobe.checks import int_list  # noqa: E402
from llmprobe.io import write_json  # noqa: E402
from synthetic.sweep import SweepConfig, config_key, extrapolated_guess, load_results, run_sweep, thresholds  # noqa: E402
from synthetic.tasks import random_bijections  # noqa: E402
from synthetic.train import TrainConfig, model_config_for  # noqa: E402

GRID_N, GRID_R, MAX_STEPS = (256, 512, 1024, 2048, 4096), (2, 4, 8, 16), 500
STACK_OPS = 209          # aten ops of one stacked training step (counted by benchmarks/batched_training.py)


def compare_per_round(cells: list[tuple[int, int]], k: int, seeds, modes) -> dict:
    """The batched sweep of ``cells`` with 1 and ``k`` widths per search per round, from empty folders."""
    real = batched.train_batched
    out = {}
    root = tempfile.mkdtemp(prefix="per-round-")
    try:
        for per in (1, k):
            count = {"rounds": 0, "model_steps": 0}

            def counted(tasks, configs, cfg=None, *a, **kw):
                res = real(tasks, configs, cfg, *a, **kw)
                count["rounds"] += 1
                count["model_steps"] += sum(r.steps for r in res)
                return res

            batched.train_batched = counted
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for N, R in cells:
                cfg = SweepConfig(subjects=[N], relations=[R], seeds=seeds, modes=modes, per_round=per,
                                  train=TrainConfig(max_steps=MAX_STEPS, progress=False))
                run_sweep(cfg, os.path.join(root, str(per)))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            rows = load_results(os.path.join(root, str(per)))
            d_star = {f"N={c[0]} R={c[1]} seed={c[2]} {c[3]}": (t["d_star"], t["exact"])
                      for c, t in sorted(thresholds(rows).items())}
            out[per] = {"cpu_s": cpu, "wall_s": wall, "points": len(rows), **count, "d_star": d_star}
            print(f"{per} width(s) per round: {cpu:.1f} s CPU ({wall:.1f} s wall), {count['rounds']} rounds, "
                  f"{len(rows)} points, {count['model_steps']} model-steps", flush=True)
    finally:
        batched.train_batched = real
        shutil.rmtree(root, ignore_errors=True)
    same = sum(out[k]["d_star"].get(c) == v for c, v in out[1]["d_star"].items())
    print(f"same d* in {same}/{len(out[1]['d_star'])} cells; {k} per round / 1 per round: CPU "
          f"{out[k]['cpu_s'] / out[1]['cpu_s']:.2f}x, rounds {out[k]['rounds'] / out[1]['rounds']:.2f}x, "
          f"model-steps {out[k]['model_steps'] / out[1]['model_steps']:.2f}x")
    for c, v in out[1]["d_star"].items():
        print(f"  {c:<30} d* {v}  vs {out[k]['d_star'].get(c)}")
    return {"cells": cells, "k": k, "runs": {str(p): v for p, v in out.items()}, "same_d_star": same}


def throughput(shapes: list[tuple[int, int, int, int]], steps: int) -> list[dict]:
    """CPU cost of ``steps`` full-batch steps of M stacked models of width d (never reaching 100%: they run on)."""
    rows = []
    for N, R, d, M in shapes:
        tasks = [random_bijections(N, R, seed) for seed in range(M)]
        configs = [model_config_for(t, d, seed=i, d_mlp=8 * d) for i, t in enumerate(tasks)]
        cfg = TrainConfig(max_steps=steps, progress=False, target_acc=2.0, log_every=10 ** 9)
        res = batched.train_batched(tasks, configs, cfg)
        cpu = sum(r.cpu_time_s for r in res)               # the steps' CPU time (shares add up to the batch's)
        ms = M * steps
        row = {"N": N, "R": R, "d": d, "M": M, "steps": steps, "cpu_s": cpu, "cpu_per_model_step_s": cpu / ms,
               "model_steps_per_cpu_s": ms / cpu, "facts_steps_per_cpu_s": ms * N * R / cpu,
               "logits_per_cpu_s": ms * N * R * N / cpu}
        rows.append(row)
        print(f"N={N:<5} R={R:<3} d={d:<3} M={M}: {cpu / ms * 1e3:8.1f} ms CPU per model-step, "
              f"{row['facts_steps_per_cpu_s'] / 1e6:6.2f} M facts*steps/CPU s, "
              f"{row['logits_per_cpu_s'] / 1e9:5.2f} G logits/CPU s", flush=True)
    return rows


def fit_cost(rows: list[dict]) -> dict:
    """CPU s per model-step = a + b N^2 R + c N^2 R d, least squares in relative error (each point weighted by
    1 / its time), over the points' own CPU shares; with the median and 90th percentile of |relative error|."""
    pts = [(r["n_subjects"], r["n_relations"], r["d_model"], r["cpu_time_s"] / r["steps"]) for r in rows
           if r.get("cpu_time_s") and r.get("steps")]
    X = np.array([[1.0, N * N * R, N * N * R * d] for N, R, d, _ in pts])
    y = np.array([t for *_, t in pts])
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    err = np.abs(X @ coef / y - 1)
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "n_points": len(pts),
            "median_rel_err": float(np.median(err)), "p90_rel_err": float(np.quantile(err, 0.9))}


def cpu_step(cost: dict, N: int, R: int, d: int) -> float:
    return cost["a"] + cost["b"] * N * N * R + cost["c"] * N * N * R * d


def h200_step(N: int, R: int, d: int) -> float:
    """Seconds of one model's full-batch step on one H200 (arithmetic or memory bound, whichever is slower)."""
    f, b = step_cost(N, R, d, 8 * d)
    return max(f / (FLOP_EFFICIENCY * H200_FP32_FLOPS), b / (BANDWIDTH_EFFICIENCY * H200_BYTES_PER_S))


def predict(path: str, nodes: int, cores: int, ref_n: int = 1024, thread_efficiency: float = 0.7) -> dict:
    """Predicted time of every (N, R, mode, seed) search of the grid: model-steps x cost per model-step at the
    measured d* (exact where measured, else extrapolated in log2 N from the measured N, :func:`extrapolated_guess`).
    Model-steps per search: measured where the search finished, else the mean over the finished searches at
    ``ref_n`` (every R) of that mode, in units of the step cap (a search costs a similar number of cap-long
    trainings at every N: most points are near d*). Ray: units ((N, R), every seed and mode) on ``nodes`` x
    ``cores`` CPUs, one torch thread per task, or ``cores`` threads per task at ``thread_efficiency`` (assumed)."""
    rows = load_results(os.path.dirname(path) or ".")
    cfg_key = config_key(SweepConfig(train=TrainConfig(max_steps=MAX_STEPS)))
    rows = [r for r in rows if r.get("config") == cfg_key]
    cost = fit_cost(rows)
    th = thresholds(rows)
    spent: dict[tuple, list] = {}
    for r in rows:
        spent.setdefault((r["n_subjects"], r["n_relations"], r["seed"], r["mode"]), []).append(r)
    done = {k[:4]: t for k, t in th.items() if t["exact"]}
    per_search = {}
    for mode in ("trainable", "frozen"):
        caps = [sum(r["steps"] for r in spent[k]) / MAX_STEPS for k in done if k[0] == ref_n and k[3] == mode]
        per_search[mode] = sum(caps) / len(caps) if caps else float("nan")
    cells = []
    for N in GRID_N:
        for R in GRID_R:
            for mode in ("trainable", "frozen"):
                for seed in (0, 1):
                    key = (N, R, seed, mode)
                    measured = key in done
                    d = done[key]["d_star"] if measured else (extrapolated_guess(rows, N, R, mode, cfg_key)
                                                              or extrapolated_guess(rows, N, R, mode))
                    steps = (sum(r["steps"] for r in spent[key]) if measured
                             else per_search[mode] * MAX_STEPS)
                    cpu_meas = sum(r["cpu_time_s"] or 0 for r in spent.get(key, []))
                    cells.append({"N": N, "R": R, "mode": mode, "seed": seed, "measured": measured, "d": d,
                                  "model_steps": steps, "cpu_measured_s": cpu_meas if measured else None,
                                  "cpu_pred_s": steps * cpu_step(cost, N, R, d),
                                  "h200_pred_s": steps * h200_step(N, R, d)})
    units: dict[tuple, float] = {}
    for c in cells:
        units[(c["N"], c["R"])] = units.get((c["N"], c["R"]), 0.0) + (c["cpu_measured_s"] or c["cpu_pred_s"])
    total_cpu = sum(units.values())
    # the GPU's floor: each stacked step dispatches ~STACK_OPS ops; a (N, R) unit runs ~rounds x cap steps
    rounds = 8
    h200_launch = len(units) * rounds * MAX_STEPS * STACK_OPS * OP_LAUNCH_S
    h200 = sum(c["h200_pred_s"] for c in cells) + h200_launch
    biggest = max(units.values())
    ray = max(total_cpu / (nodes * cores), biggest)
    ray_threads = max(total_cpu / (nodes * cores * thread_efficiency), biggest / (cores * thread_efficiency))
    print(f"cost model (CPU s per model-step, 1 thread): {cost['a'] * 1e3:.2f} ms + {cost['b'] * 1e9:.2f} ns x N^2 R "
          f"+ {cost['c'] * 1e12:.3f} ps x N^2 R d; {cost['n_points']} points, |relative error| median "
          f"{cost['median_rel_err']:.0%}, 90th percentile {cost['p90_rel_err']:.0%}")
    print(f"model-steps per unfinished search: {per_search['trainable']:.1f} x cap (trainable), "
          f"{per_search['frozen']:.1f} x cap (frozen), the mean of the finished searches at N={ref_n}")
    print(f"{'N':>5} {'R':>3} | {'d* (t/f)':>9} | {'CPU h (1 thread)':>16} | {'H200 s':>7} | measured")
    for (N, R), cpu in units.items():
        sub = [c for c in cells if (c["N"], c["R"]) == (N, R)]
        ds = "/".join(str(next(c["d"] for c in sub if c["mode"] == m)) for m in ("trainable", "frozen"))
        n_meas = sum(c["measured"] for c in sub)
        print(f"{N:>5} {R:>3} | {ds:>9} | {cpu / 3600:16.2f} | {sum(c['h200_pred_s'] for c in sub):7.1f} | "
              f"{n_meas}/{len(sub)} searches")
    print(f"whole grid: {total_cpu / 3600:.1f} CPU hours on 1 thread; one H200 {h200 / 60:.1f} min "
          f"({h200_launch / 60:.1f} of them dispatch); Ray {nodes} x {cores} cores: {ray / 3600:.1f} h with one "
          f"thread per task (bound by the largest (N, R) unit, {biggest / 3600:.1f} h on one core), "
          f"{ray_threads / 3600:.1f} h with --threads {cores} per task at an assumed {thread_efficiency:.0%} "
          f"parallel efficiency")
    return {"cost_model": cost, "per_search_caps": per_search, "cells": cells,
            "units_cpu_s": {f"{N}x{R}": v for (N, R), v in units.items()}, "total_cpu_s": total_cpu,
            "h200_s": h200, "h200_dispatch_s": h200_launch, "ray_s": ray, "ray_threads_s": ray_threads,
            "ray": {"nodes": nodes, "cores": cores, "thread_efficiency": thread_efficiency},
            "h200_assumptions": {"fp32_flops": H200_FP32_FLOPS, "flop_efficiency": FLOP_EFFICIENCY,
                                 "bytes_per_s": H200_BYTES_PER_S, "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
                                 "op_launch_s": OP_LAUNCH_S, "stack_ops": STACK_OPS, "rounds_per_unit": rounds}}


def _pairs(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-round", type=int, default=0, help="compare 1 and K widths per search per round")
    ap.add_argument("--cells", default="256x2,256x4", help="NxR cells of the per-round comparison")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default="trainable,frozen")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--shapes", default="1024x2x8x1,1024x8x16x1,2048x2x8x1,4096x2x8x1,4096x2x8x4",
                    help="NxRxdxM stacks to time")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--predict", default=None, help="a sweep's results.jsonl")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--ref-n", type=int, default=1024, help="N whose searches give the points per search")
    ap.add_argument("--thread-efficiency", type=float, default=0.7, help="assumed, for --threads CORES per task")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads}
    if args.per_round:
        out["per_round"] = compare_per_round(_pairs(args.cells), args.per_round,
                                             int_list(args.seeds, "--seeds", 0), args.modes.split(","))
    if args.throughput:
        out["throughput"] = throughput(_pairs(args.shapes), args.steps)
    if args.predict:
        out["predict"] = predict(args.predict, args.nodes, args.cores, args.ref_n, args.thread_efficiency)
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
