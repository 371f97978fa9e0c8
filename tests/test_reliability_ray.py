"""Issue 23, row 11: a Ray raylet killed (SIGKILL, for real: no monkeypatch) under ``synth sweep --executor ray``
ends in exit 2 with a message naming the dead raylet, no traceback, the points already written kept, and the
sweep run again finishes the rest. Before synthetic.executors watched the raylet, the same kill ended ~18 s later
in a LocalRayletDiedError traceback (exit 1)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "OMP_NUM_THREADS": "1",
       "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
# four units, cheap first: N=16 R=1..3 train in about a second, R=4 for about five (d=2 runs all 1500 steps)
SWEEP = ["synth", "sweep", "--subjects", "16", "--relations", "1,2,3,4", "--trainable-only", "--d-max", "12",
         "--max-steps", "1500"]


def _keys(out: Path) -> list[str]:
    path = out / "results.jsonl"
    return [json.loads(line)["key"] for line in path.read_text().splitlines()] if path.exists() else []


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry), cmdline))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the raylet in /proc")
def test_a_killed_raylet_under_a_ray_sweep_is_exit_2_keeps_the_points_and_a_rerun_finishes(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "llmprobe.cli", *SWEEP, "--executor", "ray", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    try:
        deadline = time.time() + 90
        while not _keys(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)                      # the first point written: the sweep is under way
        raylets = [pid for pid, cmd in _children(proc.pid) if "raylet" in cmd.split(" ")[0]]
        assert proc.poll() is None and raylets, f"no running sweep with a raylet to kill: {proc.poll()}"
        kept = _keys(out)
        os.kill(raylets[0], signal.SIGKILL)
        killed = time.time()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the sweep hung after its raylet was killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert time.time() - killed < 30                                # noticed in seconds, not after Ray's own timeouts
    message = [line for line in stderr.splitlines() if line.startswith("llmprobe: error:")]
    assert message and f"the Ray cluster died (its raylet (pid {raylets[0]}) exited" in message[0], stderr[-3000:]
    assert "results already written are kept" in message[0] and "run the same command again" in message[0]
    after = _keys(out)
    assert set(kept) <= set(after) and len(after) == len(set(after))    # nothing lost, nothing torn or twice
    # the sweep run again (here in this process's pool: Ray's start-up is not what is tested) trains the rest only
    done = subprocess.run([sys.executable, "-m", "llmprobe.cli", *SWEEP, "--out", str(out)], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    final = _keys(out)
    assert final[:len(after)] == after and len(final) == len(set(final)) > len(after)
    table = (out / "table.md").read_text()
    assert all(f"| 16 | {R} |" in table for R in (1, 2, 3, 4)), table


def test_rays_own_failures_become_the_projects_errors_and_a_jobs_error_stays_its_own():
    ray = pytest.importorskip("ray")
    from llmprobe.checks import UsageError, is_out_of_memory
    from synthetic.executors import RayFailed, RayOutOfMemory, _ray_failure

    def failure(error, results=("a",)):
        return _ray_failure(ray, error, list(results), 3, 3, joining=False)

    died = failure(ray.exceptions.LocalRayletDiedError())
    assert isinstance(died, RayFailed) and isinstance(died, UsageError) and died.results == ["a"]   # exit 2
    assert str(died).startswith("the Ray cluster died (LocalRayletDiedError: The task's local raylet died")
    assert "after 1 of 3 jobs finished" in str(died) and "run the same command again" in str(died)
    assert "died running a job 4 times" in str(failure(ray.exceptions.WorkerCrashedError()))
    assert isinstance(failure(ConnectionError("GCS unreachable")), RayFailed)
    assert "could not start or join" in str(_ray_failure(ray, ConnectionError("no"), [], 3, 3, joining=True))
    memory = failure(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."))
    assert isinstance(memory, RayOutOfMemory) and is_out_of_memory(memory)                          # exit 3
    task_error = ray.exceptions.RayTaskError("fn", "Traceback ...", ValueError("the job's own"))
    assert failure(task_error) is None and failure(ValueError("not Ray's")) is None


def test_run_over_models_names_the_finished_ones_when_the_ray_cluster_died(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    import llmprobe.commands
    from llmprobe.cli import main
    from synthetic.executors import RayFailed

    models = [tmp_path / "qwen2", tmp_path / "gpt2"]
    for folder in models:
        folder.mkdir()
    out = tmp_path / "runs"

    def raylet_died(fn, jobs, **kwargs):
        raise RayFailed("the Ray cluster died", "its raylet (pid 123) exited with status -9", [jobs[0].out], 2)
    monkeypatch.setattr(llmprobe.commands, "ray_map", raylet_died)
    assert main(["run", *map(str, models), "--executor", "ray", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (f"Ray failed (the Ray cluster died: its raylet (pid 123) exited with status -9); the models that "
            f"finished have their reports in {out}/<model> (finished: qwen2); run again with --resume") in err, err
