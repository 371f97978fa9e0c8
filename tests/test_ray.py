"""Sweeps on Ray (synthetic/executors.py): a local Ray instance with 2 CPUs, a unit whose worker is killed."""
import os

import pytest

from llmprobe.io import read_jsonl
from synthetic.sweep import SweepConfig, _locked_unit, append_once, load_results, run_sweep, sweep_jobs, thresholds
from synthetic.train import TrainConfig


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")          # only the Ray tests need it (an optional extra)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(**kw) -> SweepConfig:
    return SweepConfig(subjects=[16], relations=[1, 2], seeds=[0], modes=["trainable"], d_min=2, d_max=12,
                       train=TrainConfig(max_steps=150, progress=False), **kw)


def _keys(out_dir) -> list[str]:
    return [r["key"] for r in read_jsonl(os.path.join(out_dir, "results.jsonl"))]


def test_killed_task_is_retried_and_each_point_written_once(local_ray, tmp_path):
    from synthetic.executors import ray_map

    out, marker = str(tmp_path / "ray"), str(tmp_path / "killed")

    def die_once(job):
        """The unit's work, then its worker process dies before returning, once (a marker file says so)."""
        result = _locked_unit(job)
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return result

    os.makedirs(out)
    results = ray_map(die_once, sweep_jobs(_cfg(), out))
    assert os.path.exists(marker)                        # a worker did die
    assert len(results) == 2                             # and its unit was rerun: every unit returned a result
    keys = _keys(out)
    assert keys and len(keys) == len(set(keys))          # no point written twice, even by the rerun unit
    # nothing lost: the same points and thresholds as the sweep in one process
    serial = str(tmp_path / "serial")
    run_sweep(_cfg(), serial)
    assert sorted(keys) == sorted(_keys(serial))
    assert thresholds(load_results(out)) == thresholds(load_results(serial))
    # resume on Ray from the command line: the finished sweep trains and writes nothing more
    from llmprobe.cli import main

    args = ["synth", "sweep", "--subjects", "16", "--relations", "1,2", "--trainable-only", "--d-max", "12",
            "--max-steps", "150", "--executor", "ray", "--out", out]
    assert main(args) in (0, None)
    assert _keys(out) == keys and os.path.exists(os.path.join(out, "table.md"))


def test_append_once_writes_a_key_once(tmp_path):
    row = {"key": "abc", "success": True}
    assert append_once(str(tmp_path), row) and not append_once(str(tmp_path), dict(row, success=False))
    assert append_once(str(tmp_path), {"key": "other"})
    assert [r["key"] for r in read_jsonl(tmp_path / "results.jsonl")] == ["abc", "other"]
    # a unit rerun that did not see the first attempt's rows (stale cache, no lock re-read) trains its points
    # again, and still writes none of them twice
    from synthetic.sweep import _sweep_unit

    out = str(tmp_path / "stale")
    job = (16, 1, "trainable", _cfg(batched=False), out, {})
    first = _sweep_unit(job)
    keys = _keys(out)
    assert _sweep_unit(job) == first and _keys(out) == keys and len(keys) == len(set(keys))


def test_run_over_two_models_as_ray_tasks(local_ray, tmp_path):
    import json

    from tiny_models import save_tiny

    from llmprobe.cli import main

    folders = [str(save_tiny(family, tmp_path / family)) for family in ("qwen2", "gpt2")]
    relation = tmp_path / "capital.json"
    relation.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                    "neutral_templates": ["{}"],
                                    "facts": [{"subject": "France", "object": "Paris"},
                                              {"subject": "Japan", "object": "Tokyo"}]}))
    out = tmp_path / "runs"
    assert main(["run", *folders, "--relations", str(relation), "--analyses", "", "--layers", "-1", "--no-controls",
                 "--device", "cpu", "--executor", "ray", "--out", str(out)]) == 0
    for family in ("qwen2", "gpt2"):                      # one report per model, each in its own folder
        report = json.loads((out / family / "report.json").read_text())
        assert report["relations"]["capital"]["n_facts"] == 2
    page = (out / "compare" / "report.html").read_text()
    assert "qwen2" in page and "gpt2" in page
