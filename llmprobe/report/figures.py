"""The report's plots, each a matplotlib figure built with :func:`llmprobe.io.subplots` (no pyplot: no backend is
chosen or switched); the page embeds them as PNG data URIs (:func:`png_data_uri`).

One colour per relation on a page (:func:`relation_colors`, the same in every figure); what is not one relation
(all relations, the matched controls' modes, the pretrained reference) is drawn in greys. Every legend sits outside
the axes and has an entry for everything drawn. The matched controls are one-layer models: they are drawn against
their width d, never at a depth.
"""
from __future__ import annotations

import base64
import colorsys

from llmprobe.analyses.results import MatchedBlock, SelectorResult, SuperpositionLayer, Threshold, null_value
from llmprobe.io import figure_png, subplots
from llmprobe.metric import pooled_readout
from llmprobe.report.schema import ALL_RELATIONS, analyses_of, metric_rows, model_of, source_name

# tab10 and tab20's light half, without their greys (greys are for what is not one relation)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
NEUTRAL = "#333333"                                      # all relations; the pretrained reference
MODES = {"trainable": ("o", "#333333", "-"), "frozen": ("s", "#999999", "-.")}   # matched controls: marker, colour, line
KEY_MEASURES = ("lre.faithfulness", "lre.causality", "superposition.r2", "superposition.readout_accuracy")
DEPTH_LABEL = {"depth": "normalised depth (layer / last layer)", "layer": "layer"}


def relation_colors(reports: list[dict]) -> dict[str, str]:
    """{relation: colour} over every relation of ``reports`` (sorted by name): ``PALETTE``, then evenly spread
    hues, so no two relations of a page share a colour; ``(all)`` (the measures over every relation) neutral."""
    names = sorted({row["relation"] for report in reports for row in metric_rows(report)} - {ALL_RELATIONS})
    colors = {name: _color(index) for index, name in enumerate(names)}
    return colors | {ALL_RELATIONS: NEUTRAL}


def _color(index: int) -> str:
    if index < len(PALETTE):
        return PALETTE[index]
    red, green, blue = colorsys.hsv_to_rgb((index * 0.618034) % 1.0, 0.7, 0.85)     # golden-ratio hue steps
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"


def _relation_label(relation: str) -> str:
    return "all relations" if relation == ALL_RELATIONS else relation


def png_data_uri(figure) -> str:
    """A figure as a ``data:image/png;base64,...`` URI (what the page embeds)."""
    return "data:image/png;base64," + base64.b64encode(figure_png(figure)).decode("ascii")


def figure_key(figure) -> dict:
    """What a figure names: ``panels`` (its axes' titles, in order) and ``legend`` (every legend entry's text,
    the figure's legends then its axes')."""
    legends = list(figure.legends) + [axis.get_legend() for axis in figure.axes if axis.get_legend()]
    return {"panels": [axis.get_title() for axis in figure.axes if axis.get_title()],
            "legend": [text.get_text() for legend in legends for text in legend.get_texts()]}


def _legend(figure, handles: list) -> None:
    """One legend for the whole figure, below its panels (outside every axis), all of ``handles``."""
    figure.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=7,
                  frameon=False)


def _line(label: str, color: str = NEUTRAL, **style):
    from matplotlib.lines import Line2D  # matplotlib only where something is drawn (start-up time)

    return Line2D([], [], color=color, label=label, **{"lw": 2, **style})


def _band(label: str):
    from matplotlib.patches import Patch  # matplotlib only where something is drawn (start-up time)

    return Patch(color=NEUTRAL, alpha=0.15, label=label)


def _mode(source: dict) -> str:
    return "frozen" if model_of(source).frozen_subjects else "trainable"


