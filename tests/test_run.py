"""The main job: the known-fact table of the matched controls (the controls themselves: test_matched.py), the
end-to-end run on a tiny model, compare and report commands."""
import json

import pytest
from tiny_models import save_tiny

from llmprobe.cli import main
from llmprobe.jobs.main import known_table
from llmprobe.model.known import FactResult


def test_known_table_keeps_only_known_facts():
    known = {"capital": [FactResult("France", "Paris", "p", " Paris", True),
                         FactResult("Japan", "Tokyo", "p", " Kyoto", False)],
             "continent": [FactResult("Japan", "Asia", "p", " Asia", True)]}
    table, dropped = known_table({}, known, min_facts=1)
    assert table.subjects == ["France", "Japan"] and table.relations == ["capital", "continent"]
    assert table.table.tolist() == [[0, -1], [-1, 0]] and dropped == []
    table, dropped = known_table({}, {**known, "demonym": [FactResult("Japan", "Japanese", "p", " Jap", False)]},
                                 min_facts=1)
    assert table.relations == ["capital", "continent"] and dropped == ["demonym (0 known)"]
    with pytest.raises(ValueError, match="no relation has 2 or more known facts"):
        known_table({}, known, min_facts=2)


def test_run_end_to_end_on_tiny_model_and_compare(tmp_path):
    folder = str(save_tiny("qwen2", tmp_path / "qwen2"))
    relation = tmp_path / "capital.json"
    relation.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                    "neutral_templates": ["{}"],
                                    "facts": [{"subject": "France", "object": "Paris"},
                                              {"subject": "Japan", "object": "Tokyo"}]}))
    out = tmp_path / "run"
    assert main(["run", folder, "--relations", str(relation), "--analyses", "", "--layers", "-1",
                 "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["relations"]["capital"]["n_facts"] == 2
    if report["relations"]["capital"]["n_known"] == 0:  # a random model knows nothing: said, not hidden
        assert any("matched controls" in e and "no relation has" in e for e in report["errors"])
    page = (out / "report.html").read_text()
    assert "capital" in page and (out / "metrics.csv").exists() and (out / "report.md").exists()
    assert main(["compare", str(out), str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "report.html").exists()
    assert main(["report", str(out), "--format", "json", "--out", str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / "metrics.json").read_text())
    assert main(["compare", str(tmp_path / "nothing-here"), "--out", str(tmp_path / "c2")]) == 2
