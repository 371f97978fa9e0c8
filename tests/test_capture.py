"""Loading, adapters and targeted capture on a tiny random-init model of every supported family."""
import pytest
import torch
from tiny_models import FAMILIES, save_tiny

from llmprobe.model.adapters import SUPPORTED_TYPES, AdapterError, ModelAdapter, to_lens_name
from llmprobe.model.capture import capture, forward, patch
from llmprobe.model.families import PLAIN_MLP
from llmprobe.model.loading import ModelLoadError, load_model
from llmprobe.model.subjects import SubjectNotFoundError, encode

TEMPLATES = ["The capital of {} is", "Tell me about {}.", "{} is located in"]
SUBJECTS = ["France", "United Kingdom", "South Korea"]


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
    folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(str(folder), device="cpu", dtype="float32")


def test_every_supported_type_has_a_tiny_model():
    assert set(SUPPORTED_TYPES) - {"gemma3"} <= set(FAMILIES)


def test_load_describes_the_model(loaded):
    info = loaded.info
    assert info["source"] == "local" and info["n_layers"] == 3 and info["d_model"] == 32
    assert info["weights_hash"].startswith("sha256:") and info["dtype"] == "float32"
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_captured_states_equal_output_hidden_states(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS, padding_side="left")
    n = loaded.adapter.n_layers
    names = ["blocks.0.resid_pre"] + [f"blocks.{l}.resid_post" for l in range(n)] + ["ln_final", "logits"]
    states = capture(loaded.model, names, batch.input_ids, batch.attention_mask)
    reference = forward(loaded.model, batch.input_ids, batch.attention_mask, output_hidden_states=True)
    hidden = reference.hidden_states
    assert len(hidden) == n + 1
    torch.testing.assert_close(states["blocks.0.resid_pre"], hidden[0])
    for layer in range(n - 1):
        torch.testing.assert_close(states[f"blocks.{layer}.resid_post"], hidden[layer + 1])
    torch.testing.assert_close(states["ln_final"], hidden[n])  # transformers 5: last entry is after the final norm
    torch.testing.assert_close(states["logits"], reference.logits)  # hooks leave the logits unchanged


def test_hooks_leave_logits_unchanged_and_zero_patch_is_identity(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    plain = forward(loaded.model, batch.input_ids, batch.attention_mask).logits
    d = loaded.adapter.d_model
    with patch(loaded.model, "blocks.1.resid_post", batch.subject_last, delta=torch.zeros(3, d)):
        patched = forward(loaded.model, batch.input_ids, batch.attention_mask).logits
    torch.testing.assert_close(patched, plain)
    with patch(loaded.model, "blocks.1.resid_post", batch.subject_last, delta=torch.ones(3, d)):
        moved = forward(loaded.model, batch.input_ids, batch.attention_mask).logits
    assert not torch.allclose(moved, plain)


def test_left_and_right_padding_give_the_same_subject_states(loaded):
    names = ["blocks.1.resid_post", "blocks.2.resid_post"]
    got = {}
    for side in ("left", "right"):
        batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS, padding_side=side)
        positions = torch.stack([batch.subject_last, batch.prompt_last], dim=1)
        got[side] = capture(loaded.model, names, batch.input_ids, batch.attention_mask, positions=positions)
    single = []
    for template, subject in zip(TEMPLATES, SUBJECTS):
        one = encode(loaded.tokenizer, template, [subject])
        positions = torch.stack([one.subject_last, one.prompt_last], dim=1)
        single.append(capture(loaded.model, names, one.input_ids, one.attention_mask, positions=positions))
    for name in names:
        alone = torch.cat([s[name] for s in single])
        assert got["left"][name].shape == (3, 2, 32)
        torch.testing.assert_close(got["left"][name], alone, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got["right"][name], alone, atol=1e-4, rtol=1e-4)


