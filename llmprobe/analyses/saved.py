"""Fitted decoders saved beside a report: ``decoders.safetensors`` (float64 tensors) and ``decoders.json`` (one
entry per relation and decoder: layer, beta, rank, edit rank, places, tensor keys, the model's identity); and one
decoder shared on its own (``SavedDecoder.save`` / ``from_pretrained`` / ``push_to_hub``): a folder, or a Hugging
Face hub repo, holding ``decoder.safetensors``, its card ``decoder.json`` and a README.md (docs/decoders.md).

    decoder = llmprobe.load_decoder("runs/smollm2", "country_capital")
    o = decoder.apply(h, layer=decoder.layer)          # h [n, d_in] -> o [n, d_out] = beta W h + b
    ids = decoder.predict(lm, ["France", "Japan"])     # top-1 token ids [n], through the model's own head
"""
from __future__ import annotations

import html
import json
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file, save

from llmprobe import __version__
from llmprobe.analyses.settings import H_PLACE, O_PLACE
from llmprobe.checks import read_json
from llmprobe.geometry import LinearRelationOperator
from llmprobe.io import write_bytes, write_json, write_text
from llmprobe.model.engine import logits_fn, relation_states
from llmprobe.model.loading import hub_offline

DECODERS_JSON = "decoders.json"
DECODERS_TENSORS = "decoders.safetensors"
DECODER_JSON = "decoder.json"                   # one shared decoder: its card,
DECODER_TENSORS = "decoder.safetensors"         # its tensors
DECODER_README = "README.md"                    # and its model card for people
DECODER_FORMAT, DECODER_FORMAT_VERSION = "llmprobe-decoder", 1
HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")      # a hub repo id: "user/name"


