"""``llmprobe run``: the main job. Probe a pretrained model, train matched synthetic controls on the very facts it
knows, measure both with the same readout code, and write one report (JSON, HTML, Markdown, CSV).

Matched controls: the known-fact table of the probe (same subjects, relations and attribute sets; general maps,
not only bijections) trains the paper's one-layer model with trainable and with frozen subject embeddings. The
width d is found by the capacity-sweep bisection (``synthetic.sweep``): the smallest d reaching 100% train
accuracy, i.e. just above threshold; with ``at_model_width`` a second pair is trained at the model's own d_model.
Each control is measured by ``llmprobe.geometry.superposition_readout`` on its subject embeddings (via
``synthetic.mechanisms.superposition``), with the shuffled-table and random-init controls, exactly as the
pretrained model's subject states are.
"""
from __future__ import annotations

import time
from pathlib import Path

from .datasets import Fact, FactTable, Relation
from .io import write_json
from .probe import REPORT_SCHEMA_VERSION, library_versions, probe

MODES = ("trainable", "frozen")


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


def _metric(conditions: dict, key: str, relation: str | None = None) -> dict:
    """A geometry ``SuperpositionReport`` condition entry -> {"value", "ci", "control", "controls"}."""
    def pick(condition):
        entry = conditions.get(condition, {}).get(key)
        if relation is not None and entry is not None:
            entry = entry.get(relation)
        return entry

    real = pick("real") or {}
    controls = {name: e for name in conditions if name != "real" for e in [pick(name)] if e}
    out = dict(real)
    if controls:
        primary = "shuffled" if "shuffled" in controls else next(iter(controls))
        out["control"] = {"name": primary, **controls[primary]}
        out["controls"] = controls
    return out


def measure_control(model, task, seed: int = 0, n_boot: int = 500) -> dict:
    """Superposition readouts of a trained synthetic model, in the pretrained report's layout (layer 0 = e_s),
    and its MLP-as-selector measurements (``synthetic.mechanisms.selector``: ablation matrices, gate transplant)."""
    from synthetic.mechanisms import selector, superposition, untrained_like

    result = superposition(model, task, controls={"random_init": untrained_like(model)}, n_boot=n_boot, seed=seed,
                           swap_edit=False)
    conditions = result["report"]["conditions"]
    readout = {name: _metric(conditions, "readout_acc", name) for name in task.relations}
    layer = {"r2": _metric(conditions, "r2"), "readout": readout}
    sel = selector(model, task, seed=seed)
    keys = ("n_units", "n_alive", "units_per_relation", "relation_gating", "ablation", "random_ablation",
            "gate_transplant", "relation_patch")
    mlp = {k: sel[k] for k in keys}
    mlp.update({"relations": list(task.relations), "base_accuracy": sel["base_accuracy"],
                "ablation_drop": sel["ablation_drop"], "random_ablation_drop": sel["random_ablation_drop"]})
    return {"superposition": {"place": "subject embeddings e_s (blocks.0.resid_pre at the subject token)",
                              "layers": {"0": layer}},
            "selector": mlp, "wall_seconds": round((result.get("wall_s") or 0) + sel["wall_s"], 2)}


def train_controls(table: FactTable, d_model: int, seed: int = 0, at_model_width: bool = True,
                   max_steps: int = 2000, d_max: int | None = None, progress=print) -> list[dict]:
    """Train and measure matched controls; returns one synthetic report per trained control."""
    from synthetic.sweep import SweepConfig
    from synthetic.tasks import from_fact_table
    from synthetic.train import TrainConfig

    task = from_fact_table(table)
    cfg = SweepConfig(d_max=d_max or d_model, train=TrainConfig(max_steps=max_steps, progress=False))
    controls = []
    for mode in MODES:
        start = time.perf_counter()
        found = find_threshold(task, mode, cfg, seed=seed)
        search_seconds = round(time.perf_counter() - start, 1)
        progress(f"matched control ({mode}): d* = {found['d_star']} after trying "
                 f"{[(t['d'], t['success']) for t in found['tried']]}")
        widths = [found["d_star"] or cfg.d_max]
        if at_model_width and d_model not in widths:
            widths.append(d_model)
        for d in widths:
            start = time.perf_counter()
            model, result = found["models"].get(d) or _train_at(task, mode, d, cfg, seed)
            label = f"synthetic {mode} d={d}" + (" (d*)" if d == found["d_star"] else "")
            report = {
                "schema_version": REPORT_SCHEMA_VERSION, "kind": "synthetic", "label": label,
                "model": {"name": label, "architecture": "FactRecallModel (one layer)", "n_layers": 1,
                          "d_model": d, "d_mlp": result["d_mlp"], "frozen_subjects": mode == "frozen"},
                "matched_to": {"n_subjects": len(table.subjects), "relations": table.relations,
                               "n_facts": int((table.table >= 0).sum())},
                "threshold": {"d_star": found["d_star"], "tried": found["tried"], "search_seconds": search_seconds},
                "train": {k: result[k] for k in ("accuracy", "success", "steps", "wall_time_s", "n_params",
                                                  "n_trainable", "bits", "bits_per_param")},
                "analyses": measure_control(model, task, seed),
            }
            # this control's own time: training (unless the search trained it) and measuring
            report["wall_seconds"] = round(time.perf_counter() - start, 1)
            controls.append(report)
            progress(f"  {label}: train acc {result['accuracy']:.3f}, "
                     f"R^2 {report['analyses']['superposition']['layers']['0']['r2']['value']:.3f}")
    return controls