def test_stop_early_skips_later_blocks(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    calls = []
    handle = loaded.adapter.blocks[2].register_forward_hook(lambda *a: calls.append(1))
    try:
        capture(loaded.model, ["blocks.0.resid_post"], batch.input_ids, batch.attention_mask)
        assert calls == []
        capture(loaded.model, ["blocks.0.resid_post"], batch.input_ids, batch.attention_mask, stop_early=False)
        assert calls == [1]
    finally:
        handle.remove()


def test_sub_module_places(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    names = ["blocks.1.resid_pre", "blocks.1.attn_out", "blocks.1.mlp_hidden", "blocks.1.mlp_out",
             "blocks.1.resid_post"]
    s = capture(loaded.model, names, batch.input_ids, batch.attention_mask, positions=batch.subject_last[:, None])
    assert s["blocks.1.mlp_hidden"].shape == (3, 1, 64)
    if loaded.adapter.model_type not in ("gemma2", "gemma3_text"):  # these norm each branch before adding it
        torch.testing.assert_close(s["blocks.1.resid_pre"] + s["blocks.1.attn_out"] + s["blocks.1.mlp_out"],
                                   s["blocks.1.resid_post"], atol=1e-5, rtol=1e-5)


def test_mlp_pre_is_the_input_of_the_activation(loaded):
    """``blocks.{l}.mlp_pre`` (the gate's place) is what the MLP's activation reads: mlp_hidden = act(pre) in a
    plain MLP (Phi, GPT-2), act(pre) * up_proj x in a gated one (every other family), as ``mlp_gated`` says."""
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    adapter = loaded.adapter
    mlp, act = adapter.place("blocks.1.mlp_out").module, adapter.place("blocks.1.mlp_pre").module
    assert adapter.names().index("blocks.1.mlp_pre") == adapter.names().index("blocks.1.mlp_hidden") - 1
    assert adapter.mlp_gated(1) == (adapter.model_type not in PLAIN_MLP)
    seen = {}
    handle = mlp.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach()))
    try:
        s = capture(loaded.model, ["blocks.1.mlp_pre", "blocks.1.mlp_hidden"], batch.input_ids, batch.attention_mask)
    finally:
        handle.remove()
    pre, hidden = s["blocks.1.mlp_pre"], s["blocks.1.mlp_hidden"]
    assert pre.shape == hidden.shape == (3, batch.input_ids.shape[1], 64)
    expected = act(pre)
    if adapter.mlp_gated(1):
        up = mlp.up_proj(seen["x"]) if hasattr(mlp, "up_proj") else mlp.gate_up_proj(seen["x"]).chunk(2, -1)[1]
        expected = expected * up
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    with patch(loaded.model, "blocks.1.mlp_pre", batch.prompt_last, delta=torch.ones(3, 64)):
        moved = capture(loaded.model, ["blocks.1.mlp_hidden"], batch.input_ids, batch.attention_mask)
    assert not torch.allclose(moved["blocks.1.mlp_hidden"], hidden)
    assert to_lens_name("blocks.1.mlp_pre") == "blocks.1.mlp.hook_pre"


def test_adapter_logits_match_model_logits(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    out = forward(loaded.model, batch.input_ids, batch.attention_mask, output_hidden_states=True)
    last = capture(loaded.model, [f"blocks.{loaded.adapter.n_layers - 1}.resid_post"], batch.input_ids,
                   batch.attention_mask)
    torch.testing.assert_close(loaded.adapter.logits(next(iter(last.values()))), out.logits, atol=1e-4, rtol=1e-4)


def test_subject_location_decodes_to_the_subject(loaded):
    tok = loaded.tokenizer
    batch = encode(tok, TEMPLATES, SUBJECTS, padding_side="left")
    for row, subject in enumerate(SUBJECTS):
        ids = batch.input_ids[row, batch.subject_first[row]:batch.subject_last[row] + 1]
        assert tok.decode(ids).strip() == subject
        assert batch.prompt_last[row] == batch.input_ids.shape[1] - 1


def test_subject_fallback_when_offsets_are_wrong(loaded):
    from llmprobe.model.subjects import locate
    tok = loaded.tokenizer
    enc = tok("The capital of France is", return_offsets_mapping=True, return_special_tokens_mask=True)
    broken = [(0, 0)] * len(enc["input_ids"])  # offsets that point nowhere, as with some Llama-3 tokenizers
    first, last, how = locate(tok, enc["input_ids"], broken, enc["special_tokens_mask"], "France", (15, 21))
    assert how == "subsequence" and tok.decode(enc["input_ids"][first:last + 1]).strip() == "France"


def test_bad_names_and_missing_subjects_give_clear_errors(loaded):
    batch = encode(loaded.tokenizer, TEMPLATES, SUBJECTS)
    with pytest.raises(KeyError, match="out of range"):
        capture(loaded.model, ["blocks.99.resid_post"], batch.input_ids)
    with pytest.raises(KeyError, match="unknown hook name"):
        capture(loaded.model, ["blocks.0.nonsense"], batch.input_ids)
    with pytest.raises(ValueError, match="subject slot"):
        encode(loaded.tokenizer, "no slot here", ["France"])


def test_subject_not_in_prompt_names_it(loaded):
    from llmprobe.model.subjects import locate
    tok = loaded.tokenizer
    enc = tok("The capital of France is", return_offsets_mapping=True, return_special_tokens_mask=True)
    with pytest.raises(SubjectNotFoundError, match="Japan"):
        locate(tok, enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"], "Japan", (15, 20))


def test_unknown_structure_lists_supported_types():
    with pytest.raises(AdapterError, match="qwen2"):
        ModelAdapter(torch.nn.Linear(2, 2))


def test_missing_model_offline_fails_at_once(monkeypatch):
    import time
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="not-a-real/model-xyz.*Hugging Face cache"):
        load_model("not-a-real/model-xyz", device="cpu")
    assert time.perf_counter() - start < 5


def test_weights_hash_covers_the_loaded_gguf_file_only(tmp_path):
    import hashlib

    from llmprobe.model.loading import weights_hash

    (tmp_path / "a.gguf").write_bytes(b"weights a")
    (tmp_path / "b.gguf").write_bytes(b"weights b")
    assert weights_hash(tmp_path, "a.gguf") == "sha256:" + hashlib.sha256(b"weights a").hexdigest()
    assert weights_hash(tmp_path) == "sha256:" + hashlib.sha256(b"weights aweights b").hexdigest()
    assert weights_hash(tmp_path, "missing.gguf") is None and weights_hash(tmp_path / "nothing") is None