def owner_groups(reports: list[dict]) -> list[tuple[dict | None, list[dict]]]:
    """[(pretrained report, its matched controls)] in page order; synthetic sources of no pretrained report on the
    page (``_owner``, set by ``llmprobe.report.render.with_matched``) form a last group with owner None."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    synthetic = [r for r in reports if r.get("kind") == "synthetic"]
    groups = [(p, [c for c in synthetic if c.get("_owner") is p]) for p in pretrained]
    orphans = [c for c in synthetic if not any(c.get("_owner") is p for p in pretrained)]
    return groups + ([(None, orphans)] if orphans else [])


# ------------------------------------------------------------------------------------------- by depth
def depth_plot(reports: list[dict], measure: str, x: str = "depth", colors: dict | None = None):
    """``measure`` against ``x`` (``depth``: normalised depth, or ``layer``): a row of panels per pretrained
    source, a line per relation with its 95% interval as a band and its primary null control dashed; beside it,
    where the source's matched controls measured it, their values against width d (one-layer models: no depth),
    with 95% intervals. Colours: ``colors`` (default :func:`relation_colors`). None when nothing has it."""
    colors = colors or relation_colors(reports)
    rows_of = lambda source: [r for r in metric_rows(source) if r["measure"] == measure and r["layer"] is not None]
    groups = [(owner, rows_of(owner) if owner else [], [(m, rows_of(m)) for m in matched if rows_of(m)])
              for owner, matched in owner_groups(reports)]
    groups = [g for g in groups if g[1] or g[2]]
    if not groups:
        return None
    beside = any(matched for _, _, matched in groups)
    figure, axes = subplots(len(groups), 2 if beside else 1, figsize=(10.5 if beside else 7.5, 2.7 * len(groups) + 0.8),
                            squeeze=False, sharey=True, layout="constrained",
                            **({"width_ratios": [2, 1]} if beside else {}))
    drawn, nulls, modes = set(), set(), set()
    for (owner, rows, matched), row_axes in zip(groups, axes):
        if rows:
            drawn |= _draw_depth(row_axes[0], rows, x, colors, nulls)
            row_axes[0].set_title(source_name(owner), fontsize=9)
            row_axes[0].set_xlabel(DEPTH_LABEL[x], fontsize=8)
        else:
            row_axes[0].axis("off")
        if beside and matched:
            drawn |= _draw_widths(row_axes[1], matched, colors, modes)
            row_axes[1].set_title(f"{source_name(owner) + ': ' if owner else ''}matched controls (one layer)",
                                  fontsize=9)
        elif beside:
            row_axes[1].axis("off")
        row_axes[0].set_ylabel(measure, fontsize=8)
    handles = [_line(_relation_label(r), colors.get(r, NEUTRAL)) for r in sorted(drawn, key=_relation_order)]
    handles.append(_band("band: 95% interval"))
    if nulls:
        handles.append(_line(f"dashed: null ({', '.join(sorted(nulls))})", lw=1, ls="--"))
    handles += [_line(f"{mode} controls", MODES[mode][1], marker=MODES[mode][0], ls=MODES[mode][2], lw=1,
                      mfc="white" if mode == "frozen" else None) for mode in MODES if mode in modes]
    _legend(figure, handles)
    figure.suptitle(f"{measure} by {x}", fontsize=10)
    return figure


def _relation_order(relation: str) -> tuple:
    return relation == ALL_RELATIONS, relation


def _draw_depth(axis, rows: list[dict], x: str, colors: dict, nulls: set) -> set[str]:
    """A line per relation of one source's rows (value rows; the first null row of a point dashed); returns the
    relations drawn and adds the dashed nulls' names to ``nulls``."""
    series: dict[str, dict] = {}
    for row in rows:
        point = series.setdefault(row["relation"], {}).setdefault(row[x], {})
        point.setdefault("null" if row["null"] else "value", row)      # a value's first null: its primary
    for relation in sorted(series, key=_relation_order):
        points = {at: p for at, p in series[relation].items() if "value" in p}
        xs, color = sorted(points), colors.get(relation, NEUTRAL)
        axis.plot(xs, [points[at]["value"]["value"] for at in xs], marker="o", ms=3, color=color)
        if all(points[at]["value"]["lo"] is not None and points[at]["value"]["hi"] is not None for at in xs):
            axis.fill_between(xs, [points[at]["value"]["lo"] for at in xs], [points[at]["value"]["hi"] for at in xs],
                              color=color, alpha=0.15, lw=0)
        primary = [points[at].get("null") for at in xs]
        if all(c is not None and c["value"] is not None for c in primary):
            axis.plot(xs, [c["value"] for c in primary], ls="--", lw=1, color=color)
            nulls.update(c["null"] for c in primary)
    axis.grid(alpha=0.3)
    return set(series)


