"""``--chat-template``: every prompt wrapped in the tokenizer's chat template (a user turn asking to complete the
sentence, the prompt as the open assistant turn), on tiny models whose tokenizer is given a small ChatML-style
template: the prompt verbatim at the end and its subject at the same tokens; in-context examples inside the
assistant turn; the BOS token never doubled; the setting recorded, shown and repeated by ``llmprobe rerun``; a
tokenizer without a template refused before the run, naming the model."""
from __future__ import annotations

import copy
import html
import json

import pytest
from test_schema import DOC, Schema, check
from tiny_models import save_tiny, tiny_tokenizer
from transformers import AutoTokenizer

import llmprobe.analyses.decoders as decoders_module
from llmprobe.analyses.settings import Log, settings_from
from llmprobe.checks import UsageError
from llmprobe.cli import main
from llmprobe.datasets import Fact, Relation
from llmprobe.jobs.probe import probe
from llmprobe.model.chat import INSTRUCTION, adds_bos, chat_prefix, chat_relations, render
from llmprobe.model.known import FactResult, icl_template, known_facts, reference_start
from llmprobe.model.loading import load_model
from llmprobe.model.subjects import encode, fill
from llmprobe.report.render import render_html, render_markdown

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PREFIX = f"<|im_start|>user\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
PLAIN = "The capital of {} is"
FACTS = [("France", "Paris"), ("Japan", "Tokyo"), ("Brazil", "Brasilia"), ("Egypt", "Cairo"),
         ("New Zealand", "Wellington"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
         ("Portugal", "Lisbon"), ("Kenya", "Nairobi"), ("Mexico", "Mexico City"), ("South Korea", "Seoul")]


def relation(n: int = len(FACTS)) -> Relation:
    return Relation("capital", [PLAIN], ["{}"], [Fact(s, o) for s, o in FACTS[:n]], {"cardinality": "one-to-one"})


def chat_tokenizer(template: str | None, with_bos: bool = True):
    """A copy of the tiny tokenizer (adding BOS itself, or not) with ``template`` as its chat template."""
    tok = copy.deepcopy(tiny_tokenizer(with_bos))
    tok.chat_template = template
    return tok


def tiny_folder(root, template: str | None) -> str:
    """A tiny Llama saved with ``template`` as its tokenizer's chat template (None: none)."""
    folder = save_tiny("llama", root)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("chat") / "llama", CHATML)


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("plain") / "llama", None)


@pytest.fixture
def relation_file(tmp_path):
    path = tmp_path / "capital.json"
    path.write_text(json.dumps({**relation(4).to_dict(), "neutral_templates": ["{}"]}))
    return str(path)


def test_wrapped_prompts_end_with_the_prompt_and_the_subject_is_at_its_tokens():
    tok = chat_tokenizer(CHATML)
    [wrapped] = chat_relations(tok, [relation()], "tiny")
    assert wrapped.templates == [PREFIX + PLAIN] and wrapped.neutral_templates == [PREFIX + "{}"]
    assert wrapped.facts == relation().facts
    for subject in ("France", "New Zealand", "South Korea"):
        prompt = fill(wrapped.templates[0], subject)[0]
        assert prompt == render(tok, fill(PLAIN, subject)[0])        # exactly what apply_chat_template writes
        plain, chat = encode(tok, PLAIN, [subject]), encode(tok, wrapped.templates[0], [subject])
        plain_ids, chat_ids = plain.input_ids[0].tolist(), chat.input_ids[0].tolist()
        assert plain_ids[0] == chat_ids[0] == tok.bos_token_id
        assert chat_ids[-(len(plain_ids) - 1):] == plain_ids[1:]    # the prompt's tokens close the wrapped prompt
        shift = len(chat_ids) - len(plain_ids)
        assert shift > 10
        assert int(chat.subject_first[0]) == int(plain.subject_first[0]) + shift
        assert int(chat.subject_last[0]) == int(plain.subject_last[0]) + shift
        first, last = int(chat.subject_first[0]), int(chat.subject_last[0])
        assert tok.decode(chat_ids[first:last + 1]).strip() == subject
        assert int(chat.prompt_last[0]) == len(chat_ids) - 1


def test_the_bos_token_is_never_doubled():
    template = "{{ bos_token }}" + CHATML
    adding, not_adding = chat_tokenizer(template, with_bos=True), chat_tokenizer(template, with_bos=False)
    assert adds_bos(adding) and not adds_bos(not_adding)
    assert chat_prefix(adding, "tiny") == PREFIX                 # the tokenizer puts its BOS back
    assert chat_prefix(not_adding, "tiny") == "<s>" + PREFIX    # kept: nothing else would
    for tok in (adding, not_adding):
        template_text = chat_relations(tok, [relation()], "tiny")[0].templates[0]
        ids = encode(tok, template_text, ["France"]).input_ids[0].tolist()
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, tok.convert_ids_to_tokens(ids[:3])


