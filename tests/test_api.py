"""The Python API in a notebook or a script: quiet when asked (no progress bar outside a terminal, message lines
through the ``logging`` logger "llmprobe"), the same files as the command line, one-line reprs, ``capture`` on
text, the decoders' building blocks at the top level, ``assume_known`` for a model that knows nothing, and a
command line whose parser loads no torch."""
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

import llmprobe
from llmprobe import console
from llmprobe.checks import UsageError
from llmprobe.cli import main
from llmprobe.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
FACTS = [("France", "Paris"), ("Japan", "Tokyo"), ("Brazil", "Brasilia"), ("Egypt", "Cairo"), ("Italy", "Rome"),
         ("Spain", "Madrid"), ("Germany", "Berlin"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Kenya", "Nairobi")]
BAR = re.compile(r"\d+%\|")          # a tqdm bar's "100%|" (of ours, transformers' or the hub's)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-init Llama (it knows no fact) and a relation of 10 facts."""
    root = tmp_path_factory.mktemp("api")
    folder = str(save_tiny("llama", root / "llama"))
    relation = root / "capital.json"
    relation.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"],
                                    "neutral_templates": ["{}"],
                                    "facts": [{"subject": s, "object": o} for s, o in FACTS]}))
    return folder, str(relation)


def _probe(tiny, out, **options):
    folder, relation = tiny
    return llmprobe.probe(folder, relations=[relation], layers="-1", device="cpu", out=out, **options)


# ------------------------------------------------------------------------------------ progress and messages
def test_progress_false_draws_no_bar_and_verbose_false_writes_no_line(tiny, tmp_path, capfd, monkeypatch):
    capfd.readouterr()
    _probe(tiny, tmp_path / "bars", analyses="ridge", assume_known=True, progress=True)
    err = capfd.readouterr().err                 # asked for: every bar, ours and transformers' (weights)
    assert "known facts: 100%|" in err and "analyses: 100%|" in err and "Loading weights: 100%|" in err
    assert "llmprobe: loading" in err and "[analyses " in err

    monkeypatch.setattr(console, "stderr_is_terminal", lambda: True)   # the default would draw them here
    _probe(tiny, tmp_path / "quiet", analyses="ridge", assume_known=True, progress=False)
    err = capfd.readouterr().err
    assert not BAR.search(err), err[-2000:]
    assert "llmprobe: loading" in err and "[analyses " in err           # the lines stay (verbose)

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("llmprobe").addHandler(handler)
    try:
        _probe(tiny, tmp_path / "silent", analyses="ridge", assume_known=True, progress=False, verbose=False)
    finally:
        logging.getLogger("llmprobe").removeHandler(handler)
    assert capfd.readouterr().err == ""
    assert any(line.startswith("llmprobe: loading") for line in seen)    # the lines went to the logger
    assert any(line.startswith("[analyses ") and "capital" in line for line in seen)
    assert console.bars_shown() and console._SWITCH == {"progress": None, "verbose": True}   # switch restored


def test_outside_a_terminal_no_bar_is_drawn_by_default(tiny, tmp_path, capfd, monkeypatch):
    capfd.readouterr()
    monkeypatch.setattr(console, "stderr_is_terminal", lambda: False)
    _probe(tiny, tmp_path / "log", analyses="", formats=())
    err = capfd.readouterr().err
    assert not BAR.search(err) and "llmprobe: loading" in err
    with pytest.raises(UsageError, match="progress must be True, False or None"):
        _probe(tiny, tmp_path / "bad", progress="no")


def test_run_takes_progress_verbose_and_formats(tiny, tmp_path, capfd):
    folder, relation = tiny
    capfd.readouterr()
    report = llmprobe.run(folder, relations=[relation], layers="-1", device="cpu", analyses=[], matched=False,
                          out=tmp_path / "run", formats=("md",), progress=False, verbose=False)
    assert capfd.readouterr().err == ""
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_file()) == [
        "known_facts.json", "manifest.json", "report.json", "report.md"]
    assert report["relations"]["capital"]["n_facts"] == len(FACTS)


