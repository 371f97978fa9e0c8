"""The HTML report renders in a real browser: headless Chromium draws its tables and embedded plots, the summary
comes first and no image is broken.

Skipped where no Chromium/Chrome binary is installed (the page itself is built and checked in test_report.py)."""
import html
import json
import re
import shutil
import subprocess

import pytest
from test_report import test_run_page_shows_selected_layers_controls_capacity_and_ablations as build_page

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


def _browser_view(page_html: str, folder) -> dict:
    """What headless Chromium sees of a page: the id of the body's first element, images, broken images, summary
    lines."""
    page = folder / "check.html"
    page.write_text(page_html.replace("</body>", CHECK_SCRIPT + "</body>"), encoding="utf-8")
    run = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'data-check="([^"]*)"', run.stdout)
    assert run.returncode == 0 and found, run.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium/Chrome installed")
def test_summary_comes_first_and_no_image_is_broken_in_headless_chromium(tmp_path):
    build_page(tmp_path)
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    view = _browser_view(page, tmp_path)
    assert view == {"first": "summary", "images": view["images"], "broken": 0, "claims": 5} and view["images"] >= 4
    planted = page.replace("src='data:image/png;base64,", "src='data:image/png;base64,AAAA", 1)   # a corrupt PNG
    assert _browser_view(planted, tmp_path)["broken"] == 1
