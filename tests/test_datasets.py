"""Relation datasets: bundled data, country facts against the data packages, loaders, validation, FactTable."""
import csv
import json
import os
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from llmprobe.datasets import (
    DatasetError,
    Fact,
    FactTable,
    Relation,
    format_relation,
    list_bundled,
    load_relations,
    save_relation,
)

COUNTRY = ["country_capital", "country_continent", "country_subregion", "country_language", "country_currency",
           "country_demonym"]


@pytest.fixture(scope="module")
def bundled():
    return {r.name: r for r in load_relations()}


def facts(rel):
    return {f.subject: f.object for f in rel.facts}


# ------------------------------------------------------------------------------------------- bundled data

def test_bundled_relations_are_many_and_well_formed(bundled):
    assert len(bundled) >= 12
    assert sorted(bundled) == list_bundled()
    for name, rel in bundled.items():
        assert rel.name == name and Path(rel.source).name == f"{name}.json"
        assert rel.templates and all(t.count("{}") == 1 for t in rel.templates)
        assert rel.neutral_templates and all(t.count("{}") == 1 for t in rel.neutral_templates)
        assert len(rel.facts) >= 30
        assert all(f.subject and f.object and f.subject == f.subject.strip() for f in rel.facts)
        assert len({f.subject for f in rel.facts}) == len(rel.facts), name  # one object per subject
        for key in ("cardinality", "subject_type", "object_type", "source"):
            assert rel.properties.get(key), (name, key)
        # committed files are in the canonical layout save_relation writes (one fact per line)
        assert Path(rel.source).read_text(encoding="utf-8") == format_relation(rel)


def test_bundled_files_found_through_importlib_resources():
    root = resources.files("prompts")
    names = sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))
    assert names == list_bundled()
    assert (root / "SCHEMA.md").is_file()


def test_relation_families(bundled):
    curated = [n for n in bundled if not n.startswith("country_")]
    assert {n.split("_")[0] for n in curated} >= {"person", "company", "landmark"}
    assert len(curated) >= 6
    for n in curated:
        assert 30 <= len(bundled[n].facts) <= 80, n
        assert "curated" in bundled[n].properties["source"]
    for n in COUNTRY:
        assert "pycountry" in bundled[n].properties["source"] and "countryinfo" in bundled[n].properties["source"]


def test_countries_share_many_relations(bundled):
    ft = FactTable.from_relations([bundled[n] for n in COUNTRY], min_relations=4)
    assert len(ft.subjects) >= 150
    assert (ft.table >= 0).sum(dim=1).min() >= 4
    # the same holds with every bundled relation in the table
    ft_all = FactTable.from_relations(list(bundled.values()), min_relations=4)
    assert len(ft_all.subjects) >= 150
    assert ft_all.table.shape == (len(ft_all.subjects), len(bundled))


def test_country_names_are_plain_and_consistent(bundled):
    subjects = [f.subject for f in bundled["country_capital"].facts]
    assert len(subjects) == len(set(subjects)) == 193
    for n in COUNTRY:
        assert [f.subject for f in bundled[n].facts] == subjects, n  # same subjects, same order
    assert not [s for s in subjects if "," in s or "(" in s or s.startswith("The ")]
    for s in ["United States", "South Korea", "North Korea", "Russia", "Iran", "Vietnam", "Syria", "Laos",
              "Bolivia", "Tanzania", "Czech Republic", "Democratic Republic of the Congo"]:
        assert s in subjects, s
    for territory in ["Puerto Rico", "Hong Kong", "Greenland", "Taiwan", "Macau", "Guam"]:
        assert territory not in subjects


def test_country_facts_fixed_spot_checks(bundled):
    cap, cont, lang, cur = (facts(bundled[n]) for n in
                            ("country_capital", "country_continent", "country_language", "country_currency"))
    dem, sub = facts(bundled["country_demonym"]), facts(bundled["country_subregion"])
    assert cap["France"] == "Paris" and cap["Japan"] == "Tokyo" and cap["Germany"] == "Berlin"
    assert cap["India"] == "New Delhi" and cap["Australia"] == "Canberra" and cap["Canada"] == "Ottawa"
    assert cap["Kazakhstan"] == "Astana" and cap["United States"] == "Washington, D.C."
    assert cont["Brazil"] == "South America" and cont["Mexico"] == "North America" and cont["Egypt"] == "Africa"
    assert cont["France"] == "Europe" and cont["Japan"] == "Asia" and cont["New Zealand"] == "Oceania"
    assert set(cont.values()) == {"Africa", "Asia", "Europe", "North America", "South America", "Oceania"}
    assert "Yen" in cur["Japan"] and cur["France"] == "Euro" and "Dollar" in cur["United States"]
    assert "Rupee" in cur["India"] and cur["Croatia"] == "Euro"
    assert lang["France"] == "French" and lang["Brazil"] == "Portuguese" and lang["Japan"] == "Japanese"
    assert lang["Pakistan"] == "Urdu" and lang["Greece"] == "Greek"
    assert "French" in bundled["country_language"].properties["other_objects"]["Canada"]
    assert dem["France"] == "French" and dem["Japan"] == "Japanese" and sub["Brazil"] == "South America"
    assert bundled["country_capital"].properties["cardinality"] == "one-to-one"
    assert bundled["country_continent"].properties["cardinality"] == "many-to-one"


