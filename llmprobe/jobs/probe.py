"""``llmprobe probe``: load a model, check which facts it knows, run the requested analyses, write report.json."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import platform
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llmprobe.analyses import run as analyses_run
from llmprobe.analyses.saved import read_fits, save_decoders
from llmprobe.analyses.settings import AnalysisSettings, settings_from
from llmprobe.checks import UsageError, analysis_names, layer_spec, output_folder, positive_int
from llmprobe.datasets import DatasetError, Relation, load_relations
from llmprobe.io import write_json
from llmprobe.model.interop import as_loaded_model
from llmprobe.model.known import FactResult, known_facts
from llmprobe.model.loading import LoadedModel
from llmprobe.model.subjects import fill, locate_errors
from llmprobe.names import ANALYSES
from llmprobe.report.schema import REPORT_SCHEMA_VERSION
from llmprobe.settings import settings_record

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


def parse_layers(spec: str | list[int] | None, n_layers: int) -> list[int]:
    """``all`` | ``0,6,12`` | ``-1`` | ``every:3`` -> sorted layer indices in 0..n_layers-1 (UsageError otherwise)."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    layer_spec(spec)
    if isinstance(spec, str) and spec.startswith("every:"):
        step = int(spec.split(":", 1)[1])
        return sorted(set(range(0, n_layers, step)) | {n_layers - 1})
    items = spec.split(",") if isinstance(spec, str) else spec
    layers = set()
    for item in items:
        try:
            layer = int(item)
        except (TypeError, ValueError):
            raise UsageError(f"bad layer {item!r} in --layers {spec!r}: use all, every:K, or integers") from None
        if not -n_layers <= layer < n_layers:
            raise UsageError(f"layer {layer} out of range: the model has {n_layers} layers")
        layers.add(layer % n_layers)
    return sorted(layers)


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


def _digest(*parts) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def model_identity(info: dict) -> dict:
    """What identifies a loaded model's numbers: its weights (hash, or hub name and revision), dtype and device."""
    return {"weights": info.get("weights_hash") or f"{info.get('name')}@{info.get('revision')}",
            "architecture": info.get("architecture"), "dtype": info.get("dtype"),
            "device": str(info.get("device", "")).split(":")[0]}


