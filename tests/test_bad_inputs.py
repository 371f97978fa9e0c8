"""Bad inputs refused with exit status 2 and a message naming the file or setting at fault, before any long work.

* special files (a named pipe as model.safetensors, as --config, in a relations folder) are refused unopened:
  reading one waited for ever, deaf to SIGTERM and Ctrl-C;
* every number setting has a stated bound (a huge ``analysis.n_splits`` made ``plan`` count for minutes);
* ``synth sweep --executor ray --address`` checks the address answers before Ray tries for minutes;
* a tokenizer.json of ``{}``, 0 attention heads, ``num_hidden_layers`` disagreeing with ``layer_types`` (tracebacks
  before);
* relation files: .jsonl and .csv read row by row up to ``max_facts``, a .json file above its size bound refused,
  relation names that are missing values, lone surrogates, all named with the file and row or field;
* ``--gguf-file`` outside the model folder; the embedded model's cache: a copy whose record does not check is never
  loaded as the embedded model, and a cache path that cannot be written is said before converting.

Each test failed on the code before its fix (a hang, a traceback, a wrong message, or a file read whole).
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import save_tiny

from llmprobe import settings as config
from llmprobe.datasets import DatasetError, load_relations
from llmprobe.jobs.plan import REFERENCE_RATE, plan
from llmprobe.jobs.workload import TARGETS
from llmprobe.model import loading
from llmprobe.settings import from_options

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
HAS_FIFO = hasattr(os, "mkfifo")


def cli(*args, timeout=90, env=None):
    """The command line as a subprocess; a hang fails the test at ``timeout`` (the process is killed)."""
    return subprocess.run([sys.executable, "-m", "llmprobe.cli", *map(str, args)], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout)


def refused(done, *words):
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    for word in words:
        assert word in done.stderr, (word, done.stderr[-2000:])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("models") / "qwen2")


def _copy(tiny: Path, folder: Path, **config_changes) -> Path:
    folder.mkdir(parents=True)
    for path in tiny.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    if config_changes:
        data = json.loads((folder / "config.json").read_text())
        data.update(config_changes)
        (folder / "config.json").write_text(json.dumps(data))
    return folder


def _relation(path: Path, n: int = 6) -> str:
    path.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                "facts": [{"subject": f"Land{i}", "object": f"City{i}"} for i in range(n)]}))
    return str(path)


# --------------------------------------------------------------------------------------- special files
@pytest.mark.skipif(not HAS_FIFO, reason="no named pipes here")
def test_a_fifo_as_weights_config_or_relation_is_refused_unopened(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "model")
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    relation = _relation(tmp_path / "capital.json")
    refused(cli("probe", model, "--relations", relation, "--device", "cpu", "--out", tmp_path / "o1"),
            str(model / "model.safetensors"), "named pipe")

    os.mkfifo(tmp_path / "settings.toml")
    refused(cli("probe", tiny, "--relations", relation, "--config", tmp_path / "settings.toml",
                "--out", tmp_path / "o2"), "--config", "settings.toml", "named pipe")

    folder = tmp_path / "relations"
    folder.mkdir(parents=True)
    _relation(folder / "a.json")
    os.mkfifo(folder / "b.jsonl")
    with pytest.raises(DatasetError, match=r"b\.jsonl.*named pipe"):
        load_relations([str(folder)])
    refused(cli("plan", tiny, "--relations", folder), "b.jsonl", "named pipe")


# -------------------------------------------------------------------------------------- settings bounds
@pytest.mark.parametrize("text, key", [("analysis.n_splits=100000", "analysis.n_splits"),
                                       ("analysis.n_boot=1000000000", "analysis.n_boot"),
                                       ("matched.max_steps=100000000000", "matched.max_steps"),
                                       ("analysis.lre_layers=[123456]", "analysis.lre_layers"),
                                       ("run.batch_size=10000000", "run.batch_size")])
def test_every_number_setting_has_a_stated_bound(text, key, tiny, tmp_path):
    start = time.perf_counter()
    done = cli("plan", tiny, "--relations", _relation(tmp_path / "capital.json"), "--set", text)
    refused(done, key, "at most")
    assert time.perf_counter() - start < 60


def test_each_bound_is_written_in_the_settings_file():
    text = config.settings_toml()
    for key in config.RANGES:
        low, high, _ = config.full_range(key)
        assert low is not None and high is not None, f"{key} has no stated bound"
        line = next(line for line in text.splitlines() if line.startswith(key.split(".")[1] + " ="))
        assert "(range: " in line, line
    assert "n_splits = 3" in text and "(range: 1 to 100)" in text


# ---------------------------------------------------------------------------------------- Ray address
def test_synth_sweep_refuses_an_address_that_does_not_answer(tmp_path):
    with socket.socket() as sock:            # a port on this machine that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    done = cli("synth", "sweep", "--subjects", 8, "--relations", 2, "--executor", "ray",
               "--address", f"127.0.0.1:{port}", "--out", tmp_path / "sweep", timeout=120)
    refused(done, f"--address '127.0.0.1:{port}'", "cannot connect", "ray start --head")
    assert time.perf_counter() - start < 60


# ------------------------------------------------------------------------------- malformed model files
def test_a_tokenizer_json_of_an_empty_object_is_refused(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "model")
    (model / "tokenizer.json").write_text("{}")
    refused(cli("probe", model, "--relations", _relation(tmp_path / "capital.json"), "--device", "cpu",
                "--out", tmp_path / "o"), str(model / "tokenizer.json"), "'added_tokens'")


@pytest.mark.parametrize("changes, words", [
    ({"num_attention_heads": 0}, ["field 'num_attention_heads'", "at least 1, got 0"]),
    ({"num_hidden_layers": 5}, ["field 'num_hidden_layers' is 5", "'layer_types' lists 3"]),
])
@pytest.mark.parametrize("command", ["probe", "plan"])
def test_an_impossible_config_is_refused_naming_the_file_and_field(command, changes, words, tiny, tmp_path):
    model = _copy(tiny, tmp_path / "model", **changes)
    extra = ["--device", "cpu", "--out", tmp_path / "o"] if command == "probe" else []
    refused(cli(command, model, "--relations", _relation(tmp_path / "capital.json"), *extra),
            str(model / "config.json"), *words)


def test_gguf_file_outside_the_model_folder_is_refused(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "model")
    for outside in ("../..", "../other.gguf", str(tmp_path / "x.gguf")):
        refused(cli("probe", model, "--gguf-file", outside, "--relations", _relation(tmp_path / "capital.json"),
                    "--device", "cpu", "--out", tmp_path / "o"), "--gguf-file", "outside the model folder")


# ---------------------------------------------------------------------------------------- relation files
def test_rows_files_are_read_only_up_to_max_facts(tmp_path):
    jsonl = tmp_path / "capital.jsonl"
    rows = [json.dumps({"subject": f"Land{i}", "object": f"City{i}", "template": "The capital of {} is"})
            for i in range(5)]
    jsonl.write_bytes(("\n".join(rows) + "\n").encode() + b"{not json, never read\n")
    (relation,) = load_relations([str(jsonl)], max_facts=3)
    assert relation.subjects == ["Land0", "Land1", "Land2"]
    with pytest.raises(DatasetError, match=r"capital\.jsonl: line 6"):
        load_relations([str(jsonl)])
    # the plan reads them as the run does: only up to --max-facts
    planned = plan(TARGETS[0], from_options("run", None, {"relations": [str(jsonl)], "max_facts": 3,
                                                          "matched": False}), rate=REFERENCE_RATE)
    assert planned["assumed"]["facts"] == 3

    table = tmp_path / "capital.csv"
    table.write_bytes(b"subject,object,template\n" + b"".join(
        f"Land{i},City{i},The capital of {{}} is\n".encode() for i in range(5)) + b"\xff\xfe,bad,row\n")
    (relation,) = load_relations([str(table)], max_facts=4)
    assert relation.subjects == ["Land0", "Land1", "Land2", "Land3"]
    with pytest.raises(DatasetError, match=r"capital\.csv: not UTF-8 text \(byte 0xff on line 7\)"):
        load_relations([str(table)])


def test_a_json_relation_file_above_its_bound_is_refused_naming_the_size(tmp_path, monkeypatch):
    path = _relation(tmp_path / "big.json", n=50)
    size = os.path.getsize(path)
    monkeypatch.setattr("llmprobe.datasets.MAX_JSON_BYTES", size - 1)
    with pytest.raises(DatasetError, match=rf"big\.json: {size:,} bytes.*at most .*MiB.*\.jsonl"):
        load_relations([path])


@pytest.mark.parametrize("value", ["", None, ["a", "b"], "None", "['a', 'b']", "nan"])
def test_relation_names_that_are_missing_values_are_refused(value, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"subject": "France", "object": "Paris", "relation": "capital", "template": "The capital of {} is"},
            {"subject": "Japan", "object": "Tokyo", "relation": value, "template": "The capital of {} is"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DatasetError, match=r"rows\.jsonl: field 'rows\[1\]\.relation' must name the row's relation"):
        load_relations([str(path)])


def test_empty_relation_cell_in_a_csv_is_refused(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("subject,object,relation,template\nFrance,Paris,capital,The capital of {} is\n"
                    "Japan,Tokyo,,The capital of {} is\n")
    with pytest.raises(DatasetError, match=r"rows\.csv: field 'rows\[1\]\.relation'"):
        load_relations([str(path)])


def test_a_lone_surrogate_names_the_file_and_field(tmp_path):
    path = tmp_path / "capital.json"
    path.write_text('{"name": "capital", "templates": ["The capital of {} is"], '
                    '"facts": [{"subject": "Fr\\ud800ance", "object": "Paris"}]}')
    with pytest.raises(DatasetError, match=r"capital\.json: field 'facts\[0\]\.subject' holds a lone surrogate"):
        load_relations([str(path)])


# ------------------------------------------------------------------------------- the embedded model's cache
needs_embedded = pytest.mark.skipif(
    __import__("importlib").util.find_spec(loading.DEFAULT_PACKAGE) is None, reason="embedded model not installed")


class Converting(Exception):
    """Raised where the conversion would start (the test stops there)."""


@needs_embedded
def test_a_foreign_folder_at_the_cache_path_is_never_the_embedded_model(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("LLMPROBE_CACHE", str(tmp_path / "cache"))
    target = loading.embedded_folder()
    _copy(tiny, target)
    (target / "llmprobe.json").write_text(json.dumps({"gguf": str(loading.default_gguf()), "gguf_size": 1}))
    assert loading.embedded_cache_problem(target, loading.default_gguf())
    assert loading.trusted_embedded_folder() is None

    import transformers

    def converting(*args, **kwargs):
        raise Converting

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", converting)
    with pytest.raises(Converting):          # it converts again rather than load the folder
        loading._embedded_safetensors()

    # a record that checks is trusted (no conversion); any changed file is then not
    gguf = loading.default_gguf()
    (target / "llmprobe.json").write_text(json.dumps({
        "gguf": str(gguf), "gguf_size": gguf.stat().st_size, "gguf_sha256": loading.gguf_sha256(gguf),
        "weights_hash": loading.weights_hash(target), "files": loading._small_files(target)}))
    assert loading._embedded_safetensors() == str(target)
    (target / "config.json").write_text((target / "config.json").read_text().replace('"hidden_size": 32',
                                                                                      '"hidden_size": 64'))
    assert "config" in loading.embedded_cache_problem(target, gguf)
    with pytest.raises(Converting):
        loading._embedded_safetensors()


@needs_embedded
def test_a_cache_path_that_is_a_file_is_said_before_converting(tmp_path):
    a_file = tmp_path / "cache-file"
    a_file.write_text("not a folder")
    start = time.perf_counter()
    done = cli("probe", "--relations", _relation(tmp_path / "capital.json"), "--device", "cpu",
               "--out", tmp_path / "o", env={"LLMPROBE_CACHE": str(a_file)}, timeout=25)
    refused(done, str(a_file), "LLMPROBE_CACHE")
    assert "converting" not in done.stdout and time.perf_counter() - start < 25


@needs_embedded
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_is_said_with_where_to_point_it(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        done = cli("probe", "--relations", _relation(tmp_path / "capital.json"), "--device", "cpu",
                   "--out", tmp_path / "o", env={"LLMPROBE_CACHE": str(cache)}, timeout=25)
    finally:
        cache.chmod(0o700)
    refused(done, "read-only", "LLMPROBE_CACHE")
    assert "make room" not in done.stderr
