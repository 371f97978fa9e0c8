"""``llmprobe run``: the main job. Probe a pretrained model, train matched synthetic controls on the very facts it
knows, measure both with the same readout code, and write one report (JSON, HTML, Markdown, CSV).

Matched controls (``synthetic.controls``, imported here): the known-fact table of the probe (same subjects,
relations and attribute sets; general maps, not only bijections) trains the paper's one-layer model with trainable
and with frozen subject embeddings, as a curve over width: d* (the capacity sweep's bisection), 2 d*, 4 d*, ...
and the model's own d_model (only d* without ``at_model_width``). Each point is measured by
``llmprobe.geometry.superposition_readout`` on its subject embeddings, with the shuffled-table and random-init
controls, as the pretrained model's subject states are; ``report["controls"]`` is that block.
"""
from __future__ import annotations

import time
from pathlib import Path

from synthetic.controls import MODES, find_threshold, known_table, measure_control, train_controls  # noqa: F401

from .io import write_json
from .probe import library_versions, probe


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
