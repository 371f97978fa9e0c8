"""One rule for output folders: a folder holding another result (any command, any model) is refused unless
--overwrite (replace) or --resume (continue) is given; files llmprobe did not write are never deleted; report and
compare never write beside another run's report.json; locks never follow links and rerun holds one; a bare
MemoryError, an overlong name and control characters in user strings get clear outcomes. Each test calls the real
command line on tiny random-init models and asserts the exit status, the message and the files left."""
import hashlib
import json
import os
from pathlib import Path

import pytest
from tiny_models import save_tiny, write_capital_relation

import llmprobe.commands
from llmprobe.cli import main
from llmprobe.io import file_lock
from llmprobe.report.render import render_html, render_markdown, with_matched
from llmprobe.report.schema import REPORT_SCHEMA_VERSION, read_report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny("gpt2", tmp_path_factory.mktemp("gpt2") / "model"))


@pytest.fixture(scope="module")
def relation(tmp_path_factory):
    return write_capital_relation(tmp_path_factory.mktemp("relation") / "capital.json")


def _cli(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``llmprobe ARGS``."""
    capsys.readouterr()
    status = main([str(a) for a in args])
    return status, capsys.readouterr().err


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _plain_report(folder: Path, name: str = "m", relation: str = "capital") -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({
        "schema_version": REPORT_SCHEMA_VERSION, "kind": "pretrained", "model": {"name": name, "n_layers": 3},
        "relations": {relation: {"known_rate": 0.5, "n_facts": 4}}}))
    return folder


def test_a_probe_into_the_folder_of_another_commands_run_is_refused_unless_overwrite(tiny, relation, tmp_path,
                                                                                     fast_known, capsys):
    """A probe into a folder holding a decoder run of another command (``run``, the same model) deleted that run's
    decoders.safetensors and decoders.json without --overwrite. Now it is exit 2 naming the folder and both ways
    on, the run's files untouched; --overwrite replaces them."""
    out = tmp_path / "elements"
    common = ["--relations", relation, "--layers", "0", "--device", "cpu", "--out", out]
    assert _cli(capsys, "run", tiny, "--analyses", "lre", "--no-matched", *common)[0] == 0
    before = _digests(out)
    assert {"decoders.json", "decoders.safetensors", "report.json"} <= set(before)
    status, err = _cli(capsys, "probe", tiny, "--analyses", "", *common)
    assert status == 2, err
    assert f"--out {out} holds the files of another run" in err and "decoders.safetensors" in err
    assert "--overwrite replaces them" in err and "--resume continues" in err and "Traceback" not in err
    assert _digests(out) == before
    assert _cli(capsys, "probe", tiny, "--analyses", "", "--overwrite", *common)[0] == 0
    assert json.loads((out / "manifest.json").read_text())["command"] == "probe"
    assert not (out / "decoders.json").exists()           # the run's own files, named by its manifest: replaced


def test_files_a_manifest_names_that_llmprobe_does_not_write_are_never_deleted(tiny, tmp_path, capsys):
    """A manifest.json listing notes.txt and thesis.tex (with the same weights hash) got them deleted by the next
    probe. Now a repeat is refused (exit 2), and even --overwrite removes only the files llmprobe writes; a
    manifest.json llmprobe did not write is never replaced."""
    out = tmp_path / "probe"
    args = ["probe", tiny, "--relations", "country_capital", "--max-facts", "3", "--analyses", "", "--device", "cpu",
            "--out", out]
    assert _cli(capsys, *args)[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "notes.txt").write_text("my notes")
    (out / "thesis.tex").write_text("\\chapter{Results}")
    (out / "manifest.json").write_text(json.dumps({**manifest, "files": [*manifest["files"], "notes.txt",
                                                                         "thesis.tex"]}))
    status, err = _cli(capsys, *args)
    assert status == 2 and f"--out {out} holds the files of another run" in err, err
    assert "--overwrite" in err and "--resume" in err
    assert _cli(capsys, *args, "--overwrite")[0] == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "thesis.tex").read_text() == "\\chapter{Results}"

    other = tmp_path / "web"
    other.mkdir()
    (other / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    status, err = _cli(capsys, *args[:-1], other)
    assert status == 2 and f"{other / 'manifest.json'} was not written by llmprobe" in err, err
    assert (other / "manifest.json").read_text() == '{"name": "my web app", "icons": []}'


def test_report_and_compare_refuse_an_out_holding_another_run(tmp_path, capsys):
    """``report A --out B`` and ``compare ... --out B`` replaced report.html, report.md and metrics.csv beside B's
    own report.json. Now both are exit 2 naming B's report.json; B is unchanged. An export folder of A's (no
    report.json) can be written again."""
    a, c = _plain_report(tmp_path / "a", "ma"), _plain_report(tmp_path / "c", "mc")
    b = _plain_report(tmp_path / "b", "mb")
    assert _cli(capsys, "report", b)[0] == 0
    before = _digests(b)
    for args in (["report", a, "--out", b], ["compare", a, c, "--out", b]):
        status, err = _cli(capsys, *args)
        assert status == 2, err
        assert f"--out {b} holds another run ({b / 'report.json'})" in err and "Traceback" not in err
        assert _digests(b) == before
    for _ in range(2):
        assert _cli(capsys, "report", a, "--out", tmp_path / "export")[0] == 0
        assert _cli(capsys, "compare", a, c, "--out", tmp_path / "cmp")[0] == 0
    assert "llmprobe comparison" in (tmp_path / "cmp" / "report.html").read_text()


def test_a_model_folder_named_compare_keeps_its_own_reports(tiny, relation, tmp_path, fast_known, capsys):
    """``llmprobe run m/compare OTHER`` put the model named compare in OUT/compare, and the compare page then
    overwrote its report.html, report.md and metrics.csv. The compare page has that name to itself now."""
    named = save_tiny("gpt2", tmp_path / "m" / "compare", seed=1)
    out = tmp_path / "both"
    status, err = _cli(capsys, "run", named, tiny, "--relations", relation, "--layers", "0", "--analyses", "",
                       "--no-matched", "--device", "cpu", "--out", out)
    assert status == 0, err
    assert not (out / "compare" / "report.json").exists()
    assert "llmprobe comparison" in (out / "compare" / "report.html").read_text()
    runs = sorted(p.parent for p in out.glob("*/report.json"))
    assert len(runs) == 2
    for folder in runs:
        assert "llmprobe comparison" not in (folder / "report.html").read_text()
        assert "llmprobe comparison" not in (folder / "report.md").read_text()
    assert any(json.loads((f / "report.json").read_text())["model"]["name"].endswith("compare") for f in runs)


def test_rerun_locks_its_folder_and_refuses_an_earlier_result(tiny, relation, tmp_path, capsys):
    """Two ``llmprobe rerun DIR`` at once both wrote DIR-rerun: rerun took no lock. Now a second one is exit 2
    saying another run holds the lock; a later rerun into a folder holding a result is refused too."""
    folder = tmp_path / "first"
    assert _cli(capsys, "probe", tiny, "--relations", relation, "--layers", "0", "--analyses", "", "--device", "cpu",
                "--out", folder)[0] == 0
    again = tmp_path / "first-rerun"
    with file_lock(again / ".locks" / "llmprobe.lock") as held:
        assert held
        status, err = _cli(capsys, "rerun", folder)
        assert status == 2, err
        assert f"{again} is in use by another llmprobe command" in err and "another run holds its lock" in err
    assert not (again / "report.json").exists()
    assert _cli(capsys, "rerun", folder)[0] == 0
    before = _digests(again)
    status, err = _cli(capsys, "rerun", folder)
    assert status == 2 and f"--out {again} holds the files of another run" in err, err
    assert _digests(again) == before


@pytest.mark.parametrize("link", ["lock", "folder"])
def test_a_lock_path_that_is_a_symbolic_link_is_refused(link, tmp_path, capsys):
    """``.locks/llmprobe.lock`` linked outside the folder made the command create (and lock) a file there. Now a
    linked lock file or .locks folder is exit 2 naming it, and nothing is created where it points."""
    a, out, outside = _plain_report(tmp_path / "a"), tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    if link == "lock":
        (out / ".locks").mkdir()
        (out / ".locks" / "llmprobe.lock").symlink_to(outside / "planted.lock")
        named = out / ".locks" / "llmprobe.lock"
    else:
        (out / ".locks").symlink_to(outside)
        named = out / ".locks"
    status, err = _cli(capsys, "report", a, "--out", out)
    assert status == 2, err
    assert f"{named} is a symbolic link" in err and "Traceback" not in err
    assert list(outside.iterdir()) == [] and not (out / "report.html").exists()


def test_a_bare_memory_error_is_exit_3(tmp_path, monkeypatch, capsys):
    """A MemoryError without a message crashed the out-of-memory handler (IndexError, exit 1)."""
    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(llmprobe.commands, "export", no_memory)
    status, err = _cli(capsys, "report", _plain_report(tmp_path / "a"))
    assert status == 3 and "llmprobe: error: out of memory (MemoryError)" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["report --out", "report DIR", "compare DIR", "compare --out"])
