"""Which matched controls are trained and how they are named: the graded control on the facts the model knows with
the converging recipe, the all-facts control shown apart, each block saying its table and recipe, units keyed by
both, older reports (without these keys) still read and rendered."""
import json
import types

import pytest
from test_report import R2_NULLS, _claims_report, _line, _r2
from test_seed_verdicts import _control, _r2_line

from llmprobe.analyses.passes import PlannedFact
from llmprobe.analyses.results import MatchedBlock
from llmprobe.datasets import FactTable, Relation, load_relations
from llmprobe.jobs.main import all_facts_control, matched_table
from llmprobe.jobs.plan import smollm2_tokenizer
from llmprobe.report.claims import SUPERPOSITION
from llmprobe.report.render import render_markdown, with_matched
from llmprobe.settings import from_options, from_record
from synthetic.batched import train_batched
from synthetic.matched import RECIPES, RULES, r2_value, train_matched
from synthetic.model import auto_chunk
from synthetic.sweep import SweepConfig, width_config
from synthetic.tasks import from_fact_table
from synthetic.train import TrainConfig

NAMES = ["country_capital", "country_continent", "country_subregion"]


@pytest.fixture(scope="module")
def relations():
    """30 countries x capital, continent, subregion."""
    return [Relation(r.name, r.templates, r.neutral_templates, r.facts[:30], r.properties)
            for r in load_relations(NAMES)]


@pytest.fixture(scope="module")
def known(relations):
    """Which facts the model "knows": a fixed pattern that leaves some subjects with one or two relations known
    and four subjects with none."""
    return {rel.name: [PlannedFact(f.subject, f.object, (i + 2 * r) % 3 != 0 and i not in (5, 11, 17, 23))
                       for i, f in enumerate(rel.facts)] for r, rel in enumerate(relations)}


@pytest.fixture(scope="module")
def lm():
    """What matched_table reads of a loaded model: its tokenizer (SmolLM2's, embedded)."""
    return types.SimpleNamespace(tokenizer=smollm2_tokenizer())


def _facts(table: FactTable) -> set[tuple[str, str, str]]:
    """(subject, relation, object) of every filled cell of a fact table."""
    return {(s, rel, table.attributes[r][int(a)]) for i, s in enumerate(table.subjects)
            for r, rel in enumerate(table.relations) if int(a := table.table[i, r]) >= 0}


def test_the_known_facts_control_trains_on_exactly_the_facts_the_model_knows(lm, relations, known):
    """matched_table "known": the superposition table's cells the model knows, no other (a subject keeps the
    relations it knows, a subject with none is left out); "all": every fact. The control trained on it counts
    exactly those facts and says so."""
    report = {"relations": {}}
    known_table, dropped = matched_table(lm, relations, known, report, True, {}, "known")
    full, _ = matched_table(lm, relations, known, report, True, {}, "all")
    expected = {(f.subject, rel, f.object) for rel, rows in known.items() for f in rows if f.known}
    assert dropped == [] and _facts(known_table) == expected and len(expected) == 52
    assert _facts(full) == {(f.subject, rel.name, f.object) for rel in relations for f in rel.facts}
    assert set(known_table.subjects) == {s for s, _, _ in expected} and len(known_table.subjects) == 26
    assert known_table.attributes == full.attributes            # the same attribute sets (one output vocabulary)
    block = train_matched(known_table, d_model=6, max_steps=40, n_seeds=1, modes=("trainable",), n_boot=10,
                          at_model_width=False, facts="known", progress=lambda *_: None)
    assert block["table"]["n_facts"] == 52 and block["table"]["facts"] == "known"
    assert block["table"]["n_subjects"] == 26


def test_the_default_run_trains_the_graded_known_control_and_the_all_facts_one_only_when_asked(lm, relations, known):
    """Defaults: the graded control on the known facts with the weight_decay recipe, no all-facts control;
    matched.all_facts = true adds it (every fact, its own recipe and seeds)."""
    report = {"relations": {}}
    default = from_options("run", None, {})
    assert (default.matched.facts, default.matched.recipe, default.matched.all_facts) == ("known", "weight_decay",
                                                                                         False)
    assert all_facts_control(lm, relations, known, report, True, default) is None
    asked = from_options("run", None, {"matched_options": {"all_facts": True, "all_facts_n_seeds": 2}})
    apart = all_facts_control(lm, relations, known, report, True, asked)
    assert apart["recipe"] == "adam" and apart["n_seeds"] == 2 and len(_facts(apart["table"])) == 90
    assert all_facts_control(lm, relations, known, report, False, asked) is None    # no superposition table


