"""The model families llmprobe supports, where its names live in each, and what the test suite checks for each
(``llmprobe models``). ``tests/test_config.py`` keeps this table true: every family has a tiny model in
``tests/tiny_models.py`` whose adapter resolves to the modules listed here, and every test named here exists and
builds the families it claims."""
from __future__ import annotations

import textwrap

from llmprobe.model.adapters import SUPPORTED_TYPES

ALL = "every family"     # a check run on a tiny model of every family (tests parametrized over FAMILIES)

# module (and side) behind each hook name; {l} = block index
_LAYERS = {"blocks.{l}.resid_pre": "model.layers.{l} (input)", "blocks.{l}.resid_post": "model.layers.{l} (output)",
           "blocks.{l}.attn_out": "model.layers.{l}.self_attn (output)",
           "blocks.{l}.mlp_out": "model.layers.{l}.mlp (output)",
           "blocks.{l}.mlp_hidden": "model.layers.{l}.mlp.down_proj (input)", "ln_final": "model.norm (output)"}
_PHI = {**_LAYERS, "blocks.{l}.mlp_hidden": "model.layers.{l}.mlp.fc2 (input)",
        "ln_final": "model.final_layernorm (output)"}
_GPT2 = {"blocks.{l}.resid_pre": "transformer.h.{l} (input)", "blocks.{l}.resid_post": "transformer.h.{l} (output)",
         "blocks.{l}.attn_out": "transformer.h.{l}.attn (output)", "blocks.{l}.mlp_out": "transformer.h.{l}.mlp (output)",
         "blocks.{l}.mlp_hidden": "transformer.h.{l}.mlp.c_proj (input)", "ln_final": "transformer.ln_f (output)"}

# model_type -> (architecture, places); gemma3 (the multimodal config) is supported through its text model
FAMILIES = {
    "llama": ("LlamaForCausalLM", _LAYERS),
    "qwen2": ("Qwen2ForCausalLM", _LAYERS),
    "qwen3": ("Qwen3ForCausalLM", _LAYERS),
    "mistral": ("MistralForCausalLM", _LAYERS),
    "phi": ("PhiForCausalLM", _PHI),
    "phi3": ("Phi3ForCausalLM", _LAYERS),
    "gemma": ("GemmaForCausalLM", _LAYERS),
    "gemma2": ("Gemma2ForCausalLM", _LAYERS),
    "gemma3_text": ("Gemma3ForCausalLM", _LAYERS),
    "gpt2": ("GPT2LMHeadModel", _GPT2),
}
# model types whose MLP is plain (act(fc1 x): two matrices), not gated (act(gate_proj x) * up_proj x: three): what
# ``ModelAdapter.mlp_gated`` finds in the model's modules, for a config without weights (the plan's shapes);
# tests/test_capture.py checks that the two agree on every family
PLAIN_MLP = ("gpt2", "phi")
UNTESTED = {"gemma3": "the multimodal Gemma 3 config: its text model (gemma3_text) is what the tests build"}

