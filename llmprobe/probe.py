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

from .datasets import DatasetError, Relation, load_relations
from .io import write_json
from .known import known_facts
from .loading import LoadedModel, load_model
from .subjects import locate_errors

REPORT_SCHEMA_VERSION = 1
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
    """``all`` | ``0,6,12`` | ``-1`` | ``every:3`` -> sorted layer indices in 0..n_layers-1."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    if isinstance(spec, str) and spec.startswith("every:"):
        step = int(spec.split(":", 1)[1])
        return sorted(set(range(0, n_layers, step)) | {n_layers - 1})
    items = spec.split(",") if isinstance(spec, str) else spec
    layers = set()
    for item in items:
        try:
            layer = int(item)
        except ValueError:
            raise ValueError(f"bad layer {item!r} in --layers {spec!r}: use all, every:K, or integers") from None
        if not -n_layers <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range: the model has {n_layers} layers")
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
    errors = [f"{relation.name}: fact ({fact.subject!r}, {fact.object!r}): {error}"
              for fact, error in zip(relation.facts, found) if error is not None]
    return ok, errors


def probe(
    model: str | None = None,
    *,
    gguf_file: str | None = None,
    relations: list[str] | None = None,
    layers: str | list[int] | None = "every:3",
    analyses: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int = 32,
    max_facts: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    trust_remote_code: bool = False,
    lm: LoadedModel | None = None,
    on_known=None,
) -> dict:
    """Probe ``model`` (None = embedded default) on ``relations`` (None = all bundled); returns the report.

    Writes ``out/report.json`` and ``out/known_facts.json`` when ``out`` is given. ``max_facts`` keeps the first
    facts of each relation (country relations list the most populous first). ``on_known(report, known)`` is called
    once the known facts are checked, before the analyses (``llmprobe run`` starts its controls there).
    """
    start = time.perf_counter()
    random.seed(seed)
    torch.manual_seed(seed)
    rels = load_relations(relations)
    if max_facts:
        rels = [Relation(r.name, r.templates, r.neutral_templates, r.facts[:max_facts], r.properties, r.source)
                for r in rels]
    lm = lm or load_model(model, gguf_file=gguf_file, device=device, dtype=dtype,
                          trust_remote_code=trust_remote_code)
    timings = {"load_s": round(time.perf_counter() - start, 1)}
    layer_ids = parse_layers(layers, lm.adapter.n_layers)
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": "pretrained",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": lm.info,
        "dataset": {"hash": dataset_hash(rels), "relations": [r.name for r in rels], "max_facts": max_facts},
        "scoring": "first token of the object; a fact is known when the greedy continuation starts with the object "
                   "(case and leading space ignored)",
        "relations": {},
        "layers": layer_ids,
        "versions": library_versions(),
        "seed": seed,
        "timings": timings,
        "errors": [],
    }
    known = {}
    for relation in tqdm(rels, desc="known facts", unit="relation"):
        facts, errors = locatable(lm, relation)
        report["errors"] += errors
        if not facts:
            report["errors"].append(f"{relation.name}: no fact whose subject could be located; relation skipped")
            continue
        located = Relation(relation.name, relation.templates, relation.neutral_templates, facts,
                           relation.properties, relation.source)
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
    timings["known_facts_s"] = round(time.perf_counter() - start - timings["load_s"], 1)
    if on_known is not None:
        on_known(report, known)
    if analyses:
        from .analyses import run_analyses

        t = time.perf_counter()
        report["analyses"] = run_analyses(lm, rels, known, layer_ids, analyses=tuple(analyses), seed=seed)
        timings["analyses_s"] = round(time.perf_counter() - t, 1)
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    if out is not None:
        out = Path(out)
        write_json(out / "known_facts.json", {name: [r.to_dict() for r in results] for name, results in known.items()})
        write_json(out / "report.json", report)
    return report


def summary_table(report: dict) -> str:
    """Plain-text table of known-fact rates per relation."""
    rows = [f"{'relation':<28} {'facts':>6} {'known':>6} {'rate':>6}"]
    for name, rel in report["relations"].items():
        rows.append(f"{name:<28} {rel['n_facts']:>6} {rel['n_known']:>6} {rel['known_rate']:>6.2f}")
    return "\n".join(rows)


__all__ = ["probe", "parse_layers", "library_versions", "summary_table", "DatasetError"]
