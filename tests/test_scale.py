"""Scale: memory-bounded micro-batches with the out-of-memory retry, models split across devices and disk
(accelerate device maps, on CPU here), half precision and quantised weights."""
import json

import pytest
import torch

from llmprobe import batching
from llmprobe.batching import run_batched
from llmprobe.loading import ModelLoadError, load_model, parse_max_memory
from tiny_models import save_tiny


def _failing_above(limit: int, calls: list):
    """A batched stage that runs out of memory (CUDA's error type) for micro-batches larger than ``limit``."""
    def fn(part: slice) -> torch.Tensor:
        calls.append(part.stop - part.start)
        if part.stop - part.start > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.arange(part.start, part.stop, dtype=torch.float64) ** 2
    return fn


def test_out_of_memory_halves_the_batch_once_and_gives_the_same_results(capsys):
    expected = torch.arange(23, dtype=torch.float64) ** 2
    calls = []
    got = torch.cat(run_batched(_failing_above(3, calls), 23, 16, stage="test stage A"))
    assert torch.equal(got, expected)
    assert calls[:4] == [16, 8, 4, 2] and set(calls[4:]) == {2, 1}   # 16 -> 8 -> 4 -> 2, kept to the end
    err = capsys.readouterr().err
    assert err.count("out of memory") == 1 and "test stage A" in err and "halved to 8" in err
    calls.clear()                     # the same stage again: starts at the size that worked, says nothing
    assert torch.equal(torch.cat(run_batched(_failing_above(3, calls), 23, 16, stage="test stage A")), expected)
    assert set(calls) == {2, 1} and capsys.readouterr().err == ""
    assert torch.equal(torch.cat(run_batched(_failing_above(100, []), 23, 16, stage="test stage B")), expected)


def test_out_of_memory_at_batch_one_names_the_stage_and_what_to_try():
    with pytest.raises(torch.OutOfMemoryError, match="test stage C: out of memory with a micro-batch of 1") as info:
        run_batched(_failing_above(0, []), 5, 4, stage="test stage C")
    assert "--device-map" in str(info.value) and "--dtype bfloat16" in str(info.value)
    with pytest.raises(ValueError, match="not an OOM"):      # other errors pass through untouched
        run_batched(lambda part: (_ for _ in ()).throw(ValueError("not an OOM")), 5, 4, stage="test stage D")


def test_memory_budget_caps_the_batch_on_cuda_only(monkeypatch, tiny_lm):
    prompts = ["The capital of France is"] * 4
    assert batching.memory_batch_size(tiny_lm, prompts) > 10 ** 9          # CPU: not budgeted
    per_item = batching.item_bytes(tiny_lm, len(tiny_lm.tokenizer(prompts[0])["input_ids"]))
    assert per_item > 0
    param = next(tiny_lm.model.parameters())
    monkeypatch.setattr(type(param), "device", property(lambda self: torch.device("cuda:0")))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (per_item * 7, per_item * 100))
    assert batching.memory_batch_size(tiny_lm, prompts) == 3                 # half of 7 items' worth


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def tiny_lm(tiny_folder):
    return load_model(tiny_folder, device="cpu")


def test_max_memory_parsing_and_refusals(tiny_folder, tmp_path):
    assert parse_max_memory("cpu=2GiB,0=70GiB") == {"cpu": "2GiB", 0: "70GiB"}
    assert parse_max_memory(["cpu=200MiB", "cuda:1=10GB"]) == {"cpu": "200MiB", 1: "10GB"}
    assert parse_max_memory("cpu=150000") == {"cpu": 150000}
    for bad, message in (("cpu", "no size"), ("gpu=2GiB", "unknown device 'gpu'"), ("cpu=lots", "bad size")):
        with pytest.raises(ValueError, match=message):
            parse_max_memory(bad)
    with pytest.raises(ModelLoadError, match="need --device-map"):
        load_model(tiny_folder, device="cpu", max_memory="cpu=1GiB")
    with pytest.raises(ModelLoadError, match="unknown device map 'everywhere'"):
        load_model(tiny_folder, device="cpu", device_map="everywhere")
