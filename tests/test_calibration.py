"""The superposition line's measure on planted answers (``llmprobe.jobs.calibration``; the table at the real
run's n: ``benchmarks/calibration.py``, docs/measures.md, Calibration). Quick shapes: 120 subjects, d = 48, a
one-to-one relation, one of 60 attributes, one of 8, and one lexical relation (its attribute is the subject's own
token, as a country's demonym nearly is). The gain over random_attributes is what the true u vectors add to
subjects whose attribute the fit never saw: a world of few, often-seen attributes has none to show (with these
sizes the exact superposition gains ~0.3; with 4, 12 and 30 attributes it gained 0.02 and was not shown).

* an exact planted superposition of the named vectors is graded supported against every null, the lexical one
  included (power);
* the superposition of a shuffled table is not shown;
* the lexical world (states = the subjects' token embeddings) reads a large R^2 gain over random_attributes, and
  the nulls before the lexical one grade it supported or weak: that is the artefact; with the lexical null it is
  not shown. Grading it without the lexical null (``WITH_LEXICAL`` = ``BEFORE``) makes this test fail.

The selector line's measure on planted one-layer models (``calibrate_selector``) at the real run's 64 test facts:
the construction and a trained geometric model supported, the key-value memories neither supported nor weak.
Breaking the matched switch-off (``matched_switch_off`` returning all ones: no unit moved) makes the first
selector test fail (the null keeps every answer, so the trained model's keep no longer beats it).

The capacity line's scaling rule (``capacity_scaling``) on planted sweeps of the real sweep's cells and seeds at its
residual noise (``calibrate_capacity``; the table: ``benchmarks/calibration_capacity.py``): trainable d* ~ R log2 N
supported, d* ~ N and d* ~ N R (key-value memories) not shown; frozen d* = the trainable law x1.2 not shown.
Dropping N R from the memories the claim must beat (``MEMORY_FEATURES = ("N",)``) no longer grades the per-fact
memory not shown (it reads inconclusive) and makes the test fail.""" 
import math

import pytest
import torch

from llmprobe.analyses.selector import matched_switch_off
from llmprobe.jobs.calibration import (
    BEFORE,
    WITH_LEXICAL,
    calibrate,
    calibrate_capacity,
    calibrate_selector,
    capacity_worlds,
    grade,
    measure_world,
    selector_worlds,
    superposition_worlds,
    sweep_noise,
)

N, D, SIZES = 120, 48, (120, 60, 8)


@pytest.fixture(scope="module")
def shapes():
    """(A [N, 4], U, E): the subjects' token embeddings E [N, D]; relations of SIZES attributes with Gaussian u
    vectors (the first a bijection), and a lexical one whose attribute of subject s is s's own (u = E_s plus a
    little noise)."""
    gen = torch.Generator().manual_seed(0)
    E = torch.randn(N, D, generator=gen, dtype=torch.float64)
    columns = [torch.randperm(N, generator=gen)] + [torch.randint(0, k, (N,), generator=gen) for k in SIZES[1:]]
    A = torch.stack(columns + [torch.arange(N)], 1)
    U = [torch.randn(k, D, generator=gen, dtype=torch.float64) for k in SIZES]
    U.append(E + 0.1 * torch.randn(N, D, generator=gen, dtype=torch.float64))
    return A, U, E


def test_the_lexical_null_removes_the_lexical_artefact_and_keeps_the_power(shapes):
    A, U, E = shapes
    positive, mixed, shuffled, lexical = superposition_worlds(4.0)
    rows = {r["world"]: r for r in calibrate([shuffled, lexical], A, U, E, replicates=2, family=20, folds=4,
                                             jackknife_groups=10)}
    assert rows[lexical.name]["gain_random_attributes"] > 0.2                # the artefact the old nulls pass
    assert rows[lexical.name]["before_supported_or_weak"] == 1.0
    assert rows[lexical.name]["with_lexical_supported_or_weak"] == 0.0
    assert rows[shuffled.name]["before_supported_or_weak"] == rows[shuffled.name]["with_lexical_supported_or_weak"] \
        == 0.0
    # the claim holding by construction, on the relations that are not lexical: supported against every null
    clean = (A[:, :3], U[:3], E)
    r2, margins = measure_world(positive, *clean, seed=0, folds=4, jackknife_groups=10)
    assert r2["value"] > 0.4 and margins["random_attributes"]["value"] > 0.2 and margins["lexical"]["value"] > 0.3
    assert grade(r2, margins, WITH_LEXICAL, 20) == "supported" and set(BEFORE) < set(WITH_LEXICAL)


