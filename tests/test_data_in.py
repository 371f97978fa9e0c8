"""Relation data in: a datasets.Dataset or pandas.DataFrame as a source, --hf-kwargs (flag, --config, --set,
report.json, rerun), the LRE relations' snake_case names and where a user finds them, the bundled data's sources
and licences, short reprs."""
import json
import re
from importlib import resources

import pytest
import tomllib
from tiny_models import save_tiny

from llmprobe import settings as config
from llmprobe.cli import build_parser, main
from llmprobe.commands import settings_of
from llmprobe.datasets import (
    DatasetError,
    Fact,
    FactTable,
    list_bundled,
    load_relations,
    lre_files_sha256,
    lre_source,
    snake_name,
)

datasets = pytest.importorskip("datasets")
pandas = pytest.importorskip("pandas")

ROWS = [{"subject": "France", "object": "Paris", "template": "The capital of {} is", "relation": "capital"},
        {"subject": "Japan", "object": "Tokyo", "template": "The capital of {} is", "relation": "capital"},
        {"subject": "Obama", "object": "1961", "template": "{} was born in", "relation": "born"},
        {"subject": "Lincoln", "object": "1809", "template": "{} was born in", "relation": "born"}]


def _csv(path, rows, columns):
    path.write_text("\n".join([",".join(columns)] + [",".join(row[c] for c in columns) for row in rows]) + "\n")
    return path


def _frame(rows, columns):
    """The rows as a DataFrame, the years as whole numbers (a numeric column, as pandas reads one)."""
    frame = pandas.DataFrame([{c: row[c] for c in columns} for row in rows])
    return frame.assign(object=[int(o) if o.isdigit() else o for o in frame["object"]])


# --------------------------------------------------------------------------------------- Dataset, DataFrame
def test_a_dataset_and_a_dataframe_read_as_the_same_csv(tmp_path):
    """The same rows as a CSV file, a datasets.Dataset and a pandas.DataFrame (years as numbers there) give the
    same relations: one per value of the relation column, or one named relation= without it; mixed with a bundled
    name in one list."""
    columns = ["subject", "object", "template", "relation"]
    from_csv = load_relations(_csv(tmp_path / "facts.csv", ROWS, columns))
    from_dataset = load_relations(datasets.Dataset.from_list(ROWS))
    from_frame = load_relations(_frame(ROWS, columns))
    assert [r.name for r in from_csv] == ["capital", "born"]
    assert from_csv[1].facts == [Fact("Obama", "1961"), Fact("Lincoln", "1809")]
    for got in (from_dataset, from_frame):
        assert [r.to_dict() for r in got] == [r.to_dict() for r in from_csv]
    assert from_frame[0].source == "pandas.DataFrame (item 0 of load_relations)"
    # no relation column: the file's name, or relation= for every row source
    born = [row for row in ROWS if row["relation"] == "born"]
    (by_file,) = load_relations(_csv(tmp_path / "born.csv", born, columns[:3]))
    (named,) = load_relations([datasets.Dataset.from_list(born).remove_columns("relation")], relation="born")
    assert named.to_dict() == by_file.to_dict() and by_file.name == "born"
    mixed = load_relations(["country_capital", datasets.Dataset.from_list(ROWS[:2]), _frame(born, columns)])
    assert [r.name for r in mixed] == ["country_capital", "capital", "born"]


