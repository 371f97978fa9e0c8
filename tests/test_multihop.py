"""Multi-seed k-hop grid (synthetic.multihop.run_seeds) and the growth fit d* ~ R^b (fit_growth)."""
import json
import math
import os

import numpy as np

from synthetic.multihop import (
    SeedsConfig,
    fit_growth,
    resample_within,
    run_seeds,
    search_grid,
    seeds_markdown,
    smallest_on_grid,
)
from synthetic.render import seeds_figure


def _planted(k, c=3.0, noise=0.1, seed=0):
    """d* = c R^k times a per-seed log-normal factor, for R = 2, 4, 8 and 3 seeds."""
    rng = np.random.default_rng(seed)
    return [(R, c * R ** k * math.exp(noise * rng.standard_normal())) for R in (2, 4, 8) for _ in range(3)]


def test_fit_growth_recovers_planted_exponent():
    for k in (1, 2, 3):
        m = fit_growth(_planted(k), n_boot=500)
        assert abs(m.value - k) < 0.15, (k, m)
        assert m.ci[0] <= k <= m.ci[1] and not m.ci[0] <= k / 2 <= m.ci[1], (k, m)
        assert m.n == 9 and m.note.startswith("a=")
        assert abs(float(m.note.split()[0][2:]) - math.log(3.0)) < 0.3      # the intercept is log c


def test_fit_growth_resamples_within_r():
    # every seed equal at each R: each resample keeps one point per R value, so the slope never moves
    pts = [(R, 5 * R ** 0.5) for R in (2, 4, 8) for _ in range(3)]
    m = fit_growth(pts, n_boot=200)
    assert abs(m.value - 0.5) < 1e-9 and abs(m.ci[0] - 0.5) < 1e-9 and abs(m.ci[1] - 0.5) < 1e-9
    strata = np.array([2, 2, 2, 4, 4, 8, 8, 8, 8])
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = resample_within(strata, rng)
        assert sorted(strata[idx].tolist()) == strata.tolist()       # the R values stay fixed
    assert len({tuple(resample_within(strata, rng)) for _ in range(20)}) > 1
    # points not reached (None) are dropped; one R left cannot give a slope
    assert fit_growth([(2, 4), (2, 6), (4, None)]).n == 0
    assert fit_growth(pts + [(8, None)]).n == 9


def test_search_grid_in_lockstep_matches_smallest_on_grid():
    grid = [2, 3, 4, 6, 8, 12, 16]
    thresholds = {0: 3, 1: 8, 2: 16}
    searches = {s: search_grid(grid, start=6) for s in thresholds}
    pending = {s: next(g) for s, g in searches.items()}
    found = {}
    while pending:
        nxt = {}
        for s, d in pending.items():
            try:
                nxt[s] = searches[s].send(d >= thresholds[s])
            except StopIteration as stop:
                found[s] = stop.value
        pending = nxt
    for s, thr in thresholds.items():
        assert found[s] == smallest_on_grid(lambda d: d >= thr, grid, start=6)
        assert found[s][0] == thr


def test_run_seeds_tiny_grid_resumes(tmp_path):
    cfg = SeedsConfig(subjects=6, relations=[2, 4], hops=[1, 2], seeds=[0, 1], d_grid=[2, 4, 8, 16],
                      max_steps=120, n_boot=50)
    s = run_seeds(cfg, str(tmp_path), log=lambda m: None)
    rows = {(r["hops"], r["cot"], r["R"], r["seed"]): r for r in s["d_star"]}
    assert len(rows) == 2 * 2 * 2 * 2
    for R in (2, 4):
        for seed in (0, 1):                      # one hop with CoT is the same data: copied
            assert rows[(1, True, R, seed)]["d_star"] == rows[(1, False, R, seed)]["d_star"]
    pts = s["points"]
    assert {p["seed"] for p in pts} == {0, 1} and all(p["n_sequences"] == 6 * p["R"] ** p["hops"] for p in pts)
    assert set(s["cells"]) == {"k1_direct", "k1_cot", "k2_direct", "k2_cot"}
    saved = json.loads((tmp_path / "seeds.json").read_text())
    assert saved["n_points"] == len(pts) > 0
    again = run_seeds(cfg, str(tmp_path), log=lambda m: None)      # nothing retrained
    assert again["d_star"] == s["d_star"] and again["train_cpu_s"] == s["train_cpu_s"]
    assert "| k | CoT |" in seeds_markdown(again) and set(again["pooled_vs_Rk"]) == {"direct", "cot"}
    assert os.path.getsize(seeds_figure(again, str(tmp_path / "seeds.png"))) > 1000
    # drop the last trained point: without training, that search ends open, bracketed by its other points
    lines = (tmp_path / "points.jsonl").read_text().splitlines()
    (tmp_path / "points.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    cfg.train = False
    part = run_seeds(cfg, str(tmp_path), log=lambda m: None)
    assert part["n_points"] == len(pts) - 1
    last = json.loads(lines[-1])
    row = next(r for r in part["d_star"] if (r["hops"], r["cot"], r["R"], r["seed"]) ==
               (last["hops"], last["cot"], last["R"], last["seed"]))
    assert row["open"] and last["d"] not in row["tried"]
