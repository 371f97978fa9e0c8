"""Reports: report.json -> self-contained HTML (plots embedded), Markdown and CSV tables; side-by-side comparison.

Every measured number is first flattened into *metric rows* (one dict per source x relation x layer x metric,
with its interval and control), so the same renderers serve a single run and a comparison of many.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path

from .io import write_text

ROW_FIELDS = ("source", "kind", "relation", "layer", "depth", "metric", "value", "lo", "hi", "control",
              "control_value", "n")


def load_report(path: str | Path) -> dict:
    """Read ``DIR/report.json`` (or the JSON file itself) with a clear error when it is missing or malformed."""
    path = Path(path)
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no report.json at {path}")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if "schema_version" not in report:
        raise ValueError(f"{file}: not an llmprobe report (no 'schema_version')")
    report.setdefault("_path", str(file.parent))
    return report


def source_name(report: dict) -> str:
    """A short label for a report: the model name, or the synthetic control's description."""
    if report.get("kind") == "synthetic":
        return report.get("label") or "synthetic"
    return report.get("model", {}).get("name", "model")


def metric_rows(report: dict) -> list[dict]:
    """Flatten every measured number of a report into rows with the keys in ``ROW_FIELDS``.

    Known-fact rates become rows with metric ``known_rate`` and no layer; the analyses (pretrained, or a
    synthetic control's readouts in the same layout) contribute one row per relation, layer, metric and control,
    as listed by :func:`llmprobe.analyses.table_rows`.
    """
    from .analyses import table_rows

    source, kind = source_name(report), report.get("kind", "pretrained")
    n_layers = max(report.get("model", {}).get("n_layers") or 1, 1)
    rows = []
    for name, rel in report.get("relations", {}).items():
        rows.append(_row(source, kind, name, None, None, "known_rate", rel.get("known_rate"), n=rel.get("n_facts")))
    for entry in table_rows(report.get("analyses") or {}):
        layer = entry["layer"]
        depth = layer / (n_layers - 1) if n_layers > 1 else 0.0
        lo, hi = (entry.get("ci") or [None, None])[:2]
        controls = entry.get("controls") or {}
        if entry.get("control") and entry["control"] not in controls:
            controls = {entry["control"]: entry.get("control_value"), **controls}
        metric = f"{entry['analysis']}.{entry['metric']}"
        if not controls:
            rows.append(_row(source, kind, entry["relation"], layer, depth, metric, entry["value"], lo, hi))
        for control, value in controls.items():
            rows.append(_row(source, kind, entry["relation"], layer, depth, metric, entry["value"], lo, hi, control,
                             value))
    return rows


def _row(source, kind, relation, layer, depth, metric, value, lo=None, hi=None, control=None, control_value=None,
         n=None) -> dict:
    return dict(zip(ROW_FIELDS, (source, kind, relation, layer, depth, metric, value, lo, hi, control,
                                 control_value, n)))


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """The metric rows as one CSV table (atomic write)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=ROW_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    return write_text(path, buffer.getvalue())


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _png_data_uri(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def layer_figures(rows: list[dict]) -> list[tuple[str, str]]:
    """One plot per metric: value against normalised depth per (source, relation), CI band, control dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    metrics = sorted({r["metric"] for r in rows if r["layer"] is not None})
    for metric in metrics:
        chosen = [r for r in rows if r["metric"] == metric and r["layer"] is not None]
        figure, axis = plt.subplots(figsize=(7, 3.6))
        series = sorted({(r["source"], r["relation"]) for r in chosen}, key=str)
        for index, (source, relation) in enumerate(series[:12]):
            points = {}
            for r in chosen:
                if (r["source"], r["relation"]) == (source, relation):
                    points.setdefault(r["depth"], r)
            depths = sorted(points)
            color = f"C{index % 10}"
            label = relation if len({s for s, _ in series}) == 1 else f"{source}: {relation}"
            axis.plot(depths, [points[d]["value"] for d in depths], marker="o", ms=3, color=color, label=label)
            if all(points[d]["lo"] is not None for d in depths):
                axis.fill_between(depths, [points[d]["lo"] for d in depths], [points[d]["hi"] for d in depths],
                                  color=color, alpha=0.15)
            controls = [points[d]["control_value"] for d in depths]
            if all(c is not None for c in controls):
                axis.plot(depths, controls, ls="--", lw=1, color=color)
        axis.set_xlabel("normalised depth (layer / last layer)")
        axis.set_ylabel(metric)
        axis.set_title(f"{metric} by depth (dashed: control)")
        axis.legend(fontsize=6, ncol=2)
        figures.append((metric, _png_data_uri(figure)))
    return figures


