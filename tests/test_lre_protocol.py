"""The known-fact rules and the LRE reference's protocol (``--protocol lre``), step by step, on planted and tiny
models: each protocol's known facts are scored 1 by its own scoring; the reference filters only the facts outside
each trial's training facts, with that trial's in-context prompt; J and b come from each training fact prompted
with the others (the test facts with all of them); its pair rule; duplicate rows kept; the as-published label;
few-shot prompts of the strict protocol (in-context subjects never tested). Each test was checked to fail with its
step switched back to the behaviour before issue 21 (see the docstrings)."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_analyses import FAST
from test_lre import LinearToy, word_tokenizer
from tiny_models import FAMILIES, SUBJECTS10, save_tiny

import llmprobe.analyses.decoders as decoders_module
import llmprobe.model.engine as engine
from llmprobe.analyses.run import run_analyses
from llmprobe.analyses.settings import AnalysisError, settings_from
from llmprobe.analyses.splits import in_context_draws, object_pairs
from llmprobe.checks import read_json
from llmprobe.datasets import Fact, Relation, load_relations
from llmprobe.io import write_json
from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.engine import layer_sequences, next_token_predictions, prefix_cached_predictions
from llmprobe.model.known import (
    CONTEXT,
    EXCLUDED,
    KNOWN,
    FactResult,
    context_draws,
    icl_template,
    is_known,
    known_facts,
)
from llmprobe.model.loading import LoadedModel, load_model
from llmprobe.model.lre import per_prompt_jacobians

TEMPLATE = "The capital of {} is"
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "lre_protocol.py"


class GenerativeToy(LinearToy):
    """The linear toy of test_lre with a greedy ``generate`` (the strict known-fact check generates)."""

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, logits_processor=(), **kwargs):
        ids = input_ids
        for _ in range(max_new_tokens):
            scores = self(ids).logits[:, -1]
            for processor in logits_processor:
                scores = processor(ids, scores)
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], 1)
        return SimpleNamespace(sequences=ids)


def toy(n_subjects=40, seed=2) -> tuple[LoadedModel, list[str], list[str]]:
    """The toy, its subjects and its own zero-shot answers (upper-case words W0..; the vocabulary also holds
    their lower-case twins w0..)."""
    subjects = [f"S{i}" for i in range(n_subjects)]
    words = [f"W{i}" for i in range(30)]
    tok = word_tokenizer("The capital of is".split() + subjects + words + [w.lower() for w in words])
    model = GenerativeToy(len(tok), 16, 2, seed).double().eval().requires_grad_(False)
    answerable = torch.tensor([tok.convert_tokens_to_ids(w) for w in words])
    model.head.weight[~torch.isin(torch.arange(len(tok)), answerable)] = 0     # it answers with the W words only
    adapter = ModelAdapter(model)
    adapter.embed = model.embed                     # where inputs go (a hook-point model names none)
    lm = LoadedModel(model, tok, adapter, {"name": "generative_toy"})
    answers = tok.convert_ids_to_tokens(next_token_predictions(lm, TEMPLATE, subjects).tolist())
    assert set(answers) <= set(words) and len(set(answers)) >= 4
    return lm, subjects, answers


@pytest.fixture(scope="module")
def planted():
    return toy()


def answered_in_context(lm, subjects, answers, n_icl=5, seed=0, name="toy", covering=False):
    """A relation whose facts outside the first in-context draw have the toy's answers *under that draw's
    prompt* as objects (the draw's own facts keep the zero-shot answers): known with the in-context prompt.
    The strict protocol's draw (uniform), or with ``covering`` protocol lre's (one fact per distinct object first,
    which depends on the objects: the objects and the draw are iterated until they agree)."""
    objects = list(answers)
    for _ in range(10):
        context = context_draws(len(subjects), n_icl, 1, seed, name, objects if covering else None)[0]
        examples = [Fact(subjects[i], answers[i]) for i in context]
        template = icl_template(TEMPLATE, examples)
        rest = [i for i in range(len(subjects)) if i not in context]
        pred = dict(zip(rest, lm.tokenizer.convert_ids_to_tokens(
            next_token_predictions(lm, template, [subjects[i] for i in rest]).tolist())))
        new = [pred.get(i, answers[i]) for i in range(len(subjects))]
        if new == objects or not covering:
            break
        objects = new
    assert not covering or context_draws(len(subjects), n_icl, 1, seed, name, new)[0] == context
    return Relation(name, [TEMPLATE], ["{}"], [Fact(s, o) for s, o in zip(subjects, new)])


# ------------------------------------------------------------------------------ one rule: filter = scoring
def test_strict_known_facts_score_one_by_their_own_scoring(planted):
    """Half the facts have the toy's answer, half its lower-case twin (' w5' where the toy writes ' W5'): the old
    rule (greedy text starts with the object, case-folded) calls them all known, which capped the model's own
    accuracy at 0.5 here; the strict rule (also the object's first token) keeps the first half only, and the
    decoders then find the model right on every known fact. (Dropping the first-token condition fails this.)"""
    lm, subjects, answers = planted
    objects = [a if i % 2 else a.lower() for i, a in enumerate(answers)]
    relation = Relation("toy", [TEMPLATE], ["{}"], [Fact(s, o) for s, o in zip(subjects, objects)])
    results = known_facts(lm, relation)
    assert all(is_known(r.continuation, r.object) for r in results)       # the text rule alone: all known
    assert [r.known for r in results] == [bool(i % 2) for i in range(len(subjects))]
    out = run_analyses(lm, [relation], {"toy": results}, [0], analyses=("ridge",), progress=False, min_known=4,
                       **FAST)["relations"]["toy"]
    assert out["error"] is None and out["n_used"] == 20 and out["model_accuracy"] == 1.0


def test_lre_known_facts_score_one_by_the_prefix_rule(planted):
    """Protocol lre: known by the reference's prefix rule under each trial's prompt, and the protocol's model
    accuracy on its test facts is 1 in every trial."""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    results = known_facts(lm, relation, protocol="lre", n_icl=5, n_draws=3)
    out = run_analyses(lm, [relation], {"toy": results}, [0, 1], analyses=("lre",), progress=False, protocol="lre",
                       **FAST)["relations"]["toy"]
    measured = [t for t in out["trials"] if t["skipped"] is None]
    assert out["error"] is None and measured and all(t["model_accuracy"] == 1.0 for t in measured)


# ------------------------------------------------------------------------------ the filter: test facts only
def test_reference_filter_checks_only_the_facts_outside_each_trials_training_facts(planted):
    """The objects outside the first draw are the toy's answers with that draw's prompt, 4 of them other than
    its zero-shot answers: the old filter (every fact, zero-shot) misses those; the reference's filter keeps all 35,
    the training facts are never checked (used whether known or not), and each later trial filters with its own
    training facts. (Filtering zero-shot fails this.)"""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    results = known_facts(lm, relation, protocol="lre", n_icl=5, n_draws=3)
    draws = context_draws(len(subjects), 5, 3, 0, "toy", [f.object for f in relation.facts])
    assert len({tuple(d) for d in draws}) == 3
    for k, context in enumerate(draws):
        assert [i for i, r in enumerate(results) if r.draws[k] == CONTEXT] == context
    assert all(r.draws[0] == KNOWN for i, r in enumerate(results) if i not in draws[0])
    zero_shot = sum(bool(r.known_zero_shot) for r in results)
    missed = [i for i, r in enumerate(results) if i not in draws[0] and not r.known_zero_shot]
    assert len(missed) == 4 and sum(r.known for r in known_facts(lm, relation)) <= 36    # the zero-shot filters
    out = run_analyses(lm, [relation], {"toy": results}, [0, 1], analyses=("lre",), progress=False, protocol="lre",
                       **FAST)["relations"]["toy"]
    assert out["trials"][0]["train_subjects"] == [subjects[i] for i in draws[0]]
    assert out["trials"][0]["n_known"] == len(subjects) - 5
    assert out["n_known_zero_shot"] == zero_shot and out["known_only_few_shot"] is False


# ------------------------------------------------------------------------ Jacobians: leave-one-out context
@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    return load_model(str(save_tiny("llama", tmp_path_factory.mktemp("llama"))), device="cpu", dtype=torch.float64)


def _capital_all_known() -> tuple[Relation, list[FactResult]]:
    """14 subjects, each with one of 6 cities as its object, every fact given as known (no known-fact check)."""
    places = ["Paris", "Tokyo", "Berlin", "Rome", "Madrid", "Cairo"]
    subjects = ["France", "Japan", "Brazil", "Germany", "Italy", "Spain", "Portugal", "Egypt", "Kenya", "Mexico",
                "Marie", "Albert", "Europe", "Asia"]
    facts = [Fact(s, places[i % len(places)]) for i, s in enumerate(subjects)]
    return Relation("capital", [TEMPLATE], ["{}"], facts), [FactResult(f.subject, f.object, "", f.object, True)
                                                            for f in facts]


def test_W_and_b_average_the_training_facts_each_prompted_with_the_others(llama64, monkeypatch):
    """W and b of the fitted LRE = the mean over one trial's training facts of J_i and o_i - J_i h_i, each computed
    one prompt at a time (``per_prompt_jacobians``) with the *other* training facts as in-context lines; the test
    facts are prompted with all of them. (The old fixed in-context set, never Jacobian subjects, or a training
    fact's own line left in, fails this.)"""
    seen = []
    real = decoders_module.relation_states

    def spy(lm, templates, subjects, layers, **kw):
        seen.append((templates, subjects))
        return real(lm, templates, subjects, layers, **kw)
    monkeypatch.setattr(decoders_module, "relation_states", spy)
    relation, results = _capital_all_known()
    fitted: dict = {}
    out = decoders_module.decoders_for_relation(
        llama64, relation, results, [1], [1], [], True, False, settings_from(protocol="lre", n_icl=3, lre_betas=(1.0,)),
        lambda message: None, fitted)
    fit = fitted["capital"]["lre"]
    trial = out["trials"][fit["refit"]]
    train = [f for f in relation.facts if f.subject in trial["train_subjects"]]
    assert len(train) == 3 and not set(trial["train_subjects"]) & set(trial["test_subjects"])
    J, b = [], []
    for fact in train:
        template = icl_template(TEMPLATE, train, fact.subject)
        assert template.count("\n") == 2 and fact.subject + " is " not in template
        one = per_prompt_jacobians(llama64, template, [fact.subject], 1)
        J.append(one.J[0].double())
        b.append(one.O[0].double() - one.J[0].double() @ one.H[0].double())
    torch.testing.assert_close(fit["W"].double(), torch.stack(J).mean(0), rtol=0, atol=1e-7)
    torch.testing.assert_close(fit["b"].double(), torch.stack(b).mean(0), rtol=0, atol=1e-7)
    templates, tested = seen[fit["refit"]]
    assert all(t.count("\n") == 3 for t in templates) and set(trial["test_subjects"]) <= set(tested)


# ------------------------------------------------------------------ causality: the prefix-cached fast path
@pytest.fixture(scope="module")
def gpt2_64(tmp_path_factory):
    return load_model(str(save_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))), device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layer", [0, 1, -1])
def test_prefix_cached_edits_give_the_full_passes_numbers(llama64, gpt2_64, family, layer):
    """The fast path of protocol lre's causality (each source prompt's tokens before the subject run once, its
    edit sets only from the subject on) gives the logits of the full resumed forward pass for every edit: 3 source
    prompts of different lengths under an in-context prefix, each under two templates with different numbers of
    tokens after the subject (two groups of the cached pass), each with 5 edits of growing norm, rows
    interleaved (float64: equal to 1e-9). (An edit put anywhere but the subject's last token, a cache that drops
    or repeats a token or has the wrong length, or a row given another row's edit fails this.)"""
    lm = llama64 if family == "llama" else gpt2_64
    layer = layer % lm.adapter.n_layers
    train = [Fact("France", "Paris"), Fact("Japan", "Tokyo"), Fact("Italy", "Rome")]
    base = ["Germany", "United Kingdom", "Egypt"]
    subjects = base * 2
    templates = [icl_template(TEMPLATE, train)] * 3 + [icl_template("The capital city of {}, as everyone knows, is",
                                                                    train)] * 3
    k = 5
    rows, template = subjects * k, templates * k
    seqs = layer_sequences(lm, templates, subjects, layer)
    d = seqs[0].shape[-1]
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(len(rows), d, generator=gen, dtype=torch.float64) * torch.arange(len(rows))[:, None] / 3
    slow = next_token_predictions(lm, template, rows, layer, delta, return_logits=True, resume=seqs * k)
    fast = prefix_cached_predictions(lm, template, rows, layer, delta, seqs * k, batch_size=4, return_logits=True)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-9)
    assert not any("forward" in vars(block) for block in lm.adapter.blocks)               # blocks restored
    clean = next_token_predictions(lm, template, rows, return_logits=True)
    if layer < lm.adapter.n_layers - 1:         # (at the last block an edit before the prompt's end changes nothing)
        assert (slow - clean).abs().max() > 1e-3                              # the edits change the logits
    assert torch.equal(prefix_cached_predictions(lm, template, rows, layer, delta, seqs * k),
                       next_token_predictions(lm, template, rows, layer, delta, resume=seqs * k))


@pytest.mark.parametrize("margin", ["inside", "beyond"])
def test_edited_predictions_take_the_full_pass_for_rows_near_a_tie(llama64, monkeypatch, margin):
    """``edited_predictions`` returns the full resumed pass's ids bit for bit while most rows come from the prefix
    cache. Planted: a fast path that errs on rows 2 and 7 by flipping their top two logits by less than the
    margin (as float sums in another order could) is corrected, those rows' micro-batches run in full (and only
    those); a flip beyond the margin is trusted, so the test sees the margin doing the work. (Settling every row
    fails "inside"; recomputing every row fails the count of micro-batches run.)"""
    lm = llama64
    subjects = ["Germany", "United Kingdom", "Egypt", "France"] * 3
    seqs = layer_sequences(lm, TEMPLATE, subjects[:4], 1)
    gen = torch.Generator().manual_seed(1)
    delta = torch.randn(len(subjects), seqs[0].shape[-1], generator=gen, dtype=torch.float64)
    full = next_token_predictions(lm, TEMPLATE, subjects, 1, delta, resume=seqs * 3, batch_size=4)
    exact = engine.prefix_cached_predictions

    def flipped(*args, **kwargs):
        logits = exact(*args, **kwargs).clone()
        for row in (2, 7):
            top = logits[row].topk(2)
            a, b = top.indices.tolist()
            gap = engine._MARGIN / 2 if margin == "inside" else engine._MARGIN * 4
            logits[row, b] = logits[row, a] + gap            # the runner-up now leads, by ``gap``
        runs.clear()                                          # the fast path's own prompts are not counted
        return logits

    monkeypatch.setattr(engine, "prefix_cached_predictions", flipped)
    runs = []
    real_encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda *a, **k: runs.append(a[2]) or real_encode(*a, **k))
    got = engine.edited_predictions(lm, TEMPLATE, subjects, 1, delta, seqs * 3, batch_size=4)
    run_in_full = list(runs)
    fast = flipped(lm, TEMPLATE, subjects, 1, delta, seqs * 3, return_logits=True)
    top = fast.topk(2, dim=-1).values
    close = {row for row in range(len(subjects)) if float(top[row, 0] - top[row, 1]) < engine._MARGIN}
    assert ({2, 7} <= close) == (margin == "inside")
    ran = sorted({row // 4 for row in close})                  # the micro-batches of 4 holding a close row
    assert run_in_full == [subjects[4 * b:4 * b + 4] for b in ran]      # those run in full, and only those
    expected = torch.tensor([int(full[row]) if row // 4 in ran else int(fast[row].argmax())
                             for row in range(len(subjects))])
    assert torch.equal(got, expected)
    if margin == "inside":
        assert torch.equal(got, full)                           # the planted errors corrected
    elif not {0, 1} <= set(ran):
        assert not torch.equal(got, full)                       # a flip beyond the margin is trusted


@pytest.mark.parametrize("protocol", ["lre", "strict"])
def test_causality_numbers_equal_with_and_without_the_prefix_cache(llama64, monkeypatch, protocol):
    """Both protocols end to end on the tiny llama, causality measured: every number of the relation's entry
    (beta, edit rank, faithfulness, causality and its controls per re-fit or trial) is the same with the
    prefix-cached edits (``edited_predictions``, the default) as with the full resumed passes, and the cached
    path really ran (a ``PREFIX_CACHE`` the edits ignore fails the count)."""
    relation, results = _capital_all_known()
    cfg = settings_from(protocol=protocol, n_icl=3 if protocol == "lre" else 0, lre_betas=(0.5, 1.0),
                        lre_edit_ranks=(0, 8, 16, 24, 64), min_known=4, n_splits=2)
    seen, cached = [], []
    real, real_cached = decoders_module.causality_hits, decoders_module.edited_predictions

    def spy(*args, **kw):
        got = real(*args, **kw)
        seen.append((decoders_module.PREFIX_CACHE, got))
        return got
    monkeypatch.setattr(decoders_module, "causality_hits", spy)
    monkeypatch.setattr(decoders_module, "edited_predictions",
                        lambda *a, **k: cached.append(1) or real_cached(*a, **k))
    entries = {}
    for fast in (False, True):
        monkeypatch.setattr(decoders_module, "PREFIX_CACHE", fast)
        out = decoders_module.decoders_for_relation(llama64, relation, results, [1], [1], [1], True, False, cfg,
                                                    lambda message: None)
        out.pop("seconds")
        entries[fast] = out
    assert entries[True] == entries[False] and "causality" in entries[True]["layers"]["1"]["lre"]
    slow = [hits for fast, hits in seen if not fast]
    quick = [hits for fast, hits in seen if fast]
    assert len(slow) == len(quick) == len(cached) > 0
    assert all(torch.equal(a, b) for s, q in zip(slow, quick) for a, b in zip(s, q))


# ------------------------------------------------------------------------------------------ the pair rule
def test_reference_pairs_need_another_subject_and_another_object_string():
    """South Korea and South Africa share their first token: the strict rule never pairs them, the reference
    does (it compares object strings); a target never has the source's object or subject. (The first-token rule
    leaves 0 and 2 unpaired.)"""
    subjects = ["a", "b", "c", "d"]
    objects = ["South Korea", "South Africa", "South Korea", "South Africa"]
    src, tgt = object_pairs(subjects, objects, torch.arange(4), torch.Generator().manual_seed(0))
    assert src.tolist() == [0, 1, 2, 3]
    for s, t in zip(src.tolist(), tgt.tolist()):
        assert objects[s] != objects[t] and subjects[s] != subjects[t]
    src, _ = object_pairs(["a", "a", "b"], ["x", "y", "x"], torch.arange(3), torch.Generator().manual_seed(0))
    assert src.tolist() == [1, 2]                                      # 0: its only other object has its subject


# ------------------------------------------------------------------------------------------ duplicate rows
def test_duplicate_rows_are_kept_and_a_duplicate_of_a_training_fact_loses_its_line(planted):
    """The LRE dataset repeats rows (adj_comparative: 68 rows, 57 distinct): the reference keeps every row, so a
    test row may repeat a training row; its prompt then leaves that line out (the model must answer itself).
    (Deduplicating, or keeping the line, fails this.)"""
    lm, subjects, answers = planted
    facts = answered_in_context(lm, subjects, answers, covering=True).facts
    n = 2 * len(facts)
    rows = Relation("toy", [TEMPLATE], ["{}"], facts + facts)                   # every row twice
    context = context_draws(n, 5, 1, 0, "toy", [f.object for f in rows.facts])[0]
    results = known_facts(lm, rows, protocol="lre", n_icl=5, n_draws=1)
    assert len(results) == n
    draw = in_context_draws(results, "lre", 5, 1, 0, "toy")[0]
    assert draw.context == context
    in_context = [rows.facts[i].subject for i in context]
    repeated = [i for i in range(len(facts), n) if i not in context and rows.facts[i].subject in in_context]
    assert repeated
    for i in repeated:
        assert results[i].draws == [KNOWN] or results[i].draws == ["unknown"]
        assert f"The capital of {results[i].subject} is {results[i].object}" not in results[i].prompt
        assert results[i].prompt.count("\n") == 5 - in_context.count(results[i].subject)   # the others' lines
    strict = known_facts(lm, rows, n_icl=5)                             # strict: such a subject is never tested
    shared = {rows.facts[i].subject for i, r in enumerate(strict) if r.draws == [CONTEXT]}
    twins = [i for i, r in enumerate(strict) if r.draws != [CONTEXT] and rows.facts[i].subject in shared]
    assert twins and all(strict[i].draws == [EXCLUDED] for i in twins)


def test_lre_names_keep_duplicate_rows():
    adj = load_relations("lre:adj_comparative")[0]
    assert len(adj.facts) == 68 and len(set(adj.facts)) == 57 and adj.properties["duplicate_rows"] == 11


# ------------------------------------------------------------------------------------ selection and label
@pytest.mark.parametrize("mode", ["as-published", "validation"])
def test_selection_modes_and_the_as_published_label(planted, mode):
    """As published, beta, edit rank and layer are chosen on the test facts (their validation scores are the test
    scores) and every place says so; on validation, each trial's test facts are held out from the choice."""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    results = known_facts(lm, relation, protocol="lre", n_icl=5, n_draws=3)
    out = run_analyses(lm, [relation], {"toy": results}, [0, 1], analyses=("lre",), progress=False, protocol="lre",
                       lre_selection=mode, **FAST)
    entry = out["relations"]["toy"]
    lre = entry["layers"]["0"]["lre"]
    published = mode == "as-published"
    assert entry["selection"] == mode and ("as published" in entry["selected"]["lre"]["by"]) == published
    assert ("AS PUBLISHED" in entry["selection_note"]) == published
    assert ("AS PUBLISHED" in lre["faithfulness"]["note"]) == published
    for trial in (t for t in entry["trials"] if t["skipped"] is None):
        if mode == "as-published":
            assert trial["n_val"] == trial["n_test"] == trial["n_known"]
        else:
            assert trial["n_val"] + trial["n_test"] == trial["n_known"] and trial["n_test"] >= 2
    if published:
        assert all(c["val_faithfulness"] == c["test_faithfulness"] for c in lre["chosen"])
    assert lre["faithfulness"]["value"] > lre["faithfulness"]["nulls"]["majority"]["value"]


def test_an_unknown_selection_mode_is_refused(planted):
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    results = known_facts(lm, relation, protocol="lre", n_icl=5, n_draws=3)
    with pytest.raises(ValueError, match="lre_selection must be one of"):      # refused before any work
        run_analyses(lm, [relation], {"toy": results}, [0, 1], analyses=("lre",), progress=False, protocol="lre",
                     lre_selection="test", **FAST)


# ----------------------------------------------------------------------- few-shot prompts of any protocol
def test_strict_few_shot_prompts_never_test_an_in_context_subject(planted):
    """``n_icl`` for the strict protocol: the in-context facts are drawn once by the known-fact stage, written
    before every prompt of the filter and of the analyses, and never tested; the analyses refuse known facts
    checked with another number of examples."""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers)
    results = known_facts(lm, relation, n_icl=5)
    context = context_draws(len(subjects), 5, 1, 0, "toy")[0]
    assert [i for i, r in enumerate(results) if r.draws == [CONTEXT]] == context
    assert sum(r.known for r in results) == len(subjects) - 5 and sum(r.known_zero_shot for r in results) <= 27
    out = run_analyses(lm, [relation], {"toy": results}, [0], analyses=("ridge",), progress=False, n_icl=5,
                       **FAST)["relations"]["toy"]
    assert out["error"] is None and out["n_icl"] == 5 and out["model_accuracy"] == 1.0
    assert out["context_subjects"] == [subjects[i] for i in context]
    assert out["template"].count("\n") == 5 and not set(out["context_subjects"]) & set(out["test_subjects"])
    assert out["n_known_zero_shot"] == sum(r.known_zero_shot for r in results) and not out["known_only_few_shot"]
    with pytest.raises(AnalysisError, match="in-context"):
        in_context_draws(results, "strict", 3, 1, 0, "toy")


# ------------------------------------------------------------------------------------------- the benchmark
@pytest.fixture
def bench():
    """benchmarks/lre_protocol.py loaded as a module (in sys.modules while the test runs, as before)."""
    spec = importlib.util.spec_from_file_location("lre_protocol_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _toy_benchmark(planted, bench) -> tuple:
    """The benchmark on the toy: a factual relation answered in context and a bias one never known ("never"),
    at layer 0. Returns (lm, the never-known relation, the measured dict)."""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    relation.properties["relation_type"] = "factual"
    unknown = Relation("never", [TEMPLATE], ["{}"], [Fact(s, "W29") for s in subjects[:8]],
                       {"relation_type": "bias"})
    return lm, unknown, bench.measure(lm, [relation, unknown], [0], options=FAST, log=lambda message: None)


def test_benchmark_table_on_the_toy(planted, bench):
    """benchmarks/lre_protocol.py on the toy: both modes measured, one row per category and mode beside the
    published means; a relation the model cannot be tested on is listed but not measured."""
    lm, unknown, measured = _toy_benchmark(planted, bench)
    assert measured["relations"]["toy"]["measured"] and not measured["relations"]["never"]["measured"]
    rows = bench.table(measured)
    assert rows[0][:4] == ["category", "mode", "faithfulness (n rel., n facts)", "causality (n rel., n pairs)"]
    factual = {r[1]: r for r in rows if r[0] == "factual"}
    assert set(factual) == {"as-published", "validation"} and factual["as-published"][6] == "0.644 / 0.720"
    toy = measured["relations"]["toy"]["modes"]["as-published"]
    (f, _, c, _), (majority, random) = bench.selected(toy), bench.primary_nulls(toy)
    assert rows[0][4:6] == ["F - majority", "C - random dir."]
    assert factual["as-published"][4:6] == [f"{f - majority:.3f}", f"{c - random:.3f}"]
    assert factual["as-published"][2].endswith(")") and " (1, " in factual["as-published"][2]
    assert {r[1]: r[2] for r in rows if r[0] == "bias"} == {"as-published": "-", "validation": "-"}
    assert "factual" in bench.format_table(rows)


def test_benchmark_pools_saved_runs_and_writes_the_docs_rows(planted, bench, tmp_path, capsys):
    """``--table a.json b.json --markdown``: two runs of different relations pool to the table of one run of
    both, with a row per relation and the bundled relations not run; runs of other settings refuse to pool; a
    relation cut by ``max_facts`` says so in its row."""
    lm, unknown, measured = _toy_benchmark(planted, bench)
    halves = [{**measured, "relations": {name: entry}, "seconds": 1.5}
              for name, entry in measured["relations"].items()]
    pooled = bench.merge(halves)
    assert pooled["relations"] == measured["relations"] and pooled["seconds"] == 3.0
    assert bench.table(pooled) == bench.table(measured)
    rows = {line.split(" | ")[0][2:]: line for line in bench.relation_rows(pooled)[2:]}
    toy = measured["relations"]["toy"]["modes"]["as-published"]
    (f, n, c, _), (majority, random) = bench.selected(toy), bench.primary_nulls(toy)
    layer = toy["layers"][str(toy["selected"]["lre"]["layer"])]["lre"]
    assert (majority, random) == (layer["faithfulness"]["nulls"]["majority"]["value"],
                                  layer["causality"]["nulls"]["random_direction"]["value"])
    assert f"| {f:.3f} vs {majority:.3f} / {c:.3f} vs {random:.3f} ({n}) |" in rows["toy"]
    assert rows["never"].count("not measurable") == 2
    assert bench.coverage(pooled)[3].startswith("* bias: 0 measured of 7 (0 checked); not run: ")
    with pytest.raises(ValueError, match="differ in"):
        bench.merge([halves[0], {**halves[1], "layers": [1]}])
    saved = tmp_path / "capped.json"
    capped = bench.measure(lm, [unknown], [0], options=FAST, log=lambda message: None, max_facts=5,
                           out_path=str(saved))
    assert read_json(saved)["relations"] == capped["relations"]     # written though it measured nothing
    assert (capped["relations"]["never"]["n_rows"], capped["relations"]["never"]["n_rows_file"]) == (5, 8)
    assert capped["relations"]["never"]["n_known"] == []            # 5 rows: no trial beside 5 training facts
    assert "| never | bias | 5 of 8 | - | not measurable | not measurable |" in bench.relation_rows(capped)[2]
    paths = []
    for k, half in enumerate(halves):
        paths.append(str(tmp_path / f"run{k}.json"))
        write_json(paths[-1], half)
    bench.main(["--table", *paths, "--markdown"])
    printed = capsys.readouterr().out
    assert rows["toy"] in printed and "* factual: 0 measured of 26 (0 checked)" in printed


def test_benchmark_modes_share_their_jacobians_and_numbers(planted, monkeypatch, bench):
    """The benchmark computes each trial's Jacobians once for both selection modes (``shared_jacobians``): half
    the calls of computing them per mode, and every number of both modes the same. (A memo keyed on too little,
    e.g. not on the prompts, fails this.)"""
    lm, subjects, answers = planted
    relation = answered_in_context(lm, subjects, answers, covering=True)
    calls = []
    real = decoders_module.subject_jacobians

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(decoders_module, "subject_jacobians", counted)

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "seconds"}
        return [strip(v) for v in x] if isinstance(x, list) else x
    shared = bench.measure(lm, [relation], [0, 1], options=FAST, log=lambda message: None)
    n_shared = len(calls)
    monkeypatch.setattr(bench, "shared_jacobians", contextlib.nullcontext)
    calls.clear()
    alone = bench.measure(lm, [relation], [0, 1], options=FAST, log=lambda message: None)
    assert n_shared > 0 and len(calls) == 2 * n_shared
    assert strip(shared) == strip(alone) and len(shared["relations"]["toy"]["modes"]) == 2


# ------------------------------------------------------------ the known-fact check: shared in-context prefix
@pytest.mark.parametrize("family", FAMILIES)
def test_the_shared_prefix_gives_the_full_passes_next_tokens(tmp_path, family, monkeypatch):
    """The lre known-fact check's fast path (``engine.shared_prefix_logits``: the in-context examples every prompt
    starts with run once, each micro-batch of 4 only its own tokens after them, right-padded) gives the full
    pass's logits (float32: to 1e-4; float64 gemma2 turns a left-padded batch into NaN, the full pass included)
    for prompts whose subjects have 1 to 3 tokens, in every family; its ids
    (``next_token_ids``) are the full pass's, and so are ``known_facts``' results. Prompts sharing fewer tokens
    than ``SHARED_PREFIX_MIN`` run whole. (Positions that restart at 0 after the cache, a cache shared by the
    micro-batches instead of copied, or the wrong token read fail this.)"""
    lm = load_model(str(save_tiny(family, tmp_path)), device="cpu", dtype=torch.float32)
    train = [Fact("France", "Paris"), Fact("Japan", "Tokyo"), Fact("Italy", "Rome"), Fact("Spain", "Madrid")]
    template = icl_template(TEMPLATE, train)
    subjects = ["Germany", "United Kingdom", "Egypt", "the Czech Republic", *SUBJECTS10[:6]]
    full = next_token_predictions(lm, template, subjects, return_logits=True, batch_size=4)
    fast = engine.shared_prefix_logits(lm, template, subjects, batch_size=4)
    assert fast is not None
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-4)
    assert torch.equal(engine.next_token_ids(lm, template, subjects, batch_size=4), full.argmax(-1))
    assert engine.shared_prefix_logits(lm, TEMPLATE, subjects) is None          # "The capital of": too short
    relation = Relation("capital", [TEMPLATE], ["{}"], [Fact(s, "Paris") for s in subjects + [f.subject for f in train]])
    checked = known_facts(lm, relation, protocol="lre", n_icl=4, n_draws=2, seed=1)
    monkeypatch.setattr(engine, "SHARED_PREFIX_MIN", 10 ** 6)                   # every prompt run whole
    assert known_facts(lm, relation, protocol="lre", n_icl=4, n_draws=2, seed=1) == checked
