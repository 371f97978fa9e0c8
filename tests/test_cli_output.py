"""Issue 25, items 1, 2, 3, 8: what the command line prints and writes for a researcher reading it.

Each test failed on the code before the change: the analyses' lines had no "k/N" and no time left, the controls
printed tuples; the end of a run printed no claim; ``probe MODEL`` ran no analysis and wrote report.json only;
there was no ``--version``; an offline hub name left an empty output folder; a 2-cell sweep printed a bootstrap
interval and "no drift"; the ``synth analyze`` table had no intervals and no legend."""
import json
import re

import pytest
from tiny_models import save_tiny

from llmprobe import console
from llmprobe.analyses.settings import Log
from llmprobe.cli import main
from llmprobe.datasets import Fact, FactTable, Relation
from llmprobe.report.claims import CLAIMS, GRADES
from synthetic.analyze import analyze, legend
from synthetic.matched import train_matched
from synthetic.sweep import fit_trend, table_markdown
from synthetic.train import TrainConfig

VERDICTS = "|".join(map(re.escape, (*GRADES, "inconclusive", "not comparable")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture
def relation(tmp_path):
    facts = [("France", "Paris"), ("Japan", "Tokyo"), ("Brazil", "Brasilia"), ("Egypt", "Cairo"), ("Italy", "Rome"),
             ("Spain", "Madrid")]
    path = tmp_path / "capital.json"
    path.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"], "neutral_templates": ["{}"],
                                "facts": [{"subject": s, "object": o} for s, o in facts]}))
    return str(path)


# ------------------------------------------------------------------------------------------ item 1: progress
def test_analyses_lines_carry_k_of_n_and_the_time_left(capsys):
    log = Log(True)
    for name in log.bar(["a", "b", "c"], "analyses"):
        log(f"{name}: fitted")
    log("superposition: begun")
    lines = [line for line in capsys.readouterr().err.splitlines() if "fitted" in line or "begun" in line]
    assert [re.search(r"\| (\d)/3", line).group(1) for line in lines[:3]] == ["1", "2", "3"]
    assert "left" not in lines[0] and "estimating..." in lines[0]
    assert all(re.search(r"~\d\d:\d\d left", line) for line in lines[1:3])
    assert "/3" not in lines[3]                          # the stage is over: no k/N any more



def test_the_time_left_is_estimated_from_the_relations_computed_not_the_skipped_ones(capsys, monkeypatch):
    """A relation taken over from an earlier result (or refused at once: too few facts) is done in 0 s; it counts
    as done (k/N) but not in the rate: "estimating..." until one relation was computed, then the computed ones'
    mean time per relation times the relations left."""
    import llmprobe.analyses.settings as settings

    clock = [0.0]
    monkeypatch.setattr(settings.time, "perf_counter", lambda: clock[0])
    log = Log(True)
    for name in log.bar(["resumed", "a", "b", "c"], "analyses"):
        log(f"{name}: begun")
        if name == "resumed":
            log.skip()
        else:
            clock[0] += 60.0                          # a computed relation: one minute
    lines = [line for line in capsys.readouterr().err.splitlines() if "begun" in line]
    assert [re.search(r"\| (\d)/4", line).group(1) for line in lines] == ["1", "2", "3", "4"]
    assert "estimating..." in lines[0] and "estimating..." in lines[1] and "left" not in lines[1]
    assert "~02:00 left" in lines[2] and "~01:00 left" in lines[3]     # 60 s per computed relation


