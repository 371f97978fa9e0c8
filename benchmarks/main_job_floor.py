"""Benchmark: the least time the default `llmprobe run` on SmolLM2-135M can take on this machine, stage by stage,
against a measured run.

Counts the FLOPs of every stage of the default run and divides them by this machine's dense float32
matrix-multiply rate, measured in the same run on matrices shaped like the run's (rows x 576 by 576 x 1536:
``llmprobe.jobs.plan.matmul_rate``), with every usable core and with one (the controls' workers are one thread
each, by design: their numbers must not depend on the thread count). That rate is an upper bound on what any
pass reaches (small-batch matmuls, attention, norms are slower), so each quotient is a lower bound on the stage's
time: no implementation of the same measurement on these cores can be faster.

* model work: the workload count of ``llmprobe.jobs.plan`` (the bundled relations, SmolLM2's known-fact counts,
  the splits of ``relation_split``, exact Jacobians at d = 576): known facts, Jacobians, capture and LM-head
  scoring, causality and swap edits, superposition states (without ``--count-mechanisms``);
* the decoder fits: per LRE fit the SVDs of W and of its random-spectrum twin (~ 2 x 4 d^3 with the products),
  per ridge fit ~ 45 d^2 (as the cost model counts them);
* the matched controls: with ``--report``, every model-step the report's controls trained (the d* bisections'
  tries and each curve point's seeds, to the steps recorded), 6 x parameters x facts FLOPs per full-batch step;
  without it, the plan's step counts. With ``--count-mechanisms`` instead counted by torch on the run's table
  (``FlopCounterMode``, with the in-place ``baddbmm_`` it skips: the softmax's unembedding gradient):
  one full-batch step (loss and backward) of a control of each width and mode, times the steps, and each
  curve point's measurement (``measure_control`` on seed 0's model, the R^2 of every seed's kept snapshots),
  run on a freshly initialised control of that width (the same shapes; Adam's elementwise update is not a
  matmul and is not counted: a lower bound still);
* the superposition, crosspatch, selector and multihop analyses (with ``--count-mechanisms``): each run once more
  on the report's model, relations, known facts and settings under torch's ``FlopCounterMode`` (every matmul,
  attention and convolution FLOP they execute: superposition's states, swap edits and readout fits, each source
  prompt's tokens before the subject once and each edit's from the subject on, as the cached edits run them);
  without it their time is shown and no floor (superposition: its states only).

With ``--report RUN/report.json`` it prints beside each stage the run's measured seconds (``timings``) and the
ratio, and the whole run's wall time against the critical path's floor: load + known facts + the largest of
(the analyses' floor on every core, each controls worker's floor on one core, all of it over every core). A
shared host's speed drifts: when the report records the one-thread rate at the run's start and end
(``timings.matmul_gflops_one_thread``), the floor is printed at that rate too (every core scaled by the ratio
measured now), and the line says when the host ran more than 10% slower or faster during the run than now.

    python benchmarks/main_job_floor.py [--report runs/smollm2/report.json [--count-mechanisms]]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from llmprobe.analyses.run import Analyses  # noqa: E402
from llmprobe.jobs.main import matched_table  # noqa: E402
from llmprobe.jobs.plan import matched_curve, matched_step_flops, matmul_rate, smollm2_tokenizer  # noqa: E402
from llmprobe.jobs.probe import fitting, load_options, run_relations  # noqa: E402
from llmprobe.jobs.workload import (  # noqa: E402
    MATCHED_D_STAR,
    SMOLLM2_KNOWN,
    TARGETS,
    edit_work,
    forward_work,
    jacobian_work,
    known_work,
    run_workload,
    sum_work,
)
from llmprobe.model.interop import as_loaded_model  # noqa: E402
from llmprobe.model.known import FactResult  # noqa: E402
from llmprobe.report.schema import read_report  # noqa: E402
from llmprobe.settings import from_record  # noqa: E402
from synthetic.matched import N_BOOT, fixed_threads, measure_control, r2_value  # noqa: E402
from synthetic.model import FactRecallModel  # noqa: E402
from synthetic.sweep import SweepConfig, width_config  # noqa: E402
from synthetic.tasks import from_fact_table  # noqa: E402

MECHANISMS = ("crosspatch", "selector", "multihop")
COUNTED = ("superposition", *MECHANISMS)          # the analyses --count-mechanisms runs under FlopCounterMode


class RunInputs(NamedTuple):
    """What a run's report folder holds, as the run had it: the report, its settings, the model loaded again, the
    relations with the facts that fit (as the run analysed them) and the known facts (known_facts.json)."""
    report: dict
    settings: object
    lm: object
    relations: list
    known: dict


def run_inputs(report_path: str) -> RunInputs:
    """The report's model, relations, known facts and settings (read and loaded once for every count below)."""
    report = read_report(report_path)
    _, settings = from_record(report["settings"])
    run = settings.run
    lm = as_loaded_model(run.model, **load_options(run))
    relations = [r.with_facts(fitting(lm, r, run.max_prompt_tokens)[0]) for r in run_relations(run)]
    rows = json.loads((Path(report_path).parent / "known_facts.json").read_text())
    known = {name: [FactResult(**row) for row in results] for name, results in rows.items()}
    return RunInputs(report, settings, lm, relations, known)


