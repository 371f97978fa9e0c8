"""report.json against docs/report_schema.md: every key a real report has is documented, every documented key a
real report can have is there, and documented types hold.

The report is the one ``llmprobe run`` writes, on a tiny random-init Llama with forced-known facts (a random model
knows nothing) and fast analysis settings; the doc's tables (``| path | type | meaning |``) are parsed for paths.
"""
import dataclasses
import functools
import json
import random
import re
from pathlib import Path

import pytest
from test_analyses import FAST, _relations
from tiny_models import save_tiny

import llmprobe.analyses.run
import llmprobe.jobs.probe
from llmprobe.analyses.settings import AnalysisSettings
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import LIBRARIES
from llmprobe.report.schema import REPORT_SCHEMA_VERSION

DOC = Path(__file__).resolve().parents[1] / "docs" / "report_schema.md"
PLACEHOLDERS = ("<relation>", "<layer>", "<decoder>", "<null>", "<setting>", "<library>", "<property>", "<mode>", "<steps>")
METRIC = "<metric>"
TYPES = {"int", "float", "str", "bool", "null", "object", "list", "any", "metric"}
# documented paths the tiny report cannot produce (every other documented path must appear)
NOT_PRODUCED = {
    "analyses.superposition.layers.<layer>.swap.error",       # only when no swap edit can be built
    # protocol lre only (the tiny report runs the strict protocol; tests/test_lre_protocol.py checks these)
    "analyses.relations.<relation>.selection", "analyses.relations.<relation>.selection_note",
    "analyses.relations.<relation>.trials[]",
    # --chat-template only (tests/test_chat_template.py checks these against the doc)
    "dataset.chat_template.instruction", "dataset.chat_template.prefix", "dataset.chat_template.example",
    "relations.<relation>.assumed_known",      # only with run.assume_known (tests/test_api.py checks it)
    "matched.all_facts",       # only with matched.all_facts (tests/test_matched_controls.py checks it)
}


# ------------------------------------------------------------------------------------------------ the doc
@dataclasses.dataclass
class Schema:
    types: dict            # documented path -> set of allowed types
    nulls: set             # null names of the "Nulls" table
    nodes: set             # documented paths and every prefix of them (at "." and "[]")

    @classmethod
    def parse(cls, text: str) -> "Schema":
        types, nulls, header = {}, set(), None
        for line in text.splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = [c.lower() for c in cells]
                continue
            if set("".join(cells)) <= set("-: "):
                continue
            name = re.fullmatch(r"`([^`]+)`", cells[0])
            if header == ["path", "type", "meaning"]:
                assert name and len(cells) == 3, f"bad schema row: {line}"
                path = name.group(1)
                assert path not in types, f"{path} documented twice"
                types[path] = _parse_type(cells[1], path)
            elif header[0] == "null":
                assert name, f"bad null row: {line}"
                nulls.add(name.group(1))
        nodes = set()
        for path in types:
            for m in re.finditer(r"\.|\[\]", path):
                nodes.add(path[:m.start()])
            nodes.add(path)
        for path in types:
            bad = set(re.findall(r"<[^>]+>", path)) - set(PLACEHOLDERS) - {METRIC}
            assert not bad, f"{path}: unknown placeholder(s) {bad}"
        return cls(types, nulls, nodes)

    def is_leaf(self, path: str) -> bool:
        return path in self.types and not any(n.startswith((path + ".", path + "[]")) for n in self.nodes)


def _parse_type(text: str, path: str) -> set:
    """``float or null``, ``list[float or null]`` -> {"float", "null"}, {"list"} (only the outer type is checked)."""
    alternatives = re.split(r"\s+or\s+(?![^\[]*\])", text)              # " or " outside brackets
    out = {a.strip().split("[")[0] for a in alternatives}
    assert out <= TYPES, f"{path}: unknown type in {text!r}"
    return out


def _type_ok(value, allowed: set) -> bool:
    if "any" in allowed:
        return True
    kind = ("null" if value is None else "bool" if isinstance(value, bool) else "int" if isinstance(value, int)
            else "float" if isinstance(value, float) else "str" if isinstance(value, str)
            else "list" if isinstance(value, list) else "object")
    if kind == "object" and "metric" in allowed:
        return "value" in value and "ci" in value
    return kind in allowed or (kind == "int" and "float" in allowed)


