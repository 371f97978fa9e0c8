"""Benchmark: the least time the default `llmprobe run` on SmolLM2-135M can take on this machine.

Counts the model FLOPs of every stage of the default run (the workload count of ``llmprobe.jobs.plan``, the cost
model of ``benchmarks/scaling.py`` and ``llmprobe plan``: the bundled relations, SmolLM2's known-fact counts, the
splits of ``relation_split``, exact Jacobians at d = 576) and divides them by this machine's dense float32
matrix-multiply rate, measured in the same run with every usable core on matrices shaped like the run's (rows x 576
by 576 x 1536: ``llmprobe.jobs.plan.matmul_rate``). That rate is an upper bound on what any pass reaches (the
passes are small-batch matmuls, attention, norms), so the quotient is a lower bound on each stage's time: no
implementation of the same measurement on these cores can be faster.

    python benchmarks/main_job_floor.py
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmprobe.jobs.plan import (  # noqa: E402  (the cost model's workload count and the matmul rate)
    SMOLLM2_KNOWN,
    TARGETS,
    forward_work,
    jacobian_work,
    known_work,
    matmul_rate,
    run_workload,
    smollm2_tokenizer,
    sum_work,
)


def main() -> dict:
    threads = len(os.sched_getaffinity(0))
    rate = matmul_rate(threads, seconds=3.0)
    shape = TARGETS[0]
    work = run_workload(smollm2_tokenizer(), shape.layers, SMOLLM2_KNOWN)
    stages = {
        "known facts": known_work(shape, work["known"]).flops,
        "Jacobians (exact)": sum_work(jacobian_work(shape, p, work["lre_layers"]) for p in work["jacobian"]).flops,
        "capture + LM-head scoring": (sum_work(forward_work(shape, b, n) for b, n in work["forward"])
                                      .flops + work["head_rows"] * shape.head_flops()),
        "causality and swap edits": sum_work(forward_work(shape, b, n, head=True) for b, n in work["edits"]).flops,
        "superposition states": forward_work(shape, work["states"], shape.layers).flops,
    }
    print(f"dense float32 matmul on {threads} thread(s): {rate / 1e9:.0f} GFLOP/s (measured now; the ceiling)")
    print(f"{'stage':<28}{'TFLOP':>8}{'floor s':>9}")
    for name, flops in stages.items():
        print(f"{name:<28}{flops / 1e12:>8.2f}{flops / rate:>9.0f}")
    total = sum(stages.values())
    print(f"{'model work, all stages':<28}{total / 1e12:>8.2f}{total / rate:>9.0f}")
    prompts = sum(len(p) for p in work["jacobian"])
    tokens = sum(a for p in work["jacobian"] for _, a in p)
    print(f"Jacobians: {prompts} prompts ({tokens} tokens from the subject's last to the prompt's end) x {shape.d} "
          f"products through the blocks after layer {min(work['lre_layers'])} (LRE layers {work['lre_layers']})")
    return {"rate": rate, "threads": threads, "stages": stages, "jacobian_prompts": prompts}


if __name__ == "__main__":
    main()
