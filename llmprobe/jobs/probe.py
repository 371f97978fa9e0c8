"""``llmprobe probe``: load a model, check which facts it knows, run the requested analyses, write report.json."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

import torch
from transformers.utils import logging as transformers_logging

from llmprobe.analyses import run as analyses_run
from llmprobe.analyses.saved import DECODERS_JSON, DECODERS_TENSORS, read_fits, save_decoders, weights_id
from llmprobe.analyses.settings import settings_from
from llmprobe.checks import UsageError, output_folder, parse_layers, report_formats
from llmprobe.console import bar, bars_shown, say, showing
from llmprobe.datasets import DatasetError, Relation, load_relations
from llmprobe.io import json_digest
from llmprobe.jobs.helpers import AnalysisHelper
from llmprobe.jobs.plan import part_seconds
from llmprobe.jobs.runner import Parts, SharedRunner
from llmprobe.jobs.stages import (
    check_folder,
    checkpoint,
    claim_folder,
    digests,
    earlier_stage,
    mark_interrupted,
    previous_report,
    start_stage,
)
from llmprobe.model.chat import chat_record, chat_relations
from llmprobe.model.interop import as_loaded_model
from llmprobe.model.known import KNOWN, KNOWN_RULES, UNKNOWN, FactResult, KnownFactsJob
from llmprobe.model.loading import LoadedModel
from llmprobe.model.subjects import fill, locate_errors
from llmprobe.names import EXPORTS, REPORT_FILES
from llmprobe.report.claims import claims_block
from llmprobe.report.render import export
from llmprobe.report.schema import REPORT_SCHEMA_VERSION
from llmprobe.settings import RunSettings, Settings, from_options

LIBRARIES = ("llmprobe", "torch", "transformers", "accelerate", "datasets", "scikit-learn", "transformer-lens",
             "safetensors", "gguf", "numpy")


def library_versions() -> dict:
    """Installed versions of the libraries that shape the numbers, plus Python's."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def dataset_hash(relations: list[Relation]) -> str:
    """sha256 of the relations' content (names, templates, facts), independent of file layout."""
    blob = json.dumps([[r.name, r.templates, r.neutral_templates, [[f.subject, f.object] for f in r.facts]]
                       for r in relations], ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def locatable(lm: LoadedModel, relation: Relation) -> tuple[list, list[str]]:
    """Facts whose subject can be located in the relation's first template, and an error per fact that can't."""
    found = locate_errors(lm.tokenizer, relation.templates[0], [fact.subject for fact in relation.facts])
    ok = [fact for fact, error in zip(relation.facts, found) if error is None]
    errors = [f"{relation.name}: fact ({_short(fact.subject)}, {_short(fact.object)}): {error}"
              for fact, error in zip(relation.facts, found) if error is not None]
    return ok, errors


GENERATED_TOKENS = 16   # at most this many tokens follow a prompt (the known-fact check's greedy continuation)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def context_length(lm: LoadedModel) -> tuple[int | None, str | None]:
    """The model's context in tokens and the config field it comes from; (None, None) when the config has none."""
    config = getattr(lm.model, "config", None)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None, None


def _short(text: str, limit: int = 60) -> str:
    """repr of ``text``, cut to ``limit`` characters (a 1 MB subject must not land whole in errors)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def fitting(lm: LoadedModel, relation: Relation, max_prompt_tokens: int | None = None) -> tuple[list, list[str]]:
    """Facts whose prompts fit the model's context (and the ``max_prompt_tokens`` budget), and an error per fact
    that does not. A prompt is each template of the relation (first and neutral) filled with the subject and
    followed by the object; with up to ``GENERATED_TOKENS`` generated tokens it must fit the context."""
    context, field = context_length(lm)
    if context is None and max_prompt_tokens is None:
        return list(relation.facts), []
    templates = list(dict.fromkeys([relation.templates[0], *relation.neutral_templates]))
    prompts = [fill(t, f.subject)[0] + " " + f.object.strip() for f in relation.facts for t in templates]
    lengths = [len(ids) for ids in lm.tokenizer(prompts)["input_ids"]]
    ok, errors = [], []
    for i, fact in enumerate(relation.facts):
        n = max(lengths[i * len(templates):(i + 1) * len(templates)])
        if context is not None and n + GENERATED_TOKENS > context:
            reason = (f"prompt of {n} tokens (+{GENERATED_TOKENS} generated) exceeds the model's context of "
                      f"{context} tokens ({field})")
        elif max_prompt_tokens is not None and n > max_prompt_tokens:
            reason = f"prompt of {n} tokens exceeds the budget of {max_prompt_tokens} (--max-prompt-tokens)"
        else:
            ok.append(fact)
            continue
        errors.append(f"{relation.name}: fact ({_short(fact.subject)}, {_short(fact.object)}) skipped: {reason}")
    return ok, errors


def model_identity(info: dict) -> dict:
    """What identifies a loaded model's numbers: its weights (hash, or hub name and revision), dtype and device."""
    return {"weights": weights_id(info), "architecture": info.get("architecture"), "dtype": info.get("dtype"),
            "device": str(info.get("device", "")).split(":")[0]}



def run_relations(run: RunSettings) -> list[Relation]:
    """The relations a run reads: ``run.relations`` (None: the bundled ones), each cut to its first
    ``run.max_facts`` facts when that is set."""
    relations = load_relations(None if run.relations is None else list(run.relations), max_facts=run.max_facts,
                               hf_kwargs=run.hf_kwargs)
    return [r.with_facts(r.facts[:run.max_facts]) for r in relations] if run.max_facts else relations


def load_options(run: RunSettings) -> dict:
    """Keyword arguments of ``load_model`` that are run settings (the model's name aside)."""
    return {"gguf_file": run.gguf_file, "device": run.device, "dtype": run.dtype, "device_map": run.device_map,
            "max_memory": None if run.max_memory is None else list(run.max_memory),
            "offload_folder": run.offload_folder, "quantize": run.quantize}


def job_settings(command: str, model, settings: Settings | None, options: dict) -> Settings:
    """The checked settings of a ``probe`` or ``run`` call (``command``): ``settings`` with the call's keywords
    (``llmprobe.settings.from_options``); a model given by name (not an object) is ``run.model``."""
    if isinstance(model, (str, os.PathLike)):
        options = {**options, "model": model}
    return from_options(command, settings, options)




class ProbeReport(TypedDict, total=False):
    """What :func:`probe` and ``llmprobe.run`` return: report.json's content, a plain ``dict`` with these keys
    (``llmprobe.load_report(out)`` opens the written report in the notebook viewer, ``llmprobe.Report``)."""

    schema_version: int     # llmprobe.report.schema.REPORT_SCHEMA_VERSION
    kind: str               # "pretrained"
    created: str            # when the report was started (ISO 8601, UTC)
    model: dict             # the model as loaded: name, architecture, model_type, n_layers, d_model, dtype, device,
    #                         weights_hash (LoadedModel.info)
    dataset: dict           # hash of the relations' content, relation names, max_facts, max_prompt_tokens
    scoring: str            # the known-fact rule of the protocol
    relations: dict         # relation -> n_facts, n_known, known_rate (what the known-fact check found), templates,
    #                         template_used, neutral_templates, properties, source; assumed_known (run.assume_known)
    layers: list            # the layers probed (indices)
    versions: dict          # library -> installed version
    seed: int
    settings: dict          # every setting (Settings.record): command, run, analysis, matched; llmprobe rerun reads it
    timings: dict           # seconds per stage, processes and threads used
    errors: list            # skipped facts, relations and analyses, and notes a reader must see, one line each
    partial: bool           # a stage did not finish (interrupted, or the matched controls failed)
    stages: dict            # stage -> key, done, resumed (llmprobe.jobs.stages)
    wall_seconds: float
    analyses: dict          # with analyses: their results (llmprobe.analyses.results), per relation and analysis
    claims: dict            # with analyses: the summary's claims and verdicts (llmprobe.report.claims.claims_block)
    matched: dict           # run only: the matched synthetic controls (synthetic.matched)


@contextmanager
def shown(progress: bool | None, verbose: bool | None) -> Iterator[None]:
    """The output switch of one ``probe`` or ``run`` call (``llmprobe.console.showing``), transformers' and the
    hub's own bars (loading the weights) following it: off when the call draws no bar, on again after."""
    with showing(progress, verbose):
        hide = not bars_shown() and transformers_logging.is_progress_bar_enabled()
        if hide:
            transformers_logging.disable_progress_bar()
        try:
            yield
        finally:
            if hide:
                transformers_logging.enable_progress_bar()


def probe(model=None, *, settings: Settings | None = None, out: str | Path | None = None, tokenizer=None,
          lm: LoadedModel | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
          resume: bool = False, on_known=None, overwrite: bool = False, formats=EXPORTS,
          progress: bool | None = None, verbose: bool | None = None, **options) -> ProbeReport:
    """Probe ``model`` (None = ``settings.run.model``, default the embedded model) on the relations; returns the
    report: report.json's content as a plain dict (:class:`ProbeReport` lists its keys).

    ``model``: a name or folder, or a model object with ``tokenizer`` (a transformers model, a TransformerBridge,
    an nnsight TransformersModel or LanguageModel: ``llmprobe.model.interop.as_loaded_model``); ``lm``: an already loaded model
    (``model`` is then only recorded). ``options``: every run setting by its name (``relations``, ``layers``,
    ``analyses``, ``device``, ``max_facts``, ``seed``, ``assume_known``, ...: ``llmprobe.settings.RunSettings``) and
    ``analysis_options`` (fields of ``llmprobe.analyses.AnalysisSettings``, e.g. ``{"protocol": "lre"}``), over
    ``settings`` (a ``llmprobe.settings.Settings``; default: the defaults). An unknown keyword raises UsageError.

    ``assume_known``: True (every relation) or a list of relation names whose facts are taken as known: the
    analyses use every such fact that fits the context and whose subject is located, whatever the known-fact check
    finds (curated facts, smoke tests on a model that knows nothing). The check still runs: known_facts.json and
    ``report["relations"][name]``'s ``n_known`` and ``known_rate`` say what it found, ``assumed_known`` is true
    there, and a line of ``errors`` says it. A name that is no relation of the run raises UsageError.

    Output: ``progress`` draws the progress bars on stderr (default: only when stderr is a terminal; transformers'
    weight-loading bar follows it); ``verbose`` writes the message lines on stderr (default: yes). The lines are
    records of the ``logging`` logger "llmprobe" either way (``llmprobe.console``).

    Every setting, the relations and the output folder are checked before the model is loaded (UsageError,
    DatasetError). Writes ``out/report.json`` and ``out/known_facts.json`` when ``out`` is given: after the
    known facts, at the end, and on an interrupt (KeyboardInterrupt; the report then says ``"partial": true``
    and which ``stages`` are done); during the analyses report.json is rewritten after each relation's decoders
    and after the superposition analysis, so an interrupt keeps the finished ones (``analyses.partial`` true).
    At the end ``formats`` are exported beside it as ``llmprobe probe`` does (``llmprobe.report.render.export``,
    the same files: html report.html, md report.md, csv metrics.csv, json metrics.json; default html, md and csv;
    ``formats=()`` exports nothing).
    ``resume`` takes the finished stages (and the known facts of finished relations, and the finished relations
    and superposition analysis of an interrupted analyses stage) from ``out`` when their key (model hash and
    settings) matches, instead of recomputing them; ``stages.analyses`` says what was taken over
    (``llmprobe.jobs.stages``). ``max_facts`` keeps the first facts of each relation (country relations list the
    most populous first). Facts whose prompt does not fit the model's context or ``max_prompt_tokens`` are
    skipped and listed in ``errors``. ``on_known(report, known, lm, relations)`` is called once the known facts
    are checked, before the analyses (``llmprobe run`` starts its controls there). ``report["settings"]`` records
    every setting (``Settings.record``), from which ``llmprobe rerun`` repeats the run. With analyses,
    ``report["claims"]`` holds the summary's claims and verdicts (``llmprobe.report.claims.claims_block``).

    The decoders of each relation are written (decoders.safetensors, decoders.json) with its checkpoint, and
    ``resume`` computes again a relation taken over whose decoders are missing (``stages.analyses.refit_relations``,
    and a line in ``errors``). ``out`` must not hold another result, of any command or model (UsageError listing
    its files), unless ``overwrite``, which replaces the files llmprobe wrote there (its manifest names them; no
    other file is deleted), or ``resume``, which continues the same model's run (``llmprobe.jobs.stages.
    claim_folder``).
    """
    formats = report_formats(formats)
    with shown(progress, verbose):
        job = ProbeJob("probe", job_settings("probe", model, settings, options), out, resume, overwrite,
                       tuple(REPORT_FILES[f] for f in formats))
        job.load(model, tokenizer, lm, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
        report = job.run(on_known)
        if job.out is not None and formats:
            export(job.out, formats)
    return report


class ProbeJob:
    """One probe (alone, or the probe of ``run``: ``command``): its settings and output folder, the report being
    written, and what the stages computed."""

    def __init__(self, command: str, settings: Settings, out: str | Path | None, resume: bool,
                 overwrite: bool = False, files: tuple[str, ...] = ()):
        self.start = time.perf_counter()
        self.command, self.settings = command, settings
        self.out = output_folder(out) if out is not None else None
        if self.out is not None:            # a folder holding another result is refused before the model loads
            check_folder(self.out, resume, overwrite)
        self.resume, self.overwrite = resume, overwrite
        self.files = ["report.json", "known_facts.json", *files] + (    # what this job writes (manifest.json)
            [DECODERS_JSON, DECODERS_TENSORS] if {"lre", "ridge"} & set(settings.analyses(command)) else [])
        self.previous = previous_report(self.out) if resume else {}
        self.lm: LoadedModel | None = None
        self.relations: list[Relation] = []
        self.report: dict = {}
        self.known: dict = {}      # relation -> [FactResult] of its located facts, as the analyses take them
        self.checked: dict = {}    # relation -> [FactResult] as the known-fact check found them (known_facts.json)
        self.assumed: set = set()  # the relations whose facts are taken as known (run.assume_known)
        self.analysed: list = []   # the relations without the facts that do not fit the context (the analyses' input)
        self.fitted: dict = {}     # relation -> decoder -> the fit at its chosen layer (decoders.safetensors)
        self.saved: set = set()    # the (relation, decoder) pairs of self.fitted that the decoder files hold
        self.load_spec: dict | None = None     # as_loaded_model's arguments, when a helper process can repeat them
        self.ahead: tuple[int, int] | None = None   # (threads, processes) of the analyses, known before the known
        #                                             facts (``run``: beside its controls' workers): shared as they are
        self.helper_pool: list[AnalysisHelper] = []  # the helper processes started (known facts, then analyses)
        self.gate = None      # what shares the cores with the analyses' parts (``run``: its controls' CoreGate)

    def load(self, model, tokenizer, lm: LoadedModel | None, **load_flags) -> None:
        """Seed the RNGs, read the relations, load the model (unless ``lm``) and start the report."""
        run = self.settings.run
        random.seed(run.seed)
        torch.manual_seed(run.seed)
        self.relations = run_relations(run)
        self.assumed = assumed_relations(run.assume_known, self.relations)
        named = model is None or isinstance(model, (str, os.PathLike))
        if lm is None and named:
            say(f"loading {run.model or 'the embedded default model'} ...")
        self.lm = lm if lm is not None else as_loaded_model(run.model if named else model, tokenizer,
                                                           **load_options(run), **load_flags)
        if lm is None and named:
            self.load_spec = {"obj": run.model, **load_options(run), **load_flags}
        if not named:                           # a model object is recorded by its name_or_path
            recorded = self.lm.info["name"]
        elif run.model is not None or self.lm.info.get("source") == "embedded":
            recorded = run.model
        else:                                   # lm= without a model name
            recorded = self.lm.info.get("name")
        timings = {"load_s": round(time.perf_counter() - self.start, 1)}
        if run.chat_template:       # every stage reads the wrapped templates (UsageError: the model has no template)
            self.relations = chat_relations(self.lm.tokenizer, self.relations, self.lm.info.get("name"))
        self.report = new_report(self.command, self.settings, self.lm, self.relations, recorded, timings)
        self.report["dataset"]["chat_template"] = chat_record(self.lm.tokenizer, self.relations, self.lm.info.get(
            "name")) if run.chat_template else None
        if self.out is not None:
            claim_folder(self.out, self.command, self.lm.info, self.files, self.resume, self.overwrite)
        say(f"{self.lm.info.get('name')}: {self.lm.adapter.n_layers} layers, loaded in {timings['load_s']} s; "
            f"known facts of {len(self.relations)} relations ({sum(len(r.facts) for r in self.relations)} facts) "
            f"next")

    def run(self, on_known=None) -> dict:
        """The stages: known facts, ``on_known``, the analyses; report.json written after each and at the end."""
        try:
            self.check_known()
            self.save()   # checkpoint: the known facts are safe before the analyses
            if on_known is not None:
                on_known(self.report, self.known, self.lm, self.analysed)
            if self.settings.analyses(self.command):
                self.analyse()
        except KeyboardInterrupt:
            mark_interrupted(self.report)
            self.write_decoders()
            self.save()
            raise
        finally:
            self.stop_helpers()
        self.report["partial"] = False
        if "analyses" in self.report:
            self.report["claims"] = claims_block(self.report)
        self.write_decoders(changed_only=False)
        self.save()
        return self.report

    def save(self, known: bool = True) -> None:
        """Write report.json (and known_facts.json unless only the analyses moved on since the last save)."""
        self.report["wall_seconds"] = round(time.perf_counter() - self.start, 1)
        files = {"known_facts.json": {name: [r.to_dict() for r in results] for name, results in self.checked.items()}}
        if "known_facts" in self.report["stages"]:      # what --resume checks known_facts.json against
            self.report["stages"]["known_facts"]["digests"] = digests(files["known_facts.json"])
        checkpoint(self.out, self.report, files if known else None)

    def check_known(self) -> None:
        """The known-fact stage: each relation's facts that fit the context and whose subject is located, checked
        (or taken from the previous known_facts.json when its stage key matches and the subjects are the same).
        With ``self.ahead`` of more than one process the relations are shared with helper processes (this one
        from the front, the helpers from the back, each on the analyses' threads): a relation's results do not
        depend on the process (``KnownFactsJob``)."""
        run, report, t = self.settings.run, self.report, time.perf_counter()
        a = self.settings.analysis     # the protocol's known-fact rule and in-context examples
        key = json_digest(model_identity(self.lm.info), report["dataset"]["hash"], run.max_facts,
                        run.max_prompt_tokens, run.batch_size, run.seed, a.protocol, a.n_icl,
                        a.n_splits if a.protocol == "lre" else None,
                        *([sorted(self.assumed)] if self.assumed else []))    # the keys of earlier runs kept
        stage = start_stage(report, "known_facts", key)
        before = earlier_stage(self.previous, "known_facts", key)
        taken = self.unchanged_known(before) if before is not None else {}
        checked: dict = {}          # relation name -> the relation with its located facts, or its results taken
        for relation in self.relations:
            fit, errors = fitting(self.lm, relation, run.max_prompt_tokens)
            self.analysed.append(relation.with_facts(fit))
            facts, unlocated = locatable(self.lm, self.analysed[-1])
            report["errors"] += errors + unlocated
            if not facts:
                report["errors"].append(f"{relation.name}: no fact whose subject could be located (and whose "
                                        f"prompt fits); relation skipped")
                continue
            results = taken.get(relation.name)
            same = results is not None and [r.subject for r in results] == [f.subject for f in facts]
            checked[relation.name] = results if same else relation.with_facts(facts)
        todo = {name: r for name, r in checked.items() if isinstance(r, Relation)}
        options = dict(batch_size=run.batch_size, protocol=a.protocol, n_icl=a.n_icl, n_draws=a.n_splits,
                       seed=run.seed)
        job = KnownFactsJob(self.lm, todo, **options)
        threads, processes = self.ahead or (torch.get_num_threads(), 1)
        helpers = self.start_helpers(processes - 1, threads, "known facts") if len(todo) > 1 else []
        for helper in helpers:
            helper.work("known", {"relations": todo, **options})
        parts, before = Parts([("known", name) for name in todo], helpers), torch.get_num_threads()
        if helpers:
            torch.set_num_threads(threads)
        by_helpers, by_name = [], {r.name: r for r in self.relations}
        try:
            for name in bar(checked, desc="known facts", unit="relation"):
                results = checked[name]
                if name in todo:
                    outcome, here = parts.outcome(("known", name), job.compute)
                    results = outcome["value"]
                    by_helpers += [] if here else [name]
                self.checked[name] = results
                self.known[name] = taken_as_known(results) if name in self.assumed else results
                report["relations"][name] = relation_entry(by_name[name], results, name in self.assumed)
                if name in self.assumed:
                    report["errors"].append(assumed_line(name, results))
        finally:
            parts.close()
            torch.set_num_threads(before)
        report["timings"]["known_facts_s"] = round(time.perf_counter() - t, 1)
        report["timings"]["known_facts_processes"] = 1 + len(helpers)
        report["timings"]["known_facts_helper_relations"] = by_helpers
        reused = len(checked) - len(todo)
        stage.update(done=True, resumed=bool(reused) and reused == len(self.known))

    def unchanged_known(self, before: dict) -> dict:
        """The previous known_facts.json's relations (relation -> [FactResult]) whose content is what the earlier
        report recorded (its stage's ``digests``); another relation's facts (the file was changed, or its report
        has no digest of it) are checked again, with an error line naming the file."""
        taken, recorded = _previous_known(self.out), before.get("digests") or {}
        changed = [name for name, results in taken.items()
                   if digests({name: [r.to_dict() for r in results]})[name] != recorded.get(name)]
        for name in changed:
            del taken[name]
            self.report["errors"].append(f"{name}: its known facts in {self.out / 'known_facts.json'} are not those "
                                         f"report.json recorded (the file was changed since, or report.json holds "
                                         f"no record of them), so they were checked again (--resume)")
        return taken

    def analyse(self) -> None:
        """The analyses stage: taken over whole from the previous report when its key matches and it was done;
        otherwise ``run_analyses``, given the finished relations of an interrupted earlier stage of the same key."""
        report, analyses, t = self.report, self.settings.analyses(self.command), time.perf_counter()
        key = json_digest(report["stages"]["known_facts"]["key"], report["layers"], analyses,
                        sorted(self.settings.changed("analysis").items()))
        stage = start_stage(report, "analyses", key, resumed_relations=[], resumed_superposition=False,
                            refit_relations=[])
        say(f"analyses {', '.join(analyses)}: {len(self.analysed)} relations, {len(report['layers'])} layers")
        before = earlier_stage(self.previous, "analyses", key)
        earlier = self.previous.get("analyses") if before is not None else None
        earlier = earlier if isinstance(earlier, dict) else None
        if earlier is not None and self.out is not None:   # the decoders of the relations taken over
            saved = read_fits(self.out)
            misfit = unfit_decoders(saved, self.lm.adapter.n_layers, report["model"].get("d_model"))
            self.fitted.update({name: kinds for name, kinds in saved.items() if name not in misfit})
            self.saved = {(name, kind) for name, kinds in self.fitted.items() for kind in kinds}
            stage["refit_relations"] = missing_decoders(earlier, self.fitted, analyses)
            for name in stage["refit_relations"]:
                why = (f"did not fit this model ({misfit[name]})" if name in misfit else "were missing")
                report["errors"].append(f"{name}: its decoders in {self.out / DECODERS_JSON} {why}, so its "
                                        f"analyses were computed again (--resume)")
            relations = {k: v for k, v in (earlier.get("relations") or {}).items()
                         if k not in stage["refit_relations"]}
            earlier = {**earlier, "relations": relations} if stage["refit_relations"] else earlier
        if earlier is not None and before.get("done") and not stage["refit_relations"]:
            report["analyses"] = earlier
            earlier.setdefault("partial", False)
            stage.update(resumed=True, resumed_relations=list(earlier.get("relations") or {}),
                         resumed_superposition="superposition" in earlier)
        else:
            if earlier is not None:          # an interrupted run's finished parts (same key: same settings)
                report["analyses"] = {**earlier, "partial": True}   # kept should this run be interrupted too
                stage.update(taken_over(earlier, self.analysed, analyses))
            arguments = {"relations": self.analysed, "known": self.known, "layers": report["layers"],
                         "analyses": analyses, "seed": self.settings.run.seed, **self.settings.analysis_options()}
            helpers = self.helpers(arguments)
            try:
                runner = SharedRunner(on_progress=self.analyses_progress, done=earlier, fitted=self.fitted,
                                      planned=self.planned_parts(analyses), helpers=tuple(helpers), gate=self.gate)
                report["analyses"] = analyses_run.run_analyses(self.lm, **arguments, runner=runner)
            finally:
                self.stop_helpers()
        report["timings"]["analyses_s"] = round(time.perf_counter() - t, 1)
        stage["done"] = True

    def helpers(self, arguments: dict) -> list[AnalysisHelper]:
        """The analyses' helper processes (``llmprobe.jobs.helpers``): ``timings.analyses_processes`` - 1 of them
        (``llmprobe run`` sets it: the cores its controls' workers hold, at the analyses' thread count), each on
        the analyses' torch threads: those that checked the known facts when they have these threads, others
        started (:meth:`start_helpers`) for the rest."""
        wanted = self.report["timings"].get("analyses_processes", 1) - 1
        threads = torch.get_num_threads()
        kept = [h for h in self.helper_pool if h.threads == threads and not h.failed][:max(wanted, 0)]
        for helper in self.helper_pool:
            if helper not in kept:
                helper.stop()
        self.helper_pool = kept + self.start_helpers(wanted - len(kept), threads, "analyses")
        for helper in self.helper_pool:
            helper.work("analyses", arguments)
        return self.helper_pool

    def start_helpers(self, wanted: int, threads: int, stage: str) -> list[AnalysisHelper]:
        """Up to ``wanted`` new helper processes on ``threads`` torch threads each (added to ``helper_pool``), when
        this process loaded the model by name or folder on the CPU and the copies fit in half the memory
        available; none otherwise."""
        if wanted < 1 or self.load_spec is None or self.lm.device.type != "cpu" or self.settings.run.device_map:
            return []
        size = sum(p.numel() * p.element_size() for p in self.lm.model.parameters())
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        wanted = min(wanted, int(free / 2 // max(size, 1)))
        if wanted < 1:
            return []
        identity = weights_id(self.lm.info)
        say(f"{stage}: {wanted} helper process{'es' if wanted > 1 else ''} ({threads} thread{'s' if threads > 1 else ''}"
            f"{' each' if wanted > 1 else ''}, as this process) share{'' if wanted > 1 else 's'} the parts ([helper] "
            f"lines)")
        started = [AnalysisHelper(self.load_spec, self.settings.run.seed, threads, identity,
                                  on_line=lambda line: say(line, prefix="[helper]")) for _ in range(wanted)]
        self.helper_pool += started
        return started

    def stop_helpers(self) -> None:
        for helper in self.helper_pool:
            helper.stop()
        self.helper_pool = []

    def planned_parts(self, analyses: tuple) -> dict | None:
        """Each analysis part -> the plan's seconds of it (``jobs.plan.part_seconds``, on the facts the model
        knows), for the progress bar's time left; None (said on stderr) when the plan cannot be made: it never
        stops the analyses."""
        try:
            cfg = settings_from(seed=self.settings.run.seed, **self.settings.analysis_options())
            return part_seconds(self.lm, self.analysed, self.known, self.report["layers"], cfg, analyses)
        except Exception as error:  # noqa: BLE001 - the time left is an estimate; the analyses go on without it
            say(f"no plan of the analyses' time ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})")
            return None

    def analyses_progress(self, partial: dict) -> None:
        """``run_analyses``' checkpoint: the finished relations (their decoders first) are safe from an interrupt."""
        self.report["analyses"] = partial
        self.write_decoders()
        self.save(known=False)     # known_facts.json was written after the known facts

    def write_decoders(self, changed_only: bool = True) -> None:
        """The fitted decoders beside report.json: decoders.safetensors + decoders.json (``llmprobe.report.notebook``),
        when a decoder was fitted since they were last written (or, not ``changed_only``, when there are any)."""
        fitted = {(name, kind) for name, kinds in self.fitted.items() for kind in kinds}
        if self.out is not None and fitted and (fitted != self.saved or not changed_only):
            save_decoders(self.out, self.fitted, {**model_identity(self.lm.info), "name": self.lm.info.get("name")})
            self.saved = fitted


def new_report(command: str, settings: Settings, lm: LoadedModel, relations: list[Relation], model: str | None,
               timings: dict) -> dict:
    """The report of a probe before its stages (``partial`` until they are done); ``model`` as recorded."""
    run = settings.run
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": "pretrained",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": lm.info,
        "dataset": {"hash": dataset_hash(relations), "relations": [r.name for r in relations],
                    "max_facts": run.max_facts, "max_prompt_tokens": run.max_prompt_tokens},
        "scoring": KNOWN_RULES[settings.analysis.protocol],
        "relations": {},
        "layers": parse_layers(run.layers, lm.adapter.n_layers),
        "versions": library_versions(),
        "seed": run.seed,
        "settings": settings.record(command, model),
        "timings": timings,
        "errors": [],
        "partial": True,
        "stages": {},
    }


def relation_entry(relation: Relation, results: list[FactResult], assumed: bool = False) -> dict:
    """``report["relations"][name]``: the known-fact counts (what the check found) and the relation's templates
    and properties; ``assumed_known``: true when its facts are taken as known (``run.assume_known``)."""
    n_known = sum(r.known for r in results)
    return {"n_facts": len(results), "n_known": n_known, "known_rate": n_known / len(results),
            "templates": relation.templates, "template_used": relation.templates[0],
            "neutral_templates": relation.neutral_templates, "properties": relation.properties,
            "source": relation.source, **({"assumed_known": True} if assumed else {})}


def assumed_relations(assume_known: bool | tuple[str, ...], relations: list[Relation]) -> set[str]:
    """The names of the relations whose facts are taken as known: all (``assume_known`` True), none (False), or
    those named; UsageError naming a name that is no relation of the run."""
    names = [r.name for r in relations]
    if isinstance(assume_known, bool):
        return set(names) if assume_known else set()
    unknown = [name for name in assume_known if name not in names]
    if unknown:
        raise UsageError(f"run.assume_known: {', '.join(map(repr, unknown))} "
                         f"{'is no relation' if len(unknown) == 1 else 'are no relations'} of this run; its "
                         f"relations are {', '.join(names) or 'none'}")
    return set(assume_known)


def taken_as_known(results: list[FactResult]) -> list[FactResult]:
    """``results`` with every fact known: zero-shot and in every in-context draw that checked it (its "unknown"
    roles become "known"; in-context examples and excluded facts stay as they were)."""
    return [replace(r, known=True, known_zero_shot=None if r.known_zero_shot is None else True,
                    draws=[KNOWN if role == UNKNOWN else role for role in r.draws]) for r in results]


def assumed_line(name: str, results: list[FactResult]) -> str:
    """The line of ``errors`` saying a relation's facts are taken as known, and what the check found."""
    return (f"{name}: all {len(results)} facts taken as known (run.assume_known), whatever the model knows: the "
            f"known-fact check found {sum(r.known for r in results)} of {len(results)} known; the analyses use "
            f"all {len(results)}")


def _previous_known(out: Path) -> dict:
    """relation -> [FactResult] from ``out/known_facts.json`` ({} when it cannot be read)."""
    try:
        data = json.loads((out / "known_facts.json").read_text(encoding="utf-8"))
        return {name: [FactResult(**r) for r in rows] for name, rows in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def unfit_decoders(fitted: dict, n_layers: int, d_model: int | None) -> dict[str, str]:
    """Relation -> why its saved decoders (``read_fits``: {relation: {kind: fit}}) cannot be this model's: a layer
    outside its ``n_layers`` blocks, or a W or b not of its width ``d_model``; --resume computes those again."""
    out = {}
    for name, kinds in fitted.items():
        for kind, fit in kinds.items():
            layer, W, b = fit.get("layer"), fit.get("W"), fit.get("b")
            if not isinstance(layer, int) or not 0 <= layer < n_layers:
                out[name] = f"{kind} at layer {layer!r} of a {n_layers}-layer model"
            elif d_model and (W is None or tuple(W.shape) != (d_model, d_model) or b is None
                              or tuple(b.shape) != (d_model,)):
                shape = None if W is None else tuple(W.shape)
                out[name] = f"{kind} W of shape {shape} for d_model {d_model}"
    return out


def missing_decoders(earlier: dict, fitted: dict, analyses: tuple[str, ...]) -> list[str]:
    """The relations an earlier analyses result finished (no error) whose decoders chosen there (``selected``)
    of those asked for in ``analyses`` are not in ``fitted`` (the decoder files read back)."""
    asked = {"lre", "ridge"} & set(analyses)
    return [name for name, entry in (earlier.get("relations") or {}).items()
            if isinstance(entry, dict) and not entry.get("error")
            and not (asked & set(entry.get("selected") or {})).issubset(fitted.get(name) or {})]


def taken_over(earlier: dict, relations: list[Relation], analyses: tuple[str, ...]) -> dict:
    """What an interrupted analyses stage of the same key leaves to take over: the ``resumed_relations`` (their
    decoders), ``resumed_superposition``, and ``resumed`` when that is everything asked for."""
    taken = earlier.get("relations") or {}
    decoders = bool({"lre", "ridge"} & set(analyses))
    names = [r.name for r in relations if decoders and isinstance(taken.get(r.name), dict)]
    superposition = "superposition" in analyses and isinstance(earlier.get("superposition"), dict)
    return {"resumed_relations": names, "resumed_superposition": superposition,
            "resumed": (len(names) == (len(relations) if decoders else 0)
                        and superposition == ("superposition" in analyses))}


def summary_table(report: dict) -> str:
    """Plain-text table of known-fact rates per relation (a relation taken as known says so after its rate)."""
    rows = [f"{'relation':<28} {'facts':>6} {'known':>6} {'rate':>6}"]
    for name, rel in report["relations"].items():
        rows.append(f"{name:<28} {rel['n_facts']:>6} {rel['n_known']:>6} {rel['known_rate']:>6.2f}"
                    + ("  (all taken as known: run.assume_known)" if rel.get("assumed_known") else ""))
    return "\n".join(rows)


__all__ = ["probe", "ProbeJob", "ProbeReport", "library_versions", "summary_table", "DatasetError"]
