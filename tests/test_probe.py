"""The probe pipeline and CLI on a tiny model: report contents, layer parsing, errors that name the problem."""
import json

import pytest
from tiny_models import save_tiny, tiny_tokenizer

from llmprobe.checks import parse_layers
from llmprobe.cli import main
from llmprobe.io import json_digest
from llmprobe.jobs.probe import probe
from llmprobe.jobs.stages import earlier_stage, mark_interrupted, start_stage
from llmprobe.model import subjects as subjects_module
from llmprobe.model.known import first_token_ids, is_known, object_token_sequences
from llmprobe.model.subjects import SubjectNotFoundError
from llmprobe.report.schema import REPORT_SCHEMA_VERSION


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture
def relation_file(tmp_path):
    data = {"name": "capital", "templates": ["The capital of {} is"], "neutral_templates": ["{}"],
            "properties": {"cardinality": "one-to-one"},
            "facts": [{"subject": s, "object": o} for s, o in
                      [("France", "Paris"), ("Japan", "Tokyo"), ("Brazil", "Brasilia"), ("Egypt", "Cairo")]]}
    path = tmp_path / "capital.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_probe_writes_report(tiny_folder, relation_file, tmp_path):
    out = tmp_path / "run"
    report = probe(tiny_folder, relations=[relation_file], layers="0,-1", device="cpu", out=out)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["schema_version"] == REPORT_SCHEMA_VERSION and on_disk["layers"] == [0, 2]
    rel = on_disk["relations"]["capital"]
    assert rel["n_facts"] == 4 and 0 <= rel["n_known"] <= 4 and rel["known_rate"] == rel["n_known"] / 4
    assert rel["template_used"] == "The capital of {} is"
    assert on_disk["model"]["n_layers"] == 3 and on_disk["model"]["weights_hash"].startswith("sha256:")
    assert on_disk["versions"]["torch"] and on_disk["dataset"]["hash"].startswith("sha256:")
    known = json.loads((out / "known_facts.json").read_text())["capital"]
    assert [k["subject"] for k in known] == ["France", "Japan", "Brazil", "Egypt"]
    assert all(k["known"] == is_known(k["continuation"], k["object"]) for k in known)
    assert report["wall_seconds"] >= 0


def test_unlocatable_subject_is_reported_and_the_run_goes_on(tiny_folder, relation_file, tmp_path, monkeypatch):
    real_encode = subjects_module.encode

    def encode(tokenizer, template, subjects, **kw):
        if subjects == ["Japan"]:
            raise SubjectNotFoundError("subject 'Japan' not found in the prompt tokens")
        return real_encode(tokenizer, template, subjects, **kw)

    monkeypatch.setattr(subjects_module, "encode", encode)
    report = probe(tiny_folder, relations=[relation_file], layers="-1", device="cpu", out=tmp_path)
    assert report["relations"]["capital"]["n_facts"] == 3
    assert any("'Japan'" in e and "capital" in e for e in report["errors"])


def test_the_stage_protocol_keys_resumes_and_marks_an_interrupt():
    """A stage is taken over only under the same key; an interrupt marks the unfinished stages once, and a report
    whose stages are all done is not partial."""
    key = json_digest({"weights": "sha256:1"}, [0, 2], ("lre",))
    assert key == json_digest({"weights": "sha256:1"}, [0, 2], ["lre"]) != json_digest({"weights": "sha256:2"}, [0, 2])
    report = {"stages": {}, "errors": ["capital: fact skipped", "interrupted during known_facts: old"],
              "partial": True}
    stage = start_stage(report, "known_facts", key)
    assert report["stages"]["known_facts"] == {"key": key, "done": False, "resumed": False}
    start_stage(report, "analyses", "k2", resumed_relations=[])
    stage["done"] = True
    mark_interrupted(report)
    assert report["partial"] is True and report["errors"][0] == "capital: fact skipped"
    assert [e for e in report["errors"] if e.startswith("interrupted")] == [
        "interrupted during analyses: finished stages are kept in this report; rerun with --resume to finish the rest"]
    assert earlier_stage(report, "known_facts", key) is stage and earlier_stage(report, "known_facts", "k2") is None
    assert earlier_stage({}, "analyses", "k2") is None
    report["stages"]["analyses"]["done"] = True
    mark_interrupted(report)
    assert report["partial"] is False and report["errors"] == ["capital: fact skipped"]