def _draw_widths(axis, matched: list[tuple[dict, list[dict]]], colors: dict, modes: set) -> set[str]:
    """The matched controls' value rows against their width d: a line per (mode, relation), 95% interval bars;
    returns the relations drawn and adds the modes to ``modes``."""
    series: dict[tuple[str, str], list] = {}
    for source, rows in matched:
        for row in rows:
            if row["null"] is None and row["value"] is not None:
                series.setdefault((_mode(source), row["relation"]), []).append((model_of(source).d_model, row))
    for (mode, relation), points in sorted(series.items()):
        points = sorted((d, row) for d, row in points if d is not None)
        marker, _, style = MODES[mode]
        values = [row["value"] for _, row in points]
        errors = [[max(0.0, v - row["lo"]) if row["lo"] is not None else 0.0 for v, (_, row) in zip(values, points)],
                  [max(0.0, row["hi"] - v) if row["hi"] is not None else 0.0 for v, (_, row) in zip(values, points)]]
        axis.errorbar([d for d, _ in points], values, yerr=errors, marker=marker, ms=4, capsize=2, lw=1, ls=style,
                      color=colors.get(relation, NEUTRAL), mfc="white" if mode == "frozen" else None)
        modes.add(mode)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("width d (log scale)", fontsize=8)
    axis.grid(alpha=0.3)
    return {relation for _, relation in series}


def depth_measures(reports: list[dict]) -> list[str]:
    """The measures with layers that any of ``reports`` has, sorted."""
    return sorted({r["measure"] for report in reports for r in metric_rows(report) if r["layer"] is not None})


# ------------------------------------------------------------------------------ pretrained vs synthetic
def pretrained_reference(report: dict, relations: list[str]) -> tuple[str, dict | None, dict | None] | None:
    """(layer, R^2, pooled readout over ``relations``) of the pretrained report's superposition readouts at the
    layer with the highest cross-fitted R^2, the line the capacity figure draws (descriptive: chosen on the numbers
    shown; the claims choose their layers on validation, :mod:`llmprobe.report.claims`); None when it has none."""
    scored = _scored_layers(report)
    if not scored:
        return None
    layer = max(scored, key=lambda l: scored[l].r2["value"])
    readout = {name: m for name, m in scored[layer].readout.items() if name in relations}
    return layer, scored[layer].r2, pooled_readout(readout)


def _scored_layers(report: dict) -> dict[str, SuperpositionLayer]:
    """The report's superposition layers with an R^2 value, by layer key."""
    layers = analyses_of(report).superposition.layers
    return {l: e for l, e in layers.items() if e.r2 and e.r2.get("value") is not None}


def _superposition_at(report: dict) -> tuple[str, SuperpositionLayer] | None:
    """(label, layer entry) of a report's superposition readouts: a synthetic control's e_s, or the pretrained
    layer with the highest cross-fitted R^2 (descriptive: chosen on the held-out numbers it shows)."""
    scored = _scored_layers(report)
    if not scored:
        return None
    if report.get("kind") == "synthetic":
        return source_name(report), scored[min(scored, key=int)]
    layer = max(scored, key=lambda l: scored[l].r2["value"])
    return f"{source_name(report)} (layer {layer}, highest R^2)", scored[layer]


