"""The report's plots, each a matplotlib figure built with :func:`llmprobe.io.subplots` (no pyplot: no backend is
chosen or switched) and embedded as a PNG data URI (:func:`llmprobe.io.figure_png`)."""
from __future__ import annotations

import base64

from llmprobe.io import figure_png, subplots
from llmprobe.metric import pooled_readout
from llmprobe.report.schema import source_name


def pretrained_reference(report: dict, relations: list[str]) -> tuple[str, dict | None, dict | None] | None:
    """(layer, R^2, pooled readout over ``relations``) of the pretrained report's superposition readouts at the
    layer with the highest cross-fitted R^2, the line the capacity figure draws (descriptive: chosen on the numbers
    shown; the claims choose their layers on validation, :mod:`llmprobe.report.claims`); None when it has none."""
    layers = ((report.get("analyses") or {}).get("superposition") or {}).get("layers") or {}
    scored = {l: e for l, e in layers.items() if (e.get("r2") or {}).get("value") is not None}
    if not scored:
        return None
    layer = max(scored, key=lambda l: scored[l]["r2"]["value"])
    readout = {name: m for name, m in (scored[layer].get("readout") or {}).items() if name in relations}
    return layer, scored[layer]["r2"], pooled_readout(readout)


def _png_data_uri(figure) -> str:
    return "data:image/png;base64," + base64.b64encode(figure_png(figure)).decode("ascii")


def layer_figures(rows: list[dict]) -> list[tuple[str, str]]:
    """One plot per metric (:func:`measure_figure` against normalised depth), as (metric, PNG data URI)."""
    metrics = sorted({r["metric"] for r in rows if r["layer"] is not None})
    return [(metric, _png_data_uri(measure_figure(rows, metric))) for metric in metrics]


def measure_figure(rows: list[dict], metric: str, x: str = "depth"):
    """A matplotlib figure of one metric against ``x`` (``depth``: normalised depth, or ``layer``): a line per
    (source, relation) (the first 12), its 95% interval as a band, its primary control dashed."""
    chosen = [r for r in rows if r["metric"] == metric and r["layer"] is not None]
    figure, axis = subplots(figsize=(7, 3.6))
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
    widest = max((r.get("model", {}).get("d_model") or 0 for r in reports if r.get("kind") == "synthetic"), default=0)
    shown = [r for r in reports if r.get("kind") != "synthetic" or str(r.get("label", "")).endswith("(d*)")
             or r.get("model", {}).get("d_model") == widest]          # the curve's ends: d* and the widest width
    sources = [s for s in (_superposition_at(r) for r in shown) if s]
    if not sources:
        return None
    relations = list(dict.fromkeys(n for _, e in sources for n in (e.get("readout") or {})))
    groups = relations + ["R^2 (all relations)"]
    height = 0.8 / len(sources)
    figure, axis = subplots(figsize=(10, max(3.0, 0.16 * len(groups) * len(sources) + 1.2)))
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


def controls_caption(reports: list[dict]) -> str:
    """Caption of :func:`capacity_figure`: what is compared with what, and which pretrained layer."""
    for report in reports:
        block = report.get("controls")
        if isinstance(block, dict) and block.get("modes"):
            ref = pretrained_reference(report, (block.get("table") or {}).get("relations") or [])
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
    for report in reports:
        block = report.get("controls")
        if isinstance(block, dict) and block.get("modes"):
            break
    else:
        return _bisection_figure(reports)
    ref = pretrained_reference(report, (block.get("table") or {}).get("relations") or [])
    figure, axes = subplots(1, 2, figsize=(10, 3.8))
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


def _bisection_figure(reports: list[dict]):
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
    figure, axis = subplots(figsize=(6, 3.4))
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
    figure, axes = subplots(rows, cols, figsize=(9, 3.6 * rows), squeeze=False)
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


def report_figures(reports: list[dict], rows: list[dict]) -> list[tuple[str, str]]:
    """(caption, PNG data URI) of the page's plots: per-depth curves, then the pretrained-vs-synthetic bars, the
    capacity curve and the ablation heatmaps where the reports have them."""
    figures = [(f"{metric} by depth", uri) for metric, uri in layer_figures(rows)]
    return figures + [(caption, uri) for caption, uri in (
        ("Pretrained vs synthetic controls: readout accuracy and R^2", comparison_figure(reports)),
        (controls_caption(reports), capacity_figure(reports)),
        ("MLP ablations of the matched controls", ablation_figure(reports))) if uri]
