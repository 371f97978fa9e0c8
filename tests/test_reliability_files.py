"""Reliability of what llmprobe reads and writes (issue 11, rows 6-10): safe exports, clear loading errors,
locked sweeps and whole files, readable datasets; (issue 23, rows 6-8, 10, 11) models that are what they say and
hostile files read back; (issue 23, rows 2, 4, 11, 13) a folder holds one run's files, compare and rerun write
beside their inputs, malformed report.json files say what is wrong. Each test failed before its fix."""
import csv
import functools
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny, write_capital_relation

from llmprobe.analyses.saved import load_decoder
from llmprobe.checks import UsageError
from llmprobe.cli import main
from llmprobe.datasets import DatasetError, load_relations
from llmprobe.io import append_jsonl, read_jsonl, write_json
from llmprobe.jobs.probe import probe
from llmprobe.jobs.rerun import rerun
from llmprobe.model.loading import ModelLoadError, load_model
from llmprobe.report.render import compare, metric_rows, render_markdown, write_csv
from llmprobe.report.schema import REPORT_SCHEMA_VERSION, read_report

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ row 6: Markdown and CSV exports
def _hostile_report(name="m<script>alert(1)</script>\n# injected model"):
    return {"schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "model": {"name": name, "n_layers": 3},
            "relations": {"rel\n# injected heading <b>x</b>": {"known_rate": 0.5, "n_facts": 4},
                          '=HYPERLINK("http://evil","x")': {"known_rate": -0.12, "n_facts": 2},
                          "@SUM(A1)": {"known_rate": 0.25, "n_facts": 2}},
            "errors": ["fact ('<img src=x onerror=alert(1)>', 'y') skipped\n# injected error heading"]}


def test_markdown_escapes_html_and_newlines_everywhere():
    text = render_markdown([_hostile_report()], "title <script>x</script>\n# injected title")
    assert "<script" not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;" in text and "&lt;img" in text
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [h for h in headings if "injected" in h and not h.startswith("# title")], headings
    assert len([h for h in headings if h.startswith("# ")]) == 1
    assert not [line for line in text.splitlines() if line.lstrip("- ").startswith("# injected")]


def test_csv_neutralises_formula_cells_and_keeps_numbers(tmp_path):
    report = _hostile_report(name="+cmd|' /C calc'!A0")
    write_csv(metric_rows(report), tmp_path / "metrics.csv")
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key, cell in row.items():
            if cell and cell[0] in "=+-@\t\r":
                assert key in ("value", "lo", "hi", "control_value", "depth"), (key, cell)
                float(cell)  # only numbers may start with a sign
    by_relation = {r["relation"]: r for r in rows}
    assert "'=HYPERLINK(\"http://evil\",\"x\")" in by_relation
    assert "'@SUM(A1)" in by_relation
    assert by_relation["'=HYPERLINK(\"http://evil\",\"x\")"]["value"] == "-0.12"
    assert all(r["source"].startswith("'+cmd") for r in rows)


# ------------------------------------------------------------------ row 7: loading
@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    return save_tiny("gpt2", tmp_path_factory.mktemp("gpt2") / "model")


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model-folder", "~/no-such-llmprobe-model"])
def test_missing_local_path_is_named_as_a_missing_path(name):
    with pytest.raises(ModelLoadError, match="no such (folder|file)"):
        load_model(name, device="cpu")


