"""The notebook API on a real (tiny-model) probe: load_report's summary, tidy frame and plots; the fitted
decoders saved beside report.json and loaded back in a fresh process with the very same predictions and edits."""
import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import D, save_tiny

import llmprobe
import llmprobe.analyses.run
import llmprobe.model.known as known_module
from llmprobe.analyses.decoders import SVD
from llmprobe.io import figure_png
from llmprobe.jobs.probe import probe

# small and fast; ranks=(4,) with one candidate forces a truncated W (so J is saved for the edits)
OPTIONS = dict(n_splits=2, n_boot=50, folds=3, max_val_pairs=3, max_test_pairs=5, max_swap_subjects=3,
               random_control=False, betas=(1.0,), ranks=(4,), edit_ranks=(8, 16),
               ridge_alphas=(0.1, 10.0))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """probe on a tiny Llama with every fact forced known; returns (folder, the fits the analyses kept, a function
    that runs the same probe into another folder)."""
    tmp = tmp_path_factory.mktemp("notebook")
    rows = [{"subject": s, "object": o} for s, o in zip([f"Land{i}" for i in range(24)],
                                                        ["Paris", "Tokyo", "Rome", "Cairo"] * 6)]
    rel = tmp / "capital.json"
    rel.write_text(json.dumps({"name": "capital<b>", "templates": ["The capital of {} is"],
                               "neutral_templates": ["{}"], "facts": rows}))
    real_run, seen = llmprobe.analyses.run.run_analyses, {}

    def spy(*args, **kwargs):                       # keeps the very fits the analyses made, as probe passes them
        seen["fitted"] = kwargs["runner"].fitted
        return real_run(*args, progress=False, **kwargs)

    model = str(save_tiny("llama", tmp / "llama"))

    def again(out, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(known_module, "is_known", lambda text, obj: True)      # a random model knows nothing
            mp.setattr(llmprobe.analyses.run, "run_analyses", spy)
            probe(model, relations=[str(rel)], layers="0,1,2", device="cpu", analyses="lre,ridge,superposition",
                  out=out, analysis_options=OPTIONS, **kwargs)

    again(tmp / "run")
    return tmp / "run", seen["fitted"], again


def test_decoders_are_saved_at_the_chosen_layers(run):
    folder, fitted, _ = run
    report = json.loads((folder / "report.json").read_text())
    index = json.loads((folder / "decoders.json").read_text())
    selected = report["analyses"]["relations"]["capital<b>"]["selected"]
    assert {(e["relation"], e["kind"], e["layer"]) for e in index["decoders"]} == {
        ("capital<b>", kind, selected[kind]["layer"]) for kind in ("lre", "ridge")}
    lre = next(e for e in index["decoders"] if e["kind"] == "lre")
    assert lre["rank"] == 4 and lre["edit_rank"] in (8, 16) and set(lre["tensors"]) == {"W", "b", "J"}
    assert lre["h"] == f"h = blocks.{lre['layer']}.resid_post at the subject's last token"
    assert index["model"]["weights"] == report["model"]["weights_hash"]
    assert torch.linalg.matrix_rank(fitted["capital<b>"]["lre"]["W"]) == 4      # truncated, as saved


def test_decoders_load_in_a_fresh_process_with_the_same_predictions_and_edits(run, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, fitted, _ = run
    g = torch.Generator().manual_seed(0)
    h, o_s, o_t = (torch.randn(5, D, generator=g, dtype=torch.float64) for _ in range(3))
    save_file({"h": h, "o_s": o_s, "o_t": o_t}, str(tmp_path / "inputs.safetensors"))   # cloned on load: aligned
    script = (f"import llmprobe, torch, safetensors.torch as st\ntorch.set_num_threads(1)\n"
              f"x = {{k: v.clone() for k, v in st.load_file({str(tmp_path / 'inputs.safetensors')!r}).items()}}\n"
              f"out = {{}}\n"
              f"for kind in ('lre', 'ridge'):\n"
              f"    dec = llmprobe.load_decoder({str(folder)!r}, 'capital<b>', kind)\n"
              f"    out[kind + '.o'] = dec.apply(x['h'])\n"
              f"    out[kind + '.delta'] = dec.edit_delta(x['o_s'], x['o_t'])\n"
              f"st.save_file(out, {str(tmp_path / 'out.safetensors')!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = load_file(str(tmp_path / "out.safetensors"))
    for kind in ("lre", "ridge"):
        fit = fitted["capital<b>"][kind]
        predicted = fit["beta"] * (h @ fit["W"].T) + fit["b"]       # what LinearRelationDecoder.predict computed
        assert torch.equal(got[f"{kind}.o"], predicted)
    lre = fitted["capital<b>"]["lre"]                               # the analyses' edit: pinv of the untruncated J
    assert torch.allclose(got["lre.delta"], (o_t - o_s) @ SVD(lre["J"]).pinv(lre["edit_rank"]).T, atol=1e-12)
    assert not torch.allclose(got["lre.delta"], (o_t - o_s) @ SVD(lre["W"]).pinv(lre["edit_rank"]).T, atol=1e-6)
    ridge = fitted["capital<b>"]["ridge"]
    assert torch.allclose(got["ridge.delta"], (o_t - o_s) @ SVD(ridge["W"]).pinv(None).T, atol=1e-12)


def test_load_decoder_errors_name_the_problem(run, tmp_path):
    folder, _, _ = run
    with pytest.raises(KeyError, match=r"no lre decoder of relation 'capital'.*it has: capital<b> \(lre\)"):
        llmprobe.load_decoder(folder, "capital")
    with pytest.raises(FileNotFoundError, match="no saved decoders"):
        llmprobe.load_decoder(tmp_path, "capital<b>")


def test_load_report_shows_the_summary_a_tidy_frame_and_plots(run):
    folder, _, _ = run
    report = llmprobe.load_report(folder)
    page = report._repr_html_()
    assert page.startswith("<div><section id='summary'>") and page.count("data:image/png;base64,") == 4
    assert "capital<b>" not in page and "LRE edits causal" in page
    frame = report.to_frame()
    assert list(frame.columns) == ["source", "kind", "relation", "layer", "depth", "measure", "null", "value",
                                   "lo", "hi", "n"]
    faith = frame[(frame.measure == "ridge.faithfulness") & frame.null.isna()]
    assert sorted(faith.layer) == [0, 1, 2] and (faith.lo <= faith.value).all() and (faith.value <= faith.hi).all()
    data = report.data["analyses"]["relations"]["capital<b>"]["layers"]["1"]["ridge"]["faithfulness"]
    row = faith[faith.layer == 1].iloc[0]
    assert (row.value, row.lo, row.hi, row.n) == (data["value"], *data["ci"], data["n"])
    controls = frame[(frame.measure == "ridge.faithfulness") & frame.null.notna() & (frame.layer == 1)]
    assert dict(zip(controls.null, controls.value)) == {k: c["value"] for k, c in data["nulls"].items()}
    figure = report.plot("superposition.r2")
    assert [line.get_xdata().tolist() for line in figure.axes[0].lines][0] == [0, 1, 2]
    with pytest.raises(ValueError, match="no measure 'nope'.*lre.faithfulness"):
        report.plot("nope")


def test_plot_leaves_the_users_backend_and_pyplot_alone(run):
    """A notebook's backend is its user's: plot builds its figure without pyplot (no switch to Agg, nothing left
    open in pyplot's figure manager) and the figure still draws to a PNG."""
    import matplotlib
    import matplotlib.pyplot as plt

    folder, _, _ = run
    report = llmprobe.load_report(folder)
    original = matplotlib.get_backend()
    plt.switch_backend("svg")                         # the user's choice, not the Agg a report would pick
    try:
        open_before = plt.get_fignums()
        figure = report.plot("superposition.r2")
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == open_before
        assert figure_png(figure).startswith(b"\x89PNG") and len(figure.axes[0].lines) >= 1
    finally:
        plt.switch_backend(original)


def test_resume_keeps_the_decoders_of_the_analyses_it_takes_over(run, tmp_path):
    import shutil

    folder, _, again = run
    shutil.copytree(folder, tmp_path / "run")
    os.utime(tmp_path / "run" / "decoders.json", ns=(0, 0))
    again(tmp_path / "run", resume=True)
    assert (tmp_path / "run" / "decoders.json").stat().st_mtime_ns > 0                  # written again
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["stages"]["analyses"]["resumed"] is True
    assert (tmp_path / "run" / "decoders.json").read_text() == (folder / "decoders.json").read_text()
    assert (tmp_path / "run" / "decoders.safetensors").read_bytes() == (folder / "decoders.safetensors").read_bytes()



def test_low_rank_decoders_are_saved_as_factors_and_load_as_the_same_matrices(run, tmp_path):
    """With low-rank Jacobians (rank 4 at d = 32) W and J are stored as U, S, Vh (smaller than d x d) and load back
    as the very matrices the analyses used (bit for bit); resuming writes the same bytes."""
    folder, _, _ = run
    tmp = folder.parent
    real_run, seen = llmprobe.analyses.run.run_analyses, {}

    def spy(*args, **kwargs):
        seen["fitted"] = kwargs["runner"].fitted
        return real_run(*args, progress=False, **kwargs)

    def lowrank(out, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(known_module, "is_known", lambda text, obj: True)
            mp.setattr(llmprobe.analyses.run, "run_analyses", spy)
            probe(str(tmp / "llama"), relations=[str(tmp / "capital.json")], layers="0,1,2", device="cpu",
                  analyses="lre", out=out, analysis_options={**OPTIONS, "jacobian_rank": 4}, **kwargs)

    lowrank(tmp_path / "lr")
    index = json.loads((tmp_path / "lr" / "decoders.json").read_text())
    entry = next(e for e in index["decoders"] if e["kind"] == "lre")
    assert index["format"] == 2 and isinstance(entry["tensors"]["W"], list) and isinstance(entry["tensors"]["J"], list)
    fit = seen["fitted"]["capital<b>"]["lre"]
    loaded = llmprobe.load_decoder(tmp_path / "lr", "capital<b>")
    assert torch.equal(loaded.operator.W, fit["W"]) and torch.equal(loaded.J, fit["J"])
    assert torch.linalg.matrix_rank(fit["J"]) == 4
    before = (tmp_path / "lr" / "decoders.safetensors").read_bytes()
    lowrank(tmp_path / "lr", resume=True)
    assert (tmp_path / "lr" / "decoders.safetensors").read_bytes() == before