def test_in_context_examples_sit_inside_the_assistant_turn(chat_folder, monkeypatch):
    lm = load_model(chat_folder, device="cpu")
    [wrapped] = chat_relations(lm.tokenizer, [relation()], chat_folder)
    # the known-fact check (strict, two in-context examples): one chat prefix, then the examples, then the prompt
    results = known_facts(lm, wrapped, n_icl=2, seed=0)
    checked = [r for r in results if r.draws == ["known"] or r.draws == ["unknown"]]
    examples = [f for f, r in zip(wrapped.facts, results) if r.draws == ["context"]]
    assert len(examples) == 2 and len(checked) >= 8
    for r in checked:
        assert r.prompt == PREFIX + fill(icl_template(PLAIN, examples, r.subject), r.subject)[0]
    assert all(r.prompt.count("<|im_start|>") == 2 for r in checked)
    # the lre protocol's prompts of the decoders (its start text, then the chat prefix, then the examples)
    seen = []

    def states(lm, templates, subjects, layers, **kw):
        seen.extend(templates)
        raise RuntimeError("templates seen")

    monkeypatch.setattr(decoders_module, "relation_states", states)
    cfg = settings_from(seed=0, protocol="lre", n_icl=2, n_splits=1)
    forced = [FactResult(f.subject, f.object, "", "", True) for f in wrapped.facts]
    with pytest.raises(RuntimeError, match="templates seen"):
        decoders_module.lre_protocol(lm, wrapped, forced, [0], [], cfg, Log(False))
    assert seen and all(t.startswith(reference_start(lm.tokenizer) + PREFIX + "The capital of ") for t in seen)
    assert all(t.endswith("\n" + PLAIN) and t.count("<|im_start|>") == 2 and t.count("\n") == 5 for t in seen)


def test_probe_records_the_wrapping_and_checks_the_wrapped_prompts(chat_folder, relation_file, tmp_path):
    out = tmp_path / "chat"
    report = probe(chat_folder, relations=[relation_file], layers="-1", device="cpu", analyses=[],
                   chat_template=True, out=out)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["settings"]["run"]["chat_template"] is True and report["settings"] == on_disk["settings"]
    assert on_disk["dataset"]["chat_template"] == {"instruction": INSTRUCTION, "prefix": PREFIX,
                                                   "example": PREFIX + PLAIN}
    assert on_disk["relations"]["capital"]["template_used"] == PREFIX + PLAIN
    known = json.loads((out / "known_facts.json").read_text())["capital"]
    assert [k["prompt"] for k in known] == [PREFIX + PLAIN.replace("{}", s) for s, _ in FACTS[:4]]
    result = check(on_disk, Schema.parse(DOC.read_text(encoding="utf-8")))      # docs/report_schema.md has it all
    assert not result["undocumented"] and not result["wrong_type"], result
    assert {"dataset.chat_template.prefix", "settings.run.chat_template"} <= result["seen"]
    assert "Prompts in the model's chat template" in render_markdown([on_disk], "t")
    assert html.escape(json.dumps(PREFIX + PLAIN)) in render_html([on_disk], "t")    # exact, line breaks as \n
    # without the setting: plain prompts, nothing recorded, no table
    plain = probe(chat_folder, relations=[relation_file], layers="-1", device="cpu", analyses=[])
    assert plain["settings"]["run"]["chat_template"] is False and plain["dataset"]["chat_template"] is None
    assert plain["relations"]["capital"]["template_used"] == PLAIN
    assert plain["dataset"]["hash"] != on_disk["dataset"]["hash"]       # --resume never mixes the two
    assert "Prompts in the model's chat template" not in render_markdown([plain], "t")


def test_the_flag_and_rerun_repeat_the_wrapping(chat_folder, relation_file, tmp_path, capsys):
    out, again = tmp_path / "first", tmp_path / "again"
    assert main(["probe", chat_folder, "--relations", relation_file, "--layers", "-1", "--device", "cpu",
                 "--analyses", "", "--chat-template", "--out", str(out)]) == 0
    assert main(["rerun", str(out), "--out", str(again)]) == 0
    assert "numbers match" in capsys.readouterr().out
    first, second = (json.loads((d / "report.json").read_text()) for d in (out, again))
    assert first["settings"]["run"]["chat_template"] is True and second["settings"] == first["settings"]
    assert second["dataset"] == first["dataset"] and first["dataset"]["chat_template"]["prefix"] == PREFIX
    prompts = [[k["prompt"] for k in json.loads((d / "known_facts.json").read_text())["capital"]] for d in (out, again)]
    assert prompts[0] == prompts[1] and all(p.startswith(PREFIX) for p in prompts[0])


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_model(plain_folder, relation_file, tmp_path,
                                                                        capsys):
    out = tmp_path / "refused"
    with pytest.raises(UsageError, match="has no chat template") as error:
        probe(plain_folder, relations=[relation_file], layers="-1", device="cpu", chat_template=True, out=out)
    assert plain_folder in str(error.value)
    assert not (out / "report.json").exists()              # refused before the folder was claimed
    assert main(["probe", plain_folder, "--relations", relation_file, "--device", "cpu", "--chat-template",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and plain_folder in err and "Traceback" not in err
    with pytest.raises(UsageError, match="tiny-model has no chat template"):
        chat_relations(chat_tokenizer(None), [relation()], "tiny-model")
