"""Reports: report.json -> self-contained HTML (plots embedded), Markdown and CSV tables; side-by-side comparison.

Every measured number is first flattened into *metric rows* (one dict per source x relation x layer x metric,
with its interval and control), so the same renderers serve a single run and a comparison of many.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import math
from pathlib import Path

from llmprobe.io import figure_png, write_json, write_text
from llmprobe.metric import Metric, iter_metrics, pooled, pooled_readout, wilson
from llmprobe.report.schema import read_report

ROW_FIELDS = ("source", "kind", "relation", "layer", "depth", "metric", "value", "lo", "hi", "control",
              "control_value", "n")


def source_name(report: dict) -> str:
    """A short label for a report: the model name, or the synthetic control's description (``_label`` when
    :func:`compare` had to tell two sources of one name apart)."""
    if report.get("_label"):
        return report["_label"]
    if report.get("kind") == "synthetic":
        return report.get("label") or "synthetic"
    return report.get("model", {}).get("name", "model")


def metric_rows(report: dict) -> list[dict]:
    """Flatten every measured number of a report into rows with the keys in ``ROW_FIELDS``.

    Known-fact rates become rows with metric ``known_rate`` and no layer; every typed metric of the analyses
    (pretrained, or a synthetic control's readouts in the same layout) contributes one row per control (or one
    row when it has none), found by its place in the report: ``relations.R.layers.L.DECODER.MEASURE``,
    ``superposition.layers.L.r2``, ``superposition.layers.L.readout.R`` and the swap edit's scales.
    """
    source, kind = source_name(report), report.get("kind", "pretrained")
    n_layers = max(report.get("model", {}).get("n_layers") or 1, 1)
    rows = []
    for name, rel in report.get("relations", {}).items():
        rows.append(_row(source, kind, name, None, None, "known_rate", rel.get("known_rate"), n=rel.get("n_facts")))
    analyses = report.get("analyses") or {}
    for path, m in iter_metrics(analyses):
        place = _metric_place(path, analyses)
        if place is None:
            continue
        relation, layer, metric = place
        depth = layer / (n_layers - 1) if n_layers > 1 else 0.0
        lo, hi = (m.get("ci") or [None, None])[:2]
        controls = m.get("controls") or {}
        common = (source, kind, relation, layer, depth, metric, m["value"], lo, hi)
        if not controls:
            rows.append(_row(*common, n=m.get("n")))
        for control, c in controls.items():
            rows.append(_row(*common, control, c.get("value"), n=m.get("n")))
    return rows


def _metric_place(path: tuple, analyses: dict) -> tuple[str, int, str] | None:
    """(relation, layer, metric name) of the metric at ``path`` in a report's analyses; None for metrics that are
    not per-layer rows."""
    if len(path) == 6 and path[0] == "relations" and path[2] == "layers":             # decoders
        return path[1], int(path[3]), f"{path[4]}.{path[5]}"
    if len(path) >= 4 and path[:2] == ("superposition", "layers"):
        layer, rest = int(path[2]), path[3:]
        if rest == ("r2",):
            return "(all)", layer, "superposition.r2"
        if len(rest) == 2 and rest[0] == "readout":
            return rest[1], layer, "superposition.readout_accuracy"
        if len(rest) == 4 and rest[:2] == ("swap", "by_scale"):            # x1 = the fitted edit, then x4, x16
            scale = analyses["superposition"]["layers"][path[2]]["swap"]["by_scale"][int(rest[2])]["scale"]
            return "(all)", layer, f"superposition.swap_{rest[3]}" + ("" if scale == 1 else f"_x{scale:g}")
    return None


def _row(source, kind, relation, layer, depth, metric, value, lo=None, hi=None, control=None, control_value=None,
         n=None) -> dict:
    return dict(zip(ROW_FIELDS, (source, kind, relation, layer, depth, metric, value, lo, hi, control,
                                 control_value, n)))


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """The metric rows as one CSV table (atomic write); text cells that a spreadsheet would run as a formula are
    neutralised (:func:`csv_safe`)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=ROW_FIELDS)
    writer.writeheader()
    writer.writerows({k: csv_safe(v) for k, v in row.items()} for row in rows)
    return write_text(path, buffer.getvalue())


def csv_safe(value):
    """A text cell starting with ``= + - @``, tab or CR gets a leading ``'`` so that spreadsheets show it as
    text instead of running it as a formula; numbers (and text that reads as a number, like ``-0.12``) stay."""
    if isinstance(value, str) and value.startswith(("=", "+", "-", "@", "\t", "\r")):
        try:
            float(value)
        except ValueError:
            return "'" + value
    return value


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported only when a report draws)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png_data_uri(figure) -> str:
    return "data:image/png;base64," + base64.b64encode(figure_png(figure)).decode("ascii")


def layer_figures(rows: list[dict]) -> list[tuple[str, str]]:
    """One plot per metric (:func:`measure_figure` against normalised depth), as (metric, PNG data URI)."""
    metrics = sorted({r["metric"] for r in rows if r["layer"] is not None})
    return [(metric, _png_data_uri(measure_figure(rows, metric))) for metric in metrics]


