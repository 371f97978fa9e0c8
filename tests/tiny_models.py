"""Tiny random-init models of every supported family, with an offline byte-level BPE tokenizer.

Each is saved to a folder with ``save_pretrained`` so tests go through the real loading code.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

D, LAYERS, HEADS, FF = 32, 3, 4, 64
_SHARED = dict(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF,
               max_position_embeddings=128)

CONFIGS = {
    "qwen2": lambda v: transformers.Qwen2Config(vocab_size=v, num_key_value_heads=2, **_SHARED),
    "qwen3": lambda v: transformers.Qwen3Config(vocab_size=v, num_key_value_heads=2, head_dim=8, **_SHARED),
    "llama": lambda v: transformers.LlamaConfig(vocab_size=v, num_key_value_heads=2, **_SHARED),
    "mistral": lambda v: transformers.MistralConfig(vocab_size=v, num_key_value_heads=2, **_SHARED),
    "phi": lambda v: transformers.PhiConfig(vocab_size=v, **_SHARED),
    "phi3": lambda v: transformers.Phi3Config(vocab_size=v, pad_token_id=0, **_SHARED),
    "gemma": lambda v: transformers.GemmaConfig(vocab_size=v, head_dim=8, num_key_value_heads=1, **_SHARED),
    "gemma2": lambda v: transformers.Gemma2Config(vocab_size=v, head_dim=8, num_key_value_heads=2, **_SHARED),
    "gemma3_text": lambda v: transformers.Gemma3TextConfig(vocab_size=v, head_dim=8, num_key_value_heads=2,
                                                           **_SHARED),
    "gpt2": lambda v: transformers.GPT2Config(vocab_size=v, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_inner=FF,
                                              n_positions=128),
}
FAMILIES = list(CONFIGS)
# ten made-up subjects, none in the tokenizer's corpus: facts no tiny model can know from its training
SUBJECTS10 = ["Kalomi", "Neruta", "Vozika", "Mitalo", "Rukane", "Tazimo", "Lavoni", "Suketa", "Pamiro", "Zunela"]


def write_capital_relation(path: Path) -> str:
    """A relation file at ``path``: "capital" over :data:`SUBJECTS10`, objects Paris, Tokyo, Rome in turn, one
    template and a neutral one; returns its path as a string."""
    path.write_text(json.dumps({"name": "capital", "templates": ["The capital of {} is"], "neutral_templates": ["{}"],
                                "facts": [{"subject": s, "object": ["Paris", "Tokyo", "Rome"][i % 3]}
                                          for i, s in enumerate(SUBJECTS10)]}))
    return str(path)

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Brazil is Brasilia.",
    "Germany, Italy, Spain, Portugal, United States, United Kingdom, South Korea, New Zealand, Egypt.",
    "The official language of Mexico is Spanish. People in Kenya pay with the Kenyan shilling.",
    "Albert Einstein was a physicist. Marie Curie was a chemist. The Eiffel Tower is in Paris.",
    "Tell me about the country. It is located in Europe, Asia, Africa, Oceania or the Americas.",
]


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(with_bos: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~400 tokens) trained offline on a few sentences; BOS prepended if asked."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """Build a random-init model of ``family`` and save it with its tokenizer to ``folder``."""
    tokenizer = tiny_tokenizer(with_bos=family != "gpt2")
    config = CONFIGS[family](len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
