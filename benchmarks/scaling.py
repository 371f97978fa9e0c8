"""Benchmark: a measured cost model of ``llmprobe run``, and its prediction for larger models.

1. Measure: random-init Llama models (``transformers.LlamaConfig``, the embedded SmolLM2 tokenizer and its vocab)
   of several widths and depths, each in its own subprocess (peak RSS from ``resource.getrusage``, or
   ``torch.cuda.max_memory_allocated`` on CUDA). Each stage of the run is timed with the project's own functions
   on a small fixed workload: load (``load_model`` of a saved safetensors folder), known facts (``known_facts``),
   capture (``relation_states``), edits (``layer_sequences`` + resumed ``next_token_predictions``), Jacobians
   (``subject_jacobians``, exact up to d = 1024 at one layer, and low-rank ``rank=64`` at three layers at every
   width when the installed llmprobe has it), random-init control (``random_init``).
   Width-only CPU work is timed once per width: LRE fits (``SVD`` of W and of ``random_spectrum_like(W)``), ridge
   fits (``RidgeDecoder``), superposition readouts (``superposition_readout`` on the real 193 x 6 table) and the
   matched controls (``train_at`` steps, ``measure_control``).
2. Fit: per stage, seconds = a * FLOPs + b * calls (least squares; R^2 and the worst residual printed). FLOPs
   come from the config: 2 * (block parameters) per token per block forward, the same per token per block for
   one vector-Jacobian product (gradients reach the activations only), 2 * d * vocab per LM-head row; the CPU
   fits use their operation count (d^3 for an SVD, ...).
3. Predict: the workload of ``llmprobe run`` with its default settings (every bundled relation and fact, the
   SmolLM2 tokenizer's prompt lengths, layers every:3, ``AnalysisSettings`` defaults, splits from
   ``relation_split``; known-fact counts: SmolLM2's, measured) is counted in the same units and multiplied out for
   SmolLM2-135M (checked against its measured run), 0.5B, 1.5B, 8B and 70B shapes: on this machine (from the fit)
   and on one H200 (a roofline with stated assumptions), with the full and the low-rank Jacobians.

The cost model itself (shapes, the workload count, FLOPs, the prediction) is ``llmprobe.jobs.plan``'s, which
``llmprobe plan`` predicts with from its shipped fits; this script measures and fits (its fits printed here are
what ``llmprobe.jobs.plan.FITTED`` holds; the stages it does not measure, the mechanism analyses, take the shipped
fit, fitted on SmolLM2's run).

    python benchmarks/scaling.py --quick                 # smoke run (small models): 2-4 minutes
    python benchmarks/scaling.py --threads 1 --json F    # the full benchmark (13 minutes here, shared machine)
    python benchmarks/scaling.py --measured F            # refit and predict from F's measurements
    python benchmarks/scaling.py --device cuda           # on a GPU

docs/scaling.md has the measured tables, the predictions and every assumption.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the repository root first: a benchmark script must not shadow a package of the repository
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmprobe.analyses.passes import jacobian_prompts, padded_batches  # noqa: E402
from llmprobe.analyses.settings import AnalysisSettings  # noqa: E402

# the cost model (shapes, workload, FLOPs, prediction) is the package's: ``llmprobe plan`` predicts with it
from llmprobe.jobs.plan import (  # noqa: E402
    CPU_FITS,
    H200,
    auto_rank,
    cpu_model_cost,
    duration,
    gib,
    memory,
    predict_on,
    settings_workload,
)
from llmprobe.jobs.workload import (  # noqa: E402
    PREDICT_RANK,
    TARGETS,
    Shape,
    Work,
    forward_work,
    jacobian_work,
    known_batches,
    known_work,
)
from llmprobe.settings import Settings  # noqa: E402


# ------------------------------------------------------------------------------------------ benchmark shapes
def bench_shape(d: int, layers: int) -> Shape:
    """The benchmark's random-init models: head size 64, a quarter as many KV heads, MLP 8/3 d (64-aligned)."""
    heads = max(1, d // 64)
    return Shape(f"d{d}-L{layers}", d, layers, 64 * math.ceil(8 * d / 3 / 64), heads, max(1, heads // 4))



FULL_CONFIGS = [(256, 4), (256, 24), (512, 8), (1024, 4), (1024, 12), (2048, 4), (2048, 8)]
QUICK_CONFIGS = [(128, 2), (256, 2), (256, 6), (512, 2)]   # quick: also a 50-resample bootstrap in the CPU stages
MAX_CPU_WIDTH = 1024    # the width-only CPU stages are measured up to here (an SVD at 2048 alone takes minutes)


# ------------------------------------------------------------------------------------------------- fitting
def fit_linear(X: list[list[float]], y: list[float]) -> tuple[list[float], float, float]:
    """Least squares y ~ X @ coef (no intercept column added: put one in X). Returns (coef, R^2, max relative
    residual |y_hat - y| / y)."""
    import torch

    A = torch.tensor(X, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)
    if A.shape[0] < A.shape[1]:
        raise ValueError(f"{A.shape[0]} measurements cannot fit {A.shape[1]} coefficients")
    scale = A.abs().amax(0).clamp_min(1e-300)           # columns of very different size (FLOPs vs counts)
    coef = torch.linalg.lstsq(A / scale, b[:, None]).solution[:, 0] / scale
    pred = A @ coef
    ss_res = float(((b - pred) ** 2).sum())
    ss_tot = float(((b - b.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    worst = float(((pred - b).abs() / b.abs().clamp_min(1e-12)).max())
    return coef.tolist(), r2, worst


def fit_stage(rows: list[dict]) -> dict:
    """rows [{"seconds", "flops", "calls"}] -> {"a" (s/FLOP), "b" (s/call), "r2", "worst"}: seconds = a FLOPs +
    b calls, both non-negative (a negative b from noise is refitted as b = 0)."""
    X = [[r["flops"], r["calls"]] for r in rows]
    y = [r["seconds"] for r in rows]
    (a, b), r2, worst = fit_linear(X, y)
    if b < 0 or a < 0:
        (a,), r2, worst = fit_linear([[r["flops"]] for r in rows], y)
        b = 0.0
    return {"a": a, "b": b, "r2": r2, "worst": worst, "n": len(rows)}


# ---------------------------------------------------------------------------------------- measuring (child)
def peak_memory(device: str) -> int:
    """Peak bytes so far: CUDA memory allocated, or this process's peak RSS."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, device: str):
    """(result, seconds) of fn(): wall seconds on CUDA (synchronised); on the CPU this process's CPU seconds,
    which with one thread are the wall seconds of an idle core, and which other processes on a shared machine
    do not inflate (they still share caches and memory bandwidth)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


def tokenizer_folder() -> str:
    from llmprobe.model.loading import _embedded_safetensors

    return _embedded_safetensors()


def has_low_rank() -> bool:
    """Does the installed llmprobe's ``subject_jacobians`` take ``rank=``?"""
    from llmprobe.model.lre import subject_jacobians

    return "rank" in inspect.signature(subject_jacobians).parameters


def measure_config(d: int, layers: int, device: str, n_facts: int, n_jacobian: int) -> dict:
    """Every model-dependent stage on one random-init Llama model; a dict of stage -> {seconds, flops, calls,
    peak_bytes}."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llmprobe.datasets import Relation, load_relations
    from llmprobe.model.engine import layer_sequences, next_token_predictions, relation_states
    from llmprobe.model.known import known_facts
    from llmprobe.model.loading import load_model
    from llmprobe.model.lre import subject_jacobians
    from llmprobe.model.random_init import random_init

    shape = bench_shape(d, layers)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    config = LlamaConfig(vocab_size=len(tok), hidden_size=d, intermediate_size=shape.ff, num_hidden_layers=layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out: dict = {"d": d, "layers": layers, "params": shape.params, "stages": {}}
    stages = out["stages"]
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    with tempfile.TemporaryDirectory(prefix="llmprobe-scaling-") as folder:
        LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        weight_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                           if f.endswith(".safetensors"))
        lm, seconds = timed(lambda: load_model(folder, device=device, dtype=dtype), device)
    stages["load"] = {"seconds": seconds, "flops": float(weight_bytes), "calls": 1, "peak_bytes": peak_memory(device)}
    relation = load_relations(["country_capital"])[0]
    facts = relation.facts[:n_facts]
    template = relation.templates[0]
    subjects = [f.subject for f in facts]
    prompts = [template.replace("{}", s, 1) for s in subjects]

    def stage(name: str, fn, work: Work) -> None:
        if device.startswith("cuda"):
            fn()    # warm-up on the same work (kernels, allocator); the second call is timed
        _, seconds = timed(fn, device)
        stages[name] = {"seconds": seconds, "flops": work.flops, "calls": work.passes,
                        "peak_bytes": peak_memory(device)}

    small = Relation(relation.name, relation.templates, relation.neutral_templates, facts, relation.properties)
    stage("known_facts", lambda: known_facts(lm, small, batch_size=32),
          known_work(shape, known_batches(tok, prompts, [f.object for f in facts])))
    probe_layers = sorted(set(range(0, layers, 3)) | {layers - 1})
    stage("capture", lambda: relation_states(lm, template, subjects, probe_layers, batch_size=32),
          forward_work(shape, padded_batches(tok, prompts, 32), layers))
    mid = layers // 2
    delta = torch.randn(len(subjects), d) * 0.1
    edit = forward_work(shape, padded_batches(tok, prompts, 32), layers - 1 - mid, head=True)
    edit.flops += forward_work(shape, padded_batches(tok, prompts, 32), mid + 1).flops
    edit.passes *= 2
    stage("edits", lambda: next_token_predictions(lm, template, subjects, mid, delta, batch_size=32,
                                                  resume=layer_sequences(lm, template, subjects, mid, batch_size=32)),
          edit)
    # three blocks of backward at most per product (seconds, not minutes); exact: one layer; low-rank: three
    # layers, as the run's 3 LRE layers (its JVPs and VJPs per layer reach fewer blocks than the shared ones)
    jac_layers = {"jacobians": [max(0, layers - 3)], "jacobians_lowrank": sorted({max(0, layers - i) for i in (3, 2, 1)})}
    jac_subjects = subjects[:n_jacobian]
    jac_prompts = jacobian_prompts(tok, template, jac_subjects)
    for name, rank in (("jacobians", None), ("jacobians_lowrank", LOW_RANK)):
        if (rank is None and d > 1024) or (rank is not None and not has_low_rank()):
            continue
        kwargs = {} if rank is None else {"rank": rank}
        stage(name, lambda: subject_jacobians(lm, template, jac_subjects, jac_layers[name], batch_size=16,
                                              chunk=AnalysisSettings.jacobian_chunk,
                                              **kwargs),
              jacobian_work(shape, jac_prompts, jac_layers[name], rank))
    _, seconds = timed(lambda: random_init(lm, seed=1), device)
    stages["random_init"] = {"seconds": seconds, "flops": float(shape.params), "calls": 1,
                             "peak_bytes": peak_memory(device)}
    out["peak_bytes"] = peak_memory(device)
    out["weight_bytes"] = weight_bytes
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in lm.model.parameters())   # as loaded (bf16 on CUDA)
    return out


def measure_width(d: int, quick: bool = False) -> dict:
    """The CPU-side work that depends on the width only (it runs on the host CPU even with --device cuda)."""
    import torch
    from transformers import AutoTokenizer

    from llmprobe.analyses.decoders import SVD
    from llmprobe.analyses.settings import AnalysisSettings
    from llmprobe.analyses.superposition import superposition_table
    from llmprobe.datasets import load_relations
    from llmprobe.geometry import RidgeDecoder, random_spectrum_factors, random_spectrum_like, superposition_readout
    from llmprobe.model.lre import JacobianResult
    from synthetic.matched import measure_control, train_at
    from synthetic.sweep import SweepConfig
    from synthetic.tasks import from_fact_table
    from synthetic.train import TrainConfig

    cfg = AnalysisSettings()
    gen = torch.Generator().manual_seed(0)
    n_boot = 50 if quick else cfg.n_boot            # quick: a smoke run, not the run's bootstrap
    out: dict = {"d": d, "stages": {}}
    W = torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5

    def lre_fit():
        svd = SVD(W)
        rand = SVD(random_spectrum_like(svd.W, gen))
        return [s.pinv(r) for s in (svd, rand) for r in cfg.edit_ranks]
    _, seconds = timed(lre_fit, "cpu")
    out["stages"]["lre_fit"] = {"seconds": seconds, "flops": float(d) ** 3, "calls": 1}
    k = min(PREDICT_RANK + 10, d - 1)          # the same fit from a low-rank Jacobian's factors (3 prompts)
    jac = JacobianResult(H=torch.zeros(3, d), O=torch.zeros(3, d), U=torch.randn(3, d, k, generator=gen),
                         Vt=torch.randn(3, k, d, generator=gen) / d ** 0.5, rank=min(PREDICT_RANK, k))

    def lre_fit_lowrank():
        svd = SVD(*jac.svd())
        rand = SVD(*random_spectrum_factors(svd.S, svd.W.shape, gen))
        return [s.pinv(r) for s in (svd, rand) for r in cfg.edit_ranks]
    _, seconds = timed(lre_fit_lowrank, "cpu")
    out["stages"]["lre_fit_lowrank"] = {"seconds": seconds, "flops": float(d) ** 2 * jac.rank, "calls": 1}
    n_train = 45                                              # the largest relation's training subjects
    H, O = torch.randn(n_train, d, generator=gen), torch.randn(n_train, d, generator=gen)
    _, seconds = timed(lambda: [RidgeDecoder(alpha=a).fit(H.double(), O.double()) for a in cfg.ridge_alphas], "cpu")
    out["stages"]["ridge_fit"] = {"seconds": seconds / len(cfg.ridge_alphas), "flops": float(n_train) * d * d,
                                  "calls": 1}
    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    relations = load_relations(None)
    table = superposition_table(tok, relations, {}, cfg)
    n, R = table.A.shape
    Hs = torch.randn(n, d, generator=gen)
    U = [torch.randn(len(a), d, generator=gen) for a in table.attributes]
    _, seconds = timed(lambda: superposition_readout(Hs, table.A, U, nulls={"random_init": (Hs.flip(0), U)},
                                                     k=cfg.folds, seed=0, n_boot=n_boot, decode=False), "cpu")
    out["stages"]["readout"] = {"seconds": seconds, "flops": float(n) * n * d, "calls": 1}
    task = from_fact_table(table.fact_table())
    steps = 3
    sweep = SweepConfig(d_max=d, train=TrainConfig(max_steps=steps, progress=False, target_acc=2.0))
    (model, result), seconds = timed(lambda: train_at(task, "trainable", d, sweep, 0), "cpu")
    n_facts = int((task.table >= 0).sum())
    out["stages"]["matched_step"] = {"seconds": seconds / max(1, result["steps"]),
                                     "flops": 6.0 * result["n_params"] * n_facts, "calls": 1,
                                     "n_params": result["n_params"], "n_facts": n_facts}
    _, seconds = timed(lambda: measure_control(model, task, 0, 50 if quick else 500), "cpu")
    out["stages"]["matched_measure"] = {"seconds": seconds, "flops": float(n) * n * d, "calls": 1}
    return out


# ------------------------------------------------------------------------------------ measured on SmolLM2
# its measured run (report.json timings of the run of 2026-12-05 at 181-170 GFLOP/s one thread, 2 idle cores:
# the known facts over 2 processes, every analysis in one one-thread process, the controls in their worker)
SMOLLM2_RUN = {"load": 1.3, "known_facts": 35.9, "jacobians": 340.4, "decoders_other": 187.7, "superposition": 74.2,
               "crosspatch": 44.9, "selector": 17.1, "multihop": 57.6, "matched": 380.3, "wall": 766.5}
LOW_RANK = 64           # rank of the low-rank Jacobian estimate timed (k = 74 < d at every benchmark width)
# SmolLM2's measured low-rank speed-ups (CPU seconds, exact / rank K; `benchmarks/jacobian_rank.py --timing-only
# --measured 32,64,128 --timing-relations 2`: the first 9 subjects of the first 2 bundled relations, layers 6/15/24)
SMOLLM2_LOWRANK_SPEEDUP = {32: 3.50, 64: 1.84, 128: 0.98}


# ------------------------------------------------------------------------------------------------- driver
def run_child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child_width:
        result = measure_width(args.child_width, args.quick)
    else:
        d, layers = (int(x) for x in args.child.split(","))
        result = measure_config(d, layers, args.device, args.facts, args.jacobian_prompts)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(extra: list[str], args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads), "--device", args.device,
           "--facts", str(args.facts), "--jacobian-prompts", str(args.jacobian_prompts)] + extra
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"measurement {' '.join(extra)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and workload: a 1-2 minute smoke run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    parser.add_argument("--facts", type=int, default=None, help="prompts per stage (default 32; quick 8)")
    parser.add_argument("--jacobian-prompts", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the measurements and predictions here")
    parser.add_argument("--measured", default=None,
                        help="take the measurements from an earlier --json file instead of measuring (refit, predict)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-width", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.facts is None:
        args.facts = 8 if args.quick else 32
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
    if args.child or args.child_width:
        run_child(args)
        return {}
    return benchmark(args)


def benchmark(args) -> dict:
    import torch

    t0 = time.perf_counter()
    if args.measured:
        with open(args.measured, encoding="utf-8") as f:
            earlier = json.load(f)
        return fit_and_predict(earlier["measured"], earlier["widths"], args, t0)
    configs = QUICK_CONFIGS if args.quick else FULL_CONFIGS
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start")
    print(f"llmprobe cost model: {len(configs)} random-init Llama models on {args.device}, {args.threads} thread(s), "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}; {args.facts} prompts per stage, "
          f"{args.jacobian_prompts} Jacobian prompt(s)"
          + (f"; Jacobians exact (d <= 1024) and low-rank (rank {LOW_RANK})" if has_low_rank() else
             "; exact Jacobians (d <= 1024; this llmprobe has no low-rank ones)"), flush=True)
    measured = []
    for d, layers in configs:
        result = spawn(["--child", f"{d},{layers}"], args)
        measured.append(result)
        s = result["stages"]
        print(f"  d={d:5d} L={layers:3d} params {result['params'] / 1e6:7.1f}M "
              f"peak {result['peak_bytes'] / 2**30:5.2f} GiB: "
              + ", ".join(f"{k} {v['seconds']:.2f}s" for k, v in s.items()), flush=True)
    measured_widths = []
    for d in sorted({d for d, _ in configs if d <= MAX_CPU_WIDTH}):
        result = spawn(["--child-width", str(d)], args)
        measured_widths.append(result)
        print(f"  width {d:5d} (CPU): " + ", ".join(f"{k} {v['seconds']:.3f}s" for k, v in result["stages"].items()),
              flush=True)
    return fit_and_predict(measured, measured_widths, args, t0)


def fit_and_predict(measured: list[dict], measured_widths: list[dict], args, t0: float) -> dict:
    """Fit every stage, print the measured tables, predict the targets; returns everything as one dict."""
    from transformers import AutoTokenizer

    widths = [m["d"] for m in measured_widths]
    names = list(dict.fromkeys(n for m in measured for n in m["stages"]))
    fits = {name: fit_stage([m["stages"][name] for m in measured if name in m["stages"]]) for name in names}
    width_fits = {name: fit_stage([m["stages"][name] for m in measured_widths])
                  for name in measured_widths[0]["stages"]}
    width_fits["matched_params"] = fit_linear([[d * d, d, 1] for d in widths],
                                              [m["stages"]["matched_step"]["n_params"] for m in measured_widths])[0]
    print_measured(measured, measured_widths, fits, width_fits)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    predictions = {}
    for shape in TARGETS:
        work = settings_workload(Settings(), shape.layers)[0]      # the default run's, its controls included
        entry = {"params": shape.params, "lre_layers": work["lre_layers"]}
        entry["auto_rank"] = auto_rank(shape, work["lre_layers"])
        for rank, label in ((None, "full"), (entry["auto_rank"], "auto")):
            for where in ("cpu", "h200"):
                entry[f"{where}_{label}"] = predict_on(shape, work, {**CPU_FITS, **fits, **width_fits}, where, rank)
        entry["memory_cpu"] = memory(shape, work, 4)
        entry["memory_h200"] = memory(shape, work, H200["bytes_per_param"])
        predictions[shape.name] = entry
    print_predictions(predictions)
    lowrank = lowrank_check(tok, fits) if "jacobians_lowrank" in fits else {}
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")
    result = {"measured": measured, "widths": measured_widths, "fits": fits, "width_fits": width_fits,
              "predictions": predictions, "lowrank_check": lowrank, "device": args.device, "threads": args.threads, "h200": H200}
    if args.json:
        from llmprobe.io import write_json

        write_json(args.json, result)
    return result


def lowrank_check(tok, fits: dict) -> dict:
    """Out-of-sample check of the Jacobian fits: the predicted speed-up of rank-K over exact Jacobians on
    SmolLM2's shape and prompts (``SMOLLM2_LOWRANK_SPEEDUP``'s workload) against the measured one."""
    from llmprobe.datasets import load_relations

    shape = TARGETS[0]
    layers = [6, 15, 24]
    prompts = [jacobian_prompts(tok, rel.templates[0], [f.subject for f in rel.facts[:9]])
               for rel in load_relations(None)[:2]]
    cost = cpu_model_cost(fits)
    exact = sum(cost("jacobians", jacobian_work(shape, p, layers), shape) for p in prompts)
    out = {}
    for rank, measured in SMOLLM2_LOWRANK_SPEEDUP.items():
        low = sum(cost("jacobians_lowrank", jacobian_work(shape, p, layers, rank), shape) for p in prompts)
        out[rank] = {"measured": measured, "predicted": round(exact / low, 2)}
    print("\nlow-rank Jacobians on SmolLM2 (layers 6/15/24, 2 relations x 9 prompts), speed-up over exact, "
          "measured / predicted: " + ", ".join(f"K={k} {v['measured']:.2f}x / {v['predicted']:.2f}x"
                                                for k, v in out.items()))
    return out


def print_measured(measured: list[dict], widths: list[dict], fits: dict, width_fits: dict) -> None:
    """Measured seconds per stage and config (x: ratio to the first, smallest config, measured in this run), the
    width-only CPU stages, and each stage's fit."""
    names = list(dict.fromkeys(n for m in measured for n in m["stages"]))
    base = measured[0]["stages"]
    print("\nmeasured (seconds: CPU seconds of one thread, wall seconds on CUDA; in brackets the ratio to the first, "
          "smallest config measured in this run)")
    print(f"{'config':<14}{'params':>9}{'peak GiB':>9}{'model GiB':>10}" + "".join(f"{n:>20}" for n in names))
    def model_bytes(m: dict) -> int:
        return m.get("model_bytes", m["weight_bytes"])
    base_rss = measured[0]["peak_bytes"] - 2 * model_bytes(measured[0])
    for m in measured:
        cells = []
        for n in names:
            st = m["stages"].get(n)
            if st is None:
                cells.append(f"{'-':>20}")
            elif n in base:
                cells.append(f"{st['seconds']:>9.2f} (x{st['seconds'] / base[n]['seconds']:>6.1f}) ")
            else:
                cells.append(f"{st['seconds']:>19.2f} ")
        print(f"{'d' + str(m['d']) + ' L' + str(m['layers']):<14}{m['params'] / 1e6:>8.1f}M{gib(m['peak_bytes']):>9}"
              f"{gib(2 * model_bytes(m) + base_rss):>10}" + "".join(cells))
    print("(model GiB: the memory model, the weights twice (the model and its random-init twin) plus the first "
          "config's remainder (Python, torch, tokenizer))")
    print("\nwidth-only CPU work (seconds per unit)")
    print(f"{'d':>6}" + "".join(f"{n:>17}" for n in widths[0]["stages"]))
    for w in widths:
        print(f"{w['d']:>6}" + "".join(f"{st['seconds']:>17.4f}" for st in w["stages"].values()))
    print("\nfits: seconds = a * work + b * passes; 1/a = work per second (model stages: FLOP/s; load: bytes/s; "
          "random_init: parameters/s; CPU stages: the operation count of the table above)")
    print(f"{'stage':<16}{'1/a':>12}{'b (ms/pass)':>13}{'R^2':>8}{'worst residual':>16}{'n':>4}")
    for name, f in {**fits, **{k: v for k, v in width_fits.items() if isinstance(v, dict)}}.items():
        rate = f"{1 / f['a']:12.3g}" if f["a"] > 0 else f"{'-':>12}"
        print(f"{name:<16}{rate}{f['b'] * 1e3:>13.2f}{f['r2']:>8.3f}{f['worst']:>15.0%}{f['n']:>4}")


def print_predictions(predictions: dict) -> None:
    stages = ("load", "known_facts", "jacobians", "decoders_other", "superposition", "crosspatch", "selector",
              "multihop", "matched", "wall")
    for where in ("cpu", "h200"):
        title = ("this machine, one thread (the fit above)" if where == "cpu" else
                 f"one H200 (roofline: {H200['peak_flops'] / 1e12:.0f} TFLOP/s bf16 x {H200['efficiency']:.0%}, "
                 f"{H200['hbm_bytes_per_s'] / 1e12:.1f} TB/s, {H200['launch_s_per_block'] * 1e3:.1f} ms/block/pass; "
                 f"control steps at {H200['fp32_flops'] / 1e12:.0f} TFLOP/s fp32 x {H200['matched_efficiency']:.0%}; "
                 "CPU-side fits, control searches and measurements at this machine's one-thread speed)")
        for label in ("full", "auto"):
            print(f"\npredicted `llmprobe run`, {title}, "
                  + ("exact Jacobians" if label == "full" else
                     f"the default Jacobians (auto: low-rank K={PREDICT_RANK} where it costs less than exact)"))
            print(f"{'model':<22}{'params':>8}" + "".join(f"{s:>15}" for s in stages))
            for name, p in predictions.items():
                row = p[f"{where}_{label}"]
                print(f"{name:<22}{p['params'] / 1e9:>7.2f}B" + "".join(f"{duration(row[s]):>15}" for s in stages))
    smol = predictions.get("SmolLM2-135M")
    if smol:
        stages_s = ", ".join(f"{s} {SMOLLM2_RUN[s]:.0f} s / {smol['cpu_full'][s]:.0f} s" for s in stages)
        print(f"\ncheck on SmolLM2-135M, measured `llmprobe run` (2 idle cores) / predicted here (one thread): "
              f"{stages_s}")
    print("\npredicted peak memory (GiB): model device = model + its random-init twin; host = the twin's "
          "construction on the CPU (bf16 for the H200 run), one relation's Jacobians")
    print(f"{'model':<22}{'CPU fp32 device':>16}{'H200 bf16 device':>18}{'fits one H200':>15}{'host init':>11}"
          f"{'host Jacobians':>16}")
    for name, p in predictions.items():
        m, g = p["memory_cpu"], p["memory_h200"]
        fits_gpu = "yes" if g["device"] <= H200["hbm_bytes"] else ("weights only" if g["weights"] <= H200["hbm_bytes"]
                                                                   else "no")
        print(f"{name:<22}{gib(m['device']):>16}{gib(g['device']):>18}{fits_gpu:>15}{gib(g['host_init']):>11}"
              f"{gib(g['host_jacobians']):>16}")


if __name__ == "__main__":
    main()
