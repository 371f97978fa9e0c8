"""The claims' matched comparisons read the control over its seeds: a comparison word that would flip between the
control's seeds says so in its line and takes the word of the interval over seeds; seeds that agree add nothing;
reports without per-seed values read as before. (The capacity verdict is graded from the capacity sweep's cells,
not from the control, so no seed of the control moves it.)"""
import pytest
from test_report import (
    MATCHED_SELECTOR,
    R2_NULLS,
    _calibrated_selector_report,
    _claims_report,
    _line,
    _r2,
    _readout,
)

from llmprobe.metric import t_over_seeds
from llmprobe.report.claims import DECODABLE, SELECTOR, SUPERPOSITION

FLIP = "depends on the control's seed: seed values"


def _over(values, bounds=None) -> dict:
    return t_over_seeds(values, bounds).to_dict()


def _control(r2=None, readout=None, keep=None, d=8) -> dict:
    """A matched block whose trainable control at width ``d`` (the model's) has its R^2 over seeds (``r2``: the
    seeds' values), readouts over seeds (``readout``: {relation: values}) and same-relation / other-relation keep
    rates over seeds (``keep``: (values, values)); seed 0's own numbers (``readout``, ``selector``) set apart
    (0.9, 0.99 and 0.01) so that a comparison read from seed 0 shows."""
    point = {"d": d, "train": {"bits_per_param": 1.0}, "readout": {"capital": _readout(36)},
             "selector": {"gate_transplant": {"same_relation": 0.99, "same_subject": 0.01}}, "over_seeds": {}}
    if r2 is not None:
        point["r2_final"] = _over(r2)
    if readout is not None:
        point["over_seeds"]["readout"] = {k: _over(v, (0, 1)) for k, v in readout.items()}
    if keep is not None:
        point["over_seeds"]["gate_transplant"] = {"same_relation": _over(keep[0], (0, 1)),
                                                  "same_subject": _over(keep[1], (0, 1))}
    return {"table": {"n_subjects": 40, "relations": ["capital"], "n_facts": 80, "bits": 100.0},
            "training": {"max_steps": 2000}, "seeds": [0, 1, 2],
            "modes": {"trainable": {"threshold": {"d_star": d, "exact": True}, "points": [point]}}}


def _r2_line(seeds):
    """The superposition line of a pretrained R^2 of 0.170 [0.132, 0.208] (SmolLM2's) beside a control at the
    model's width whose seeds read ``seeds``."""
    report = _claims_report(superposition={"1": {"r2": _r2(0.170, 0.132, 0.208, R2_NULLS)}},
                            controls=_control(r2=seeds))
    return _line(report, SUPERPOSITION)


def test_an_r2_comparison_that_flips_between_seeds_says_so():
    """SmolLM2's control at d = 576: seeds 0.240 and 0.265 read "less than", 0.201 "as much as"; the word is the
    one over seeds and the note gives every seed's value and word."""
    line = _r2_line([0.240, 0.265, 0.201])
    comparison = line["comparison"]
    assert comparison["seed_words"] == ["less than", "less than", "as much as"]
    assert comparison["word"] == "as much as" and comparison["metric"]["interval"] == "t over seeds"
    assert comparison["metric"]["value"] == pytest.approx((0.240 + 0.265 + 0.201) / 3)
    assert (f"{FLIP} 0.240 (less than), 0.265 (less than), 0.201 (as much as); the word is the one over seeds "
            "(as much as, the 3 seeds' Student-t interval)") in line["note"]


def test_an_r2_comparison_the_seeds_agree_on_has_no_note():
    line = _r2_line([0.50, 0.52, 0.48])
    assert line["comparison"]["seed_words"] == ["less than"] * 3 and line["comparison"]["word"] == "less than"
    assert FLIP not in line["note"] and "note" not in line["comparison"]


def test_readouts_are_compared_with_the_control_over_its_seeds():
    """The pretrained readout 20/40 beside the control's readout over seeds (not seed 0's 36/40): 0.30 reads
    "more than", 0.40 and 0.45 "as much as"."""
    superposition = {"1": {"r2": _r2(0.17, 0.15, 0.19, R2_NULLS), "readout": {"capital": _readout(20)}}}
    report = _claims_report(superposition=superposition, controls=_control(readout={"capital": [0.30, 0.40, 0.45]}))
    line = _line(report, DECODABLE)
    assert line["comparison"]["metric"]["value"] == pytest.approx(0.3833, abs=1e-4)
    assert line["comparison"]["seed_words"] == ["more than", "as much as", "as much as"]
    assert line["comparison"]["word"] == "as much as" and f"{FLIP} 0.300 (more than)" in line["note"]
    report["matched"]["modes"]["trainable"]["points"][0]["over_seeds"] = {}     # an older report: seed 0's readout
    line = _line(report, DECODABLE)
    assert line["comparison"]["metric"]["value"] == 0.9 and "seed_words" not in line["comparison"]


@pytest.mark.parametrize("other, word, words", [
    ([0.5, 0.6, 0.25], "as much as", ["more than", "more than", "as much as"]),
    ([0.5, 0.6, 0.7], "more than", ["more than"] * 3)])