def test_countries_ordered_by_population(bundled):
    for n in COUNTRY:
        rel = bundled[n]
        subjects = [f.subject for f in rel.facts]
        assert subjects[:2] == ["China", "India"], n
        pop = rel.properties["population"]
        values = [pop[s] for s in subjects]
        assert values == sorted(values, reverse=True), n
        assert "population" in rel.properties["order"]
    top = {f.subject for f in bundled["country_capital"].facts[:20]}
    assert {"United States", "Indonesia", "Brazil", "Japan", "Germany"} <= top
    assert "Monaco" not in top


def test_country_facts_agree_with_data_packages(bundled):
    pycountry = pytest.importorskip("pycountry")
    countryinfo = pytest.importorskip("countryinfo")
    ci = countryinfo.CountryInfo
    cap, cont, cur, lang = (facts(bundled[n]) for n in
                            ("country_capital", "country_continent", "country_currency", "country_language"))
    # independent look-ups in the packages
    assert ci("FR").capital() == cap["France"] == "Paris"
    assert ci("JP").capital() == cap["Japan"]
    assert ci("BR").info()["intermediateregion"] == cont["Brazil"] == "South America"
    assert pycountry.currencies.get(alpha_3=ci("JP").currencies()[0]).name == cur["Japan"]
    assert pycountry.languages.get(alpha_2=ci("DE").languages()[0]).name == lang["Germany"]
    assert ci("CN").population() > ci("IN").population() > ci("US").population()
    # every capital agrees with countryinfo except the documented corrections
    from prompts import build_countries as build
    by_code = {c.alpha_2: getattr(c, "common_name", None) for c in pycountry.countries}
    checked = 0
    for code in ["DE", "IT", "ES", "EG", "NG", "KE", "AR", "PE", "TH", "VN", "PL", "SE", "AU", "CA", "MX"]:
        name = by_code[code] or ci(code).name()
        assert cap[name] == ci(code).capital(), code
        checked += 1
    assert checked == 15
    assert set(build.CAPITAL_FIX) <= {"KZ", "SZ", "US"}


def test_country_files_rebuild_from_data_packages(bundled):
    """The committed country files are what build_countries.py makes from the installed packages (exactly, when
    the package versions are the ones recorded in the files; else at least 95% of the facts, allowing for drift)."""
    pytest.importorskip("pycountry")
    pytest.importorskip("countryinfo")
    from prompts import build_countries as build
    rels = build.build(build.collect())
    root = resources.files("prompts")
    for name, obj in rels.items():
        if obj["properties"]["source"] == bundled[name].properties["source"]:
            assert (root / f"{name}.json").read_text(encoding="utf-8") == build.dump(obj), name
        else:
            fresh = {(f["subject"], f["object"]) for f in obj["facts"]}
            same = sum((f.subject, f.object) in fresh for f in bundled[name].facts)
            assert same >= 0.95 * len(bundled[name].facts), name


def test_curated_objects_link_to_other_relations(bundled):
    countries = {f.subject for f in bundled["country_capital"].facts} | {"Taiwan"}
    for n in ("person_citizenship", "company_hq_country", "landmark_country"):
        assert {f.object for f in bundled[n].facts} <= countries, n
    companies = {f.subject for f in bundled["company_hq_country"].facts}
    assert {f.object for f in bundled["product_company"].facts} <= companies
    occ = facts(bundled["person_occupation"])
    assert occ["Albert Einstein"] == "physicist" and occ["Wolfgang Amadeus Mozart"] == "composer"
    assert not [o for o in occ.values() if o[0] in "aeiou"]  # templates end in "a", never "an"
    assert facts(bundled["landmark_city"])["Eiffel Tower"] == "Paris"
    assert facts(bundled["company_hq_country"])["Toyota"] == "Japan"
    assert facts(bundled["product_company"])["iPhone"] == "Apple"