def comparison_plot(reports: list[dict], colors: dict | None = None):
    """Pretrained vs synthetic, a row of bars per source: readout accuracy per relation (left, the relation's
    colour) and R^2 (right), with 95% CIs and the shuffled control as a black tick; of the matched controls only
    the d* and the widest points (the whole curve is :func:`capacity_plot`). None without readouts."""
    colors = colors or relation_colors(reports)
    shown = []
    for owner, matched in owner_groups(reports):
        widest = max((model_of(c).d_model or 0 for c in matched), default=0)
        shown += ([owner] if owner else []) + [c for c in matched if str(c.get("label", "")).endswith("(d*)")
                                               or model_of(c).d_model == widest]
    sources = [s for s in (_superposition_at(r) for r in shown) if s]
    if not sources:
        return None
    relations = sorted({n for _, e in sources for n in e.readout})
    height = 0.8 / max(len(relations), 1)
    figure, (left, right) = subplots(1, 2, figsize=(10, 0.16 * len(sources) * max(len(relations), 2) + 1.6),
                                     sharey=True, width_ratios=[3, 1], layout="constrained")
    for index, (_, entry) in enumerate(sources):
        for k, relation in enumerate(relations):
            _bar(left, index + (k - (len(relations) - 1) / 2) * height, entry.readout.get(relation),
                 height, colors.get(relation, NEUTRAL))
        _bar(right, index, entry.r2, 0.6, NEUTRAL)
    left.set_yticks(range(len(sources)), [label for label, _ in sources], fontsize=7)
    left.invert_yaxis()
    left.set_xlim(0, 1.05)
    left.set_xlabel("readout accuracy (cross-fitted)", fontsize=8)
    right.set_xlabel("held-out R^2 (all relations)", fontsize=8)
    for axis in (left, right):
        axis.grid(axis="x", alpha=0.3)
    handles = [_line(relation, colors.get(relation, NEUTRAL), lw=6) for relation in relations]
    handles.append(_line("black tick: shuffled control", "black", marker="|", ms=10, ls="none"))
    _legend(figure, handles)
    figure.suptitle("Pretrained vs synthetic: superposition readouts (95% CIs)", fontsize=10)
    return figure


def _bar(axis, y: float, m: dict | None, height: float, color: str) -> None:
    """One horizontal bar of a typed metric at ``y`` with its 95% CI and its shuffled control as a black tick."""
    if not m or m.get("value") is None:
        return
    lo, hi = (m.get("ci") or [None, None])[:2]
    error = [[max(0.0, m["value"] - lo)], [max(0.0, hi - m["value"])]] if None not in (lo, hi) else None
    axis.barh([y], [m["value"]], height=height * 0.95, xerr=error, capsize=2, color=color, error_kw={"lw": 0.8})
    shuffled = null_value(m, "shuffled")
    if shuffled is not None:
        axis.scatter([shuffled], [y], marker="|", s=60, color="black", zorder=3)


# ---------------------------------------------------------------------------------- capacity curve
def _blocks(reports: list[dict]) -> list[tuple[dict, dict]]:
    """(pretrained report, a matched block) of every report with one (``matched.modes``): the graded control, then
    the all-facts control shown apart where the report has one (``matched.all_facts``)."""
    out = []
    for r in reports:
        block = r.get("matched")
        if isinstance(block, dict) and block.get("modes"):
            out.append((r, block))
            if isinstance(block.get("all_facts"), dict) and block["all_facts"].get("modes"):
                out.append((r, block["all_facts"]))
    return out


def controls_caption(reports: list[dict]) -> str:
    """Caption of :func:`capacity_plot`: what is compared with what, and which pretrained layer."""
    blocks = _blocks(reports)
    if not blocks:
        return "Capacity of the matched controls"
    parts = []
    for report, block in blocks:
        ref = pretrained_reference(report, MatchedBlock.from_dict(block).table.relations or [])
        parts.append(block.get("compared_with", "") + (
            f" Pretrained line and band: layer {ref[0]} of {source_name(report)}, the layer with the highest "
            f"cross-fitted R^2 (chosen on the numbers shown, which favours the pretrained model), and its 95% interval."
            if ref else f" {source_name(report)} has no superposition readouts to draw."))
    return ("Matched controls against width d (log scale): held-out R^2 of the superposition fit and readout "
            "accuracy (pooled over relations) of the controls' subject embeddings, with 95% intervals; dotted: the "
            "shuffled-table control. " + " ".join(parts))


