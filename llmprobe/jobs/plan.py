"""The plan of ``llmprobe run`` (layer 5): the predicted seconds and peak memory of each stage, from the model's
config alone (no weights read), on this CPU and on one H200.

This is the cost model of ``benchmarks/scaling.py`` (docs/scaling.md); the benchmark measures and fits,
``llmprobe.jobs.workload`` counts (the shapes, the run's workload, its FLOPs), this module predicts:

* :func:`predict`: seconds per stage. This CPU: ``CPU_FITS`` (seconds = a * work + b * passes, fitted once on
  the project's machine) times ``REFERENCE_RATE`` / this machine's one-thread matmul rate, measured now
  (:func:`measured_rate`); one H200: a roofline (``H200``);
* :func:`part_seconds`: the same for each part of the analyses of a loaded model, on the facts it knows (the
  progress bar's time left).

:func:`plan` puts it together for one model and device, :func:`format_plan` prints it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import asdict

import torch

from llmprobe.analyses.decoders import jacobian_rank_for, lre_jacobian_rank
from llmprobe.analyses.passes import assumed_known
from llmprobe.analyses.registry import REGISTRY
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, settings_from
from llmprobe.analyses.superposition import superposition_table
from llmprobe.checks import UsageError
from llmprobe.datasets import load_relations
from llmprobe.jobs.cost_model import constant, group
from llmprobe.jobs.workload import (
    CONTROL_POINT_STEPS,
    CONTROL_STEPS,
    MATCHED_D_STAR,
    MATCHED_SEARCH_S,
    SMOLLM2_KNOWN,
    SMOLLM2_KNOWN_FRACTION,
    Shape,
    Work,
    edit_work,
    forward_work,
    jacobian_work,
    known_work,
    mechanism_work,
    model_shape,
    run_workload,
    shape_from_config,
    sum_work,
)
from llmprobe.model.loading import (
    DEFAULT_MODEL,
    ModelLoadError,
    default_gguf,
    trusted_embedded_folder,
)
from llmprobe.names import ANALYSES
from llmprobe.settings import Settings
from synthetic.matched import MAX_STEPS, PAST_FIT, curve_widths, recipe_rule

# ------------------------------------------------------------------------------------------------ predict
# The fitted, measured and assumed numbers below come from cost_model.toml, each with its machine (or "assumed"),
# date, source and how it was fitted. H200: one H200's roofline (datasheet peaks, assumed efficiencies and
# overheads, its memory, bytes per parameter).
H200 = group("H200")
# The CPU fits of benchmarks/scaling.py and of the SmolLM2 runs, one thread, CPU seconds (docs/scaling.md):
# stage -> (work per second, seconds per pass). Work: FLOPs for the model stages, weight bytes for load,
# parameters for random_init, the operation counts of docs/scaling.md for the width-only CPU stages.
FITTED = {stage: tuple(fit) for stage, fit in group("FITTED").items()}
CPU_FITS = {stage: {"a": 1.0 / rate, "b": b} for stage, (rate, b) in FITTED.items()}
# the matched control's parameters at width d: [p2, p1, p0] of p2 d^2 + p1 d + p0 on the default table
CPU_FITS["matched_params"] = constant("MATCHED_PARAMS")
# one thread's dense float32 matmul rate per CPU second on the fits' machine: it over this machine's rate (measured
# now, ``measured_rate()``) scales every CPU fit
REFERENCE_RATE = constant("REFERENCE_RATE")
PROCESS_BYTES = constant("PROCESS_BYTES")   # Python, torch and the tokenizer: a process's RSS less its model
THREADS_PARALLEL_FRACTION = constant("THREADS_PARALLEL_FRACTION")   # Amdahl's p of an analysis process
# the known-facts control's d* and search seconds per mode (MATCHED_D_STAR, MATCHED_SEARCH_S: the all-facts one's)
MATCHED_KNOWN_D_STAR = constant("MATCHED_KNOWN_D_STAR")
MATCHED_KNOWN_SEARCH_S = constant("MATCHED_KNOWN_SEARCH_S")


def thread_speedup(threads: int) -> float:
    """How much faster one analysis process runs on ``threads`` torch threads than on one: Amdahl's law with the
    measured parallel fraction (``THREADS_PARALLEL_FRACTION``; the fits are one thread's seconds)."""
    p = THREADS_PARALLEL_FRACTION
    return 1.0 / ((1.0 - p) + p / max(1, threads))


def h200_matched_step(flops: float) -> float:
    """Seconds of one full-batch training step of a matched control on the H200 (``llmprobe run`` trains them on
    the model's GPU): float32 FLOPs at the assumed efficiency plus a per-step overhead."""
    return flops / (H200["fp32_flops"] * H200["matched_efficiency"]) + H200["matched_step_s"]


def cpu_model_cost(fits: dict):
    """The fitted cost of model work on this machine: seconds = a FLOPs + b passes (low-rank Jacobians by the
    exact ones' fit when they were not measured)."""
    def cost(stage: str, wk: Work, shape: Shape) -> float:
        f = fits.get(stage) or fits[stage.replace("_lowrank", "")]
        return f["a"] * wk.flops + f["b"] * wk.passes
    return cost


def h200_model_cost(stage: str, wk: Work, shape: Shape) -> float:
    """Roofline of model work on one H200: FLOPs at an assumed efficiency, plus per pass the weights read from
    HBM once and a launch overhead per block."""
    weights = shape.params * H200["bytes_per_param"]
    per_pass = weights / H200["hbm_bytes_per_s"] + shape.layers * H200["launch_s_per_block"]
    return wk.flops / (H200["peak_flops"] * H200["efficiency"]) + wk.passes * per_pass


def auto_rank(shape: Shape, lre_layers: list[int], cfg: AnalysisSettings | None = None) -> int | None:
    """The Jacobian rank ``cfg.jacobian_rank`` (default ``auto``) takes for this shape (None: exact); protocol lre's
    (``lre_jacobian_rank``: exact unless a rank is asked for)."""
    cfg = cfg or AnalysisSettings()
    if cfg.protocol == "lre":
        return lre_jacobian_rank(cfg)
    return jacobian_rank_for(cfg, shape.d, lre_layers, shape.layers)


def matched_params(d: int, width_fits: dict = CPU_FITS) -> float:
    """Parameters of the matched control at width d: the quadratic through the measured widths' counts."""
    p2, p1, p0 = width_fits["matched_params"]
    return p2 * d * d + p1 * d + p0


def matched_step_flops(d: int, n_facts: int, width_fits: dict = CPU_FITS) -> float:
    """FLOPs of one full-batch training step of the matched control at width d on ``n_facts`` facts: 6 per
    parameter per fact (forward and backward)."""
    return 6.0 * matched_params(d, width_fits) * n_facts


def matched_curve(mode: str, d_model: int, at_model_width: bool = True, n_seeds: int = 3, past_fit: int = PAST_FIT,
                  max_steps: int = MAX_STEPS, facts: str = "all") -> list[tuple[int, float]]:
    """(width, training steps of all its seeds) of every point of ``mode``'s curve as planned: the widths of
    ``synthetic.matched.curve_widths`` from the measured d* of the table (``facts``: "all", the default table's,
    ``MATCHED_D_STAR``; "known", SmolLM2's known-facts table's, ``MATCHED_KNOWN_D_STAR``). A rule that trains the
    whole schedule (``past_fit >= max_steps``) trains ``max_steps`` a seed, whenever it fits; else each seed's steps
    as measured on the default table (``CONTROL_POINT_STEPS``, else ``CONTROL_STEPS``: ``PAST_FIT`` steps past its
    first 100% step), moved to ``past_fit`` steps past that step and capped at ``max_steps`` (a point that reached
    the cap stays at the cap). The first 100% step is the measured one: another recipe fits at another step, which
    the plan cannot know."""
    def steps(d: int) -> int:
        if past_fit >= max_steps:
            return max_steps
        measured = CONTROL_POINT_STEPS[mode].get(d, CONTROL_STEPS)
        return max_steps if measured >= MAX_STEPS else min(max_steps, measured - PAST_FIT + past_fit)
    d_star = (MATCHED_KNOWN_D_STAR if facts == "known" else MATCHED_D_STAR)[mode]
    return [(d, steps(d) * n_seeds) for d in curve_widths(d_star, d_model, at_model_width)]


def search_seconds(mode: str, facts: str = "all") -> float:
    """The measured CPU seconds of ``mode``'s d* search on the table of ``facts`` at REFERENCE_RATE (known:
    SmolLM2's known-facts table, weight_decay recipe; all: the default table, adam)."""
    return (MATCHED_KNOWN_SEARCH_S if facts == "known" else MATCHED_SEARCH_S)[mode]


def run_controls(settings: Settings, n_facts: dict, n_subjects: dict) -> list[dict]:
    """The controls ``llmprobe run`` trains with ``settings``, in the order each worker trains them: the graded one
    (``matched.facts``, ``recipe``, ``n_seeds``, its rule) and the all-facts one shown apart when
    ``matched.all_facts`` (and the graded one is not on all facts already): {"facts", "recipe", "n_seeds",
    "past_fit", "max_steps", "n_facts", "n_subjects"} each, the tables' sizes from ``n_facts`` / ``n_subjects``
    (facts -> count)."""
    m = settings.matched

    def control(facts: str, recipe: str, n_seeds: int, past_fit: int | None, max_steps: int | None) -> dict:
        max_steps, past_fit = recipe_rule(recipe, max_steps, past_fit)
        return {"facts": facts, "recipe": recipe, "n_seeds": n_seeds, "past_fit": past_fit, "max_steps": max_steps,
                "n_facts": n_facts[facts], "n_subjects": n_subjects[facts]}

    out = [control(m.facts, m.recipe, m.n_seeds, m.past_fit, m.max_steps)]
    if m.all_facts and m.facts != "all":
        out.append(control("all", m.all_facts_recipe, m.all_facts_n_seeds, None, None))
    return out


def analyses_budget(threads: int, workers: int) -> tuple[int, int]:
    """(torch threads of each analysis process, analysis processes) of ``llmprobe run`` on ``threads`` threads
    beside ``workers`` one-thread controls workers: the threads the workers leave, max(1, threads - workers), in as
    many processes of that many threads as the threads hold (the cores the workers free when they finish)."""
    each = max(1, threads - workers)
    return each, max(1, threads // each) if workers else 1


def predict(shape: Shape, work: dict, model_cost, width_fits: dict, load_s: float, init_s: float,
            rank: int | None, matched_step=None, search_scale: float = 1.0,
            cores: int | None = None, helpers_fit: bool = True) -> dict:
    """Seconds per stage of ``llmprobe run`` for ``shape``: model work through ``model_cost(stage, Work, shape)``,
    the width-only CPU work (decoder fits, readouts, controls) from ``width_fits`` (it runs on the host CPU on any
    device), ``load_s`` and ``init_s`` (the random-init control's construction) given; the matched controls'
    training steps by ``matched_step(FLOPs)`` (default: the CPU fit), their threshold searches (``search_seconds``
    times ``search_scale``) and measurements at the CPU fit's speed, each control of ``work["controls"]`` (a workload with
    matched modes has them: :func:`settings_workload`) with its seeds, rule and table, one after the other in one worker per mode.
    wall = load + known facts over the analyses' processes + max(analyses over their processes, the longer mode's
    controls, all of that work over ``cores``) (the known facts' and analyses' seconds are one thread's; a process
    of several threads runs them ``thread_speedup`` faster; their processes ``analyses_processes``: cores // the threads the workers
    leave, as ``llmprobe run`` starts them (the known facts are shared by the same processes before the workers),
    1 when ``helpers_fit`` is false (the helpers' model copies would not fit in half the memory);
    ``cores`` None, on a GPU: one process and the last term left out, the GPU's small-batch passes leaving room for
    the controls' steps beside them)."""
    def width_cost(stage: str, flops: float, count: float) -> float:
        f = width_fits[stage]
        return count * (f["a"] * flops + f["b"])

    fwd = sum_work(forward_work(shape, b, blocks) for b, blocks in work["forward"])
    edits = edit_work(shape, work["edits"])
    jac = sum_work(jacobian_work(shape, p, work["lre_layers"], rank) for p in work["jacobian"])
    heads = Work(work["head_rows"] * shape.head_flops(), 0)
    states = forward_work(shape, work["states"], shape.layers)
    out = {"load": load_s, "known_facts": model_cost("known_facts", known_work(shape, work["known"]), shape),
           "jacobians": model_cost("jacobians" if rank is None else "jacobians_lowrank", jac, shape)}
    factored = rank is not None and rank + 10 < shape.d and "lre_fit_lowrank" in width_fits   # as subject_jacobians
    lre_fits = (width_cost("lre_fit_lowrank", float(shape.d) ** 2 * rank, work["lre_fits"]) if factored else
                width_cost("lre_fit", float(shape.d) ** 3, work["lre_fits"]))
    out["decoders_other"] = (model_cost("capture", fwd, shape) + model_cost("edits", edits, shape)
                             + model_cost("capture", heads, shape) + lre_fits
                             + width_cost("ridge_fit", 45.0 * shape.d ** 2, work["ridge_fits"]))
    out["superposition"] = (model_cost("capture", states, shape) + init_s
                            + width_cost("readout", float(work["readout_subjects"]) ** 2 * shape.d, work["readouts"]))
    per_mode = {}
    for mode in (m for m in work.get("matched_modes", MATCHED_D_STAR) if m in MATCHED_D_STAR):
        seconds = 0.0
        for control in work["controls"]:
            seconds += search_scale * search_seconds(mode, control["facts"])
            for width, steps in matched_curve(mode, shape.d, work.get("at_model_width", True), control["n_seeds"],
                                              control["past_fit"], control["max_steps"], control["facts"]):
                flops = matched_step_flops(width, control["n_facts"], width_fits)
                seconds += (width_cost("matched_step", flops, steps) if matched_step is None else
                            steps * matched_step(flops))
                seconds += width_cost("matched_measure", float(control["n_subjects"]) ** 2 * width, 1)
        per_mode[mode] = seconds
    out["matched"] = max(per_mode.values(), default=0.0)          # one worker per mode, side by side
    out["matched_total"] = sum(per_mode.values())
    for name in priced_by_passes():
        mechanism = work.get("mechanisms", {}).get(name)
        out[name] = (model_cost("mechanisms", mechanism_work(shape, mechanism), shape) + mechanism["twins"] * init_s
                     if mechanism else 0.0)
    out["analyses"] = sum(out[stage] for stage in ("jacobians", "decoders_other", "superposition",
                                                    *priced_by_passes()))
    # beside the workers the analyses run on the threads left, in as many processes of that many threads as the
    # cores hold (llmprobe.jobs.helpers); the workers and the analyses share the cores: no faster than their work
    # spread over every core
    # (without workers: one process on every thread, ``thread_speedup`` faster than one thread)
    each, processes = analyses_budget(cores, len(per_mode)) if cores else (1, 1)
    out["analyses_processes"], out["analyses_threads"] = (processes if helpers_fit else 1), each
    speed = out["analyses_processes"] * thread_speedup(each)
    shared = (out["analyses"] + out["matched_total"]) / cores if cores else 0.0
    out["wall"] = (out["load"] + out["known_facts"] / speed + max(out["analyses"] / speed, out["matched"], shared))
    return out


def scaled_fits(fits: dict, factor: float) -> dict:
    """``fits`` with every stage's a and b times ``factor`` (load, a disk read, and the control parameters kept)."""
    return {stage: f if stage in ("load", "matched_params") else {**f, "a": f["a"] * factor, "b": f["b"] * factor}
            for stage, f in fits.items()}


def predict_on(shape: Shape, work: dict, fits: dict, device: str, rank: int | None, cpu_scale: float = 1.0,
               helpers_fit: bool = True) -> dict:
    """:func:`predict` on ``device``: "cpu" by ``fits`` times ``cpu_scale`` (float32 weights read at the load
    fit's speed), "h200" by the roofline (bf16 weights read at ``H200["disk_bytes_per_s"]``), its host-CPU work
    (fits, readouts, the controls' searches, the random twin's construction) by ``fits`` as they are."""
    init = fits["random_init"]["a"] * shape.params + fits["random_init"]["b"] if work["readouts"] else 0.0
    if device == "cpu":
        here = scaled_fits(fits, cpu_scale)
        load = here["load"]["a"] * shape.params * 4 + here["load"]["b"]
        return predict(shape, work, cpu_model_cost(here), here, load, init * cpu_scale, rank,
                       search_scale=cpu_scale, cores=len(os.sched_getaffinity(0)),
                       helpers_fit=helpers_fit)
    load = shape.params * H200["bytes_per_param"] / H200["disk_bytes_per_s"]
    return predict(shape, work, h200_model_cost, fits, load, init, rank, h200_matched_step)


def memory(shape: Shape, work: dict, bytes_per_param: float) -> dict:
    """Peak bytes: on the model's device the model and its random-init twin (superposition); on the host the
    twin's construction (``from_config`` builds it on the CPU in the config's dtype, then it moves) and one
    relation's Jacobians (float32, every LRE layer) with the float64 copies and SVDs of one fit."""
    weights = shape.params * bytes_per_param
    d = shape.d
    jac_prompts = max((len(p) for p in work["jacobian"]), default=0)
    jacobians = jac_prompts * len(work["lre_layers"]) * d * d * 4 + (3 + 2 * 4) * d * d * 8
    return {"weights": weights, "device": 2 * weights, "host_init": weights, "host_jacobians": jacobians}


# ------------------------------------------------------------------------------------------------- the plan
def matmul_rate(threads: int = 1, seconds: float = 1.0, clock=time.perf_counter) -> float:
    """FLOP/s of float32 matmuls shaped like the run's GEMMs (rows x 576 by 576 x 1536, rows 256, 1024, 4096),
    the best of the shapes, each timed for ``seconds / 3`` of ``clock`` on ``threads`` torch threads (restored
    after). ``clock``: wall seconds, or ``time.thread_time`` (one thread only: its CPU seconds, which other
    processes' share of the cores does not inflate, as the fits' CPU seconds)."""
    before, gen = torch.get_num_threads(), torch.Generator().manual_seed(0)   # (torch's own RNG left alone)
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for rows in (256, 1024, 4096):
            a, b = torch.randn(rows, 576, generator=gen), torch.randn(576, 1536, generator=gen)
            a @ b
            n, t = 0, clock()
            while clock() - t < seconds / 3:
                a @ b
                n += 1
            best = max(best, 2.0 * rows * 576 * 1536 * n / (clock() - t))
        return best
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def measured_rate() -> float:
    """This machine's one-thread matmul rate (per CPU second), measured once per process (about a second)."""
    return matmul_rate(1, 1.0, time.thread_time)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The embedded SmolLM2 tokenizer (the cost model's prompt lengths): its cached copy's files, else its GGUF
    file's metadata (no weights read). UsageError when the embedded model is not installed."""
    from transformers import AutoTokenizer  # lazy: start-up time: the CLI's checks and errors do not load it

    try:
        gguf = default_gguf()
    except ModelLoadError as error:
        raise UsageError(f"the plan counts prompts with the embedded SmolLM2 tokenizer: {error}") from None
    folder = trusted_embedded_folder(gguf)
    if folder is not None and (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


_WORKLOADS: dict = {}   # the workloads counted in this process, by their settings and depth


def settings_workload(settings: Settings, n_layers: int) -> tuple[dict, AnalysisSettings, dict]:
    """(workload, analysis settings, what it assumed) of ``llmprobe run`` with ``settings`` on an ``n_layers``-deep
    model: its relations (first ``max_facts`` facts), layers, analyses, analysis settings and controls; known
    facts: SmolLM2's counts (scaled to ``max_facts``; other relations at SmolLM2's overall fraction)."""
    run = settings.run
    cfg = settings_from(seed=run.seed, **settings.analysis_options())
    analyses = settings.analyses("run")
    modes = tuple(settings.matched.modes) if settings.matched.enabled else ()
    key = json.dumps([run.relations, run.hf_kwargs, run.max_facts, run.layers, n_layers, asdict(cfg), analyses, modes,
                      sorted(settings.section("matched").items())], default=str)
    if key not in _WORKLOADS:
        # read as the run reads them: only up to max_facts (a long .jsonl or .csv file is not read whole)
        relations = load_relations(None if run.relations is None else list(run.relations), hf_kwargs=run.hf_kwargs,
                                   max_facts=run.max_facts)
        known = {rel.name: round(known_share(rel.name) * len(rel.facts)) for rel in relations}
        work = run_workload(smollm2_tokenizer(), n_layers, known, cfg, relations, run.layers, analyses, modes,
                            settings.matched.at_model_width)
        if work["matched_modes"]:
            work["controls"] = run_controls(settings, *control_tables(smollm2_tokenizer(), relations, known, cfg,
                                                                      work))
        assumed = {"relations": len(relations), "facts": sum(len(r.facts) for r in relations),
                   "known": sum(known.values()), "layers": work["layers"], "lre_layers": work["lre_layers"],
                   "analyses": analyses, "matched_modes": work["matched_modes"], "protocol": cfg.protocol,
                   "n_splits": cfg.n_splits}
        _WORKLOADS[key] = (work, cfg, assumed)
    return _WORKLOADS[key]


def control_tables(tok, relations: list, known: dict, cfg: AnalysisSettings, work: dict) -> tuple[dict, dict]:
    """({facts: facts}, {facts: subjects}) of the controls' tables, "all" (the superposition fit's, as
    ``run_workload`` counted it) and "known" (its facts among the first ``known[name]`` of each relation's,
    as ``llmprobe run``'s ``matched_table`` builds it; none when too few are known)."""
    try:
        table = superposition_table(tok, relations, assumed_known(relations, known),
                                    dataclasses.replace(cfg, superposition_facts="known"))
        facts, subjects = int((table.A >= 0).sum()), len(table.subjects)
    except AnalysisError:
        facts, subjects = 0, 0
    return ({"all": work["n_facts_table"], "known": facts}, {"all": work["n_subjects"], "known": subjects})


@functools.lru_cache(maxsize=None)
def known_share(name: str) -> float:
    """The share of relation ``name``'s facts the plan takes as known: SmolLM2's measured count over the bundled
    relation's facts for a bundled relation it measured, else SmolLM2's overall fraction."""
    if name not in SMOLLM2_KNOWN:
        return SMOLLM2_KNOWN_FRACTION
    return SMOLLM2_KNOWN[name] / len(load_relations([name])[0].facts)


def priced_by_passes() -> list[str]:
    """The registered analyses (``llmprobe.analyses.registry``) priced by their passes, each a stage of its own, in
    run order (crosspatch, selector, multihop and any registered since)."""
    return [a.name for a in REGISTRY if a.priced == "passes"]


def stages() -> dict[str, str]:
    """The plan's stages in run order, key -> label: load, known facts, the decoders' Jacobians and the rest of
    their work, the superposition, each analysis priced by its passes (its record's label), the matched
    controls."""
    return {"load": "load", "known_facts": "known facts", "jacobians": "Jacobians", "decoders_other": "decoders, rest",
            "superposition": "superposition", **{a.name: a.stage for a in REGISTRY if a.priced == "passes"},
            "matched": "matched controls"}


DEVICES = ("cpu", "h200")       # this CPU, one H200


def plan_devices(run_device: str) -> tuple[str, ...]:
    """The plan's devices for a run's ``--device``: auto both, cpu this CPU, h200 or cuda[:N] one H200."""
    if run_device == "auto":
        return DEVICES
    if run_device == "cpu":
        return ("cpu",)
    if run_device == "h200" or run_device.startswith("cuda"):
        return ("h200",)
    raise UsageError(f"plan: --device {run_device!r}: choose auto (this CPU and one H200), cpu, h200 or cuda")


def _bytes_per_param(settings: Settings, device: str) -> float:
    run = settings.run
    if device == "h200" and run.quantize:
        return {"4bit": 0.5, "8bit": 1.0}[run.quantize]
    dtype = run.dtype if run.dtype != "auto" else ("bfloat16" if device == "h200" else "float32")
    return 4.0 if dtype == "float32" else 2.0


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(model=None, settings: Settings | None = None, *, device: str = "cpu", rate: float | None = None,
         trust_remote_code: bool = False) -> dict:
    """The plan of ``llmprobe run`` of ``model`` (a name, folder, .gguf file, preset, transformers config or
    Shape: :func:`model_shape`; None = ``settings.run.model``) with ``settings`` on ``device``: "cpu" (this CPU)
    or "h200" (one H200). No weights are read.

    This CPU: every CPU fit (seconds = a * work + b * passes; load aside) times REFERENCE_RATE / ``rate``, where
    ``rate`` is one thread's float32 matmul FLOP/s per CPU second here (default :func:`measured_rate`: ~1 s, once
    per process) and REFERENCE_RATE the same on the machine the fits were made on: a core twice as fast halves
    the prediction. Both are one thread's: cores beyond one are not credited (SmolLM2's run on 2 idle cores took
    as long as the one-thread fit predicts; its passes are small). One H200: the roofline of ``H200``, its
    host-side work (fits, readouts, the controls' searches) at the fits' own speed.

    Returns {"model", "source", "shape", "device", "rate", "jacobian_rank", "assumed", "stages": {stage:
    {"seconds", "peak_bytes"}}, "total": {"seconds", "peak_bytes", "host_peak_bytes", "memory_bytes", "fits"}}:
    peak_bytes on the device (this CPU: process RSS; H200: GPU memory), total seconds the wall time (load + known
    facts + max(analyses over their processes, the longer control mode, all of that work over the cores): one
    controls worker per mode beside the analyses; ``total["matched_seconds"]`` both modes' seconds,
    ``total["analyses_processes"]`` the analyses' processes), its peak the most at any time (each analysis helper
    holds its own copy of the model)."""
    settings = settings or Settings()
    if device not in DEVICES:
        raise UsageError(f"plan: unknown device {device!r}; choose cpu (this CPU) or h200 (one H200)")
    model = settings.run.model if model is None else model
    shape, source = model_shape(model, trust_remote_code)
    work, cfg, assumed = settings_workload(settings, shape.layers)
    rank = auto_rank(shape, work["lre_layers"], cfg) if work["jacobian"] else None
    rate = (rate or measured_rate()) if device == "cpu" else None
    mem = memory(shape, work, _bytes_per_param(settings, device))
    helpers_fit = PROCESS_BYTES + mem["weights"] <= _ram_bytes() / 2     # ProbeJob.helpers: with the free memory
    seconds = predict_on(shape, work, CPU_FITS, device, rank, REFERENCE_RATE / rate if rate else 1.0, helpers_fit)
    weights, jacobians = mem["weights"], mem["host_jacobians"] if work["jacobian"] else 0
    twin = weights if work["readouts"] else 0                    # the random-init twin of the superposition
    control = 16 * matched_params(shape.d, CPU_FITS) if work["matched_modes"] else 0   # weights, grads, Adam
    on_host = device == "cpu"
    base = PROCESS_BYTES if on_host else 0          # the device's memory: this process's RSS, or the GPU's
    decoders = base + weights + (jacobians if on_host else 0)    # one relation's Jacobians and fits: on the host
    workers = len(work["matched_modes"])                          # one controls process per mode
    peaks = {"load": base + weights, "known_facts": base + weights, "jacobians": decoders, "decoders_other": decoders,
             "superposition": base + weights + twin, "matched": workers * (base + control) if control else 0}
    for name, mechanism in work.get("mechanisms", {}).items():              # selector, multihop: a random twin
        peaks[name] = base + weights * (1 + min(mechanism["twins"], 1)) if seconds[name] else 0
    for name in priced_by_passes():
        peaks.setdefault(name, 0)
    helpers = seconds["analyses_processes"] - 1                   # analysis helpers, each with its copy
    analysis_peak = max(decoders, *(peaks[s] for s in ("superposition", *priced_by_passes())))
    peak = max(peaks["known_facts"], analysis_peak * (1 + helpers) + peaks["matched"])
    host = peak if on_host else PROCESS_BYTES + max(mem["host_init"] if twin else 0, jacobians)
    limit = _ram_bytes() if on_host else H200["hbm_bytes"]
    label = DEFAULT_MODEL if model is None else str(model) if isinstance(model, (str, os.PathLike)) else shape.name
    return {"model": label, "source": source, "shape": {**asdict(shape), "params": shape.params}, "device": device,
            "rate": rate, "jacobian_rank": rank, "assumed": assumed,
            "stages": {stage: {"seconds": seconds[stage], "peak_bytes": peaks[stage]} for stage in stages()},
            "total": {"seconds": seconds["wall"], "matched_seconds": seconds["matched_total"],
                      "analyses_processes": seconds["analyses_processes"],
                      "analyses_threads": seconds["analyses_threads"], "peak_bytes": peak,
                      "host_peak_bytes": host,
                      "memory_bytes": limit, "fits": peak <= limit}}



def part_seconds(lm, relations: list, known: dict, layers: list[int], cfg: AnalysisSettings,
                 analyses=ANALYSES) -> dict[tuple[str, str | None], float]:
    """The plan's seconds of each part of ``run_analyses`` (``llmprobe.analyses.run.parts_of``) on the loaded
    model ``lm`` (its config and tokenizer; on a GPU the H200 roofline), counted on the facts it knows
    (``known``: relation name -> its known-facts results): ("decoders", relation name): Jacobians, LRE and ridge
    fits, causality edits (0 s for a relation skipped for too few facts); ("superposition", None) and each
    mechanism analysis. What the analyses' progress bar estimates the time left from."""
    shape = shape_from_config(lm.model.config, lm.info.get("name") or "model")
    device = "cpu" if lm.device.type == "cpu" else "h200"
    scale = REFERENCE_RATE / measured_rate() if device == "cpu" else 1.0
    counts = {name: sum(r.known for r in results) for name, results in known.items()}
    out = {}
    decoders = tuple(a for a in analyses if a in ("lre", "ridge"))
    for relation in relations if decoders else []:
        work = run_workload(lm.tokenizer, shape.layers, {relation.name: counts.get(relation.name, 0)}, cfg,
                            [relation], layers, decoders, matched_modes=())
        rank = auto_rank(shape, work["lre_layers"], cfg) if work["jacobian"] else None
        seconds = predict_on(shape, work, CPU_FITS, device, rank, scale)
        out[("decoders", relation.name)] = (seconds["jacobians"] + seconds["decoders_other"] if work["forward"]
                                            else 0.0)
    rest = tuple(a for a in analyses if a == "superposition" or a in priced_by_passes())
    if rest:
        work = run_workload(lm.tokenizer, shape.layers, counts, cfg, relations, layers, rest, matched_modes=(),
                            known_results=known)
        seconds = predict_on(shape, work, CPU_FITS, device, None, scale)
        out.update({(name, None): seconds[name] for name in rest})
    return out


def matched_width_steps(mode: str, d: int, d_model: int, n_seeds: int = 3, past_fit: int = PAST_FIT,
                        max_steps: int = MAX_STEPS, facts: str = "all") -> float:
    """The plan's training steps (all seeds) of width ``d`` of ``mode``'s curve under the rule (``past_fit``,
    ``max_steps``): :func:`matched_curve`'s at one of its widths (the curve up to max(d_model, d) from the
    measured d* of ``facts``' table), else interpolated linearly in log d between the two planned widths around it
    (beyond them: the nearest one's)."""
    curve = matched_curve(mode, max(d_model, d), True, n_seeds, past_fit, max_steps, facts)
    if d <= curve[0][0]:
        return float(curve[0][1])
    for (d0, s0), (d1, s1) in zip(curve, curve[1:]):
        if d0 <= d <= d1:
            return s0 + (s1 - s0) * (math.log(d) - math.log(d0)) / (math.log(d1) - math.log(d0))
    return float(curve[-1][1])


def matched_width_seconds(d: int, *, mode: str, d_model: int, n_facts: int, n_subjects: int, max_steps: int,
                          past_fit: int, n_seeds: int = 3, device: str = "cpu", cpu_scale: float = 1.0,
                          facts: str = "all") -> float:
    """The plan's seconds of one point of ``mode``'s curve at width ``d`` on a table of ``n_facts`` facts over
    ``n_subjects`` subjects (``facts``: which table, for its d*): :func:`matched_width_steps` steps under the rule
    (``past_fit``, ``max_steps``: :func:`matched_planned` resolves the recipe's) at :func:`matched_step_flops` each
    (this CPU: the matched_step fit times ``cpu_scale``; "h200": :func:`h200_matched_step`), and its measurement (the
    matched_measure fit), as :func:`predict` prices each point. Module-level, so a ``functools.partial`` of it
    reaches the controls' spawned worker."""
    fits = scaled_fits(CPU_FITS, cpu_scale) if device == "cpu" else CPU_FITS
    steps = matched_width_steps(mode, d, d_model, n_seeds, past_fit, max_steps, facts)
    flops = matched_step_flops(d, n_facts, fits)
    step = fits["matched_step"]["a"] * flops + fits["matched_step"]["b"] if device == "cpu" else h200_matched_step(flops)
    return steps * step + fits["matched_measure"]["a"] * float(n_subjects) ** 2 * d + fits["matched_measure"]["b"]


def matched_planned(mode: str, d_model: int, n_facts: int, n_subjects: int, at_model_width: bool = True,
                    n_seeds: int = 3, device: str = "cpu", cpu_scale: float = 1.0,
                    max_steps: int | None = None, past_fit: int | None = None, facts: str = "all",
                    recipe: str = "weight_decay") -> dict | None:
    """The plan of one mode's matched controls, as ``synthetic.matched.train_matched(planned={mode: ...})``
    takes it for its progress lines' time left: {"search": the threshold search's seconds, "curve": the seconds
    of the curve's widths as planned (from the measured d*), "width": :func:`matched_width_seconds` of this
    table and device as a function of d (the actual widths are known only after the search)}. None for a mode
    the plan has no measurements of. ``device``: "cpu" (fits times ``cpu_scale``: REFERENCE_RATE /
    :func:`measured_rate`) or "h200" (one H200, its host work at the fits' speed), as :func:`predict_on`;
    ``max_steps``, ``past_fit``: the run's rule (None: ``recipe``'s, ``synthetic.matched.recipe_rule``; the
    default recipe is the run's); ``facts``: which table ("all", "known": its d* and search)."""
    if mode not in MATCHED_D_STAR:
        return None
    max_steps, past_fit = recipe_rule(recipe, max_steps, past_fit)
    width = functools.partial(matched_width_seconds, mode=mode, d_model=d_model, n_facts=n_facts,
                              n_subjects=n_subjects, n_seeds=n_seeds, device=device, cpu_scale=cpu_scale,
                              max_steps=max_steps, past_fit=past_fit, facts=facts)
    return {"search": search_seconds(mode, facts) * (cpu_scale if device == "cpu" else 1.0),
            "curve": sum(width(d) for d, _ in matched_curve(mode, d_model, at_model_width, n_seeds, past_fit,
                                                            max_steps, facts)),
            "width": width}


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def duration(seconds: float) -> str:
    """Seconds as 12 s, 3.4 min, 5.6 h or 7.8 d."""
    for limit, unit, scale in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / scale:.0f} {unit}" if unit == "s" else f"{seconds / scale:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"


def format_plan(plans: dict | list[dict]) -> str:
    """A short table of one model's plans (one column pair per device: time, peak GiB), what it assumed, and
    how each column was predicted."""
    plans = [plans] if isinstance(plans, dict) else list(plans)
    first = plans[0]
    s, a = first["shape"], first["assumed"]
    rank = "exact" if first["jacobian_rank"] is None else f"rank {first['jacobian_rank']}"
    head = {"cpu": "this CPU", "h200": "one H200"}
    lines = [f"plan of llmprobe run: {first['model']} ({first['source']}; no weights read)",
             f"  {s['params'] / 1e9:.2f}B params, d_model {s['d']}, {s['layers']} layers, vocab {s['vocab']}; "
             f"{len(a['layers'])} layers probed, LRE layers {','.join(map(str, a['lre_layers'])) or 'none'}, "
             f"Jacobians {rank}",
             f"  {a['relations']} relations, {a['facts']} facts, {a['known']} known (SmolLM2-135M's measured counts: "
             f"a larger model knows more, costing more)",
             *([f"  protocol lre is priced as the default protocol: its {a['n_splits']} in-context known-fact trials "
                f"(each a pass over every fact, the examples run once), its longer prompts and its beta and edit-rank "
                f"sweeps are not, so expect more"] if a.get("protocol") == "lre" else []),
             f"{'stage':<18}" + "".join(f"{head[p['device']]:>22}" for p in plans)]
    rows = [(label, [p["stages"][stage] for p in plans]) for stage, label in stages().items()]
    rows.append(("run (wall)", [p["total"] for p in plans]))
    for label, cells in rows:
        lines.append(f"{label:<18}" + "".join(f"{duration(c['seconds']):>11}{gib(c['peak_bytes']):>7} GiB"
                                              for c in cells))
    lines.append(f"{'fits in memory':<18}" + "".join(
        f"{('yes' if p['total']['fits'] else 'NO') + ' (' + gib(p['total']['memory_bytes']) + ' GiB)':>22}"
        for p in plans))
    for p in plans:
        if p["device"] == "cpu":
            lines.append(f"  this CPU: docs/scaling.md's fits x {REFERENCE_RATE / p['rate']:.2f} (one-thread matmul "
                         f"{p['rate'] / 1e9:.0f} GFLOP/s here, {REFERENCE_RATE / 1e9:.0f} at the fit)")
        else:
            lines.append(f"  one H200: roofline ({H200['peak_flops'] / 1e12:.0f} TFLOP/s bf16 x "
                         f"{H200['efficiency']:.0%}, {H200['hbm_bytes_per_s'] / 1e12:.1f} TB/s), host work at the "
                         f"fit's speed; host peak "
                         f"{gib(p['total']['host_peak_bytes'])} GiB")
    cpu = [p["total"] for p in plans if p["device"] == "cpu"]
    lines.append("  wall = load + known facts and analyses each over their processes"
                 + (f" (this CPU: {cpu[0]['analyses_processes']} process(es) of {cpu[0]['analyses_threads']} thread(s), "
                    f"{thread_speedup(cpu[0]['analyses_threads']):.2f}x one thread)" if cpu else "") + ": known facts + max(analyses, the longer control mode "
                 "(one worker each), all of it over the cores)")
    if cpu:
        lines += busy_note()
    return "\n".join(lines)


def busy_note() -> list[str]:
    """A line when this CPU is busy now (load average over the last minute above half its cores): the plan
    assumes idle cores; [] when it is idle or the load cannot be read."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return []
    cores = len(os.sched_getaffinity(0))
    if load <= cores / 2:
        return []
    return [f"  this CPU is busy now: load {load:.1f} over the last minute on {cores} cores; the plan assumes idle "
            f"cores, so expect up to ~{1 + load / cores:.1f}x its times (other processes take their share, and the "
            "analyses wait longer for the cores the controls' workers hold)"]
