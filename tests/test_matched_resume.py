"""Nothing of the matched controls is lost to an interrupt: each finished unit (a training of the threshold search, a
width of the curve) is written to the run's folder as it finishes, and ``--resume`` reads it back instead of
training it again, so that an interrupted run resumed has the numbers of an uninterrupted one, digit for digit. A
unit written for other settings is trained again, and said. A worker stopped by SIGTERM (as ``timeout`` sends it to
a whole process group) was interrupted, not failed: its line and the report say so, and the report is partial."""
import json
import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest
from test_matched import _numbers
from tiny_models import save_tiny

import llmprobe.jobs.main
import synthetic.matched
from llmprobe.cli import main
from llmprobe.datasets import FactTable, Relation, load_relations
from llmprobe.io import write_json
from llmprobe.jobs.main import MatchedStage
from llmprobe.jobs.plan import REFERENCE_RATE
from llmprobe.model.known import FactResult
from llmprobe.settings import Settings
from synthetic.matched import known_table, merge_matched, train_matched

POSIX = sys.platform.startswith("linux")


def _as_written(block: dict, tmp_path) -> dict:
    """``block`` as report.json holds it (llmprobe.io.write_json: NaN as null, tuples as lists)."""
    path = write_json(tmp_path / "as_written.json", block)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def table():
    """12 countries x capital, continent, subregion (d* = 3 at a 150-step cap: the curve 3, 6, 12 at d_model 12)."""
    relations = load_relations(["country_capital", "country_continent", "country_subregion"])
    return FactTable.from_relations([Relation(r.name, r.templates, r.neutral_templates, r.facts[:12], r.properties)
                                     for r in relations])


SMALL = dict(d_model=12, max_steps=150, past_fit=20, n_boot=20, n_seeds=2, modes=("trainable",))


