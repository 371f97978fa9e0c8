"""The typed metric: the value lies inside its interval, intervals never have zero width for n >= 1, and the
JSON form round-trips."""
import json
import math

import numpy as np
import pytest

from llmprobe.metric import (
    Metric,
    bootstrap,
    iter_metrics,
    jackknife,
    paired_difference,
    pooled_readout,
    proportion,
    t_quantile,
    wilson,
)


@pytest.mark.parametrize("hits", [[1] * 9, [0] * 5, [1], [0], [1, 0, 1], [0.5, 1, 0.25, 0.75]])
def test_proportion_brackets_its_value_with_nonzero_width(hits):
    m = proportion(hits)
    lo, hi = m.ci
    assert m.n == len(hits) and m.interval == "wilson"
    assert lo <= m.value <= hi and hi - lo > 0.05
    assert 0 <= lo and hi <= 1


def test_wilson_matches_the_closed_form_and_narrows():
    lo, hi = wilson(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson(1.0, 9)[0] == pytest.approx(0.7008, abs=1e-3)            # 9/9: [0.70, 1], not [1, 1]
    assert wilson(0.3, 1000)[1] - wilson(0.3, 1000)[0] < (wilson(0.3, 50)[1] - wilson(0.3, 50)[0]) / 3
    with pytest.raises(ValueError, match="proportion"):
        wilson(1.5, 10)


def test_bootstrap_contains_the_mean_narrows_and_is_deterministic():
    rng = np.random.default_rng(0)
    widths = []
    for n in (50, 2000):
        x = 3.0 + rng.standard_normal(n)
        m = bootstrap(x, n_boot=1000, seed=1)
        assert m.ci[0] < 3.0 < m.ci[1] and m.ci[0] <= m.value <= m.ci[1] and m.n == n
        widths.append(m.ci[1] - m.ci[0])
    assert widths[1] < widths[0] / 3
    assert bootstrap(x, seed=7).ci == bootstrap(x, seed=7).ci
    parts = np.stack([rng.random(100), np.ones(100)], 1)
    r2 = bootstrap(parts, lambda p: 1 - p[:, 0].sum() / p[:, 1].sum(), bounds=(-math.inf, 1.0), n_boot=200)
    assert r2.ci[0] <= r2.value <= r2.ci[1] and r2.ci[1] > r2.ci[0]


def test_bootstrap_of_one_item_or_equal_items_is_widened_not_zero_width():
    one = bootstrap([0.4], bounds=(0.0, 1.0))
    assert one.ci == (0.0, 1.0) and one.interval == "bootstrap (widened)"
    same = paired_difference([1, 1, 1], [0, 0, 0])
    assert same.value == 1.0 and same.ci[0] < 1.0 and same.ci[1] >= 1.0


def test_refits_give_the_spread_and_json_round_trips():
    m = proportion([1, 0, 1, 1], refits=[0.75, 0.5, 1.0]).with_nulls(
        {"random_direction": proportion([0, 0, 0, 1])})
    assert m.spread["sd"] == pytest.approx(0.25) and m.spread["values"] == [0.75, 0.5, 1.0]
    d = json.loads(json.dumps(m.to_dict()))
    assert d["primary_null"] == "random_direction" and d["nulls"]["random_direction"]["n"] == 4
    assert Metric.from_dict(d).to_dict() == d
    found = dict(iter_metrics({"a": {"b": d}, "c": [d]}))
    assert set(found) == {("a", "b"), ("c", "0")}                            # controls are not descended


def test_t_quantile_matches_the_tables():
    assert t_quantile(0.95, 1) == pytest.approx(12.7062, abs=1e-4)      # the series was 11% narrow here
    assert t_quantile(0.95, 2) == pytest.approx(4.3027, abs=1e-4)       # and 0.75% here (3 seeds)
    assert t_quantile(0.95, 19) == pytest.approx(2.0930, abs=1e-4)
    assert t_quantile(0.95, 9) == pytest.approx(2.2622, abs=1e-4)
    assert t_quantile(0.95, 10 ** 6) == pytest.approx(1.95996, abs=1e-4)


def test_jackknife_of_a_mean_is_the_classical_interval():
    """Delete-one replicates of a mean: the jackknife standard error is exactly sd / sqrt(n)."""
    x = np.random.default_rng(0).standard_normal(25) + 2.0
    reps = (x.sum() - x) / (len(x) - 1)
    m = jackknife(x.mean(), reps, len(x))
    half = t_quantile(0.95, 24) * x.std(ddof=1) / math.sqrt(len(x))
    assert m.ci == pytest.approx((x.mean() - half, x.mean() + half)) and m.interval == "jackknife"
    assert m.jackknife == pytest.approx(list(reps)) and Metric.from_dict(m.to_dict()).jackknife == m.jackknife
    flat = jackknife(0.3, [0.3] * 10, 40, bounds=(-1.0, 1.0))
    assert flat.ci == (-1.0, 1.0) and flat.interval == "jackknife (widened)"


def test_jackknife_proportion_is_wilson_at_the_effective_n():
    """A proportion's jackknife interval: value -+ t se away from the bounds, never narrower than Wilson with n
    items (the binomial part alone), never of zero width."""
    hits = np.r_[np.ones(60), np.zeros(40)]
    wide = jackknife(0.6, 0.6 + 0.02 * np.random.default_rng(1).standard_normal(20), 100, proportion=True)
    se = math.sqrt(19 / 20 * ((np.asarray(wide.jackknife) - np.mean(wide.jackknife)) ** 2).sum())
    assert wide.interval == "wilson (jackknife)" and wide.ci[1] - wide.ci[0] > wilson(0.6, 100)[1] - wilson(0.6, 100)[0]
    assert (wide.ci[1] - wide.ci[0]) / 2 == pytest.approx(t_quantile(0.95, 19) * se, rel=0.05)
    tight = jackknife(hits.mean(), [0.6] * 20, 100, proportion=True)
    assert tight.ci == pytest.approx(wilson(0.6, 100))
    perfect = jackknife(1.0, [1.0] * 20, 9, proportion=True)
    assert perfect.ci == pytest.approx(wilson(1.0, 9)) and perfect.ci[0] < 1.0


def test_pooled_uses_aligned_jackknife_replicates():
    """Relations measured together carry aligned replicates: the pooled interval comes from the pooled replicates
    (keeping their correlation); without replicates it is Wilson on the pooled n."""
    rng = np.random.default_rng(2)
    shared = 0.03 * rng.standard_normal(20)                                  # the relations move together
    a = jackknife(0.7, 0.7 + shared, 100, proportion=True)
    b = jackknife(0.5, 0.5 + shared, 100, proportion=True)
    pooled = pooled_readout({"a": a.to_dict(), "b": b.to_dict()})
    assert pooled["value"] == pytest.approx(0.6) and pooled["interval"] == "wilson (jackknife)"
    assert pooled["jackknife"] == pytest.approx(list(0.6 + shared))
    plain = pooled_readout({"a": proportion([1] * 70 + [0] * 30).to_dict(), "b": proportion([1, 0] * 50).to_dict()})
    assert plain["interval"] == "wilson" and plain["ci"] == pytest.approx(wilson(0.6, 200))
    assert pooled["ci"][1] - pooled["ci"][0] > 1.5 * (plain["ci"][1] - plain["ci"][0])
