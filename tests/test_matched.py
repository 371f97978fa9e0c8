"""Matched synthetic controls (``synthetic.matched``): the threshold on a real fact table, the width curve trained
past the first 100% step over seeds, reproducible under any thread count, the controls block, its expansion into
report sources, and the curve figure against a pretrained reference."""
import json
import re

import pytest
import torch

from llmprobe.datasets import FactTable, Relation, load_relations
from llmprobe.metric import Metric, is_metric, pooled_readout
from llmprobe.report.figures import capacity_figure, controls_caption
from llmprobe.report.render import render_markdown, with_matched
from llmprobe.report.schema import matched_sources
from synthetic.matched import (
    KEEP_RATES,
    PAST_FIT,
    curve_widths,
    measure_control,
    merge_matched,
    over_seeds,
    seed_values,
    train_at,
    train_matched,
)
from synthetic.sweep import SweepConfig
from synthetic.tasks import from_fact_table
from synthetic.train import TrainConfig


@pytest.fixture(scope="module")
def table():
    """30 countries x capital, continent, subregion (trainable d* = 3, frozen d* = 4 at a 600-step cap)."""
    relations = load_relations(["country_capital", "country_continent", "country_subregion"])
    return FactTable.from_relations([Relation(r.name, r.templates, r.neutral_templates, r.facts[:30], r.properties)
                                     for r in relations])


@pytest.fixture(scope="module")
def block(table):
    return train_matched(table, d_model=24, max_steps=600, recipe="adam", progress=lambda *_: None, n_boot=200)


def test_controls_train_past_their_first_fit_by_the_stated_rule(block):
    """Every seed of every point trains PAST_FIT steps past its first step at 100% (or to the 600-step cap), the
    block says so, and the R^2 is read at that first step and at the end."""
    assert block["training"]["past_fit"] == PAST_FIT and block["training"]["budgets"] == [0, 30]
    assert str(PAST_FIT) in block["training"]["stopping_rule"] and f"then {PAST_FIT} steps" in block["compared_with"]
    for entry in block["modes"].values():
        for p in entry["points"]:
            assert p["train"]["fit_step"] == p["seeds"][0]["fit_step"] and p["train"]["success"]
            for row in p["seeds"]:
                assert row["fit_step"] is not None and row["steps"] == min(row["fit_step"] + PAST_FIT, 600)
                assert row["steps_past_fit"] == row["steps"] - row["fit_step"] > 0.6 * PAST_FIT
                assert row["r2_at_fit"] == row["r2_by_budget"]["0"] and row["r2_final"] is not None
                assert row["movement_final"]["unembed"] > row["movement_at_fit"]["unembed"] > 0
            assert p["r2_final"]["value"] == pytest.approx(sum(r["r2_final"] for r in p["seeds"]) / 3)
            assert p["seeds"][0]["r2_final"] == p["r2"]["value"]          # seed 0's end state, measured in full
    # at the model's width the first fit comes early and the embeddings barely moved: R^2 rises a lot after it
    wide = block["modes"]["trainable"]["points"][-1]
    assert wide["d"] == 24 and max(r["fit_step"] for r in wide["seeds"]) < 60
    assert wide["movement"]["at_fit"]["subject_embed"] < 0.5 * wide["movement"]["final"]["subject_embed"]
    assert wide["r2_final"]["value"] > wide["r2_at_fit"]["value"] + 0.15
    frozen = block["modes"]["frozen"]["points"][-1]
    assert frozen["movement"]["final"]["subject_embed"] == 0.0 < frozen["movement"]["final"]["unembed"]