def test_an_interrupted_call_resumed_from_its_units_gives_the_numbers_of_an_uninterrupted_one(table, tmp_path,
                                                                                               monkeypatch):
    """The training of the second width raises KeyboardInterrupt (as an interrupt would): the threshold search's
    trainings and the first width are on disk, nothing else. Resumed, none of them is trained again, the other
    widths are, and the block is the uninterrupted block digit for digit (NaN where a seed never fitted)."""
    whole = train_matched(table, progress=lambda *_: None, **SMALL)
    widths = [p["d"] for p in whole["modes"]["trainable"]["points"]]
    assert len(widths) == 3

    folder, real_point = tmp_path / "matched", synthetic.matched.train_point
    trained: list[int] = []

    def interrupted_after_one(tasks, mode, d, *args, **kwargs):
        if trained:
            raise KeyboardInterrupt
        trained.append(d)
        return real_point(tasks, mode, d, *args, **kwargs)

    monkeypatch.setattr(synthetic.matched, "train_point", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        train_matched(table, progress=lambda *_: None, checkpoints=folder, **SMALL)
    searched = {f"search-d{t['d']}-init{t['init']}.json" for t in whole["modes"]["trainable"]["threshold"]["tried"]}
    assert {p.name for p in (folder / "trainable").iterdir()} == searched | {f"width-d{widths[0]}.json"}

    counted: dict[str, list] = {"search": [], "width": []}
    real_at = synthetic.matched.train_at

    def counting_point(tasks, mode, d, *args, **kwargs):
        counted["width"].append(d)
        return real_point(tasks, mode, d, *args, **kwargs)

    def counting_at(task, mode, d, *args, **kwargs):
        counted["search"].append(d)
        return real_at(task, mode, d, *args, **kwargs)

    monkeypatch.setattr(synthetic.matched, "train_point", counting_point)
    monkeypatch.setattr(synthetic.matched, "train_at", counting_at)
    lines: list[str] = []
    resumed = train_matched(table, progress=lines.append, checkpoints=folder, resume=True, **SMALL)
    assert counted == {"search": [], "width": widths[1:]}
    assert any(f"taken from {folder / 'trainable' / f'width-d{widths[0]}.json'} (--resume)" in line
               for line in lines), lines
    assert json.dumps(_numbers(resumed)) == json.dumps(_numbers(whole))


def test_a_unit_of_other_settings_or_unreadable_is_trained_again_and_said(table, tmp_path, monkeypatch):
    """Units written with n_boot 20 are not taken by a call with n_boot 30 (their key differs): every one is trained
    again, each said; a unit file cut in half is trained again, said. Without ``resume`` nothing is read."""
    kwargs = {**SMALL, "at_model_width": False}
    folder = tmp_path / "matched"
    train_matched(table, progress=lambda *_: None, checkpoints=folder, **kwargs)
    files = sorted(p.name for p in (folder / "trainable").iterdir())
    trained: list[int] = []
    real_at = synthetic.matched.train_at

    def counting_at(task, mode, d, *args, **kw):
        trained.append(d)
        return real_at(task, mode, d, *args, **kw)

    monkeypatch.setattr(synthetic.matched, "train_at", counting_at)
    lines: list[str] = []
    other = train_matched(table, progress=lines.append, checkpoints=folder, resume=True, **{**kwargs, "n_boot": 30})
    differ = [line for line in lines if "was written for other settings or another table (its key differs)" in line]
    assert len(differ) == len(files) and len(trained) == len(files) - 1        # the search's, and one width
    assert other["modes"]["trainable"]["points"][0]["r2"]["n"] == len(table.subjects)

    trained.clear()
    lines.clear()
    width = folder / "trainable" / next(name for name in files if name.startswith("width"))
    width.write_text(width.read_text()[:100])
    train_matched(table, progress=lines.append, checkpoints=folder, resume=True, **{**kwargs, "n_boot": 30})
    assert trained == [] and sum("cannot be read (JSONDecodeError), so it is trained again" in line
                                 for line in lines) == 1
    train_matched(table, progress=lambda *_: None, checkpoints=folder, **{**kwargs, "n_boot": 30})
    assert len(trained) == len(files) - 1                                     # no resume: everything trained


@pytest.fixture
def run_setup(tmp_path, fast_known, monkeypatch):
    """A tiny GPT-2 (d_model 32), three relations over 8 made-up subjects (every fact known), and the CLI's
    arguments of a run with only the matched controls (one mode, one seed, 20 steps past the fit, at most 150).
    The host's matmul rate is
    not measured (a timing only)."""
    model = save_tiny("gpt2", tmp_path / "gpt2")
    subjects = ["Kalomi", "Neruta", "Vozika", "Mitalo", "Rukane", "Tazimo", "Lavoni", "Suketa"]
    values = {"capital": ["Paris", "Tokyo", "Rome"], "continent": ["Europe", "Asia"],
              "language": ["French", "German", "Dutch"]}
    paths = []
    for name, vals in values.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "templates": [f"The {name} of {{}} is"], "neutral_templates": ["{}"],
                                    "facts": [{"subject": s, "object": vals[i % len(vals)]}
                                              for i, s in enumerate(subjects)]}))
        paths.append(str(path))
    for name in ("matmul_rate", "measured_rate"):
        monkeypatch.setattr(llmprobe.jobs.main, name, lambda *args: REFERENCE_RATE)
    out = tmp_path / "run"
    return out, ["run", str(model), "--relations", *paths, "--analyses", "", "--layers", "0", "--device", "cpu",
                 "--set", "matched.max_steps=150", "--set", "matched.past_fit=20", "--set", "matched.n_seeds=1",
                 "--set", "matched.n_boot=20", "--set", "matched.modes=['trainable']", "--out", str(out)]


