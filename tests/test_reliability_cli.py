"""Issue 11, rows 1-5: exit codes and short summaries, the output folder and every option checked before the model
loads, prompts longer than the model's context, interrupts (SIGTERM, kill -9) and ``run --resume``.

Each test failed on the code before the fix (row 1: ``synth`` exited 1 printing a dict; row 2: an unwritable --out
failed after the work with a traceback; row 3: negative/zero numbers were taken silently; row 4: SIGTERM left the
controls worker running and wrote nothing; row 5: a 150-word subject gave an IndexError on GPT-2). The commands run
as subprocesses where the exit status, stdout or a signal matters.

Issue 23, rows 1, 3, 5, 11: decoders written with each relation's checkpoint (and refit on --resume when missing),
a disk-full failure, a tampered report.json under --resume, a seed out of range and a dead Ray raylet exit 2 with a
message, one command at a time per output folder, a dead controls worker leaves a partial report (exit 1). Each
failed on the code before its fix.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_analyses import FAST
from tiny_models import save_tiny

from llmprobe.checks import UsageError, analysis_names, is_out_of_memory
from llmprobe.cli import main
from llmprobe.jobs.probe import probe
from llmprobe.metric import is_metric, iter_metrics

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
POSIX_PROC = sys.platform.startswith("linux")


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "llmprobe.cli", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: str(save_tiny(family, root / family)) for family in ("qwen2", "gpt2")}


def _relation(path: Path, facts, name="capital") -> str:
    path.write_text(json.dumps({"name": name, "templates": [f"The {name} of {{}} is"], "neutral_templates": ["{}"],
                                "facts": [{"subject": s, "object": o} for s, o in facts]}))
    return str(path)


@pytest.fixture
def capital(tmp_path):
    return _relation(tmp_path / "capital.json", [("France", "Paris"), ("Japan", "Tokyo"), ("Brazil", "Brasilia"),
                                                 ("Egypt", "Cairo"), ("Italy", "Rome"), ("Spain", "Madrid")])


# ------------------------------------------------------------------------------------ row 1: synth exit codes
def test_synth_commands_exit_0_with_a_short_summary(tmp_path, capsys):
    done = cli("synth", "train", "-N", 8, "-R", 2, "--d", 8, "--max-steps", 5, "--no-progress",
               "--out", tmp_path / "train")
    assert done.returncode == 0, done.stderr
    assert "{" not in done.stdout + done.stderr and "run.json" in done.stdout and len(done.stdout) < 400
    assert (tmp_path / "train" / "run.json").is_file()
    assert main(["synth", "bounds", "-N", "10", "-R", "2"]) == 0         # the console script exits with this
    printed = capsys.readouterr()
    assert "min_d_trainable" in printed.out and "{" not in printed.out + printed.err
    assert main(["synth"]) == 2 and "train" in capsys.readouterr().err  # no subcommand: a usage error


# ------------------------------------------------------------------ row 2: the output folder, checked first
@pytest.mark.parametrize("command", ["probe", "run", "compare", "report", "synth sweep"])
def test_unwritable_out_fails_at_once_before_any_work(command, models, capital, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    words = command.split()
    inputs = {"probe": [models["qwen2"], "--relations", capital, "--device", "cpu"],
              "run": [models["qwen2"], "--relations", capital, "--device", "cpu"],
              "compare": [tmp_path], "report": [tmp_path], "synth sweep": ["--subjects", 8, "--relations", 2]}[command]
    for out in (a_file, a_file / "below"):
        if command.startswith("synth"):        # in-process: the synth modules take seconds to import
            assert main([*words, *map(str, inputs), "--out", str(out)]) == 2
            continue
        start = time.perf_counter()
        assert cli("config").returncode == 0     # the start-up of a command (its handlers), timed on this load now
        startup = time.perf_counter() - start
        start = time.perf_counter()
        done = cli(*words, *inputs, "--out", out)
        assert time.perf_counter() - start < 2 * startup + 3, "refusing --out took longer than starting up"
        assert done.returncode == 2, done.stderr
        assert "--out" in done.stderr and "Traceback" not in done.stderr and "Loading" not in done.stderr
    assert a_file.read_text() == "not a folder" and not list(tmp_path.glob("**/report.json"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_is_refused(models, capital, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        done = cli("probe", models["qwen2"], "--relations", capital, "--out", folder)
    finally:
        folder.chmod(0o700)
    assert done.returncode == 2 and "not a writable folder" in done.stderr


# -------------------------------------------------------------------------------- row 3: options checked
@pytest.mark.parametrize("option", [["--max-facts", "-3"], ["--max-facts", "0"], ["--batch-size", "-2"],
                                    ["--layers", "every:0"], ["--layers", "every:-1"], ["--layers", "1,x"],
                                    ["--max-prompt-tokens", "0"], ["--analyses", "lre,ridgee"]])
def test_bad_numbers_and_names_are_refused_before_loading(option, models, capital, tmp_path):
    done = cli("probe", models["qwen2"], "--relations", capital, "--device", "cpu", *option,
               "--out", tmp_path / "out")
    assert done.returncode == 2, done.stdout
    assert option[0] in done.stderr or "ridgee" in done.stderr
    assert "Traceback" not in done.stderr and "Loading" not in done.stderr
    assert not (tmp_path / "out" / "report.json").exists()
    if option[1] == "lre,ridgee":              # every valid name listed at once
        assert all(name in done.stderr for name in ("lre", "ridge", "superposition"))


def test_analysis_names_allow_spaces_and_the_api_checks_too(models, capital, tmp_path):
    from llmprobe.names import ANALYSES

    assert analysis_names("lre, ridge", ANALYSES) == ("lre", "ridge")
    assert analysis_names(" lre,,superposition ", ANALYSES) == ("lre", "superposition")
    with pytest.raises(UsageError, match="ridgee.*lre, ridge, superposition"):
        analysis_names(["lre", "ridgee"], ANALYSES)
    for bad in ({"max_facts": 0}, {"batch_size": -2}, {"layers": "every:0"}):
        with pytest.raises(UsageError):
            probe("no-such-model-is-loaded", relations=[capital], out=tmp_path / "api", **bad)
    assert main(["probe", models["qwen2"], "--relations", capital, "--analyses", "lre, ridge", "--layers", "-1",
                 "--device", "cpu", "--out", str(tmp_path / "spaces")]) == 0
    report = json.loads((tmp_path / "spaces" / "report.json").read_text())
    assert report["analyses"]["settings"]["analyses"] == ["lre", "ridge"]


# ------------------------------------------------------------------------- row 5: prompts and the context
def test_prompts_longer_than_the_context_are_skipped_and_listed(models, tmp_path, capsys):
    long_subject, huge_subject = " ".join(["Germany"] * 150), "Spain" * 200_000    # ~150 tokens; 1 MB
    path = _relation(tmp_path / "long.json", [("France", "Paris"), (long_subject, "Berlin"), ("Japan", "Tokyo"),
                                              (huge_subject, "Madrid")])
    for family in ("gpt2", "qwen2"):                  # GPT-2's n_positions reads as max_position_embeddings
        out = tmp_path / family
        assert main(["probe", models[family], "--relations", path, "--layers", "-1", "--device", "cpu",
                     "--analyses", "superposition", "--out", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["relations"]["capital"]["n_facts"] == 2 and report["partial"] is False
        skipped = [e for e in report["errors"] if "skipped" in e and "context of 128 tokens" in e]
        assert len(skipped) == 2 and all("max_position_embeddings" in e and len(e) < 400 for e in skipped)
        known = json.loads((out / "known_facts.json").read_text())["capital"]
        assert [k["subject"] for k in known] == ["France", "Japan"]
    out = tmp_path / "budget"
    assert main(["probe", models["qwen2"], "--relations", path, "--layers", "-1", "--device", "cpu",
                 "--max-prompt-tokens", "9", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dataset"]["max_prompt_tokens"] == 9
    over_budget = sum("--max-prompt-tokens" in e for e in report["errors"])
    assert over_budget >= 1 and report["relations"]["capital"]["n_facts"] + over_budget == 2


def test_a_cpu_allocation_failure_is_out_of_memory(models, capital, tmp_path, monkeypatch, capsys):
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 123145302310912 bytes. Error code 12 (Cannot allocate memory)")
    assert is_out_of_memory(cpu) and is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("x"))

    def allocate(*args, **kwargs):
        raise cpu

    monkeypatch.setattr("llmprobe.commands.probe", allocate)
    assert main(["probe", models["qwen2"], "--relations", capital, "--out", str(tmp_path / "oom")]) == 3
    assert "out of memory" in capsys.readouterr().err


def test_out_of_memory_at_a_batch_of_one_does_not_advise_a_smaller_batch(models, capital, tmp_path, monkeypatch,
                                                                        capsys):
    from llmprobe.model.batching import run_batched

    def allocate(*args, **kwargs):
        def fail(part):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run_batched(fail, 4, 1, stage="known facts")

    monkeypatch.setattr("llmprobe.commands.probe", allocate)
    assert main(["probe", models["qwen2"], "--relations", capital, "--out", str(tmp_path / "oom1")]) == 3
    err = capsys.readouterr().err
    assert "known facts: out of memory with a micro-batch of 1" in err and "--device-map auto" in err
    assert "smaller --batch-size" not in err


# ------------------------------------------------------------------------- row 4: interrupts and resume
WRAPPER = """
import dataclasses, functools, os, sys, time
import llmprobe.analyses.decoders, llmprobe.analyses.run, llmprobe.model.known
from test_analyses import FAST

