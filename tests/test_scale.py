"""Scale: memory-bounded micro-batches with the out-of-memory retry, models split across devices and disk
(accelerate device maps, on CPU here), half precision and quantised weights."""
import json

import pytest
import torch
from tiny_models import save_tiny

from llmprobe.checks import parse_max_memory
from llmprobe.model import batching
from llmprobe.model.batching import run_batched
from llmprobe.model.loading import ModelLoadError, load_model


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


# ------------------------------------------------------------------------------------- models split over devices
@pytest.fixture(scope="module")
def relation_files(tmp_path_factory):
    """Two relations over 24 shared subjects (enough for the decoders' splits and the superposition table)."""
    folder = tmp_path_factory.mktemp("relations")
    subjects = [f"Land{i}" for i in range(24)]
    paths = []
    for name, template, objects in (("capital", "The capital of {} is", ["Paris", "Tokyo", "Rome", "Cairo"]),
                                    ("continent", "{} is located in", ["Europe", "Asia", "Africa"])):
        data = {"name": name, "templates": [template], "neutral_templates": ["{}", "Tell me about {}."],
                "facts": [{"subject": s, "object": objects[i % len(objects)]} for i, s in enumerate(subjects)]}
        (folder / f"{name}.json").write_text(json.dumps(data))
        paths.append(str(folder / f"{name}.json"))
    return paths


@pytest.fixture
def everything_known(monkeypatch):
    """A random model knows no fact; count every fact as known so that the analyses run."""
    import llmprobe.model.known as known_module

    monkeypatch.setattr(known_module, "is_known", lambda text, obj: True)