def _when_a_width_is_written(folder, then) -> threading.Thread:
    """Call ``then()`` from a thread as soon as a width's unit file is in ``folder``."""
    def watch():
        deadline = time.monotonic() + 240
        while not list(folder.glob("*/width-*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not POSIX, reason="signals a process group's way")
def test_a_run_interrupted_by_sigterm_resumes_its_controls_where_they_stopped(run_setup, tmp_path, capsys):
    """SIGTERM to the run and its worker (``timeout`` signals the whole process group) once the first width is
    written: exit 130, the worker's line says its controls were interrupted (not that it failed), the report is
    partial. ``--resume`` trains only the widths not written and its matched block is, digit for digit, the block
    of the controls trained uninterrupted on the same table with the same settings."""
    out, args = run_setup

    def group_sigterm():
        for child in multiprocessing.active_children():
            if child.name == "llmprobe-controls":
                os.kill(child.pid, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    guard = signal.signal(signal.SIGTERM, lambda *_: None)   # a SIGTERM after main() returned stops nothing
    try:
        watcher = _when_a_width_is_written(out / "matched", group_sigterm)
        capsys.readouterr()
        status = main(args)
        watcher.join(30)
    finally:
        signal.signal(signal.SIGTERM, guard)
    err = capsys.readouterr().err
    assert status == 130, err
    assert "matched controls: the trainable controls were interrupted (resume with --resume" in err
    assert "worker failed" not in err and "controls failed" not in err and "Traceback" not in err
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["stages"]["matched"]["done"] is False
    assert not any("failed" in e for e in report["errors"]) and any("interrupted during" in e for e in report["errors"])
    written = sorted(p.name for p in (out / "matched" / "trainable").glob("width-*.json"))
    assert written

    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is False and report["stages"]["matched"]["done"]
    points = report["matched"]["modes"]["trainable"]["points"]
    assert len(points) > len(written) and sum("(--resume)" in line and "taken from" in line
                                              for line in err.splitlines()) == len(written)

    known = {name: [FactResult(**row) for row in rows]
             for name, rows in json.loads((out / "known_facts.json").read_text()).items()}
    settings = {"max_steps": 150, "past_fit": 20, "n_seeds": 1, "n_boot": 20, "modes": ("trainable",),
                "facts": "known"}                       # without the superposition analysis: the known-fact table
    whole = train_matched(known_table(report["relations"], known)[0], report["model"]["d_model"],
                          progress=lambda *_: None, **settings)
    assert _numbers(report["matched"]) == _numbers(_as_written(merge_matched([whole]), tmp_path))


@pytest.mark.skipif(not POSIX, reason="sends SIGTERM")
def test_a_worker_stopped_by_sigterm_alone_leaves_the_stage_interrupted_not_failed(table, tmp_path, capsys):
    """SIGTERM to one controls worker while the run goes on: the worker sends that it was interrupted; its line
    and the report's errors say "interrupted" and how to go on (never "failed"), the stage stays unfinished (the
    report partial), and the units it finished stay on disk."""
    stage = MatchedStage(Settings(), {})
    stage.folder = tmp_path / "matched"
    arguments = {k: v for k, v in SMALL.items() if k not in ("d_model", "modes")}
    stage.start_workers((table, SMALL["d_model"]), {**arguments, "checkpoints": stage.folder}, SMALL["modes"], {})
    _when_a_width_is_written(stage.folder, lambda: os.kill(stage.workers[0].process.pid, signal.SIGTERM)).join(240)
    report = {"errors": [], "timings": {}, "stages": {"matched": {"key": "k", "done": False, "resumed": False}}}
    try:
        stage.finish(report, None)
    finally:
        stage.stop()
    err = capsys.readouterr().err
    assert stage.workers[0].interrupted == "SIGTERM" and not stage.workers[0].failed()
    assert report["stages"]["matched"]["done"] is False and "matched" not in report
    assert report["errors"] == [f"matched controls: the trainable controls were interrupted by SIGTERM (resume with "
                                f"--resume: what they finished is kept in {stage.folder})"]
    assert "the trainable controls were interrupted (resume with --resume" in err and "worker failed" not in err
    assert list((stage.folder / "trainable").glob("width-*.json"))