def test_seeds_give_an_interval(block):
    """Seeds 0, 1, 2 (model seed and subject order; seed 0 the table as given): distinct values, a Student-t
    interval over them, and the shuffled control over the same seeds."""
    assert block["seeds"] == [0, 1, 2]
    for entry in block["modes"].values():
        for p in entry["points"]:
            assert [r["seed"] for r in p["seeds"]] == [0, 1, 2]
            assert [r["subject_order"] for r in p["seeds"]] == [None, 1, 2]
            for key in ("r2_at_fit", "r2_final"):
                m = p[key]
                values = [r[key] for r in p["seeds"]]
                assert m["interval"] == "t over seeds" and m["n"] == 3 and m["spread"]["values"] == values
                assert len(set(values)) == 3 and m["ci"][0] < m["value"] < m["ci"][1]
                assert m["primary_null"] == "shuffled" and abs(m["nulls"]["shuffled"]["value"]) < 0.05
    one = over_seeds([0.4, None])
    assert one["n"] == 1 and one["value"] == 0.4 and one["ci"] == [None, None]       # one seed: no interval
    lo, hi = over_seeds([0.2, 0.4, 0.6])["ci"]
    assert (lo + hi) / 2 == pytest.approx(0.4) and (hi - lo) / 2 == pytest.approx(4.303 * 0.2 / 3 ** 0.5, rel=0.01)


def test_every_seed_stores_its_readouts_and_keep_rates(block, table):
    """Every seed of a point stores its readout accuracies (and their mean pooled over relations) and its gate
    transplant's keep rates at the end of training, seed 0's those of its full measurement; over seeds each is a
    Student-t metric whose interval covers every seed's value, and each report source carries them. A seed's
    values come from the one superposition fit its R^2 needs: the same values as the full measurement's."""
    for entry in block["modes"].values():
        for p in entry["points"]:
            rows, over = p["seeds"], p["over_seeds"]
            assert rows[0]["readout"] == {name: m["value"] for name, m in p["readout"].items()}
            assert rows[0]["readout_mean"] == pytest.approx(p["readout_mean"]["value"])
            assert rows[0]["gate_transplant"] == {k: p["selector"]["gate_transplant"][k] for k in KEEP_RATES}
            metrics = [(over["readout"][name], [r["readout"][name] for r in rows]) for name in p["readout"]]
            metrics += [(over["readout_mean"], [r["readout_mean"] for r in rows])]
            metrics += [(over["gate_transplant"][k], [r["gate_transplant"][k] for r in rows]) for k in KEEP_RATES]
            for m, values in metrics:
                assert m["interval"] == "t over seeds" and m["n"] == 3 and m["spread"]["values"] == values
                assert m["value"] == pytest.approx(sum(values) / 3)
                if len(set(values)) == 1:            # every seed the same value: no interval claimed
                    assert m["ci"] == [None, None]
                else:
                    assert max(0.0, m["ci"][0]) <= min(values) and max(values) <= m["ci"][1] <= 1.0
    sources = matched_sources(block)
    assert all(s["over_seeds"]["readout"] and s["over_seeds"]["gate_transplant"]["same_relation"]["n"] == 3
               and s["over_seeds"]["r2"]["interval"] == "t over seeds" and len(s["seeds"]) == 3 for s in sources)
    task = from_fact_table(table)
    model, _ = train_at(task, "trainable", 6, SweepConfig(train=TrainConfig(max_steps=200, progress=False)))
    full = measure_control(model, task, seed=5, n_boot=20, selector=False)
    quick = seed_values(model.subject_embed.detach(), model.unembed_weight.detach(), task, seed=5)
    assert quick["r2"] == full["r2"]["value"] and quick["shuffled"] == full["r2"]["nulls"]["shuffled"]["value"]
    assert quick["readout"] == {name: m["value"] for name, m in full["readout"].items()}


def _numbers(tree):
    """The block without its timings (seconds), for bit-for-bit comparison."""
    if isinstance(tree, dict):
        return {k: _numbers(v) for k, v in tree.items() if "seconds" not in k and "time" not in k}
    if isinstance(tree, list):
        return [_numbers(v) for v in tree]
    return tree


