"""Matched synthetic controls, like for like: the paper's one-layer model trained on the *same* fact table that a
pretrained model's superposition fit uses (same subjects, relations and attribute sets), measured with the same
readout code, as a curve over width.

:func:`train_controls` (what ``llmprobe run`` calls in its worker process):

1. finds the threshold width d* for each mode (:func:`control_threshold`) by the capacity sweep's public
   bisection (:func:`synthetic.sweep.find_threshold`: d* is exact only when d*-1 failed with two initialisations);
2. trains the curve d*, 2 d*, 4 d*, ... up to ``d_model`` / 1.5, and ``d_model`` itself (the pretrained model's
   width);
3. measures every point as the pretrained subject states are measured: the superposition fit
   h_s ~ c + sum_r W_r u_{a_r(s)} (held-out R^2) and each relation's linear readout accuracy, through
   :func:`llmprobe.geometry.superposition_readout` on the subject embeddings e_s, with the shuffled-table and the
   random-init (:func:`llmprobe.model.random_init.random_init` at model seed + 1) controls, every number a typed
   :class:`llmprobe.metric.Metric`; and the MLP-as-selector measurements (:func:`synthetic.mechanisms.selector`).

Modes: ``trainable`` (every parameter learns) and ``frozen`` (subject embeddings frozen at random init, the
unembedding learns). ``frozen_all`` (subject embeddings and unembedding frozen) is a sweep mode, not trained here.

The returned block (``report["controls"]``)::

    {"compared_with": "<one sentence: what is compared with what>",
     "table": {"n_subjects", "relations", "n_facts", "bits"}, "d_model": 576, "seed": 0,
     "training": {TrainConfig fields that matter}, "wall_seconds": ...,
     "modes": {"trainable": {"threshold": {"d_star", "exact", "tried": [...], "search_seconds"},
                             "points": [{"d", "d_over_dstar", "d_mlp", "train": {"accuracy", "success", "steps",
                                         ...}, "r2": Metric, "readout": {relation: Metric},
                                         "readout_mean": Metric (pooled over relations), "selector": {...},
                                         "wall_seconds"}, ...]},
               "frozen": {...}}}
"""
from __future__ import annotations

import time

from llmprobe.datasets import Fact, FactTable, Relation
from llmprobe.geometry import superposition_readout
from llmprobe.metric import pooled_readout
from llmprobe.model.random_init import random_init
from llmprobe.names import CONTROL_MODES
from synthetic.mechanisms import readout_inputs
from synthetic.mechanisms import selector as measure_selector
from synthetic.sweep import SweepConfig, find_threshold, initial_guess, train_width
from synthetic.tasks import from_fact_table
from synthetic.train import TrainConfig

MODES = CONTROL_MODES
MAX_STEPS = 2000          # step cap of every control's training (the bisection's too)
N_BOOT = 500              # bootstrap resamples of the controls' R^2 intervals
PLACE = "subject embeddings e_s (blocks.0.resid_pre at the subject token)"


def known_table(report_relations: dict, known: dict, min_facts: int = 5) -> tuple[FactTable, list[str]]:
    """The fact table of known facts only, and the relations left out for having fewer than ``min_facts``.

    ``known`` maps relation name -> list of FactResult. Too few facts cannot be split into cross-fitting folds.
    """
    relations, dropped = [], []
    for name, results in known.items():
        facts = [Fact(r.subject, r.object) for r in results if r.known]
        if len(facts) < min_facts:
            dropped.append(f"{name} ({len(facts)} known)")
            continue
        meta = report_relations.get(name, {})
        relations.append(Relation(name, meta.get("templates") or ["{}"], meta.get("neutral_templates") or [],
                                  facts, meta.get("properties") or {}))
    if not relations:
        raise ValueError(f"no relation has {min_facts} or more known facts, so there is no table to train "
                         f"controls on (known: {', '.join(dropped) or 'none'})")
    return FactTable.from_relations(relations), dropped