def _numbers(block: dict) -> list:
    """The trained numbers of a block: per mode and point, each seed's steps and R^2 values."""
    return [(mode, p["d"], [(s["steps"], s["r2_final"], s["r2_by_budget"]) for s in p["seeds"]])
            for mode, entry in block["modes"].items() for p in entry["points"]]


def test_the_recipe_and_table_are_recorded_and_units_of_another_recipe_are_trained_again(lm, relations, known,
                                                                                          tmp_path, monkeypatch):
    """The block records its recipe (lr, weight decay), its rule (the whole schedule: every seed trains max_steps)
    and its table, in ``training``, ``table`` and ``compared_with``; the all-facts control shown apart records its
    own. Units are keyed by the recipe and the table: a resume with another recipe trains every unit again (said),
    one with the same settings reads every unit back and gives the same numbers."""
    known_table, _ = matched_table(lm, relations, known, {"relations": {}}, True, {}, "known")
    full, _ = matched_table(lm, relations, known, {"relations": {}}, True, {}, "all")
    kwargs = dict(d_model=5, max_steps=40, n_seeds=2, modes=("trainable",), n_boot=10, at_model_width=False,
                  facts="known", checkpoints=tmp_path, progress=lambda *_: None)
    apart = {"table": full, "recipe": "adam", "n_seeds": 1, "max_steps": 80, "past_fit": 10}
    block = train_matched(known_table, recipe="weight_decay", all_facts=apart, **kwargs)
    training = block["training"]
    assert (training["recipe"], training["lr"], training["weight_decay"]) == ("weight_decay",
                                                                             *RECIPES["weight_decay"].values())
    assert training["past_fit"] >= training["max_steps"] == 40 and "whole 40-step" in training["stopping_rule"]
    assert all(s["steps"] == 40 for p in block["modes"]["trainable"]["points"] for s in p["seeds"])
    assert "weight_decay recipe (Adam, lr 0.03, weight decay 0.001," in block["compared_with"]
    assert "the facts the pretrained model knows" in block["compared_with"] and "52 facts" in block["compared_with"]
    shown = block["all_facts"]
    assert shown["table"]["facts"] == "all" and shown["table"]["n_facts"] == 90 and shown["seeds"] == [0]
    assert (shown["training"]["recipe"], shown["training"]["lr"], shown["training"]["past_fit"]) == ("adam", 0.1, 10)
    assert "every fact of the table" in shown["compared_with"] and "adam recipe" in shown["compared_with"]
    assert (tmp_path / "trainable").is_dir() and (tmp_path / "all_facts" / "trainable").is_dir()
    typed = MatchedBlock.from_dict(block)
    assert typed.described() == "known facts, weight_decay recipe, 2 seeds"
    assert MatchedBlock.from_dict(typed.all_facts).described() == "all facts, adam recipe, 1 seed"

    lines = []
    again = train_matched(known_table, recipe="weight_decay", all_facts=apart,
                          **{**kwargs, "progress": lines.append, "resume": True})
    assert not any("trained again" in line for line in lines) and sum("(--resume)" in line for line in lines) == 2
    assert _numbers(again) == _numbers(block) and _numbers(again["all_facts"]) == _numbers(block["all_facts"])

    lines = []
    other = train_matched(known_table, recipe="adam", past_fit=40,     # the same rule: only the recipe differs
                          **{**kwargs, "progress": lines.append, "resume": True})
    assert any("its key differs), so it is trained again" in line for line in lines)
    assert not any("(--resume)" in line for line in lines) and other["training"]["recipe"] == "adam"

    lines = []                            # the same recipe name with another weight decay: trained again too
    monkeypatch.setitem(RECIPES, "weight_decay", {**RECIPES["weight_decay"], "weight_decay": 2e-3})
    train_matched(known_table, recipe="weight_decay", **{**kwargs, "progress": lines.append, "resume": True})
    assert any("its key differs), so it is trained again" in line for line in lines)
    assert not any("(--resume)" in line for line in lines)


