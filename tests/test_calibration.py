"""The superposition line's measure on planted answers (``llmprobe.report.calibration``; the table at the real
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
  not shown. Grading it without the lexical null (``WITH_LEXICAL`` = ``BEFORE``) makes this test fail."""
import pytest
import torch

from llmprobe.report.calibration import BEFORE, WITH_LEXICAL, calibrate, grade, measure_world, superposition_worlds

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
