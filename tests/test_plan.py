"""Issue 24, "A plan before it starts": ``llmprobe plan`` predicts each stage of ``llmprobe run`` from the model's
config alone (``llmprobe.jobs.plan``, the cost model of benchmarks/scaling.py with its fits shipped)."""
import json
import os
import re
import shutil

import pytest
import torch
import transformers
from tiny_models import CONFIGS, save_tiny

import llmprobe.jobs.cost_model as cost_model
import llmprobe.jobs.plan as plan_module
import llmprobe.jobs.workload as workload_module
from llmprobe.analyses.passes import PlannedFact
from llmprobe.analyses.run import parts_of
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.checks import UsageError
from llmprobe.cli import main
from llmprobe.commands import print_plan
from llmprobe.datasets import load_relations
from llmprobe.jobs.plan import (
    CPU_FITS,
    REFERENCE_RATE,
    auto_rank,
    format_plan,
    matmul_rate,
    part_seconds,
    plan,
    predict_on,
    stages,
)
from llmprobe.jobs.workload import SMOLLM2_KNOWN, TARGETS, shape_from_config
from llmprobe.model.loading import load_model
from llmprobe.names import ANALYSES
from llmprobe.settings import from_options


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def config_only(folder, where, **changes):
    """A folder holding only ``folder``'s config.json (no weights, no tokenizer), with ``changes`` made."""
    where.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, **changes}))
    return where


def test_a_config_alone_gets_a_plan_and_a_deeper_or_wider_model_costs_more(tiny, tmp_path):
    base = plan(config_only(tiny, tmp_path / "base"), rate=REFERENCE_RATE)
    assert list(base["stages"]) == list(stages()) and base["shape"]["layers"] == 3 and base["device"] == "cpu"
    assert all(stage["seconds"] > 0 and stage["peak_bytes"] > 0 for stage in base["stages"].values())
    deep = plan(config_only(tiny, tmp_path / "deep", num_hidden_layers=6), rate=REFERENCE_RATE)
    wide = plan(config_only(tiny, tmp_path / "wide", hidden_size=64, intermediate_size=128), rate=REFERENCE_RATE)
    for bigger in (deep, wide):
        for stage in ("jacobians", "decoders_other", "known_facts"):          # decoders_other: the capture passes
            assert bigger["stages"][stage]["seconds"] > base["stages"][stage]["seconds"], stage
        assert bigger["shape"]["params"] > base["shape"]["params"]
    analyses = sum(base["stages"][s]["seconds"] for s in ("jacobians", "decoders_other", "superposition",
                                                           "crosspatch", "selector", "multihop"))
    controls = base["stages"]["matched"]["seconds"]             # the longer mode's worker
    both = base["total"]["matched_seconds"]                     # trainable and frozen, one worker each
    assert controls < both <= 2 * controls
    processes = base["total"]["analyses_processes"]               # the known facts and analyses are shared by them
    assert base["total"]["seconds"] == pytest.approx(base["stages"]["load"]["seconds"] + base["stages"][
        "known_facts"]["seconds"] / processes + max(analyses / processes, controls,
                                                    (analyses + both) / len(os.sched_getaffinity(0))))


def test_a_slower_machine_predicts_proportionally_more_cpu_time_and_the_same_h200_time(tiny):
    fast, slow = plan(tiny, rate=REFERENCE_RATE), plan(tiny, rate=REFERENCE_RATE / 2)
    assert slow["stages"]["jacobians"]["seconds"] == pytest.approx(2 * fast["stages"]["jacobians"]["seconds"])
    assert plan(tiny, device="h200")["rate"] is None
    with pytest.raises(UsageError, match="tpu"):
        plan(tiny, device="tpu")