def test_truncated_or_corrupt_safetensors_name_the_file(tiny_gpt2, tmp_path):
    folder = shutil.copytree(tiny_gpt2, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for broken in (data[: len(data) // 2], b"not a safetensors file at all"):
        weights.write_bytes(broken)
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            load_model(str(folder), device="cpu")


def test_pickle_weights_need_allow_pickle_and_load_weights_only(tiny_gpt2, tmp_path):
    folder = shutil.copytree(tiny_gpt2, tmp_path / "m")
    state = {k: v for k, v in load_model(str(folder), device="cpu").model.state_dict().items()}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow.pickle"):
        load_model(str(folder), device="cpu")
    lm = load_model(str(folder), device="cpu", allow_pickle=True)
    assert lm.adapter.n_layers == 3

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        load_model(str(folder), device="cpu", allow_pickle=True)


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x"])
def test_unavailable_or_unknown_device_lists_the_choices(tiny_gpt2, device):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("mps is available here")
    with pytest.raises(ModelLoadError, match="cpu.*cuda"):
        load_model(str(tiny_gpt2), device=device)


# ------------------------------------------------------------------ row 8: files
SWEEP_CHILD = textwrap.dedent("""
    import os, sys, time
    import synthetic.sweep as sw
    from synthetic.sweep import SweepConfig, run_sweep
    from synthetic.train import TrainConfig

    real = sw._run_point

    def slow(*args, **kwargs):          # long enough that the two processes overlap on every point
        time.sleep(0.3)
        return real(*args, **kwargs)

    sw._run_point = slow
    go = sys.argv[2]
    while not os.path.exists(go):       # start both sweeps together
        time.sleep(0.01)
    cfg = SweepConfig(subjects=[16], relations=[1, 2], seeds=[0], modes=["trainable"], d_min=2, d_max=12,
                      batched=False, train=TrainConfig(max_steps=150, progress=False))
    run_sweep(cfg, sys.argv[1])
""")


def test_concurrent_sweeps_train_every_point_once(tmp_path):
    out, go = tmp_path / "sweep", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg")
    procs = [subprocess.Popen([sys.executable, "-c", SWEEP_CHILD, str(out), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.write_text("go")
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    rows = read_jsonl(out / "results.jsonl")
    keys = [r["key"] for r in rows]
    assert rows and len(keys) == len(set(keys)), logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_runs"] == len(set(keys))


def test_append_jsonl_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\n{"b": 2, "tor')          # killed in the middle of a line
    append_jsonl(path, {"c": 3})
    with pytest.warns(UserWarning, match="results.jsonl.*line 2"):
        records = read_jsonl(path)
    assert records == [{"a": 1}, {"c": 3}]


def test_a_results_line_nested_too_deeply_is_skipped_like_a_torn_one(tmp_path):
    """read_jsonl parses each line through checks.parse_json: a line too deep for json (RecursionError, which
    escaped before) is skipped with the same warning as a torn line."""
    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"c": 3}\n')
    with pytest.warns(UserWarning, match="results.jsonl.*line 2 is not valid JSON"):
        assert read_jsonl(path) == [{"a": 1}, {"c": 3}]


@pytest.mark.parametrize("index, says", [
    ("{not json", r"not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, r"nested too deeply to read"),
    ('["a list"]', r"'weight_map' must map tensor names to shard file names"),
], ids=["cut", "deep", "list"])
def test_an_unreadable_weights_index_names_itself(tiny_gpt2, tmp_path, index, says):
    folder = shutil.copytree(tiny_gpt2, tmp_path / "model")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json.*" + says):
        load_model(str(folder), device="cpu")


def test_stale_tmp_files_are_cleaned_on_the_next_write(tmp_path):
    stale = tmp_path / ".report.json.abc123.tmp"
    stale.write_text("half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".report.json.def456.tmp"   # another writer may be busy with this one
    fresh.write_text("half")
    write_json(tmp_path / "report.json", {"ok": 1})
    assert not stale.exists() and fresh.exists()
    assert json.loads((tmp_path / "report.json").read_text()) == {"ok": 1}


def test_checkpoint_weights_optimizer_and_step_are_one_file(tmp_path):
    from synthetic.tasks import random_bijections
    from synthetic.train import TrainConfig, train

    task = random_bijections(16, 2, seed=0)
    cfg = TrainConfig(max_steps=40, target_acc=1.1, progress=False)
    out = tmp_path / "run"
    train(task, 8, config=cfg, out_dir=str(out), callback=lambda step, loss, acc: step >= 10)
    # a kill between the two writes of the old pair left checkpoint.json behind the weights
    state = json.loads((out / "checkpoint.json").read_text())
    write_json(out / "checkpoint.json", dict(state, step=3, opt_step={k: 3.0 for k in state["opt_step"]}))
    resumed = train(task, 8, config=cfg, out_dir=str(out), callback=lambda step, loss, acc: True)
    assert resumed.steps == 11
    assert not [p.name for p in out.iterdir() if "tmp" in p.name]


def test_construction_json_is_written_atomically(tmp_path, monkeypatch):
    import llmprobe.io
    from synthetic.cli import cmd_construct

    written = []
    real = llmprobe.io.write_json
    monkeypatch.setattr(llmprobe.io, "write_json", lambda path, obj: written.append(path) or real(path, obj))

    class Args:
        subjects, relations, codes, variant, precision_bits, out = "16", "2", "sphere", "erase", 8, str(tmp_path)

    cmd_construct(Args())
    assert [Path(p).name for p in written] == ["construction.json"]
    assert json.loads((tmp_path / "construction.json").read_text())[0]["accuracy"] == 1.0


# ------------------------------------------------------------------ row 9: compare
def _report_dir(folder: Path, report) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(report) if not isinstance(report, str) else report)
    return folder


def _plain(name="m", version=REPORT_SCHEMA_VERSION):
    return {"schema_version": version, "kind": "pretrained", "model": {"name": name, "n_layers": 3},
            "relations": {"capital": {"known_rate": 0.5, "n_facts": 4}}}


def test_compare_refuses_unknown_schema_versions(tmp_path):
    folder = _report_dir(tmp_path / "future", _plain(version=REPORT_SCHEMA_VERSION + 1))
    with pytest.raises(ValueError, match=f"schema_version {REPORT_SCHEMA_VERSION + 1}.*supported"):
        compare([folder], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("text", ['["schema_version"]', "[1, 2]", '"schema_version"', "3",
                                  '{"schema_version": 1, "model": []}'.replace("1", str(REPORT_SCHEMA_VERSION)),
                                  '{"schema_version": "two"}'])
def test_malformed_report_json_gives_a_clear_error(tmp_path, text):
    folder = _report_dir(tmp_path / "bad", text)
    with pytest.raises(ValueError, match="report.json"):
        read_report(folder)


def test_compare_labels_two_runs_of_one_model_apart(tmp_path):
    a = _report_dir(tmp_path / "run1", _plain("gpt2"))
    b = _report_dir(tmp_path / "run2", dict(_plain("gpt2"), relations={"capital": {"known_rate": 0.9,
                                                                                   "n_facts": 4}}))
    compare([a, b], tmp_path / "cmp", formats=("csv",))
    with open(tmp_path / "cmp" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len({r["source"] for r in rows}) == 2
    assert {r["source"] for r in rows} == {"gpt2 (run1)", "gpt2 (run2)"}


# ------------------------------------------------------------------ row 10: datasets
RELATION = {"name": "café_relation", "templates": ["{} is in"], "facts": [{"subject": "Café", "object": "Paris"}]}


def _relation_text(suffix: str) -> str:
    """The same one-fact relation with a non-ASCII subject, as a .json, .jsonl or .csv file's text."""
    return {".json": json.dumps(RELATION, ensure_ascii=False),
            ".jsonl": json.dumps({"subject": "Café", "object": "Paris"}, ensure_ascii=False) + "\n",
            ".csv": "subject,object\nCafé,Paris\n"}[suffix]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_latin1_file_gives_an_error_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"latin{suffix}"
    path.write_bytes(_relation_text(suffix).encode("latin-1"))
    with pytest.raises(DatasetError, match=f"latin{suffix}.*UTF-8"):
        load_relations([str(path)], templates=["{} is in"])


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_utf8_bom_is_accepted_in_every_format(tmp_path, suffix):
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + _relation_text(suffix).encode("utf-8"))
    relations = load_relations([str(path)], templates=["{} is in"])
    assert relations[0].facts[0].subject == "Café"


# ------------------------------------------------------------------ issue 23: models that are what they say
def _model_copy(tiny, tmp_path, **config_changes) -> Path:
    """A copy of a tiny model folder, its config.json changed as given."""
    folder = shutil.copytree(tiny, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def _relation_file(tmp_path) -> str:
    path = tmp_path / "capital.json"
    path.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                "facts": [{"subject": s, "object": o} for s, o in
                                          (("France", "Paris"), ("Japan", "Tokyo"), ("Egypt", "Cairo"))]}))
    return str(path)


def _probe_cli(model: str, tmp_path, capsys, *options) -> tuple[int, str]:
    """(exit status, stderr) of ``llmprobe probe MODEL`` on a three-fact relation."""
    from llmprobe.cli import main

    capsys.readouterr()
    status = main(["probe", model, "--relations", _relation_file(tmp_path), "--layers", "0", "--analyses", "lre",
                   "--out", str(tmp_path / "out"), *options])
    return status, capsys.readouterr().err


def test_sharded_weights_must_lie_in_the_model_folder_and_are_hashed(tiny_gpt2, tmp_path, capsys):
    """Row 6: a weight_map pointing outside the folder loaded (exit 0, weights_hash null); now refused. Shards in
    a subfolder load, each header is checked and the hash covers them (so rerun can verify them)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_gpt2, tmp_path / "a" / "b" / "model")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"shard-1.safetensors": keys[: len(keys) // 2], "shard-2.safetensors": keys[len(keys) // 2:]}

    def write_shards(where: Path, prefix: str) -> list[Path]:
        where.mkdir(parents=True, exist_ok=True)
        for name, part in shards.items():
            save_file({k: state[k] for k in part}, where / name, metadata={"format": "pt"})
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: prefix + name for name, part in shards.items() for k in part}}))
        return [where / name for name in shards]

    write_shards(tmp_path, "../../../")
    with pytest.raises(ModelLoadError, match=r"shard '\.\./\.\./\.\./shard-1\.safetensors' lies outside the model "
                                             r"folder"):
        load_model(str(folder), device="cpu")
    status, err = _probe_cli(str(folder), tmp_path, capsys)
    assert status == 2 and "model.safetensors.index.json" in err and "outside the model folder" in err
    inside = write_shards(folder / "shards", "shards/")
    lm = load_model(str(folder), device="cpu")
    assert torch.equal(lm.model.state_dict()["transformer.h.2.mlp.c_fc.weight"],
                       state["transformer.h.2.mlp.c_fc.weight"])
    assert lm.info["weights_hash"] == "sha256:" + hashlib.sha256(b"".join(p.read_bytes() for p in inside)).hexdigest()
    inside[1].write_bytes(inside[1].read_bytes()[:100])                   # a truncated shard is named
    with pytest.raises(ModelLoadError, match="shard-2.safetensors: corrupt or truncated"):
        load_model(str(folder), device="cpu")
    inside[1].unlink()
    with pytest.raises(ModelLoadError, match="shard 'shards/shard-2.safetensors' is missing"):
        load_model(str(folder), device="cpu")


def test_config_declaring_other_layers_than_the_weights_hold_is_refused(tiny_gpt2, tmp_path, capsys):
    """Row 7: 6 declared layers over weights of 3 loaded with blocks 3-5 randomly initialised (exit 0); now the
    missing (or, for fewer declared layers, unexpected) weights are an error naming the keys, and other shapes
    are said to be other shapes."""
    more = _model_copy(tiny_gpt2, tmp_path, n_layer=6)
    with pytest.raises(ModelLoadError, match=r"do not match its config.json: 36 weights missing from the weight "
                                             r"files: transformer\.h\.3\."):
        load_model(str(more), device="cpu")
    status, err = _probe_cli(str(more), tmp_path, capsys)
    assert status == 2 and "missing from the weight files: transformer.h.3." in err
    shutil.rmtree(more)
    fewer = _model_copy(tiny_gpt2, tmp_path, n_layer=2)
    with pytest.raises(ModelLoadError, match=r"\d+ weights in the weight files but not in the model that "
                                             r"config.json declares: transformer\.h\.2\."):
        load_model(str(fewer), device="cpu")
    shutil.rmtree(fewer)
    wider = _model_copy(tiny_gpt2, tmp_path, n_inner=128)          # was "corrupt, truncated or not a weights file"
    with pytest.raises(ModelLoadError, match=r"have other shapes than its config.json declares"):
        load_model(str(wider), device="cpu")


def test_running_out_of_memory_building_the_declared_model_says_so(tiny_gpt2, tmp_path, monkeypatch, capsys):
    """Row 7: a config.json declaring 20000 layers ran out of memory while transformers built them, reported as
    "corrupt ... (MemoryError)" with exit 2; now out of memory at the declared size, exit 3. (The allocation of
    the declared layers is made to fail here: 64 layers, not 20000, keep the test fast.)"""
    from transformers import PreTrainedModel

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(PreTrainedModel, "_move_missing_keys_from_meta_to_device", no_memory)
    folder = _model_copy(tiny_gpt2, tmp_path, n_layer=64)
    with pytest.raises(MemoryError, match=r"does not fit in memory at the size .*model/config.json declares "
                                          r"\(layers 64, hidden size 32, vocabulary 400\); its weight files hold "
                                          r"0\.\d MiB"):
        load_model(str(folder), device="cpu")
    status, err = _probe_cli(str(folder), tmp_path, capsys)
    assert status == 3 and "out of memory" in err and "config.json declares (layers 64" in err, err


def _poisoned_gpt2(tiny, tmp_path, fc: float, proj: float) -> Path:
    """The tiny gpt2 with block 1's MLP weights multiplied by ``fc`` (input) and ``proj`` (output); nan: NaN."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny, tmp_path / f"poisoned-{fc}-{proj}")
    state = load_file(folder / "model.safetensors")
    for name, factor in (("c_fc", fc), ("c_proj", proj)):
        state[f"transformer.h.1.mlp.{name}.weight"] = state[f"transformer.h.1.mlp.{name}.weight"] * factor
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_non_finite_states_name_the_place_and_suggest_float32(tiny_gpt2, tmp_path, capsys):
    """Row 8: NaN weights or a float16 overflow gave exit 0 with every relation failing in linalg.svd; now the
    capture names the first place that is not finite, and the probe stops with exit 2 saying so."""
    from llmprobe.model.capture import NonFiniteStatesError, capture

    ids = torch.tensor([[5, 17, 42, 99]])
    nan = _poisoned_gpt2(tiny_gpt2, tmp_path, 1.0, float("nan"))
    lm = load_model(str(nan), device="cpu")
    with pytest.raises(NonFiniteStatesError, match=r"states at blocks\.1\.mlp_out hold NaN or infinite values "
                                                   r"\(float32\): its weights hold NaN/inf .* corrupt"):
        capture(lm.model, lm.adapter.names(), ids)
    assert capture(lm.model, ["blocks.1.mlp_hidden"], ids)["blocks.1.mlp_hidden"].isfinite().all()
    status, err = _probe_cli(str(nan), tmp_path, capsys)
    assert status == 2 and "blocks.1.mlp_out hold NaN or infinite values" in err, err
    huge = _poisoned_gpt2(tiny_gpt2, tmp_path, 1e3, 1e4)   # weights < 1000, outputs > 65504 (float16's largest)
    half = load_model(str(huge), device="cpu", dtype="float16")
    assert all(p.isfinite().all() for p in half.model.parameters())
    with pytest.raises(NonFiniteStatesError, match=r"blocks\.1\.mlp_out .*\(float16\): .*float16 overflowed: load "
                                                   r"it in float32 \(--dtype float32\)"):
        capture(half.model, half.adapter.names(), ids)
    status, err = _probe_cli(str(huge), tmp_path, capsys, "--dtype", "float16")
    assert status == 2 and "blocks.1.mlp_out" in err and "--dtype float32" in err, err
    full = load_model(str(huge), device="cpu", dtype="float32")
    states = capture(full.model, full.adapter.names() + ["logits"], ids)
    assert states["blocks.1.mlp_out"].abs().max() > 65504 and all(s.isfinite().all() for s in states.values())


def test_decoder_tensors_must_have_the_recorded_shapes(tmp_path):
    """Row 10: rank-1 factors of a 40000 x 40000 matrix in a 640 KB decoders.safetensors made load_decoder ask for
    12.8 GB; every tensor's shape is now checked against the entry's d_in/d_out before it is used."""
    from safetensors.torch import save_file

    from llmprobe.analyses.saved import load_decoder, save_decoders

    d = 6
    W = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    save_decoders(tmp_path, {"capital": {"lre": {"W": W, "b": torch.zeros(d, dtype=torch.float64), "layer": 1,
                                                 "beta": 2.0, "rank": None}}}, {"name": "m"})
    assert torch.equal(load_decoder(tmp_path, "capital").operator.W, W)
    index = json.loads((tmp_path / "decoders.json").read_text())
    index["decoders"][0]["tensors"]["W"] = ["decoder0.W.U", "decoder0.W.S", "decoder0.W.Vh"]
    (tmp_path / "decoders.json").write_text(json.dumps(index))
    n, f64 = 40000, torch.float64
    save_file({"decoder0.W.U": torch.ones(n, 1, dtype=f64), "decoder0.W.S": torch.ones(1, dtype=f64),
               "decoder0.W.Vh": torch.ones(1, n, dtype=f64), "decoder0.b": torch.zeros(d, dtype=f64)},
              tmp_path / "decoders.safetensors")
    assert (tmp_path / "decoders.safetensors").stat().st_size < 700_000
    with pytest.raises(ValueError, match=r"decoders.safetensors .*the tensors of W .* have shapes \[\(40000, 1\), "
                                         r"\(1,\), \(1, 40000\)\], but d_in 6 and d_out 6 call for \[\(6, 1\), \(1,\), "
                                         r"\(1, 6\)\]"):
        load_decoder(tmp_path, "capital")


GOOD_ENTRY = {"relation": "capital", "kind": "lre", "layer": 1, "beta": 2.0, "rank": None, "d_in": 6, "d_out": 6,
              "tensors": {"W": "decoder0.W", "b": "decoder0.b"}}


@pytest.mark.parametrize("entries,problem", [
    (["not an object"], r"must be an object, got str"),                           # was AttributeError
    ([{k: v for k, v in GOOD_ENTRY.items() if k != "kind"}], r"field 'kind' must be of type str"),   # KeyError
    ([{**GOOD_ENTRY, "tensors": {"W": 5, "b": "decoder0.b"}}], r"tensors\.W must be a tensor key"),  # TypeError
    ([{**GOOD_ENTRY, "tensors": ["decoder0.W"]}], r"field 'tensors' must be of type dict"),          # AttributeError
    ([{**GOOD_ENTRY, "beta": "two"}], r"field 'beta' must be of type number"),                       # ValueError
    ([{**GOOD_ENTRY, "d_in": "6"}], r"field 'd_in' must be of type int"),
    ([{**GOOD_ENTRY, "edit_rank": [1]}], r"field 'edit_rank' must be a whole number or null"),
])
def test_wrong_types_in_decoders_json_are_named(tmp_path, entries, problem):
    """Row 11: wrong types in decoders.json gave TypeError, AttributeError or KeyError tracebacks."""
    from safetensors.torch import save_file

    from llmprobe.analyses.saved import load_decoder, read_fits

    save_file({"decoder0.W": torch.eye(6, dtype=torch.float64), "decoder0.b": torch.zeros(6, dtype=torch.float64)},
              tmp_path / "decoders.safetensors")
    (tmp_path / "decoders.json").write_text(json.dumps({"format": 2, "model": {}, "decoders": entries}))
    for read in (lambda: load_decoder(tmp_path, "capital"), lambda: read_fits(tmp_path)):
        with pytest.raises(ValueError, match=r"decoders\.json: decoders\[0\]:? " + problem):
            read()
    (tmp_path / "decoders.json").write_text('{"decoders": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="decoders.json: nested too deeply"):
        read_fits(tmp_path)


def test_hostile_model_files_are_usage_errors_naming_the_file(tiny_gpt2, tmp_path, capsys):
    """Row 11: a crafted GGUF file (struct.error), a tokenizer with more tokens than the embedding has rows
    (IndexError in the forward pass), a deeply nested config.json (RecursionError) gave tracebacks (exit 1), and
    model "/" a message that did not say what was wrong; each is now exit 2 naming the file and the problem."""
    import struct

    from safetensors.torch import load_file, save_file

    gguf = tmp_path / "crafted.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 10 ** 6) + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match=r"crafted\.gguf: not a readable GGUF file, corrupt or truncated "
                                             r"\(struct\.error"):
        load_model(str(gguf), device="cpu")
    small = _model_copy(tiny_gpt2, tmp_path, vocab_size=100)       # weights cut to 100 token rows, tokenizer: 400
    state = load_file(small / "model.safetensors")
    state = {k: v[:100].clone() if k == "transformer.wte.weight" else v for k, v in state.items()}
    save_file(state, small / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tokenizer of .* uses token ids past the model's input embedding "
                                             r"\(100 rows\): its vocabulary \(id 399\)"):
        load_model(str(small), device="cpu")
    nested = shutil.copytree(tiny_gpt2, tmp_path / "nested")
    (nested / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ModelLoadError, match=r"nested/config\.json: nested too deeply to read"):
        load_model(str(nested), device="cpu")
    with pytest.raises(ModelLoadError, match=r"^/ is a folder but not a model folder: it holds no config\.json"):
        load_model("/", device="cpu")
    empty = shutil.copytree(tiny_gpt2, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no-weights holds no weights"):
        load_model(str(empty), device="cpu")
    for model, named in ((gguf, "crafted.gguf"), (small, "id 399"), (nested, "config.json"), ("/", "/ is a")):
        status, err = _probe_cli(str(model), tmp_path, capsys)
        assert status == 2 and named in err and "Traceback" not in err, (model, err)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_deeply_nested_relation_files_name_the_file(tmp_path, suffix):
    """Row 11: a deeply nested relation file raised RecursionError."""
    path = tmp_path / f"deep{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DatasetError, match=f"deep{suffix}: (line 1: )?nested too deeply to read"):
        load_relations([str(path)])


# ------------------------------------------------------------------------ issue 23, rows 1-5, 11-13
def _ten_facts(tmp_path) -> str:
    return write_capital_relation(tmp_path / "capital10.json")


def test_a_folder_of_another_models_run_is_refused_cleared_when_asked_and_decoders_must_match(
        tiny_gpt2, tmp_path, fast_known, capsys):
    """Row 2: a gpt2 probe into a folder that held a qwen2 run left qwen2's decoders, report.html, report.md and
    metrics.csv beside gpt2's report.json, and load_decoder served qwen2's W. Now manifest.json records what a run
    wrote and for which weights: another model's files are refused (exit 2) unless ``overwrite=True`` clears
    them, a repeat of the same model too (its earlier files, the export's included, are cleared with
    ``overwrite``), and load_decoder checks that decoders.json and report.json name the same weights."""
    qwen2, relation, out = str(save_tiny("qwen2", tmp_path / "qwen2")), _ten_facts(tmp_path), tmp_path / "out"
    probe_args = ["--relations", relation, "--layers", "0", "--device", "cpu", "--out", str(out)]
    assert main(["probe", qwen2, "--analyses", "lre", *probe_args]) == 0
    assert main(["report", str(out)]) == 0
    written = {"report.json", "known_facts.json", "decoders.json", "decoders.safetensors", "manifest.json",
               "report.html", "report.md", "metrics.csv"}
    assert written <= {p.name for p in out.iterdir()}
    manifest = json.loads((out / "manifest.json").read_text())
    qwen2_weights = json.loads((out / "report.json").read_text())["model"]["weights_hash"]
    assert manifest["weights"] == qwen2_weights and set(manifest["files"]) >= {"report.json", "decoders.json"}
    saved = {name: (out / name).read_bytes() for name in ("decoders.json", "decoders.safetensors")}
    capsys.readouterr()
    assert main(["probe", str(tiny_gpt2), *probe_args]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds the files of another run" in err and qwen2_weights in err and "decoders.json" in err
    assert json.loads((out / "report.json").read_text())["model"]["weights_hash"] == qwen2_weights

    with pytest.raises(UsageError, match=f"--out {out} holds the files of another run .*--overwrite replaces"):
        probe(qwen2, relations=[relation], layers="0", device="cpu", out=out, analyses=[])   # the same model again
    probe(qwen2, relations=[relation], layers="0", device="cpu", out=out, analyses=[], overwrite=True, formats=())
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {"report.json", "known_facts.json",
                                                                             "manifest.json"}   # no export asked
    report = probe(str(tiny_gpt2), relations=[relation], layers="0", device="cpu", out=out, overwrite=True)
    assert json.loads((out / "manifest.json").read_text())["weights"] == report["model"]["weights_hash"]
    for name, data in saved.items():                          # qwen2's decoders put back beside gpt2's report
        (out / name).write_bytes(data)
    with pytest.raises(ValueError, match=f"decoders.json: the decoders of weights {qwen2_weights}, but .*report.json "
                                         f"is the report of weights {report['model']['weights_hash']}"):
        load_decoder(out, "capital")


def test_compare_refuses_to_write_into_a_compared_folder(tmp_path, capsys):
    """Row 4: ``compare A B --out A`` overwrote A's own report.html, report.md and metrics.csv."""
    a, b = _report_dir(tmp_path / "a", _plain("m1")), _report_dir(tmp_path / "b", _plain("m2"))
    (a / "report.html").write_text("A's own page")
    for out in (a, tmp_path / "b" / ".." / "a", b):
        assert main(["compare", str(a), str(b), "--out", str(out)]) == 2
        assert "is one of the compared folders" in capsys.readouterr().err
    assert (a / "report.html").read_text() == "A's own page" and not (b / "report.html").exists()
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0


@pytest.mark.parametrize("change, problem", [
    (lambda r: r["analyses"]["relations"]["capital"]["layers"].update(x={}),
     r"analyses\.relations\.capital\.layers: layer key 'x' is not a layer index"),
    (lambda r: r["analyses"]["superposition"]["layers"].update({"-": {}}),
     r"analyses\.superposition\.layers: layer key '-' is not a layer index"),
    (lambda r: r.update(matched=["a", "b"]), r"'matched' is a list of str, expected a list of objects"),
    (lambda r: r["relations"].update(capital="x"), r"'relations\.capital' is a JSON str, expected an object"),
    (lambda r: r["analyses"].update(relations=[]), r"'analyses\.relations' is a JSON list, expected an object"),
    ("digits", r"not valid JSON \(a number of more than \d+ digits\)"),
    ("nested", r"nested too deeply to read"),
])
def test_malformed_report_json_says_what_is_wrong(change, problem, tmp_path, capsys):
    """Row 11: a layer key "x", controls as a list of strings, a 5000-digit int and deep nesting gave messages that
    did not say what was wrong (or a traceback); each is now a ValueError naming the file and the problem, exit 2."""
    report = dict(_plain(), analyses={"relations": {"capital": {"layers": {"0": {}}}},
                                      "superposition": {"layers": {"0": {}}}})
    if change == "digits":
        text = json.dumps(report).replace('"n_facts": 4', '"n_facts": ' + "7" * 5000)
    elif change == "nested":
        text = json.dumps(report)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    else:
        change(report)
        text = json.dumps(report)
    folder = _report_dir(tmp_path / "bad", text)
    with pytest.raises(ValueError, match=f"report.json: .*{problem}"):
        read_report(folder)
    capsys.readouterr()
    assert main(["report", str(folder), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert re.search(problem, err) and str(folder / "report.json") in err and "Traceback" not in err


def test_a_reruns_offload_folder_stays_inside_its_own_folder(tmp_path):
    """Row 13: ``rerun`` created the recorded offload_folder wherever it pointed (a report from elsewhere names any
    path); now the rerun offloads into ``OUT/offload`` and says so, with the same numbers."""
    folder, first = str(save_tiny("llama", tmp_path / "llama")), tmp_path / "first"
    probe(folder, relations=[_relation_file(tmp_path)], layers="0", device_map="sequential",
          max_memory="cpu=150000", offload_folder=tmp_path / "offload", out=first)
    report = json.loads((first / "report.json").read_text())
    assert report["model"]["placement"]["disk"] > 0
    elsewhere = tmp_path / "elsewhere" / "offload"
    report["settings"]["run"]["offload_folder"] = str(elsewhere)
    (first / "report.json").write_text(json.dumps(report))
    result = rerun(first, tmp_path / "again")
    assert result["comparison"]["match"] and not (tmp_path / "elsewhere").exists()
    offload = (tmp_path / "again" / "offload").resolve()
    assert result["offload_folder"] == str(offload) and offload.is_dir()
    assert result["report"]["model"]["placement"]["disk"] > 0


# ------------------------------------------------------- issue 23, row 11: synthetic task and checkpoint files
DEEP = "[" * 100_000 + "]" * 100_000
GOOD_TASK = {"table": [[0, 1], [1, 0]], "n_outputs": 2}


@functools.lru_cache(maxsize=1)
def _synth_run_files() -> dict:
    """The files of a 5-step ``synth train`` run (N=8, R=2, d=8), trained once for the tests below."""
    import tempfile

    out = Path(tempfile.mkdtemp()) / "run"
    assert main(["synth", "train", "-N", "8", "-R", "2", "--d", "8", "--max-steps", "5", "--no-progress",
                 "--out", str(out)]) == 0
    from synthetic.train import load_run

    model, task, info = load_run(str(out))            # the files as written pass the checks
    assert task.n_subjects == 8 and info["steps"] == 5
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def _synth_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in _synth_run_files().items():
        (folder / name).write_bytes(data)
    return folder


def _synth_cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    status = main(["synth", *map(str, args)])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("text, problem", [
    (DEEP, "nested too deeply to read"),
    ('{"table": ' + DEEP + ', "n_outputs": 2}', "nested too deeply to read"),
    (json.dumps({**GOOD_TASK, "n_outputs": "two"}), "'n_outputs' must be of type int"),
    (json.dumps({**GOOD_TASK, "table": {"0": [0, 1]}}), "'table' must be of type list"),
    (json.dumps({**GOOD_TASK, "table": [[0, "a"], [1, 0]]}), "'table' must be a list of rows of whole numbers"),
    (json.dumps({**GOOD_TASK, "table": [0, 1]}), "'table' must be a list of rows of whole numbers"),
    (json.dumps({**GOOD_TASK, "meta": [1]}), "'meta' must be of type dict"),
    (json.dumps({**GOOD_TASK, "attr_index": [["x"]]}), "field 'attr_index[0]' must be a list of whole numbers"),
    (json.dumps({"khop": [2], "base": GOOD_TASK}), "'khop' must be of type dict"),
    (json.dumps({"khop": {"hops": "2", "cot": False, "sequences": [[0, 1]]}, "base": GOOD_TASK}),
     "khop: field 'hops' must be of type int"),
    (json.dumps([GOOD_TASK]), "a JSON object"),
], ids=["deep", "deep-table", "n_outputs-str", "table-dict", "table-str-cell", "table-1d", "meta-list",
        "attr_index-str", "khop-list", "hops-str", "list"])
def test_malformed_synth_task_json_is_exit_2_naming_the_file(text, problem, tmp_path, capsys):
    """Row 11: a deeply nested task.json (RecursionError) or one with wrong types (TypeError, AttributeError,
    KeyError, or a run that failed later) gave tracebacks; ``synth analyze`` of the run and ``synth train --facts``
    now exit 2 naming the file and what is wrong."""
    from synthetic.tasks import FactTask

    run = _synth_run(tmp_path / "run")
    (run / "task.json").write_text(text)
    status, err = _synth_cli(capsys, "analyze", run, "--controls", "", "--no-swap", "--no-plots")
    assert status == 2 and "task.json" in err and problem in err and "Traceback" not in err, err
    if "khop" not in text and not text.startswith("[{"):   # --facts: a task file (a list is a relation file)
        facts = tmp_path / "facts.json"
        facts.write_text(text)
        status, err = _synth_cli(capsys, "train", "--facts", facts, "--d", 8, "--max-steps", 2, "--no-progress",
                                 "--out", tmp_path / "train")
        assert status == 2 and "facts.json" in err and problem in err, err
        with pytest.raises(UsageError, match="facts.json.*" + re.escape(problem)):
            FactTask.load(str(facts))


@pytest.mark.parametrize("state, problem", [
    (DEEP, "nested too deeply to read"),
    ([1, 2], "a JSON object"),
    ({"step": "3"}, "'step' must be of type int"),
    ({"history": {"a": 1}}, "'history' must be of type list"),
    ({"model_config": []}, "'model_config' must be of type dict"),
    ({"model_config": {"d_model": "8"}}, "model_config: field 'd_model' must be of type int"),
    ({"opt_step": ["embed.weight"]}, "'opt_step' must be of type dict"),
    ({"train_config": {"lr": "fast"}}, "train_config: field 'lr' must be of type float"),
], ids=["deep", "list", "step-str", "history-dict", "model_config-list", "d_model-str", "opt_step-list",
        "lr-str"])
def test_wrong_types_in_synth_checkpoint_metadata_are_exit_2_naming_the_file(state, problem, tmp_path, capsys):
    """Row 11: a checkpoint whose metadata (the training state) was nested too deeply or had wrong types gave a
    RecursionError, KeyError or TypeError traceback on resume (``synth train``) and ``synth analyze``; both now
    exit 2 naming checkpoint.safetensors. The weights are still read with safetensors (no pickle)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    run = _synth_run(tmp_path / "run")
    path = run / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        saved = json.loads(handle.metadata()["llmprobe_state"])
    if isinstance(state, dict):
        state = {**saved, **{k: {**saved[k], **v} if isinstance(v, dict) and v and isinstance(saved[k], dict) else v
                             for k, v in state.items()}}
    save_file(load_file(str(path)), str(path),
              metadata={"llmprobe_state": state if isinstance(state, str) else json.dumps(state)})
    for args in (("analyze", run, "--controls", "", "--no-swap", "--no-plots"),
                 ("train", "-N", 8, "-R", 2, "--d", 8, "--max-steps", 8, "--no-progress", "--out", run)):
        status, err = _synth_cli(capsys, *args)
        assert status == 2 and "checkpoint.safetensors" in err and problem in err and "Traceback" not in err, \
            (args[0], err)


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_corrupt_synth_checkpoint_is_exit_2_naming_the_file(damage, tmp_path, capsys):
    """A checkpoint.safetensors of 100 random bytes, or a real one cut short, gave a safetensors traceback from
    ``synth analyze`` and a resuming ``synth train``; both now exit 2 naming the file."""
    run = _synth_run(tmp_path / "run")
    path = run / "checkpoint.safetensors"
    data = path.read_bytes()
    path.write_bytes(random.Random(0).randbytes(100) if damage == "random" else data[:len(data) - 64])
    for args in (("analyze", run, "--controls", "", "--no-swap", "--no-plots"),
                 ("train", "-N", 8, "-R", 2, "--d", 8, "--max-steps", 8, "--no-progress", "--out", run)):
        status, err = _synth_cli(capsys, *args)
        assert status == 2 and "not a readable safetensors checkpoint" in err and "checkpoint.safetensors" in err \
            and "Traceback" not in err, (args[0], err)


@pytest.mark.parametrize("damage", ["wider-config", "missing-tensor"])
def test_a_synth_checkpoint_not_matching_its_model_config_is_exit_2_naming_the_tensors(damage, tmp_path, capsys):
    """Row 11: a well-typed model_config that does not describe the saved tensors (d_model edited, or a tensor
    gone) gave a RuntimeError (size mismatch) or KeyError traceback from ``synth analyze``; now exit 2 naming
    checkpoint.safetensors and each parameter that is missing or has another shape."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    run = _synth_run(tmp_path / "run")
    path = run / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        state = json.loads(handle.metadata()["llmprobe_state"])
    tensors = load_file(str(path))
    if damage == "wider-config":
        state["model_config"]["d_model"] *= 2
        expected = r"shapes .*\(the config gives"
    else:
        name = next(k for k in tensors if not k.startswith("opt."))
        del tensors[name]
        expected = f"missing {re.escape(name)}"
    save_file(tensors, str(path), metadata={"llmprobe_state": json.dumps(state)})
    (run / "run.json").unlink(missing_ok=True)         # the checkpoint's own state is the one read
    status, err = _synth_cli(capsys, "analyze", run, "--controls", "", "--no-swap", "--no-plots")
    assert status == 2 and "checkpoint.safetensors does not hold the model its model_config describes" in err \
        and re.search(expected, err) and "Traceback" not in err, err
