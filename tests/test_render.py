"""The HTML report renders in a real browser: headless Chromium draws its tables and embedded plots, the summary
comes first and no image is broken.

Skipped where no Chromium/Chrome binary is installed (the page itself is built and checked in test_report.py)."""
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_report import test_run_page_shows_selected_layers_controls_capacity_and_ablations as build_page

from llmprobe.report.claims import CLAIMS

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "chrome")
                if shutil.which(b)), None)


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium/Chrome installed")
def test_report_renders_in_headless_chromium(tmp_path):
    import numpy as np
    from PIL import Image

    build_page(tmp_path)
    page = tmp_path / "out" / "report.html"
    shot = tmp_path / "shot.png"
    run = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1100,4000", f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 4000)
    hsv = np.asarray(image.convert("HSV")).reshape(-1, 3).astype(int)
    colored = int(((hsv[:, 1] > 120) & (hsv[:, 2] > 60)).sum())    # plot colours; tables and text are grey
    assert colored > 20_000, f"only {colored} coloured pixels: the embedded plots did not render"
    dark = int((np.asarray(image).astype(int).sum(-1) < 150).sum())
    assert dark > 5_000, "no text was drawn"
    # the page is self-contained: nothing but data: URIs are loaded
    assert "src='http" not in page.read_text() and json.loads((tmp_path / "run" / "report.json").read_text())


# Appended to a copy of the page (the report itself has no script): once the page and its images are loaded, the
# browser's own view of it goes into an attribute that --dump-dom prints.
CHECK_SCRIPT = """<script>window.addEventListener('load', () => {
  const images = [...document.images];
  document.body.setAttribute('data-check', JSON.stringify({
    first: document.body.firstElementChild.id, images: images.length,
    broken: images.filter(i => !i.complete || i.naturalWidth === 0).length,
    claims: document.querySelectorAll('#summary tbody tr').length}));
});</script>"""