def test_a_relation_subset_and_fewer_layers_predict_less(tiny):
    full = plan(tiny, rate=REFERENCE_RATE)
    some = plan(tiny, from_options("run", None, {"relations": ["country_capital", "country_continent"]}),
                rate=REFERENCE_RATE)
    assert some["assumed"]["relations"] == 2 < full["assumed"]["relations"]
    assert some["assumed"]["known"] == SMOLLM2_KNOWN["country_capital"] + SMOLLM2_KNOWN["country_continent"]
    for stage in ("known_facts", "jacobians", "decoders_other"):
        assert some["stages"][stage]["seconds"] < full["stages"][stage]["seconds"], stage
    assert some["total"]["seconds"] < full["total"]["seconds"]
    smol = plan("HuggingFaceTB/SmolLM2-135M", rate=REFERENCE_RATE)
    one = plan("HuggingFaceTB/SmolLM2-135M", from_options("run", None, {"layers": "15"}), rate=REFERENCE_RATE)
    assert one["assumed"]["layers"] == one["assumed"]["lre_layers"] == [15]
    for stage in ("jacobians", "decoders_other", "superposition"):     # LRE layers 6, 15, 24 -> 15 alone
        assert one["stages"][stage]["seconds"] < smol["stages"][stage]["seconds"], stage
    bare = plan("HuggingFaceTB/SmolLM2-135M", from_options("run", None, {"analyses": "ridge", "matched": False}),
                rate=REFERENCE_RATE)
    assert bare["stages"]["jacobians"]["seconds"] == bare["stages"]["matched"]["seconds"] == 0
    assert all(bare["stages"][s]["seconds"] == bare["stages"][s]["peak_bytes"] == 0
               for s in ("crosspatch", "selector", "multihop"))
    assert all(smol["stages"][s]["seconds"] > 0 for s in ("crosspatch", "selector", "multihop"))


