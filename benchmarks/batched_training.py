"""Batched training benchmark: the same models trained one at a time and all at once (synthetic/batched.py).

In one run, on one device: every model of ``--widths x --seeds x --modes`` on R random bijections of N subjects
(the points a sweep cell or a bisection round trains) is trained with :func:`synthetic.train.train`, one after the
other, then together with :func:`synthetic.batched.train_batched` (same seeds, same step cap). Printed: per model
the steps and time to 100% of each way (time to 100% one at a time counts from the start of the whole series, as a
sweep waits for it), the throughput of each way in model-steps per second and their ratio. Then a prediction for
one H200 (assumptions printed with it), and with ``--dstar`` the sweep's d* per cell both ways.

    python benchmarks/batched_training.py -N 256 -R 4 --widths 5,6,7,8,9,10,11,12 --seeds 0,1
    python benchmarks/batched_training.py -N 256 -R 2 --dstar --dstar-subjects 256,512 --dstar-relations 2,4
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from llmprobe.checks import int_list  # noqa: E402
from llmprobe.io import write_json  # noqa: E402
from synthetic.batched import ModelStack, train_batched  # noqa: E402
from synthetic.model import FactRecallModel, auto_chunk  # noqa: E402
from synthetic.sweep import SweepConfig, load_results, run_sweep, thresholds  # noqa: E402
from synthetic.tasks import random_bijections  # noqa: E402
from synthetic.train import TrainConfig, lr_at, model_config_for, train  # noqa: E402

# H200 (SXM): dense FP32 without tensor cores 67 TFLOP/s, HBM3e 4.8 TB/s; eager PyTorch costs ~5 us of host time
# per dispatched op (the GPU waits on the host when kernels are small)
H200_FP32_FLOPS, H200_BYTES_PER_S, OP_LAUNCH_S = 67e12, 4.8e12, 5e-6
FLOP_EFFICIENCY, BANDWIDTH_EFFICIENCY = 0.5, 0.7


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def count_ops(fn) -> int:
    """Number of aten ops (kernel launches on a GPU) that ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.n