@dataclass(repr=False)
class SavedDecoder:
    """A fitted relation decoder: loaded from a report folder (:func:`load_decoder`), a decoder folder or hub repo
    (:meth:`from_pretrained`), or made from one fitted by hand (:meth:`from_operator`).

    ``operator``: o = beta W h + b (W [d_out, d_in], b [d_out]), exactly as the analyses applied it;
    ``info``: its card (relation, kind, layer, beta, rank, edit_rank, places, model identity, template, metrics);
    ``J``: the untruncated mean Jacobian [d_out, d_in] when W is rank-truncated (the edits invert J);
    ``factors``: {"W" or "J": (U [d_out, r], S [r], Vh [r, d_in])} where they were saved as factors (saved so
    again)."""

    operator: LinearRelationOperator
    info: dict
    J: torch.Tensor | None = None
    factors: dict = field(default_factory=dict)

    @property
    def layer(self) -> int:
        """The block whose output it reads: h = blocks.{layer}.resid_post at the subject's last token."""
        return self.info["layer"]

    @property
    def relation(self) -> str:
        return self.info["relation"]

    @property
    def kind(self) -> str:
        """``lre`` or ``ridge`` (or a name given to :meth:`from_operator`)."""
        return self.info["kind"]

    def __repr__(self) -> str:
        model = (self.info.get("model") or {}).get("name")
        return (f"SavedDecoder({self.relation!r}, kind={self.kind!r}, layer={self.layer}, d_in={self.operator.d_in} "
                f"-> d_out={self.operator.d_out}, beta={self.operator.beta:g}, rank={self.operator.rank}, "
                f"model={model!r})")

    def apply(self, h, layer: int | None = None) -> torch.Tensor:
        """h [n, d_in] (subject states at ``info["h"]``) -> o [n, d_out] = beta W h + b. ``layer``: the layer h was
        captured at; ValueError when it is not the decoder's (a layer-6 decoder read on layer-12 states)."""
        if layer is not None and layer != self.layer:
            raise ValueError(f"the {self.kind} decoder of {self.relation!r} reads the states of layer {self.layer} "
                             f"(blocks.{self.layer}.resid_post), but h is of layer {layer}: capture layer "
                             f"{self.layer}, or let decoder.predict(lm, subjects) capture them")
        return self.operator(h)

    def predict(self, lm, subjects, template: str | None = None, batch_size: int = 32) -> torch.Tensor:
        """Top-1 next-token ids LongTensor [n] read through the decoder: h at the decoder's own layer (the last
        token of each subject in ``template``, by default the template it was fitted with), o = beta W h + b in
        float64, then the model's final norm and LM head. ``lm``: a LoadedModel (``llmprobe.load_model``);
        ``lm.tokenizer.batch_decode(ids[:, None])`` gives the tokens."""
        template = self.info.get("template") if template is None else template
        if template is None:
            raise ValueError(f"the {self.kind} decoder of {self.relation!r} has no saved template (it was not "
                             f"fitted on one prompt): pass template='... {{}} ...' with a {{}} subject slot")
        self._check_model(lm)
        subjects = [subjects] if isinstance(subjects, str) else list(subjects)
        states = relation_states(lm, template, subjects, [self.layer], batch_size=batch_size)
        o = self.apply(states.H[self.layer].double(), layer=self.layer)
        return logits_fn(lm)(o).argmax(-1)

    def _check_model(self, lm) -> None:
        """ValueError when ``lm`` has no block at the decoder's layer or another width; a warning when its weights
        are not those the decoder was fitted on."""
        n_layers, d_model = lm.adapter.n_layers, lm.adapter.d_model
        if not 0 <= self.layer < n_layers or d_model != self.operator.d_in:
            raise ValueError(f"the {self.kind} decoder of {self.relation!r} reads layer {self.layer} of width "
                             f"{self.operator.d_in}, but the model has {n_layers} layers of width {d_model}")
        saved = (self.info.get("model") or {}).get("weights")
        measured = weights_id(lm.info) if lm.info.get("weights_hash") or lm.info.get("name") else None
        if saved and measured and saved != measured:
            warnings.warn(f"the {self.kind} decoder of {self.relation!r} was fitted on weights {saved}, and is read "
                          f"on weights {measured}", UserWarning, stacklevel=3)

    def edit_delta(self, o_source, o_target) -> torch.Tensor:
        """The causal edit delta_h [n, d_in] = W_k^+ (o_target - o_source), k = the edit rank chosen on validation
        (full rank when none was chosen: the ridge decoder, or a layer without causality edits), inverting J where
        W is truncated: the edit the analyses made."""
        inverted = self.operator if self.J is None else LinearRelationOperator(self.J, self.operator.b)
        return inverted.edit_delta(o_source, o_target, self.info.get("edit_rank"))

    # ------------------------------------------------------------------------------------------- sharing
    def save(self, folder: str | Path, overwrite: bool = False) -> list[Path]:
        """Write this decoder alone to ``folder``: ``decoder.safetensors`` (float64 W, b and J; a low-rank one as
        its factors U, S, Vh when they take less room, as in a run's decoders), ``decoder.json`` (its card: format
        version, relation, kind, layer, beta, rank, edit rank, places, d_in, d_out, the model's identity, the
        template, metrics, llmprobe's version) and README.md, each atomically. A folder holding anything already is
        refused unless ``overwrite`` (then these three files are replaced and nothing else is touched)."""
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file: save a decoder into a folder")
        held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if held and not overwrite:
            raise FileExistsError(f"{folder} is not empty (it holds {', '.join(held[:5])}"
                                  f"{', ...' if len(held) > 5 else ''}): save the decoder into a new or empty "
                                  f"folder, or pass overwrite=True to replace its {DECODER_JSON}, "
                                  f"{DECODER_TENSORS} and {DECODER_README}")
        fit = {"W": self.operator.W, "b": self.operator.b, "J": self.J, "W_factors": self.factors.get("W"),
               "J_factors": self.factors.get("J"), "layer": self.layer, "beta": float(self.operator.beta),
               "rank": self.operator.rank, **{k: self.info.get(k) for k in ("edit_rank", "alpha", "refit",
                                                                             "val_faithfulness")}}
        keys, tensors = _tensors_of(fit, "decoder")
        card = {"format": DECODER_FORMAT, "format_version": DECODER_FORMAT_VERSION,
                **_entry(self.relation, self.kind, fit), "tensors": keys, "model": self.info.get("model"),
                "template": self.info.get("template"), "metrics": self.info.get("metrics") or {},
                "llmprobe_version": __version__}
        return [write_bytes(folder / DECODER_TENSORS, save(tensors)), write_json(folder / DECODER_JSON, card),
                write_text(folder / DECODER_README, model_card(card))]

    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path, relation: str | None = None, kind: str | None = None,
                        revision: str | None = None, cache_dir: str | Path | None = None,
                        token: str | None = None) -> "SavedDecoder":
        """A decoder from a folder written by :meth:`save`; from a run's output folder (``relation`` required,
        ``kind`` ``lre`` by default, as :func:`load_decoder`); or from a Hugging Face hub repo ``"user/name"`` (a
        folder of that path that exists comes first) fetched with ``huggingface_hub.snapshot_download`` at
        ``revision`` (its three files only; ``cache_dir``: the hub cache, default ``HF_HUB_CACHE``). Offline
        (``HF_HUB_OFFLINE`` set, read at the call) the repo is read from the cache; not cached there, a
        FileNotFoundError at once. For a decoder folder, ``relation`` and ``kind``, when given, are checked
        against it. Tensors are read with safetensors (never unpickled) and their shapes checked against the
        card."""
        path = Path(path_or_repo)
        if path.exists():
            if revision is not None:
                raise ValueError(f"revision={revision!r} is for hub repos; {path} is a local folder")
            return _from_folder(path, relation, kind)
        name = str(path_or_repo)
        if not HUB_REPO.fullmatch(name):
            raise FileNotFoundError(f"no folder {name}, and {name!r} is not a hub repo id ('user/name')")
        return _from_folder(_hub_snapshot(name, revision, cache_dir, token), relation, kind)

    @classmethod
    def from_operator(cls, operator, *, layer: int, relation: str, model, kind: str | None = None,
                      template: str | None = None, J: torch.Tensor | None = None, edit_rank: int | None = None,
                      metrics: dict | None = None) -> "SavedDecoder":
        """A decoder fitted by hand, ready to :meth:`save`, :meth:`push_to_hub` or :meth:`predict`. ``operator``:
        a ``LinearRelationOperator`` or a fitted ``LinearRelationDecoder`` / ``RidgeDecoder`` (its
        ``operator_``); ``layer``: the block whose output h it reads (blocks.{layer}.resid_post at the subject's
        last token); ``model``: the LoadedModel it was fitted on (or its ``info`` dict); ``kind``: default the
        estimator's (``lre``/``ridge``) else ``lre``; ``template``: the prompt with a {} subject slot it was
        fitted on; ``J`` [d_out, d_in]: the untruncated Jacobian the edits invert, if W is truncated."""
        op = getattr(operator, "operator_", operator)
        if not isinstance(op, LinearRelationOperator):
            raise TypeError(f"operator must be a LinearRelationOperator or a fitted LinearRelationDecoder / "
                            f"RidgeDecoder, got {type(operator).__name__}")
        info = model.info if hasattr(model, "adapter") else model
        if not isinstance(info, dict):
            raise TypeError(f"model must be a LoadedModel or its info dict, got {type(model).__name__}")
        n_layers, d_model = info.get("n_layers"), info.get("d_model")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0 or (n_layers and layer >= n_layers):
            raise ValueError(f"layer must be a block of the model (0 .. {(n_layers or 0) - 1}), got {layer!r}")
        if d_model and d_model != op.d_in:
            raise ValueError(f"the operator reads h of width {op.d_in}, but the model's width is {d_model}")
        if not isinstance(relation, str) or not relation:
            raise ValueError(f"relation must be a non-empty name, got {relation!r}")
        _check_template(template, "template")
        kind = kind or op.metadata.get("estimator") or "lre"
        W, b = (t.detach().to("cpu", torch.float64) for t in (op.W, op.b))
        J = None if J is None else J.detach().to("cpu", torch.float64)
        if J is not None and J.shape != W.shape:
            raise ValueError(f"J must be [d_out, d_in] = {list(W.shape)} like W, got {list(J.shape)}")
        fit = {"W": W, "b": b, "layer": layer, "beta": float(op.beta), "rank": op.rank, "edit_rank": edit_rank,
               "alpha": op.metadata.get("alpha")}
        identity = {"name": info.get("name"), "revision": info.get("revision"),
                    "weights": info.get("weights") or weights_id(info), "architecture": info.get("architecture"),
                    "dtype": info.get("dtype"), "n_layers": n_layers, "d_model": d_model}
        return cls(LinearRelationOperator(W, b, float(op.beta), op.rank),
                   {**_entry(relation, kind, fit), "model": identity, "template": template,
                    "metrics": dict(metrics or {})}, J)

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = False,
                    revision: str | None = None, commit_message: str | None = None):
        """Upload this decoder (:meth:`save`'s three files, written to a temporary folder) to the hub repo
        ``repo_id`` ("user/name"; created if missing, ``private`` then) on branch ``revision`` (default main;
        created if missing) through ``huggingface_hub.HfApi``. Returns the hub's CommitInfo (``.commit_url``).
        Offline (``HF_HUB_OFFLINE`` set) it fails at once."""
        if not HUB_REPO.fullmatch(str(repo_id)):
            raise ValueError(f"repo_id must be a hub repo id 'user/name', got {repo_id!r}")
        if hub_offline() or hub_constants.is_offline_mode():
            raise ConnectionError(f"cannot push to hub repo {repo_id!r}: offline (HF_HUB_OFFLINE is set). Unset "
                                  f"it, or save(folder) now and upload that folder later "
                                  f"(`hf upload {repo_id} FOLDER`)")
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="llmprobe-decoder-") as folder:
            self.save(folder)
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                     commit_message=commit_message or f"llmprobe {self.kind} decoder of "
                                                                      f"{self.relation} at layer {self.layer}")