def test_an_unknown_path_or_name_offline_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match=re.escape(str(tmp_path / "nothing"))):
        plan(str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match="nobody/no-such-model.*presets"):
        plan("nobody/no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="without config.json"):
        plan(str(tmp_path / "empty"))


def test_presets_work_offline_and_memory_grows_with_the_parameters(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    small = plan("HuggingFaceTB/SmolLM2-135M", device="h200")
    large = plan("meta-llama/Meta-Llama-3-8B", device="h200")
    assert large["source"].startswith("preset 8B") and large["shape"]["params"] == 8_030_261_248
    params = large["shape"]["params"] / small["shape"]["params"]
    assert 0.8 < (large["total"]["peak_bytes"] / small["total"]["peak_bytes"]) / params < 1.25
    assert plan("Llama-3-70B", device="h200")["total"]["fits"] is False     # 70B and its random twin: 263 GiB


def test_the_shipped_fits_reproduce_the_benchmark_and_its_documented_table():
    """The plan of the default run is the benchmark's prediction with the shipped fits (this CPU at the fit
    machine's rate) with the default run's controls (the known-facts control, weight_decay), and those fits give
    the predicted walls (SmolLM2 16.6 min here: docs/scaling.md's 15.5 min with the all-facts adam controls of
    before 2026-12-06; 8B on one H200 29.5 min)."""
    shape = TARGETS[0]
    work = plan_module.settings_workload(from_options("run", None, {}), shape.layers)[0]
    expected = predict_on(shape, work, CPU_FITS, "cpu", auto_rank(shape, work["lre_layers"]))
    got = plan(shape, rate=REFERENCE_RATE)
    assert {s: got["stages"][s]["seconds"] for s in stages()} == pytest.approx({s: expected[s] for s in stages()})
    assert got["total"]["seconds"] == pytest.approx(16.6 * 60, rel=0.05)
    assert plan(TARGETS[3], device="h200")["total"]["seconds"] == pytest.approx(29.5 * 60, rel=0.05)


def test_the_cli_prints_the_table_for_a_model_folder(tiny, capsys):
    assert main(["plan", str(tiny), "--relations", "country_capital", "--layers", "every:1"]) == 0
    out = capsys.readouterr().out
    assert f"plan of llmprobe run: {tiny}" in out and "this CPU" in out and "one H200" in out
    for label in (*stages().values(), "run (wall)"):
        assert re.search(rf"^{re.escape(label)} +\d", out, re.M), label
    assert "protocol lre" not in out
    assert main(["plan", "meta-llama/Meta-Llama-3-8B", "--device", "h200", "--out", "never-made"]) == 0
    out = capsys.readouterr().out
    assert "one H200" in out and "this CPU" not in out and "d_model 4096" in out
    assert main(["plan", str(tiny), "--relations", "country_capital", "--layers", "every:1", "--protocol", "lre"]) == 0
    out = capsys.readouterr().out      # what the plan does not price is said
    assert "protocol lre is priced as the default protocol: its 3 in-context known-fact trials" in out


def test_the_analyses_bar_plans_every_part_on_the_facts_the_model_knows(tiny):
    """``part_seconds``: the plan's seconds of every part ``run_analyses`` runs (each relation's decoders, the
    superposition and mechanism analyses), counted on the known facts given: a relation known too little plans
    0 s, more known facts plan more, and the mechanisms' seconds are those of the plan's own stages."""
    lm = load_model(str(tiny), device="cpu", dtype="float32")
    relations = load_relations(None)
    cfg = AnalysisSettings()

    def knowing(share: float) -> dict:
        return {r.name: [PlannedFact(f.subject, f.object, i < share * len(r.facts)) for i, f in enumerate(r.facts)]
                for r in relations}
    little, more = (part_seconds(lm, relations, knowing(share), [0, 2], cfg) for share in (0.25, 0.5))
    assert list(little) == parts_of(relations, ANALYSES)
    assert all(more[part] > little[part] > 0 for part in little if part[0] == "decoders")
    for name in ("crosspatch", "selector", "multihop"):
        assert more[(name, None)] > 0
    none = part_seconds(lm, relations, knowing(0.01), [0, 2], cfg, analyses=("lre",))
    assert list(none) == [("decoders", r.name) for r in relations] and set(none.values()) == {0.0}


def test_run_prints_the_plan_before_loading_and_never_fails_for_it(tiny, tmp_path, capsys, monkeypatch):
    relation = tmp_path / "capital.json"
    facts = [("France", "Paris"), ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Italy", "Rome")]
    relation.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                    "neutral_templates": ["{}"],
                                    "facts": [{"subject": s, "object": o} for s, o in facts]}))
    assert main(["run", str(tiny), "--relations", str(relation), "--layers", "-1", "--device", "cpu",
                 "--no-controls", "--analyses", "", "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "plan of llmprobe run" in err and err.index("plan of llmprobe run") < err.index("loading")

    def broken(*args, **kwargs):
        raise OSError("no config here")
    monkeypatch.setattr("llmprobe.commands.plan", broken)
    print_plan(from_options("run", None, {"model": str(tiny)}), False)
    assert capsys.readouterr().err.strip() == "llmprobe: no plan of this run (OSError: no config here)"


def test_a_folder_copied_without_weights_still_plans_and_format_plan_takes_one_plan(tiny, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tiny, folder)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not weights")                    # were they read, the plan would fail
    text = format_plan(plan(folder, rate=REFERENCE_RATE))
    assert text.count("\n") < 19 and "no weights read" in text
    assert plan_module.measured_rate.cache_info().maxsize == 1    # the machine's rate: measured once a process


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_shape_of_every_family_counts_its_parameters(family):
    """Within 15% of transformers' count (biases and GPT-2's learned positions are left out of the FLOPs)."""
    config = CONFIGS[family](400)
    real = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert shape_from_config(config, family).params == pytest.approx(real, rel=0.15)


def test_the_rate_measurement_leaves_torch_as_it_found_it():
    """``llmprobe run`` measures it before it seeds and loads: its threads and random state stay the run's."""
    torch.set_num_threads(2)
    state = torch.random.get_rng_state()
    assert matmul_rate(1, 0.05) > 1e8
    assert torch.get_num_threads() == 2 and torch.equal(torch.random.get_rng_state(), state)


def test_the_analyses_share_the_cores_the_workers_free_unless_a_model_copy_does_not_fit(monkeypatch):
    """As ``llmprobe run`` starts them: on 2 cores beside two one-thread control workers the analyses run on one
    thread in 2 processes (the wall divides their seconds by 2, the peak holds a model copy per helper); one
    process when a copy would not fit in half the memory, or on 8 cores (6 threads each: 8 // 6)."""
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: {0, 1})
    two = plan(TARGETS[0], rate=REFERENCE_RATE)
    monkeypatch.setattr(plan_module, "_ram_bytes", lambda: 2 * plan_module.PROCESS_BYTES)
    one = plan(TARGETS[0], rate=REFERENCE_RATE)
    assert two["total"]["analyses_processes"] == 2 and one["total"]["analyses_processes"] == 1
    assert two["total"]["peak_bytes"] > one["total"]["peak_bytes"] and two["total"]["seconds"] <= one["total"]["seconds"]
    monkeypatch.undo()
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert plan(TARGETS[0], rate=REFERENCE_RATE)["total"]["analyses_processes"] == 1


def test_without_controls_one_process_runs_the_analyses_on_every_thread_and_the_plan_prices_its_threads(monkeypatch):
    """With no control workers the analyses run in one process on all the cores' threads: its known facts and
    analyses are priced Amdahl's speedup faster than one thread (1.68x on 2 threads, the quick command's measured
    share), where before they were priced as one thread (1.7x over); beside the two workers on 2 cores each process
    has one thread and the price is as it was."""
    assert plan_module.thread_speedup(1) == 1.0
    assert plan_module.thread_speedup(2) == pytest.approx(1.68, abs=0.01)
    assert plan_module.thread_speedup(64) < 1 / (1 - plan_module.THREADS_PARALLEL_FRACTION)
    bare = from_options("run", None, {"matched": False})
    plans = {}
    for cores in (1, 2):
        monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        plans[cores] = plan(TARGETS[0], bare, rate=REFERENCE_RATE)
    assert plans[2]["total"]["analyses_threads"] == 2 and plans[2]["total"]["analyses_processes"] == 1
    load = plans[1]["stages"]["load"]["seconds"]
    assert plans[2]["total"]["seconds"] - load == pytest.approx((plans[1]["total"]["seconds"] - load) / 1.68, rel=0.01)
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: {0, 1})
    with_workers = plan(TARGETS[0], rate=REFERENCE_RATE)["total"]
    assert with_workers["analyses_threads"] == 1 and with_workers["analyses_processes"] == 2