def _metrics(tree, path=""):
    """{path: number} of every number in a report part, timings left out."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() if "timing" not in key and not key.endswith("seconds")
                for k, v in _metrics(value, f"{path}.{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, value in enumerate(tree) for k, v in _metrics(value, f"{path}[{i}]").items()}
    return {path: float(tree)} if isinstance(tree, (int, float)) and not isinstance(tree, bool) else {}


OFFLOAD = "cpu=150000"   # bytes: the embedding and block 0 in memory, blocks 1-2, the norm and the head on disk


def test_offloaded_model_gives_the_numbers_of_the_model_in_one_piece(tiny_folder, tiny_lm, relation_files,
                                                                     everything_known, tmp_path):
    from llmprobe.jobs.probe import probe
    from llmprobe.model.capture import capture, patch
    from llmprobe.model.engine import layer_sequences, next_token_predictions
    from llmprobe.model.lre import subject_jacobians
    from llmprobe.model.subjects import encode

    split = load_model(tiny_folder, device="cpu", device_map="auto", max_memory=OFFLOAD,
                       offload_folder=tmp_path / "offload")
    placed = split.model.hf_device_map
    assert placed["model.layers.0"] == "cpu" and placed["model.layers.1"] == "disk" and placed["lm_head"] == "disk"
    assert split.model.model.layers[1].mlp.down_proj.weight.device.type == "meta"     # really not in memory
    assert split.info["placement"] == {"cpu": 2, "disk": 5}
    on_disk = load_model(tiny_folder, device="cpu", device_map="auto", max_memory="cpu=1000",
                         offload_folder=tmp_path / "offload-all")                   # every weight, embedding too
    assert on_disk.info["placement"] == {"disk": 1} and on_disk.adapter.embed.weight.device.type == "meta"
    names = ["blocks.0.resid_post", "blocks.1.attn_out", "blocks.2.mlp_hidden", "blocks.2.resid_post", "ln_final",
             "logits"]
    template, subjects = "The capital of {} is", ["Land1", "Land12", "Land3"]
    enc = encode(tiny_lm.tokenizer, template, subjects, padding_side="left")
    delta = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    for lm in (tiny_lm, split, on_disk):
        lm.resumed = [next_token_predictions(lm, template, subjects, layer, delta, return_logits=True,
                                             resume=layer_sequences(lm, template, subjects, layer))
                      for layer in (0, 1)]                    # blocks up to 0 (in memory) or 1 (on disk) skipped
        with patch(lm.model, "blocks.0.resid_post", enc.subject_last, delta=delta):   # block 0 in memory ...
            lm.got = capture(lm.model, names, enc.input_ids, enc.attention_mask)     # ... block 1 from disk
        lm.J = subject_jacobians(lm, template, subjects, [0, 1])
    # the skipped blocks got accelerate's dispatch wrapper back (it moves inputs between GPUs; on CPU nothing shows it)
    assert all("forward" in block.__dict__ for block in split.adapter.blocks[:2])
    for lm in (split, on_disk):
        for name in names:
            assert torch.allclose(tiny_lm.got[name], lm.got[name], atol=1e-5), name
        for layer in (0, 1):
            assert torch.allclose(tiny_lm.J[layer].W, lm.J[layer].W, atol=1e-5)
        for clean, split_resumed in zip(tiny_lm.resumed, lm.resumed):
            assert torch.allclose(clean, split_resumed, atol=1e-5)
    options = dict(relations=relation_files, layers="1", analyses="lre,ridge,superposition", device="cpu")
    whole = probe(tiny_folder, **options, out=tmp_path / "whole")
    offloaded = probe(tiny_folder, **options, device_map="auto", max_memory=OFFLOAD,
                      offload_folder=tmp_path / "offload2", out=tmp_path / "offloaded")
    assert offloaded["model"]["placement"] == {"cpu": 2, "disk": 5}
    assert whole["errors"] == offloaded["errors"] == [] and whole["analyses"]["errors"] == []
    ours, theirs = (_metrics({"relations": r["relations"], "analyses": r["analyses"]}) for r in (whole, offloaded))
    assert len(ours) > 300 and ours.keys() == theirs.keys()
    assert any(".superposition.layers.1.r2.value" in key for key in ours)
    assert all(abs(ours[k] - theirs[k]) <= 1e-5 * max(1.0, abs(ours[k])) for k in ours), \
        [k for k in ours if abs(ours[k] - theirs[k]) > 1e-5 * max(1.0, abs(ours[k]))][:5]


# ---------------------------------------------------------------------------------------------- half precision
BF16_STATE_TOLERANCE = 1e-2   # relative; bfloat16 keeps 8 significant bits (2^-8 = 0.4% per rounding)


def test_bfloat16_model_matches_float32_within_the_stated_tolerance(tiny_folder, tiny_lm, relation_files,
                                                                    everything_known, tmp_path):
    """States and Jacobians of the bf16 model are within 1% (relative Frobenius error; measured: 0.3-0.5%) of
    float32's: the model computes in bf16, llmprobe copies states to float32 on CPU and fits in float64. Report
    metrics: a continuous value within 0.02, a proportion within 0.02 + 1/n (one prediction at a near-tie may
    flip between precisions)."""
    from llmprobe.jobs.probe import probe
    from llmprobe.model.engine import relation_states
    from llmprobe.model.lre import subject_jacobians

    half = load_model(tiny_folder, device="cpu", dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    subjects = [f"Land{i}" for i in range(6)]
    for layer in (0, 1):
        a = relation_states(tiny_lm, "The capital of {} is", subjects, [layer])
        b = relation_states(half, "The capital of {} is", subjects, [layer])
        assert b.H[layer].dtype == torch.float32
        assert (a.H[layer] - b.H[layer]).norm() / a.H[layer].norm() < BF16_STATE_TOLERANCE
        Ja = subject_jacobians(tiny_lm, "The capital of {} is", subjects, layer)
        Jb = subject_jacobians(half, "The capital of {} is", subjects, layer)
        assert Jb.J.dtype == torch.float32 and (Ja.W - Jb.W).norm() / Ja.W.norm() < BF16_STATE_TOLERANCE
    options = dict(relations=relation_files, layers="1", analyses="lre,ridge,superposition", device="cpu")
    full = probe(tiny_folder, **options, out=tmp_path / "f32")
    bf16 = probe(tiny_folder, **options, dtype="bfloat16", out=tmp_path / "bf16")
    assert bf16["model"]["dtype"] == "bfloat16" and bf16["errors"] == [] and bf16["analyses"]["errors"] == []
    checked = 0

    def compare(a, b, path):
        nonlocal checked
        if isinstance(a, dict) and isinstance(a.get("value"), (int, float)) and not isinstance(a["value"], bool):
            n = a.get("n") or 0
            tolerance = 0.02 + (1 / n if a.get("kind") == "proportion" and n else 0)
            assert abs(a["value"] - b["value"]) <= tolerance, (path, a["value"], b["value"])
            checked += 1
        if isinstance(a, dict):
            for key in a:
                compare(a[key], b[key], f"{path}.{key}")
        elif isinstance(a, list):
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{path}[{i}]")

    compare(full["analyses"], bf16["analyses"], "analyses")
    assert checked > 30


# --------------------------------------------------------------------------------------------- quantised weights
def test_quantization_without_bitsandbytes_or_cuda_is_refused(tiny_folder, tmp_path):
    import importlib.util
    import shutil

    from llmprobe.cli import main

    missing = importlib.util.find_spec("bitsandbytes") is None
    if not missing and torch.cuda.is_available():
        pytest.skip("bitsandbytes and CUDA are here: quantisation is supported")
    reason = "needs the bitsandbytes package" if missing else "needs a CUDA device"
    with pytest.raises(ModelLoadError, match=f"--quantize 4bit.*{reason}"):
        load_model(tiny_folder, device="cpu", quantize="4bit")
    assert main(["probe", tiny_folder, "--quantize", "8bit", "--out", str(tmp_path / "q")]) == 2
    folder = shutil.copytree(tiny_folder, tmp_path / "gptq")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ModelLoadError, match="gptq-quantised weights, which llmprobe does not support"):
        load_model(str(folder), device="cpu")
    dequantised = shutil.copytree(tiny_folder, tmp_path / "from_gguf")   # saved after dequantising a GGUF file
    (dequantised / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "gguf", "gguf_file": "model.Q4_1.gguf", "dequantize": False}}))
    assert load_model(str(dequantised), device="cpu").adapter.d_model == config["hidden_size"]


# ---------------------------------------------------------------------------------------------- command line
def test_cli_batch_size_reaches_every_batched_stage_and_device_flags_reach_the_loader(
        tiny_folder, relation_files, everything_known, tmp_path, monkeypatch, capsys):
    import llmprobe.analyses.decoders as decoders
    import llmprobe.model.engine as engine
    import llmprobe.model.known as known_module
    import llmprobe.model.lre as lre
    from llmprobe.cli import main

    sizes: dict[str, set] = {}

    def spy(fn, n, batch_size, *, stage, **kwargs):
        sizes.setdefault(stage, set()).add(batch_size)
        return run_batched(fn, n, batch_size, stage=stage, **kwargs)

    jacobian = decoders.subject_jacobians

    def spy_jacobians(*args, **kwargs):
        sizes.setdefault("jacobians", set()).add(kwargs["batch_size"])
        return jacobian(*args, **kwargs)

    monkeypatch.setattr(engine, "run_batched", spy)
    monkeypatch.setattr(lre, "run_batched", spy)
    monkeypatch.setattr(known_module, "run_batched", spy)
    monkeypatch.setattr(decoders, "subject_jacobians", spy_jacobians)
    assert main(["run", tiny_folder, "--relations", *relation_files, "--layers", "1", "--batch-size", "5",
                 "--no-controls", "--out", str(tmp_path / "run")]) == 0
    assert {"known facts", "relation states", "subject states", "next-token predictions", "layer sequences",
            "jacobians"} <= sizes.keys()
    assert all(size == {5} for size in sizes.values()), sizes
    assert json.loads((tmp_path / "run" / "report.json").read_text())["analyses"]["settings"]["batch_size"] == 5
    assert main(["probe", tiny_folder, "--relations", *relation_files, "--device-map", "sequential",
                 "--max-memory", OFFLOAD, "--offload-folder", str(tmp_path / "offload"),
                 "--out", str(tmp_path / "probe")]) == 0
    model = json.loads((tmp_path / "probe" / "report.json").read_text())["model"]
    assert model["placement"] == {"cpu": 2, "disk": 5} and model["device_map"] == "sequential"
    with pytest.raises(SystemExit):
        main(["probe", tiny_folder, "--device-map", "auto", "--max-memory", "cpu=lots"])
    assert "bad size 'lots'" in capsys.readouterr().err
    assert main(["probe", tiny_folder, "--max-memory", "cpu=1GiB", "--out", str(tmp_path / "p")]) == 2
    assert "need --device-map" in capsys.readouterr().err