def test_controls_numbers_do_not_depend_on_the_thread_count(table):
    """Two runs, one and two torch threads: the same numbers, digit for digit (at d = 128 two threads sum the MLP's
    products in another order, and the first step at 100% moves with that rounding unless the controls fix their
    thread count); the caller's thread count is restored."""
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append(train_matched(table, d_model=128, max_steps=600, recipe="adam", modes=("trainable",), n_boot=20,
                                   progress=lambda *_: None))
        assert torch.get_num_threads() == threads
    assert [p["d"] for p in runs[0]["modes"]["trainable"]["points"]][-1] == 128
    assert _numbers(runs[0]) == _numbers(runs[1])


def test_curve_widths():
    assert curve_widths(5, 64) == [5, 10, 20, 40, 64]
    assert curve_widths(8, 64) == [8, 16, 32, 64]
    assert curve_widths(5, 64, at_model_width=False) == [5]
    assert curve_widths(None, 64) == [64] and curve_widths(64, 64) == [64]
    assert curve_widths(4, 576) == [4, 8, 16, 32, 64, 128, 256, 576]     # 512 is within 1.5x of 576: left out


def test_threshold_on_a_table_is_confirmed_with_a_second_initialisation(block):
    for entry in block["modes"].values():
        threshold = entry["threshold"]
        d_star = threshold["d_star"]
        assert d_star is not None and threshold["exact"]
        below = [t for t in threshold["tried"] if t["d"] == d_star - 1]
        assert [t["init"] for t in below] == [0, 1] and not any(t["success"] or t["accuracy"] == 1.0 for t in below)
        assert not any(t["success"] for t in threshold["tried"] if t["d"] < d_star)
        assert all(t["success"] and t["accuracy"] == 1.0 for t in threshold["tried"] if t["d"] == d_star)


def test_controls_train_on_the_device_they_are_given(monkeypatch, table):
    """``device`` reaches every training (a GPU for a large model's controls; every control trains through
    synthetic.sweep.train_width); the block records it."""
    import synthetic.sweep as module

    seen, real = [], module.train

    def spy(task, model_config, config):
        seen.append(config.device)
        return real(task, model_config=model_config, config=config)

    monkeypatch.setattr(module, "train", spy)
    out = train_matched(table, d_model=4, max_steps=50, recipe="adam", modes=("trainable",), at_model_width=False, n_boot=20,
                         progress=lambda *_: None, device="cpu:0")
    assert seen and set(seen) == {"cpu:0"} and out["training"]["device"] == "cpu:0"
    assert block_is_measured(out)


def block_is_measured(out) -> bool:
    points = out["modes"]["trainable"]["points"]
    return bool(points) and all(is_metric(p["r2"]) for p in points)


def test_controls_block_is_a_curve_of_typed_metrics(block, table):
    assert set(block["modes"]) == {"trainable", "frozen"}
    assert block["table"]["n_subjects"] == len(table.subjects) and block["table"]["relations"] == table.relations
    assert block["table"]["bits_joint"] < block["table"]["bits"]          # continent is a function of subregion
    assert block["table"]["bits_joint"] == round(from_fact_table(table).bits_joint(), 1)
    assert f"{len(table.subjects)} subjects x 3 relations" in block["compared_with"]
    for mode, entry in block["modes"].items():
        d_star = entry["threshold"]["d_star"]
        ds = [p["d"] for p in entry["points"]]
        assert ds == curve_widths(d_star, 24) and ds[-1] == 24
        assert [p["d_over_dstar"] for p in entry["points"]] == [round(d / d_star, 3) for d in ds]
        for p in entry["points"]:
            assert p["train"]["accuracy"] == 1.0
            assert is_metric(p["r2"]) and {"shuffled", "random_init"} <= set(p["r2"]["nulls"])
            assert p["r2"]["n"] == len(table.subjects) and p["r2"]["ci"][0] <= p["r2"]["value"] <= p["r2"]["ci"][1]
            assert set(p["readout"]) == set(table.relations)
            for m in p["readout"].values():
                assert m["interval"].startswith("wilson") and m["ci"][0] < m["ci"][1] and 0 < m["n"] <= len(table.subjects)
                assert {"shuffled", "random_init"} <= set(m["nulls"])
            assert p["selector"]["base_accuracy"] == [1.0] * 3 and len(p["selector"]["ablation_drop"]) == 3
    trainable = block["modes"]["trainable"]["points"][0]           # at d*: the facts are readable from e_s
    assert trainable["r2"]["value"] > trainable["r2"]["nulls"]["shuffled"]["value"] + 0.3
    assert trainable["r2"]["value"] > trainable["r2"]["nulls"]["random_init"]["value"] + 0.3
    assert trainable["readout_mean"]["value"] > trainable["readout_mean"]["nulls"]["shuffled"]["value"] + 0.25