def test_the_time_left_is_the_plans_seconds_scaled_by_measured_over_planned(capsys, monkeypatch):
    """With the plan's seconds per relation (``bar(planned=...)``): before any relation was computed, the plan's
    seconds of those left, said "(planned)"; then those seconds times measured / planned of the relations computed
    (a relation taken over, skip(), in neither), so a heavy relation left counts for more than a light one."""
    import llmprobe.analyses.settings as settings

    clock = [0.0]
    monkeypatch.setattr(settings.time, "perf_counter", lambda: clock[0])
    log = Log(True)
    takes = {"resumed": 0.0, "a": 20.0, "b": 60.0, "c": 0.0}
    for name in log.bar(list(takes), "analyses", planned=[40.0, 10.0, 30.0, 20.0]):
        log(f"{name}: begun")
        if name == "resumed":
            log.skip()
        clock[0] += takes[name] / 2
        log(f"{name}: half way")
        clock[0] += takes[name] / 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "begun" in line or "half" in line]
    assert "| 1/4, ~01:40 left (planned)" in lines[0]    # 40 + 10 + 30 + 20 s planned
    assert "| 2/4, ~01:00 left (planned)" in lines[2]    # the resumed one computed nothing
    assert "| 2/4, ~00:50 left (planned)" in lines[3]    # 10 s into a's 20: it counts down
    assert "| 3/4, ~01:40 left]" in lines[4]             # (30 + 20) x 20 s measured / 10 s planned
    assert "| 3/4, ~01:10 left]" in lines[5]             # 30 s into b's 60 s estimate, 40 s after it
    assert "| 4/4, ~00:40 left]" in lines[6]             # 20 x (20 + 60) / (10 + 30)
    with pytest.raises(ValueError, match="2 planned seconds for 3 items"):
        list(log.bar(["a", "b", "c"], "analyses", planned=[1.0, 2.0]))


def test_the_time_a_relation_waited_for_a_core_stays_out_of_the_time_left(capsys, monkeypatch):
    """A relation that waited 10 minutes for a core the controls' workers held (``Log.started`` when its part
    starts) counts with the 60 s it was computed in, not 660 s."""
    import llmprobe.analyses.settings as settings

    clock = [0.0]
    monkeypatch.setattr(settings.time, "perf_counter", lambda: clock[0])
    log = Log(True)
    for name in log.bar(["a", "b", "c"], "analyses"):
        clock[0] += 600.0 if name == "a" else 0.0         # a waits for a core
        log.started()
        clock[0] += 60.0
        log(f"{name}: fitted")
    lines = [line for line in capsys.readouterr().err.splitlines() if "fitted" in line]
    assert "~01:00 left" in lines[1], lines            # one relation after b at a's 60 s


def test_a_relation_waiting_for_a_core_says_so_and_its_time_left_stands_still(capsys, monkeypatch):
    """While a relation waits for a core the controls' workers hold (``Log.waiting``, as ``Parts``' gate calls
    it), the bar and the lines say so and the plan's time left does not count down; once it starts
    (``Log.started``) the countdown runs from then."""
    import llmprobe.analyses.settings as settings

    clock = [0.0]
    monkeypatch.setattr(settings.time, "perf_counter", lambda: clock[0])
    log = Log(True)
    for name in log.bar(["a", "b"], "analyses", planned=[60.0, 60.0]):
        if name == "a":
            log.waiting()
            clock[0] += 300.0                          # five minutes in the queue
            log(f"{name}: queued")
            log.started()
        clock[0] += 30.0
        log(f"{name}: half way")
        clock[0] += 30.0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "queued" in line or "half" in line]
    assert "| 1/2, ~02:00 left (planned) once a core is free (the controls hold them)]" in lines[0], lines
    assert "| 1/2, ~01:30 left (planned)]" in lines[1], lines     # 30 s into a's 60, from its start
    assert "once a core is free" not in lines[1] and "once a core is free" not in lines[2]
    assert "~02:00 left (planned) once a core is free" in err.replace("\r", "\n")   # the bar's own line too


def _countries() -> FactTable:
    countries = [("France", "Paris", "Europe"), ("Japan", "Tokyo", "Asia"), ("Brazil", "Brasilia", "Americas"),
                 ("Egypt", "Cairo", "Africa"), ("Italy", "Rome", "Europe"), ("India", "New Delhi", "Asia")]
    return FactTable.from_relations([Relation(name, ["{}"], [], [Fact(c[0], c[k]) for c in countries])
                                     for k, name in ((1, "capital"), (2, "continent"))])