def capacity_plot(reports: list[dict]):
    """The matched controls as a curve over width, a row per pretrained report with a controls block: R^2 (left)
    and pooled readout accuracy (right) against d (log scale) for each mode, with 95% intervals and the shuffled
    control dotted; the pretrained model's value at its highest-R^2 layer as a horizontal line with its interval
    band. Reports with the older per-control list draw the bisection's train accuracy against d instead. None
    without any control."""
    blocks = _blocks(reports)
    if not blocks:
        return _bisection_plot(reports)
    figure, axes = subplots(len(blocks), 2, figsize=(10, 3.1 * len(blocks) + 0.8), squeeze=False,
                            layout="constrained")
    handles = {}
    for (report, block), row_axes in zip(blocks, axes):
        ref = pretrained_reference(report, MatchedBlock.from_dict(block).table.relations or [])
        for axis, key, label in ((row_axes[0], "r2", "held-out R^2 of the superposition fit"),
                                 (row_axes[1], "readout_mean", "readout accuracy (pooled over relations)")):
            for mode, entry in block["modes"].items():
                marker, color, _ = MODES.get(mode, ("o", NEUTRAL, "-"))
                points = sorted(entry.get("points") or [], key=lambda p: p["d"])
                metrics = [(p["d"], p.get(key) if key == "r2" else pooled_readout(p.get("readout"))) for p in points]
                metrics = [(d, m) for d, m in metrics if m and m.get("value") is not None]
                if not metrics:
                    continue
                ds, values = [d for d, _ in metrics], [m["value"] for _, m in metrics]
                lo = [max(0.0, v - (m["ci"][0] if m["ci"][0] is not None else v)) for v, (_, m) in zip(values, metrics)]
                hi = [max(0.0, (m["ci"][1] if m["ci"][1] is not None else v) - v) for v, (_, m) in zip(values, metrics)]
                d_star = Threshold.from_dict(entry.get("threshold")).d_star
                axis.errorbar(ds, values, yerr=[lo, hi], marker=marker, ms=4, capsize=2, color=color,
                              mfc="white" if mode == "frozen" else None)
                handles.setdefault(mode, _line(f"{mode} controls (d* = {d_star})" if len(blocks) == 1 else
                                               f"{mode} controls", color, marker=marker, lw=1,
                                               mfc="white" if mode == "frozen" else None))
                shuffled = [null_value(m, "shuffled") for _, m in metrics]
                if all(v is not None for v in shuffled):
                    axis.plot(ds, shuffled, ls=":", lw=1, color=color)
                    handles.setdefault("shuffled", _line("dotted: shuffled-table control", lw=1, ls=":"))
            m = (ref[1] if key == "r2" else ref[2]) if ref else None
            if m and m.get("value") is not None:
                axis.axhline(m["value"], color="black", lw=1.6)
                handles.setdefault("pretrained", _line("pretrained model (its highest-R^2 layer)", "black"))
                if None not in (m.get("ci") or [None, None])[:2]:
                    axis.axhspan(m["ci"][0], m["ci"][1], color="black", alpha=0.12, lw=0)
            axis.set_xscale("log", base=2)
            axis.set_xlabel("width d (log scale)", fontsize=8)
            axis.set_ylabel(label, fontsize=8)
            axis.grid(alpha=0.3)
            axis.set_title(f"{source_name(report)}" + (f" (layer {ref[0]})" if ref else "")
                           + f"; controls: {MatchedBlock.from_dict(block).described()}"
                           + ("" if block is report["matched"] else " (shown apart, not graded)"), fontsize=9)
        row_axes[1].set_ylim(0, 1.05)
    _legend(figure, list(handles.values()))
    figure.suptitle("Matched controls on the pretrained fit's fact table, against width", fontsize=10)
    return figure


def capacity_figure(reports: list[dict]) -> str | None:
    """:func:`capacity_plot` as a PNG data URI (None without any control)."""
    figure = capacity_plot(reports)
    return None if figure is None else png_data_uri(figure)