def weights_id(info: dict) -> str:
    """What names a model's weights in decoders.json, report.json's stage keys and manifest.json: its weights hash,
    else ``name@revision`` (``info``: ``LoadedModel.info``, or report.json's ``model``)."""
    return info.get("weights_hash") or f"{info.get('name')}@{info.get('revision')}"


def save_decoders(out: str | Path, fitted: dict, model: dict) -> list[Path]:
    """Write ``fitted`` ({relation: {kind: fit}}, from ``run_analyses(fitted=...)``) to ``out/decoders.safetensors``
    (float64 tensors) and ``out/decoders.json`` (the entries, ``model``: the model's identity), atomically. A
    low-rank W or J whose factors (``W_factors``: U [d_out, r], S [r], Vh [r, d_in]) take less room is saved as
    them (its ``tensors`` entry lists three keys), e.g. with low-rank Jacobians: ~r x 2d instead of d x d."""
    tensors, entries = {}, []
    for relation, kinds in fitted.items():
        for kind, fit in kinds.items():
            keys, named = _tensors_of(fit, f"decoder{len(entries)}")
            tensors.update(named)
            entries.append({**_entry(relation, kind, fit), "tensors": keys})
    out = Path(out)
    return [write_bytes(out / DECODERS_TENSORS, save(tensors)),
            write_json(out / DECODERS_JSON, {"format": 2, "model": model, "decoders": entries})]