def test_a_name_too_long_is_exit_2_naming_the_path(where, tmp_path, capsys):
    """A 300-character --out, report or compare folder name gave a raw OSError "File name too long" (exit 1)."""
    a, long = _plain_report(tmp_path / "a"), tmp_path / ("x" * 300)
    args = {"report --out": ["report", a, "--out", long], "report DIR": ["report", long],
            "compare DIR": ["compare", a, long, "--out", tmp_path / "cmp"],
            "compare --out": ["compare", a, "--out", long]}[where]
    status, err = _cli(capsys, *args)
    assert status == 2, err
    assert "too long" in err and str(long) in err and "Traceback" not in err


def test_nul_and_bidi_controls_are_shown_escaped_in_md_html_and_csv(tmp_path, capsys):
    """NUL and right-to-left override characters of user strings (model and relation names) were copied raw into
    report.md, report.html, metrics.csv and metrics.json; they are written visibly escaped now (JSON's escapes read
    back as the same strings). A report without them is written
    byte for byte as rendered."""
    hostile = _plain_report(tmp_path / "hostile", name="model\x00\u202etxt.exe", relation="cap\u202eital\x1b")
    plain = _plain_report(tmp_path / "plain")
    for folder in (hostile, plain):
        assert _cli(capsys, "report", folder, "--format", "html,md,csv,json")[0] == 0
    for name in ("report.md", "report.html", "metrics.csv", "metrics.json"):
        text = (hostile / name).read_text(encoding="utf-8")
        assert not {"\x00", "\u202e", "\x1b"} & set(text), name
        assert "\\u202e" in text and ("\\x00" in text or "\\u0000" in text), name
    rows = json.loads((hostile / "metrics.json").read_text(encoding="utf-8"))   # JSON escapes: the same strings
    assert any(row.get("relation") == "cap\u202eital\x1b" for row in rows)
    reports = with_matched([read_report(plain)])
    title = "llmprobe report: m"
    assert (plain / "report.html").read_text(encoding="utf-8") == render_html(reports, title)
    assert (plain / "report.md").read_text(encoding="utf-8") == render_markdown(reports, title)
    assert os.path.getsize(plain / "metrics.csv") > 0