def test_a_table_missing_a_column_or_a_name_is_refused_naming_it():
    frame = pandas.DataFrame({"subject": ["France"], "answer": ["Paris"], "template": ["The capital of {} is"]})
    with pytest.raises(DatasetError, match=r"pandas\.DataFrame \(item 0 of load_relations\): field 'object' is not "
                                           r"a column \(columns: \['subject', 'answer', 'template'\]\); name the "
                                           r"column that holds the objects with object_column="):
        load_relations(frame)
    with pytest.raises(DatasetError, match=r"no relation column 'relation' .*give relation='NAME'"):
        load_relations(frame, object_column="answer")
    assert load_relations(frame, object_column="answer", relation="capital")[0].facts == [Fact("France", "Paris")]
    with pytest.raises(DatasetError, match=r"field 'rows\[0\]\.answer' must be a non-empty string, got nan"):
        load_relations(frame.assign(answer=[float("nan")]), object_column="answer", relation="capital")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(DatasetError, match=r"DatasetDict holds several splits \['train', 'test'\]; pass one split, "
                                           r"e\.g\. dataset\['train'\]"):
        load_relations(["country_capital", splits])
    with pytest.raises(DatasetError, match="item 1 of load_relations is a dict: give a relation name, a path"):
        load_relations(["country_capital", {"subject": "France"}])