def _tensors_of(fit: dict, prefix: str) -> tuple[dict, dict]:
    """(the ``tensors`` entry {name: key, or [U, S, Vh keys] for a low-rank matrix}, {key: float64 tensor}) of a
    fit's W, b and J; a matrix is saved as its factors (``fit[name + "_factors"]``) when they take less room."""
    keys, tensors = {}, {}
    for name in ("W", "b", "J"):
        if fit.get(name) is None:
            continue
        factors = fit.get(f"{name}_factors")
        if factors is not None and factors[1].numel() * sum(fit[name].shape) < fit[name].numel():
            keys[name] = [f"{prefix}.{name}.{part}" for part in ("U", "S", "Vh")]       # low rank: U S Vh
            parts = factors
        else:
            keys[name], parts = f"{prefix}.{name}", [fit[name]]
        for key, t in zip([keys[name]] if isinstance(keys[name], str) else keys[name], parts):
            tensors[key] = t.detach().to("cpu", torch.float64).contiguous().clone()       # no storage shared
    return keys, tensors


def _entry(relation: str, kind: str, fit: dict) -> dict:
    """A decoder's description (decoders.json's entry, a decoder card's fields) without its tensor keys."""
    return {"relation": relation, "kind": kind, "layer": fit["layer"], "beta": fit["beta"], "rank": fit.get("rank"),
            "edit_rank": fit.get("edit_rank"), "alpha": fit.get("alpha"), "refit": fit.get("refit"),
            "val_faithfulness": fit.get("val_faithfulness"), "h": H_PLACE.replace("{l}", str(fit["layer"])),
            "o": O_PLACE, "d_in": int(fit["W"].shape[1]), "d_out": int(fit["W"].shape[0])}


