"""Bring your own model: a transformers object, a TransformerBridge and an nnsight TransformersModel (and its
deprecated LanguageModel, while nnsight has it) give the same
states and the same probe report as the same weights loaded by path; hook names translate to and from
TransformerLens'; unsupported objects and missing tokenizers fail clearly."""
import contextlib
import json

import pytest
import torch
from tiny_models import save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmprobe.model.known as known_module
from llmprobe.jobs.main import run
from llmprobe.jobs.probe import probe
from llmprobe.model.adapters import ModelAdapter, from_lens_name, to_lens_name
from llmprobe.model.capture import capture
from llmprobe.model.interop import as_loaded_model, state_dict_hash
from llmprobe.model.loading import ModelLoadError, load_model

FAMILIES = ("llama", "qwen2", "phi")     # the bridge boots all three offline
SUBJECTS = ["France", "Japan", "Brazil", "Germany", "Italy", "Spain", "Portugal", "Egypt", "Mexico", "Kenya",
            "Korea", "Zealand", "Europe", "Asia", "Africa", "Oceania", "Americas", "Paris", "Tokyo", "Curie"]
TEMPLATE = "The capital of {} is"
FAST = dict(n_boot=50, max_swap_subjects=4, folds=3, max_val_pairs=4, max_test_pairs=8)


def _own_relation(folder, path):
    """A relation whose objects are the model's own greedy answers, so every fact is known and the decoders run."""
    lm = load_model(str(folder), device="cpu")
    facts = []
    for subject in SUBJECTS:
        ids = lm.tokenizer([TEMPLATE.format(subject)], return_tensors="pt").input_ids
        with torch.no_grad():
            answer = lm.tokenizer.decode([int(lm.model(ids).logits[0, -1].argmax())]).strip()
        if answer:              # the first token of the greedy continuation, spaces stripped
            facts.append({"subject": subject, "object": answer})
    path.write_text(json.dumps({"name": "own", "templates": [TEMPLATE], "neutral_templates": ["{}"],
                                "properties": {"cardinality": "many-to-one"}, "facts": facts}))
    return str(path)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(folder, relation file, the report of the model loaded by path) for one tiny random-init family."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = str(save_tiny(request.param, tmp / "model"))
    if request.param == "qwen2":    # no BOS, as Qwen2's own tokenizer (the bridge's copy of it would prepend one)
        tiny_tokenizer(with_bos=False).save_pretrained(folder)
    relation = _own_relation(folder, tmp / "own.json")
    return folder, relation, _probe(folder, **_options(relation))


def _probe(model, **kwargs):
    """``probe`` with every fact known: a random model's greedy token often lacks the leading space the strict
    rule's first token has (phi: 1 of 20), and the decoders need 8 known facts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(known_module, "is_known", lambda text, obj: True)
        return probe(model, **kwargs)


def _options(relation):
    return dict(relations=[relation], layers="0,-1", analyses=("lre",), device="cpu", analysis_options=FAST)


def _numbers(report):
    """What must not depend on how the model was handed over: known facts and every analysis number."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not (k.endswith("_s") or "seconds" in k)}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return {"relations": report["relations"], "analyses": strip(report["analyses"])}


def _states(lm):
    """Every place llmprobe offers, at every token of two prompts: {name: [2, seq, d]}."""
    batch = lm.tokenizer([TEMPLATE.format("France"), TEMPLATE.format("Kenya")], return_tensors="pt", padding=True)
    return capture(lm.model, lm.adapter.names(), batch.input_ids, batch.attention_mask)


def _hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _bridge(folder):
    lens = pytest.importorskip("transformer_lens.model_bridge")
    model, tokenizer = _hf(folder)
    return lens.TransformerBridge.boot_transformers(folder, hf_model=model, tokenizer=tokenizer, device="cpu")


def _plain_bridge(folder):
    """Booted the way TransformerLens' docs show: the bridge loads the model itself (and sets output_attentions,
    which made ``generate`` return a dict: issue 23, row 9)."""
    lens = pytest.importorskip("transformer_lens.model_bridge")
    return lens.TransformerBridge.boot_transformers(folder, device="cpu")


def _nnsight(folder):
    """What nnsight recommends: TransformersModel(model, task='text-generation')."""
    nnsight = pytest.importorskip("nnsight")
    model, tokenizer = _hf(folder)
    return nnsight.TransformersModel(model, tokenizer=tokenizer, task="text-generation")


def _nnsight_language_model(folder):
    """nnsight's older class, deprecated upstream (it warns): kept working while nnsight has it."""
    nnsight = pytest.importorskip("nnsight")
    if not hasattr(nnsight, "LanguageModel"):
        pytest.skip("this nnsight no longer has LanguageModel")
    model, tokenizer = _hf(folder)
    with pytest.warns(FutureWarning, match="LanguageModel is deprecated") if hasattr(nnsight, "TransformersModel") \
            else contextlib.nullcontext():
        return nnsight.LanguageModel(model, tokenizer=tokenizer)