# ------------------------------------------------------------------------------------------ the report walk
def check(report: dict, schema: Schema) -> dict:
    """Walk the report along the doc. Returns {"undocumented", "wrong_type", "seen"}: paths (placeholders put back
    where the doc has them; a key that fits no documented path is kept literally) that the doc lacks, paths whose
    value has another type than documented, and every documented path visited."""
    valid = {
        "<layer>": str.isdigit,
        "<decoder>": lambda k: k in ("lre", "ridge"),
        "<relation>": lambda k: k in report["dataset"]["relations"],
        "<null>": lambda k: k in schema.nulls,
        "<setting>": lambda k: k in AnalysisSettings.__dataclass_fields__,
        "<library>": lambda k: k in ("python",) + LIBRARIES,
        "<property>": lambda k: True,
        "<mode>": lambda k: k in ("trainable", "frozen"),
        "<steps>": str.isdigit,
    }
    undocumented, wrong_type, seen = set(), set(), set()

    def child(parent: str, key: str) -> str:
        literal = f"{parent}.{key}" if parent else key
        if literal in schema.nodes:
            return literal
        for ph in PLACEHOLDERS:
            if f"{parent}.{ph}" in schema.nodes and valid[ph](key):
                return f"{parent}.{ph}"
        return literal

    def walk(value, path: str, metric_at: str = "") -> None:
        where = f" (in {metric_at})" if metric_at else ""
        if path in schema.types:
            seen.add(path)
            if not _type_ok(value, schema.types[path]):
                wrong_type.add(f"{path}{where}: {json.dumps(value)[:80]} is not "
                               f"{' or '.join(sorted(schema.types[path]))}")
                return
            if "metric" in schema.types[path] and isinstance(value, dict):
                for key, v in value.items():
                    walk(v, child(METRIC, key), path)
                return
            if schema.is_leaf(path) or value is None:
                return
        elif path not in schema.nodes:
            undocumented.add(path + where)
            return
        # below here the doc describes keys under this path
        if isinstance(value, dict):
            for key, v in value.items():
                walk(v, child(path, key), metric_at)
        elif isinstance(value, list) and path + "[]" in schema.nodes:
            for item in value:
                walk(item, path + "[]", metric_at)
        else:
            wrong_type.add(f"{path}{where}: {json.dumps(value)[:80]} where the doc describes keys below")

    for key, v in report.items():
        walk(v, child("", key))
    return {"undocumented": undocumented, "wrong_type": wrong_type, "seen": seen}


# -------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def schema():
    return Schema.parse(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """``llmprobe run`` on a tiny Llama: three relations over 28 made-up countries, every fact forced known except
    all but 3 of ``language`` (so it fails the decoders and is left out of the controls, with errors)."""
    tmp = tmp_path_factory.mktemp("schema")
    folder = str(save_tiny("llama", tmp / "llama"))
    rnd = random.Random(1)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi"]
    subjects = sorted({"".join(rnd.choice(syllables) for _ in range(3)).capitalize() for _ in range(60)})[:28]
    paths = []
    for rel in _relations(subjects)[0]:
        path = tmp / f"{rel.name}.json"
        path.write_text(json.dumps({"name": rel.name, "templates": rel.templates,
                                    "neutral_templates": rel.neutral_templates, "properties": rel.properties,
                                    "facts": [{"subject": f.subject, "object": f.object} for f in rel.facts]}))
        paths.append(str(path))
    real_known = llmprobe.model.known.known_facts

    def forced_known(lm, relation, **kw):
        results = real_known(lm, relation, **kw)
        keep = 3 if relation.name == "language" else len(results)
        return [dataclasses.replace(r, known=i < keep) for i, r in enumerate(results)]

    fast = functools.partial(llmprobe.analyses.run.run_analyses, progress=False, **FAST)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmprobe.model.known, "known_facts", forced_known)
        mp.setattr(llmprobe.analyses.run, "run_analyses", fast)
        run(folder, out=tmp / "run", relations=paths, layers="all", device="cpu", at_model_width=False,
            formats=())
    return json.loads((tmp / "run" / "report.json").read_text(encoding="utf-8"))   # as written (NaN -> null)


# ----------------------------------------------------------------------------------------------------- tests
def test_report_has_the_current_schema_version_and_the_doc_states_it(report):
    assert report["schema_version"] == REPORT_SCHEMA_VERSION
    assert f"Current version: **{REPORT_SCHEMA_VERSION}**" in DOC.read_text(encoding="utf-8")