def read_fits(path: str | Path) -> dict:
    """The decoders saved in folder ``path`` in the form :func:`save_decoders` takes ({relation: {kind: fit}});
    {} when there are none."""
    index, tensors = _read_decoders(Path(path), missing_ok=True)
    fits: dict = {}
    for entry in (index or {}).get("decoders", []):
        fits.setdefault(entry["relation"], {})[entry["kind"]] = _fit(entry, tensors)
    return fits


def load_decoder(path: str | Path, relation: str, kind: str = "lre") -> SavedDecoder:
    """The ``kind`` decoder (``lre`` or ``ridge``) of ``relation`` saved in report folder ``path``. Clear errors
    when the folder has no decoders or not this one (the message lists those it has)."""
    index, tensors = _read_decoders(Path(path))
    for entry in index["decoders"]:
        if entry["relation"] == relation and entry["kind"] == kind:
            return _saved({**entry, **_report_details(_read_report(Path(path)), entry, index.get("model"))},
                          _fit(entry, tensors))
    have = ", ".join(f"{e['relation']} ({e['kind']})" for e in index["decoders"]) or "none"
    raise KeyError(f"no {kind} decoder of relation {relation!r} in {Path(path) / DECODERS_JSON}; it has: {have}")


def _read_decoders(folder: Path, missing_ok: bool = False) -> tuple[dict | None, dict]:
    index_file, tensor_file = folder / DECODERS_JSON, folder / DECODERS_TENSORS
    if not index_file.is_file() or not tensor_file.is_file():
        if missing_ok:
            return None, {}
        raise FileNotFoundError(f"no saved decoders in {folder} (need {DECODERS_JSON} and {DECODERS_TENSORS}, "
                                f"written by llmprobe probe/run with the lre or ridge analyses)")
    index = read_json(index_file, ValueError, "; not an llmprobe decoders index", encoding="utf-8")
    if not isinstance(index, dict) or not isinstance(index.get("decoders"), list):
        raise ValueError(f"{index_file}: not an llmprobe decoders index (no 'decoders' list)")
    for i, entry in enumerate(index["decoders"]):
        _check_entry(entry, f"{index_file}: decoders[{i}]")
    _check_same_weights(index, index_file, folder / "report.json")
    tensors = _load_tensors(tensor_file)
    for i, entry in enumerate(index["decoders"]):
        _check_shapes(entry, tensors, f"{tensor_file} (decoders[{i}] of {DECODERS_JSON})")
    return index, tensors


def _load_tensors(tensor_file: Path) -> dict:
    """{key: tensor} of a safetensors file (never a pickle); ValueError naming a corrupt one."""
    try:
        # cloned: load_file's tensors may sit unaligned in one buffer, and BLAS then rounds differently (1 ulp)
        return {key: t.clone() for key, t in load_file(str(tensor_file)).items()}
    except Exception as error:  # noqa: BLE001 - safetensors reports a corrupt file as SafetensorError and others
        raise ValueError(f"{tensor_file}: corrupt or not a safetensors file ({type(error).__name__}: {error})"
                         ) from None


def _read_report(folder: Path) -> dict | None:
    """The report.json beside a run's decoders, None when there is none or it cannot be read (an unreadable
    report says nothing about the decoders)."""
    report_file = folder / "report.json"
    try:
        report = json.loads(report_file.read_text(encoding="utf-8")) if report_file.is_file() else None
    except (OSError, ValueError, RecursionError):
        return None
    return report if isinstance(report, dict) else None