def test_controls_say_what_they_train_and_find_in_words():
    lines = []
    table = _countries()
    out = train_matched(table, d_model=4, max_steps=50, modes=("trainable",), at_model_width=False, n_boot=20,
                         progress=lines.append, n_seeds=1, recipe="adam")    # adam fits this table within 50 steps
    d_star = out["modes"]["trainable"]["threshold"]["d_star"]
    text = "\n".join(lines)
    assert "trainable, seed 0: searching d*" in text and "modes)" not in text     # one mode (one worker each)
    assert "[(" not in text and "False" not in text
    assert (f"d* = {d_star}," if d_star else "no width up to 4 reaches 100%") in text
    assert re.search(r"trained d=\d+ (100%|\d+\.\d%)", text)
    assert re.search(r"trainable d=\d+ \(width 1/1\): 100% train accuracy at step", text)


def _no_seconds(tree):
    """A controls block without its timings, for comparing numbers digit for digit."""
    if isinstance(tree, dict):
        return {k: _no_seconds(v) for k, v in tree.items() if "seconds" not in k and "time" not in k}
    return [_no_seconds(v) for v in tree] if isinstance(tree, list) else tree


def test_the_matched_lines_say_the_modes_time_left_from_the_plan(monkeypatch):
    """With the plan's seconds (``train_matched(planned=...)``, as ``llmprobe run`` passes them from
    ``jobs.plan.matched_planned``): the search's line says the plan's search and curve; the line after the search
    the plan's seconds of the actual widths, "(planned)"; the line after width k of N the plan's seconds of the
    widths left times measured / planned of the widths done. The numbers are those trained without a plan."""
    import time
    import types

    from tqdm import tqdm

    import synthetic.matched as matched

    table = _countries()
    kwargs = dict(d_model=16, max_steps=50, modes=("trainable",), n_boot=20, n_seeds=1)
    unplanned: list[str] = []
    alone = train_matched(table, progress=unplanned.append, **kwargs)
    assert not any(" left" in line for line in unplanned)                # no plan (a direct caller): no time left

    now = [0.0]                                  # a clock that moves only while a width trains
    monkeypatch.setattr(matched, "time", types.SimpleNamespace(perf_counter=lambda: now[0],
                                                               process_time=time.process_time))
    real, measured = matched.train_point, {}

    def timed(tasks, mode, d, *args):
        measured[d] = 30.0 * d if not measured else 5.0 * d     # the first width 3x its plan, the others 0.5x
        now[0] += measured[d]
        return real(tasks, mode, d, *args)

    monkeypatch.setattr(matched, "train_point", timed)
    lines: list[str] = []
    planned = {"trainable": {"search": 40.0, "curve": 500.0, "width": {d: 10.0 * d for d in range(1, 17)}}}
    out = train_matched(table, progress=lines.append, planned=planned, **kwargs)
    assert json.dumps(_no_seconds(out)) == json.dumps(_no_seconds(alone))    # it only prints more (NaN too)
    widths = [p["d"] for p in out["modes"]["trainable"]["points"]]
    assert len(widths) >= 3 and list(measured) == widths
    plan = [10.0 * d for d in widths]
    left = lambda seconds: f"~{tqdm.format_interval(seconds)} left"      # noqa: E731
    assert lines[0].endswith(f"by bisection; {left(540)} (planned)")    # the search and the curve as planned
    assert lines[1].startswith("trainable: d* = ") and lines[1].endswith(f"; {left(sum(plan))} (planned)")
    done = [line for line in lines if re.match(r"trainable d=\d+ \(width \d+/\d+\): (100%|no seed)", line)]
    assert len(done) == len(widths)
    for k, (d, line) in enumerate(zip(widths, done), 1):
        assert f"trainable d={d} (width {k}/{len(widths)}): training seed 0, up to 50 steps" in lines
        spent = sum(measured[w] for w in widths[:k])
        assert line.endswith(f"; {left(sum(plan[k:]) * spent / sum(plan[:k]))}"), (line, k)
    assert "(planned)" not in done[0] and left(sum(plan[1:]) * 3) in done[0]      # scaled: not the plan's 3 x
    assert done[-1].endswith("~00:00 left")


