"""Settings: defaults <- --config FILE.toml <- --set <- flags, recorded in report.json; rerun; models; the doc.

The end-to-end tests use a tiny random-init Llama whose facts are forced known (a random model knows nothing).
"""
import dataclasses
import inspect
import json
import random
import re
from pathlib import Path

import pytest
import tomllib
import torch
from test_analyses import _relations
from test_helpers import without_seconds
from tiny_models import CONFIGS, save_tiny

import llmprobe.jobs.main
import llmprobe.jobs.probe
import llmprobe.model.known as known_module
from llmprobe import settings as config
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.checks import UsageError
from llmprobe.cli import build_parser, main
from llmprobe.commands import settings_of as command_settings
from llmprobe.jobs import rerun as rerun_job
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import load_options, probe
from llmprobe.model.engine import next_token_predictions
from llmprobe.model.families import ALL, FAMILIES, TESTED, families
from llmprobe.model.loading import load_model
from llmprobe.names import ANALYSES

ROOT = Path(__file__).resolve().parents[1]
# a valid value other than the default for every analysis setting; a new AnalysisSettings field must get one here
NOT_DEFAULT = {
    "n_splits": 2, "max_subjects": 40, "min_known": 4, "n_jacobian": 2, "test_fraction": 0.3, "val_fraction": 0.3,
    "selection_folds": 3, "betas": (1.0, 2.0), "ranks": (None, 8), "edit_ranks": (4, 8), "max_val_pairs": 3,
    "max_test_pairs": 5, "ridge_alphas": (0.1, 10.0), "protocol": "lre", "n_icl": 2, "scoring": "sequence",
    "lre_layers": (1,), "max_lre_layers": 2, "causality_layers": (1,), "superposition_facts": "known",
    "neutral_templates": ("Tell me about {}.",), "attribute_vectors": "mean", "max_superposition_subjects": 20,
    "folds": 3, "random_control": False, "swap_layers": (1,), "max_swap_subjects": 3, "swap_scales": (1.0, 2.0),
    "n_boot": 50, "batch_size": 8, "jacobian_batch_size": 4, "jacobian_chunk": 16, "jacobian_rank": 8,
    "jacobian_oversample": 5, "lre_selection": "as-published", "lre_betas": (0.0, 1.0), "lre_edit_ranks": (0, 8),
    "jackknife_groups": 10,
}
NOT_DEFAULT = {k: v for k, v in NOT_DEFAULT.items() if k in AnalysisSettings.__dataclass_fields__}
FAST = {"n_splits": 1, "n_boot": 50, "folds": 3, "max_val_pairs": 3, "max_test_pairs": 5, "max_swap_subjects": 3,
        "random_control": False, "lre_layers": (1,), "ridge_alphas": (0.1, 10.0)}


