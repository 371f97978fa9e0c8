"""Synthetic training benchmark: throughput (facts/second) and time to 100% train accuracy for a fixed (N, R, d).

Compares, in the same process and on the same device:

* ``ours``      -- llmprobe's recipe: full batch, fused chunked softmax cross-entropy (gradient formed in the
                   forward pass, L2-sized chunks on CPU), Adam lr 0.1 with 10% warm-up and cosine decay, MLP 8d.
* ``baseline``  -- the prototype's recipe: minibatches of 512, ``F.cross_entropy`` on full logits through autograd,
                   Adam lr 0.03 with cosine decay, MLP 4d.

Throughput is measured over a few timed epochs after a warm-up; time to 100% is a full training run of each recipe
(the baseline is capped at ``--baseline-max-epochs``). Runs unchanged on a GPU with ``--device cuda``.

    python benchmarks/synthetic_training.py                       # N=1024, R=8, d=24 on CPU, 2 threads
    python benchmarks/synthetic_training.py --device cuda -N 4096 -R 16 --d 40
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from synthetic.model import FactRecallModel  # noqa: E402
from synthetic.tasks import random_bijections  # noqa: E402
from synthetic.train import TrainConfig, evaluate, model_config_for, train  # noqa: E402


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def baseline_epoch(model, opt, data, batch, gen, sched=None):
    perm = torch.randperm(len(data), generator=gen).to(data.input_ids.device)
    correct = 0
    for i in range(0, len(data), batch):
        idx = perm[i:i + batch]
        logits = model(data.input_ids[idx])[:, -1]
        y = data.targets[idx, 0]
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        correct += int((logits.argmax(-1) == y).sum())
    return correct / len(data)


def throughput(args, task, device) -> dict:
    data = task.data().to(device)
    n = len(data)
    out = {}
    # ours: full-batch fused steps
    model = FactRecallModel(model_config_for(task, args.d, d_mlp=8 * args.d)).to(device)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def ours_step():
        loss, _ = model.loss(data.input_ids, data.target_pos, data.targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        ours_step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(args.epochs):
        ours_step()
    _sync(device)
    out["ours_facts_per_s"] = n * args.epochs / (time.perf_counter() - t)
    # baseline: minibatch autograd cross-entropy
    model = FactRecallModel(model_config_for(task, args.d, d_mlp=4 * args.d)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    baseline_epoch(model, opt, data, args.baseline_batch, gen)
    _sync(device)
    t = time.perf_counter()
    for _ in range(args.epochs):
        baseline_epoch(model, opt, data, args.baseline_batch, gen)
    _sync(device)
    out["baseline_facts_per_s"] = n * args.epochs / (time.perf_counter() - t)
    out["throughput_ratio"] = out["ours_facts_per_s"] / out["baseline_facts_per_s"]
    out["ns_per_logit_ours"] = 1e9 / (out["ours_facts_per_s"] * task.n_outputs)
    return out


def time_to_100(args, task, device) -> dict:
    out = {}
    res = train(task, args.d, d_mlp=8 * args.d,
                config=TrainConfig(lr=0.1, warmup_frac=0.1, max_steps=args.max_steps, device=device,
                                   progress=False))
    out.update(ours_success=res.success, ours_steps=res.steps, ours_time_s=res.wall_time_s,
               ours_accuracy=res.accuracy, ours_bits_per_param=res.bits_per_param)
    if args.skip_baseline:
        return out
    model = FactRecallModel(model_config_for(task, args.d, d_mlp=4 * args.d)).to(device)
    data = task.data().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    steps_per_epoch = math.ceil(len(data) / args.baseline_batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.baseline_max_epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    acc, epochs = 0.0, 0
    while epochs < args.baseline_max_epochs:
        baseline_epoch(model, opt, data, args.baseline_batch, gen, sched)
        epochs += 1
        acc = evaluate(model, data)
        if acc >= 1.0:
            break
    _sync(device)
    out.update(baseline_success=acc >= 1.0, baseline_epochs=epochs, baseline_steps=epochs * steps_per_epoch,
               baseline_time_s=time.perf_counter() - t, baseline_accuracy=acc,
               baseline_bits_per_param=task.bits() / sum(p.numel() for p in model.parameters()))
    if out["baseline_success"] and out["ours_success"]:
        out["time_to_100_speedup"] = out["baseline_time_s"] / out["ours_time_s"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-N", "--subjects", type=int, default=1024)
    p.add_argument("-R", "--relations", type=int, default=8)
    p.add_argument("--d", type=int, default=24)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs for throughput")
    p.add_argument("--max-steps", type=int, default=600, help="step cap of our recipe")
    p.add_argument("--baseline-batch", type=int, default=512)
    p.add_argument("--baseline-max-epochs", type=int, default=300)
    p.add_argument("--skip-baseline", action="store_true", help="time to 100%% for our recipe only")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)
    task = random_bijections(args.subjects, args.relations, seed=0)
    info = {"N": args.subjects, "R": args.relations, "d": args.d, "device": args.device,
            "threads": torch.get_num_threads(), "n_facts": task.n_facts, "torch": torch.__version__}
    print(f"synthetic benchmark: N={args.subjects} R={args.relations} d={args.d} on {args.device} "
          f"({info['threads']} threads), {task.n_facts} facts", flush=True)
    info.update(throughput(args, task, args.device))
    print(f"  throughput  ours {info['ours_facts_per_s']:,.0f} facts/s  baseline {info['baseline_facts_per_s']:,.0f}"
          f" facts/s  ratio {info['throughput_ratio']:.2f}x  ({info['ns_per_logit_ours']:.2f} ns per logit)",
          flush=True)
    info.update(time_to_100(args, task, args.device))
    line = (f"  time to 100%  ours {'ok' if info['ours_success'] else 'FAILED'} in {info['ours_steps']} steps, "
            f"{info['ours_time_s']:.1f}s")
    if "baseline_success" in info:
        line += (f"; baseline {'ok' if info['baseline_success'] else 'not reached'} after "
                 f"{info['baseline_epochs']} epochs ({info['baseline_steps']} steps), {info['baseline_time_s']:.1f}s"
                 f" (acc {info['baseline_accuracy']:.4f})")
        if "time_to_100_speedup" in info:
            line += f"; speed-up {info['time_to_100_speedup']:.1f}x"
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return info


if __name__ == "__main__":
    main()