# ------------------------------------------------------------------------------------------------ formats
def _without_wall_seconds(text: str, folder: Path) -> str:
    """``text`` with the report's wall seconds (the Sources table's last cell: the one number two runs differ
    in) blanked."""
    wall = f"{json.loads((folder / 'report.json').read_text())['wall_seconds']:.1f}"
    return re.sub(rf"(<td>|\| ){re.escape(wall)}(</td></tr>|( \|)$)", r"\1WALL\2", text, flags=re.MULTILINE)


def test_probe_writes_the_files_the_command_line_writes(tiny, tmp_path):
    folder, relation = tiny
    common = ["--relations", relation, "--layers", "-1", "--device", "cpu", "--analyses", "ridge",
              "--set", "run.assume_known=true"]
    assert main(["probe", folder, *common, "--out", str(tmp_path / "cli")]) == 0
    assert main(["report", str(tmp_path / "cli"), "--format", "json"]) == 0          # metrics.json: --format json
    _probe(tiny, tmp_path / "api", analyses="ridge", assume_known=True, formats=("json", "html", "md", "csv"),
           progress=False, verbose=False)
    for name in ("report.html", "report.md", "metrics.csv", "metrics.json"):
        cli, api = (tmp_path / "cli" / name).read_text(), (tmp_path / "api" / name).read_text()
        assert _without_wall_seconds(api, tmp_path / "api") == _without_wall_seconds(cli, tmp_path / "cli"), name
    assert "ridge" in (tmp_path / "api" / "metrics.csv").read_text()
    manifest = json.loads((tmp_path / "api" / "manifest.json").read_text())["files"]
    assert {"report.html", "report.md", "metrics.csv", "metrics.json"} <= set(manifest)

    _probe(tiny, tmp_path / "json", analyses="", formats=(), progress=False, verbose=False)   # report.json alone
    assert sorted(p.name for p in (tmp_path / "json").iterdir() if p.is_file()) == [
        "known_facts.json", "manifest.json", "report.json"]
    with pytest.raises(UsageError, match=r"unknown report format\(s\) \['pdf'\]"):
        _probe(tiny, tmp_path / "pdf", formats=("md", "pdf"))
    assert not (tmp_path / "pdf").exists()                         # refused before anything was written


# -------------------------------------------------------------------------------------------- reprs, capture
def test_a_loaded_model_prints_on_one_line(tiny):
    lm = load_model(tiny[0], device="cpu")
    text = repr(lm)
    assert "\n" not in text and len(text) < 200, text
    assert text == (f"LoadedModel(name={lm.info['name']!r}, family='llama', n_layers=3, d_model=32, device='cpu', "
                    f"dtype='float32')")


def test_capture_on_text_equals_capture_on_its_token_ids(tiny):
    lm = load_model(tiny[0], device="cpu")
    names = ["blocks.0.resid_post", "blocks.2.resid_post"]
    one = "The capital of France is"
    ids = lm.tokenizer(one, return_tensors="pt")
    by_text = llmprobe.capture(lm, names, one)
    by_ids = llmprobe.capture(lm.model, names, ids["input_ids"], ids["attention_mask"])
    assert all(torch.equal(by_text[n], by_ids[n]) for n in names) and by_text[names[0]].shape[:2] == (1, 7)

    texts = ["The capital of Japan is", "Tell me about Brazil and its capital city."]   # lengths differ: padded
    lm.tokenizer.padding_side = "left"
    batch = lm.tokenizer(texts, return_tensors="pt", padding=True)
    lm.tokenizer.padding_side = "right"       # capture pads on the left whatever the tokenizer's side
    last = torch.full((2, 1), batch["input_ids"].shape[1] - 1)
    by_text = llmprobe.capture(lm, names, texts, positions=last)
    by_ids = llmprobe.capture(lm.model, names, batch["input_ids"], batch["attention_mask"], positions=last)
    assert all(torch.equal(by_text[n], by_ids[n]) for n in names) and lm.tokenizer.padding_side == "right"
    assert torch.equal(llmprobe.capture(lm.model, names, texts, tokenizer=lm.tokenizer, positions=last)[names[1]],
                       by_ids[names[1]])
    with pytest.raises(ValueError, match="text needs a tokenizer and this LlamaForCausalLM has none"):
        llmprobe.capture(lm.model, names, one)
    with pytest.raises(ValueError, match="attention mask is the tokenizer's"):
        llmprobe.capture(lm, names, one, ids["attention_mask"])