def measure_figure(rows: list[dict], metric: str, x: str = "depth"):
    """A matplotlib figure of one metric against ``x`` (``depth``: normalised depth, or ``layer``): a line per
    (source, relation) (the first 12), its 95% interval as a band, its primary control dashed."""
    plt = _pyplot()
    chosen = [r for r in rows if r["metric"] == metric and r["layer"] is not None]
    figure, axis = plt.subplots(figsize=(7, 3.6))
    series = sorted({(r["source"], r["relation"]) for r in chosen}, key=str)
    for index, (source, relation) in enumerate(series[:12]):
        points = {}
        for r in chosen:
            if (r["source"], r["relation"]) == (source, relation):
                points.setdefault(r[x], r)                  # the first row of a metric: its primary control
        xs = sorted(points)
        color = f"C{index % 10}"
        label = relation if len({s for s, _ in series}) == 1 else f"{source}: {relation}"
        axis.plot(xs, [points[d]["value"] for d in xs], marker="o", ms=3, color=color, label=label)
        if all(points[d]["lo"] is not None and points[d]["hi"] is not None for d in xs):
            axis.fill_between(xs, [points[d]["lo"] for d in xs], [points[d]["hi"] for d in xs], color=color,
                              alpha=0.15)
        controls = [points[d]["control_value"] for d in xs]
        if all(c is not None for c in controls):
            axis.plot(xs, controls, ls="--", lw=1, color=color)
    axis.set_xlabel("normalised depth (layer / last layer)" if x == "depth" else x)
    axis.set_ylabel(metric)
    axis.set_title(f"{metric} by {x} (band: 95% interval; dashed: control)")
    axis.legend(fontsize=6, ncol=2)
    return figure


