"""Issue 11, rows 1-5: exit codes and short summaries, the output folder and every option checked before the model
loads, prompts longer than the model's context, interrupts (SIGTERM, kill -9) and ``run --resume``.

Each test failed on the code before the fix (row 1: ``synth`` exited 1 printing a dict; row 2: an unwritable --out
failed after the work with a traceback; row 3: negative/zero numbers were taken silently; row 4: SIGTERM left the
controls worker running and wrote nothing; row 5: a 150-word subject gave an IndexError on GPT-2). The commands run
as subprocesses where the exit status, stdout or a signal matters.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmprobe.checks import UsageError, analysis_names, is_out_of_memory
from llmprobe.cli import main
from llmprobe.probe import probe
from tiny_models import save_tiny

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
        done = cli(*words, *inputs, "--out", out)
        assert time.perf_counter() - start < 5
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
    from llmprobe.analyses import ANALYSES

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

    monkeypatch.setattr("llmprobe.probe.probe", allocate)
    assert main(["probe", models["qwen2"], "--relations", capital, "--out", str(tmp_path / "oom")]) == 3
    assert "out of memory" in capsys.readouterr().err


# ------------------------------------------------------------------------- row 4: interrupts and resume
WRAPPER = """
import dataclasses, functools, os, sys, time
import llmprobe.analyses, llmprobe.probe
from test_analyses import FAST

real_known, real_analyses = llmprobe.probe.known_facts, llmprobe.analyses.run_analyses


def forced_known(lm, relation, **kw):      # a random model knows nothing; the controls need known facts
    return [dataclasses.replace(r, known=True) for r in real_known(lm, relation, **kw)]


def analyses(*args, **kw):
    if os.environ.get("SLOW_ANALYSES"):    # hold the run inside the probe until the test's signal arrives
        time.sleep(120)
    return real_analyses(*args, progress=False, **{**FAST, **kw})


llmprobe.probe.known_facts, llmprobe.analyses.run_analyses = forced_known, analyses
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
    assert report["stages"]["analyses"]["done"] is False and report["stages"]["controls"]["done"] is False
    assert report["relations"]["capital"]["n_known"] == 6 and "analyses" not in report
    assert any(e.startswith("interrupted during") and "analyses" in e and "--resume" in e for e in report["errors"])
    assert len(json.loads((out / "known_facts.json").read_text())) == 3

    done = subprocess.run(run_args + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert report["partial"] is False and all(s["done"] for s in stages.values())
    assert stages["known_facts"]["resumed"] and not stages["analyses"]["resumed"]
    assert not stages["controls"]["resumed"] and report["controls"]
    assert not any(e.startswith("interrupted") for e in report["errors"])

    done = subprocess.run(run_args + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((out / "report.json").read_text())
    assert all(s["resumed"] for s in again["stages"].values())          # nothing left to compute
    assert again["analyses"] == report["analyses"] and again["controls"] == report["controls"]


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