real_known, real_analyses = llmprobe.model.known.known_facts, llmprobe.analyses.run.run_analyses


def forced_known(lm, relation, **kw):      # a random model knows nothing; the controls need known facts
    return [dataclasses.replace(r, known=True) for r in real_known(lm, relation, **kw)]


def analyses(*args, **kw):
    if os.environ.get("SLOW_ANALYSES"):    # hold the run inside the probe until the test's signal arrives
        time.sleep(120)
    runner = kw.get("runner")
    hold, checkpoint = int(os.environ.get("HOLD_AFTER_RELATIONS", "0")), runner and runner.on_progress
    if hold and checkpoint is not None:    # hold it inside the analyses, once that many relations are written

        def on_progress(result):
            checkpoint(result)
            if len(result["relations"]) >= hold:
                time.sleep(120)
        runner.on_progress = on_progress
    return real_analyses(*args, progress=False, **{**FAST, **kw})


def logged_decoders(lm, relation, *args, **kw):    # which relations' decoders this process computes
    if os.environ.get("DECODERS_LOG"):
        with open(os.environ["DECODERS_LOG"], "a") as log:
            log.write(relation.name + "\\n")
    return real_decoders(lm, relation, *args, **kw)


real_decoders = llmprobe.analyses.decoders.decoders_for_relation
llmprobe.model.known.known_facts, llmprobe.analyses.run.run_analyses = forced_known, analyses
llmprobe.analyses.decoders.decoders_for_relation = logged_decoders
if __name__ == "__main__":
    from llmprobe.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every live child process of ``pid`` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
        if ppid == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