def toml_value(value) -> str:
    return config._toml_value(value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama folder and three relation files over 28 made-up countries."""
    root = tmp_path_factory.mktemp("config")
    folder = str(save_tiny("llama", root / "llama"))
    rnd = random.Random(1)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi"]
    subjects = sorted({"".join(rnd.choice(syllables) for _ in range(3)).capitalize() for _ in range(60)})[:28]
    paths = []
    for rel in _relations(subjects)[0]:
        path = root / f"{rel.name}.json"
        path.write_text(json.dumps({"name": rel.name, "templates": rel.templates,
                                    "neutral_templates": rel.neutral_templates, "properties": rel.properties,
                                    "facts": [{"subject": f.subject, "object": f.object} for f in rel.facts]}))
        paths.append(str(path))
    return folder, paths


@pytest.fixture(scope="module")
def planted_known(tiny, tmp_path_factory):
    """The tiny folder and its relations with each object replaced by the tiny model's own top-1 next token, so
    that the LRE prefix rule (zero-shot: ``--set analysis.protocol="lre"``, ``analysis.n_icl=0``) finds every fact
    known in any process: a monkeypatched rule (``all_known``) does not reach a helper process."""
    folder, paths = tiny
    lm = load_model(folder, device="cpu")
    root, planted = tmp_path_factory.mktemp("planted"), []
    for path in paths:
        data = json.loads(Path(path).read_text())
        subjects = [f["subject"] for f in data["facts"]]
        top = next_token_predictions(lm, [data["templates"][0]] * len(subjects), subjects).tolist()
        data["facts"] = [{"subject": s, "object": lm.tokenizer.decode([t]).strip()} for s, t in zip(subjects, top)]
        assert all(f["object"] for f in data["facts"]) and len({f["object"] for f in data["facts"]}) > 1
        planted.append(root / Path(path).name)
        planted[-1].write_text(json.dumps(data))
    return folder, [str(p) for p in planted]


@pytest.fixture
def all_known(monkeypatch):
    """A random model knows nothing: every fact known under both protocols' rules (strict and the prefix rule)."""
    monkeypatch.setattr(known_module, "is_known", lambda text, obj: True)
    monkeypatch.setattr(known_module, "prefix_hit", lambda text, obj: True)


def write_toml(path: Path, sections: dict) -> str:
    lines = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def settings_of(argv: list[str]) -> config.Settings:
    return command_settings(build_parser(synth=False).parse_args(argv))


# ------------------------------------------------------------------------------------- every setting
def test_every_analysis_setting_has_a_test_value_and_every_field_a_known_type():
    fields = {f.name for f in dataclasses.fields(AnalysisSettings)} - {"seed"}
    assert set(NOT_DEFAULT) == fields, f"give NOT_DEFAULT a value for {sorted(fields - set(NOT_DEFAULT))}"
    for section in config.SECTIONS:
        for key, value in config.Settings().section(section).items():
            assert config.coerce(key, value, config.field_types(section)[key]) == value   # defaults type-check
    for key, value in NOT_DEFAULT.items():
        assert value != getattr(AnalysisSettings(), key), key


def test_every_analysis_setting_from_toml_and_from_set(tmp_path):
    from_file = config.resolve(write_toml(tmp_path / "s.toml", {"analysis": NOT_DEFAULT}))
    assert from_file.section("analysis") == NOT_DEFAULT
    sets = [f"analysis.{key}={toml_value(value)}" for key, value in NOT_DEFAULT.items()]
    assert config.resolve(sets=sets).section("analysis") == NOT_DEFAULT
    assert config.from_options("probe", None, {"analysis_options": NOT_DEFAULT}).section("analysis") == NOT_DEFAULT
    assert from_file.changed("analysis") == NOT_DEFAULT
    assert config.resolve().changed("analysis") == {}


def test_settings_from_a_file_reach_the_analyses_and_land_in_report_json(tiny, tmp_path, all_known):
    """Every analysis setting from --config reaches run_analyses (its own record, analyses.settings, says what it
    used) and settings.analysis; n_splits=2 shows in the LRE's re-fits."""
    folder, relations = tiny
    chosen = {**NOT_DEFAULT, **{k: v for k, v in FAST.items() if k != "n_splits"}, "protocol": "strict"}
    path = write_toml(tmp_path / "s.toml", {"run": {"seed": 3}, "analysis": chosen})
    out = tmp_path / "out"
    assert main(["probe", folder, "--relations", *relations, "--layers", "all", "--device", "cpu",
                 "--analyses", "lre,superposition", "--config", path, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    recorded, used = report["settings"]["analysis"], report["analyses"]["settings"]
    assert report["settings"]["command"] == "probe" and report["settings"]["matched"] is None
    assert report["settings"]["run"]["seed"] == 3 and used["seed"] == 3 and report["seed"] == 3
    for key, value in chosen.items():
        expected = list(value) if isinstance(value, tuple) else value
        assert recorded[key] == expected, key
        assert used[key] == expected, key
    lre = report["analyses"]["relations"]["capital"]["layers"]["1"]["lre"]
    assert len(lre["faithfulness"]["spread"]["values"]) == 2          # n_splits re-fits
    assert report["analyses"]["superposition"]["facts"] == "known"


def test_flags_override_set_which_overrides_the_file(tmp_path):
    path = write_toml(tmp_path / "s.toml", {"run": {"layers": "0", "batch_size": 4, "seed": 1},
                                            "analysis": {"n_splits": 2, "protocol": "lre", "n_icl": 3},
                                            "matched": {"max_steps": 7, "at_model_width": True}})
    values = settings_of(["run", "--config", path, "--set", "analysis.n_splits=4", "--set", "run.layers=2",
                          "--set", "analysis.n_icl=4", "--layers", "-1", "--n-icl", "6", "--no-model-width"])
    assert values.run.layers == "-1" and values.run.batch_size == 4 and values.run.seed == 1
    assert values.analysis.n_splits == 4 and values.analysis.protocol == "lre" and values.analysis.n_icl == 6
    assert values.matched.max_steps == 7 and values.matched.at_model_width is False
    assert values.analyses("run") == ANALYSES and values.analyses("probe") == ("lre", "ridge", "superposition")
    assert values.changed("analysis") == {"n_splits": 4, "protocol": "lre", "n_icl": 6}
    assert values.analysis_options() == {"batch_size": 4, "jacobian_batch_size": 4, "n_splits": 4, "protocol": "lre",
                                         "n_icl": 6}
    assert values.matched_arguments() == {"seed": 1, "at_model_width": False, "max_steps": 7, "d_max": None,
                                          "n_boot": 500, "modes": ("trainable", "frozen"), "n_seeds": 3,
                                          "past_fit": None, "recipe": "weight_decay"}
    assert settings_of(["probe"]).analyses("probe") == ("lre", "ridge", "superposition")
    assert settings_of(["run"]).analyses("run") == ANALYSES and settings_of(["probe", "--analyses", ""]).analyses("probe") == ()
    assert settings_of(["run", "--analyses", ""]).analyses("run") == ()
    assert settings_of(["probe", "--set", "run.analyses=['ridge']"]).run.analyses == ("ridge",)
    assert settings_of(["probe", "--analyses", "lre, ridge,lre"]).analyses("probe") == ("lre", "ridge")
    placed = load_options(settings_of(
        ["probe", "--set", "run.max_memory=['cpu=1GiB']", "--max-memory", "0=2GiB,cpu=3GiB", "--device-map", "auto",
         "--set", "run.quantize=8bit", "--set", "run.offload_folder=/tmp/x"]).run)
    assert {k: placed[k] for k in config.PLACEMENT} == {"device_map": "auto", "max_memory": ["0=2GiB,cpu=3GiB"],
                                                        "offload_folder": "/tmp/x", "quantize": "8bit"}
    values = settings_of(["probe", "--set", "run.max_facts=none", "--set", "run.device=cpu", "--set", "run.layers=2"])
    assert values.run.device == "cpu" and values.run.layers == "2" and values.run.max_facts is None
    with pytest.raises(UsageError, match=r"unknown analysis name\(s\) 'ridgee'"):
        settings_of(["probe", "--analyses", "lre,ridgee"])
    with pytest.raises(UsageError, match=r"every:K needs a whole number"):
        settings_of(["probe", "--set", "run.layers=every:0"])


def test_cli_flags_over_a_file_land_in_report_json(tiny, tmp_path):
    folder, relations = tiny
    path = write_toml(tmp_path / "s.toml", {"run": {"layers": "0", "max_facts": 3, "batch_size": 2},
                                            "analysis": {"protocol": "lre"}})
    out = tmp_path / "out"
    assert main(["probe", folder, "--relations", relations[0], "--device", "cpu", "--config", path,
                 "--set", "run.max_facts=5", "--layers", "-1", "--protocol", "strict", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    run = report["settings"]["run"]
    assert run["layers"] == "-1" and report["layers"] == [2]
    assert run["max_facts"] == 5 and report["relations"]["capital"]["n_facts"] == 5 and run["batch_size"] == 2
    assert run["model"] == str(Path(folder).resolve()) and run["relations"] == [str(Path(relations[0]).resolve())]
    assert report["settings"]["analysis"]["protocol"] == "strict"
    # --batch-size is the analyses' batch size too (Jacobians: at most 16) unless set: the record says so
    assert report["settings"]["analysis"]["batch_size"] == 2 and report["settings"]["analysis"]["jacobian_batch_size"] == 2


@pytest.mark.parametrize("content, message", [
    ("[analysis]\nridge_alpha = [1.0]\n", r"unknown setting analysis\.ridge_alpha \(did you mean analysis\.ridge_alphas"),
    ("[analysis]\nn_splits = \"3\"\n", r"analysis\.n_splits: expected int, got \"3\""),
    ("[analysis]\nbetas = [1.0, \"x\"]\n", r"analysis\.betas\[1\]: expected float"),
    ("[analysis]\nrandom_control = 1\n", r"analysis\.random_control: expected true/false"),
    ("[analysis]\nn_splits = 2\nbetas = [1.0,\nfolds = 3\n", r"not valid TOML: .*line 4"),
    ("[analysis]\nseed = 4\n", r"analysis\.seed is set as run\.seed"),
    ("seed = 4\n", r"seed is outside the sections"),
    ("[model]\nname = \"x\"\n", r"unknown section 'model'"),
    ("[matched]\nmodes = [\"frozen_all\"]\n", r"matched\.modes must be a non-empty list of trainable, frozen"),
    ("[analysis]\nprotocol = \"reference\"\n", r"protocol must be one of"),
    ("[run]\ndevice_map = \"everywhere\"\n", r"run\.device_map must be one of auto, balanced"),
    ("[run]\nmax_memory = [\"cpu=lots\"]\n", r"run\.max_memory: .*lots"),
    ("[run]\nquantize = 4\n", r"run\.quantize: expected text or none"),
])
def test_a_bad_settings_file_is_refused_naming_the_key(content, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    # the model does not exist: the settings are checked before anything is loaded
    assert main(["probe", str(tmp_path / "no-model"), "--config", str(path), "--out", str(tmp_path / "o")]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("text, message", [
    ("analysis.n_splits", r"use --set SECTION\.KEY=VALUE"),
    ("n_splits=3", r"use --set SECTION\.KEY=VALUE"),
    ("analysis.n_splits=three", r"analysis\.n_splits: expected int, got \"three\""),
    ("analysis.ranks=[none, 8]", r"analysis\.ranks: expected list of \(int or none"),
    ("matched.max_steps=0", r"matched\.max_steps must be at least 1"),
])
def test_a_bad_set_is_refused_naming_the_key(text, message, tmp_path, capsys):
    assert main(["run", str(tmp_path / "no-model"), "--set", text, "--out", str(tmp_path / "o")]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_settings_file_is_a_usage_error(tmp_path, capsys):
    assert main(["probe", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "none.toml" in capsys.readouterr().err


def _record_controls(monkeypatch) -> dict:
    """Replace run's MatchedWorker by a recorder (training itself is tested in test_matched.py): it keeps the
    keyword arguments the workers get ("kwargs") and this process's torch threads when their controls are
    collected ("threads": the analyses' budget while they trained), and returns an empty controls block of the
    shape train_matched returns."""
    seen = {"kwargs": {}, "threads": []}

    class Recorder:
        def __init__(self, args, kwargs, on_progress=None, on_done=None):
            seen["kwargs"].update(kwargs)

        def get(self):
            seen["threads"].append(torch.get_num_threads())
            table = {"n_subjects": 0, "relations": [], "n_facts": 0, "bits": 0.0}
            training = {"past_fit": 1, "max_steps": 1, "recipe": "adam", "lr": 0.1, "weight_decay": 0.0}
            return {"modes": {}, "table": table, "d_model": 8, "seed": 0, "seeds": [0], "training": training,
                    "wall_seconds": 0.0, "cpu_seconds": 0.0}, 0.0

        def ready(self):
            return True

        def stop(self):
            pass

    monkeypatch.setattr(llmprobe.jobs.main, "MatchedWorker", Recorder)
    return seen


def test_control_settings_reach_the_controls_worker(tiny, tmp_path, all_known, monkeypatch):
    """matched.* from --set reach train_matched' arguments and settings.matched (the worker is replaced by a
    recorder: training itself is tested in test_matched.py)."""
    seen = _record_controls(monkeypatch)["kwargs"]
    folder, relations = tiny
    out = tmp_path / "out"
    assert main(["run", folder, "--relations", *relations, "--analyses", "", "--layers", "-1", "--device", "cpu",
                 "--set", "matched.max_steps=7", "--set", "matched.modes=['frozen']", "--set", "matched.d_max=9",
                 "--set", "matched.n_boot=11", "--no-model-width", "--seed", "2", "--out", str(out)]) == 0
    assert seen["max_steps"] == 7 and seen["modes"] == ("frozen",) and seen["d_max"] == 9 and seen["n_boot"] == 11
    assert seen["at_model_width"] is False and seen["seed"] == 2 and seen["device"] == "cpu"   # a CPU model
    recorded = json.loads((out / "report.json").read_text())["settings"]
    assert recorded["command"] == "run" and recorded["matched"] == {
        "enabled": True, "at_model_width": False, "max_steps": 7, "d_max": 9, "n_boot": 11, "modes": ["frozen"],
        "n_seeds": 3, "past_fit": None, "recipe": "weight_decay", "facts": "known", "all_facts": False,
        "all_facts_recipe": "adam", "all_facts_n_seeds": 1}
    # rerun repeats run (not probe) with the same control settings
    seen.clear()
    assert main(["rerun", str(out), "--out", str(tmp_path / "again")]) == 0
    assert seen["max_steps"] == 7 and seen["modes"] == ("frozen",) and seen["at_model_width"] is False
    assert json.loads((tmp_path / "again" / "report.json").read_text())["settings"] == recorded


# ---------------------------------------------------------------------------------------------- rerun
def test_rerun_reproduces_the_numbers_and_refuses_other_weights(tiny, tmp_path, all_known, capsys):
    folder, relations = tiny
    out = tmp_path / "first"
    fast = [f"--set=analysis.{k}={toml_value(v)}" for k, v in FAST.items()]
    assert main(["probe", folder, "--relations", *relations, "--layers", "all", "--device", "cpu",
                 "--analyses", "lre,ridge,superposition", *fast, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["rerun", str(out), "--out", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out
    first, again = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("first", "again"))
    assert again["settings"] == first["settings"] and again["analyses"]["settings"] == first["analyses"]["settings"]
    comparison = rerun_job.compare_numbers(first, again)
    assert comparison["match"] and comparison["n_numbers"] > 500, comparison["n_numbers"]
    assert "weights: same" in printed and "numbers match" in printed
    # the comparison is not vacuous: one changed number is found
    changed = json.loads(json.dumps(again))
    changed["analyses"]["relations"]["capital"]["layers"]["1"]["lre"]["faithfulness"]["value"] += 0.01
    assert [d[0] for d in rerun_job.compare_numbers(first, changed)["differences"]] == [
        "analyses.relations.capital.layers.1.lre.faithfulness.value"]
    # other weights in the model folder: refused, unless asked for
    save_tiny("llama", Path(folder), seed=1)
    try:
        assert main(["rerun", str(out), "--out", str(tmp_path / "other")]) == 2
        assert "differ from the report's" in capsys.readouterr().err
        assert main(["rerun", str(out), "--out", str(out)]) == 2
        assert "own folder" in capsys.readouterr().err
    finally:
        save_tiny("llama", Path(folder), seed=0)


def test_rerun_needs_recorded_settings(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps({"schema_version": 2, "model": {}}))
    assert main(["rerun", str(tmp_path / "old")]) == 2
    assert "no recorded settings" in capsys.readouterr().err


@pytest.mark.parametrize("text, says", [("{cut", "not valid JSON"), ("[" * 100_000 + "]" * 100_000,
                                                                      "nested too deeply to read")],
                         ids=["cut", "deep"])
def test_rerun_of_an_unreadable_report_names_it(tmp_path, capsys, text, says):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(text)
    assert main(["rerun", str(tmp_path / "old")]) == 2
    err = capsys.readouterr().err
    assert "rerun:" in err and "report.json" in err and says in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------- defaults
# a valid value other than the default for every run setting, as the Python API takes it; a new RunSettings field
# must get one here
API_RUN = {"model": "some/model", "gguf_file": "m.gguf", "relations": ["capital", Path("/no/such/rel.json")],
           "layers": [0, -1], "analyses": "ridge, lre", "device": "cpu", "dtype": "float32", "device_map": "auto",
           "max_memory": {"cpu": "1GiB", 0: "2GiB"}, "offload_folder": Path("/no/such/offload"), "quantize": "8bit",
           "batch_size": 4, "max_facts": 3, "max_prompt_tokens": 40, "seed": 7,
           "chat_template": True, "hf_kwargs": {"data_files": ["a.csv", "b.csv"], "sep": ";"}, "assume_known": ["capital"]}
AS_SETTINGS = {**API_RUN, "relations": ("capital", "/no/such/rel.json"), "layers": "0,-1", "analyses": ("ridge", "lre"),
               "max_memory": ("cpu=1GiB", "0=2GiB"), "offload_folder": "/no/such/offload",
               "assume_known": ("capital",)}


def test_the_python_api_takes_every_setting_by_name_and_names_an_unknown_keyword(tmp_path):
    assert set(API_RUN) == set(config.field_types("run")), "give API_RUN a value for the new run setting"
    settings = config.from_options("run", None, {**API_RUN, "matched": False, "at_model_width": False,
                                                 "analysis_options": {"n_splits": 2},
                                                 "matched_options": {"max_steps": 9, "modes": ["frozen"]}})
    assert settings.section("run") == AS_SETTINGS
    assert settings.analysis.n_splits == 2 and settings.matched == config.MatchedSettings(
        enabled=False, at_model_width=False, max_steps=9, modes=("frozen",))
    assert config.from_options("probe", None, {"layers": None}).run.layers == "all"
    # over given settings, which stay as they were
    base = config.resolve(sets=["run.seed=3", "analysis.n_splits=4"])
    over = config.from_options("probe", base, {"max_facts": 2})
    assert (over.run.seed, over.run.max_facts, over.analysis.n_splits, base.run.max_facts) == (3, 2, 4, None)
    # refused before anything is loaded, naming the keyword or the setting
    for call, message in ((lambda: probe("no/such-model", max_fact=3, out=tmp_path), r"unknown keyword\(s\) max_fact;"),
                          (lambda: probe("no/such-model", matched_options={}, out=tmp_path), "matched_options"),
                          (lambda: run("no/such-model", controlz=False, out=tmp_path), "controlz"),
                          (lambda: probe("no/such-model", batch_size="8", out=tmp_path), r"run\.batch_size: expected int"),
                          (lambda: run("no/such-model", matched_options={"max_step": 3}, out=tmp_path),
                           r"unknown setting matched\.max_step \(did you mean matched\.max_steps"),
                          (lambda: probe("no/such-model", analysis_options={"seed": 1}, out=tmp_path),
                           r"analysis\.seed is set as run\.seed"),
                          (lambda: probe("no/such-model", layers=["x"], out=tmp_path), "list of integers")):
        with pytest.raises(UsageError, match=message):
            call()
    assert not (tmp_path / "report.json").exists()


def test_the_api_and_the_command_line_record_the_same_settings(tiny, tmp_path):
    """The same probe through probe(...) (lists, dicts and paths as the API takes them) and through the command
    line: the same settings block, and the same stage keys."""
    folder, relations = tiny
    api = probe(Path(folder), relations=[Path(relations[0])], layers=[0, -1], device="cpu", max_facts=4,
                batch_size=2, analysis_options={"n_splits": 2}, out=tmp_path / "api")
    assert main(["probe", folder, "--relations", relations[0], "--layers", "0,-1", "--device", "cpu",
                 "--max-facts", "4", "--batch-size", "2", "--set", "analysis.n_splits=2",
                 "--out", str(tmp_path / "cli")]) == 0
    cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert api["settings"] == cli["settings"] and api["stages"] == cli["stages"]
    assert cli["settings"]["run"]["layers"] == "0,-1" and cli["settings"]["analysis"]["batch_size"] == 2


def test_the_control_defaults_agree_with_train_controls():
    """The job passes every control setting to train_matched; its own defaults (the synthetic API) agree."""
    from synthetic import matched

    trained = inspect.signature(matched.train_matched).parameters
    block = config.Settings().section("matched")
    for key in config.TRAINING + ("at_model_width",):
        assert block[key] == trained[key].default, key
    assert set(config.Settings().matched_arguments()) <= set(trained) and config.MATCHED_MODES == matched.MODES


def test_importing_the_settings_loads_no_torch():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, llmprobe.settings; print('torch' in sys.modules)"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_the_doc_lists_every_setting_with_its_default():
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    example = config.settings_toml()
    assert example in doc, "docs/config.md is out of date: paste `llmprobe config` output into it"
    values = config.Settings().update(tomllib.loads(example), "docs/config.md")
    assert values == config.Settings()
    for section in config.SECTIONS:
        for key in config.field_types(section):
            assert re.search(rf"^{key} = ", example, re.M), f"{section}.{key}"


def test_config_command_prints_resolved_settings_that_read_back(tmp_path, capsys):
    assert main(["config", "--set", "analysis.betas=[2.0]", "--set", "run.layers=all"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "printed.toml"
    path.write_text(text)
    values = config.resolve(path)
    assert values.analysis.betas == (2.0,) and values.run.layers == "all"
    assert values.analysis.ridge_alphas == AnalysisSettings().ridge_alphas


# --------------------------------------------------------------------------------------------- models
def test_models_lists_every_family_with_its_checks(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert max(map(len, text.splitlines())) <= 80           # wrapped at the terminal's width
    for family in CONFIGS:
        assert re.search(rf"^{family} \(", text, re.M), family
    assert "SmolLM2-135M-Instruct" in text
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    rows = {row["model_type"]: row for row in listed["families"]}
    assert set(CONFIGS) <= set(rows) and listed["default"]["model_type"] == "llama"
    assert {t["check"] for t in rows["gpt2"]["tested"]} >= {"Jacobians equal central finite differences (float64)"}
    assert not any("finite differences" in t["check"] for t in rows["qwen2"]["tested"])


def test_plan_help_lists_only_what_changes_the_plan(capsys):
    """plan takes a run's whole command line (--out, --executor, --address) but its help lists only its own."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    listed = re.findall(r"^\s+(--[a-z-]+)", text, re.M)
    assert "not used" not in text and "--layers" in listed and "change nothing" in text
    assert not {"--out", "--executor", "--address"} & set(listed)
    assert main(["plan", "--layers", "0", "--out", "somewhere", "--executor", "ray", "--no-matched"]) == 0
    assert "plan of llmprobe run" in capsys.readouterr().out


def test_the_family_table_matches_the_tiny_models_and_the_tests():
    """Places: the adapter of each tiny model resolves every name to the listed module; tests: every named test
    exists, and builds the families it is said to (its file parametrizes over FAMILIES, or names the family)."""
    from transformers import AutoModelForCausalLM

    from llmprobe.model.adapters import ModelAdapter

    assert set(FAMILIES) == set(CONFIGS)
    for family, (architecture, places) in FAMILIES.items():
        model = AutoModelForCausalLM.from_config(CONFIGS[family](64))
        adapter = ModelAdapter(model)
        names = {id(module): name for name, module in model.named_modules()}
        assert type(model).__name__ == architecture
        for place, module in places.items():
            found = adapter.place(place.replace("{l}", "1"))
            side = "input" if found.read_input else "output"
            assert module.replace("{l}", "1") == f"{names[id(found.module)]} ({side})", (family, place)
    for check, test, which in TESTED + tuple((c, t, ("llama",)) for c, t in config_embedded()):
        path, name = test.split("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {name}\(", source, re.M), test
        if which == ALL:
            assert "params=FAMILIES" in source, test
        else:
            assert all(f'"{family}"' in source or path.endswith("test_embedded.py") for family in which), test
    assert all(row["tested"] for row in families() if row["model_type"] in FAMILIES)


def config_embedded():
    from llmprobe.model.families import EMBEDDED

    return EMBEDDED[2]


# ------------------------------------------------------------------- issue 23, row 12: ranges, checked in one place
@pytest.mark.parametrize("text, message", [
    ("analysis.betas=[]", r"analysis\.betas must list at least one value, got \[\]"),
    ("analysis.ridge_alphas=[-1]", r"each value of analysis\.ridge_alphas must be a finite number above 0, got -1"),
    ("analysis.max_lre_layers=0", r"analysis\.max_lre_layers must be at least 1, got 0"),
    ("analysis.jacobian_batch_size=0", r"analysis\.jacobian_batch_size must be at least 1, got 0"),
    ("analysis.test_fraction=1.5", r"analysis\.test_fraction must be a finite number above 0 and below 1, got 1\.5"),
    ("analysis.folds=1", r"analysis\.folds must be at least 2, got 1"),
    ("analysis.n_boot=-1", r"analysis\.n_boot must be at least 1, got -1"),
    ("analysis.betas=[1.0, nan]", r"each value of analysis\.betas must be a finite number above 0, got nan"),
    ("analysis.val_fraction=-0.5", r"analysis\.val_fraction must be a finite number above 0 and below 1, got -0\.5"),
    ("analysis.edit_ranks=[0]", r"each value of analysis\.edit_ranks must be at least 1, got 0"),
    ("analysis.lre_layers=[]", r"analysis\.lre_layers must list at least one value"),
    ("run.seed=99999999999999999999", r"run\.seed must be at least 0 and at most 4294967295, got 9{20}"),
    ("run.seed=-1", r"run\.seed must be at least 0 and at most 4294967295, got -1"),
    ("matched.n_boot=0", r"matched\.n_boot must be at least 1, got 0"),
])
def test_settings_out_of_range_are_refused_naming_the_key_and_the_range(text, message, tmp_path, capsys):
    """Row 12: these were checked for their type only, and ran with every analysis failing (exit 0), or wrote a
    decoders.json that load_decoder could not read (betas=[nan])."""
    assert main(["probe", str(tmp_path / "no-model"), "--set", text, "--out", str(tmp_path / "o")]) == 2
    assert re.search(message, capsys.readouterr().err)
    name, raw = text.split("=", 1)
    section, key = name.split(".")
    value = tomllib.loads(f"v = {raw}")["v"]
    options = {key: value} if section == "run" else {f"{section}_options" if section == "analysis" else
                                                     "matched_options": {key: value}}
    with pytest.raises(UsageError, match=message):                   # the Python API: the same check
        config.from_options("run", None, options)


def test_every_range_names_a_number_setting_and_its_edges_are_allowed():
    for key in config.RANGES:
        section, name = key.split(".")
        assert name in config.field_types(section), key
    edges = ["run.seed=4294967295", "run.seed=0", "analysis.lre_edit_ranks=[0, 8]", "analysis.lre_betas=[0.0]",
             "analysis.n_icl=0", "analysis.jackknife_groups=0", "analysis.jacobian_oversample=0",
             "analysis.ranks=[1]", "analysis.test_fraction=0.01", "analysis.selection_folds=2"]
    assert config.resolve(sets=edges).run.seed == 0


def test_the_controls_workers_threads_come_out_of_the_analyses_budget(tiny, tmp_path, all_known, monkeypatch):
    """While the two control workers (one thread each) train, run's analyses take max(1, threads - workers)
    torch threads (recorded in timings.analyses_threads) in threads // that many processes (analyses_processes),
    and the process gets its threads back afterwards."""
    seen = _record_controls(monkeypatch)["threads"]
    folder, relations = tiny
    before = torch.get_num_threads()
    try:
        for threads, expected, processes in ((5, 3, 1), (2, 1, 2)):
            torch.set_num_threads(threads)
            out = tmp_path / f"out{threads}"
            assert main(["run", folder, "--relations", *relations, "--analyses", "", "--layers", "-1", "--device",
                         "cpu", "--no-model-width", "--out", str(out)]) == 0
            timings = json.loads((out / "report.json").read_text())["timings"]
            assert timings["analyses_threads"] == expected and timings["analyses_processes"] == processes
            start, end = timings["matmul_gflops_one_thread"]                 # the host's speed, both ends
            assert 0.1 < start < 1e5 and 0.1 < end < 1e5
            assert seen[-1] == expected and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_on_two_threads_run_shares_the_analyses_with_a_helper_and_writes_the_one_process_numbers(
        planted_known, tmp_path, monkeypatch):
    """2 threads and two control workers: the known facts, then the analyses, run on 1 thread in this process and
    one helper process (which loads the same folder); the known facts and every analysis number equal the run on
    1 thread (one process: 1 // 1)."""
    _record_controls(monkeypatch)
    folder, relations = planted_known
    fast = [arg for key, value in {**FAST, "protocol": "lre", "n_icl": 0}.items()
            for arg in ("--set", f"analysis.{key}={toml_value(value)}")]
    analyses, known, timings = {}, {}, {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        out = tmp_path / f"out{threads}"
        assert main(["run", folder, "--relations", *relations, "--analyses", "lre,superposition", "--layers", "0,1",
                     "--device", "cpu", "--no-model-width", *fast, "--out", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        analyses[threads], timings[threads] = report["analyses"], report["timings"]
        known[threads] = (json.loads((out / "known_facts.json").read_text()), report["relations"])
    assert timings[2]["known_facts_processes"] == 2 and timings[1]["known_facts_processes"] == 1
    assert timings[2]["known_facts_helper_relations"] == ["language"], "the helper checked no relation"
    assert known[2] == known[1] and all(r["known"] for rows in known[1][0].values() for r in rows)
    assert analyses[2]["timing"]["processes"] == 2 and analyses[1]["timing"]["processes"] == 1
    assert analyses[2]["timing"]["helper_parts"], "the helper computed nothing"
    for key in ("relations", "superposition", "errors"):
        assert without_seconds(analyses[2][key]) == without_seconds(analyses[1][key]), key


def test_the_old_words_of_the_matched_settings_are_still_taken_with_a_warning(tmp_path):
    """Before report schema 3 the matched synthetic models' settings were the section [controls], the flag
    --no-controls and run()'s keywords controls= / control_options=: each is still read, as the new name, and says
    so (FutureWarning)."""
    toml = tmp_path / "old.toml"
    toml.write_text("[controls]\nmax_steps = 11\n")
    with pytest.warns(FutureWarning, match="'controls' is now 'matched'"):
        assert config.resolve(config=toml).matched.max_steps == 11
    with pytest.warns(FutureWarning, match="'controls' is now 'matched'"):
        assert config.resolve(sets=["controls.n_seeds=2"]).matched.n_seeds == 2
    with pytest.warns(FutureWarning, match="now 'matched"):
        old = config.from_options("run", None, {"controls": False, "control_options": {"max_steps": 9}})
    assert old.matched == config.MatchedSettings(enabled=False, max_steps=9)
    from llmprobe.cli import build_parser
    args = build_parser().parse_args(["run", "--no-controls"])
    assert getattr(args, "matched.enabled") is False