def step_ops(tasks, configs, cfg, device="cuda") -> tuple[int, int]:
    """Aten ops of one full-batch training step: (one model alone, all models stacked), counted on the CPU with the
    softmax chunks that ``device`` would use (one chunk on a GPU at these sizes)."""
    task, mcfg = tasks[0], configs[0]
    n = mcfg.n_outputs
    model = FactRecallModel(mcfg)
    data = task.data()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas)

    def alone():
        loss, correct = model.loss(data.input_ids, data.target_pos, data.targets, chunk=auto_chunk(n, device))
        int(correct)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    stack = ModelStack([FactRecallModel(c) for c in configs])
    datas = [t.data() for t in tasks]

    def stacked():
        ids = torch.stack([d.input_ids for d in datas])
        targets = torch.stack([d.targets for d in datas])
        chunk = max(1, auto_chunk(n, device) // len(configs))
        loss, correct = stack.loss(ids, data.target_pos, targets, chunk=chunk)
        loss.tolist(), correct.tolist()
        loss.sum().backward()
        stack.adam_step([lr_at(0, cfg)] * len(configs), cfg)

    alone()                                      # Adam creates its state on the first step
    return count_ops(alone), count_ops(stacked)


def step_cost(N: int, R: int, d: int, m: int) -> tuple[float, float]:
    """(FLOPs, bytes of memory traffic) of one full-batch step of one model: B = N R facts, N-way softmax."""
    B = N * R
    flops = 6 * B * N * d + 12 * B * d * m + 8 * B * N
    bytes_ = 4 * (6 * B * N + 8 * B * (d + m))
    return flops, bytes_


def predict_h200(N, R, configs, steps, ops_alone, ops_stacked) -> dict:
    """Predicted seconds on one H200: each step costs max(ops x launch, FLOPs / (efficiency x peak),
    bytes / (efficiency x bandwidth)); one at a time sums that over every model's steps, batched over the steps
    of the shrinking stack (padded to its widest model)."""
    flop_rate, byte_rate = FLOP_EFFICIENCY * H200_FP32_FLOPS, BANDWIDTH_EFFICIENCY * H200_BYTES_PER_S
    alone = 0.0
    for c, s in zip(configs, steps):
        f, b = step_cost(N, R, c.d_model, c.d_mlp)
        alone += s * max(ops_alone * OP_LAUNCH_S, f / flop_rate, b / byte_rate)
    batched = 0.0
    for t in range(max(steps) + 1):
        live = [c for c, s in zip(configs, steps) if s >= t]
        if not live:
            break
        d, m = max(c.d_model for c in live), max(c.d_mlp for c in live)
        f, b = step_cost(N, R, d, m)
        batched += max(ops_stacked * OP_LAUNCH_S, len(live) * f / flop_rate, len(live) * b / byte_rate)
    return {"one_at_a_time_s": alone, "batched_s": batched, "speedup": alone / max(batched, 1e-12)}


def compare_training(args) -> dict:
    widths, seeds, modes = int_list(args.widths, "--widths"), int_list(args.seeds, "--seeds", 0), args.modes.split(",")
    cfg = TrainConfig(max_steps=args.max_steps, progress=False, device=args.device)
    points = list(itertools.product(modes, widths, seeds))
    tasks = [random_bijections(args.N, args.R, seed) for _, _, seed in points]
    configs = [model_config_for(task, d, seed=seed, frozen_subjects=mode != "trainable",
                                frozen_unembed=mode == "frozen_all", d_mlp=8 * d)
               for task, (mode, d, seed) in zip(tasks, points)]
    print(f"N={args.N} R={args.R}: {len(points)} models ({', '.join(modes)} x d {widths} x seeds {seeds}), "
          f"max {args.max_steps} steps, device {args.device}, {torch.get_num_threads()} thread(s)", flush=True)
    _sync(args.device)
    t0, c0 = time.perf_counter(), time.process_time()
    alone, t100_alone = [], []
    for task, mcfg in zip(tasks, configs):
        res = train(task, model_config=mcfg, config=cfg)
        _sync(args.device)
        alone.append(res)
        t100_alone.append(time.perf_counter() - t0 if res.success else None)
    wall_alone, cpu_alone = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    batched = train_batched(tasks, configs, cfg)
    _sync(args.device)
    wall_batched, cpu_batched = time.perf_counter() - t0, time.process_time() - c0
    print(f"{'mode':<10} {'d':>3} {'seed':>4} | {'steps':>5} {'100%':>5} {'t100 s':>7} | {'steps':>5} {'100%':>5} "
          f"{'t100 s':>7} | max |param diff|")
    rows = []
    for (mode, d, seed), a, b, ta in zip(points, alone, batched, t100_alone):
        diff = max(float((p - q).abs().max()) for p, q in zip(a.model.state_dict().values(),
                                                               b.model.state_dict().values()))
        fmt = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731
        print(f"{mode:<10} {d:>3} {seed:>4} | {a.steps:>5} {str(a.success):>5} {fmt(ta):>7} | {b.steps:>5} "
              f"{str(b.success):>5} {fmt(b.time_to_target_s):>7} | {diff:.2e}")
        rows.append({"mode": mode, "d": d, "seed": seed, "alone_steps": a.steps, "alone_success": a.success,
                     "alone_t100_s": ta, "batched_steps": b.steps, "batched_success": b.success,
                     "batched_t100_s": b.time_to_target_s, "max_param_diff": diff})
    steps_alone, steps_batched = sum(r.steps for r in alone), sum(r.steps for r in batched)
    tput_alone, tput_batched = steps_alone / wall_alone, steps_batched / wall_batched
    all_alone = max((t for t in t100_alone if t is not None), default=None)
    all_batched = max((r.time_to_target_s for r in batched if r.time_to_target_s is not None), default=None)
    print(f"one at a time: {wall_alone:.1f} s wall, {cpu_alone:.1f} s CPU, {steps_alone} model-steps, "
          f"{tput_alone:.1f} model-steps/s")
    print(f"batched:       {wall_batched:.1f} s wall, {cpu_batched:.1f} s CPU, {steps_batched} model-steps, "
          f"{tput_batched:.1f} model-steps/s")
    same_success = sum(r["alone_success"] == r["batched_success"] for r in rows)
    same_steps = sum(r["alone_steps"] == r["batched_steps"] for r in rows)
    print(f"speed-up: throughput {tput_batched / tput_alone:.2f}x, wall {wall_alone / wall_batched:.2f}x, "
          f"CPU {cpu_alone / cpu_batched:.2f}x; same success for {same_success}/{len(rows)} models, same steps for "
          f"{same_steps}/{len(rows)}")
    ops_alone, ops_stacked = step_ops(tasks, configs, cfg)
    pred = predict_h200(args.N, args.R, configs, [r.steps for r in batched], ops_alone, ops_stacked)
    print(f"H200 prediction (not measured): one at a time {pred['one_at_a_time_s']:.2f} s, batched "
          f"{pred['batched_s']:.2f} s ({pred['speedup']:.1f}x). Assumptions: a step costs max(ops x "
          f"{OP_LAUNCH_S * 1e6:.0f} us host dispatch, FLOPs / {FLOP_EFFICIENCY:.0%} of "
          f"{H200_FP32_FLOPS / 1e12:.0f} TFLOP/s FP32, bytes / "
          f"{BANDWIDTH_EFFICIENCY:.0%} of {H200_BYTES_PER_S / 1e12:.1f} TB/s); {ops_alone} ops per step alone, "
          f"{ops_stacked} stacked (counted here); the batched steps as measured here.")
    return {"N": args.N, "R": args.R, "models": rows, "wall_alone_s": wall_alone, "wall_batched_s": wall_batched,
            "cpu_alone_s": cpu_alone, "cpu_batched_s": cpu_batched, "throughput_alone": tput_alone,
            "throughput_batched": tput_batched, "all_at_100_alone_s": all_alone, "all_at_100_batched_s": all_batched,
            "threads": torch.get_num_threads(), "h200_prediction": pred, "ops_alone": ops_alone,
            "ops_stacked": ops_stacked}


def compare_dstar(args) -> dict:
    """d* per (N, R, seed, mode) from the one-at-a-time sweep and the batched sweep, with their wall times."""
    found, times = {}, {}
    root = tempfile.mkdtemp(prefix="dstar-")
    try:
        for batched in (False, True):
            cfg = SweepConfig(subjects=int_list(args.dstar_subjects, "--dstar-subjects"),
                              relations=int_list(args.dstar_relations, "--dstar-relations"),
                              seeds=int_list(args.seeds, "--seeds", 0), modes=args.modes.split(","), batched=batched,
                              train=TrainConfig(max_steps=args.max_steps, progress=False, device=args.device))
            out = os.path.join(root, str(batched))
            t0 = time.perf_counter()
            run_sweep(cfg, out)
            times[batched] = time.perf_counter() - t0
            rows = load_results(out)
            found[batched] = {f"N={k[0]} R={k[1]} seed={k[2]} {k[3]}": (t["d_star"], t["exact"])
                              for k, t in thresholds(rows).items()}
            print(f"{'batched' if batched else 'one at a time'} sweep: {times[batched]:.1f} s, {len(rows)} points",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = sum(found[True].get(k) == v for k, v in found[False].items())
    for k, v in found[False].items():
        print(f"{k:<34} one at a time d*={v[0]} exact={v[1]}   batched d*={found[True].get(k)}")
    print(f"same d* in {same}/{len(found[False])} cells; sweep wall time {times[False]:.1f} s vs {times[True]:.1f} s "
          f"({times[False] / times[True]:.2f}x)")
    return {"one_at_a_time": found[False], "batched": found[True], "same": same, "cells": len(found[False]),
            "wall_s": {"one_at_a_time": times[False], "batched": times[True]}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", type=int, default=256)
    ap.add_argument("-R", type=int, default=4)
    ap.add_argument("--widths", default="5,6,7,8,9,10,11,12")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default="trainable")
    ap.add_argument("--max-steps", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dstar", action="store_true", help="also compare the sweep's d* both ways")
    ap.add_argument("--dstar-subjects", default="256,512")
    ap.add_argument("--dstar-relations", default="2,4")
    ap.add_argument("--skip-training", action="store_true", help="only the d* comparison")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {}
    if not args.skip_training:
        out["training"] = compare_training(args)
    if args.dstar:
        out["dstar"] = compare_dstar(args)
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