def _train_at(task, mode: str, d: int, cfg, seed: int):
    """Train one control of width d: (model, RunResult as a dict)."""
    from synthetic.train import train

    d_mlp = cfg.d_mlp or max(1, int(round(cfg.mlp_ratio * d)))
    result = train(task, d, config=cfg.train, frozen_subjects=mode == "frozen", d_mlp=d_mlp,
                   attention=cfg.attention, seed=seed)
    return result.model, result.to_dict()


def find_threshold(task, mode: str, cfg, seed: int = 0) -> dict:
    """Smallest d reaching 100% train accuracy on ``task`` by the capacity sweep's bisection, started from the
    table's bits per subject (``synthetic.sweep.initial_guess``).

    Returns {"d_star", "tried": [{"d", "success", "accuracy", "steps", "wall_time_s"}] (by d),
    "models": {d: (model, result)}} (every trained model kept).
    """
    from synthetic.sweep import _Cell

    cell = _Cell(task.n_subjects, task.n_relations, seed, mode, cfg,
                 bits_per_subject=task.bits() / max(1, task.n_subjects))
    models = {}
    while (d := cell.next_d()) is not None:
        models[d] = _train_at(task, mode, d, cfg, seed)
        cell.record(d, bool(models[d][1]["success"]))
    tried = [{"d": d, "success": bool(r["success"]), "accuracy": r["accuracy"], "steps": r["steps"],
              "wall_time_s": r["wall_time_s"]} for d, (_, r) in sorted(models.items())]
    return {"d_star": cell.d_star(), "tried": tried, "models": models}


def run(model: str | None = None, *, out: str | Path = "runs/main", relations: list[str] | None = None,
        layers: str = "every:3", analyses: tuple[str, ...] = ("lre", "ridge", "superposition"),
        device: str = "auto", dtype: str = "auto", max_facts: int | None = None, seed: int = 0,
        controls: bool = True, at_model_width: bool = True, formats=("html", "md", "csv"), gguf_file=None,
        trust_remote_code: bool = False) -> dict:
    """The main job; writes ``out/report.json`` (+ html/md/csv) and returns the report.

    The matched controls need only the known facts, so they train in a worker process (one CPU thread) while
    this process runs the analyses, which leave part of the CPU idle. One thread sums floats in another order
    than two, so their numbers can differ slightly from ``train_controls`` called in a two-thread process
    (SmolLM2's frozen d* control: R^2 0.094 here, 0.103 there).
    """
    from .report import with_controls, write_all

    start = time.perf_counter()
    out = Path(out)
    pending: dict = {}

    def start_controls(partial: dict, known: dict) -> None:
        try:
            table, dropped = known_table(partial["relations"], known)
        except ValueError as error:
            pending["error"] = f"matched controls: {error}"
            return
        if dropped:
            pending["dropped"] = f"matched controls: left out for too few known facts: {', '.join(dropped)}"
        pending["pool"] = _worker_pool()
        pending["result"] = pending["pool"].apply_async(
            _timed_controls, (table, partial["model"]["d_model"]),
            {"seed": seed, "at_model_width": at_model_width, "progress": _controls_progress})

    try:
        report = probe(model, gguf_file=gguf_file, relations=relations, layers=layers, analyses=analyses,
                       device=device, dtype=dtype, max_facts=max_facts, seed=seed, out=out,
                       trust_remote_code=trust_remote_code, on_known=start_controls if controls else None)
        if controls:
            t = time.perf_counter()
            report["errors"] += [pending[k] for k in ("dropped", "error") if k in pending]
            if "result" in pending:
                try:
                    report["controls"], report["timings"]["controls_s"] = pending["result"].get()
                except Exception as error:  # noqa: BLE001 - the probe's numbers are kept and exported
                    report["errors"].append(f"matched controls failed: {type(error).__name__}: {error}")
                report["timings"]["controls_wait_s"] = round(time.perf_counter() - t, 1)
            write_json(out / "report.json", report)  # checkpoint: the probe's numbers are safe before export
    finally:
        if "pool" in pending:           # an interrupted run does not wait for the controls
            pending["pool"].terminate()
            pending["pool"].join()
    report["versions"] = library_versions()
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    write_json(out / "report.json", report)
    write_all(with_controls([report]), out, f"llmprobe: {report['model']['name']} and its matched synthetic controls",
              formats)
    return report


def _timed_controls(*args, **kwargs) -> tuple[list[dict], float]:
    """``train_controls`` and its own wall seconds (run in the worker process)."""
    start = time.perf_counter()
    return train_controls(*args, **kwargs), round(time.perf_counter() - start, 1)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _worker_pool():
    """One spawned worker process with one torch thread (spawn: safe with torch and any device)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(1, initializer=_one_thread)


def _controls_progress(message: str) -> None:
    print(f"[controls] {message}", flush=True)


__all__ = ["run", "train_controls", "measure_control", "known_table", "find_threshold"]