def test_every_constant_of_the_cost_model_has_its_provenance_and_is_the_one_plan_and_workload_use():
    """llmprobe/jobs/cost_model.toml: each fitted, measured or assumed constant has its machine (or "assumed"),
    date, source and note beside its value; plan and workload hold the file's values, in their own types."""
    data = cost_model.DATA
    for name, entry in cost_model.entries().items():
        assert set(entry) == {"value", *cost_model.PROVENANCE}, f"{name}: {sorted(entry)}"
        assert all(isinstance(entry[f], str) and entry[f].strip() for f in cost_model.PROVENANCE), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]), f"{name}: date {entry['date']}"
    assert any(e["machine"] == "assumed" for e in data["H200"].values())
    assert set(data) == {"FITTED", "H200", "MATCHED_PARAMS", "REFERENCE_RATE", "PROCESS_BYTES", "SMOLLM2_KNOWN",
                         "SMOLLM2_KNOWN_FRACTION", "MATCHED_D_STAR", "CONTROL_STEPS", "CONTROL_POINT_STEPS",
                         "MATCHED_SEARCH_S", "THREADS_PARALLEL_FRACTION", "MATCHED_KNOWN_D_STAR",
                         "MATCHED_KNOWN_SEARCH_S"}
    assert plan_module.THREADS_PARALLEL_FRACTION == data["THREADS_PARALLEL_FRACTION"]["value"]
    for name in ("MATCHED_KNOWN_D_STAR", "MATCHED_KNOWN_SEARCH_S"):
        assert getattr(plan_module, name) == data[name]["value"], name
    fitted = plan_module.FITTED
    assert fitted == {stage: tuple(e["value"]) for stage, e in data["FITTED"].items()}
    assert all(type(fit) is tuple and len(fit) == 2 for fit in fitted.values())
    assert set(CPU_FITS) == set(fitted) | {"matched_params"}
    assert all(CPU_FITS[stage] == {"a": 1.0 / rate, "b": b} for stage, (rate, b) in fitted.items())
    assert plan_module.H200 == {key: e["value"] for key, e in data["H200"].items()}
    assert type(plan_module.H200["hbm_bytes"]) is int and plan_module.H200["hbm_bytes"] == 139 * 2**30
    assert CPU_FITS["matched_params"] == data["MATCHED_PARAMS"]["value"] == [16.0, 785.0, 0.0]
    assert REFERENCE_RATE == data["REFERENCE_RATE"]["value"] == 145e9
    assert plan_module.PROCESS_BYTES == data["PROCESS_BYTES"]["value"] == 0.5 * 2**30
    for name in ("SMOLLM2_KNOWN", "SMOLLM2_KNOWN_FRACTION", "MATCHED_D_STAR", "CONTROL_STEPS", "MATCHED_SEARCH_S"):
        assert getattr(workload_module, name) == data[name]["value"], name
    assert workload_module.SMOLLM2_KNOWN_FRACTION == sum(SMOLLM2_KNOWN.values()) / 1574
    assert type(workload_module.CONTROL_STEPS) is int and all(type(n) is int for n in SMOLLM2_KNOWN.values())
    points = workload_module.CONTROL_POINT_STEPS
    assert points == {mode: {int(d): n for d, n in steps.items()}
                      for mode, steps in data["CONTROL_POINT_STEPS"]["value"].items()}
    assert all(type(d) is int and type(n) is int for steps in points.values() for d, n in steps.items())