def _table_html(header: list[str], body: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    lines = ["<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in body]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _table_md(header: list[str], body: list[list]) -> str:
    def cell(value):
        return _fmt(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def summary_tables(reports: list[dict], rows: list[dict]) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, body) tables shared by the HTML and Markdown renderers."""
    tables = []
    models = [[source_name(r), r.get("kind"), r.get("model", {}).get("architecture"),
               r.get("model", {}).get("n_layers"), r.get("model", {}).get("d_model"),
               (r.get("model", {}).get("weights_hash") or "")[:19], r.get("wall_seconds")] for r in reports]
    tables.append(("Sources", ["source", "kind", "architecture", "layers", "d_model", "weights", "wall s"], models))
    known = [[r["source"], r["relation"], r["n"], r["value"]] for r in rows if r["metric"] == "known_rate"]
    if known:
        tables.append(("Known facts (greedy continuation starts with the object)",
                       ["source", "relation", "facts", "known rate"], known))
    best = {}
    for r in rows:
        if r["layer"] is None or r["value"] is None:
            continue
        key = (r["source"], r["relation"], r["metric"], r["control"])
        if key not in best or r["value"] > best[key]["value"]:
            best[key] = r
    if best:
        body = [[r["source"], r["relation"], r["metric"], r["layer"], r["value"], r["lo"], r["hi"], r["control"],
                 r["control_value"]] for r in sorted(best.values(), key=lambda r: (r["metric"], r["relation"],
                                                                                     r["source"], str(r["control"])))]
        tables.append(("Highest value over layers per relation and metric (descriptive: picked on test numbers; "
                       "the validation-selected layer is in report.json, analyses.selected)",
                       ["source", "relation", "metric", "layer", "value", "lo", "hi", "control", "control value"],
                       body))
    return tables


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}.err{color:#a00}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:1.6em}"""


def render_html(reports: list[dict], title: str, extra_images: list[tuple[str, str]] = ()) -> str:
    """A self-contained page: tables, per-depth curves with intervals and controls, and any extra images.

    ``extra_images``: (caption, data URI or path to a PNG) pairs, e.g. synthetic capacity plots. Every user
    string is escaped.
    """
    rows = [row for report in reports for row in metric_rows(report)]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    for caption, header, body in summary_tables(reports, rows):
        parts.append(f"<h2>{html.escape(caption)}</h2>{_table_html(header, body)}")
    for metric, uri in layer_figures(rows):
        parts.append(f"<h2>{html.escape(metric)}</h2><img alt='{html.escape(metric)}' src='{uri}'>")
    for caption, image in extra_images:
        if not image.startswith("data:"):
            path = Path(image)
            if not path.is_file():
                continue
            image = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(caption)}</h2><img alt='{html.escape(caption)}' src='{image}'>")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        items = "".join(f"<li class='err'>{html.escape(str(e))}</li>" for e in errors)
        parts.append(f"<h2>Errors and skipped facts</h2><ul>{items}</ul>")
    parts.append("</body></html>")
    return "".join(parts)


def render_markdown(reports: list[dict], title: str) -> str:
    rows = [row for report in reports for row in metric_rows(report)]
    parts = [f"# {title}"]
    for caption, header, body in summary_tables(reports, rows):
        parts.append(f"## {caption}\n\n{_table_md(header, body)}")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        parts.append("## Errors and skipped facts\n\n" + "\n".join(f"- {e}" for e in errors))
    return "\n\n".join(parts) + "\n"


def export(report_dir: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"), out: str | Path | None = None,
           extra_images: list[tuple[str, str]] = ()) -> list[Path]:
    """Write report.html / report.md / metrics.csv for the report in ``report_dir`` (into ``out`` or beside it)."""
    report = load_report(report_dir)
    return write_all([report], Path(out or report_dir), f"llmprobe report: {source_name(report)}", formats,
                     extra_images)


def compare(report_dirs: list[str | Path], out: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"),
            ) -> list[Path]:
    """Side-by-side page of any number of reports, aligned on relations and normalised depth."""
    if len(report_dirs) < 1:
        raise ValueError("compare needs at least one report directory")
    reports = [load_report(d) for d in report_dirs]
    for report in reports:  # a run's matched synthetic controls are reports in their own right
        reports += [dict(c, schema_version=report["schema_version"]) for c in report.get("controls", [])]
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
        from .io import write_json

        written.append(write_json(out / "metrics.json", rows))
    return written
