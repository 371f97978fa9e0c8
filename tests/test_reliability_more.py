"""Nothing replaced unasked, nothing taken over unchecked, nothing measured said plainly:

* ``report --out`` and ``compare --out`` into a folder holding another run refused it with no way on; ``--overwrite``
  now replaces that run's files (those its manifest.json names and llmprobe writes) and keeps every other file;
* a run in which no fact could be measured (every prompt over ``--max-prompt-tokens``) exited 0; it is exit 2 now,
  saying why;
* ``--resume`` took over a known_facts.json whose known flags had been edited (a report with n_known 0 beside
  analyses on every fact known); the relation's known facts are checked again now, with a line naming the file;
* the Python API refused an output folder holding another result only after loading the model; it refuses it before
  now (a model that cannot load gives the folder's error).

Each test calls the real command line or API on tiny random-init models and asserts the exit status, the message and
the files left; each failed on the code before its fix.
"""
import json
from pathlib import Path

import pytest
from test_output_folders import _cli, _digests
from tiny_models import save_tiny, write_capital_relation

from llmprobe.checks import UsageError
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import probe
from llmprobe.report.schema import REPORT_SCHEMA_VERSION


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny("gpt2", tmp_path_factory.mktemp("gpt2") / "model"))


@pytest.fixture(scope="module")
def relation(tmp_path_factory):
    return write_capital_relation(tmp_path_factory.mktemp("relation") / "capital.json")


def _run_folder(folder: Path, name: str, listed: bool = True) -> Path:
    """A run's folder as probe leaves it: report.json, known_facts.json and report.html, named in the manifest.json
    llmprobe writes (``listed``: report.json among them), beside a file of the user's."""
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({
        "schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "model": {"name": name, "n_layers": 3},
        "relations": {"capital": {"known_rate": 0.5, "n_facts": 4}}}))
    (folder / "known_facts.json").write_text("{}")
    (folder / "report.html").write_text(f"<html>{name}</html>")
    (folder / "notes.txt").write_text("my notes")
    files = ["known_facts.json", "report.html"] + (["report.json"] if listed else [])
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "command": "probe", "model": name,
                                                      "files": sorted(files)}))
    return folder


@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_and_compare_overwrite_replace_only_the_files_llmprobe_wrote(command, tmp_path, capsys):
    """Refused without --overwrite (the way on named, nothing changed); with it the run's files named by its
    manifest are replaced by the export or comparison, its manifest says so, the user's file stays. A report.json
    the manifest does not name is still refused, nothing deleted."""
    a, c = _run_folder(tmp_path / "a", "ma"), _run_folder(tmp_path / "c", "mc")
    out = _run_folder(tmp_path / "out", "mout")
    args = ["report", a] if command == "report" else ["compare", a, c]
    before = _digests(out)
    status, err = _cli(capsys, *args, "--out", out)
    assert status == 2 and f"--out {out} holds another run" in err and "--overwrite to replace that run" in err, err
    assert _digests(out) == before

    status, err = _cli(capsys, *args, "--out", out, "--overwrite")
    assert status == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["manifest.json", "metrics.csv", "notes.txt",
                                                                     "report.html", "report.md"]
    assert (out / "notes.txt").read_text() == "my notes"
    title = "llmprobe report: ma" if command == "report" else "llmprobe comparison: ma vs mc"
    assert title in (out / "report.html").read_text() and "mout" not in (out / "report.html").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"] == command and manifest["sources"] == [str(d) for d in args[1:]]
    assert manifest["files"] == ["metrics.csv", "report.html", "report.md"]

    unlisted = _run_folder(tmp_path / "unlisted", "mu", listed=False)
    before = _digests(unlisted)
    status, err = _cli(capsys, *args, "--out", unlisted, "--overwrite")
    assert status == 2 and "does not name as llmprobe's" in err and "Traceback" not in err, err
    assert _digests(unlisted) == before


def test_a_run_where_no_fact_fits_is_exit_2_saying_why(tiny, relation, tmp_path, capsys):
    """--max-prompt-tokens 1: no prompt fits, every fact is skipped, and the probe exited 0 with an empty table. It
    is exit 2 now, saying no fact could be measured and why (the budget); the report still lists each fact."""
    out = tmp_path / "nothing"
    status, err = _cli(capsys, "probe", tiny, "--relations", relation, "--analyses", "", "--device", "cpu",
                       "--max-prompt-tokens", 1, "--out", out)
    assert status == 2, err
    assert "llmprobe: error: no fact could be measured: every relation was skipped (10 facts skipped" in err
    assert "exceeds the budget of 1 (--max-prompt-tokens)" in err and "Traceback" not in err
    report = json.loads((out / "report.json").read_text())
    assert report["relations"] == {} and sum("--max-prompt-tokens" in e for e in report["errors"]) == 10


def test_resume_checks_the_known_facts_it_takes_over(tiny, relation, tmp_path, fast_known, capsys):
    """Every known flag of known_facts.json set to false, then --resume: the report said n_known 0 beside the
    decoders fitted on 10 known facts. The file no longer matches what report.json recorded of it, so the
    relation's known facts are checked again (10 known, as the decoders), said in a line naming the file."""
    out = tmp_path / "probe"
    args = ["probe", tiny, "--relations", relation, "--analyses", "lre", "--layers", "0", "--device", "cpu",
            "--out", out]
    assert _cli(capsys, *args)[0] == 0
    first = json.loads((out / "report.json").read_text())
    assert first["relations"]["capital"]["n_known"] == 10
    known = json.loads((out / "known_facts.json").read_text())
    (out / "known_facts.json").write_text(json.dumps({name: [{**row, "known": False} for row in rows]
                                                      for name, rows in known.items()}))
    status, err = _cli(capsys, *args, "--resume")
    assert status == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["relations"]["capital"] == first["relations"]["capital"]
    assert report["analyses"]["relations"] == first["analyses"]["relations"]
    assert json.loads((out / "known_facts.json").read_text()) == known
    assert not report["stages"]["known_facts"]["resumed"]
    assert [e for e in report["errors"] if "known facts in" in e] == [
        f"capital: its known facts in {out / 'known_facts.json'} are not those report.json recorded (the file was "
        f"changed since, or report.json holds no record of them), so they were checked again (--resume)"]

    assert _cli(capsys, *args, "--resume")[0] == 0            # unchanged: taken over, nothing said
    again = json.loads((out / "report.json").read_text())
    assert again["stages"]["known_facts"]["resumed"] and not any("known facts in" in e for e in again["errors"])


@pytest.mark.parametrize("job", [probe, run])
def test_the_api_refuses_a_folder_holding_another_result_before_loading_the_model(job, tmp_path):
    """probe() and run() into a folder holding another result loaded the model first (slow; here a model that
    cannot load: its load error was the one raised). The folder's error comes first now."""
    out = _run_folder(tmp_path / "out", "other")
    before = _digests(out)
    with pytest.raises(UsageError, match=f"--out {out} holds the files of another run .*overwrite=True"):
        job(str(tmp_path / "no-such-model"), out=out)
    assert _digests(out) == before