def _bisection_plot(reports: list[dict]):
    """Reports written before the matched block: the controls' train accuracy against width d, d* marked."""
    curves = {}
    for report in reports:
        threshold = Threshold.from_dict(report.get("threshold"))
        if report.get("kind") == "synthetic" and threshold.tried:
            points = [t for t in threshold.tried if isinstance(t, dict)]
            curves[_mode(report)] = (sorted((t["d"], t["accuracy"]) for t in points), threshold.d_star)
    if not curves:
        return None
    figure, axis = subplots(figsize=(6, 3.6), layout="constrained")
    handles = []
    for index, (mode, (points, d_star)) in enumerate(sorted(curves.items())):
        marker, color, _ = MODES[mode]
        axis.plot([d for d, _ in points], [a for _, a in points], marker=marker, color=color)
        handles.append(_line(f"{mode} subjects (d* = {d_star})", color, marker=marker, lw=1))
        if d_star is not None:
            axis.axvline(d_star, color=color, ls=":", lw=1)
            axis.annotate(f"d* = {d_star}", (d_star, 0.02 + 0.08 * index), color=color, fontsize=7)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("width d (log scale)")
    axis.set_ylabel("train accuracy")
    axis.set_ylim(0, 1.05)
    axis.set_title("Matched controls: capacity (bisection on d; d* = smallest width at 100%)", fontsize=9)
    _legend(figure, handles)
    return figure


# ---------------------------------------------------------------------------------- ablation heatmaps
def ablation_plots(reports: list[dict]) -> list[tuple[str, object, bool]]:
    """(caption, figure, folded) of the matched controls' MLP ablations: heatmaps of the accuracy drop on
    relation r (column) when the units most tied to relation q (row) are zeroed, beside the same number of random
    live units; the controls at d* open, the other widths folded (one grid each)."""
    panels = []
    for report in reports:
        selector = analyses_of(report).selector
        if report.get("kind") == "synthetic" and selector.ablation_drop:
            panels.append((report, selector))
    at_star = [(r, s) for r, s in panels if str(r.get("label", "")).endswith("(d*)")] or panels[:1]
    others = [(r, s) for r, s in panels if all(r is not o for o, _ in at_star)]
    return [(caption, _heatmap_grid(group), folded) for caption, group, folded in (
        ("MLP ablations of the matched controls at d*", at_star, False),
        (f"MLP ablations of the matched controls at the other {len(others)} widths", others, True)) if group]


def _heatmap_grid(panels: list[tuple[dict, SelectorResult]]):
    """Two heatmaps per control (relation units, random units), two controls to a row, one colour bar."""
    cols = 4 if len(panels) > 1 else 2
    rows = -(-2 * len(panels) // cols)
    figure, axes = subplots(rows, cols, figsize=(2.6 * cols + 0.8, 2.6 * rows + 0.4), squeeze=False,
                            layout="constrained")
    image = None
    cells = [(report, what, drop, selector.relations) for report, selector in panels
             for what, drop in (("relation units", selector.ablation_drop),
                                ("random units", selector.random_ablation_drop))]
    for axis, (report, what, drop, names) in zip(axes.flat, cells):
        image = axis.imshow(drop, vmin=0, vmax=1, cmap="viridis")
        ticks = [n if len(n) <= 12 else n[:11] + "." for n in names]
        size = 6 if len(names) <= 8 else 4
        axis.set_xticks(range(len(names)), ticks, rotation=90, fontsize=size)
        axis.set_yticks(range(len(names)), ticks, fontsize=size)
        axis.set_title(f"{source_name(report)}:\n{what}", fontsize=7)
    for axis in list(axes.flat)[len(cells):]:
        axis.axis("off")
    figure.colorbar(image, ax=axes, fraction=0.03, label="accuracy drop on relation (column) when the units tied "
                                                         "to the row's relation are zeroed")
    return figure


# ------------------------------------------------------------------------------------------- the page
def report_figures(reports: list[dict]) -> list[tuple[str, object, bool]]:
    """(caption, figure, folded) of the page's plots, one colour per relation in all of them: per-depth curves
    (``KEY_MEASURES`` open, the others folded), the pretrained-vs-synthetic bars, the capacity curve and the
    ablation heatmaps where the reports have them."""
    colors = relation_colors(reports)
    figures = [(f"{measure} by depth", depth_plot(reports, measure, colors=colors), measure not in KEY_MEASURES)
               for measure in depth_measures(reports)]
    figures += [("Pretrained vs synthetic controls: readout accuracy and R^2", comparison_plot(reports, colors),
                 False), (controls_caption(reports), capacity_plot(reports), False)]
    return [(caption, figure, folded) for caption, figure, folded in figures + ablation_plots(reports)
            if figure is not None]