def test_the_selectors_matched_selection_effect_is_read_over_seeds(other, word, words):
    """The pretrained selection effect (same-relation keep 63/64 - other-relation keep 18/64, paired: 0.703)
    beside the control's effect over seeds (each seed's same-relation keep 0.955, 0.925, 0.94 minus its
    other-relation keep; not seed 0's keep rate, Wilson on the table's facts): seeds' effects 0.455, 0.325, 0.69
    read "more than" twice and "as much as" once, which the note says, the word the one over seeds; 0.455, 0.325,
    0.24 read "more than" every one. An older control (seed 0 only) is compared on the same-relation keep rate,
    Wilson."""
    same = [0.955, 0.925, 0.94]
    report = _calibrated_selector_report(63, 18, 20, controls=_control(keep=(same, other)))
    line = _line(report, SELECTOR)
    comparison = line["comparison"]
    effects = [a - b for a, b in zip(same, other)]
    assert comparison["metric"]["value"] == pytest.approx(sum(effects) / 3)
    assert comparison["metric"]["interval"] == "t over seeds" and "over 3 seeds" in comparison["name"]
    assert "selection effect" in comparison["name"]
    assert comparison["measured"]["value"] == pytest.approx(line["difference"]["value"]) == pytest.approx(45 / 64)
    assert comparison["difference"]["value"] == pytest.approx(45 / 64 - sum(effects) / 3)
    assert comparison["word"] == word and comparison["seed_words"] == words
    assert (FLIP in (line["note"] or "")) == (len(set(words)) > 1)
    old = _line(_calibrated_selector_report(63, 18, 20, controls=MATCHED_SELECTOR), SELECTOR)["comparison"]
    assert old["metric"]["interval"] == "wilson" and old["metric"]["n"] == 80 and "seed_words" not in old
    assert "selection effect" not in old["name"]
    bare = _control(keep=(same, other))                 # keep rates over seeds without each seed's value
    for m in bare["modes"]["trainable"]["points"][0]["over_seeds"]["gate_transplant"].values():
        m.pop("spread")
    kept = _line(_calibrated_selector_report(63, 18, 20, controls=bare), SELECTOR)["comparison"]
    assert "selection effect" not in kept["name"] and kept["metric"]["value"] == pytest.approx(sum(same) / 3)


@pytest.mark.parametrize("values", [[0.240, 0.265, 0.201], [0.1, 0.9], [0.5, 0.5, 0.51], [1.0, 0.2, 0.3, 0.95]])
def test_the_interval_over_seeds_covers_every_seed(values):
    """With 2 to 4 seeds the Student-t interval of the mean reaches past every seed's value (t_{n-1} >= n - 1);
    cut to (0, 1) it stays a rate's interval."""
    m = t_over_seeds(values)
    assert m.n == len(values) and m.value == pytest.approx(sum(values) / len(values))
    assert m.ci[0] <= min(values) and max(values) <= m.ci[1] and m.spread["values"] == values
    cut = t_over_seeds(values, (0, 1))
    assert 0 <= cut.ci[0] <= min(values) and max(values) <= cut.ci[1] <= 1
    assert t_over_seeds([0.3, None]).ci == (None, None) and t_over_seeds([None]).n == 0


def test_seeds_that_all_give_one_value_claim_no_interval():
    """Three seeds reading 1.0 each: their spread is 0, which says nothing of another seed, so no interval is
    claimed (a zero-width one would read as certainty), and a comparison beside it reads "as much as"."""
    for values in ([1.0, 1.0, 1.0], [0.5, 0.5]):
        m = t_over_seeds(values, (0, 1))
        assert m.value == values[0] and m.ci == (None, None) and m.n == len(values) and m.spread["sd"] == 0


def _curve_line(narrow: list[float], wide: list[float]) -> dict:
    """The superposition line beside a control whose curve has a narrow point (d = 4, its seeds' R^2 ``narrow``)
    and the point at the model's width (d = 8, ``wide``)."""
    controls = _control(r2=wide)
    narrow_point = {**controls["modes"]["trainable"]["points"][0], "d": 4, "r2_final": _over(narrow)}
    controls["modes"]["trainable"]["points"].insert(0, narrow_point)
    report = _claims_report(superposition={"1": {"r2": _r2(0.170, 0.132, 0.208, R2_NULLS)}}, controls=controls)
    return _line(report, SUPERPOSITION)


def test_a_control_short_of_its_own_curve_at_the_models_width_says_so():
    """SmolLM2's known-facts control: R^2 0.41 at d = 576 where its narrower widths reach 0.85; the comparison at
    the model's width says it reads a control short of the paper's model; a control whose interval reaches its
    curve's best says nothing, nor one short of it by less than the superposition's minimal effect (SmolLM2's
    converged control: 0.827 [0.811, 0.842] at d = 576 against 0.854 [0.834, 0.873] at d = 6)."""
    short = _curve_line([0.84, 0.85, 0.86], [0.40, 0.42, 0.41])
    assert "the control at d=8 reads superposition R^2 0.410" in short["note"]
    assert "its own curve reaches 0.850 at d=4" in short["note"] and "short of the paper's model" in short["note"]
    level = _curve_line([0.84, 0.85, 0.86], [0.80, 0.85, 0.90])
    assert "short of the paper's model" not in (level.get("note") or "")
    flat = _curve_line([0.846, 0.854, 0.862], [0.820, 0.827, 0.833])   # the converged control: 0.854 at d = 6, 0.827 at 576
    assert "short of the paper's model" not in (flat.get("note") or "")
