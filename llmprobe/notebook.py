"""Notebook API: a report folder as an object, and the fitted decoders saved beside it.

    import llmprobe
    report = llmprobe.load_report("runs/smollm2")      # shows the summary and key plots in Jupyter
    frame = report.to_frame()                          # tidy pandas table (pandas: the ``notebook`` extra)
    report.plot("lre.faithfulness")                    # a matplotlib figure: the measure by layer, intervals
    decoder = llmprobe.load_decoder("runs/smollm2", "country_capital")
    o = decoder.apply(h)                               # h [n, d_in] -> o [n, d_out] = beta W h + b

Decoders: ``probe`` writes ``decoders.safetensors`` (float64 tensors) and ``decoders.json`` (one entry per
relation and decoder: layer, beta, rank, edit rank, places, tensor keys, the model's identity) beside
report.json. pandas and matplotlib are imported only by the methods that need them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .geometry import LinearRelationOperator
from .io import write_bytes, write_json

DECODERS_JSON = "decoders.json"
DECODERS_TENSORS = "decoders.safetensors"
FRAME_COLUMNS = ("source", "relation", "layer", "measure", "value", "lo", "hi", "n", "control")
KEY_MEASURES = ("lre.faithfulness", "lre.causality", "superposition.r2")     # the plots _repr_html_ shows


# ------------------------------------------------------------------------------------------------ the report
class Report:
    """A report folder: ``data`` (report.json as a dict, controls expanded into ``sources``), ``_repr_html_``
    (the summary and key plots), ``to_frame()`` and ``plot(measure)``."""

    def __init__(self, data: dict):
        from .report import label_apart, with_controls

        self.data = data
        self.sources = label_apart(with_controls([data]))

    @property
    def rows(self) -> list[dict]:
        """Every measured number as a metric row (``llmprobe.report.metric_rows``)."""
        from .report import metric_rows

        return [row for source in self.sources for row in metric_rows(source)]

    @property
    def claims(self) -> list[dict]:
        """The summary's lines: one per claim of the paper, with its verdict (``llmprobe.report.summary_claims``)."""
        from .report import summary_claims

        return summary_claims(self.data)

    def __repr__(self) -> str:
        from .report import source_name

        lines = [f"llmprobe report: {source_name(self.data)} ({self.data.get('_path', '')})"]
        lines += [f"  {c['claim']}: {c['verdict']}" for c in self.claims]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The summary section and the key per-depth plots (``KEY_MEASURES``), every user string escaped."""
        from .report import figure_html, layer_figures, source_name, summary_html

        figures = layer_figures([row for row in self.rows if row["metric"] in KEY_MEASURES])
        return "<div>" + summary_html(self.sources, f"llmprobe report: {source_name(self.data)}") + "".join(
            figure_html(f"{measure} by depth", uri) for measure, uri in figures) + "</div>"

    def to_frame(self):
        """Tidy pandas DataFrame, one row per number (``FRAME_COLUMNS``): each measure's value with its interval
        and n (control empty), then each of its controls (control = its name, value = the control's value)."""
        import pandas as pd

        records, seen = [], set()
        for row in self.rows:
            place = (row["source"], row["relation"], row["layer"], row["metric"])
            if place not in seen:
                seen.add(place)
                records.append([*place, row["value"], row["lo"], row["hi"], row["n"], None])
            if row["control"] is not None:
                records.append([*place, row["control_value"], None, None, row["n"], row["control"]])
        frame = pd.DataFrame(records, columns=list(FRAME_COLUMNS))
        return frame.astype({"layer": "Int64", "n": "Int64", "value": float, "lo": float, "hi": float})

    def plot(self, measure: str):
        """A matplotlib figure of ``measure`` by layer: a line per (source, relation), its 95% interval as a band,
        its primary control dashed (``llmprobe.report.measure_figure``). Raises ValueError naming the measures."""
        from .report import measure_figure

        measures = sorted({r["metric"] for r in self.rows if r["layer"] is not None})
        if measure not in measures:
            raise ValueError(f"no measure {measure!r} by layer in this report; measures: {', '.join(measures)}")
        return measure_figure(self.rows, measure, x="layer")


def load_report(path: str | Path) -> Report:
    """The report in folder ``path`` (or its report.json) as a :class:`Report`; clear errors for a missing or
    malformed file (``llmprobe.report.read_report``)."""
    from .report import read_report

    return Report(read_report(path))


# ---------------------------------------------------------------------------------------------- the decoders
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


def save_decoders(out: str | Path, fitted: dict, model: dict) -> list[Path]:
    """Write ``fitted`` ({relation: {kind: fit}}, from ``run_analyses(fitted=...)``) to ``out/decoders.safetensors``
    (float64 tensors) and ``out/decoders.json`` (the entries, ``model``: the model's identity), atomically. A
    low-rank W or J whose factors (``W_factors``: U [d_out, r], S [r], Vh [r, d_in]) take less room is saved as
    them (its ``tensors`` entry lists three keys), e.g. with low-rank Jacobians: ~r x 2d instead of d x d."""
    from safetensors.torch import save

    from .analyses.settings import H_PLACE, O_PLACE

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
    import json

    from safetensors.torch import load_file

    index_file, tensor_file = folder / DECODERS_JSON, folder / DECODERS_TENSORS
    if not index_file.is_file() or not tensor_file.is_file():
        if missing_ok:
            return None, {}
        raise FileNotFoundError(f"no saved decoders in {folder} (need {DECODERS_JSON} and {DECODERS_TENSORS}, "
                                f"written by llmprobe probe/run with the lre or ridge analyses)")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{index_file}: not valid JSON ({error})") from None
    if not isinstance(index, dict) or not isinstance(index.get("decoders"), list):
        raise ValueError(f"{index_file}: not an llmprobe decoders index (no 'decoders' list)")
    # cloned: load_file's tensors may sit unaligned in one buffer, and BLAS then rounds differently (1 ulp)
    return index, {key: t.clone() for key, t in load_file(str(tensor_file)).items()}


def _fit(entry: dict, tensors: dict) -> dict:
    """The entry with its tensors; a matrix saved as factors (a list of keys U, S, Vh: format 2) is multiplied
    out as the analyses did, (U * S) @ Vh, so it is the very matrix they used."""
    keys = [k for key in entry["tensors"].values() for k in ([key] if isinstance(key, str) else key)]
    missing = [key for key in keys if key not in tensors]
    if missing:
        raise ValueError(f"{DECODERS_TENSORS} lacks tensors {missing} named in {DECODERS_JSON}")

    def matrix(key):
        if isinstance(key, str):
            return tensors[key]
        U, S, Vh = (tensors[k] for k in key)
        return (U * S) @ Vh
    fit = {**entry, **{name: matrix(key) for name, key in entry["tensors"].items()}}
    fit.update({f"{name}_factors": tuple(tensors[k] for k in key) for name, key in entry["tensors"].items()
                if not isinstance(key, str)})     # kept, so that a resumed run writes the same bytes again
    return fit
