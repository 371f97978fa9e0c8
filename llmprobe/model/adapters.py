"""Architecture adapters: one naming scheme for places inside any causal LM.

Names (TransformerLens style, whatever the architecture underneath):

* ``blocks.{l}.resid_pre``  -- residual stream entering block ``l``            [batch, seq, d_model]
* ``blocks.{l}.resid_post`` -- residual stream leaving block ``l``             [batch, seq, d_model]
* ``blocks.{l}.attn_out``   -- output of block ``l``'s attention               [batch, seq, d_model]
* ``blocks.{l}.mlp_out``    -- output of block ``l``'s MLP                     [batch, seq, d_model]
* ``blocks.{l}.mlp_pre``    -- the MLP's pre-activation: the input of its activation function
                              (``gate_proj x`` of a gated MLP, ``fc1 x`` / ``c_fc x`` of a plain one) [batch, seq, d_mlp]
* ``blocks.{l}.mlp_hidden`` -- MLP activations entering the down projection    [batch, seq, d_mlp]
* ``ln_final``              -- after the final norm                            [batch, seq, d_model]

The MLP's *gate* (``llmprobe.analyses.selector``): a gated MLP (``mlp_gated``: SwiGLU in Llama, Qwen2/3, Mistral
and Phi-3, GeGLU in Gemma 1-3) computes ``mlp_hidden = act(mlp_pre) * up_proj x``: its gate is ``act(mlp_pre)``. A
plain MLP (GELU in Phi-1/2 and GPT-2) computes ``mlp_hidden = act(p) = p * (act(p) / p)`` with ``p = mlp_pre``: its
gate is ``act(p) / p`` (the ReLU on/off mask of the synthetic model, Phi(p) for an exact GELU).

TransformerLens names are accepted wherever a name is (``blocks.{l}.hook_resid_post`` etc.;
:func:`to_lens_name` and :func:`from_lens_name` translate, ``LENS_NAMES`` is the table).

Blocks are found by structure (the ``nn.ModuleList`` holding ``num_hidden_layers`` blocks), so families outside
``SUPPORTED_TYPES`` work when they follow the usual layout. A model that defines ``hook_points()`` (the synthetic
model) is addressed through that dict instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_TYPES = (
    "qwen2", "qwen3", "llama", "phi", "phi3", "gpt2", "gemma", "gemma2", "gemma3", "gemma3_text", "mistral",
)
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_norm")
_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn")
_DOWN_NAMES = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2")
_ACT_NAMES = ("act_fn", "activation_fn", "act")
_GATE_NAMES = ("gate_proj", "gate_up_proj")     # a gated MLP has one of these beside its activation
_NAME = re.compile(r"^blocks\.(\d+)\.(resid_pre|resid_post|attn_out|mlp_out|mlp_pre|mlp_hidden)$")
# llmprobe place -> TransformerLens hook (TransformerBridge's names; HookedTransformer has all but ln_final.hook_out).
# resid_mid exists in synthetic models only (their hook_points()).
LENS_NAMES = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
              "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "mlp_pre": "mlp.hook_pre",
              "mlp_hidden": "mlp.hook_post"}
LENS_FINAL = "ln_final.hook_out"      # the final norm's output (hook_normalized is before the norm's weight)
_PLACE_NAME = re.compile(r"^blocks\.(\d+)\.(" + "|".join(LENS_NAMES) + r")$")
_LENS_NAME = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(v) for v in LENS_NAMES.values()) + r")$")


def to_lens_name(name: str) -> str:
    """llmprobe hook name -> TransformerLens hook name: ``blocks.3.resid_post`` -> ``blocks.3.hook_resid_post``."""
    if name == "ln_final":
        return LENS_FINAL
    match = _PLACE_NAME.match(name)
    if not match:
        raise KeyError(f"{name!r} is not an llmprobe hook name (blocks.{{l}}.<{'|'.join(LENS_NAMES)}> or ln_final), "
                       f"so it has no TransformerLens counterpart")
    return f"blocks.{match.group(1)}.{LENS_NAMES[match.group(2)]}"


def from_lens_name(name: str) -> str:
    """TransformerLens hook name -> llmprobe hook name: ``blocks.3.hook_resid_post`` -> ``blocks.3.resid_post``.

    Only the places llmprobe defines translate (see ``LENS_NAMES``); others (attention patterns,
    ``hook_mlp_in``, ...) raise a KeyError that says so."""
    if name == LENS_FINAL:
        return "ln_final"
    match = _LENS_NAME.match(name)
    if not match:
        known = ", ".join(f"blocks.{{l}}.{v}" for v in LENS_NAMES.values())
        raise KeyError(f"TransformerLens hook {name!r} has no llmprobe counterpart; llmprobe's places are "
                       f"{known} and {LENS_FINAL}")
    kind = next(k for k, v in LENS_NAMES.items() if v == match.group(2))
    return f"blocks.{match.group(1)}.{kind}"


def is_lens_name(name: str) -> bool:
    """Whether ``name`` is in TransformerLens' style (a ``hook_`` part), not llmprobe's."""
    return any(part.startswith("hook_") for part in name.split("."))


class AdapterError(ValueError):
    """The model's structure could not be mapped onto llmprobe's names."""


@dataclass
class Place:
    """Where a name lives: the module and whether to read its input (pre-hook) or its output."""

    module: nn.Module
    read_input: bool = False


class ModelAdapter:
    """Maps llmprobe hook names onto the modules of one model.

    Attributes: ``model``, ``model_type``, ``blocks`` (the decoder layers), ``embed``, ``final_norm`` (or None),
    ``lm_head``, ``n_layers``, ``d_model``.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        config = getattr(model, "config", None)
        self.model_type = getattr(config, "model_type", type(model).__name__)
        self._points = model.hook_points() if hasattr(model, "hook_points") else None
        if self._points is not None:
            self.n_layers = 1 + max(int(m.group(1)) for m in map(_NAME.match, self._points) if m)
            self.blocks = None
            self.embed = self.final_norm = self.lm_head = None
            self.d_model = getattr(config, "d_model", None)
            return
        self.blocks = _find_blocks(model, self.model_type)
        self.n_layers = len(self.blocks)
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.final_norm = _find_final_norm(model, self.blocks)
        self.d_model = self.embed.weight.shape[1]

    def names(self) -> list[str]:
        """Every hook name this model offers, in forward order."""
        if self._points is not None:
            return list(self._points)
        per_block = ("resid_pre", "attn_out", "mlp_pre", "mlp_hidden", "mlp_out", "resid_post")
        names = [f"blocks.{l}.{p}" for l in range(self.n_layers) for p in per_block]
        return names + (["ln_final"] if self.final_norm is not None else [])

    def place(self, name: str) -> Place:
        """The module (and side of it) that holds ``name`` (llmprobe's or TransformerLens' name); a clear error for
        unknown names."""
        if is_lens_name(name):
            name = from_lens_name(name)
        if self._points is not None:
            if name not in self._points:
                raise KeyError(f"unknown hook name {name!r}; this model offers {list(self._points)}")
            return Place(self._points[name])
        if name == "ln_final":
            if self.final_norm is None:
                raise KeyError(f"{self.model_type}: no final norm found, so 'ln_final' is not available")
            return Place(self.final_norm)
        match = _NAME.match(name)
        if not match:
            raise KeyError(f"unknown hook name {name!r}; expected blocks.{{l}}.<resid_pre|resid_post|attn_out|"
                           f"mlp_out|mlp_pre|mlp_hidden> or ln_final")
        layer, kind = int(match.group(1)), match.group(2)
        if not 0 <= layer < self.n_layers:
            raise KeyError(f"layer {layer} out of range: {self.model_type} has {self.n_layers} blocks")
        block = self.blocks[layer]
        if kind == "resid_pre":
            return Place(block, read_input=True)
        if kind == "resid_post":
            return Place(block)
        if kind == "attn_out":
            return Place(_child(block, _ATTN_NAMES, name))
        mlp = _child(block, _MLP_NAMES, name)
        if kind == "mlp_out":
            return Place(mlp)
        if kind == "mlp_pre":
            return Place(_child(mlp, _ACT_NAMES, name), read_input=True)
        return Place(_child(mlp, _DOWN_NAMES, name), read_input=True)

    def mlp_gated(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is gated (``act(gate_proj x) * up_proj x``: it has a ``gate_proj`` or a
        fused ``gate_up_proj``) rather than plain (``act(fc1 x)``); see the module docstring for each one's gate."""
        if self._points is not None:
            return False
        mlp = _child(self.blocks[self.layer_index(layer)], _MLP_NAMES, f"blocks.{layer}.mlp_pre")
        return any(isinstance(getattr(mlp, attr, None), nn.Module) for attr in _GATE_NAMES)

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ Gemma's soft-capping): residual [..., d_model] -> logits [..., vocab]."""
        if self.lm_head is None:
            return self.model.unembed(resid)
        hidden = self.final_norm(resid) if self.final_norm is not None else resid
        logits = self.lm_head(hidden)
        cap = getattr(getattr(self.model, "config", None), "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def layer_index(self, spec: str | int) -> int:
        """Resolve a layer given as an int or a string like "-1" to 0..n_layers-1."""
        layer = int(spec)
        if layer < 0:
            layer += self.n_layers
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {spec} out of range: the model has {self.n_layers} layers")
        return layer


def _find_blocks(model: nn.Module, model_type: str) -> nn.ModuleList:
    config = getattr(model, "config", None)
    n_layers = None
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        n_layers = n_layers or getattr(getattr(config, "get_text_config", lambda: config)(), attr, None)
    candidates = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (n_layers is None or len(module) == n_layers)
    ]
    if not candidates:
        raise AdapterError(
            f"cannot find the decoder blocks of model type {model_type!r} (no ModuleList of {n_layers} layers). "
            f"Supported types: {', '.join(SUPPORTED_TYPES)}; others work when their blocks sit in one ModuleList.")
    # The decoder stack is the shallowest such list (vision towers or nested lists sit deeper).
    return min(candidates, key=lambda item: item[0].count("."))[1]


def _find_final_norm(model: nn.Module, blocks: nn.ModuleList) -> nn.Module | None:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _NORM_NAMES and not any(module is m for m in blocks.modules()):
            return module
    return None


def _child(parent: nn.Module, names: tuple[str, ...], wanted: str) -> nn.Module:
    for attr in names:
        child = getattr(parent, attr, None)
        if isinstance(child, nn.Module):
            return child
    raise AdapterError(f"cannot place {wanted!r}: {type(parent).__name__} has none of the sub-modules {names}")