def test_the_plan_says_when_this_cpu_is_busy(tiny, monkeypatch):
    """The plan assumes idle cores; under load it says so, with the load and the cores it read."""
    planned = plan(tiny, rate=REFERENCE_RATE)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert "busy" not in format_plan(planned)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    line = format_plan(planned).splitlines()[-1]
    assert f"load {3.0 * cores:.1f} over the last minute on {cores} cores" in line and "~4.0x" in line


def test_the_controls_are_priced_at_the_training_rule_set():
    """``matched.past_fit`` and ``matched.max_steps`` move the planned steps of every curve point (each seed: its
    measured first 100% step + past_fit, capped at max_steps; a point that reached the cap stays there), so the
    weight-decay recipe's whole 1000-step schedule is priced as 1000 steps a seed, not as the default's ~100 past
    the fit; the default rule gives the measured steps."""
    default = plan_module.matched_curve("trainable", 576)
    assert default == plan_module.matched_curve("trainable", 576, past_fit=100, max_steps=2000)
    schedule = plan_module.matched_curve("trainable", 576, past_fit=1000, max_steps=1000)
    assert [d for d, _ in schedule] == [d for d, _ in default]
    assert all(steps == 1000 * 3 for _, steps in schedule)
    assert all(steps >= before for (_, steps), (_, before) in zip(plan_module.matched_curve(
        "trainable", 576, past_fit=300), default))
    seconds = {past: plan(TARGETS[0], from_options("run", None, {"matched_options": {"past_fit": past}}),
                          rate=REFERENCE_RATE)["total"]["matched_seconds"] for past in (100, 1000)}
    assert seconds[1000] > 2 * seconds[100]


def test_the_plan_prices_the_graded_known_facts_control_and_the_all_facts_one_when_asked():
    """The default run trains one control per mode: the known-facts table (its facts among the plan's known ones)
    with the weight_decay recipe, every seed its whole 1000-step schedule, at the known table's measured d*;
    matched.all_facts adds the all-facts control (adam's rule, its seeds, every fact) after it, in the same
    worker, and its seconds."""
    settings = from_options("run", None, {})
    work, _, _ = plan_module.settings_workload(settings, 30)
    graded, = work["controls"]
    assert (graded["facts"], graded["recipe"], graded["n_seeds"], graded["max_steps"]) == ("known", "weight_decay",
                                                                                         3, 1000)
    assert 0 < graded["n_facts"] < work["n_facts_table"] and 0 < graded["n_subjects"] <= work["n_subjects"]
    curve = plan_module.matched_curve("frozen", 576, True, 3, graded["past_fit"], 1000, "known")
    assert curve[0][0] == plan_module.MATCHED_KNOWN_D_STAR["frozen"] == 7 and all(s == 3000 for _, s in curve)
    asked = from_options("run", None, {"matched_options": {"all_facts": True, "all_facts_n_seeds": 2}})
    work_asked, _, _ = plan_module.settings_workload(asked, 30)
    assert work_asked["controls"][0] == graded and work_asked["controls"][1] == {
        "facts": "all", "recipe": "adam", "n_seeds": 2, "past_fit": 100, "max_steps": 2000,
        "n_facts": work["n_facts_table"], "n_subjects": work["n_subjects"]}
    alone = plan("HuggingFaceTB/SmolLM2-135M", settings, rate=REFERENCE_RATE)["total"]["matched_seconds"]
    both = plan("HuggingFaceTB/SmolLM2-135M", asked, rate=REFERENCE_RATE)["total"]["matched_seconds"]
    shape = plan_module.model_shape("HuggingFaceTB/SmolLM2-135M", False)[0]
    apart = plan_module.predict_on(shape, {**work_asked, "controls": work_asked["controls"][1:]}, CPU_FITS, "cpu",
                                   None)["matched_total"]
    assert both == pytest.approx(alone + apart) and apart > 0