def _inplace_matmul_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of an in-place ``addmm_`` / ``baddbmm_`` (a [.., n, k] @ b [.., k, m]): 2 n k m per matrix."""
    return 2 * math.prod(a_shape) * b_shape[-1]


# torch's FlopCounterMode counts the out-of-place addmm and baddbmm only; the controls' softmax accumulates the
# unembedding's gradient with baddbmm_
INPLACE_MATMULS = {torch.ops.aten.addmm_: _inplace_matmul_flops, torch.ops.aten.baddbmm_: _inplace_matmul_flops}


def counted(fn) -> float:
    """The FLOPs torch's FlopCounterMode counts while ``fn()`` runs (in-place matmuls included)."""
    with FlopCounterMode(display=False, custom_mapping=INPLACE_MATMULS) as counter:
        fn()
    return float(counter.get_total_flops())


def mechanism_flops(inputs: RunInputs) -> dict[str, float]:
    """{analysis: FLOPs} of superposition, crosspatch, selector and multihop (``COUNTED``), each computed once on
    the run's model, relations, known facts and settings, under torch's FlopCounterMode."""
    job = Analyses(inputs.lm, inputs.relations, inputs.known, inputs.report["layers"], COUNTED,
                   seed=inputs.settings.run.seed, **inputs.settings.analysis_options())
    return {name: counted(lambda: job.compute((name, None))) for name in COUNTED}


def control_flops(inputs: RunInputs) -> dict[str, float]:
    """{mode: FLOPs} of the report's matched controls counted by torch's FlopCounterMode on the run's table (the
    superposition fit's, as the run trained them): per width and mode one full-batch training step (loss and its
    backward) times every step trained at that width (the bisection's tries, each point's seeds), plus each curve
    point's measurement: ``measure_control`` of seed 0's model and one ``r2_value`` per kept snapshot of every
    seed (the R^2 at the budgets, and at the end for seeds > 0), on a fresh control of the same width."""
    block, settings = inputs.report["matched"], inputs.settings
    table, _ = matched_table(inputs.lm, inputs.relations, inputs.known, inputs.report,
                             "superposition" in settings.analyses("run"), settings.analysis_options())
    task = from_fact_table(table)
    if int((task.table >= 0).sum()) != block["table"]["n_facts"]:
        raise SystemExit(f"the rebuilt controls' table has {int((task.table >= 0).sum())} facts, the report's "
                         f"{block['table']['n_facts']}: not the run's table")
    data, cfg = task.data(), SweepConfig(d_max=block["d_model"], mlp_ratio=block["training"]["mlp_ratio"],
                                         attention=block["training"]["attention"])

    @functools.lru_cache(maxsize=None)
    def fresh(mode: str, d: int) -> FactRecallModel:
        return FactRecallModel(width_config(task, mode, d, cfg, block["seed"]))

    @functools.lru_cache(maxsize=None)
    def step(mode: str, d: int) -> float:
        model = fresh(mode, d)
        return counted(lambda: model.loss(data.input_ids, data.target_pos, data.targets)[0].backward())

    out = {}
    with fixed_threads():
        for mode, entry in block["modes"].items():
            total = sum(step(mode, t["d"]) * t["steps"] for t in entry["threshold"]["tried"])
            for point in entry["points"]:
                d, model = point["d"], fresh(mode, point["d"])
                if model.config.d_mlp != point["d_mlp"]:
                    raise SystemExit(f"{mode} d={d}: MLP width {model.config.d_mlp}, the report's {point['d_mlp']}")
                total += step(mode, d) * sum(s["steps"] for s in point["seeds"])
                total += counted(lambda: measure_control(model, task, block["seed"], N_BOOT))
                r2 = counted(lambda: r2_value(model.subject_embed.detach(), model.unembed_weight.detach(), task))
                total += r2 * sum(len(s["r2_by_budget"]) + (i > 0) for i, s in enumerate(point["seeds"]))
            out[mode] = total
    return out