def _processed_bridge(folder):
    bridge = _bridge(folder)
    bridge.enable_compatibility_mode(disable_warnings=True)   # folds the norms, centres the residual stream
    return bridge


KINDS = {"transformers": lambda folder: _hf(folder), "bridge": lambda folder: (_bridge(folder), None),
         "plain_bridge": lambda folder: (_plain_bridge(folder), None),
         "processed_bridge": lambda folder: (_processed_bridge(folder), None),
         "nnsight": lambda folder: (_nnsight(folder), None),
         "nnsight_language_model": lambda folder: (_nnsight_language_model(folder), None)}


@pytest.mark.parametrize("kind", KINDS)
def test_an_object_gives_the_states_and_report_of_its_folder(family, kind):
    folder, relation, by_path = family
    obj, tokenizer = KINDS[kind](folder)
    lm = as_loaded_model(obj, tokenizer)
    reference = load_model(folder, device="cpu")
    ours, theirs = _states(lm), _states(reference)
    assert list(ours) == list(theirs) and len(ours) == 6 * 3 + 1
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert lm.info["source"] == "object" and lm.info["path"] == folder
    assert lm.info["n_params"] == reference.info["n_params"] and lm.info["weights_hash"].startswith("sha256:")
    report = _probe(obj, tokenizer=tokenizer, **_options(relation))
    assert report["relations"]["own"]["n_known"] == report["relations"]["own"]["n_facts"] >= 8
    assert report["analyses"]["relations"]["own"]["layers"]["0"]["lre"]["faithfulness"]["n"] > 0
    assert _numbers(report) == _numbers(by_path)


def test_a_bridge_leaves_its_own_model_alone_and_the_hash_names_the_weights(tmp_path):
    folder = str(save_tiny("llama", tmp_path / "llama"))
    bridge = _bridge(folder)
    lm = as_loaded_model(bridge)
    assert lm.model is not bridge.original_model and bridge.original_model.config._attn_implementation == "eager"
    assert lm.model.config._attn_implementation == load_model(folder, device="cpu").model.config._attn_implementation
    model, tokenizer = _hf(folder)
    assert as_loaded_model(model, tokenizer).info["weights_hash"] == lm.info["weights_hash"]
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1
    assert state_dict_hash(model) != lm.info["weights_hash"]


def test_run_takes_a_model_object(family, tmp_path):
    """run() with an object (no controls here: their worker gets only the fact table, never the model)."""
    folder, relation, _ = family
    model, tokenizer = _hf(folder)
    kwargs = dict(relations=[relation], layers="0", analyses=("lre",), device="cpu", matched=False,
                  formats=("json",), analysis_options=FAST)
    by_object = run(model, tokenizer=tokenizer, out=tmp_path / "object", **kwargs)
    by_path = run(folder, out=tmp_path / "path", **kwargs)
    assert by_object["model"]["source"] == "object" and _numbers(by_object) == _numbers(by_path)


@pytest.mark.parametrize("name,lens", [("blocks.3.resid_post", "blocks.3.hook_resid_post"),
                                       ("blocks.0.resid_pre", "blocks.0.hook_resid_pre"),
                                       ("blocks.0.resid_mid", "blocks.0.hook_resid_mid"),
                                       ("blocks.12.attn_out", "blocks.12.hook_attn_out"),
                                       ("blocks.1.mlp_out", "blocks.1.hook_mlp_out"),
                                       ("blocks.1.mlp_hidden", "blocks.1.mlp.hook_post"),
                                       ("ln_final", "ln_final.hook_out")])
def test_hook_names_translate_both_ways(name, lens):
    assert to_lens_name(name) == lens and from_lens_name(lens) == name


def test_hook_names_without_a_counterpart_are_refused():
    with pytest.raises(KeyError, match="no TransformerLens counterpart"):
        to_lens_name("blocks.0.attn_pattern")
    with pytest.raises(KeyError, match="no llmprobe counterpart"):
        from_lens_name("blocks.0.attn.hook_pattern")
    with pytest.raises(KeyError, match="no llmprobe counterpart"):
        from_lens_name("ln_final.hook_normalized")