def test_the_graded_recipe_is_converged_at_a_wide_width_within_its_schedule():
    """The weight_decay recipe's whole schedule (:data:`RULES`) takes a control far wider than its table needs to
    the R^2 of a narrow one: 60 countries x 6 relations (a third of the facts missing, 240 facts), R^2 of the
    superposition fit of e_s at d = 128 within 0.03 of d = 8 (measured 0.952 and 0.942; with weight decay 1e-4
    the wide one is still at 0.861 after 1000 steps, 0.936 after 2000)."""
    names = ["country_capital", "country_continent", "country_currency", "country_demonym", "country_language",
             "country_subregion"]
    relations = [Relation(r.name, r.templates, r.neutral_templates,
                          [f for i, f in enumerate(r.facts[:60]) if (7 * i + k) % 3], r.properties)
                 for k, r in enumerate(load_relations(names))]
    task = from_fact_table(FactTable.from_relations(relations))
    rule = RULES["weight_decay"]
    train = TrainConfig(**RECIPES["weight_decay"], max_steps=rule["max_steps"], past_fit=rule["max_steps"],
                        progress=False, threads=1, chunk=auto_chunk(task.n_outputs, "cpu"))
    cfg = SweepConfig(train=train)
    r2 = {}
    for d in (8, 128):
        result = train_batched([task], [width_config(task, "trainable", d, cfg, 0)], train)[0]
        assert result.accuracy == 1.0
        r2[d] = r2_value(result.model.subject_embed.detach(), result.model.unembed_weight.detach(), task, 0)[0]
    assert r2[8] > 0.9 and abs(r2[128] - r2[8]) < 0.03, r2


def test_an_older_report_reads_as_the_all_facts_control_and_a_new_one_names_both():
    """A block without ``table.facts``, ``training.recipe`` or ``all_facts`` (older reports) reads as the
    all-facts control and renders; a block that has them names the graded control by its table and recipe and
    shows the all-facts control's number beside, graded nothing."""
    old = _control(r2=[0.50, 0.52, 0.48])
    assert MatchedBlock.from_dict(old).all_facts is None
    line = _r2_line([0.50, 0.52, 0.48])
    assert "all facts, 3 seeds" in line["comparison"]["name"] and "all-facts control" not in line["note"]

    apart = _control(r2=[0.20, 0.22, 0.24])
    apart["table"] = {**apart["table"], "facts": "all"}
    apart["training"] = {"max_steps": 2000, "recipe": "adam"}
    apart["seeds"] = [0]
    new = _control(r2=[0.50, 0.52, 0.48])
    new["table"] = {**new["table"], "facts": "known"}
    new["training"] = {"max_steps": 1000, "recipe": "weight_decay"}
    new["all_facts"] = apart
    report = _claims_report(superposition={"1": {"r2": _r2(0.170, 0.132, 0.208, R2_NULLS)}}, controls=new)
    line = _line(report, SUPERPOSITION)
    assert "known facts, weight_decay recipe, 3 seeds" in line["comparison"]["name"]
    assert line["comparison"]["word"] == "less than" and line["comparison"]["metric"]["value"] == pytest.approx(0.5)
    assert "beside, the all-facts control (all facts, adam recipe, 1 seed, not graded): 0.220" in line["note"]
    assert line["comparison"]["all_facts"]["metric"]["value"] == pytest.approx(0.22)
    page = render_markdown(with_matched([{**report, "schema_version": 3}]), "t")
    assert "synthetic all-facts trainable d=8" in page and "synthetic trainable d=8" in page
    assert json.dumps(report)                      # still plain JSON


def test_a_rerun_of_an_older_report_trains_its_controls_on_every_fact_as_it_did():
    """Settings recorded before ``matched.facts`` existed (their controls trained every fact with adam) are read
    with ``facts = "all"`` and their recorded recipe, so a rerun repeats them; a record that has ``facts`` keeps it."""
    older = {"command": "run", "matched": {"enabled": True, "max_steps": 2000, "past_fit": 100, "recipe": "adam"}}
    _, settings = from_record(older)
    assert (settings.matched.facts, settings.matched.recipe, settings.matched.past_fit) == ("all", "adam", 100)
    _, settings = from_record({"command": "run", "matched": {"facts": "known", "recipe": "weight_decay"}})
    assert (settings.matched.facts, settings.matched.recipe, settings.matched.past_fit) == ("known", "weight_decay",
                                                                                          None)