def test_pooled_readout_weights_relations_by_their_facts():
    a = Metric(1.0, (0.8, 1.0), 30, "wilson").with_nulls({"shuffled": Metric(0.1, (0.0, 0.3), 30, "wilson")})
    b = Metric(0.5, (0.3, 0.7), 10, "wilson").with_nulls({"shuffled": Metric(0.3, (0.1, 0.6), 10, "wilson")})
    pooled = pooled_readout({"a": a.to_dict(), "b": b.to_dict()})
    assert pooled["value"] == pytest.approx(35 / 40) and pooled["n"] == 40
    assert pooled["ci"][0] < 35 / 40 < pooled["ci"][1]
    assert pooled["nulls"]["shuffled"]["value"] == pytest.approx(6 / 40) and pooled["primary_null"] == "shuffled"
    assert pooled_readout({}) is None


def test_report_sources_and_curve_figure(block):
    metric = lambda v: Metric(v, (v - 0.05, v + 0.05), 60, "bootstrap").to_dict()   # noqa: E731
    pretrained = {"schema_version": 1, "kind": "pretrained", "model": {"name": "tiny", "n_layers": 4},
                  "analyses": {"superposition": {"layers": {"1": {"r2": metric(0.10), "readout": {}},
                                                            "2": {"r2": metric(0.17), "readout": {}}}}},
                  "matched": block}
    sources = with_matched([pretrained])
    n_points = sum(len(e["points"]) for e in block["modes"].values())
    assert len(sources) == 1 + n_points and len(matched_sources(block, 1)) == n_points
    star = [s for s in sources[1:] if s["label"].endswith("(d*)")]
    assert len(star) == 2 and all(s["analyses"]["superposition"]["layers"]["0"]["r2"] for s in star)
    caption = controls_caption(sources)
    assert "layer 2 of tiny" in caption and "highest" in caption and block["compared_with"] in caption
    assert capacity_figure(sources).startswith("data:image/png;base64,")
    assert "synthetic frozen d=24" in render_markdown(sources, "t")
    old = [dict(s, threshold={"d_star": 4, "tried": [{"d": 4, "accuracy": 1.0}]}) for s in star]
    assert len(matched_sources(old, 1)) == 2                     # reports written before the block: passed through


def _drop_seconds(line: str) -> str:
    return re.sub(r"in [0-9.]+ s", "in ? s", line)


def test_the_workers_progress_lines_reach_the_parent_and_its_result_comes_back(table):
    """MatchedWorker relays each progress line of the spawned worker's train_matched to ``on_progress`` in this
    process (where run writes it above its progress bar), then returns the same block as training here; a worker
    killed mid-way is a RuntimeError naming its death, not a hang."""
    from llmprobe.jobs.matched import MatchedWorker

    kwargs = dict(d_model=4, max_steps=50, recipe="adam", modes=("trainable",), at_model_width=False, n_boot=20)
    lines: list[str] = []
    worker = MatchedWorker((table,), kwargs, on_progress=lines.append)
    controls, seconds = worker.get()
    here: list[str] = []
    alone = train_matched(table, progress=here.append, **kwargs)["modes"]
    assert json.dumps(_numbers(controls["modes"])) == json.dumps(_numbers(alone))     # NaN where never fitted
    assert [_drop_seconds(line) for line in lines] == [_drop_seconds(line) for line in here] and any("d*" in line for line in lines) and seconds > 0
    assert worker.ready()

    worker = MatchedWorker((table,), {**kwargs, "max_steps": 100000}, on_progress=lines.append)
    worker.process.kill()
    with pytest.raises(RuntimeError, match="controls worker died"):
        worker.get()


