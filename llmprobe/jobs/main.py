"""``llmprobe run``: the main job. Probe a pretrained model, train matched synthetic controls on the table its
superposition fit measures, measure both with the same readout code, and write one report (JSON, HTML, Markdown,
CSV).

Matched controls (``synthetic.controls``, imported here): the superposition fit's fact table (same subjects,
relations and attribute sets, all facts; the known-fact table when the superposition analysis is not run;
general maps, not only bijections) trains the paper's one-layer model with trainable
and with frozen subject embeddings, as a curve over width: d* (the capacity sweep's bisection), 2 d*, 4 d*, ...
and the model's own d_model (only d* without ``at_model_width``). Each point is measured by
``llmprobe.geometry.superposition_readout`` on its subject embeddings, with the shuffled-table and random-init
controls, as the pretrained model's subject states are; ``report["controls"]`` is that block.
"""
from __future__ import annotations

import time
from pathlib import Path

from llmprobe.analyses.settings import settings_from
from llmprobe.analyses.superposition import superposition_table
from llmprobe.checks import UsageError
from llmprobe.io import write_json
from llmprobe.jobs.controls import ControlsWorker
from llmprobe.jobs.probe import _digest, library_versions, previous_report, probe
from llmprobe.report.render import with_controls, write_all
from synthetic.controls import known_table


def run(model=None, *, tokenizer=None, out: str | Path = "runs/main", relations: list[str] | None = None,
        layers: str = "every:3", analyses: tuple[str, ...] = ("lre", "ridge", "superposition"),
        device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None,
        max_memory: str | dict | list | None = None, offload_folder: str | Path | None = None,
        quantize: str | None = None, max_facts: int | None = None, seed: int = 0,
        controls: bool = True, at_model_width: bool = True, formats=("html", "md", "csv"), gguf_file=None,
        trust_remote_code: bool = False, allow_pickle: bool = False, batch_size: int = 32, max_prompt_tokens: int | None = None,
        resume: bool = False, analysis_options: dict | None = None, control_options: dict | None = None,
        lm=None) -> dict:
    """The main job; writes ``out/report.json`` (+ html/md/csv) and returns the report. ``model``/``tokenizer``:
    as in ``probe`` (a name or folder, or a model object; the controls' worker gets only the fact table).

    Like for like: the matched controls train on the fact table the pretrained superposition fit measures (the
    shared-subject relations, all their facts, the subjects locatable in the neutral templates:
    ``llmprobe.analyses.superposition_table``); without the superposition analysis, on the known-fact table.

    The matched controls need only the known facts, so they train in a worker process (one CPU thread) while
    this process runs the analyses, which leave part of the CPU idle; they train on the model's GPU when it has
    one (the widest control, at the model's own width, is a GPU-sized job for a 7B model). One thread sums floats
    in another order than two, so their numbers can differ slightly from ``train_controls`` called in a
    two-thread process (SmolLM2's frozen d* control: R^2 0.094 here, 0.103 there).

    ``batch_size`` is every batched stage's largest micro-batch (known facts and analyses); ``device_map``,
    ``max_memory``, ``offload_folder``, ``quantize`` place the model (``llmprobe.load_model``).
    Options are checked before the model loads (see ``probe``). On an interrupt (KeyboardInterrupt; the command
    line turns SIGTERM into one) the worker is stopped and report.json keeps the finished stages
    (``"partial": true``), the analyses' finished relations included (``analyses.partial``); ``resume`` takes
    finished stages (known facts, analyses, controls) and an interrupted analyses stage's finished relations from
    ``out`` when their key (model hash and settings) matches, and computes only the rest.

    ``control_options``: more arguments of ``train_controls`` (``max_steps``, ``d_max``, ``n_boot``, ``modes``);
    ``lm``: an already loaded model (``model`` is then only recorded).
    """
    start = time.perf_counter()
    unknown = sorted(set(formats) - {"html", "md", "json", "csv"})
    if unknown:
        raise UsageError(f"unknown report format(s) {unknown}; choose from html, md, json, csv")
    control_options = dict(control_options or {})
    bad = sorted(set(control_options) - {"max_steps", "d_max", "n_boot", "modes"})
    if bad:
        raise UsageError(f"unknown control settings {bad}; choose from max_steps, d_max, n_boot, modes")
    out = Path(out)
    previous = previous_report(out) if resume else {}
    pending: dict = {}

    def start_controls(partial: dict, known: dict, lm, relations: list) -> None:
        pending["report"] = partial
        like_for_like = "superposition" in analyses
        key = _digest(partial["stages"]["known_facts"]["key"], "controls", at_model_width, seed, like_for_like,
                      sorted((analysis_options or {}).items()),
                      *([sorted(control_options.items())] if control_options else []))
        stage = partial["stages"]["controls"] = {"key": key, "done": False, "resumed": False}
        try:
            table, dropped = _control_table(lm, relations, known, partial, like_for_like, analysis_options)
        except ValueError as error:
            partial["errors"].append(f"matched controls: {error}")
            stage["done"] = True          # nothing to train
            return
        if dropped:
            partial["errors"].append(f"matched controls: left out for too few known facts: {', '.join(dropped)}")
        before = (previous.get("stages") or {}).get("controls") or {}
        if before.get("key") == key and before.get("done") and isinstance(previous.get("controls"), dict):
            partial["controls"] = previous["controls"]
            if "controls_s" in (previous.get("timings") or {}):
                partial["timings"]["controls_s"] = previous["timings"]["controls_s"]
            stage.update(done=True, resumed=True)
            return
        pending["worker"] = ControlsWorker(
            (table, partial["model"]["d_model"]),
            {"seed": seed, "at_model_width": at_model_width, "progress": _controls_progress,
             "device": str(lm.device) if lm.device.type == "cuda" else "cpu", **control_options})

    try:
        report = probe(model, tokenizer=tokenizer, gguf_file=gguf_file, relations=relations, layers=layers,
                       analyses=analyses, device=device, dtype=dtype, device_map=device_map, max_memory=max_memory,
                       offload_folder=offload_folder, quantize=quantize, max_facts=max_facts, seed=seed, out=out,
                       trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                       on_known=start_controls if controls else None,
                       batch_size=batch_size, max_prompt_tokens=max_prompt_tokens, resume=resume,
                       analysis_options=analysis_options, lm=lm,
                       controls_settings={"enabled": controls, "at_model_width": at_model_width, **control_options})
        if controls and "worker" in pending:
            t = time.perf_counter()
            try:
                report["controls"], report["timings"]["controls_s"] = pending["worker"].get()
                report["stages"]["controls"]["done"] = True
            except Exception as error:  # noqa: BLE001 - the probe's numbers are kept and exported
                report["errors"].append(f"matched controls failed: {type(error).__name__}: {error}")
            report["timings"]["controls_wait_s"] = round(time.perf_counter() - t, 1)
            write_json(out / "report.json", report)  # checkpoint: the probe's numbers are safe before export
    except KeyboardInterrupt:
        _save_interrupted(out, pending)
        raise
    finally:
        if "worker" in pending:         # an interrupted run does not wait for the controls
            pending["worker"].stop()
    report["versions"] = library_versions()
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    write_json(out / "report.json", report)
    write_all(with_controls([report]), out, f"llmprobe: {report['model']['name']} and its matched synthetic controls",
              formats)
    return report