def previous_report(out: str | Path | None) -> dict:
    """report.json already in ``out`` (for ``resume``), or {} when there is none or it cannot be read."""
    if out is None:
        return {}
    try:
        report = json.loads((Path(out) / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def _previous_known(out: Path, previous: dict, key: str) -> dict:
    """relation -> [FactResult] from ``out/known_facts.json`` when the previous run's known-fact stage had ``key``."""
    stage = (previous.get("stages") or {}).get("known_facts") or {}
    if stage.get("key") != key:
        return {}
    try:
        data = json.loads((out / "known_facts.json").read_text(encoding="utf-8"))
        return {name: [FactResult(**r) for r in rows] for name, rows in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def probe(
    model=None,
    *,
    tokenizer=None,
    gguf_file: str | None = None,
    relations: list[str] | None = None,
    layers: str | list[int] | None = "every:3",
    analyses: tuple[str, ...] | str = (),
    device: str = "auto",
    dtype: str = "auto",
    device_map: str | dict | None = None,
    max_memory: str | dict | list | None = None,
    offload_folder: str | Path | None = None,
    quantize: str | None = None,
    batch_size: int = 32,
    max_facts: int | None = None,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    resume: bool = False,
    lm: LoadedModel | None = None,
    on_known=None,
    analysis_options: dict | None = None,
    controls_settings: dict | None = None,
) -> dict:
    """Probe ``model`` (None = embedded default) on ``relations`` (None = all bundled); returns the report.

    ``model``: a name or folder, or a model object with ``tokenizer`` (a transformers model, a TransformerBridge,
    an nnsight LanguageModel: ``llmprobe.model.interop.as_loaded_model``).

    Every option, the relations and the output folder are checked before the model is loaded (UsageError,
    DatasetError). Writes ``out/report.json`` and ``out/known_facts.json`` when ``out`` is given: after the
    known facts, at the end, and on an interrupt (KeyboardInterrupt; the report then says ``"partial": true``
    and which ``stages`` are done); during the analyses report.json is rewritten after each relation's decoders
    and after the superposition analysis, so an interrupt keeps the finished ones (``analyses.partial`` true).
    ``resume`` takes the finished stages (and the known facts of finished relations, and the finished relations
    and superposition analysis of an interrupted analyses stage) from ``out`` when their key (model hash and
    settings) matches, instead of recomputing them; ``stages.analyses`` says what was taken over.
    ``max_facts`` keeps the first facts of each relation (country relations list the most populous first).
    Facts whose prompt does not fit the model's context or ``max_prompt_tokens`` are skipped and listed in
    ``errors``. ``on_known(report, known, lm, relations)`` is called once the known facts are checked, before the
    analyses (``llmprobe run`` starts its controls there). ``analysis_options``: fields of
    ``llmprobe.analyses.AnalysisSettings`` (e.g. ``{"protocol": "lre"}``), checked before the model loads.
    ``report["settings"]`` records every setting (``llmprobe.settings.settings_record``; ``controls_settings``, the
    matched controls' settings, is given by ``llmprobe run``), from which ``llmprobe rerun`` repeats the run.
    """
    start = time.perf_counter()
    analyses = analysis_names(analyses, ANALYSES)
    batch_size = positive_int(batch_size, "--batch-size")
    max_facts = positive_int(max_facts, "--max-facts", allow_none=True)
    max_prompt_tokens = positive_int(max_prompt_tokens, "--max-prompt-tokens", allow_none=True)
    if analysis_options:
        try:
            settings_from(**analysis_options)
        except (TypeError, ValueError) as error:
            raise UsageError(f"analysis settings: {error}") from None
    layer_spec(layers)
    if out is not None:
        out = output_folder(out)
    previous = previous_report(out) if resume else {}
    random.seed(seed)
    torch.manual_seed(seed)
    rels = load_relations(relations)
    if max_facts:
        rels = [Relation(r.name, r.templates, r.neutral_templates, r.facts[:max_facts], r.properties, r.source)
                for r in rels]
    lm = lm or as_loaded_model(model, tokenizer, gguf_file=gguf_file, device=device, dtype=dtype,
                               device_map=device_map, max_memory=max_memory, offload_folder=offload_folder,
                               quantize=quantize, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    if not isinstance(model, (str, Path, type(None))):
        model = lm.info["name"]           # a model object is recorded by its name_or_path
    timings = {"load_s": round(time.perf_counter() - start, 1)}
    layer_ids = parse_layers(layers, lm.adapter.n_layers)
    data_hash = dataset_hash(rels)
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": "pretrained",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": lm.info,
        "dataset": {"hash": data_hash, "relations": [r.name for r in rels], "max_facts": max_facts,
                    "max_prompt_tokens": max_prompt_tokens},
        "scoring": "first token of the object; a fact is known when the greedy continuation starts with the object "
                   "(case and leading space ignored)",
        "relations": {},
        "layers": layer_ids,
        "versions": library_versions(),
        "seed": seed,
        "settings": settings_record("run" if controls_settings is not None else "probe", {
            "model": model if model is not None or lm.info.get("source") == "embedded" else lm.info.get("name"),
            "gguf_file": gguf_file, "relations": relations, "layers": layers, "analyses": analyses,
            "device": device, "dtype": dtype, "device_map": device_map, "max_memory": max_memory,
            "offload_folder": offload_folder, "quantize": quantize, "batch_size": batch_size,
            "max_facts": max_facts, "max_prompt_tokens": max_prompt_tokens, "seed": seed},
            batch_options(batch_size, analysis_options), controls_settings),
        "timings": timings,
        "errors": [],
        "partial": True,
        "stages": {},
    }
    stages = report["stages"]
    known_key = _digest(model_identity(lm.info), data_hash, max_facts, max_prompt_tokens, batch_size, seed)
    stages["known_facts"] = {"key": known_key, "done": False, "resumed": False}
    previous_known = _previous_known(out, previous, known_key) if previous else {}
    known: dict = {}
    fitted: dict = {}   # relation -> decoder -> the fit at its chosen layer (decoders.safetensors)
    analysed = []   # the relations without the facts that do not fit the context (the analyses' input)

    def save(known_changed: bool = True) -> None:
        """Write report.json (and known_facts.json unless only the analyses moved on since the last save)."""
        report["wall_seconds"] = round(time.perf_counter() - start, 1)
        if out is not None:
            if known_changed:
                write_json(out / "known_facts.json", {name: [r.to_dict() for r in results]
                                                      for name, results in known.items()})
            write_json(out / "report.json", report)

    try:
        t = time.perf_counter()
        reused = 0
        for relation in tqdm(rels, desc="known facts", unit="relation"):
            fit, errors = fitting(lm, relation, max_prompt_tokens)
            analysed.append(Relation(relation.name, relation.templates, relation.neutral_templates, fit,
                                     relation.properties, relation.source))
            facts, unlocated = locatable(lm, analysed[-1])
            report["errors"] += errors + unlocated
            if not facts:
                report["errors"].append(f"{relation.name}: no fact whose subject could be located (and whose "
                                        f"prompt fits); relation skipped")
                continue
            located = Relation(relation.name, relation.templates, relation.neutral_templates, facts,
                               relation.properties, relation.source)
            results = previous_known.get(relation.name)
            if results is not None and [r.subject for r in results] == [f.subject for f in facts]:
                reused += 1
            else:
                results = known_facts(lm, located, batch_size=batch_size)
            known[relation.name] = results
            n_known = sum(r.known for r in results)
            report["relations"][relation.name] = {
                "n_facts": len(results),
                "n_known": n_known,
                "known_rate": n_known / len(results),
                "templates": relation.templates,
                "template_used": relation.templates[0],
                "neutral_templates": relation.neutral_templates,
                "properties": relation.properties,
                "source": relation.source,
            }
        timings["known_facts_s"] = round(time.perf_counter() - t, 1)
        stages["known_facts"].update(done=True, resumed=bool(reused) and reused == len(known))
        save()   # checkpoint: the known facts are safe before the analyses
        if on_known is not None:
            on_known(report, known, lm, analysed)
        if analyses:
            key = _digest(known_key, layer_ids, analyses, sorted((analysis_options or {}).items()))
            stage = stages["analyses"] = {"key": key, "done": False, "resumed": False, "resumed_relations": [],
                                          "resumed_superposition": False}
            before = (previous.get("stages") or {}).get("analyses") or {}
            earlier = previous.get("analyses") if before.get("key") == key else None
            earlier = earlier if isinstance(earlier, dict) else None
            if earlier is not None and out is not None:   # the decoders of the relations taken over

                fitted.update(read_fits(out))
            t = time.perf_counter()
            if earlier is not None and before.get("done"):
                report["analyses"] = earlier
                earlier.setdefault("partial", False)
                stage.update(resumed=True, resumed_relations=list(earlier.get("relations") or {}),
                             resumed_superposition="superposition" in earlier)
            else:
                def checkpoint(partial: dict) -> None:   # the finished relations are safe from an interrupt
                    report["analyses"] = partial
                    save(known_changed=False)     # known_facts.json was written after the known facts

                if earlier is not None:          # an interrupted run's finished parts (same key: same settings)
                    report["analyses"] = {**earlier, "partial": True}   # kept should this run be interrupted too
                    taken = earlier.get("relations") or {}
                    decoders = bool({"lre", "ridge"} & set(analyses))
                    stage["resumed_relations"] = [r.name for r in analysed
                                                  if decoders and isinstance(taken.get(r.name), dict)]
                    stage["resumed_superposition"] = ("superposition" in analyses
                                                      and isinstance(earlier.get("superposition"), dict))
                    stage["resumed"] = (len(stage["resumed_relations"]) == (len(analysed) if decoders else 0)
                                        and stage["resumed_superposition"] == ("superposition" in analyses))
                report["analyses"] = analyses_run.run_analyses(lm, analysed, known, layer_ids,
                                                                  analyses=analyses, seed=seed,
                                                                  on_progress=checkpoint, done=earlier, fitted=fitted,
                                                                  **batch_options(batch_size, analysis_options))
            timings["analyses_s"] = round(time.perf_counter() - t, 1)
            stage["done"] = True
    except KeyboardInterrupt:
        unfinished = [name for name, stage in stages.items() if not stage["done"]]
        report["errors"].append(f"interrupted during {', '.join(unfinished) or 'the end'}: finished stages are kept "
                                f"in this report; rerun with --resume to finish the rest")
        _write_decoders(out, fitted, lm)
        save()
        raise
    report["partial"] = False
    _write_decoders(out, fitted, lm)
    save()
    return report


def _write_decoders(out: Path | None, fitted: dict, lm: LoadedModel) -> None:
    """The fitted decoders beside report.json: decoders.safetensors + decoders.json (``llmprobe.report.notebook``)."""
    if out is not None and fitted:
        save_decoders(out, fitted, {**model_identity(lm.info), "name": lm.info.get("name")})


def batch_options(batch_size: int, analysis_options: dict | None) -> dict:
    """The analysis options with ``batch_size`` (``--batch-size``) as every analysis stage's batch size (at most
    the default 16 for the Jacobians), unless the options set their own."""
    return {"batch_size": batch_size, "jacobian_batch_size": min(AnalysisSettings.jacobian_batch_size, batch_size),
            **(analysis_options or {})}


def summary_table(report: dict) -> str:
    """Plain-text table of known-fact rates per relation."""
    rows = [f"{'relation':<28} {'facts':>6} {'known':>6} {'rate':>6}"]
    for name, rel in report["relations"].items():
        rows.append(f"{name:<28} {rel['n_facts']:>6} {rel['n_known']:>6} {rel['known_rate']:>6.2f}")
    return "\n".join(rows)


__all__ = ["probe", "parse_layers", "library_versions", "summary_table", "DatasetError"]
