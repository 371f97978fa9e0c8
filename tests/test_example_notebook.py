"""examples/quickstart.ipynb runs from its first cell to its last, in a kernel of its own, on a tiny random-init
Llama (the notebook takes the facts as known there): every cell without an error, the claims printed, the decoder
saved and loaded back predicting the same ids (the notebook's own assert)."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_the_quickstart_notebook_runs_on_a_tiny_model(tmp_path, monkeypatch):
    folder = save_tiny("llama", tmp_path / "tiny")
    monkeypatch.setenv("LLMPROBE_EXAMPLE_MODEL", str(folder))      # the kernel inherits the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")   # kept clean
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    printed = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for out in cell.outputs)
    assert "attributes linearly decodable:" in printed and "LRE edits causal:" in printed
    assert "country_capital: " in printed and " facts known" in printed
    assert (tmp_path / "runs" / "quickstart" / "report.html").is_file()
    assert (tmp_path / "runs" / "capital_decoder" / "decoder.safetensors").is_file()