# (what is checked, the test that checks it, the families it builds)
TESTED = (
    ("loads from safetensors, described with a weights hash", "tests/test_capture.py::test_load_describes_the_model",
     ALL),
    ("captured states equal output_hidden_states", "tests/test_capture.py::test_captured_states_equal_output_hidden_states",
     ALL),
    ("hooks leave logits unchanged; a zero patch is the identity",
     "tests/test_capture.py::test_hooks_leave_logits_unchanged_and_zero_patch_is_identity", ALL),
    ("left and right padding give the same states",
     "tests/test_capture.py::test_left_and_right_padding_give_the_same_subject_states", ALL),
    ("attn_out, mlp_out, mlp_hidden places", "tests/test_capture.py::test_sub_module_places", ALL),
    ("adapter logits (final norm + LM head) equal the model's",
     "tests/test_capture.py::test_adapter_logits_match_model_logits", ALL),
    ("subject tokens located in prompts", "tests/test_capture.py::test_subject_location_decodes_to_the_subject", ALL),
    ("batched Jacobians equal per-prompt autograd", "tests/test_lre.py::test_batched_jacobian_equals_per_prompt_autograd_jacobian",
     ("llama",)),
    ("batched Jacobians equal per-prompt Jacobians", "tests/test_lre.py::test_batched_jacobian_other_families",
     ("qwen3", "gemma2")),
    ("Jacobians equal central finite differences (float64)",
     "tests/test_lre.py::test_jacobian_matches_central_finite_differences", ("gpt2",)),
    ("probe: known facts and report.json", "tests/test_probe.py::test_probe_writes_report", ("llama",)),
    ("analyses (LRE, ridge, superposition) end to end",
     "tests/test_analyses.py::test_result_has_the_documented_keys_and_typed_metrics", ("llama",)),
    ("neutral templates without a BOS token",
     "tests/test_analyses.py::test_neutral_templates_that_open_with_the_subject_are_dropped_without_a_bos_token",
     ("gpt2",)),
    ("run (probe + matched controls) and report export", "tests/test_run.py::test_run_end_to_end_on_tiny_model_and_compare",
     ("qwen2",)),
    ("report.json matches docs/report_schema.md", "tests/test_schema.py::test_every_key_of_the_report_is_documented",
     ("llama",)),
    ("rerun reproduces a report from its recorded settings",
     "tests/test_config.py::test_rerun_reproduces_the_numbers_and_refuses_other_weights", ("llama",)),
)
EMBEDDED = ("SmolLM2-135M-Instruct", "llama", (
    ("loads offline from the embedded weights", "tests/test_embedded.py::test_embedded_default_loads_from_cached_safetensors"),
    ("knows famous capitals", "tests/test_embedded.py::test_embedded_knows_famous_capitals"),
    ("captured states equal output_hidden_states", "tests/test_embedded.py::test_embedded_capture_matches_hidden_states"),
))


def families() -> list[dict]:
    """One entry per supported model_type: {"model_type", "architecture", "places", "tested": [{"check",
    "test"}], "note"} (``architecture`` and ``places`` null for a type without a tiny model)."""
    rows = []
    for model_type in sorted(set(SUPPORTED_TYPES) | set(FAMILIES)):
        architecture, places = FAMILIES.get(model_type, (None, None))
        tested = [{"check": check, "test": test} for check, test, which in TESTED
                  if which == ALL or model_type in which] if model_type in FAMILIES else []
        rows.append({"model_type": model_type, "architecture": architecture, "places": places, "tested": tested,
                     "note": UNTESTED.get(model_type)})
    return rows


def embedded() -> dict:
    """The embedded default model: {"name", "model_type", "tested": [{"check", "test"}]}."""
    name, model_type, tested = EMBEDDED
    return {"name": name, "model_type": model_type, "tested": [{"check": c, "test": t} for c, t in tested]}


def models_text(width: int = 100) -> str:
    """``llmprobe models`` as plain text, each line wrapped at ``width`` columns (continuations indented)."""
    lines = [f"default model: {embedded()['name']} (embedded, {embedded()['model_type']}); tested: "
             + "; ".join(t["check"] for t in embedded()["tested"]), ""]
    for row in families():
        lines.append(f"{row['model_type']}" + (f" ({row['architecture']})" if row["architecture"] else ""))
        if row["note"]:
            lines.append(f"  note: {row['note']}")
        if row["places"]:
            lines.append("  places: " + ", ".join(f"{name} = {module}" for name, module in row["places"].items()))
        if row["tested"]:
            lines.append("  tested: " + "; ".join(t["check"] for t in row["tested"]))
    lines.append("")
    lines.append("Other causal LMs may load too (llmprobe/adapters.py finds the blocks by structure: one ModuleList "
                 "of num_hidden_layers blocks), untested.")
    indent = "    "
    return "\n".join(textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) if line else ""
                     for line in lines)


__all__ = ["FAMILIES", "TESTED", "families", "embedded", "models_text"]
