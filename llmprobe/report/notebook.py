"""Notebook API: a report folder as an object (the decoders saved beside it: ``llmprobe.analyses.saved``).

    import llmprobe
    report = llmprobe.load_report("runs/smollm2")      # shows the summary and key plots in Jupyter
    frame = report.to_frame()                          # tidy pandas table (pandas: the ``notebook`` extra)
    report.plot("lre.faithfulness")                    # a matplotlib figure: the measure by layer, intervals

pandas and matplotlib are imported only by the methods that need them.
"""
from __future__ import annotations

from pathlib import Path

from llmprobe.report.claims import summary_claims
from llmprobe.report.figures import KEY_MEASURES, depth_measures, depth_plot, figure_key, png_data_uri, relation_colors
from llmprobe.report.render import figure_html, label_apart, summary_html, with_matched
from llmprobe.report.schema import ROW_FIELDS, metric_rows, read_report, source_name

FRAME_COLUMNS = ROW_FIELDS           # to_frame's columns: those of metrics.csv's metric rows


# ------------------------------------------------------------------------------------------------ the report
class Report:
    """A report folder: ``data`` (report.json as a dict, controls expanded into ``sources``), ``_repr_html_``
    (the summary and key plots), ``to_frame()`` and ``plot(measure)``."""

    def __init__(self, data: dict):
        self.data = data
        self.sources = label_apart(with_matched([data]))

    @property
    def rows(self) -> list[dict]:
        """Every measured number as a metric row (``llmprobe.report.render.metric_rows``)."""
        return [row for source in self.sources for row in metric_rows(source)]

    @property
    def claims(self) -> list[dict]:
        """The summary's lines: one per claim of the paper, with its verdict (``llmprobe.report.claims.summary_claims``)."""
        return summary_claims(self.data)

    def __repr__(self) -> str:
        lines = [f"llmprobe report: {source_name(self.data)} ({self.data.get('_path', '')})"]
        lines += [f"  {c['claim']}: {c['verdict']}" for c in self.claims]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The summary section and the key per-depth plots (``KEY_MEASURES``), every user string escaped."""
        colors = relation_colors(self.sources)
        figures = [(measure, depth_plot(self.sources, measure, colors=colors)) for measure in depth_measures(self.sources)
                   if measure in KEY_MEASURES]
        return "<div>" + summary_html(self.sources, f"llmprobe report: {source_name(self.data)}") + "".join(
            figure_html(f"{measure} by depth", png_data_uri(figure), figure_key(figure)) for measure, figure in figures
        ) + "</div>"

    def to_frame(self):
        """Tidy pandas DataFrame, one row per number, the columns of metrics.csv (``FRAME_COLUMNS``): each
        measure's value row (``control`` empty; its interval and n), then a row per control of it (``control`` =
        its name; ``value``, ``lo``, ``hi``, ``n`` = the control's own)."""
        import pandas as pd

        frame = pd.DataFrame(self.rows, columns=list(FRAME_COLUMNS))
        return frame.astype({"layer": "Int64", "n": "Int64", "value": float, "lo": float, "hi": float,
                             "depth": float})

    def plot(self, measure: str):
        """A matplotlib figure of ``measure`` by layer: a panel per source, a line per relation, its 95% interval
        as a band, its primary control dashed, the matched controls beside it against width
        (``llmprobe.report.figures.depth_plot``), built without pyplot: the notebook's backend stays as it is and
        pyplot holds no new figure (Jupyter shows it as the cell's value). Raises ValueError naming the measures."""
        measures = depth_measures(self.sources)
        if measure not in measures:
            raise ValueError(f"no measure {measure!r} by layer in this report; measures: {', '.join(measures)}")
        return depth_plot(self.sources, measure, x="layer")


def load_report(path: str | Path) -> Report:
    """The report in folder ``path`` (or its report.json) as a :class:`Report`; clear errors for a missing or
    malformed file (``llmprobe.report.schema.read_report``)."""
    return Report(read_report(path))