@pytest.fixture
def run_args(tmp_path):
    """A tiny Qwen2 and three relations over 6 made-up subjects (all forced known by the wrapper)."""
    folder = save_tiny("qwen2", tmp_path / "qwen2")
    subjects = ["Kalomi", "Neruta", "Vozika", "Mitalo", "Rukane", "Tazimo"]
    values = {"capital": ["Paris", "Tokyo", "Rome"], "continent": ["Europe", "Asia"], "language": ["French", "German"]}
    paths = [_relation(tmp_path / f"{name}.json", [(s, vals[i % len(vals)]) for i, s in enumerate(subjects)], name)
             for name, vals in values.items()]
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    return [sys.executable, str(tmp_path / "wrapper.py"), "run", str(folder), "--relations", *paths,
            "--analyses", "lre", "--layers", "all", "--device", "cpu", "--no-model-width",
            "--out", str(tmp_path / "run")]


def _start_and_wait_for_worker(args, out: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(args, env={**ENV, "SLOW_ANALYSES": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        workers = [pid for pid, cmd in _children(proc.pid).items() if "spawn_main" in cmd]
        if workers and (out / "report.json").is_file():
            stages = json.loads((out / "report.json").read_text())["stages"]
            if stages["known_facts"]["done"]:
                return proc, workers[0]
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the run did not reach its controls worker: {proc.communicate()[1][-2000:]}")


@pytest.mark.skipif(not POSIX_PROC, reason="reads /proc")
def test_sigterm_stops_the_worker_keeps_finished_stages_and_resume_finishes_the_rest(run_args, tmp_path):
    out = tmp_path / "run"
    proc, worker = _start_and_wait_for_worker(run_args, out)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted by SIGTERM" in stderr
    deadline = time.monotonic() + 10
    while (_alive(worker) or _children(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker) and not _children(proc.pid)
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["stages"]["known_facts"]["done"] is True
    assert report["stages"]["analyses"]["done"] is False and report["stages"]["matched"]["done"] is False
    assert report["relations"]["capital"]["n_known"] == 6 and "analyses" not in report
    assert any(e.startswith("interrupted during") and "analyses" in e and "--resume" in e for e in report["errors"])
    assert len(json.loads((out / "known_facts.json").read_text())) == 3

    done = subprocess.run(run_args + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert report["partial"] is False and all(s["done"] for s in stages.values())
    assert stages["known_facts"]["resumed"] and not stages["analyses"]["resumed"]
    assert not stages["matched"]["resumed"] and report["matched"]
    assert not any(e.startswith("interrupted") for e in report["errors"])

    done = subprocess.run(run_args + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((out / "report.json").read_text())
    assert all(s["resumed"] for s in again["stages"].values())          # nothing left to compute
    assert again["analyses"] == report["analyses"] and again["matched"] == report["matched"]


@pytest.mark.skipif(not POSIX_PROC, reason="reads /proc")
def test_kill_9_of_run_leaves_no_worker_behind(run_args, tmp_path):
    proc, worker = _start_and_wait_for_worker(run_args, tmp_path / "run")
    others = set(_children(proc.pid))
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in others), "a child of the killed run is still running"


@pytest.mark.skipif(not POSIX_PROC, reason="reads /proc")
def test_sigterm_on_synth_train_checkpoints_and_exits_130(tmp_path):
    out = tmp_path / "train"
    proc = subprocess.Popen([sys.executable, "-m", "llmprobe.cli", "synth", "train", "-N", "512", "-R", "8", "--d",
                             "4", "--max-steps", "1000000", "--no-progress", "--out", str(out)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(out.glob("task*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)                                  # inside the training loop
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted" in stderr
    state = json.loads((out / "checkpoint.json").read_text())
    assert state["step"] > 0


def _logged(path: Path) -> list[str]:
    return path.read_text().split() if path.is_file() else []


def _numbers(entry: dict) -> dict:
    """A relation's decoder entry without its wall-clock seconds."""
    if isinstance(entry, dict):
        return {k: _numbers(v) for k, v in entry.items() if not k.endswith("seconds")}
    return [_numbers(v) for v in entry] if isinstance(entry, list) else entry


def _held_after_a_relation(relations: list[str], tmp_path: Path):
    """``run`` of a tiny qwen2 on ``relations`` (lre, every layer, no controls) in a wrapper process held once the
    first relation's decoders are in report.json; (process, its arguments, --out, three decoder logs: the first
    one this process writes, the others for the resumes)."""
    folder = save_tiny("qwen2", tmp_path / "qwen2")
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    out = tmp_path / "run"
    args = [sys.executable, str(tmp_path / "wrapper.py"), "run", str(folder), "--relations", *relations,
            "--analyses", "lre", "--layers", "all", "--device", "cpu", "--no-controls", "--out", str(out)]
    logs = [tmp_path / f"decoders{i}.log" for i in range(3)]
    proc = subprocess.Popen(args, env={**ENV, "HOLD_AFTER_RELATIONS": "1", "DECODERS_LOG": str(logs[0])},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "report.json").is_file() and (json.loads((out / "report.json").read_text()).get("analyses") or
                                                {}).get("relations"):
            return proc, args, out, logs
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the run did not finish a relation's decoders: {proc.communicate()[1][-2000:]}")


@pytest.mark.skipif(not POSIX_PROC, reason="signals a subprocess")
def test_sigterm_during_the_analyses_keeps_finished_relations_and_resume_computes_only_the_rest(three_relations,
                                                                                                tmp_path):
    """Three relations of 10 forced-known facts (enough for the decoders); the run is held after the first
    relation's decoders are written and gets SIGTERM there. The report keeps that relation (typed metrics,
    ``analyses.partial``); ``--resume`` takes it over and computes the other two only (the wrapper logs every
    relation whose decoders a process computes). Then a finished relation taken out of the report is recomputed
    alone, by itself in its process, and gives the numbers it had when computed after another one."""
    proc, args, out, logs = _held_after_a_relation(three_relations, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted by SIGTERM" in stderr
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["stages"]["analyses"]["done"] is False
    assert any(e.startswith("interrupted during analyses") for e in report["errors"])
    analyses = report["analyses"]
    assert analyses["partial"] is True and list(analyses["relations"]) == ["capital"] == _logged(logs[0])
    capital = analyses["relations"]["capital"]
    assert capital["error"] is None and capital["n_used"] == 10
    metrics = [m for _, m in iter_metrics(capital)]
    assert metrics and all({"value", "ci", "n", "interval"} <= set(m) for m in metrics)
    faithfulness = capital["layers"]["0"]["lre"]["faithfulness"]
    assert is_metric(faithfulness) and faithfulness["n"] == len(capital["test_subjects"]) >= 2

    done = subprocess.run(args + ["--resume"], env={**ENV, "DECODERS_LOG": str(logs[1])}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    stage, analyses = report["stages"]["analyses"], report["analyses"]
    assert report["partial"] is False and analyses["partial"] is False and stage["done"] is True
    assert stage["resumed_relations"] == ["capital"] and stage["resumed"] is False
    assert stage["resumed_superposition"] is False and report["stages"]["known_facts"]["resumed"]
    assert _logged(logs[1]) == ["continent", "language"]                    # only the rest was computed
    assert list(analyses["relations"]) == ["capital", "continent", "language"]
    assert analyses["relations"]["capital"] == capital                       # taken over as it was
    assert all(analyses["relations"][name]["error"] is None for name in ("continent", "language"))
    assert not analyses["errors"] and not any(e.startswith("interrupted") for e in report["errors"])

    # language was computed after continent; alone in its process it gives the same numbers
    finished = report["analyses"]["relations"]
    trimmed = json.loads(json.dumps(report))
    del trimmed["analyses"]["relations"]["language"]
    trimmed["analyses"]["partial"], trimmed["stages"]["analyses"]["done"], trimmed["partial"] = True, False, True
    (out / "report.json").write_text(json.dumps(trimmed))
    done = subprocess.run(args + ["--resume"], env={**ENV, "DECODERS_LOG": str(logs[2])}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((out / "report.json").read_text())
    assert _logged(logs[2]) == ["language"]
    assert again["stages"]["analyses"]["resumed_relations"] == ["capital", "continent"]
    assert again["analyses"]["relations"]["continent"] == finished["continent"]
    assert _numbers(again["analyses"]["relations"]["language"]) == _numbers(finished["language"])


def test_run_analyses_reports_progress_and_takes_over_what_is_done(tmp_path, monkeypatch):
    """In-process, ridge and superposition: ``on_progress`` sees each relation, then the superposition analysis,
    with ``partial`` true until the end; ``done`` (the finished result, through JSON) is taken over whole, errors
    re-listed, nothing recomputed."""
    from test_analyses import _relations

    import llmprobe.analyses.decoders
    import llmprobe.analyses.run
    import llmprobe.analyses.superposition
    from llmprobe.analyses.run import Runner
    from llmprobe.model.loading import load_model

    lm = load_model(str(save_tiny("llama", tmp_path / "llama")), device="cpu")
    subjects = ["Kalomi", "Neruta", "Vozika", "Mitalo", "Rukane", "Tazimo", "Lavoni", "Suketa", "Pamiro", "Zunela",
                "Borati", "Kimelo", "Ravuni", "Sotika", "Melura", "Dakoni"]
    rels, known = _relations(subjects)
    known["language"] = known["language"][:3]                          # too few: an error entry
    seen = []

    def on_progress(result):
        seen.append((result["partial"], list(result["relations"]), "superposition" in result))

    first = llmprobe.analyses.run.run_analyses(lm, rels, known, [0, 1, 2], analyses=("ridge", "superposition"),
                                           progress=False, runner=Runner(on_progress=on_progress), **FAST)
    names = ["capital", "continent", "language"]
    assert seen == [(True, names[:1], False), (True, names[:2], False), (True, names, False), (True, names, True)]
    assert first["partial"] is False and first["superposition"]["error"] is None
    assert first["relations"]["capital"]["error"] is None and "language" in first["relations"]["language"]["error"]

    def recomputed(*args, **kwargs):
        raise AssertionError("recomputed a part that was done")

    monkeypatch.setattr(llmprobe.analyses.decoders, "decoders_for_relation", recomputed)
    monkeypatch.setattr(llmprobe.analyses.superposition, "superposition", recomputed)
    done = json.loads(json.dumps(first))
    seen.clear()
    again = llmprobe.analyses.run.run_analyses(lm, rels, known, [0, 1, 2], analyses=("ridge", "superposition"),
                                           progress=False, runner=Runner(on_progress=on_progress, done=done), **FAST)
    assert again["relations"] == done["relations"] and again["superposition"] == done["superposition"]
    assert again["errors"] == first["errors"] and len(again["errors"]) == 1 and again["partial"] is False
    assert len(seen) == 4


# ------------------------------------------------------------------------ issue 23, rows 1-5, 11-13
SUBJECTS = ["Kalomi", "Neruta", "Vozika", "Mitalo", "Rukane", "Tazimo", "Lavoni", "Suketa", "Pamiro", "Zunela"]
RELATIONS = ("capital", "continent", "language")


@pytest.fixture
def three_relations(tmp_path):
    """Three relations of 10 made-up subjects (enough known facts for the decoders once forced known)."""
    values = {"capital": ["Paris", "Tokyo", "Rome"], "continent": ["Europe", "Asia", "Africa"],
              "language": ["Spanish", "German"]}
    return [_relation(tmp_path / f"{name}.json", [(s, vals[i % len(vals)]) for i, s in enumerate(SUBJECTS)], name)
            for name, vals in values.items()]


def _disk_full_at(monkeypatch, name: str, nth: int = 1) -> list:
    """Make the ``nth`` and later atomic writes of a file called ``name`` fail as on a full disk (ENOSPC)."""
    import errno

    real, seen = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == name:
            seen.append(dst)
            if len(seen) >= nth:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def test_disk_full_is_exit_2_naming_the_file_and_resume_keeps_every_decoder(models, three_relations, fast_known,
                                                                             tmp_path, monkeypatch, capsys):
    """Rows 1 and 11: decoders were written only at the end, so a disk-full failure there (a traceback, exit 1)
    left none, and --resume, which took every relation over, wrote none either. Now each relation's decoders are
    written with its checkpoint: the disk fills while the second relation's are written, the command exits 2
    naming the file, the first relation stays safe, and --resume computes the other two and writes all three."""
    from llmprobe.analyses.saved import load_decoder

    out = tmp_path / "probe"
    args = ["probe", models["qwen2"], "--relations", *three_relations, "--analyses", "lre", "--layers", "all",
            "--device", "cpu", "--out", str(out)]
    with monkeypatch.context() as patch:
        _disk_full_at(patch, "decoders.safetensors", nth=2)
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out / "decoders.safetensors") in err and "--resume" in err
    assert list(json.loads((out / "report.json").read_text())["analyses"]["relations"]) == ["capital"]
    saved = load_decoder(out, "capital")
    assert main(args + ["--resume"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["analyses"]["resumed_relations"] == ["capital"] and report["partial"] is False
    assert torch.equal(load_decoder(out, "capital").operator.W, saved.operator.W)
    assert [load_decoder(out, name).info["relation"] for name in RELATIONS] == list(RELATIONS)
    with monkeypatch.context() as patch:                    # `llmprobe report`: the same
        _disk_full_at(patch, "report.html")
        assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out / "report.html") in err and "Traceback" not in err


@pytest.mark.skipif(not POSIX_PROC, reason="signals a subprocess")
def test_kill_9_after_a_relation_keeps_its_decoders_and_a_missing_decoder_is_refit(three_relations, tmp_path):
    """Row 1: kill -9 after the first relation, then --resume: exit 0 and equal numbers, but decoders.json lacked
    that relation (load_decoder: KeyError). Now its decoders were written with its checkpoint and are taken over;
    a relation taken over whose decoders are missing all the same (here removed by hand) is computed again, and
    ``stages.analyses.refit_relations`` says so."""
    from llmprobe.analyses.saved import load_decoder

    proc, args, out, logs = _held_after_a_relation(three_relations, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    capital = load_decoder(out, "capital")
    done = subprocess.run(args + ["--resume"], env={**ENV, "DECODERS_LOG": str(logs[1])}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _logged(logs[1]) == ["continent", "language"]
    stage = json.loads((out / "report.json").read_text())["stages"]["analyses"]
    assert stage["resumed_relations"] == ["capital"] and stage["refit_relations"] == []
    assert torch.equal(load_decoder(out, "capital").operator.W, capital.operator.W)
    index = json.loads((out / "decoders.json").read_text())
    assert [e["relation"] for e in index["decoders"]] == list(RELATIONS)
    index["decoders"] = [e for e in index["decoders"] if e["relation"] != "continent"]
    (out / "decoders.json").write_text(json.dumps(index))
    done = subprocess.run(args + ["--resume"], env={**ENV, "DECODERS_LOG": str(logs[2])}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _logged(logs[2]) == ["continent"]
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["analyses"]["refit_relations"] == ["continent"]
    assert any("continent" in e and "decoders" in e and "computed again" in e for e in report["errors"])
    assert [load_decoder(out, name).info["relation"] for name in RELATIONS] == list(RELATIONS)
    index = json.loads((out / "decoders.json").read_text())     # a tampered layer, out of the 3-layer model
    for entry in index["decoders"]:
        if entry["relation"] == "language":
            entry["layer"] = 999
    (out / "decoders.json").write_text(json.dumps(index))
    logs.append(tmp_path / "log3")
    done = subprocess.run(args + ["--resume"], env={**ENV, "DECODERS_LOG": str(logs[3])}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _logged(logs[3]) == ["language"]
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["analyses"]["refit_relations"] == ["language"]
    assert any("language" in e and "layer 999 of a 3-layer model" in e for e in report["errors"])
    assert load_decoder(out, "language").info["layer"] in range(3)


@pytest.mark.skipif(not POSIX_PROC, reason="signals a subprocess")
def test_two_commands_into_one_folder_the_second_is_refused(models, capital, tmp_path):
    """Row 3: two probes (or two synth trains) into one --out both ran and the last writer won; the second is now
    refused at once (exit 2) while the first holds the folder, whose files it leaves alone."""
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    out = tmp_path / "probe"
    first = subprocess.Popen([sys.executable, str(tmp_path / "wrapper.py"), "probe", models["qwen2"], "--relations",
                              capital, "--analyses", "ridge", "--device", "cpu", "--out", str(out)],
                             env={**ENV, "SLOW_ANALYSES": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    train = tmp_path / "train"
    trainer = subprocess.Popen([sys.executable, "-m", "llmprobe.cli", "synth", "train", "-N", "512", "-R", "8",
                                "--d", "4", "--max-steps", "1000000", "--no-progress", "--out", str(train)],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ((out / "report.json").is_file() and (train / "task.json").is_file()):
            assert first.poll() is None and trainer.poll() is None
            time.sleep(0.2)
        before = (out / "report.json").read_text()
        second = cli("probe", models["gpt2"], "--relations", capital, "--device", "cpu", "--out", out)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"{out} is in use by another llmprobe command" in second.stderr and "Traceback" not in second.stderr
        assert (out / "report.json").read_text() == before
        again = cli("synth", "train", "-N", "8", "-R", "2", "--d", "8", "--max-steps", "5", "--no-progress",
                    "--out", train)
        assert again.returncode == 2 and f"{train} is in use by another llmprobe command" in again.stderr
    finally:
        for proc in (first, trainer):
            proc.kill()
            proc.communicate(timeout=30)
    done = cli("probe", models["qwen2"], "--relations", capital, "--device", "cpu", "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr[-2000:]                      # the lock went with its holder


CONTROLS_WRAPPER = WRAPPER.replace('if __name__ == "__main__":', '''
import llmprobe.jobs.matched

real_controls = llmprobe.jobs.matched.train_matched


def slow_controls(*args, **kw):     # in the worker (spawn runs this file there too): wait for the test's kill -9
    if os.environ.get("SLOW_CONTROLS"):
        time.sleep(120)
    return real_controls(*args, **kw)


llmprobe.jobs.matched.train_matched = slow_controls
if __name__ == "__main__":''')


@pytest.mark.skipif(not POSIX_PROC, reason="reads /proc")
def test_a_dead_controls_worker_leaves_a_partial_report_and_exit_1(run_args, tmp_path):
    """Row 5: a controls worker killed by kill -9 left "partial": false and exit 0 with stages.controls.done
    false. Now the report is partial, the command says so and exits 1, and --resume trains the controls. The other
    mode's worker is stopped at once (the stage has failed), so the analyses waiting for its core go on."""
    out = tmp_path / "run"
    (tmp_path / "wrapper.py").write_text(CONTROLS_WRAPPER)
    proc = subprocess.Popen(run_args, env={**ENV, "SLOW_CONTROLS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline, workers = time.monotonic() + 90, []
    while time.monotonic() < deadline and proc.poll() is None and not workers:
        workers = [pid for pid, cmd in _children(proc.pid).items() if "spawn_main" in cmd]
        time.sleep(0.2)
    assert workers, proc.communicate()[1][-2000:]
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-2000:]
    assert "Traceback" not in stderr and "partial" in stderr and "controls" in stderr and "--resume" in stderr
    assert "worker failed; the other workers are stopped" in stderr    # not trained on to be thrown away, nor
    #                                    holding the cores the analyses wait for (the other one sleeps 120 s here)
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["stages"]["matched"]["done"] is False
    assert report["stages"]["analyses"]["done"] is True
    assert any("controls worker died" in e for e in report["errors"])
    done = subprocess.run(run_args + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is False and report["stages"]["matched"]["done"] and report["matched"]["modes"]
    assert report["stages"]["analyses"]["resumed"] and not any("died" in e for e in report["errors"])


@pytest.mark.parametrize("tamper, problem", [
    (lambda r: r.update(stages=["known_facts"]), r"'stages' is a JSON list, expected an object"),
    (lambda r: r["stages"].update(known_facts="done"), r"'stages\.known_facts' is a JSON str, expected an object"),
    (lambda r: r.update(relations=[1]), r"'relations' is a JSON list, expected an object"),
    (lambda r: r["stages"]["known_facts"].update(done="yes"), r"'stages\.known_facts\.done' is a JSON str, "
                                                              r"expected true or false"),
])
def test_a_tampered_report_under_resume_is_exit_2_naming_the_file(tamper, problem, models, capital, tmp_path,
                                                                 capsys):
    """Row 11: a report.json of the wrong shape under --resume gave TypeError/AttributeError tracebacks."""
    out = tmp_path / "probe"
    args = ["probe", models["qwen2"], "--relations", capital, "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    tamper(report)
    (out / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert re.search(f"{re.escape(str(out / 'report.json'))}: .*{problem}", err), err
    assert "--resume" in err


def test_seed_out_of_range_and_a_dead_ray_raylet_are_exit_2_with_a_message(models, capital, tmp_path, monkeypatch,
                                                                          capsys):
    """Row 11: ``--set run.seed=9999...`` failed after loading with "Overflow when unpacking long long"; a raylet
    that died under ``run --executor ray`` gave a traceback (exit 1)."""
    import ray.exceptions

    import llmprobe.commands

    done = cli("probe", models["qwen2"], "--relations", capital, "--set", "run.seed=99999999999999999999",
               "--out", tmp_path / "seed")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "Loading" not in done.stderr
    assert "run.seed must be at least 0 and at most 4294967295, got 99999999999999999999" in done.stderr

    def raylet_died(fn, jobs, **kwargs):
        raise ray.exceptions.LocalRayletDiedError()
    monkeypatch.setattr(llmprobe.commands, "ray_map", raylet_died)
    capsys.readouterr()
    assert main(["run", models["qwen2"], models["gpt2"], "--executor", "ray", "--relations", capital,
                 "--out", str(tmp_path / "ray")]) == 2
    err = capsys.readouterr().err
    assert "Ray failed (LocalRayletDiedError: The task's local raylet died" in err and str(tmp_path / "ray") in err