# --------------------------------------------------------------------------------------------------- selector
@pytest.fixture(scope="module")
def selector_rows():
    """The selector line's worlds (N = 64, R = 4; trained d = 16 for 300 steps), 2 replicates each at the real
    run's 64 test facts, graded with Bonferroni over the SmolLM2 report's 20 tests."""
    worlds = {w.name: w for w in selector_worlds(64, 4, 16, 300)}
    return {r["world"]: r for r in calibrate_selector(list(worlds.values())[:5], 64, replicates=2, family=20,
                                                        n_boot=300)}


def test_the_selector_keep_test_passes_the_selectors_and_fails_the_memories(selector_rows):
    """The construction and a trained geometric model are graded supported on every replicate, both key-value
    memories never supported or weak; the break test it replaced shows none of them (the construction included:
    a random switch-off of another relation's size breaks as much as another relation's gates)."""
    holds = [r for r in selector_rows.values() if r["claim_holds"]]
    fails = [r for r in selector_rows.values() if r["claim_holds"] is False]
    assert len(holds) == 3 and len(fails) == 2 and all(r["n"] == 64 for r in selector_rows.values())
    construction, trained = holds[0], holds[1]
    assert construction["same_relation"] == 1.0 and construction["other_relation"] < 0.05
    assert construction["keep_supported"] == trained["keep_supported"] == 1.0
    assert trained["same_relation"] > 0.6 and trained["random_units_matched"] < 0.2
    assert all(r["keep_supported_or_weak"] == 0.0 for r in fails)
    assert max(r["same_relation"] for r in fails) < 0.4
    assert construction["break_supported_or_weak"] == 0.0                  # the old test had no power


def test_the_matched_switch_off_matches_count_and_norm():
    own = torch.tensor([[0.9, 0.5, 0.1, 0.0, 2.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    new = torch.tensor([[0.0, 0.5, 0.1, 0.7, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    scale = matched_switch_off(own, new, own > 0, new > 0, torch.Generator().manual_seed(0))
    moved = scale[0] != 1
    assert int(moved.sum()) == 3 and bool((own[0][moved] > 0).all())            # 3 units moved: 3 open ones
    assert math.isclose(float((own[0] * (scale[0] - 1)).norm()), float((new[0] - own[0]).norm()), rel_tol=1e-5)
    assert bool((scale[1] == 1).all())                                             # nothing moved: no edit
    relu = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    off = matched_switch_off(relu, torch.tensor([[0.0, 1.0, 1.0, 1.0]]), relu > 0, torch.tensor([[0, 1, 1, 1]]) > 0,
                             torch.Generator().manual_seed(1))
    assert sorted(off[0].tolist()) == [0.0, 0.0, 1.0, 1.0]                         # 0/1 gates: switched off


def test_the_capacity_rule_passes_r_log_n_and_fails_the_key_value_memories():
    rows = {r["world"]: r for r in calibrate_capacity(capacity_worlds(), replicates=3, noise=sweep_noise(),
                                                      n_boot=200)}
    for row in rows.values():
        if row["trainable_holds"]:
            assert row["trainable_supported"] == 1.0, row
        else:
            assert row["trainable_supported"] == 0.0 and row["trainable_not_shown"] == 1.0, row
        if row["frozen_holds"] is False:
            assert row["frozen_supported"] == 0.0 and row["frozen_not_shown"] == 1.0, row
    assert sum(not r["trainable_holds"] for r in rows.values()) == 2 and len(rows) == 4