def train_at(task, mode: str, d: int, cfg: SweepConfig, seed: int = 0, init: int = 0):
    """Train one control of width d (:func:`synthetic.sweep.train_width`, model seed ``seed + init *
    INIT_OFFSET``): (model, RunResult as a dict)."""
    if mode not in MODES:
        raise ValueError(f"unknown control mode {mode!r}; choose from {MODES}")
    result = train_width(task, mode, d, cfg, seed, init)
    return result.model, result.to_dict()


def control_threshold(task, mode: str, cfg: SweepConfig, seed: int = 0) -> dict:
    """Smallest d in [cfg.d_min, cfg.d_max] reaching 100% train accuracy on ``task``, by the sweep's public
    bisection (:func:`synthetic.sweep.find_threshold`), started from the table's bits per subject.

    Returns {"d_star", "exact", "tried": [{"d", "init", "success", "accuracy", "steps", "wall_time_s"}] (by d,
    then init), "models": {d: (model, result)}} (the successful, else the last, model of every width tried)."""
    models: dict[int, tuple] = {}
    rows = []

    def train_fn(d, init):
        model, result = train_at(task, mode, d, cfg, seed, init)
        rows.append({"d": d, "init": init, "success": bool(result["success"]), "accuracy": result["accuracy"],
                     "steps": result["steps"], "wall_time_s": result["wall_time_s"]})
        if d not in models or result["success"]:
            models[d] = (model, result)
        return bool(result["success"])

    start = initial_guess(task.n_subjects, task.n_relations, mode, task.bits() / max(1, task.n_subjects))
    found = find_threshold(train_fn, cfg.d_min, cfg.d_max, start)
    return {"d_star": found["d_star"], "exact": found["exact"],
            "tried": sorted(rows, key=lambda t: (t["d"], t["init"])), "models": models}


def curve_widths(d_star: int | None, d_model: int, at_model_width: bool = True) -> list[int]:
    """d*, 2 d*, 4 d*, ... up to d_model / 1.5, then ``d_model`` itself (only d_model when d* is None; without
    ``at_model_width`` only d*). A doubling within 1.5x of d_model is left out: it would cost as much as d_model
    (the widest trainings dominate the controls' time) and sit next to it on the log axis."""
    if d_star is None:
        return [d_model]
    if not at_model_width:
        return [d_star]
    widths, d = [], d_star
    while d < d_model and (d == d_star or 1.5 * d <= d_model):
        widths.append(d)
        d *= 2
    return widths + [d_model]


def _measure(report, key: str, relation: str | None = None) -> dict | None:
    """The real condition's metric with the other conditions as named controls (shuffled primary), JSON form."""
    m = report.measure(key, relation, primary="shuffled")
    return None if m is None else m.to_dict()


