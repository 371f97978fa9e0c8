"""The typed metric: every number llmprobe reports, pretrained or synthetic, is a :class:`Metric`.

A ``Metric`` holds the estimate, the interval that brackets *that* estimate, ``n`` (the number of test items it
averages), the ``spread`` over re-fits (re-drawn Jacobian subjects, re-splits, re-shuffles) and its named *nulls*
(controls built to break what the measure needs: shuffled attributes, a random direction, a random-init model),
metrics of the same type. Its JSON form is the one interval vocabulary of every report::

    {"value": 0.71, "ci": [0.52, 0.85], "n": 24, "interval": "wilson",
     "spread": {"sd": 0.04, "values": [0.70, 0.75, 0.67]},      # or null: no re-fit was made
     "primary_null": "random_direction",                        # the null shown beside the value, or null
     "nulls": {"random_direction": {...same type...}, ...}}

Intervals (95% by default):

* proportions (faithfulness, causality, readout accuracy): Wilson score interval on the mean of the per-item
  values with ``n`` items. Per-item values may be fractions (an item's hit rate averaged over re-fits on the same
  fixed test set); the Wilson interval is then conservative, since such values vary less than 0/1 hits. It never
  has zero width for n >= 1.
* other statistics (R^2, differences of proportions): percentile bootstrap over items (subjects), the statistic
  recomputed on each resample; the value is the statistic on all items. A percentile interval that would not
  contain the value (a skewed bootstrap) is extended to it; one of zero width (all resamples equal, e.g. a single
  item) becomes the statistic's ``bounds``; the ``interval`` field then says "bootstrap (widened)".
* cross-fitted statistics (the superposition readouts): the grouped **jackknife** with refits
  (:func:`jackknife`): the items are cut into G groups, the statistic is recomputed with each group left out
  *and every fit redone*, so the interval includes the variation that refitting on other subjects brings (a
  bootstrap of out-of-fold values holds the fits fixed and under-covers: ``benchmarks/coverage.py``). The G
  replicate values travel with the metric (``jackknife``) so that :func:`pooled` can pool them.

Nothing here imports torch, a model loader, the analyses or the report code: this is the ground module that the
geometry, the analyses, the matched synthetic models and the reports all read.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LEVEL", "Metric", "wilson", "proportion", "bootstrap", "paired_difference", "jackknife", "t_quantile",
           "t_over_seeds", "is_metric", "iter_metrics", "nan_metric"]

LEVEL = 0.95
_FIELDS = ("value", "ci", "n", "interval")


def _z(level: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + level / 2)


def t_quantile(level: float, df: int) -> float:
    """Two-sided Student-t quantile t_{df, (1 + level) / 2}, exact (``scipy.special.stdtrit``; the series it
    replaced was 11% narrow at df = 1 and 0.75% at df = 2, the matched controls' 3 seeds); inf for df < 1."""
    if df < 1:
        return float("inf")
    from scipy.special import stdtrit  # lazy: start-up time: scipy.special takes ~0.8 s to import, the CLI needs none

    return float(stdtrit(df, (1 + level) / 2))


def wilson(mean: float, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval for a proportion ``mean`` observed on ``n`` items (n >= 1): (lo, hi), lo < hi."""
    if n < 1:
        return float("nan"), float("nan")
    if not 0 <= mean <= 1:
        raise ValueError(f"a proportion must lie in [0, 1], got {mean}")
    z = _z(level)
    denom = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denom
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
    return min(mean, max(0.0, centre - half)), max(mean, min(1.0, centre + half))   # exact at 0 and 1


@dataclass
class Metric:
    """One reported number. ``ci`` brackets ``value``; ``n`` test items; ``spread`` {"sd", "values"} over
    re-fits (None when no re-fit was made); ``nulls`` {name: Metric}; ``primary_null`` the name shown beside it;
    ``jackknife``: the statistic with each group of items left out and every fit redone (:func:`jackknife`; None
    for other intervals), aligned with the other metrics of the same measurement."""

    value: float
    ci: tuple[float, float]
    n: int
    interval: str
    spread: dict | None = None
    nulls: dict[str, "Metric"] = field(default_factory=dict)
    primary_null: str | None = None
    note: str | None = None
    jackknife: list[float] | None = None

    def with_nulls(self, nulls: dict[str, "Metric"], primary: str | None = None) -> "Metric":
        """Attach nulls (same type); ``primary`` (default: the first) is the one shown beside the value."""
        self.nulls = {**self.nulls, **nulls}
        self.primary_null = primary or self.primary_null or (next(iter(self.nulls)) if self.nulls else None)
        return self

    def to_dict(self) -> dict:
        out = {"value": _float(self.value), "ci": [_float(self.ci[0]), _float(self.ci[1])], "n": int(self.n),
               "interval": self.interval, "spread": self.spread, "primary_null": self.primary_null,
               "nulls": {name: m.to_dict() for name, m in self.nulls.items()}}
        if self.note:
            out["note"] = self.note
        if self.jackknife is not None:
            out["jackknife"] = [float(v) for v in self.jackknife]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Metric":
        return cls(d["value"], tuple(d["ci"]), d["n"], d["interval"], d.get("spread"),
                   {k: cls.from_dict(v) for k, v in (d.get("nulls") or {}).items()}, d.get("primary_null"),
                   d.get("note"), d.get("jackknife"))


def _float(x) -> float | None:
    return None if x is None else float(x)


def nan_metric(interval: str = "none", note: str | None = None) -> Metric:
    """A metric that could not be measured (no test item): value and interval NaN, n = 0."""
    return Metric(float("nan"), (float("nan"), float("nan")), 0, interval, note=note)


SPREAD_TOLERANCE = 1e-12   # an sd of values at or below this is no spread: equal values up to float rounding


def t_over_seeds(values: Sequence[float | None], bounds: tuple[float, float] | None = None,
                 level: float = LEVEL) -> Metric:
    """The mean of ``values`` (one per seed; None or NaN = that seed has none, left out) with its Student-t
    interval (``n`` = seeds; cut to ``bounds`` where given, e.g. (0, 1) for a rate), the values and their sd in
    ``spread``; a NaN metric when no seed has one. Unbounded (no interval claimed) with one seed, and where every
    seed gives the same value (sd at most ``SPREAD_TOLERANCE``: the same up to float rounding): their spread is then
    0 and says nothing of how far another seed could land."""
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not kept:
        return nan_metric("t over seeds")
    n, mean = len(kept), sum(kept) / len(kept)
    sd = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1)) if n > 1 else 0.0
    half = t_quantile(level, n - 1) * sd / math.sqrt(n) if n > 1 and sd > SPREAD_TOLERANCE else None
    lo, hi = (None, None) if half is None else (mean - half, mean + half)
    if bounds is not None and half is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return Metric(mean, (lo, hi), n, "t over seeds", spread={"sd": sd, "values": kept})


def _spread(refits: Sequence[float] | None) -> dict | None:
    if refits is None:
        return None
    values = [float(v) for v in refits if v is not None and not math.isnan(float(v))]
    if not values:
        return None
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"sd": sd, "values": values}


def proportion(per_item: Sequence[float], *, refits: Sequence[float] | None = None, level: float = LEVEL,
               note: str | None = None) -> Metric:
    """A proportion from per-item values in [0, 1] (hits, or hit rates averaged over re-fits of the same items).

    value = mean over items; ci = Wilson with n = number of items; ``refits``: the same proportion from each
    re-fit (its standard deviation is the spread)."""
    v = np.asarray([float(x) for x in per_item], dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return nan_metric("wilson", note)
    if v.min() < 0 or v.max() > 1:
        raise ValueError("per-item values of a proportion must lie in [0, 1]")
    mean = float(v.mean())
    return Metric(mean, wilson(mean, int(v.size), level), int(v.size), "wilson", _spread(refits), note=note)


def bootstrap(parts, statistic: Callable[[np.ndarray], float] | None = None, *, n_boot: int = 1000,
              seed: int = 0, level: float = LEVEL, bounds: tuple[float, float] = (-math.inf, math.inf),
              refits: Sequence[float] | None = None, note: str | None = None) -> Metric:
    """Percentile bootstrap over items. ``parts``: [n] per-item values (statistic: mean) or [n, k] per-item
    parts for a custom ``statistic`` (e.g. pooled R^2 from per-subject (SSE, SST)). NaN rows are dropped.

    value = statistic(all items); a percentile interval that excludes the value is extended to it, one of zero
    width becomes ``bounds`` (``interval`` then says "bootstrap (widened)")."""
    x = np.asarray(parts, dtype=np.float64)
    if x.ndim not in (1, 2):
        raise ValueError(f"parts must be [n] or [n, k], got shape {x.shape}")
    x = x[~np.isnan(x).reshape(len(x), -1).any(1)] if x.size else x
    stat = statistic or (lambda a: float(a.mean()))
    n = int(len(x))
    if n == 0:
        return nan_metric("bootstrap", note)
    value = float(stat(x))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    boots = np.array([stat(x[i]) for i in idx], dtype=np.float64)
    boots = boots[np.isfinite(boots)]
    kind = "bootstrap"
    if boots.size == 0 or not math.isfinite(value):
        lo, hi = bounds
        kind = "bootstrap (widened)"
    else:
        lo, hi = (float(q) for q in np.quantile(boots, [(1 - level) / 2, (1 + level) / 2]))
        if lo == hi:                                   # every resample gave the same number: nothing is known
            (lo, hi), kind = bounds, "bootstrap (widened)"
        elif not lo <= value <= hi:                    # a skewed bootstrap: extend the side that misses the value
            lo, hi, kind = min(lo, value), max(hi, value), "bootstrap (widened)"
    return Metric(value, (lo, hi), n, kind, _spread(refits), note=note)


def paired_difference(a: Sequence[float], b: Sequence[float], *, n_boot: int = 1000, seed: int = 0,
                      level: float = LEVEL, note: str | None = None) -> Metric:
    """Mean of a - b over the items where both are measured, with a paired percentile bootstrap (bounds [-1, 1]
    for proportions)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = ~(np.isnan(a) | np.isnan(b))
    return bootstrap(a[keep] - b[keep], n_boot=n_boot, seed=seed, level=level, bounds=(-1.0, 1.0), note=note)


def jackknife(value: float, replicates: Sequence[float], n: int, *, proportion: bool = False,
              bounds: tuple[float, float] = (-math.inf, math.inf), level: float = LEVEL,
              refits: Sequence[float] | None = None, note: str | None = None) -> Metric:
    """Grouped (delete-a-group) jackknife interval. ``replicates``: the statistic with each of G groups of items
    left out, every fit redone; ``n``: the items of ``value``.

    se = sqrt((G - 1) / G * sum_g (theta_g - mean_g theta)^2); ci = value -+ t_{G-1} se, clipped to ``bounds``
    ("jackknife"; of zero width -> ``bounds``, "jackknife (widened)"). proportion: the Wilson interval at the
    effective number of items n_eff = min(n, p (1 - p) / (t se / z)^2) ("wilson (jackknife)"): value -+ t se away
    from 0 and 1, never narrower than Wilson with n items, never of zero width."""
    reps = np.asarray([float(v) for v in replicates], dtype=np.float64)
    reps = reps[np.isfinite(reps)]
    if n < 1 or not math.isfinite(float(value)):
        return nan_metric("wilson (jackknife)" if proportion else "jackknife", note)
    g = reps.size
    se = math.sqrt((g - 1) / g * float(((reps - reps.mean()) ** 2).sum())) if g > 1 else math.inf
    if se <= 1e-12 * max(1.0, abs(float(value))):                       # every replicate equal (up to rounding)
        se = 0.0
    t = t_quantile(level, g - 1)
    if proportion:
        p = min(1.0, max(0.0, float(value)))
        n_eff = n if se == 0 or p in (0.0, 1.0) else min(n, p * (1 - p) / (t * se / _z(level)) ** 2)
        lo, hi = wilson(p, 1, level) if n_eff < 1 else wilson(p, n_eff, level)
        return Metric(float(value), (lo, hi), int(n), "wilson (jackknife)", _spread(refits), note=note,
                      jackknife=reps.tolist())
    if se == 0 or not math.isfinite(se):
        return Metric(float(value), bounds, int(n), "jackknife (widened)", _spread(refits), note=note,
                      jackknife=reps.tolist())
    lo, hi = max(bounds[0], value - t * se), min(bounds[1], value + t * se)
    return Metric(float(value), (lo, hi), int(n), "jackknife", _spread(refits), note=note, jackknife=reps.tolist())


def pooled_readout(readout: dict | None) -> dict | None:
    """Readout accuracy pooled over relations (every subject-relation fact counts once): see :func:`pooled`."""
    return pooled(readout, "pooled over relations (each subject-relation fact once)")


def pooled(metrics: dict | None, note: str) -> dict | None:
    """Proportions pooled over relations ({relation: metric}, each item counts once): a typed metric (JSON form)
    and the same pooling for every null all relations have. Interval: when every metric carries aligned
    jackknife replicates (one measurement's relations), the pooled replicates' :func:`jackknife` interval (so the
    dependence between relations, which share subjects and fits, is kept); else Wilson on the pooled n."""
    entries = [m for m in (metrics or {}).values() if m and m.get("value") is not None and m.get("n")]
    if not entries:
        return None

    def pool(items):
        n = sum(int(m["n"]) for m in items)
        value = sum(float(m["value"]) * int(m["n"]) for m in items) / n
        reps = [m.get("jackknife") for m in items]
        if all(reps) and len({len(r) for r in reps}) == 1:
            pooled_reps = np.asarray(reps, dtype=np.float64).T @ np.asarray([m["n"] for m in items]) / n
            return jackknife(value, pooled_reps, n, proportion=True, note=note)
        return Metric(value, wilson(min(1.0, max(0.0, value)), n), n, "wilson", note=note)

    out = pool(entries)
    names = set.intersection(*(set(m.get("nulls") or {}) for m in entries))
    nulls = {name: pool([m["nulls"][name] for m in entries]) for name in sorted(names)
             if all((m["nulls"][name] or {}).get("n") for m in entries)}
    return out.with_nulls(nulls, "shuffled" if "shuffled" in nulls else None).to_dict()


def is_metric(obj) -> bool:
    """Is ``obj`` a metric in its JSON form?"""
    return isinstance(obj, dict) and all(k in obj for k in _FIELDS)


def iter_metrics(tree, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """Every metric (JSON form) in a nested dict, with its key path; a metric's nulls are not descended."""
    if is_metric(tree):
        yield path, tree
        return
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from iter_metrics(value, path + (str(key),))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from iter_metrics(value, path + (str(i),))