def test_lens_names_address_the_same_tensors_as_the_bridge_cache(tmp_path):
    """capture() takes TransformerLens names, and each translated name holds what the bridge's run_with_cache
    holds under it (the final norm given a non-unit weight, so hook_out and hook_normalized differ)."""
    folder = str(save_tiny("llama", tmp_path / "llama"))
    model, tokenizer = _hf(folder)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    names = ModelAdapter(model).names()
    ids = tokenizer([TEMPLATE.format("France")], return_tensors="pt").input_ids
    ours = capture(model, names, ids)
    by_lens_name = capture(model, [to_lens_name(n) for n in names], ids)
    assert all(torch.equal(ours[n], by_lens_name[to_lens_name(n)]) for n in names)
    lens = pytest.importorskip("transformer_lens.model_bridge")
    bridge = lens.TransformerBridge.boot_transformers(folder, hf_model=model, tokenizer=tokenizer, device="cpu")
    _, cache = bridge.run_with_cache(ids)
    for name in names:        # the bridge runs eager attention: equal to float32 rounding
        torch.testing.assert_close(cache[to_lens_name(name)], ours[name], atol=1e-5, rtol=1e-5, msg=name)


def test_unsupported_objects_and_missing_tokenizers_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot probe a torch.nn.modules.linear.Linear"):
        as_loaded_model(torch.nn.Linear(2, 2))
    folder = str(save_tiny("qwen2", tmp_path / "qwen2"))
    model, tokenizer = _hf(folder)
    with pytest.raises(ModelLoadError, match="tokenizer= goes with a model object"):
        as_loaded_model(folder, tokenizer)
    orphan = AutoModelForCausalLM.from_config(model.config)
    orphan.name_or_path = "someone/elses-model"            # no folder to read a tokenizer from
    with pytest.raises(ModelLoadError, match="needs its tokenizer: pass tokenizer="):
        probe(orphan, relations=[_own_relation(folder, tmp_path / "own.json")], device="cpu")
    assert as_loaded_model(model).tokenizer.name_or_path == folder   # read from the model's folder
    hooked = type("HookedTransformer", (), {"__module__": "transformer_lens.HookedTransformer"})()
    with pytest.raises(ModelLoadError, match="HookedTransformer .*cannot map them back"):
        as_loaded_model(hooked)


def test_nnsight_transformers_model_is_probed_and_one_made_for_another_task_is_refused(tmp_path):
    """TransformersModel(..., task='text-generation') is what nnsight now recommends: it gives the weights of the
    folder (undispatched from a name, or around a model object); one made for another task wraps a model without
    a language-model head, and the error says how to make the right one."""
    nnsight = pytest.importorskip("nnsight")
    if not hasattr(nnsight, "TransformersModel"):
        pytest.skip("this nnsight has no TransformersModel")
    from transformers import AutoModel

    folder = str(save_tiny("llama", tmp_path / "llama"))
    by_path = load_model(folder, device="cpu")
    lazy = nnsight.TransformersModel(folder, tokenizer=AutoTokenizer.from_pretrained(folder), task="text-generation")
    lm = as_loaded_model(lazy)                       # made from a name: dispatched (its weights loaded) here
    assert lm.info["weights_hash"] == state_dict_hash(by_path.model)
    assert lm.info["object_class"] == "nnsight.modeling.transformers.TransformersModel"
    assert torch.equal(_states(lm)["blocks.1.resid_post"], _states(by_path)["blocks.1.resid_post"])
    headless = nnsight.TransformersModel(AutoModel.from_pretrained(folder), tokenizer=lm.tokenizer,
                                         task="feature-extraction")
    with pytest.raises(ModelLoadError, match="'feature-extraction' task.*TransformersModel\\(repo_id, "
                                             "task='text-generation'\\)"):
        as_loaded_model(headless)


def test_a_processed_bridge_without_a_folder_is_refused(tmp_path):
    folder = str(save_tiny("llama", tmp_path / "llama"))
    bridge = _processed_bridge(folder)
    bridge.original_model.name_or_path = "someone/elses-model"
    with pytest.raises(ModelLoadError, match="weights were processed"):
        as_loaded_model(bridge)


def test_every_public_name_is_what_it_says_whatever_was_imported_before(tmp_path):
    """After importing every module of the package, each name of ``llmprobe.__all__`` is still the function or
    class it names, never a module of the same name: ``llmprobe.probe(...)``, ``llmprobe.run(...)`` and
    ``llmprobe.capture(...)`` call the functions (their argument checks answer)."""
    import importlib
    import pkgutil
    import types

    import llmprobe
    from llmprobe.checks import UsageError

    for info in pkgutil.walk_packages(llmprobe.__path__, "llmprobe."):
        importlib.import_module(info.name)
    for name in llmprobe.__all__:
        assert not isinstance(getattr(llmprobe, name), types.ModuleType), name
    for function in (llmprobe.probe, llmprobe.run):
        with pytest.raises(UsageError, match="bad layer 'nonsense'"):
            function("any-model", layers="nonsense", out=str(tmp_path / "out"))
    assert (llmprobe.probe.__name__, llmprobe.run.__name__, llmprobe.capture.__name__) == ("probe", "run", "capture")