def _browser_view(page_html: str, folder, script: str = CHECK_SCRIPT, window: str | None = None) -> dict:
    """What headless Chromium sees of a page: the JSON that ``script`` (appended to a copy of the page) puts into
    the body's data-check attribute once the page is loaded (default: the id of the body's first element, images,
    broken images, summary lines); ``window`` "W,H" sets the window size."""
    page = folder / "check.html"
    page.write_text(page_html.replace("</body>", script + "</body>"), encoding="utf-8")
    size = [f"--window-size={window}"] if window else []
    run = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", *size,
                          "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'data-check="([^"]*)"', run.stdout)
    assert run.returncode == 0 and found, run.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium/Chrome installed")
def test_summary_comes_first_and_no_image_is_broken_in_headless_chromium(tmp_path):
    build_page(tmp_path)
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    view = _browser_view(page, tmp_path)
    assert view == {"first": "summary", "images": view["images"], "broken": 0, "claims": len(CLAIMS)} and view["images"] >= 4
    planted = page.replace("src='data:image/png;base64,", "src='data:image/png;base64,AAAA", 1)   # a corrupt PNG
    assert _browser_view(planted, tmp_path)["broken"] == 1


# ------------------------------------------------------------------ the figures (issue 25, item 5)
RELATIONS = [f"relation_{i:02d}" for i in range(14)]              # more than the 12 entries legends used to keep
WIDTHS = (3, 6, 12, 24, 48, 96, 192, 384, 576)                    # 18 controls per model: 19 sources each


def _pages(tmp_path):
    """Two model folders (llama-like and qwen-like), 14 relations each (13 shared), 9 control widths per mode."""
    from test_report import page_report, write_report

    a = write_report(tmp_path / "a", page_report("/models/llama", RELATIONS[:13] + ["only_llama"], widths=WIDTHS))
    b = write_report(tmp_path / "b", page_report("/models/qwen2", RELATIONS[:13] + ["only_qwen2"], widths=WIDTHS))
    return a, b


def _sources(folders):
    from llmprobe.report.render import label_apart, with_matched
    from llmprobe.report.schema import read_report

    return label_apart(with_matched([read_report(f) for f in folders]))


def test_every_figure_names_every_source_and_relation_it_draws(tmp_path):
    """Counted in matplotlib: every by-depth figure has a panel per model and one legend entry per relation
    (14 per model, 15 on the compare page); the 18 matched controls per model are points against width in a
    panel of their own (never at a depth); the bars have a row per source shown; ablations of the d* controls
    open, the other widths folded."""
    from llmprobe.report.figures import ALL_RELATIONS, figure_key, report_figures

    sources = _sources(_pages(tmp_path))
    relations = set(RELATIONS[:13]) | {"only_llama", "only_qwen2"}
    figures = report_figures(sources)
    depth = {caption: figure for caption, figure, _ in figures if caption.endswith(" by depth")}
    assert set(depth) == {f"{m} by depth" for m in ("lre.causality", "lre.faithfulness", "superposition.r2",
                                                    "superposition.readout_accuracy")}
    for caption, figure in depth.items():
        key = figure_key(figure)
        assert key["panels"][:1] == ["llama"] and "qwen2" in key["panels"]
        drawn = {"all relations"} if caption.startswith("superposition.r2") else relations
        assert {e for e in key["legend"] if e.startswith(("relation_", "only_", "all relations"))} == drawn
        assert len(key["legend"]) == len(set(key["legend"]))
    readout = depth["superposition.readout_accuracy by depth"]
    panels = {axis.get_title(): axis for axis in readout.axes}
    assert set(panels) == {"llama", "qwen2", "llama: matched controls (one layer)", "qwen2: matched controls (one layer)"}
    for model in ("llama", "qwen2"):
        by_depth = [line for line in panels[model].lines if line.get_linestyle() == "-"]
        assert len(by_depth) == 14 and all(list(line.get_xdata()) == [0, 1 / 3, 2 / 3, 1] for line in by_depth)
        widths = [line for line in panels[f"{model}: matched controls (one layer)"].lines
                  if line.get_marker() in ("o", "s")]                    # the curves, not the error bars' caps
        assert len(widths) == 2 * 14 and all(tuple(line.get_xdata()) == WIDTHS for line in widths)
    assert ALL_RELATIONS not in relations
    bars = next(f for c, f, _ in figures if c.startswith("Pretrained vs synthetic"))
    labels = [t.get_text() for t in bars.axes[0].get_yticklabels()]
    assert labels == ["llama (layer 3, highest R^2)", "llama: synthetic trainable d=3 (d*)",
                      "llama: synthetic trainable d=576", "llama: synthetic frozen d=3 (d*)",
                      "llama: synthetic frozen d=576", "qwen2 (layer 3, highest R^2)",
                      "qwen2: synthetic trainable d=3 (d*)", "qwen2: synthetic trainable d=576",
                      "qwen2: synthetic frozen d=3 (d*)", "qwen2: synthetic frozen d=576"]
    ablations = [(c, f, folded) for c, f, folded in figures if c.startswith("MLP ablations")]
    assert [(len(f.axes) - 1, folded) for _, f, folded in ablations] == [(8, False), (2 * 2 * 8 * 2, True)]


def test_one_colour_per_relation_in_every_figure(tmp_path):
    """A relation has the same colour in every figure of the page (legends, lines, bars, the controls' curves),
    and no two relations share one: 15 relations, 15 colours."""
    from matplotlib.colors import to_hex

    from llmprobe.report.figures import relation_colors, report_figures

    sources = _sources(_pages(tmp_path))
    colors = relation_colors(sources)
    named = {r: c for r, c in colors.items() if r != "(all)"}
    assert len(named) == 15 and len(set(named.values())) == 15
    for caption, figure, _ in report_figures(sources):
        for legend in figure.legends:
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                if text.get_text() in named:
                    assert to_hex(handle.get_color()) == named[text.get_text()], (caption, text.get_text())
        if caption.endswith(" by depth"):
            drawn = {to_hex(line.get_color()) for axis in figure.axes for line in axis.lines}
            assert drawn <= set(colors.values()) | {"#000000"}, caption
        if caption.startswith("Pretrained vs synthetic"):
            bars = {to_hex(patch.get_facecolor()) for patch in figure.axes[0].patches}
            assert bars == set(named.values())


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium/Chrome installed")
def test_the_compare_page_at_1200_px_names_every_source_in_its_figures(tmp_path):
    """In headless Chromium at 1200 px: every by-depth figure's legend (carried by its <figure>) has an entry per
    relation of the known-facts table and a panel per model of the Sources table; no image is wider than the
    window; the heatmaps of the other widths are folded, so the page stays short."""
    from llmprobe.report.render import compare

    compare(list(_pages(tmp_path)), tmp_path / "cmp")
    page = (tmp_path / "cmp" / "report.html").read_text(encoding="utf-8")
    script = """<script>window.addEventListener('load', () => {
      const tables = [...document.querySelectorAll('h2')];
      const rowsOf = (title) => { const table = tables.find(h => h.textContent.startsWith(title)).nextElementSibling;
        return [...table.querySelectorAll('tbody tr')].map(tr => [...tr.children].map(td => td.textContent)); };
      const figures = [...document.querySelectorAll('figure')].filter(f => f.offsetParent !== null);
      document.body.setAttribute('data-check', JSON.stringify({
        known: rowsOf('Known facts').map(r => r[1]), models: rowsOf('Sources').filter(r => r[1] === 'pretrained').map(r => r[0]),
        figures: figures.map(f => ({title: f.querySelector('h2').textContent, legend: JSON.parse(f.dataset.legend),
          panels: JSON.parse(f.dataset.panels), right: f.querySelector('img').getBoundingClientRect().right})),
        width: window.innerWidth, scroll: document.documentElement.scrollWidth, height: document.body.scrollHeight}));
    });</script>"""
    view = _browser_view(page, tmp_path, script, window="1200,2000")
    relations, models = set(view["known"]), view["models"]
    assert len(relations) == 15 and models == ["llama", "qwen2"]
    depth = [f for f in view["figures"] if f["title"].endswith(" by depth")]
    assert len(depth) == 4
    for figure in depth:
        named = set(figure["legend"]) & relations
        assert named == relations or figure["title"].startswith("superposition.r2"), figure["title"]
        assert [p for p in figure["panels"] if p in models] == models
    assert all(f["right"] <= view["width"] for f in view["figures"]) and view["scroll"] <= view["width"]
    assert view["height"] < 15_000, view["height"]


# ------------------------------------------------------------------ the summary at 1200 px (issue 25)
# The claims block's lines of a full run (SmolLM2-135M-Instruct, every stage): the long measures, nulls, notes and
# comparisons a real summary shows.
FULL_LINES = Path(__file__).parent / "data" / "summary_lines_smollm2.json"


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium/Chrome installed")
def test_the_summary_table_fits_a_1200_px_window(tmp_path, monkeypatch):
    """In headless Chromium at 1200 px, the summary of a full run's claims is no wider than its section, nor the
    page than the window, and no cell's text is cut: the measure cell is a short label (the full measure its title
    and a numbered note below the table, each once), every column wraps."""
    from test_report import _claims_report

    import llmprobe.report.render as render

    lines = json.loads(FULL_LINES.read_text(encoding="utf-8"))
    monkeypatch.setattr(render, "claims_block", lambda report: {"lines": lines})
    page = render.render_html([_claims_report()], "llmprobe report: SmolLM2-135M-Instruct")
    script = """<script>window.addEventListener('load', () => {
      const section = document.querySelector('#summary'), table = section.querySelector('table');
      const cells = [...table.querySelectorAll('td, th')];
      document.body.setAttribute('data-check', JSON.stringify({
        table: table.scrollWidth, right: table.getBoundingClientRect().right, section: section.clientWidth,
        window: window.innerWidth, page: document.documentElement.scrollWidth,
        cut: cells.filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.textContent),
        measures: [...table.querySelectorAll('tbody tr')].map(tr => tr.children[1].textContent),
        titles: [...table.querySelectorAll('tbody tr')].map(tr => tr.children[1].title),
        notes: [...section.querySelectorAll('.measures li')].map(li => li.textContent)}));
    });</script>"""
    view = _browser_view(page, tmp_path, script, window="1200,1600")
    assert view["window"] == 1200
    assert view["table"] <= view["section"] and view["right"] <= view["window"], view
    assert view["page"] <= view["window"] and view["cut"] == [], view
    full = [line["measure"] for line in lines]
    assert view["titles"] == full and view["notes"] == full
    assert all(len(label) <= 40 for label in view["measures"]), view["measures"]
