"""Every ```python snippet of README.md and docs/*.md runs as written, on a tiny random-init Llama (30 blocks,
so the layer numbers the snippets name exist) where a snippet names the embedded model or a report folder.

The names a snippet leaves to the reader (``h``, ``path``, ``lm``, ``relations``, ...) are given here, each with
the shape the snippet's comment states; ``runs/smollm2`` is a real probe report of the tiny model (every fact
forced known, since a random model knows none). A snippet that is a signature, not code, is fenced ```text."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS, tiny_tokenizer
from transformers import AutoModelForCausalLM

import llmprobe.model.known as known_module
import llmprobe.model.loading as loading
from llmprobe.datasets import load_relations
from llmprobe.jobs.probe import probe
from llmprobe.model.known import known_facts

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
D, BLOCKS = 32, 30
RELATIONS = ["country_capital", "country_language"]
FAST = dict(n_splits=2, n_boot=50, folds=3, max_val_pairs=3, max_test_pairs=5, max_swap_subjects=3,
            random_control=False, betas=(1.0, 2.0), edit_ranks=(8,))


def snippets() -> list[tuple[str, str]]:
    """(id "FILE[k]", code) of every ```python block."""
    found = []
    for path in DOCS:
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        found += [(f"{path.relative_to(ROOT)}[{k}]", code) for k, code in enumerate(blocks)]
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny model's folder and a probe report folder runs/smollm2 of it, under one working folder."""
    work = tmp_path_factory.mktemp("snippets")
    tokenizer = tiny_tokenizer(with_bos=True)
    config = CONFIGS["llama"](len(tokenizer))
    config.num_hidden_layers, config.pad_token_id = BLOCKS, tokenizer.pad_token_id
    torch.manual_seed(0)
    folder = work / "path" / "to" / "model"          # the folder docs/interop.md names
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(known_module, "is_known", lambda text, obj: True)
        probe(str(folder), relations=RELATIONS, max_facts=24, layers="0,6,12,18,24,29", device="cpu",
              analyses="lre,ridge,superposition", out=work / "runs" / "smollm2", analysis_options=FAST)
    return work, folder


@pytest.mark.parametrize("where,code", snippets(), ids=[where for where, _ in snippets()])
def test_snippet_runs(where, code, world, monkeypatch):
    work, folder = world
    monkeypatch.chdir(work)
    real_load = loading.load_model
    # the embedded SmolLM2 is the tiny model here; a folder or hub name as the snippet gives it
    monkeypatch.setattr(loading, "load_model", lambda name=None, **kw: real_load(name or str(folder), **kw))
    monkeypatch.setattr(known_module, "is_known", lambda text, obj: True)
    lm = real_load(str(folder), device="cpu")
    relations = [r.with_facts(r.facts[:24]) for r in load_relations(RELATIONS)]
    g = torch.Generator().manual_seed(0)
    namespace = {
        "path": str(folder), "folder": str(folder), "lm": lm, "model": lm.model, "relations": relations,
        "known": {r.name: known_facts(lm, r) for r in relations},
        "input_ids": lm.tokenizer(["The capital of France is"], return_tensors="pt").input_ids,
        "h": torch.randn(3, D, generator=g), "o_source": torch.randn(3, D, generator=g),
        "o_target": torch.randn(3, D, generator=g), "direction": torch.randn(D, generator=g),
        "__name__": "snippet",
    }
    exec(compile(code, where, "exec"), namespace)


def test_the_snippets_are_found():
    """The collector sees the snippets the docs hold (a renamed fence would silently test nothing)."""
    found = [where for where, _ in snippets()]
    assert "README.md[0]" in found and any(w.startswith("docs/notebook.md") for w in found) and len(found) >= 6