def _field(obj, *keys):
    """obj[k1][k2]... through JSON objects, None where one is missing or not an object."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _report_details(report: dict | None, entry: dict, model: dict | None) -> dict:
    """What a run's report adds to a decoder's card: the model's identity with its revision, the prompt template
    it was fitted on (protocol lre: only the first trial's refit has the report's template; other refits None),
    and its layer's test metrics (value, ci, n; the mean over the run's re-fits)."""
    relation = _field(report, "analyses", "relations", entry["relation"])
    template = _field(relation, "template")
    exact = _field(relation, "protocol") != "lre" or entry.get("refit") in (0, None)
    metrics = {}
    for name in ("faithfulness", "causality"):
        metric = _field(relation, "layers", str(entry["layer"]), entry["kind"], name)
        if isinstance(metric, dict) and isinstance(metric.get("value"), (int, float)):
            metrics[f"test_{name}"] = {k: metric.get(k) for k in ("value", "ci", "n")}
    revision = _field(report, "model", "revision")
    return {"model": {**model, "revision": revision} if isinstance(model, dict) and revision else model,
            "template": template if isinstance(template, str) and "{}" in template and exact else None,
            "metrics": metrics}


def _check_same_weights(index: dict, index_file: Path, report_file: Path) -> None:
    """ValueError when the report beside the decoders names other weights than they do (another run's files)."""
    model = index.get("model")
    saved = model.get("weights") if isinstance(model, dict) else None
    report = _read_report(report_file.parent) if saved else None
    measured = report.get("model") if isinstance(report, dict) else None
    if isinstance(measured, dict) and weights_id(measured) != saved:
        raise ValueError(f"{index_file}: the decoders of weights {saved}, but {report_file} is the report of "
                         f"weights {weights_id(measured)}: they come from different runs; probe the model again "
                         f"into an empty folder"[:600])


def _check_entry(entry, where: str) -> None:
    """One decoders.json entry has the fields, of the types, that loading it uses; ValueError naming them."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
    kinds = {"relation": str, "kind": str, "layer": int, "d_in": int, "d_out": int, "beta": (int, float),
             "tensors": dict}
    for name, kind in kinds.items():
        if not isinstance(entry.get(name), kind) or isinstance(entry.get(name), bool):
            raise ValueError(f"{where}: field {name!r} must be of type "
                             f"{kind.__name__ if isinstance(kind, type) else 'number'}, got {entry.get(name)!r}"[:300])
    for name in ("rank", "edit_rank"):
        if entry.get(name) is not None and (not isinstance(entry[name], int) or isinstance(entry[name], bool)):
            raise ValueError(f"{where}: field {name!r} must be a whole number or null, got {entry[name]!r}"[:300])
    if entry["d_in"] < 1 or entry["d_out"] < 1:
        raise ValueError(f"{where}: d_in and d_out must be at least 1, got {entry['d_in']} and {entry['d_out']}")
    names = entry["tensors"]
    if not {"W", "b"} <= set(names) <= {"W", "b", "J"}:
        raise ValueError(f"{where}: field 'tensors' must name W, b (and J), got {sorted(names)}"[:300])
    for name, key in names.items():
        factors = isinstance(key, list) and len(key) == 3 and all(isinstance(k, str) for k in key)
        if not (isinstance(key, str) or (factors and name != "b")):
            raise ValueError(f"{where}: tensors.{name} must be a tensor key, or three keys (U, S, Vh) for W or J, "
                             f"got {key!r}"[:300])


def _check_shapes(entry: dict, tensors: dict, where: str, named_in: str = DECODERS_JSON) -> None:
    """Every tensor of an entry has the shape its d_in/d_out say, checked before any is used (so a crafted file
    cannot make loading multiply out a matrix of another size): W, J [d_out, d_in] or their factors U [d_out, r],
    S [r], Vh [r, d_in] with r <= min(d_in, d_out); b [d_out]."""
    d_in, d_out = entry["d_in"], entry["d_out"]
    for name, key in entry["tensors"].items():
        keys = [key] if isinstance(key, str) else key
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"{where}: lacks tensors {missing} named in {named_in}")
        shapes = [tuple(tensors[k].shape) for k in keys]
        if name == "b":
            expected = [(d_out,)]
        elif isinstance(key, str):
            expected = [(d_out, d_in)]
        else:
            rank = shapes[1][0] if len(shapes[1]) == 1 else -1
            expected = [(d_out, rank), (rank,), (rank, d_in)] if 1 <= rank <= min(d_in, d_out) else None
        if shapes != expected:
            wanted = expected or f"U [{d_out}, r], S [r], Vh [r, {d_in}] with 1 <= r <= {min(d_in, d_out)}"
            raise ValueError(f"{where}: the tensors of {name} {keys} have shapes {shapes}, but d_in {d_in} and "
                             f"d_out {d_out} call for {wanted}"[:500])


def _fit(entry: dict, tensors: dict) -> dict:
    """The entry with its tensors (checked by ``_read_decoders``); a matrix saved as factors (a list of keys U,
    S, Vh: format 2) is multiplied out as the analyses did, (U * S) @ Vh, so it is the very matrix they used."""

    def matrix(key):
        if isinstance(key, str):
            return tensors[key]
        U, S, Vh = (tensors[k] for k in key)
        return (U * S) @ Vh
    fit = {**entry, **{name: matrix(key) for name, key in entry["tensors"].items()}}
    fit.update({f"{name}_factors": tuple(tensors[k] for k in key) for name, key in entry["tensors"].items()
                if not isinstance(key, str)})     # kept, so that a resumed run writes the same bytes again
    return fit


def _saved(info: dict, fit: dict) -> SavedDecoder:
    """The SavedDecoder of a checked entry or card ``info`` and its tensors (:func:`_fit`)."""
    operator = LinearRelationOperator(fit["W"], fit["b"], float(info["beta"]), info.get("rank"))
    factors = {name: fit[f"{name}_factors"] for name in ("W", "J") if f"{name}_factors" in fit}
    return SavedDecoder(operator, info, fit.get("J"), factors)


def _from_folder(folder: Path, relation: str | None, kind: str | None) -> SavedDecoder:
    """A decoder folder's decoder (``relation``, ``kind`` checked when given), or a run folder's (``relation``
    required)."""
    if (folder / DECODER_JSON).is_file():
        decoder = _read_card(folder)
        if (relation or decoder.relation, kind or decoder.kind) != (decoder.relation, decoder.kind):
            raise KeyError(f"{folder / DECODER_JSON} holds the {decoder.kind} decoder of relation "
                           f"{decoder.relation!r}, not the {kind or decoder.kind} decoder of {relation!r}")
        return decoder
    if (folder / DECODERS_JSON).is_file():
        if relation is None:
            raise ValueError(f"{folder} is a run's folder of decoders: name the relation, e.g. "
                             f"from_pretrained({str(folder)!r}, relation='country_capital')")
        return load_decoder(folder, relation, kind or "lre")
    raise FileNotFoundError(f"no decoder in {folder}: it has neither {DECODER_JSON} (a decoder saved by "
                            f"SavedDecoder.save) nor {DECODERS_JSON} (a run's decoders)")


def _read_card(folder: Path) -> SavedDecoder:
    """The decoder of a folder written by :meth:`SavedDecoder.save`, its card and tensors checked first."""
    card_file, tensor_file = folder / DECODER_JSON, folder / DECODER_TENSORS
    card = read_json(card_file, ValueError, "; not an llmprobe decoder card", encoding="utf-8")
    if not isinstance(card, dict) or card.get("format") != DECODER_FORMAT:
        raise ValueError(f"{card_file}: not an llmprobe decoder card (its 'format' is not {DECODER_FORMAT!r})")
    version = card.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= DECODER_FORMAT_VERSION:
        raise ValueError(f"{card_file}: format_version {version!r}; llmprobe {__version__} reads 1 to "
                         f"{DECODER_FORMAT_VERSION}: a newer llmprobe wrote it"[:300])
    _check_entry(card, str(card_file))
    for name, kinds in (("model", (dict, type(None))), ("metrics", (dict, type(None)))):
        if not isinstance(card.get(name), kinds):
            raise ValueError(f"{card_file}: field {name!r} must be an object or null, got {card.get(name)!r}"[:300])
    _check_template(card.get("template"), f"{card_file}: field 'template'")
    if not tensor_file.is_file():
        raise FileNotFoundError(f"{folder} has {DECODER_JSON} but not its {DECODER_TENSORS}")
    tensors = _load_tensors(tensor_file)
    _check_shapes(card, tensors, f"{card_file} (its tensors in {DECODER_TENSORS})", DECODER_JSON)
    return _saved(card, _fit(card, tensors))


def _check_template(template, what: str) -> None:
    if template is not None and (not isinstance(template, str) or "{}" not in template):
        raise ValueError(f"{what} must be a prompt with a {{}} subject slot, or null; got {template!r}"[:300])


def _hub_snapshot(repo: str, revision: str | None, cache_dir: str | Path | None, token: str | None) -> Path:
    """The local folder of hub repo ``repo``'s decoder files (downloaded, or from the cache when offline or the hub
    is unreachable); FileNotFoundError naming the repo and how to fetch it when it cannot be had."""
    offline = hub_offline() or hub_constants.is_offline_mode()
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=offline,
                                      allow_patterns=[DECODER_JSON, DECODER_TENSORS, DECODER_README]))
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise FileNotFoundError(f"no hub repo {repo!r} at revision {revision or 'main'} (or it is private: pass "
                                f"token=...): {type(error).__name__}") from error
    except LocalEntryNotFoundError as error:
        why = "offline (HF_HUB_OFFLINE is set)" if offline else "the hub could not be reached"
        how = f"`hf download {repo}`" + (", or this call without HF_HUB_OFFLINE" if offline else "")
        raise FileNotFoundError(
            f"hub repo {repo!r} (revision {revision or 'main'}) is not in the local Hugging Face cache "
            f"({cache_dir or hub_constants.HF_HUB_CACHE}) and {why}: fetch it once with network access ({how}), "
            f"or load a folder written by SavedDecoder.save") from error


MD_SPECIAL = set("\\`*_[]|~!")      # inline Markdown, escaped with a backslash; & < > become HTML entities


def _md(value) -> str:
    """A user string for Markdown, shown as it is ("-" for None): on one line, invisible characters (controls,
    bidirectional marks) written as escapes, inline Markdown backslash-escaped and & < > as entities (no HTML,
    link, emphasis or table cell can be injected)."""
    if value is None:
        return "-"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return html.escape("".join("\\" + c if c in MD_SPECIAL else c for c in text), quote=False)


def model_card(card: dict) -> str:
    """README.md of a shared decoder: what it is, its numbers, how to load it (user strings escaped, :func:`_md`)."""
    model = card.get("model") or {}
    metrics = card.get("metrics") or {}

    def metric(name):
        m = metrics.get(name)
        if not isinstance(m, dict):
            return "-"
        ci = m.get("ci") if isinstance(m.get("ci"), list) and len(m["ci"]) == 2 else None
        return f"{m['value']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "") + f" (n = {m.get('n')})"
    rows = [("relation", _md(card["relation"])), ("kind", _md(card["kind"])), ("layer", card["layer"]),
            ("reads h", _md(card["h"])), ("gives o", _md(card["o"])),
            ("shape", f"d_in {card['d_in']} -> d_out {card['d_out']}"), ("beta", card["beta"]),
            ("rank", card["rank"]), ("edit rank", card["edit_rank"]),
            ("model", _md(model.get("name"))), ("revision", _md(model.get("revision"))),
            ("weights", _md(model.get("weights"))), ("template", _md(card.get("template"))),
            ("validation faithfulness", "-" if card.get("val_faithfulness") is None else
             f"{card['val_faithfulness']:.3f}"),
            ("test faithfulness at its layer", metric("test_faithfulness")),
            ("test causality at its layer", metric("test_causality"))]
    lines = ["---", "library_name: llmprobe", "tags:", "- llmprobe", "- linear-relation-decoder", "---", "",
             f"# {_md(card['relation'])}: {_md(card['kind'])} decoder at layer {card['layer']}", "",
             f"A linear relation decoder fitted by llmprobe {_md(card.get('llmprobe_version'))}: o = beta W h + b "
             f"maps the subject's state h to the state o the model's final norm and LM head read the object from. "
             f"Tensors: `{DECODER_TENSORS}` (float64, safetensors); card: `{DECODER_JSON}`.", "",
             "| field | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), "",
             "```python", "from llmprobe import SavedDecoder", "",
             "decoder = SavedDecoder.from_pretrained(\"THIS_REPO_OR_FOLDER\")",
             "ids = decoder.predict(lm, [\"France\", \"Japan\"])   # lm: llmprobe.load_model() of the model above",
             "```", ""]
    return "\n".join(lines)
