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
selector test fail (the null keeps every answer, so the trained model's keep no longer beats it).""" 
import math
import statistics

import pytest
import torch

from llmprobe.analyses.decoders import causality_metric
from llmprobe.analyses.selector import matched_switch_off
from llmprobe.jobs.calibration import (
    BEFORE,
    WITH_LEXICAL,
    calibrate,
    calibrate_causal,
    calibrate_selector,
    causal_tests,
    causal_worlds,
    grade,
    measure_world,
    selector_worlds,
    superposition_worlds,
)
from llmprobe.metric import t_quantile

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


# ---------------------------------------------------------------------------------------------- LRE causality
@pytest.fixture(scope="module")
def causal_rows():
    """The causal line's planted worlds at d = 48, 2 replicates each, with 10 and 25 known facts (3 and 8 test
    pairs, the SmolLM2 run's smaller relations), graded with Bonferroni over its 20 tests."""
    worlds = [w for w in causal_worlds() if w.name in (
        "linear rank 16, null share 3", "linear rank 16, states in its row space", "key-value memory")]
    return {(r["world"], r["n"]): r for r in calibrate_causal(worlds, [10, 25], 48, replicates=2, family=20)}


def test_the_causal_line_passes_the_planted_edit_and_not_a_step_toward_h_t_as_good(causal_rows):
    """Where the relation is exactly linear and the states lie mostly in W's null space, the pseudo-inverse edit
    flips every answer and the same-norm step toward h_t none: supported at 8 pairs, inconclusive (low power) at 3.
    Where the step toward h_t is the edit (states in W's row space) or does as well (a key-value memory), the line
    is never supported or weak, while the nulls it had before scaled_patch grade the row-space world supported."""
    holds = causal_rows["linear rank 16, null share 3", 8]
    assert holds["edit"] == 1.0 and holds["scaled_patch"] == 0.0 and holds["random_direction"] == 0.0
    assert holds["edit_minus_scaled_patch"] == 1.0 and holds["paired_supported"] == 1.0
    assert causal_rows["linear rank 16, null share 3", 3]["paired_low_power"] == 1.0
    row_space = causal_rows["linear rank 16, states in its row space", 8]
    memory = causal_rows["key-value memory", 8]
    assert row_space["edit"] == row_space["scaled_patch"] == 1.0 and memory["scaled_patch"] == 1.0
    assert row_space["paired_supported_or_weak"] == memory["paired_supported_or_weak"] == 0.0
    assert row_space["mover_supported_or_weak"] == 0.0
    assert row_space["before_supported"] == 1.0                     # the artefact scaled_patch removes


def test_the_causality_margins_are_paired_over_the_test_pairs():
    """causality_metric's margins: edit - control per pair (means over re-fits), Student t (df = n - 1); every pair
    the same difference widens to [-1, 1], which the claims block replaces by MOVER from the two intervals."""
    edit = [torch.tensor([True, True, False, True]), torch.tensor([True, False, False, True])]
    patch = [torch.tensor([False, True, False, False])] * 2
    never = [torch.zeros(4, dtype=torch.bool)] * 2
    metric = causality_metric({"edit": edit, "scaled_patch": patch, "random_direction": never,
                               "random_operator": never}, torch.ones(4, dtype=torch.bool))
    margin = metric["margins"]["scaled_patch"]              # per pair: (1, 0.5, 0, 1) - (0, 1, 0, 0)
    assert margin["value"] == pytest.approx(0.375) and margin["interval"] == "paired t" and margin["n"] == 4
    half = t_quantile(0.95, 3) * statistics.stdev([1, -0.5, 0, 1]) / 2
    assert margin["ci"] == pytest.approx([max(-1.0, 0.375 - half), min(1.0, 0.375 + half)])
    assert metric["margins"]["full_patch"]["value"] == pytest.approx(0.625 - 1.0)
    assert metric["nulls"]["scaled_patch"]["value"] == 0.25 and metric["primary_null"] == "random_direction"
    ones, zeros = [torch.ones(6, dtype=torch.bool)] * 2, [torch.zeros(6, dtype=torch.bool)] * 2
    same = causality_metric({"edit": ones, "scaled_patch": zeros, "random_direction": zeros,
                             "random_operator": zeros})                  # every pair: 1 - 0
    assert same["margins"]["scaled_patch"]["ci"] == [-1.0, 1.0]
    test = causal_tests(same)["paired"]
    assert test["difference"]["interval"] == "MOVER (unpaired)" and test["null_name"] == "scaled_patch"
    assert causal_tests(metric)["paired"]["difference"]["interval"] == "paired t"