def matched_flops(report: dict | None, n_facts: int, d_model: int) -> dict[str, float]:
    """{mode: FLOPs of every training step it took}: from the report's controls block (the bisection's tries and
    every seed of every curve point) or, without a report, the plan's steps (3 seeds per point)."""
    out = {}
    block = (report or {}).get("matched") if isinstance((report or {}).get("matched"), dict) else None
    if block:
        n_facts = block["table"]["n_facts"]
        for mode, entry in block["modes"].items():
            steps = [(t["d"], t["steps"]) for t in entry["threshold"]["tried"]]
            steps += [(p["d"], s["steps"]) for p in entry["points"] for s in p["seeds"]]
            out[mode] = sum(matched_step_flops(d, n_facts) * n for d, n in steps)
        return out
    for mode in MATCHED_D_STAR:
        out[mode] = sum(matched_step_flops(d, n_facts) * steps for d, steps in matched_curve(mode, d_model))
    return out


def drift_note(run_rate: float, rate_now: float) -> str:
    """" (the host ran 1.14x slower during the run than now: ...)" when the two one-thread rates differ by 10% or
    more, else ""."""
    if abs(run_rate / rate_now - 1) < 0.1:
        return ""
    how = f"{rate_now / run_rate:.2f}x slower" if run_rate < rate_now else f"{run_rate / rate_now:.2f}x faster"
    return f" (the host ran {how} during the run than now: read this ratio)"


