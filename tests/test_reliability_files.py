"""Reliability of what llmprobe reads and writes (issue 11, rows 6-10): safe exports, clear loading errors,
locked sweeps and whole files, readable datasets. Each test failed before its fix."""
import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from llmprobe.datasets import DatasetError, load_relations
from llmprobe.io import append_jsonl, read_jsonl, write_json
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
