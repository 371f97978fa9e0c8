"""Fitted decoders saved beside a report: ``decoders.safetensors`` (float64 tensors) and ``decoders.json`` (one
entry per relation and decoder: layer, beta, rank, edit rank, places, tensor keys, the model's identity).

    decoder = llmprobe.load_decoder("runs/smollm2", "country_capital")
    o = decoder.apply(h)                               # h [n, d_in] -> o [n, d_out] = beta W h + b
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from llmprobe.analyses.settings import H_PLACE, O_PLACE
from llmprobe.checks import read_json
from llmprobe.geometry import LinearRelationOperator
from llmprobe.io import write_bytes, write_json

DECODERS_JSON = "decoders.json"
DECODERS_TENSORS = "decoders.safetensors"

@dataclass
class SavedDecoder:
    """A fitted relation decoder loaded from a report folder.

    ``operator``: o = beta W h + b (W [d_out, d_in], b [d_out]), exactly as the analyses applied it;
    ``info``: its decoders.json entry (relation, kind, layer, beta, rank, edit_rank, places, model identity);
    ``J``: the untruncated mean Jacobian [d_out, d_in] when W is rank-truncated (the edits invert J)."""

    operator: LinearRelationOperator
    info: dict
    J: torch.Tensor | None = None

    def apply(self, h) -> torch.Tensor:
        """h [n, d_in] (subject states at ``info["h"]``) -> o [n, d_out] = beta W h + b."""
        return self.operator(h)

    def edit_delta(self, o_source, o_target) -> torch.Tensor:
        """The causal edit delta_h [n, d_in] = W_k^+ (o_target - o_source), k = the edit rank chosen on validation
        (full rank when none was chosen: the ridge decoder, or a layer without causality edits), inverting J where
        W is truncated: the edit the analyses made."""
        inverted = self.operator if self.J is None else LinearRelationOperator(self.J, self.operator.b)
        return inverted.edit_delta(o_source, o_target, self.info.get("edit_rank"))


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
            prefix = f"decoder{len(entries)}"
            keys = {}
            for name in ("W", "b", "J"):
                if fit.get(name) is None:
                    continue
                factors = fit.get(f"{name}_factors")
                if factors is not None and factors[1].numel() * sum(fit[name].shape) < fit[name].numel():
                    keys[name] = [f"{prefix}.{name}.{part}" for part in ("U", "S", "Vh")]   # low rank: U S Vh
                    parts = factors
                else:
                    keys[name], parts = f"{prefix}.{name}", [fit[name]]
                for key, t in zip([keys[name]] if isinstance(keys[name], str) else keys[name], parts):
                    tensors[key] = t.detach().to("cpu", torch.float64).contiguous().clone()   # no storage shared
            entries.append({"relation": relation, "kind": kind, "layer": fit["layer"], "beta": fit["beta"],
                            "rank": fit.get("rank"), "edit_rank": fit.get("edit_rank"), "alpha": fit.get("alpha"),
                            "refit": fit.get("refit"), "val_faithfulness": fit.get("val_faithfulness"),
                            "h": H_PLACE.replace("{l}", str(fit["layer"])), "o": O_PLACE,
                            "d_in": int(fit["W"].shape[1]), "d_out": int(fit["W"].shape[0]), "tensors": keys})
    out = Path(out)
    return [write_bytes(out / DECODERS_TENSORS, save(tensors)),
            write_json(out / DECODERS_JSON, {"format": 2, "model": model, "decoders": entries})]


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
            fit = _fit(entry, tensors)
            operator = LinearRelationOperator(fit["W"], fit["b"], float(entry["beta"]), entry.get("rank"))
            return SavedDecoder(operator, {**entry, "model": index.get("model")}, fit.get("J"))
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
    try:
        # cloned: load_file's tensors may sit unaligned in one buffer, and BLAS then rounds differently (1 ulp)
        tensors = {key: t.clone() for key, t in load_file(str(tensor_file)).items()}
    except Exception as error:  # noqa: BLE001 - safetensors reports a corrupt file as SafetensorError and others
        raise ValueError(f"{tensor_file}: corrupt or not a safetensors file ({type(error).__name__}: {error})"
                         ) from None
    for i, entry in enumerate(index["decoders"]):
        _check_shapes(entry, tensors, f"{tensor_file} (decoders[{i}] of {DECODERS_JSON})")
    return index, tensors


def _check_same_weights(index: dict, index_file: Path, report_file: Path) -> None:
    """ValueError when the report beside the decoders names other weights than they do (another run's files)."""
    model = index.get("model")
    saved = model.get("weights") if isinstance(model, dict) else None
    try:
        report = json.loads(report_file.read_text(encoding="utf-8")) if saved and report_file.is_file() else None
    except (OSError, ValueError, RecursionError):      # an unreadable report says nothing about the decoders
        report = None
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
    for field, kind in kinds.items():
        if not isinstance(entry.get(field), kind) or isinstance(entry.get(field), bool):
            raise ValueError(f"{where}: field {field!r} must be of type "
                             f"{kind.__name__ if isinstance(kind, type) else 'number'}, got {entry.get(field)!r}"[:300])
    for field in ("rank", "edit_rank"):
        if entry.get(field) is not None and (not isinstance(entry[field], int) or isinstance(entry[field], bool)):
            raise ValueError(f"{where}: field {field!r} must be a whole number or null, got {entry[field]!r}"[:300])
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


def _check_shapes(entry: dict, tensors: dict, where: str) -> None:
    """Every tensor of an entry has the shape its d_in/d_out say, checked before any is used (so a crafted file
    cannot make loading multiply out a matrix of another size): W, J [d_out, d_in] or their factors U [d_out, r],
    S [r], Vh [r, d_in] with r <= min(d_in, d_out); b [d_out]."""
    d_in, d_out = entry["d_in"], entry["d_out"]
    for name, key in entry["tensors"].items():
        keys = [key] if isinstance(key, str) else key
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"{where}: lacks tensors {missing} named in {DECODERS_JSON}")
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
