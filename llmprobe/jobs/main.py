"""``llmprobe run``: the main job. Probe a pretrained model, train matched synthetic controls on the table its
superposition fit measures, measure both with the same readout code, and write one report (JSON, HTML, Markdown,
CSV).

Matched controls (``synthetic.matched``, imported here): the superposition fit's fact table restricted to the facts
the model knows (same subjects, relations and attribute sets; ``matched.facts``; the known-fact table when the
superposition analysis is not run; general maps, not only bijections) trains the paper's one-layer model with the
``matched.recipe`` (weight_decay: its whole 1000-step schedule) with trainable and with frozen subject embeddings
(and, with ``matched.all_facts``, the same on every fact of that table, shown apart), as a curve over width: d* (the capacity sweep's bisection), 2 d*, 4 d*, ...
and the model's own d_model (only d* without ``at_model_width``). Each point is measured by
``llmprobe.geometry.superposition_readout`` on its subject embeddings, with the shuffled-table and random-init
controls, as the pretrained model's subject states are; ``report["matched"]`` is that block.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import torch

from llmprobe.analyses.settings import settings_from
from llmprobe.analyses.superposition import superposition_table
from llmprobe.checks import report_formats
from llmprobe.io import json_digest
from llmprobe.jobs.matched import CoreGate, MatchedWorker, WorkerInterrupted
from llmprobe.jobs.plan import REFERENCE_RATE, analyses_budget, matched_planned, matmul_rate, measured_rate
from llmprobe.jobs.probe import (
    ProbeJob,
    ProbeReport,
    job_settings,
    library_versions,
    say,
    shown,
)
from llmprobe.jobs.stages import checkpoint, earlier_stage, mark_interrupted, start_stage, unfinished
from llmprobe.names import EXPORTS, REPORT_FILES
from llmprobe.report.claims import claims_block
from llmprobe.report.render import with_matched, write_all
from llmprobe.settings import TABLES, TRAINING, Settings
from synthetic.matched import known_table, merge_matched

CHECKPOINTS = "matched"     # in a run's folder: the matched controls' finished units (synthetic.matched.Units)


def run(model=None, *, settings: Settings | None = None, out: str | Path = "runs/main", tokenizer=None, lm=None,
        formats=EXPORTS, trust_remote_code: bool = False, allow_pickle: bool = False,
        resume: bool = False, overwrite: bool = False, progress: bool | None = None, verbose: bool | None = None,
        **options) -> ProbeReport:
    """The main job; writes ``out/report.json`` and ``formats`` beside it (as in ``probe``: default html, md and
    csv; ``()`` none) and returns the report (a plain dict: ``llmprobe.jobs.probe.ProbeReport`` lists its keys, and
    ``matched`` the controls). ``model``/``tokenizer``/``lm``, ``progress``, ``verbose`` and ``assume_known``: as
    in ``probe`` (a name or folder, or a model object; the controls' worker gets only the fact table).
    ``options``: those of ``probe`` (every run setting by its name, ``analysis_options``), ``controls`` and
    ``at_model_width`` (``controls.enabled``, ``controls.at_model_width``) and ``control_options`` (more
    settings of the controls: ``max_steps``, ``d_max``, ``n_boot``, ``modes``), over ``settings``.

    Like for like: the matched controls train on the fact table the pretrained superposition fit measures (the
    shared-subject relations, the subjects locatable in the neutral templates:
    ``llmprobe.analyses.superposition_table``), on the facts of it the model knows (``matched.facts``; every fact
    for the all-facts control, ``matched.all_facts``); without the superposition analysis, on the known-fact table.

    The matched controls need only the known facts, so they train beside the analyses: one worker process per
    control mode (trainable, frozen), each on one CPU thread, so the critical path is the longer mode, not both
    in a row (SmolLM2: trainable 822 s, frozen 575 s of one thread). Their threads come out of this process's
    budget: the analyses run on max(1, torch threads - workers) threads (``timings.analyses_threads``; on 2 cores
    1 thread: a second thread there makes the decoders 1.3x faster alone but costs 13% more CPU, which the
    workers need), in as many processes of that many threads as the threads hold
    (``timings.analyses_processes``: the main one and helpers that load the same model,
    ``llmprobe.jobs.helpers``). On the CPU the workers go first: an analysis part starts only on the cores the
    alive workers leave (``llmprobe.jobs.matched.CoreGate``; on 2 cores none until a worker finishes), since
    four one-thread processes on two cores made each SmolLM2 pass 9% slower than two did; each core a finished
    worker frees goes to the analyses' parts (``analyses.timing.core_wait_seconds``: how long they waited). The
    thread count, and so every number, does not depend on when the workers finish. They train on the model's
    GPU when it has one (the widest control, at the model's own width, is a GPU-sized job for a 7B model). Their
    numbers are those of ``train_matched`` called anywhere (it fixes one thread itself), mode by mode: nothing is
    shared between the modes but the table (``synthetic.matched.merge_matched``). Their ``[matched]`` lines say
    each mode's time left, from the plan (:func:`planned_matched`): the plan's seconds until a width is trained
    ("(planned)"), then the plan's seconds of the widths left times measured / planned.

    ``run.batch_size`` is every batched stage's largest micro-batch (known facts and analyses); ``device_map``,
    ``max_memory``, ``offload_folder``, ``quantize`` place the model (``llmprobe.load_model``).
    Settings are checked before the model loads (see ``probe``). On an interrupt (KeyboardInterrupt; the command
    line turns SIGTERM into one) the worker is stopped and report.json keeps the finished stages
    (``"partial": true``), the analyses' finished relations included (``analyses.partial``); ``resume`` takes
    finished stages (known facts, analyses, controls) and an interrupted analyses stage's finished relations from
    ``out`` when their key (model hash and settings) matches, and computes only the rest. A controls stage that
    fails (a worker died; the others are then stopped at once) leaves the report partial (``"partial": true``;
    ``--resume`` trains them). The folder, decoders and ``overwrite``: as in ``probe``; ``report["claims"]`` is
    the summary's claims and verdicts, the controls merged.
    """
    formats = report_formats(formats)
    with shown(progress, verbose):
        return _run(model, settings, out, tokenizer, lm, formats, trust_remote_code, allow_pickle, resume, overwrite,
                    options)


def _run(model, settings, out, tokenizer, lm, formats, trust_remote_code, allow_pickle, resume, overwrite,
         options) -> ProbeReport:
    """``run``'s work, its arguments checked, under its output switch."""
    start = time.perf_counter()
    job = ProbeJob("run", job_settings("run", model, settings, options), Path(out), resume, overwrite,
                   tuple(REPORT_FILES[f] for f in formats))
    job.load(model, tokenizer, lm, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    on_cpu = job.lm.device.type == "cpu"
    rate_start = measured_rate() if on_cpu else None    # the plan's measurement when the command line printed it
    controls = MatchedStage(job.settings, job.previous) if job.settings.matched.enabled else None
    job.ahead = controls.budget(job.lm) if controls else None
    try:
        report = job.run(on_known=partial(start_controls, controls, job) if controls else None)
        if controls:
            controls.finish(report, job.out)
    except KeyboardInterrupt:
        if controls and controls.started:
            controls.collect_finished(job.report)
            mark_interrupted(job.report)
            checkpoint(job.out, job.report)
        raise
    finally:
        if controls:                    # an interrupted run does not wait for the controls
            controls.stop()
    report["versions"] = library_versions()
    if on_cpu:          # the host's speed at both ends of the run: a floor is read against the run's own rate
        report["timings"]["matmul_gflops_one_thread"] = [
            round(rate / 1e9, 1) for rate in (rate_start, matmul_rate(1, 1.0, time.thread_time))]
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    report["partial"] = bool(unfinished(report))            # the controls failed: --resume trains them
    report["claims"] = claims_block(report)
    checkpoint(job.out, report)
    write_all(with_matched([report]), job.out,
              f"llmprobe: {report['model']['name']} and its matched synthetic controls", formats)
    return report


def start_controls(controls: MatchedStage, job: ProbeJob, report: dict, known: dict, lm, relations: list) -> None:
    """``run``'s ``on_known``: start the controls' stage and share the cores its workers leave with the analyses."""
    controls.start(report, known, lm, relations, job.out, job.resume)
    job.gate = controls.gate


class MatchedStage:
    """The controls stage of ``run``: started once the known facts are in (``start``, probe's ``on_known``),
    trained by a :class:`MatchedWorker` while the analyses run, collected by ``finish`` (or, after an interrupt,
    by ``collect_finished`` if the worker is done), taken over instead from the previous report when its stage
    key matches. Each unit a worker finishes (a training of the threshold search, a width of the curve) is written
    at once to ``OUT/matched/<mode>/`` (``synthetic.matched.Units``); with ``--resume`` the units of the same key
    are read back from there instead of trained again, so an interrupted stage goes on where it stopped.

    A worker stopped by SIGTERM (``timeout`` signals a whole process group), or by the run's own interrupt, was
    interrupted, not failed: its line says so and that ``--resume`` goes on from its finished units; the report is
    partial."""

    def __init__(self, settings: Settings, previous: dict):
        self.settings, self.previous = settings, previous
        self.started = False
        self.workers: list[MatchedWorker] = []      # one per control mode, each on one thread
        self.modes: tuple[str, ...] = ()              # the mode of each worker
        self.folder: Path | None = None               # where the workers write their finished units
        self.said: set[str] = set()                   # the modes whose interruption was said
        self.threads_before: int | None = None       # this process's torch threads before the workers took theirs
        self.gate: CoreGate | None = None             # the cores shared with the analyses, when workers use the CPU
        self.failed: MatchedWorker | None = None      # the first worker that failed (the others were then stopped)
        self.stopping = False                         # stop() is stopping the workers: that is no failure
        self.lock = threading.Lock()

    def budget(self, lm) -> tuple[int, int] | None:
        """(threads, processes) of the analyses once the workers train beside them (``analyses_budget``), for the
        known facts to be shared the same way before; None on a GPU (the workers do not take CPU threads)."""
        if lm.device.type == "cuda":
            return None
        return analyses_budget(torch.get_num_threads(), len(self.settings.matched_arguments()["modes"]))

    def start(self, report: dict, known: dict, lm, relations: list, out: Path | None = None,
              resume: bool = False) -> None:
        """Key the stage; record why nothing is trained, take the previous controls over, or start the workers
        (writing their finished units into ``out/matched``, reading those of the same key back with ``resume``)."""
        self.started = True
        settings = self.settings
        like_for_like = "superposition" in settings.analyses("run")
        training = {k: v for k, v in settings.changed("matched").items() if k in TRAINING + TABLES}
        key = json_digest(report["stages"]["known_facts"]["key"], "controls 4", settings.matched.at_model_width,
                        settings.run.seed, like_for_like, sorted(settings.changed("analysis").items()),
                        *([sorted(training.items())] if training else []))
        stage = start_stage(report, "matched", key)
        try:
            table, dropped = matched_table(lm, relations, known, report, like_for_like,
                                           settings.changed("analysis"), settings.matched.facts)
            apart = all_facts_control(lm, relations, known, report, like_for_like, settings)
        except ValueError as error:
            report["errors"].append(f"matched controls: {error}")
            stage["done"] = True          # nothing to train
            return
        if dropped:
            report["errors"].append(f"matched controls: left out for too few known facts: {', '.join(dropped)}")
        before = earlier_stage(self.previous, "matched", key)
        if before is not None and before.get("done") and isinstance(self.previous.get("matched"), dict):
            report["matched"] = self.previous["matched"]
            if "matched_s" in (self.previous.get("timings") or {}):
                report["timings"]["matched_s"] = self.previous["timings"]["matched_s"]
            stage.update(done=True, resumed=True)
            return
        self.folder = None if out is None else out / CHECKPOINTS
        arguments = {**settings.matched_arguments(), "device": str(lm.device) if lm.device.type == "cuda" else "cpu",
                     "checkpoints": self.folder, "resume": resume, "facts": table_facts(settings, like_for_like),
                     "all_facts": apart}
        modes = tuple(arguments.pop("modes"))
        say(f"matched controls: {len(table.subjects)} subjects x {len(table.relations)} relations, "
            f"{int((table.table >= 0).sum())} facts ({arguments['facts'] or 'known'} facts, recipe "
            f"{arguments['recipe']})" + (f", and the all-facts control shown apart ({len(apart['table'].subjects)} "
                                          f"subjects, recipe {apart['recipe']}, {apart['n_seeds']} seed"
                                          f"{'s' if apart['n_seeds'] != 1 else ''})" if apart else "") + ", trained in "
            f"{len(modes)} worker process{'es' if len(modes) > 1 else ''} ({', '.join(modes)}) beside "
            f"the analyses ([matched] lines)")
        planned = planned_matched(table, report["model"]["d_model"], modes, arguments)
        self.start_workers((table, report["model"]["d_model"]), arguments, modes, planned)
        if arguments["device"] == "cpu":          # the workers' threads come out of this process's budget
            self.threads_before = torch.get_num_threads()
            threads, report["timings"]["analyses_processes"] = analyses_budget(self.threads_before, len(self.workers))
            torch.set_num_threads(threads)
            self.gate = CoreGate(self.threads_before, threads, self.workers, patience_s(planned))
            now = self.gate.capacity()
            say(f"analyses: each part starts on the cores the controls' workers leave ({now} "
                f"part{'s' if now != 1 else ''} at a time now, more as they finish; one at a time after "
                f"{self.gate.patience_s:.0f} s of waiting, whatever the controls do)")
        report["timings"]["analyses_threads"] = torch.get_num_threads()

    def finish(self, report: dict, out: Path) -> None:
        """Wait for the worker's controls (a failure is recorded in the errors; the probe's numbers are kept) and
        write report.json."""
        if not self.workers:
            return
        t = time.perf_counter()
        if not self.ready():
            say("waiting for the matched controls ([matched] lines)")
        try:
            report["matched"], report["timings"]["matched_s"] = self.get()
            report["stages"]["matched"]["done"] = True
        except WorkerInterrupted as error:       # the stage stays unfinished: the report is partial
            report["errors"].append(f"matched controls: {error}")
        except Exception as error:  # noqa: BLE001 - the probe's numbers are kept and exported
            report["errors"].append(f"matched controls failed: {type(error).__name__}: {error}")
        report["timings"]["matched_wait_s"] = round(time.perf_counter() - t, 1)
        checkpoint(out, report)   # the probe's numbers are safe before export

    def collect_finished(self, report: dict) -> None:
        """After an interrupt: the controls, if the workers have already sent them; else each unfinished mode's
        line says it was interrupted."""
        stage = report["stages"].get("matched")
        if stage and not stage["done"] and self.workers and self.ready():
            try:
                report["matched"], report["timings"]["matched_s"] = self.get()
                stage["done"] = True
            except RuntimeError:            # a worker failed or was interrupted: the stage stays unfinished
                pass
        if stage and not stage["done"]:
            for mode, worker in zip(self.modes, self.workers):
                if not worker.ready() or worker.interrupted:
                    self.say_interrupted(mode)

    def say_interrupted(self, mode: str) -> None:
        """The line of a mode whose worker was interrupted (once per mode)."""
        with self.lock:
            if mode in self.said:
                return
            self.said.add(mode)
        kept = f": what it finished is kept in {self.folder}" if self.folder is not None else ""
        say(f"matched controls: the {mode} controls were interrupted (resume with --resume{kept})")

    def start_workers(self, args: tuple, arguments: dict, modes: tuple, planned: dict) -> None:
        """One :class:`MatchedWorker` per mode (``train_matched(*args, **arguments)`` with that mode); a worker
        that fails while the later ones are starting stops them once they are all in."""
        self.modes = modes
        self.workers = [MatchedWorker(args, {**arguments, "modes": (mode,),
                                             "planned": {mode: planned[mode]} if mode in planned else None},
                                      on_progress=_matched_progress, on_done=partial(self.worker_done, mode))
                        for mode in modes]
        with self.lock:
            failed = self.failed
        if failed is not None:
            self.stop_others(failed)

    def worker_done(self, mode: str, worker: MatchedWorker) -> None:
        """A worker's result came, it was interrupted or it died (its reader thread). An interrupted worker's line
        says so; the others go on. A failure fails the whole stage, so the other workers are stopped at once and
        their cores go to the analyses (``--resume`` trains the units not finished)."""
        if not worker.failed():             # its result came, or an interrupt stopped it
            if worker.interrupted and not self.stopping:
                self.say_interrupted(mode)
            return
        with self.lock:
            if self.stopping or self.failed is not None:
                return
            self.failed = worker
        say(f"matched controls: the {mode} worker failed; the other workers are stopped (the report will be "
            f"partial: --resume trains what was not finished)")
        self.stop_others(worker)

    def stop_others(self, failed: MatchedWorker) -> None:
        """Stop every worker but ``failed`` (those already started: ``start_workers`` calls it again)."""
        for other in self.workers:
            if other is not failed:
                other.stop()

    def ready(self) -> bool:
        """Has every worker sent its result (or died)?"""
        return all(worker.ready() for worker in self.workers)

    def get(self) -> tuple[dict, float]:
        """Wait for every worker: (the merged controls block, the longest worker's seconds); RuntimeError when one
        failed or died (the first to fail on its own: not a worker stopped because of it), else WorkerInterrupted
        naming the modes interrupted."""
        if self.failed is not None:
            self.failed.get()
        results, interrupted = [], []
        for mode, worker in zip(self.modes, self.workers):
            try:
                results.append(worker.get())
            except WorkerInterrupted as stop:
                interrupted.append(f"the {mode} controls were {stop}")
        if interrupted:
            kept = f": what they finished is kept in {self.folder}" if self.folder is not None else ""
            raise WorkerInterrupted(f"{'; '.join(interrupted)} (resume with --resume{kept})")
        return merge_matched([block for block, _ in results]), max(seconds for _, seconds in results)

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
        for worker in self.workers:
            worker.stop()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None


def matched_table(lm, relations: list, known: dict, report: dict, like_for_like: bool, analysis_options: dict,
                  facts: str = "known"):
    """(FactTable, relations left out) the graded matched control trains on. With ``like_for_like`` the
    superposition fit's table (its subjects, relations and attribute sets): ``facts`` "all" every fact of it (the
    fit's own table), "known" only the facts the model knows (a subject keeps the relations it knows; subjects
    and relations with too few known facts are left out as the fit leaves them out: ``superposition_table`` with
    ``superposition_facts = "known"``); nothing else left out. Without it (no superposition analysis) the
    known-fact table of every relation, whatever ``facts``."""
    if like_for_like:
        options = analysis_options if facts == "all" else {**analysis_options, "superposition_facts": "known"}
        table = superposition_table(lm.tokenizer, relations, known, settings_from(**options))
        return table.fact_table(), []
    return known_table(report["relations"], known)


def table_facts(settings: Settings, like_for_like: bool) -> str:
    """Which facts the graded control's table holds: ``matched.facts``, "known" without the superposition's table."""
    return settings.matched.facts if like_for_like else "known"


def all_facts_control(lm, relations: list, known: dict, report: dict, like_for_like: bool,
                      settings: Settings) -> dict | None:
    """``train_matched``'s ``all_facts``: the all-facts control shown apart ({"table": every fact of the
    superposition fit's table, "recipe", "n_seeds"}), or None when ``matched.all_facts`` is off, the graded control
    already trains on every fact, or there is no superposition table (its analysis not run)."""
    matched = settings.matched
    if not matched.all_facts or table_facts(settings, like_for_like) == "all" or not like_for_like:
        return None
    table, _ = matched_table(lm, relations, known, report, like_for_like, settings.changed("analysis"), "all")
    return {"table": table, "recipe": matched.all_facts_recipe, "n_seeds": matched.all_facts_n_seeds}


PATIENCE_S = 600.0      # how long an analysis part waits for the controls' cores when their plan is unknown


def patience_s(planned: dict) -> float:
    """How long an analysis part waits for the cores the controls' workers hold before it goes in anyway
    (``CoreGate.patience_s``): the plan's seconds of the longer mode (its threshold search and curve) x 1.25, at
    least 60 s; ``PATIENCE_S`` without a plan."""
    modes = [plan["search"] + plan["curve"] + plan.get("apart", 0.0) for plan in planned.values()]
    return max(60.0, 1.25 * max(modes)) if modes else PATIENCE_S


def planned_matched(table, d_model: int, modes: tuple, arguments: dict) -> dict:
    """Mode -> the plan of its controls (``jobs.plan.matched_planned``: this table's facts and subjects, the
    run's seeds, widths, recipe and rule, this CPU's matmul rate or the H200's roofline), which its worker's
    progress lines estimate the time left from, with "apart": the plan's seconds of the all-facts control the
    worker trains after it (``arguments["all_facts"]``; 0 without); {} (said on stderr) when the plan cannot be
    made: it never stops the controls."""
    def plans(table, arguments: dict, facts: str) -> dict:
        n_facts, n_subjects = int((table.table >= 0).sum()), len(table.subjects)
        return {mode: matched_planned(mode, d_model, n_facts, n_subjects, arguments["at_model_width"],
                                      arguments["n_seeds"], device, scale, arguments.get("max_steps"),
                                      arguments.get("past_fit"), facts, arguments["recipe"])
                for mode in modes}

    try:
        device = "cpu" if arguments["device"] == "cpu" else "h200"
        scale = REFERENCE_RATE / measured_rate() if device == "cpu" else 1.0
        graded = plans(table, arguments, arguments.get("facts") or "known")
        apart = arguments.get("all_facts")
        beside = plans(apart["table"], {**arguments, "max_steps": None, "past_fit": None, **apart}, "all") if apart else {}
    except Exception as error:  # noqa: BLE001 - the time left is an estimate; the controls go on without it
        say(f"no plan of the matched controls' time ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})")
        return {}
    return {mode: {**plan, "apart": (beside.get(mode) or {}).get("search", 0.0) + (beside.get(mode) or {}).get("curve", 0.0)}
            for mode, plan in graded.items() if plan is not None}


def _matched_progress(message: str) -> None:
    """The controls worker's progress lines (relayed to this process), on stderr like every other stage's."""
    say(message, prefix="[matched]")


__all__ = ["run", "known_table"]