# ---------------------------------------------------------------------------------------------- loaders

def _rel(name="toy", facts_=(("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima")), **props):
    return Relation(name, ["The capital of {} is", "{}'s capital is"], ["{}", "Tell me about {}."],
                    [Fact(s, o) for s, o in facts_], {"cardinality": "one-to-one", **props})


def test_save_and_load_our_schema(tmp_path):
    rel = _rel(subject_type="country")
    path = save_relation(rel, tmp_path / "sub" / "toy.json")
    assert os.listdir(path.parent) == ["toy.json"]  # no temp file left behind
    (back,) = load_relations([str(path)])
    assert (back.name, back.templates, back.neutral_templates, back.facts) == \
        (rel.name, rel.templates, rel.neutral_templates, rel.facts)
    assert back.properties == rel.properties and back.source == str(path)
    # overwrite in place
    save_relation(_rel(facts_=(("Chile", "Santiago"),)), path)
    assert load_relations(str(path))[0].facts == [Fact("Chile", "Santiago")]


def test_save_refuses_invalid_relation_and_keeps_old_file(tmp_path):
    path = save_relation(_rel(), tmp_path / "toy.json")
    before = path.read_text()
    with pytest.raises(DatasetError, match="templates"):
        save_relation(Relation("toy", ["no slot"], ["{}"], [Fact("a", "b")], {}), path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["toy.json"]


def test_lre_format(tmp_path):
    lre = {"name": "country capital city",
           "prompt_templates": ["The capital city of {} is", "{}'s capital is"],
           "prompt_templates_zs": ["The capital of {} is", "{}'s capital is"],
           "properties": {"relation_type": "factual", "domain_name": "country", "range_name": "city",
                          "symmetric": False, "fn_type": "ONE_TO_ONE", "disambiguating": False},
           "samples": [{"subject": "France", "object": "Paris"}, {"subject": "Japan", "object": "Tokyo"}]}
    p = tmp_path / "country_capital_city.json"
    p.write_text(json.dumps(lre))
    (rel,) = load_relations([str(p)])
    assert rel.name == "country_capital_city" and rel.properties["lre_name"] == "country capital city"
    assert rel.templates == ["The capital city of {} is", "{}'s capital is", "The capital of {} is"]
    assert rel.neutral_templates == ["{}"]
    assert rel.facts == [Fact("France", "Paris"), Fact("Japan", "Tokyo")]
    assert rel.properties["cardinality"] == "one-to-one" and rel.properties["format"] == "lre"
    assert rel.properties["subject_type"] == "country" and rel.properties["object_type"] == "city"
    lre["samples"].append({"subject": "France", "object": "Lyon"})
    p.write_text(json.dumps(lre))
    with pytest.raises(DatasetError, match=r"country_capital_city\.json: field 'samples\[2\]\.object'"):
        load_relations([str(p)])


def test_csv_with_template_column_and_with_templates_argument(tmp_path):
    p = tmp_path / "capitals.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["subject", "object", "template"])
        w.writerow(["France", "Paris", "The capital of {} is"])
        w.writerow(["Japan", "Tokyo", "{}'s capital city is"])
        w.writerow(["Peru", "Lima", "The capital of {} is"])
    (rel,) = load_relations([str(p)])
    assert rel.name == "capitals" and rel.source == str(p)
    assert rel.templates == ["The capital of {} is", "{}'s capital city is"]
    assert rel.facts == [Fact("France", "Paris"), Fact("Japan", "Tokyo"), Fact("Peru", "Lima")]
    assert rel.properties["cardinality"] == "one-to-one"
    (rel2,) = load_relations([str(p)], templates=["{} has the capital"], neutral_templates=["{}", "About {}:"])
    assert rel2.templates == ["{} has the capital"] and rel2.neutral_templates == ["{}", "About {}:"]
    # other column names, no template column, several relations in one file
    q = tmp_path / "mixed.csv"
    q.write_text("rel,s,o\ncapital,France,Paris\ncontinent,France,Europe\ncapital,Chile,Santiago\n")
    rels = load_relations([str(q)], subject_column="s", object_column="o", relation_column="rel",
                          templates=["{}:"])
    assert [(r.name, len(r.facts)) for r in rels] == [("capital", 2), ("continent", 1)]
    # round trip: CSV -> our schema -> load
    out = save_relation(rel, tmp_path / "capitals.json")
    assert load_relations([str(out)])[0].facts == rel.facts


def test_jsonl_and_directory(tmp_path):
    d = tmp_path / "rels"
    d.mkdir()
    (d / "a.jsonl").write_text('{"subject": "France", "object": "Paris", "template": "The capital of {} is"}\n\n'
                               '{"subject": "Japan", "object": "Tokyo", "template": "The capital of {} is"}\n')
    save_relation(_rel(name="b", facts_=(("Chile", "Santiago"),)), d / "b.json")
    (d / "notes.txt").write_text("ignored")
    rels = load_relations([str(d)])
    assert [r.name for r in rels] == ["a", "b"]
    assert rels[0].facts == [Fact("France", "Paris"), Fact("Japan", "Tokyo")]


def test_hf_datasets_loader(tmp_path):
    pytest.importorskip("datasets")
    p = tmp_path / "facts.jsonl"
    rows = [{"subj": "France", "answer": {"text": "Paris"}, "prompt": "The capital of {} is"},
            {"subj": "Japan", "answer": {"text": "Tokyo"}, "prompt": "The capital of {} is"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(subject_column="subj", object_column="answer.text", template_column="prompt",
              hf_kwargs={"data_files": str(p), "cache_dir": str(tmp_path / "cache")})
    (rel,) = load_relations(["hf:json:train"], **kw)
    assert rel.name == "facts" and rel.source == "hf:json:train"
    assert rel.facts == [Fact("France", "Paris"), Fact("Japan", "Tokyo")]
    assert rel.templates == ["The capital of {} is"]
    with pytest.raises(DatasetError, match=r"hf:json: field 'subject' is not a column"):
        load_relations(["hf:json"], hf_kwargs=kw["hf_kwargs"], templates=["{}"])


def test_bundled_lre_dataset_by_category_name_and_all():
    """The LRE dataset ships in the package (prompts/lre/, with its licence) and loads by category, by file name
    or whole; the default relation set stays the 13 bundled relations."""
    counts = {category: len(load_relations(f"lre:{category}")) for category in ("factual", "linguistic",
                                                                                  "commonsense", "bias")}
    assert counts == {"factual": 26, "linguistic": 6, "commonsense": 8, "bias": 7}
    linguistic = load_relations("lre:linguistic")
    assert [r.name for r in linguistic] == ["adjective_antonym", "adjective_comparative", "adjective_superlative",
                                            "verb_past_tense", "word_first_letter", "word_last_letter"]
    assert all(r.properties["relation_type"] == "linguistic" and r.properties["format"] == "lre" for r in linguistic)
    everything = load_relations("lre:all")
    assert len(everything) == 47 and len({r.name for r in everything}) == 47
    (capital,) = load_relations("lre:country_capital_city")
    assert Fact("Brazil", "Brasília") in capital.facts                 # the file's "Bras\\u00edlia", read
    assert not any("\\u" in f.subject + f.object for r in everything for f in r.facts)
    assert len(load_relations(None)) == len(list_bundled()) == 13
    root = resources.files("prompts") / "lre"
    assert "MIT License" in (root / "LICENSE").read_text(encoding="utf-8")
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    assert '"lre/*/*.json"' in pyproject and '"lre/LICENSE"' in pyproject
    with pytest.raises(DatasetError, match="lre:linguistic.*adjective_comparative"):
        load_relations("lre:adjective")


def test_bundled_by_name_and_subset():
    rels = load_relations(["country_capital", "landmark_city"])
    assert [r.name for r in rels] == ["country_capital", "landmark_city"]
    assert load_relations("country_capital")[0].facts[0] == Fact("China", "Beijing")


# ------------------------------------------------------------------------------------------- validation

def _write(tmp_path, obj, name="bad.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


GOOD = {"name": "r", "templates": ["{} is"], "facts": [{"subject": "a", "object": "b"}]}


@pytest.mark.parametrize("change, field", [
    ({"name": ""}, "name"),
    ({"templates": []}, "templates"),
    ({"templates": ["no slot here"]}, r"templates\[0\]"),
    ({"templates": ["{} and {}"]}, r"templates\[0\]"),
    ({"neutral_templates": ["{}", "none"]}, r"neutral_templates\[1\]"),
    ({"facts": []}, "facts"),
    ({"facts": [{"subject": "a", "object": "b"}] * 3 + [{"subject": "c", "object": ""}]}, r"facts\[3\]\.object"),
    ({"facts": [{"subject": "a", "object": "b"}, {"object": "c"}]}, r"facts\[1\]\.subject"),
    ({"facts": [{"subject": "a", "object": "b"}, "a,b"]}, r"facts\[1\]"),
    ({"properties": {"cardinality": "one-to-one"},
      "facts": [{"subject": "a", "object": "b"}, {"subject": "a", "object": "c"}]}, r"facts\[1\]\.object"),
    ({"properties": {"cardinality": "some"}}, r"properties\.cardinality"),
    ({"properties": []}, "properties"),
])
def test_malformed_json_names_file_and_field(tmp_path, change, field):
    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(DatasetError, match=rf"^{path}: field '{field}'"):
        load_relations([path])


def test_one_to_one_duplicate_message_and_allowed_cases(tmp_path):
    bad = {**GOOD, "properties": {"cardinality": "one-to-one"},
           "facts": [{"subject": "France", "object": "Paris"}, {"subject": "France", "object": "Lyon"}]}
    with pytest.raises(DatasetError, match="'France'.*'Lyon'.*one-to-one"):
        load_relations([_write(tmp_path, bad)])
    # exact duplicates are dropped; undeclared cardinality is inferred
    ok = {**GOOD, "facts": [{"subject": "a", "object": "x"}, {"subject": "a", "object": "x"},
                            {"subject": "a", "object": "y"}]}
    (rel,) = load_relations([_write(tmp_path, ok, "ok.json")])
    assert len(rel.facts) == 2 and rel.properties["cardinality"] == "one-to-many"


def test_unknown_relation_name_lists_the_bundled_ones():
    with pytest.raises(DatasetError, match="no_such_relation.*country_capital"):
        load_relations(["no_such_relation"])


@pytest.mark.parametrize("name, content, templates, message", [
    ("broken.json", '{"name": "r", ', None, "{p}: not valid JSON"),
    ("list.json", "[1, 2]", None, r"list\.json\[0\]: expected a JSON object"),
    ("cols.csv", "subject,answer\nFrance,Paris\n", ["{}"], "{p}: field 'object' is not a column"),
    ("notpl.csv", "subject,object\nFrance,Paris\n", None, "{p}: field 'template' is missing"),
    ("empty.csv", "subject,object,template\nFrance,,The capital of {} is\n", None, r"{p}: field 'rows\[0\]\.object'"),
    ("facts.txt", "x", None, "unknown file type"),
])
def test_load_errors_name_the_file_and_field(tmp_path, name, content, templates, message):
    path = _write(tmp_path, content, name)
    pattern = message.replace("{p}", "^" + re.escape(str(path)))
    with pytest.raises(DatasetError, match=pattern):
        load_relations([path], templates=templates) if templates else load_relations([path])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .json"):
        load_relations([str(tmp_path / "empty")])
    with pytest.raises(DatasetError, match="repeats relation 'country_capital'"):
        load_relations(["country_capital", "country_capital"])
    assert issubclass(DatasetError, ValueError)


# -------------------------------------------------------------------------------------------- FactTable

def test_fact_table_shape_and_missing():
    cap = _rel("capital", (("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima")))
    cont = _rel("continent", (("Japan", "Asia"), ("France", "Europe"), ("Chile", "South America"),
                              ("Germany", "Europe")))
    lang = _rel("language", (("France", "French"), ("Chile", "Spanish"), ("Peru", "Spanish")))
    ft = FactTable.from_relations([cap, cont, lang])
    assert ft.subjects == ["France", "Japan", "Peru", "Chile", "Germany"]
    assert ft.relations == ["capital", "continent", "language"]
    assert ft.attributes == [["Paris", "Tokyo", "Lima"], ["Europe", "Asia", "South America"], ["French", "Spanish"]]
    assert ft.table.dtype == torch.long and ft.table.shape == (5, 3)
    assert ft.table.tolist() == [[0, 0, 0], [1, 1, -1], [2, -1, 1], [-1, 2, 1], [-1, 0, -1]]
    for i, s in enumerate(ft.subjects):  # decoding the table gives back the facts
        for r, rel in enumerate([cap, cont, lang]):
            k = int(ft.table[i, r])
            assert (ft.attributes[r][k] if k >= 0 else None) == facts(rel).get(s)
    ft2 = FactTable.from_relations([cap, cont, lang], min_relations=2)
    assert ft2.subjects == ["France", "Japan", "Peru", "Chile"] and ft2.table.shape == (4, 3)
    ft3 = FactTable.from_relations([cap, cont, lang], min_relations=3)
    assert ft3.subjects == ["France"] and ft3.attributes == [["Paris"], ["Europe"], ["French"]]
    with pytest.raises(DatasetError, match="duplicate relation names"):
        FactTable.from_relations([cap, cap])