def _control_table(lm, relations: list, known: dict, partial: dict, like_for_like: bool,
                   analysis_options: dict | None):
    """(FactTable, relations left out) the matched controls train on: the superposition fit's table when
    ``like_for_like`` (nothing left out), else the known-fact table."""
    if like_for_like:
        table = superposition_table(lm.tokenizer, relations, known, settings_from(**(analysis_options or {})))
        return table.fact_table(), []
    return known_table(partial["relations"], known)


def _save_interrupted(out: Path, pending: dict) -> None:
    """After an interrupt: report.json with every finished stage (controls too, if the worker had finished them),
    marked ``"partial": true`` while a stage is unfinished."""
    report = pending.get("report")
    if report is None:                  # interrupted before the known facts: probe wrote nothing to keep
        return
    stage, worker = report["stages"].get("controls"), pending.get("worker")
    if stage and not stage["done"] and worker is not None and worker.ready():
        try:
            report["controls"], report["timings"]["controls_s"] = worker.get()
            stage["done"] = True
        except RuntimeError:            # the worker failed: the stage stays unfinished
            pass
    unfinished = [name for name, s in report["stages"].items() if not s["done"]]
    report["partial"] = bool(unfinished)
    report["errors"] = [e for e in report["errors"] if not e.startswith("interrupted during")]
    if unfinished:
        report["errors"].append(f"interrupted during {', '.join(unfinished)}: finished stages are kept in this "
                                f"report; rerun with --resume to finish the rest")
    write_json(out / "report.json", report)


def _controls_progress(message: str) -> None:
    print(f"[controls] {message}", flush=True)


__all__ = ["run"]