def test_each_mode_trained_apart_and_merged_is_the_block_of_both_trained_together(table, block):
    """run trains each mode in its own worker: the merged block has every number of the block trained in one
    call (nothing passes from one mode to the other), compared_with names both modes, and blocks of different
    settings refuse to merge."""
    kwargs = dict(d_model=24, max_steps=600, recipe="adam", progress=lambda *_: None, n_boot=200)
    apart = [train_matched(table, modes=(mode,), **kwargs) for mode in ("frozen", "trainable")]
    merged = merge_matched(apart)
    assert list(merged["modes"]) == ["trainable", "frozen"]
    assert json.dumps(_numbers(merged)) == json.dumps(_numbers(block))
    assert merged["wall_seconds"] == max(b["wall_seconds"] for b in apart)
    other = train_matched(table, modes=("frozen",), **{**kwargs, "max_steps": 50})
    with pytest.raises(ValueError, match="differ in .*training"):
        merge_matched([apart[1], other])


def test_the_plan_prices_each_width_as_the_run_plan_does():
    """``jobs.plan.matched_planned`` (what ``llmprobe run`` gives each mode's worker for its time left): at the
    plan's own widths the search plus the curve are the seconds ``predict`` gives that mode (this CPU, scaled,
    and one H200); a width between two planned ones has steps between theirs (interpolated in log d); its width
    function survives pickling (the worker is a spawned process)."""
    import pickle

    from llmprobe.jobs.plan import CPU_FITS, matched_curve, matched_planned, matched_width_steps, predict_on
    from llmprobe.jobs.workload import PRESETS

    shape = PRESETS["smollm2-135m"]
    work = {"forward": [], "edits": [], "jacobian": [], "lre_layers": [], "head_rows": 0, "states": [], "known": [],
            "lre_fits": 0, "ridge_fits": 0, "readouts": 0, "readout_subjects": 0, "n_subjects": 193, "n_facts_table": 1158,
            "at_model_width": True, "n_seeds": 3,
            "controls": [{"facts": "all", "recipe": "weight_decay", "n_seeds": 3, "past_fit": 1000, "max_steps": 1000,
                          "n_facts": 1158, "n_subjects": 193}]}        # the control matched_planned prices by default
    for mode in ("trainable", "frozen"):
        one, scale = {**work, "matched_modes": (mode,)}, 1.7
        for device in ("cpu", "h200"):
            expected = predict_on(shape, one, CPU_FITS, device, None, scale)
            plan = matched_planned(mode, shape.d, 1158, 193, True, 3, device, scale)
            assert plan["search"] + plan["curve"] == pytest.approx(expected["matched"], rel=1e-12)
            width = pickle.loads(pickle.dumps(plan["width"]))
            assert plan["curve"] == pytest.approx(sum(width(d) for d, _ in matched_curve(mode, shape.d)), rel=1e-12)
    curve = dict(matched_curve("trainable", 576))                     # {3: 6000, 6: 786, 12: 570, ...}
    assert matched_width_steps("trainable", 6, 576) == curve[6] and matched_width_steps("trainable", 2, 576) == curve[3]
    assert curve[6] > matched_width_steps("trainable", 8, 576) > curve[12]
    measure = CPU_FITS["matched_measure"]["a"] * 193 ** 2 * 3 + CPU_FITS["matched_measure"]["b"]   # not capped
    whole = matched_planned("trainable", 576, 1158, 193)["width"]          # the weight-decay recipe: 1000 steps
    shorter = matched_planned("trainable", 576, 1158, 193, max_steps=600)["width"]    # its schedule cut to 600
    measure_48 = CPU_FITS["matched_measure"]["a"] * 193 ** 2 * 48 + CPU_FITS["matched_measure"]["b"]
    assert shorter(48) - measure_48 == pytest.approx((whole(48) - measure_48) * 0.6, rel=1e-9)
    capped = matched_planned("trainable", 576, 1158, 193, max_steps=600, recipe="adam")["width"]   # 600 at most
    full = matched_planned("trainable", 576, 1158, 193, recipe="adam")["width"]
    assert capped(3) - measure == pytest.approx((full(3) - measure) * 0.3, rel=1e-9)
    assert capped(48) == full(48)                                      # adam stops at d = 48 before 600 steps
    assert matched_planned("frozen_all", 576, 1158, 193) is None