def test_known_is_case_and_space_insensitive_prefix():
    assert is_known(" paris.\n\nThe", "Paris")
    assert is_known("New York City is", "new york")
    assert not is_known(" Lyon", "Paris")
    assert not is_known(" Paris", "")


def test_object_tokens_follow_the_prompt():
    tok = tiny_tokenizer()
    seqs = object_token_sequences(tok, ["The capital of France is"], ["Paris"])
    assert tok.decode(seqs[0]).strip() == "Paris"
    assert first_token_ids(tok, ["The capital of France is"], ["Paris"]).tolist() == [seqs[0][0]]


@pytest.mark.parametrize("spec,expected", [("all", [0, 1, 2, 3]), ("-1", [3]), ("0,2", [0, 2]),
                                           ("every:2", [0, 2, 3])])
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 4) == expected


def test_parse_layers_errors():
    with pytest.raises(ValueError, match="out of range"):
        parse_layers("7", 4)
    with pytest.raises(ValueError, match="bad layer"):
        parse_layers("first", 4)


def test_cli_probe_and_errors(tiny_folder, relation_file, tmp_path, capsys):
    assert main(["probe", tiny_folder, "--relations", relation_file, "--layers", "-1", "--device", "cpu",
                 "--out", str(tmp_path / "cli")]) == 0
    assert "capital" in capsys.readouterr().out
    assert (tmp_path / "cli" / "report.json").exists()
    assert main(["probe", tiny_folder, "--relations", "no_such_relation", "--out", str(tmp_path / "x")]) == 2
    assert "no_such_relation" in capsys.readouterr().err
    assert main(["probe", "nobody/no-such-model", "--out", str(tmp_path / "y")]) == 2
    assert "nobody/no-such-model" in capsys.readouterr().err
    assert not (tmp_path / "y" / "report.json").exists()


def test_cli_protocol_and_pickle_flags_reach_the_analyses_and_the_loader(tiny_folder, tmp_path, capsys):
    """--protocol lre runs the reference protocol (recorded in the report); --allow-pickle lets probe load a
    folder that holds only pickle weights, which it refuses without the flag."""
    import shutil

    import torch

    from llmprobe.model.loading import load_model

    rows = [{"subject": s, "object": o} for s, o in zip([f"Land{i}" for i in range(24)],
                                                        ["Paris", "Tokyo", "Rome", "Cairo"] * 6)]
    data = {"name": "capital", "templates": ["The capital of {} is"], "neutral_templates": ["{}"], "facts": rows}
    rel = tmp_path / "capital.json"
    rel.write_text(json.dumps(data))
    import llmprobe.model.known as known_module

    real = known_module.is_known, known_module.prefix_hit
    try:       # a random model knows nothing: force it (strict rule and the lre protocol's prefix rule)
        known_module.is_known = known_module.prefix_hit = lambda text, obj: True
        assert main(["probe", tiny_folder, "--relations", str(rel), "--layers", "0,1", "--device", "cpu",
                     "--analyses", "lre", "--protocol", "lre", "--n-icl", "2", "--out", str(tmp_path / "icl")]) == 0
    finally:
        known_module.is_known, known_module.prefix_hit = real
    report = json.loads((tmp_path / "icl" / "report.json").read_text())
    entry = report["analyses"]["relations"]["capital"]
    assert report["analyses"]["settings"]["protocol"] == "lre" and len(entry["context_subjects"]) == 2
    with pytest.raises(SystemExit) as stop:                      # argparse refuses an unknown protocol
        main(["probe", tiny_folder, "--relations", str(rel), "--protocol", "icl", "--out", str(tmp_path / "z")])
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err
    folder = shutil.copytree(tiny_folder, tmp_path / "pickled")
    state = load_model(str(folder), device="cpu").model.state_dict()
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    assert main(["probe", str(folder), "--relations", str(rel), "--out", str(tmp_path / "p1")]) == 2
    assert "allow-pickle" in capsys.readouterr().err.replace("_", "-")
    assert main(["probe", str(folder), "--relations", str(rel), "--allow-pickle", "--out", str(tmp_path / "p2")]) == 0