def test_the_tiny_report_exercises_what_it_should(report):
    """Guards the fixture: a report without decoders, swap edits, errors or controls would check little. The
    controls train on the superposition fit's table (like for like), language included although the model
    knows only 3 of its facts."""
    assert {"load_s", "known_facts_s", "analyses_s", "matched_s"} <= set(report["timings"])
    rels = report["analyses"]["relations"]
    assert rels["capital"]["error"] is None and "lre" in rels["capital"]["layers"]["0"]
    assert "3 known facts" in rels["language"]["error"]
    assert "swap" in report["analyses"]["superposition"]["layers"]["0"]
    assert any("language" in e for e in report["analyses"]["errors"])
    assert list(report["matched"]["modes"]) == ["trainable", "frozen"]
    sup = report["analyses"]["superposition"]
    assert report["matched"]["table"]["facts"] == "known"       # the fit's table, on the facts the model knows
    assert report["matched"]["table"]["relations"] == [r for r in sup["relations"] if r != "language"]
    assert report["matched"]["table"]["n_subjects"] == sup["subjects"]
    assert report["matched"]["table"]["n_facts"] < sup["n_facts"]


def test_every_key_of_the_report_is_documented(report, schema):
    result = check(report, schema)
    assert not result["undocumented"], ("keys of report.json that docs/report_schema.md does not describe:\n  "
                                        + "\n  ".join(sorted(result["undocumented"])))


def test_documented_types_hold(report, schema):
    result = check(report, schema)
    assert not result["wrong_type"], "values whose type the doc gets wrong:\n  " + "\n  ".join(
        sorted(result["wrong_type"]))


def test_every_documented_key_is_in_the_report(report, schema):
    seen = check(report, schema)["seen"]
    assert NOT_PRODUCED <= set(schema.types), "NOT_PRODUCED names paths the doc no longer has"
    assert not NOT_PRODUCED & seen, "NOT_PRODUCED names paths the report has: take them off the list"
    missing = set(schema.types) - seen - NOT_PRODUCED
    assert not missing, ("paths docs/report_schema.md describes that report.json lacks (renamed or removed?):\n  "
                         + "\n  ".join(sorted(missing)))


@pytest.mark.parametrize("where", ["top", "model", "metric", "metric_control", "setting", "control_report",
                                   "selector", "relation_layer"])
def test_the_check_catches_a_stray_key(report, schema, where):
    """The check is not vacuous: one stray key anywhere is reported."""
    r = json.loads(json.dumps(report))
    rel = r["analyses"]["relations"]["capital"]
    target = {"top": r, "model": r["model"], "metric": rel["layers"]["0"]["lre"]["faithfulness"],
              "metric_control": rel["layers"]["0"]["ridge"]["faithfulness"]["nulls"]["shuffled"],
              "setting": r["analyses"]["settings"], "control_report": r["matched"]["modes"]["frozen"]["points"][0],
              "selector": r["matched"]["modes"]["trainable"]["points"][0]["selector"],
              "relation_layer": rel["layers"]["1"]}[where]
    target["stray_key"] = 1
    undocumented = check(r, schema)["undocumented"]
    assert len(undocumented) == 1 and "stray_key" in next(iter(undocumented)), undocumented


def _as_version_2(node, top: bool = True):
    """``node`` in version 2's words: a metric's nulls/primary_null as controls/control, the matched block, its
    stage, settings section and timings as controls (the inverse of ``upgrade``, written apart from it)."""
    if isinstance(node, list):
        return [_as_version_2(v, False) for v in node]
    if not isinstance(node, dict):
        return node
    metric = all(k in node for k in ("value", "ci", "n", "interval"))
    words = {"nulls": "controls", "primary_null": "control"} if metric else {}
    out = {words.get(k, k): _as_version_2(v, False) for k, v in node.items()}
    if top:
        out = {("controls" if k == "matched" else k): v for k, v in out.items()}
        for key in ("stages", "settings"):
            out[key] = {("controls" if k == "matched" else k): v for k, v in out[key].items()}
        out["timings"] = {k.replace("matched_", "controls_"): v for k, v in out["timings"].items()}
        out["schema_version"] = 2
    return out


def test_a_version_2_report_is_read_in_todays_words(report, tmp_path):
    """A report written by the version before (both meanings called controls) reads as the same report in version
    3's words, every number unchanged; the rerun's number list is the same too."""
    from llmprobe.jobs.rerun import numbers
    from llmprobe.report.schema import read_report, upgrade

    old = _as_version_2(report)
    assert "controls" in old and "controls" in old["stages"] and "controls_s" in old["timings"]
    assert '"nulls"' not in json.dumps(old) and '"matched"' not in json.dumps(old)
    (tmp_path / "report.json").write_text(json.dumps(old))
    read = read_report(tmp_path)
    read.pop("_path")
    assert read == report and upgrade(report) is report
    assert numbers(upgrade(old)) == numbers(report)