# ----------------------------------------------------------------------- items 2, 3: the end of probe and run
def test_the_end_of_a_run_prints_every_claim_with_its_verdict_and_the_report_path(tiny, relation, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", tiny, "--relations", relation, "--layers", "-1", "--device", "cpu", "--no-controls",
                 "--analyses", "", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    for claim in CLAIMS:
        assert any(re.match(rf"  {re.escape(claim)}: ({VERDICTS})", line) for line in printed), claim
    assert printed[-1].startswith(f"report: {out / 'report.html'} ") and (out / "report.html").is_file()


def test_probe_model_runs_the_analyses_and_writes_the_html_report(tiny, relation, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(console, "stderr_is_terminal", lambda: True)     # bars are drawn on a terminal only
    out = tmp_path / "probe"
    assert main(["probe", tiny, "--relations", relation, "--layers", "-1", "--device", "cpu",
                 "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["run"]["analyses"] == ["lre", "ridge", "superposition"] and "analyses" in report
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    err = capsys.readouterr().err     # the analyses' time left (decoders, superposition): the plan's until one was computed
    assert re.search(r"\| 1/2, ~\d\d:\d\d left \(planned\)\] capital", err), err[-2000:]
    assert re.search(r"analyses: 100%.*\| 2/2 \[\d\d:\d\d, done\]", err)
    assert main(["probe", tiny, "--relations", relation, "--layers", "-1", "--device", "cpu", "--analyses", "",
                 "--out", str(tmp_path / "known")]) == 0
    assert "analyses" not in json.loads((tmp_path / "known" / "report.json").read_text())


# ------------------------------------------------------------------------------------- item 8: help and errors
def test_version_and_help_say_what_is_there(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and re.fullmatch(r"llmprobe \d+\.\d+\.\d+\n", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "flags above" not in text and "--set overrides it" in text
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    assert "(default runs/probe)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["probe", "run"])
def test_an_unreachable_hub_model_fails_before_the_output_folder_is_made(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "never"
    assert main([command, "nobody/no-such-model", "--out", str(out)]) == 2
    assert "nobody/no-such-model" in capsys.readouterr().err and not out.exists()


def test_a_two_cell_sweep_says_drift_cannot_be_judged():
    fit = fit_trend([(256, 2, 4), (512, 2, 5)])
    assert fit["drift_reason"].startswith("Drift cannot be judged from 2 cells")
    cells = [{"N": N, "R": 2, "mode": "trainable", "d_star": [d], "bits_per_param": 1.4, "steps": 100,
              "censored": 0, "pending": 0, "upper_bounds": []} for N, d in ((256, 4), (512, 5))]
    text = table_markdown({"cells": cells, "fit": {"trainable": fit}, "power_fits": {}})
    assert "no interval from 2 cells" in text and "inf" not in text and "No drift" not in text


def test_synth_analyze_table_has_intervals_and_a_legend_line_per_measure(tmp_path):
    spec = {"subjects": 16, "relations": 2, "d": 8, "d_mlp": 32,
            "train_config": TrainConfig(lr=0.03, max_steps=100, weight_decay=1e-4, target_acc=1.01, progress=False)}
    result = analyze(str(tmp_path / "run"), nulls=("frozen_all",), n_boot=20, swap_steps=(0, 5), plots=False,
                     train_spec=spec, progress=False)
    rows = {line.split(" | ")[0][2:]: line for line in result["table_md"].splitlines()
            if line.startswith("| ") and not line.startswith("| measure")}
    r2 = result["table"]["trainable"]["superposition_r2"]
    lo, hi = result["table_intervals"]["trainable"]["superposition_r2"]
    assert lo <= r2 <= hi and f"{r2:.3f} [{lo:.3f}, {hi:.3f}]" in rows["superposition_r2"]
    assert "[" in rows["readout_acc"] and "[" not in rows["exclusive_ablation_offdiag_drop"]
    for key in rows:
        assert legend(key) and f"* {key}: {legend(key)}" in result["table_md"]