def measure_control(model, task, seed: int = 0, n_boot: int = N_BOOT, selector: bool = True) -> dict:
    """Superposition readouts of a trained control's subject embeddings (controls ``shuffled`` and
    ``random_init``), as the pretrained model's subject states are measured, and its MLP-as-selector numbers.

    Returns {"r2": Metric, "readout": {relation: Metric}, "selector": {...} (when asked), "wall_seconds"}."""
    t0 = time.perf_counter()
    H, A, U = readout_inputs(model, task)
    H_c, _, U_c = readout_inputs(random_init(model, model.config.seed + 1), task)
    rep = superposition_readout(H, A, U, controls={"random_init": (H_c, U_c)}, relation_names=task.relations,
                                n_boot=n_boot, seed=seed, decode=False)
    out = {"r2": _measure(rep, "r2"), "readout": {name: _measure(rep, "readout_acc", name)
                                                  for name in task.relations}}
    if selector:
        sel = measure_selector(model, task, seed=seed)
        keys = ("n_units", "n_alive", "units_per_relation", "relation_gating", "ablation", "random_ablation",
                "gate_transplant", "relation_patch", "base_accuracy", "ablation_drop", "random_ablation_drop")
        out["selector"] = {"relations": list(task.relations), **{k: sel[k] for k in keys}}
    out["wall_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def compared_with(table_info: dict, d_model: int, modes: dict) -> str:
    """The sentence that says exactly what the controls' numbers are compared with."""
    stars = ", ".join(f"{m} d* = {v['threshold']['d_star']}" for m, v in modes.items())
    return (f"Each control is the one-layer model trained to 100% train accuracy (or its {MAX_STEPS}-step cap) on "
            f"the same fact table as the pretrained superposition fit ({table_info['n_subjects']} subjects x "
            f"{len(table_info['relations'])} relations, {table_info['n_facts']} facts, the same attribute sets), "
            f"at widths d*, 2 d*, 4 d*, ... and the pretrained d_model = {d_model} ({stars}); its subject "
            f"embeddings e_s are measured with the same cross-fitted superposition fit (held-out R^2) and "
            f"per-relation linear readouts as the pretrained model's relation-free subject states, with the same "
            f"shuffled-table and random-init controls. Widths, training and subjects differ from the pretrained "
            f"model; the table, the measure and the controls do not.")


def train_controls(table: FactTable, d_model: int, seed: int = 0, at_model_width: bool = True,
                   max_steps: int = MAX_STEPS, d_max: int | None = None, n_boot: int = N_BOOT,
                   modes: tuple[str, ...] = MODES, progress=print, device: str = "cpu") -> dict:
    """Train and measure the matched controls on ``table`` (pass the very table of the pretrained superposition
    fit); returns the controls block of the module docstring. ``device``: where the controls train (a CUDA
    device pays at the pretrained model's width: d = 4096 with an MLP of 8d is ~2 TFLOP per full-batch step on a
    1158-fact table); they are measured on the CPU."""
    t0 = time.perf_counter()
    task = from_fact_table(table)
    cfg = SweepConfig(d_max=d_max or d_model, train=TrainConfig(max_steps=max_steps, progress=False, device=device))
    info = {"n_subjects": len(table.subjects), "relations": list(table.relations),
            "n_facts": int((task.table >= 0).sum()), "bits": round(task.bits(), 1)}
    block_modes = {}
    for mode in modes:
        start = time.perf_counter()
        found = control_threshold(task, mode, cfg, seed=seed)
        d_star = found["d_star"]
        search = {"d_star": d_star, "exact": found["exact"], "tried": found["tried"],
                  "search_seconds": round(time.perf_counter() - start, 1)}
        progress(f"matched control ({mode}): d* = {d_star} ({'exact' if found['exact'] else 'not confirmed'}) "
                 f"after trying {[(t['d'], t['init'], t['success']) for t in found['tried']]}")
        points = []
        for d in curve_widths(d_star, d_model, at_model_width):
            start = time.perf_counter()
            model, result = found["models"].get(d) or train_at(task, mode, d, cfg, seed)
            measured = measure_control(model.cpu(), task, seed, n_boot)
            points.append({"d": d, "d_over_dstar": round(d / d_star, 3) if d_star else None,
                           "d_mlp": result["d_mlp"],
                           "train": {k: result[k] for k in ("accuracy", "success", "steps", "wall_time_s",
                                                            "n_params", "n_trainable", "bits_per_param")},
                           "r2": measured["r2"], "readout": measured["readout"],
                           "readout_mean": pooled_readout(measured["readout"]), "selector": measured["selector"],
                           "wall_seconds": round(time.perf_counter() - start, 1)})
            progress(f"  {mode} d={d}: train acc {result['accuracy']:.3f}, R^2 {measured['r2']['value']:.3f}")
        block_modes[mode] = {"threshold": search, "points": points}
    return {"compared_with": compared_with(info, d_model, block_modes), "place": PLACE, "table": info,
            "d_model": d_model, "seed": seed,
            "training": {"max_steps": max_steps, "lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay,
                         "mlp_ratio": cfg.mlp_ratio, "attention": cfg.attention, "target_acc": cfg.train.target_acc,
                         "device": device},
            "modes": block_modes, "wall_seconds": round(time.perf_counter() - t0, 1)}


__all__ = ["MODES", "known_table", "train_at", "control_threshold", "curve_widths", "measure_control",
           "train_controls", "compared_with"]