def _superposition_at(report: dict) -> tuple[str, dict] | None:
    """(label, layer entry) of a report's superposition readouts: a synthetic control's e_s, or the pretrained
    layer with the highest cross-fitted R^2 (descriptive: chosen on the held-out numbers it shows)."""
    layers = ((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}
    scored = {l: e for l, e in layers.items() if (e.get("r2") or {}).get("value") is not None}
    if not scored:
        return None
    if report.get("kind") == "synthetic":
        return source_name(report), scored[min(scored, key=int)]
    layer = max(scored, key=lambda l: scored[l]["r2"]["value"])
    return f"{source_name(report)} (layer {layer}, highest R^2)", scored[layer]


def comparison_figure(reports: list[dict]):
    """Grouped bars, pretrained vs synthetic: per-relation readout accuracy and R^2, with 95% CIs and the
    shuffled control as a black tick on each bar; of the matched controls only the d* and the widest points (the
    whole curve is :func:`capacity_figure`). None when fewer than one source has readouts."""
    plt = _pyplot()
    widest = max((r.get("model", {}).get("d_model") or 0 for r in reports if r.get("kind") == "synthetic"), default=0)
    shown = [r for r in reports if r.get("kind") != "synthetic" or str(r.get("label", "")).endswith("(d*)")
             or r.get("model", {}).get("d_model") == widest]          # the curve's ends: d* and the widest width
    sources = [s for s in (_superposition_at(r) for r in shown) if s]
    if not sources:
        return None
    relations = list(dict.fromkeys(n for _, e in sources for n in (e.get("readout") or {})))
    groups = relations + ["R^2 (all relations)"]
    height = 0.8 / len(sources)
    figure, axis = plt.subplots(figsize=(10, max(3.0, 0.16 * len(groups) * len(sources) + 1.2)))
    for index, (label, entry) in enumerate(sources):
        metrics = [(entry.get("readout") or {}).get(n) for n in relations] + [entry.get("r2")]
        ys = [g + (index - (len(sources) - 1) / 2) * height for g in range(len(groups))]
        values = [m["value"] if m and m.get("value") is not None else float("nan") for m in metrics]
        cis = [(m or {}).get("ci") or [None, None] for m in metrics]
        errors = [[max(0.0, v - ci[0]) if None not in ci[:2] else 0.0 for v, ci in zip(values, cis)],
                  [max(0.0, ci[1] - v) if None not in ci[:2] else 0.0 for v, ci in zip(values, cis)]]
        axis.barh(ys, values, height=height * 0.95, xerr=errors, capsize=2, color=f"C{index % 10}", label=label,
                  error_kw={"lw": 0.8})
        shuffled = [((m or {}).get("controls") or {}).get("shuffled", {}).get("value") for m in metrics]
        axis.scatter([c for c in shuffled if c is not None], [y for y, c in zip(ys, shuffled) if c is not None],
                     marker="|", s=60, color="black", zorder=3)
    axis.set_yticks(range(len(groups)), groups, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel("readout accuracy (per relation) / R^2 (last row)")
    axis.set_title("Pretrained vs synthetic: superposition readouts (black tick: shuffled control)", fontsize=9)
    axis.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside the bars
    return _png_data_uri(figure)


def _pretrained_reference(report: dict, relations: list[str]) -> tuple[str, dict | None, dict | None] | None:
    """(layer, R^2, pooled readout over ``relations``) of the pretrained report's superposition readouts at the
    layer with the highest cross-fitted R^2; None when it has none."""
    layers = ((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}
    scored = {l: e for l, e in layers.items() if (e.get("r2") or {}).get("value") is not None}
    if not scored:
        return None
    layer = max(scored, key=lambda l: scored[l]["r2"]["value"])
    readout = {name: m for name, m in (scored[layer].get("readout") or {}).items() if name in relations}
    return layer, scored[layer]["r2"], pooled_readout(readout)


def controls_caption(reports: list[dict]) -> str:
    """Caption of :func:`capacity_figure`: what is compared with what, and which pretrained layer."""
    for report in reports:
        block = report.get("controls")
        if isinstance(block, dict) and block.get("modes"):
            ref = _pretrained_reference(report, (block.get("table") or {}).get("relations") or [])
            where = (f" Pretrained line and band: layer {ref[0]} of {source_name(report)}, the layer with the highest "
                     f"cross-fitted R^2 (chosen on the numbers shown, which favours the pretrained model), and its "
                     f"95% interval." if ref else " The pretrained report has no superposition readouts to draw.")
            return ("Matched controls against width d (log scale): held-out R^2 of the superposition fit and readout "
                    "accuracy (pooled over relations) of the controls' subject embeddings, with 95% intervals; "
                    "dotted: the shuffled-table control. " + block.get("compared_with", "") + where)
    return "Capacity of the matched controls"


def capacity_figure(reports: list[dict]):
    """The matched controls as a curve over width: R^2 (left) and pooled readout accuracy (right) against d (log
    scale) for each mode, with 95% intervals and the shuffled control dotted; the pretrained model's value at its
    highest-R^2 layer as a horizontal line with its interval band. Reports with the older per-control list draw
    the bisection's train accuracy against d instead. None without any control."""
    plt = _pyplot()
    for report in reports:
        block = report.get("controls")
        if isinstance(block, dict) and block.get("modes"):
            break
    else:
        return _bisection_figure(plt, reports)
    ref = _pretrained_reference(report, (block.get("table") or {}).get("relations") or [])
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, key, label in ((axes[0], "r2", "held-out R^2 of the superposition fit"),
                             (axes[1], "readout_mean", "readout accuracy (pooled over relations)")):
        for index, (mode, entry) in enumerate(block["modes"].items()):
            points = sorted(entry.get("points") or [], key=lambda p: p["d"])
            metrics = [(p["d"], p.get(key) if key == "r2" else pooled_readout(p.get("readout"))) for p in points]
            metrics = [(d, m) for d, m in metrics if m and m.get("value") is not None]
            if not metrics:
                continue
            ds, values = [d for d, _ in metrics], [m["value"] for _, m in metrics]
            lo = [max(0.0, v - (m["ci"][0] if m["ci"][0] is not None else v)) for v, (_, m) in zip(values, metrics)]
            hi = [max(0.0, (m["ci"][1] if m["ci"][1] is not None else v) - v) for v, (_, m) in zip(values, metrics)]
            d_star = (entry.get("threshold") or {}).get("d_star")
            axis.errorbar(ds, values, yerr=[lo, hi], marker="o", ms=4, capsize=2, color=f"C{index}",
                          label=f"{mode} (d* = {d_star})")
            shuffled = [((m.get("controls") or {}).get("shuffled") or {}).get("value") for _, m in metrics]
            if all(v is not None for v in shuffled):
                axis.plot(ds, shuffled, ls=":", lw=1, color=f"C{index}")
        if ref is not None:
            m = ref[1] if key == "r2" else ref[2]
            if m and m.get("value") is not None:
                axis.axhline(m["value"], color="black", lw=1.2, label=f"pretrained (layer {ref[0]})")
                if None not in (m.get("ci") or [None, None])[:2]:
                    axis.axhspan(m["ci"][0], m["ci"][1], color="black", alpha=0.12, lw=0)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("width d (log scale)")
        axis.set_ylabel(label, fontsize=8)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[1].set_ylim(0, 1.05)
    figure.suptitle("Matched controls on the pretrained fit's fact table, against width", fontsize=9)
    figure.tight_layout()
    return _png_data_uri(figure)


def _bisection_figure(plt, reports: list[dict]):
    """Reports written before the controls block: the controls' train accuracy against width d, d* marked."""
    curves = {}
    for report in reports:
        threshold = report.get("threshold") or {}
        if report.get("kind") == "synthetic" and threshold.get("tried"):
            mode = "frozen subjects" if report.get("model", {}).get("frozen_subjects") else "trainable subjects"
            points = [t for t in threshold["tried"] if isinstance(t, dict)]
            curves[mode] = (sorted((t["d"], t["accuracy"]) for t in points), threshold.get("d_star"))
    if not curves:
        return None
    figure, axis = plt.subplots(figsize=(6, 3.4))
    for index, (mode, (points, d_star)) in enumerate(sorted(curves.items())):
        axis.plot([d for d, _ in points], [a for _, a in points], marker="o", color=f"C{index}", label=mode)
        if d_star is not None:
            axis.axvline(d_star, color=f"C{index}", ls=":", lw=1)
            axis.annotate(f"d* = {d_star}", (d_star, 0.02 + 0.08 * index), color=f"C{index}", fontsize=7)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("width d (log scale)")
    axis.set_ylabel("train accuracy")
    axis.set_ylim(0, 1.05)
    axis.set_title("Matched controls: capacity (bisection on d; d* = smallest width at 100%)")
    axis.legend(fontsize=7)
    return _png_data_uri(figure)


def ablation_figure(reports: list[dict]):
    """Heatmaps of the controls' MLP ablations: accuracy drop on relation r (column) when the units most tied to
    relation q (row) are zeroed, beside the same number of random live units. None without any."""
    plt = _pyplot()
    panels = []
    for report in reports:
        selector = (report.get("analyses") or {}).get("selector") or {}
        if report.get("kind") == "synthetic" and selector.get("ablation_drop"):
            panels.append((source_name(report), "relation units", selector["ablation_drop"], selector["relations"]))
            panels.append((source_name(report), "random units", selector["random_ablation_drop"],
                           selector["relations"]))
    if not panels:
        return None
    cols = 2
    rows = (len(panels) + 1) // cols
    figure, axes = plt.subplots(rows, cols, figsize=(9, 3.6 * rows), squeeze=False)
    for axis, (label, what, drop, names) in zip(axes.flat, panels):
        image = axis.imshow(drop, vmin=0, vmax=1, cmap="viridis")
        ticks = [n if len(n) <= 18 else n[:17] + "." for n in names]
        axis.set_xticks(range(len(names)), ticks, rotation=90, fontsize=6)
        axis.set_yticks(range(len(names)), ticks, fontsize=6)
        axis.set_title(f"{label}: {what}", fontsize=8)
        axis.set_xlabel("accuracy drop on relation", fontsize=7)
        axis.set_ylabel("units zeroed: those tied to", fontsize=7)
        figure.colorbar(image, ax=axis, fraction=0.046)
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    figure.tight_layout()
    return _png_data_uri(figure)


def _table_html(header: list[str], body: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    lines = ["<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in body]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _md(text) -> str:
    """Any text for Markdown, on one line: HTML escaped (no tag reaches a renderer that allows HTML), line breaks
    folded into spaces (no injected headings or list items), backslashes and table pipes escaped."""
    text = html.escape(str(text), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return " ".join(text.splitlines())


def _table_md(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(_fmt(c)) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _with_ci(m: dict | None) -> str:
    """'value [lo, hi] (n=N)' of a typed metric, '-' when absent."""
    if not m or m.get("value") is None:
        return "-"
    lo, hi = (m.get("ci") or [None, None])[:2]
    text = _fmt(m["value"]) + (f" [{_fmt(lo, 2)}, {_fmt(hi, 2)}]" if lo is not None and hi is not None else "")
    return text + (f" (n={m['n']})" if m.get("n") is not None else "")


def _control_text(m: dict | None, *names: str) -> str:
    """'name value' of the named controls (default: the primary one) of a typed metric."""
    if not m:
        return "-"
    controls = m.get("controls") or {}
    names = names or ((m["control"],) if m.get("control") else ())
    return ", ".join(f"{n} {_fmt(controls[n].get('value'))}" for n in names if n in controls) or "-"


def selected_rows(report: dict) -> list[list]:
    """Per relation and decoder, at the layers chosen on validation (``analyses.relations.R.selected``): test
    faithfulness and causality with n, interval and every control."""
    rows = []
    for name, rel in ((report.get("analyses") or {}).get("relations") or {}).items():
        for method, sel in (rel.get("selected") or {}).items():
            at = lambda layer, key: ((rel.get("layers") or {}).get(str(layer)) or {}).get(method, {}).get(key)
            faith = at(sel.get("layer"), "faithfulness")
            causal = at(sel.get("causality_layer"), "causality") if sel.get("causality_layer") is not None else None
            rows.append([source_name(report), name, method, sel.get("layer"), _with_ci(faith),
                         _control_text(faith, *(faith or {}).get("controls", {})), sel.get("causality_layer"),
                         _with_ci(causal), _control_text(causal, *(causal or {}).get("controls", {}))])
    return rows


def superposition_rows(report: dict) -> list[list]:
    """Per layer: R^2 with its controls, mean readout accuracy with its shuffled control, swap edit where run."""
    rows = []
    layers = ((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}
    for layer, entry in sorted(layers.items(), key=lambda kv: int(kv[0])):
        readout = [m for m in (entry.get("readout") or {}).values() if m.get("value") is not None]
        acc = _mean([m["value"] for m in readout])
        acc_shuffled = _mean([m["controls"]["shuffled"]["value"] for m in readout
                             if (m.get("controls") or {}).get("shuffled", {}).get("value") is not None])
        scales = (entry.get("swap") or {}).get("by_scale") or []
        fitted = scales[0] if scales else {}
        rows.append([source_name(report), int(layer), _with_ci(entry.get("r2")),
                     _control_text(entry.get("r2"), "shuffled", "random_init"), acc, acc_shuffled,
                     _with_ci(fitted["success"]) if fitted else "not run at this layer",
                     _control_text(fitted.get("success"), "random_direction") if fitted else "-",
                     _with_ci(fitted["others_unchanged"]) if fitted else "-",
                     "; ".join(f"x{b['scale']:g}: {_fmt(b['success']['value'], 2)} "
                               f"({_fmt(b['success']['controls']['random_direction']['value'], 2)}) / "
                               f"{_fmt(b['others_unchanged']['value'], 2)}" for b in scales) or "-"])
    return rows


def control_rows(report: dict) -> list[list]:
    """One row per synthetic report (a matched control): width, training, readouts, selector numbers."""
    if report.get("kind") != "synthetic":
        return []
    train = report.get("train") or {}
    layer = (((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}).get("0") or {}
    readout = [m["value"] for m in (layer.get("readout") or {}).values() if m.get("value") is not None]
    selector = (report.get("analyses") or {}).get("selector") or {}
    transplant = selector.get("gate_transplant") or {}
    return [[source_name(report), report.get("model", {}).get("d_model"),
             (report.get("threshold") or {}).get("d_star"), train.get("accuracy"), train.get("steps"),
             f"{train['bits_per_param']:.3g}" if isinstance(train.get("bits_per_param"), (int, float)) else None,
             _with_ci(layer.get("r2")),
             _control_text(layer.get("r2"), "shuffled", "random_init"),
             _mean(readout),
             (selector.get("relation_gating") or {}).get("mean"), transplant.get("same_relation"),
             transplant.get("same_subject")]]


MIN_N = 10                                  # fewer test items than this: inconclusive, whatever the numbers
NOT_NULL = ("full_patch",)                  # controls that are ceilings, not null controls
CAPACITY_LAW = (0.177, 0.165, 0.191)        # d* = c R log2 N: c [95% CI] of the capacity sweep (docs/synthetic.md)
VERDICT_RULE = (
    "Verdicts (docs/measures.md, Verdicts): supported when the 95% interval lies above the control's interval "
    "(lower end above the control's upper end); not supported when the interval reaches the control's value or "
    "lies below it; inconclusive otherwise (it excludes the control's value but overlaps its interval) or with "
    f"fewer than {MIN_N} test items; not measured when the report has no such number. The control is the claim's "
    "strongest null control (the highest one; full_patch is a ceiling, not a null) unless the line names another. "
    "Capacity: supported when d* / (R log2 N) of the trainable control is at most the upper end of the capacity "
    f"sweep's law d* = {CAPACITY_LAW[0]} [{CAPACITY_LAW[1]}, {CAPACITY_LAW[2]}] R log2 N, not supported when it "
    "is above it with an exact d*, inconclusive when above it and d* is only an upper bound.")
CLAIMS = ("attributes linearly decodable", "LRE edits causal", "subject states a superposition of attribute vectors",
          "MLP a relation-conditioned selector", "capacity O(R log N) in the matched controls")


def verdict(metric: dict | None, control: dict | None) -> str:
    """The summary's rule (``VERDICT_RULE``) for a typed metric (JSON form) against its control."""
    if not metric or metric.get("value") is None:
        return "not measured"
    lo = (metric.get("ci") or [None])[0]
    if not control or control.get("value") is None or lo is None or (metric.get("n") or 0) < MIN_N:
        return "inconclusive"
    control_hi = (control.get("ci") or [None, None])[1]
    if lo > (control["value"] if control_hi is None else control_hi):
        return "supported"
    return "not supported" if lo <= control["value"] else "inconclusive"


def _strongest_null(metric: dict | None) -> tuple[str | None, dict | None]:
    """(name, metric) of the highest null control of a typed metric; (None, None) when it has none."""
    nulls = {k: c for k, c in ((metric or {}).get("controls") or {}).items()
             if k not in NOT_NULL and c and c.get("value") is not None}
    if not nulls:
        return None, None
    name = max(nulls, key=lambda k: nulls[k]["value"])
    return name, nulls[name]


def _claim(claim: str, measure: str, metric: dict | None, control_name: str | None = None,
           control: dict | None = None, note: str = "", result: str | None = None) -> dict:
    """One summary line: the claim, what its number is, the number and its control (typed metrics, JSON form),
    the verdict (``result`` overrides the rule, for the capacity line) and a note."""
    if control is None and metric is not None:
        control_name, control = _strongest_null(metric)
    return {"claim": claim, "measure": measure, "metric": metric, "control_name": control_name,
            "control": control, "verdict": result or verdict(metric, control), "note": note}


def summary_claims(report: dict) -> list[dict]:
    """One line per claim of the paper (``CLAIMS``) for a pretrained report, each with its verdict (``VERDICT_RULE``);
    a claim whose data the report lacks says "not measured"."""
    analyses = report.get("analyses") or {}
    superposition = (analyses.get("superposition") or {}).get("layers") or {}
    relations = sorted({n for e in superposition.values() for n in (e.get("readout") or {})})
    ref = _pretrained_reference(report, relations)
    at = f"layer {ref[0]} (highest held-out R^2)" if ref else ""
    lines = [_claim(CLAIMS[0], f"superposition readout accuracy, pooled over relations, at {at}",
                    ref[2] if ref else None)]
    causal = {}
    for name, rel in (analyses.get("relations") or {}).items():
        layer = ((rel.get("selected") or {}).get("lre") or {}).get("causality_layer")
        if layer is not None:
            causal[name] = (((rel.get("layers") or {}).get(str(layer)) or {}).get("lre") or {}).get("causality")
    lines.append(_claim(CLAIMS[1], f"LRE causality (reference edit W^+ (o_t - o_s)) pooled over {len(causal)} "
                        "relations, each at its causality layer chosen on validation",
                        pooled(causal, "pooled over relations (each test pair once)")))
    sources = control_sources(report.get("controls"), report.get("schema_version"))
    trainable = [s for s in sources if not s.get("model", {}).get("frozen_subjects")]
    d_model = report.get("model", {}).get("d_model")
    same_width = next((s for s in trainable if s.get("model", {}).get("d_model") == d_model), None)
    control_r2 = ((((same_width or {}).get("analyses") or {}).get("superposition") or {}).get("layers") or {}) \
        .get("0", {}).get("r2")
    if control_r2 and control_r2.get("value") is not None:
        lines.append(_claim(CLAIMS[2], f"held-out R^2 of h_s ~ c + sum_r W_r u_a(s) at {at}", ref[1] if ref else None,
                            f"matched one-layer control at the same width (d={d_model})", control_r2))
    else:
        lines.append(_claim(CLAIMS[2], f"held-out R^2 of h_s ~ c + sum_r W_r u_a(s) at {at}", ref[1] if ref else None))
    at_star = next((s for s in trainable if (s.get("threshold") or {}).get("d_star") == s.get("model", {}).get(
        "d_model")), trainable[0] if trainable else None)
    transplant = (((at_star or {}).get("analyses") or {}).get("selector") or {}).get("gate_transplant") or {}
    n_facts = ((at_star or {}).get("matched_to") or {}).get("n_facts")
    if transplant.get("same_relation") is not None and transplant.get("same_subject") is not None and n_facts:
        as_metric = lambda v: Metric(v, wilson(v, n_facts), n_facts, "wilson").to_dict()
        lines.append(_claim(CLAIMS[3], f"matched control ({source_name(at_star)}): accuracy with another subject's "
                            "MLP gate of the same relation (not measured in the pretrained model)",
                            as_metric(transplant["same_relation"]), "gate of the same subject, another relation",
                            as_metric(transplant["same_subject"])))
    else:
        lines.append(_claim(CLAIMS[3], "MLP gate transplant in the matched controls", None))
    threshold = (at_star or {}).get("threshold") or {}
    table = (at_star or {}).get("matched_to") or {}
    n, r = table.get("n_subjects"), len(table.get("relations") or [])
    if threshold.get("d_star") and n and n > 1 and r:
        c = threshold["d_star"] / (r * math.log2(n))
        law = {"value": CAPACITY_LAW[0], "ci": list(CAPACITY_LAW[1:])}
        result = "supported" if c <= CAPACITY_LAW[2] else "not supported" if threshold.get("exact") else \
            "inconclusive"
        lines.append(_claim(CLAIMS[4], f"d* / (R log2 N) of the trainable control: d* = {threshold['d_star']}"
                            f"{'' if threshold.get('exact') else ' (upper bound)'}, N = {n}, R = {r}",
                            {"value": c, "ci": None, "n": None}, "the capacity sweep's law (docs/synthetic.md)",
                            law, "one table: consistent with the law or not; the scaling itself is measured by "
                            "llmprobe synth sweep", result))
    else:
        lines.append(_claim(CLAIMS[4], "threshold width d* of the matched controls", None))
    return lines


def summary_tables(reports: list[dict], rows: list[dict]) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, body) tables shared by the HTML and Markdown renderers."""
    tables = []
    models = [[source_name(r), r.get("kind"), r.get("model", {}).get("architecture"),
               r.get("model", {}).get("n_layers"), r.get("model", {}).get("d_model"),
               (r.get("model", {}).get("weights_hash") or "")[:19],
               f"{r['wall_seconds']:.1f}" if isinstance(r.get("wall_seconds"), (int, float)) else None]
              for r in reports]
    tables.append(("Sources", ["source", "kind", "architecture", "layers", "d_model", "weights", "wall s"], models))
    known = [[r["source"], r["relation"], r["n"], r["value"]] for r in rows if r["metric"] == "known_rate"]
    if known:
        tables.append(("Known facts (greedy continuation starts with the object)",
                       ["source", "relation", "facts", "known rate"], known))
    selected = [row for report in reports for row in selected_rows(report)]
    if selected:
        tables.append(("Linear relation decoders at the layer chosen on validation (fixed test subjects; value "
                       "[95% CI] (n test items); causality = the reference edit W^+ (o_t - o_s))",
                       ["source", "relation", "decoder", "layer", "faithfulness", "controls", "causality layer",
                        "causality", "controls"], selected))
    superposition = [row for report in reports for row in superposition_rows(report)]
    if superposition:
        tables.append(("Superposition readouts of relation-free subject states, per layer (cross-fitted)",
                       ["source", "layer", "R^2", "R^2 controls", "mean readout accuracy", "shuffled",
                        "swap success", "swap control", "others unchanged",
                        "swap by edit scale: success (random dir.) / others unchanged"], superposition))
    controls = [row for report in reports for row in control_rows(report)]
    if controls:
        tables.append(("Matched synthetic controls (readouts of their subject embeddings e_s; what they were trained "
                       "on: controls.compared_with in report.json)",
                       ["control", "d", "d*", "train acc", "steps", "bits/param", "R^2", "R^2 controls",
                        "mean readout accuracy", "relation gating", "gate transplant (same relation)",
                        "gate transplant (other relation)"], controls))
    return tables


SUMMARY_HEADER = ["claim", "measure", "number [95% CI] (n)", "control", "verdict"]
LONG_TABLE = 15          # tables with more rows than this are folded into <details> (no JavaScript needed)


def summary_rows(reports: list[dict]) -> list[list]:
    """The summary's lines (``SUMMARY_HEADER``) of every pretrained report, its source first when there are
    several."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    rows = []
    for report in pretrained:
        prefix = f"{source_name(report)}: " if len(pretrained) > 1 else ""
        for line in summary_claims(report):
            control = f"{line['control_name']}: {_with_ci(line['control'])}" if line["control_name"] else "-"
            rows.append([prefix + line["claim"], line["measure"], _with_ci(line["metric"]), control,
                         line["verdict"] + (f" ({line['note']})" if line["note"] else "")])
    return rows


def summary_html(reports: list[dict], title: str) -> str:
    """``<section id="summary">``: the title, one line per claim with its number, control and verdict, the rule."""
    rows = summary_rows(reports)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in SUMMARY_HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row[:-1]) +
                   f"<td class='verdict {row[-1].split(' (')[0].replace(' ', '-')}'>{html.escape(row[-1])}</td></tr>"
                   for row in rows)
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>" if rows else \
        "<p>No pretrained report: no claim is measured on this page.</p>"
    return (f"<section id='summary'><h1>{html.escape(title)}</h1><h2>Summary: the paper's claims</h2>{table}"
            f"<p class='rule'>{html.escape(VERDICT_RULE)}</p></section>")


def report_figures(reports: list[dict], rows: list[dict]) -> list[tuple[str, str]]:
    """(caption, PNG data URI) of the page's plots: per-depth curves, then the pretrained-vs-synthetic bars, the
    capacity curve and the ablation heatmaps where the reports have them."""
    figures = [(f"{metric} by depth", uri) for metric, uri in layer_figures(rows)]
    return figures + [(caption, uri) for caption, uri in (
        ("Pretrained vs synthetic controls: readout accuracy and R^2", comparison_figure(reports)),
        (controls_caption(reports), capacity_figure(reports)),
        ("MLP ablations of the matched controls", ablation_figure(reports))) if uri]


def figure_html(caption: str, uri: str) -> str:
    title, _, rest = caption.partition(". ")          # a long caption: its first sentence heads the figure
    return (f"<h2>{html.escape(title)}</h2>" + (f"<p>{html.escape(rest)}</p>" if rest else "") +
            f"<img alt='{html.escape(title)}' src='{uri}'>")


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}.err{color:#a00}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:1.6em}summary{cursor:pointer;color:#555}
.rule{font-size:12px;color:#555}.supported{background:#dff0d8}.not-supported{background:#f2dede}
.inconclusive{background:#fcf8e3}.not-measured{color:#888}
#summary td:nth-child(3){white-space:nowrap}"""


def render_html(reports: list[dict], title: str, extra_images: list[tuple[str, str]] = ()) -> str:
    """A self-contained page, the answer first: the summary of the paper's claims (``<section id="summary">``),
    then per-depth curves with intervals and controls and any extra images, then the tables (long ones folded
    in ``<details>``). No JavaScript.

    ``extra_images``: (caption, data URI or path to a PNG) pairs, e.g. synthetic capacity plots. Every user
    string is escaped.
    """
    rows = [row for report in reports for row in metric_rows(report)]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body>{summary_html(reports, title)}"]
    parts += [figure_html(caption, uri) for caption, uri in report_figures(reports, rows)]
    for caption, image in extra_images:
        if not image.startswith("data:"):
            path = Path(image)
            if not path.is_file():
                continue
            image = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(figure_html(caption, image))
    for caption, header, body in summary_tables(reports, rows):
        table = _table_html(header, body)
        if len(body) > LONG_TABLE:
            table = f"<details><summary>{len(body)} rows (click to open)</summary>{table}</details>"
        parts.append(f"<h2>{html.escape(caption)}</h2>{table}")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        items = "".join(f"<li class='err'>{html.escape(str(e))}</li>" for e in errors)
        parts.append(f"<h2>Errors and skipped facts</h2><details><summary>{len(errors)} messages</summary>"
                     f"<ul>{items}</ul></details>")
    parts.append("</body></html>")
    return "".join(parts)


def render_markdown(reports: list[dict], title: str) -> str:
    """The Markdown report, the answer first: the summary of the claims with the verdict rule, then the tables."""
    rows = [row for report in reports for row in metric_rows(report)]
    summary = summary_rows(reports)
    parts = [f"# {_md(title)}", "## Summary: the paper's claims\n\n" + (
        _table_md(SUMMARY_HEADER, summary) if summary else "No pretrained report: no claim is measured here.") +
        f"\n\n{_md(VERDICT_RULE)}"]
    for caption, header, body in summary_tables(reports, rows):
        parts.append(f"## {_md(caption)}\n\n{_table_md(header, body)}")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        parts.append("## Errors and skipped facts\n\n" + "\n".join(f"- {_md(e)}" for e in errors))
    return "\n\n".join(parts) + "\n"


def export(report_dir: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"), out: str | Path | None = None,
           extra_images: list[tuple[str, str]] = ()) -> list[Path]:
    """Write report.html / report.md / metrics.csv for the report in ``report_dir`` (into ``out`` or beside it)."""
    report = read_report(report_dir)
    return write_all(with_controls([report]), Path(out or report_dir), f"llmprobe report: {source_name(report)}",
                     formats, extra_images)


def with_controls(reports: list[dict]) -> list[dict]:
    """The reports followed by the matched synthetic controls inside them (each trained point a source of its own,
    see :func:`control_sources`)."""
    return list(reports) + [dict(c, _path=r.get("_path")) for r in reports
                            for c in control_sources(r.get("controls"), r["schema_version"])]


def label_apart(reports: list[dict]) -> list[dict]:
    """Sources that share a name (two runs of one model, or their controls) get the report folder's name after
    it (and a number where the folder names repeat too), so their rows and plot lines stay apart."""
    groups: dict[str, list[dict]] = {}
    for report in reports:
        groups.setdefault(source_name(report), []).append(report)
    for name, group in groups.items():
        if len(group) < 2:
            continue
        folders = [Path(r.get("_path") or "").name or "?" for r in group]
        for index, (report, folder) in enumerate(zip(group, folders), 1):
            report["_label"] = f"{name} ({folder})" if folders.count(folder) == 1 else f"{name} ({folder} #{index})"
    return reports


def control_sources(block: dict | list | None, schema_version: int | None = None) -> list[dict]:
    """One synthetic source per trained control point of a report's controls block, in the per-source layout the
    tables and figures read (``analyses.superposition.layers["0"]``, ``analyses.selector``, ``train``,
    ``threshold``). A list (reports written before the block existed) is passed through."""
    if not block:
        return []
    if isinstance(block, list):
        return [dict(c, schema_version=schema_version) for c in block]
    out = []
    for mode, entry in (block.get("modes") or {}).items():
        threshold = entry.get("threshold") or {}
        for point in entry.get("points") or []:
            d = point["d"]
            label = f"synthetic {mode} d={d}" + (" (d*)" if d == threshold.get("d_star") else "")
            out.append({
                "schema_version": schema_version, "kind": "synthetic", "label": label,
                "model": {"name": label, "architecture": "FactRecallModel (one layer)", "n_layers": 1,
                          "d_model": d, "d_mlp": point.get("d_mlp"), "frozen_subjects": mode == "frozen"},
                "matched_to": block.get("table"), "threshold": threshold, "train": point.get("train") or {},
                "analyses": {"superposition": {"place": block.get("place"),
                                               "layers": {"0": {"r2": point.get("r2"),
                                                                "readout": point.get("readout") or {}}}},
                             "selector": point.get("selector") or {}},
                "wall_seconds": point.get("wall_seconds")})
    return out


def compare(report_dirs: list[str | Path], out: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"),
            ) -> list[Path]:
    """Side-by-side page of any number of reports, aligned on relations and normalised depth."""
    if len(report_dirs) < 1:
        raise ValueError("compare needs at least one report directory")
    reports = label_apart(with_controls([read_report(d) for d in report_dirs]))
    names = " vs ".join(dict.fromkeys(source_name(r) for r in reports))
    return write_all(reports, Path(out), f"llmprobe comparison: {names}", formats)


def write_all(reports: list[dict], out: Path, title: str, formats: tuple[str, ...],
              extra_images: list[tuple[str, str]] = ()) -> list[Path]:
    unknown = set(formats) - {"html", "md", "json", "csv"}
    if unknown:
        raise ValueError(f"unknown report format(s) {sorted(unknown)}; choose from html, md, json, csv")
    rows = [row for report in reports for row in metric_rows(report)]
    written = []
    if "html" in formats:
        written.append(write_text(out / "report.html", render_html(reports, title, extra_images)))
    if "md" in formats:
        written.append(write_text(out / "report.md", render_markdown(reports, title)))
    if "csv" in formats:
        written.append(write_csv(rows, out / "metrics.csv"))
    if "json" in formats:
        written.append(write_json(out / "metrics.json", rows))
    return written