# ------------------------------------------------------------------------------------------------ --hf-kwargs
def _status(argv: list[str]) -> int:
    """The exit status of ``llmprobe ARGV``: argparse's (a bad flag value) or the command's (a refused setting)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_hf_kwargs_from_the_flag_the_file_and_set_and_bad_json_refused(tmp_path, capsys):
    kwargs = {"data_files": {"train": "facts.csv"}, "delimiter": ";"}
    parsed = settings_of(build_parser(synth=False).parse_args(["probe", "--hf-kwargs", json.dumps(kwargs)]))
    assert parsed.run.hf_kwargs == kwargs
    toml = tmp_path / "s.toml"
    toml.write_text('[run]\nhf_kwargs = {data_files = {train = "facts.csv"}, delimiter = ";"}\n')
    assert main(["config", "--config", str(toml)]) == 0
    printed = capsys.readouterr().out
    assert tomllib.loads(printed)["run"]["hf_kwargs"] == kwargs
    assert config.resolve(sets=['run.hf_kwargs={data_files = {train = "facts.csv"}, delimiter = ";"}']) \
        .run.hf_kwargs == kwargs
    for argv, message in ((["--hf-kwargs", "[1]"], "argument --hf-kwargs: .*expected a JSON object"),
                          (["--hf-kwargs", "{data_files: x}"], "argument --hf-kwargs: .*not JSON"),
                          (["--hf-kwargs", '{"split": "test"}'], r"run\.hf_kwargs: split is not taken: name the "
                                                                  r"split in the relation, hf:NAME:SPLIT"),
                          (["--hf-kwargs", '{"trust_remote_code": true}'], r"run\.hf_kwargs: trust_remote_code"),
                          (["--set", 'run.hf_kwargs="facts.csv"'], r"run\.hf_kwargs: expected table")):
        # a relation that is not there: a setting let through stops there, before any model is loaded
        assert _status(["probe", *argv, "--relations", "no_such_relation", "--out", str(tmp_path / "never")]) == 2, argv
        assert re.search(message, capsys.readouterr().err), argv
    assert not (tmp_path / "never").exists()


def test_a_probe_reads_an_hf_csv_through_hf_kwargs_and_rerun_repeats_it(tmp_path, monkeypatch, capsys):
    """probe --relations hf:csv --hf-kwargs '{"data_files": "born.csv"}' (a relative path) reads the local file
    through datasets.load_dataset; report.json records the keywords (the path made absolute), and rerun from
    another folder reads the same facts."""
    folder = save_tiny("llama", tmp_path / "llama")
    work = tmp_path / "work"
    work.mkdir()
    _csv(work / "born.csv", [row for row in ROWS if row["relation"] == "born"], ["subject", "object", "template"])
    monkeypatch.chdir(work)
    kwargs = {"data_files": "born.csv", "cache_dir": str(tmp_path / "cache")}
    assert main(["probe", str(folder), "--relations", "hf:csv", "--hf-kwargs", json.dumps(kwargs), "--analyses", "",
                 "--device", "cpu", "--out", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "report.json").read_text())
    assert first["settings"]["run"]["hf_kwargs"] == {**kwargs, "data_files": str(work / "born.csv")}
    assert first["dataset"]["relations"] == ["born"] and first["relations"]["born"]["n_facts"] == 2
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["rerun", str(tmp_path / "first"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["settings"] == first["settings"] and again["dataset"] == first["dataset"]


# ------------------------------------------------------------------------------------------------ LRE names
def test_lre_relations_are_named_in_snake_case_and_taken_in_every_spelling():
    (degree,) = load_relations("lre:univ_degree_gender")
    assert degree.name == "univ_degree_gender" and degree.properties["lre_name"] == "univ degree gender"
    for spelling in ('lre:"univ degree gender"', "lre:univ degree gender", "lre:degree_gender",
                     "lre:Univ Degree Gender"):
        assert load_relations(spelling)[0].to_dict() == degree.to_dict(), spelling
    assert load_relations("lre:company_ceo")[0].properties["lre_name"] == "company CEO"
    assert snake_name("substance phase of matter") == "substance_phase_of_matter"
    names = [r.name for r in load_relations("lre:all")]
    assert len(set(names)) == 47 and all(name == snake_name(name) for name in names)
    assert list_bundled(include_lre=True) == list_bundled() + sorted(f"lre:{name}" for name in names)
    assert len(list_bundled()) == 13 and not any(n.startswith("lre:") for n in list_bundled())


def test_an_unknown_name_suggests_bundled_and_lre_names(capsys):
    with pytest.raises(DatasetError, match=r"'univ_degre_gender' is not a bundled relation.*\(did you mean "
                                           r"lre:univ_degree_gender"):
        load_relations("univ_degre_gender")
    with pytest.raises(DatasetError, match=r"\(did you mean country_capital, lre:country_capital_city"):
        load_relations("contry_capital")
    with pytest.raises(DatasetError, match=r"'lre:adjective_comparitive' is not an LRE .*\(did you mean "
                                           r"lre:adjective_comparative"):
        load_relations("lre:adjective_comparitive")
    with pytest.raises(SystemExit):
        build_parser(synth=False).parse_args(["probe", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "lre:all" in help_text and "univ_degree_gender" in help_text and "--hf-kwargs JSON" in help_text


# ------------------------------------------------------------------------------------ sources and licences
def test_the_lre_copy_names_its_source_and_licence_and_pins_its_files():
    meta = lre_source()
    assert meta["url"] == "https://github.com/evandez/relations" and meta["licence"] == "MIT"
    licence = (resources.files("prompts") / "lre" / meta["licence_file"]).read_text(encoding="utf-8")
    assert "MIT License" in licence and meta["copyright"] in licence
    assert meta["commit"] or (meta["copied"] and "not recorded" in meta["commit_note"])
    assert meta["sha256"] == lre_files_sha256() and meta["relations"] == 47
    (capital,) = load_relations("lre:country_capital_city")
    assert capital.properties["licence"] == "MIT, Copyright (c) 2022 Evan Hernandez (prompts/lre/LICENSE)"
    assert capital.properties["source"].startswith("https://github.com/evandez/relations, "
                                                   "data/factual/country_capital_city.json (")


def test_every_bundled_relation_states_its_source_and_licence():
    schema = (resources.files("prompts") / "SCHEMA.md").read_text(encoding="utf-8")
    for relation in load_relations(None):
        assert relation.properties["source"] and relation.properties["licence"], relation.name
        row = next(line for line in schema.splitlines() if line.startswith(f"| `{relation.name}` |"))
        assert f"| {relation.properties['licence']} |" in row, relation.name


def test_short_reprs():
    (capital,) = load_relations("country_capital")
    assert repr(capital) == "Relation('country_capital', 193 facts, 4 templates, one-to-one)"
    table = FactTable.from_relations(load_relations(["country_capital", "country_continent"]))
    assert repr(table) == "FactTable(193 subjects x 2 relations, 386 facts, attributes per relation [193, 6])"