def busy_note(rate: float, rate1: float, threads: int) -> str:
    """A warning line when ``threads`` threads ran under 0.75 x ``threads`` times one thread's rate (the cores were
    not idle while they were measured: the floor is then too high and the run's ratio to it flattering; a
    2026-12-05 try read 244 GFLOP/s on 2 threads beside a few seconds of another command, 376 on idle cores), else
    ""."""
    if threads < 2 or rate >= 0.75 * threads * rate1:
        return ""
    return (f"WARNING: {threads} threads ran at only {rate / rate1:.2f}x one thread: the cores were not idle while "
            f"the rate was measured, so every floor below is too high; run this again on idle cores")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="a default run's report.json: its measured seconds beside the floors")
    parser.add_argument("--count-mechanisms", action="store_true",
                        help="with --report: count the superposition, crosspatch, selector and multihop analyses' "
                             "FLOPs by running them once more (minutes)")
    args = parser.parse_args(argv)
    report = read_report(args.report) if args.report else None      # a schema-2 report read in schema 3's words
    timings = (report or {}).get("timings") or {}
    analyses_t = ((report or {}).get("analyses") or {}).get("timing") or {}

    threads = len(os.sched_getaffinity(0))
    rate, rate1 = matmul_rate(threads, seconds=3.0), matmul_rate(1, seconds=3.0)
    shape = TARGETS[0]
    work = run_workload(smollm2_tokenizer(), shape.layers, SMOLLM2_KNOWN)
    d = shape.d
    decoders = {
        "Jacobians (exact)": sum_work(jacobian_work(shape, p, work["lre_layers"]) for p in work["jacobian"]).flops,
        "capture + LM-head scoring": (sum_work(forward_work(shape, b, n) for b, n in work["forward"]).flops
                                      + work["head_rows"] * shape.head_flops()),
        "causality and swap edits": edit_work(shape, work["edits"]).flops,
        "decoder fits (SVDs, ridge)": work["lre_fits"] * 8.0 * d ** 3 + work["ridge_fits"] * 45.0 * d ** 2,
    }
    known = known_work(shape, work["known"]).flops
    states = forward_work(shape, work["states"], shape.layers).flops
    inputs = run_inputs(args.report) if args.report and args.count_mechanisms else None
    counted_controls = bool(inputs and isinstance(report.get("matched"), dict))
    controls = control_flops(inputs) if counted_controls else matched_flops(report, work["n_facts_table"], d)

    print(f"dense float32 matmul: {rate / 1e9:.0f} GFLOP/s on {threads} thread(s), {rate1 / 1e9:.0f} on one "
          f"(measured now; the ceiling)")
    busy = busy_note(rate, rate1, threads)
    if busy:
        print(busy)
    print(f"{'stage':<34}{'TFLOP':>8}{'floor s':>9}{'measured s':>12}{'ratio':>7}")

    def row(name, flops, measured=None, on=rate):
        floor = flops / on
        ratio = f"{measured / floor:>7.1f}" if measured and floor else ""
        print(f"{name:<34}{flops / 1e12:>8.2f}{floor:>9.0f}" + (f"{measured:>12.0f}{ratio}" if measured else ""))
        return floor

    row("known facts", known, timings.get("known_facts_s"))
    for name, flops in decoders.items():
        row(f"  {name}", flops)
    row("decoders (all of the above)", sum(decoders.values()), analyses_t.get("decoders_seconds"))
    mechanisms = mechanism_flops(inputs) if inputs else {}
    if "superposition" in mechanisms:
        row("superposition (counted by torch)", mechanisms["superposition"], analyses_t.get("superposition_seconds"))
    else:
        row("superposition states", states, analyses_t.get("superposition_seconds"))
    for name in MECHANISMS:
        if name in mechanisms:
            row(f"{name} (counted by torch)", mechanisms[name], analyses_t.get(f"{name}_seconds"))
        elif analyses_t.get(f"{name}_seconds"):
            print(f"{name + ' (not counted)':<34}{'':>8}{'':>9}{analyses_t[f'{name}_seconds']:>12.0f}")
    analyses_flops = sum(decoders.values()) + (0.0 if "superposition" in mechanisms else states) \
        + sum(mechanisms.values())
    analyses_floor = row("analyses, counted stages", analyses_flops, timings.get("analyses_s"))
    for mode, flops in controls.items():
        seconds = (report or {}).get("matched", {}).get("modes", {}).get(mode)
        measured = sum(p["wall_seconds"] for p in seconds["points"]) + seconds["threshold"]["search_seconds"] \
            if seconds else None
        row(f"controls {mode} ({'by torch, ' if counted_controls else ''}1 thread)", flops, measured, on=rate1)

    def critical_path(rate, rate1) -> tuple[float, float, dict]:
        """(floor, all work over every core, each worker's floor) at these rates (every core, one thread)."""
        workers = {mode: flops / rate1 for mode, flops in controls.items()}
        shared = (analyses_flops + sum(controls.values())) / rate
        return (known / rate + max([analyses_flops / rate, shared, *workers.values()]) + timings.get("load_s", 0.0),
                shared, workers)

    floor, shared, worker_floors = critical_path(rate, rate1)
    print(f"critical path floor: load + known facts + max(analyses {analyses_floor:.0f} s, controls workers "
          + ", ".join(f"{m} {s:.0f} s" for m, s in worker_floors.items()) + f", all work over {threads} cores "
          f"{shared:.0f} s) = {floor:.0f} s")
    wall = (report or {}).get("wall_seconds")
    if wall:
        print(f"run wall {wall:.0f} s = {wall / floor:.2f} x the floor"
              + ("" if mechanisms else " (the uncounted analyses are in the wall, not in the floor)"))
    at_run = timings.get("matmul_gflops_one_thread")       # the host's speed at the run's start and end
    floor_at_run = None
    if at_run:
        run_rate1 = sum(at_run) / len(at_run) * 1e9
        floor_at_run = critical_path(rate * run_rate1 / rate1, run_rate1)[0]
        print(f"at the run's own one-thread rate ({' and '.join(f'{r:.0f}' for r in at_run)} GFLOP/s at its start "
              f"and end, mean {run_rate1 / 1e9:.0f}; every core scaled by the ratio measured now, "
              f"{rate / rate1:.2f}): floor {floor_at_run:.0f} s"
              + (f", run wall = {wall / floor_at_run:.2f} x" if wall else "")
              + drift_note(run_rate1, rate1))
    prompts = sum(len(p) for p in work["jacobian"])
    tokens = sum(a for p in work["jacobian"] for _, a in p)
    print(f"Jacobians: {prompts} prompts ({tokens} tokens from the subject's last to the prompt's end) x {d} "
          f"products through the blocks after layer {min(work['lre_layers'])} (LRE layers {work['lre_layers']})")
    return {"rate": rate, "rate_one_thread": rate1, "threads": threads, "floor": floor, "floor_at_run": floor_at_run,
            "stages": {**decoders, "known facts": known, "superposition states": states, **mechanisms,
                       **{f"controls {m}": f for m, f in controls.items()}}, "jacobian_prompts": prompts}


if __name__ == "__main__":
    main()