def test_run_gives_each_modes_worker_the_plan_of_its_table(table, monkeypatch, capsys):
    """``jobs.main.planned_matched``: the plan of each mode on the run's table, seeds and widths (this CPU scaled
    by REFERENCE_RATE / its matmul rate), picklable for the spawned worker; a plan that cannot be made is said and
    leaves the controls without a time left."""
    import pickle

    import llmprobe.jobs.main as job
    from llmprobe.jobs.plan import REFERENCE_RATE, matched_planned

    monkeypatch.setattr(job, "measured_rate", lambda: REFERENCE_RATE / 2)
    arguments = {"device": "cpu", "at_model_width": True, "n_seeds": 3, "max_steps": 600, "recipe": "adam",
                 "facts": "all", "all_facts": {"table": table, "recipe": "adam", "n_seeds": 1}}
    plans = pickle.loads(pickle.dumps(job.planned_matched(table, 24, ("trainable", "frozen"), arguments)))
    n_facts = int((table.table >= 0).sum())
    for mode in ("trainable", "frozen"):
        expected = matched_planned(mode, 24, n_facts, len(table.subjects), True, 3, "cpu", 2.0, 600, 100, "all")
        apart = matched_planned(mode, 24, n_facts, len(table.subjects), True, 1, "cpu", 2.0, 2000, 100, "all")
        assert plans[mode]["apart"] == apart["search"] + apart["curve"] > 0      # the all-facts control after it
        assert plans[mode]["search"] == expected["search"] and plans[mode]["curve"] == expected["curve"]
        assert plans[mode]["width"](7) == expected["width"](7) > 0
    assert job.planned_matched(table, 24, ("trainable",), {"device": "cpu"}) == {}
    assert "no plan of the matched controls' time (KeyError" in capsys.readouterr().err


_KILLED_WORKER = '''
import multiprocessing, sys, time

def child(parent_pid):
    from llmprobe.jobs.matched import worker_setup
    from tqdm.auto import tqdm
    worker_setup(parent_pid)
    for _ in tqdm(range(3)):
        pass
    print("bar done", flush=True)
    time.sleep(60)

if __name__ == "__main__":
    import os
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=child, args=(os.getpid(),), daemon=True)
    process.start()
    deadline = time.time() + 60
    while time.time() < deadline and not open(sys.argv[1]).read():
        time.sleep(0.1)
    process.kill()
    process.join()
'''


def test_a_killed_worker_leaves_no_semaphore_behind(tmp_path):
    """A worker killed after its progress bar (as run kills its helpers at the end) leaves the parent's exit
    quiet: tqdm's default multiprocessing lock in a spawned process was a semaphore its resource tracker
    reported as leaked."""
    import subprocess
    import sys

    script, said = tmp_path / "killed_worker.py", tmp_path / "said.txt"
    script.write_text(_KILLED_WORKER)
    said.write_text("")
    with open(said, "w") as out:
        done = subprocess.run([sys.executable, str(script), str(said)], stdout=out, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "bar done" in said.read_text()
    assert "leaked semaphore" not in done.stderr, done.stderr