def test_the_decoders_building_blocks_are_top_level_names(tiny):
    from llmprobe.geometry import decoders
    from llmprobe.model import engine, lre

    for name, module in (("relation_states", engine), ("subject_jacobians", lre), ("RidgeDecoder", decoders),
                         ("LinearRelationOperator", decoders), ("LinearRelationDecoder", decoders)):
        assert name in llmprobe.__all__ and getattr(llmprobe, name) is getattr(module, name)
    lm = load_model(tiny[0], device="cpu")
    subjects = [s for s, _ in FACTS[:4]]
    states = llmprobe.relation_states(lm, "The capital of {} is", subjects, layers=[1])
    jac = llmprobe.subject_jacobians(lm, "The capital of {} is", subjects, 1)
    assert torch.allclose(states.H[1], jac.H, atol=1e-5) and torch.allclose(states.O, jac.O, atol=1e-5)
    operator = llmprobe.LinearRelationDecoder(beta=2.0).fit(jac.H, jac.O, jac.J).operator_
    assert isinstance(operator, llmprobe.LinearRelationOperator) and operator(jac.H).shape == (4, 32)


# ---------------------------------------------------------------------------------------------- assume_known
def test_assume_known_fits_decoders_on_a_model_that_knows_nothing_and_says_so(tiny, tmp_path):
    analyses = dict(analyses="lre,ridge", analysis_options={"n_boot": 100}, progress=False, verbose=False)
    plain = _probe(tiny, tmp_path / "plain", formats=(), **analyses)
    entry = plain["analyses"]["relations"]["capital"]
    assert plain["relations"]["capital"]["n_known"] == 0 and "0 known facts" in entry["error"]

    report = _probe(tiny, tmp_path / "assumed", formats=("md",), assume_known=["capital"], **analyses)
    entry = report["analyses"]["relations"]["capital"]
    assert not entry.get("error") and set(entry["selected"]) == {"lre", "ridge"}
    assert entry["n_known"] == len(FACTS)                               # the analyses took all 10
    rel = report["relations"]["capital"]
    assert rel["assumed_known"] is True and rel["n_known"] == 0          # what the check found stays said
    assert report["settings"]["run"]["assume_known"] == ["capital"]
    line = "capital: all 10 facts taken as known (run.assume_known)"
    assert any(e.startswith(line) and "found 0 of 10 known" in e for e in report["errors"])
    assert line in (tmp_path / "assumed" / "report.md").read_text()
    checked = json.loads((tmp_path / "assumed" / "known_facts.json").read_text())["capital"]
    assert not any(fact["known"] for fact in checked)                   # known_facts.json: the check's own results
    assert report["stages"]["known_facts"]["key"] != plain["stages"]["known_facts"]["key"]

    with pytest.raises(UsageError, match="run.assume_known: 'nope' is no relation of this run; its relations are "
                                         "capital"):
        _probe(tiny, tmp_path / "nope", assume_known=["nope"])


# ---------------------------------------------------------------------------------------- the command line
def test_the_command_line_parser_and_its_help_load_no_torch():
    code = ("import sys\nfrom llmprobe.cli import main\n"
            "for argv in (['--help'], ['probe', '--help'], ['run', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'sklearn', 'transformers', 'scipy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]
    assert "usage: llmprobe probe" in done.stdout and "--relations" in done.stdout
