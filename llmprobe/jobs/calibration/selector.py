"""The selector line (:func:`calibrate_selector`): one-layer models where the MLP is a relation-conditioned selector
by construction or by training (the paper's construction; a trained geometric model) and where it is a key-value
memory (frozen_all; a memory whose MLP reads only the subject), each measured by the pretrained run's own gate
transplant code at the run's number of test facts and graded by the report's rule
(``llmprobe.report.claims.selector_test``): the calibrated keep test, the break test it replaces, and the
redirection test (a candidate that was not adopted).

Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmprobe.analyses.selector import PromptSet, redirect_metrics, redirect_transplant, transplant_metrics
from llmprobe.analyses.selector import gate_transplant as run_transplant
from llmprobe.jobs.calibration.common import world_row
from llmprobe.report.claims import ALPHA, SELECTOR, SELECTOR_BREAK_NULLS, _informative, claim_test, selector_test
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.mechanisms import redirection_items, transplant_items
from synthetic.model import FactRecallModel
from synthetic.tasks import FactTask, random_bijections, random_functions
from synthetic.train import TrainConfig, train


# ------------------------------------------------------------------------------------------------ the selector
@dataclass(frozen=True)
class SelectorWorld:
    """A planted world of the selector line: ``build(seed)`` -> (a one-layer model, its fact task); ``holds``:
    whether the MLP is a relation-conditioned selector in it (None: neither by construction)."""

    name: str
    build: Callable
    holds: bool | None


def selector_worlds(n_subjects: int = 64, n_relations: int = 4, d_model: int = 16, steps: int = 1000
                    ) -> list[SelectorWorld]:
    """The selector line's worlds, each a one-layer model on a fresh random table per seed:

    * the paper's construction (``synthetic.construction.build_construction``, smallest block size that answers
      every fact): a selector by construction;
    * a trained geometric model (trainable subject embeddings; Adam lr 0.03, weight decay 1e-4, ``steps`` steps:
      ``synth analyze``'s recipe), and the same stopped at its first 100% step without weight decay (the matched
      controls' regime, where the superposition is not yet clean);
    * the key-value memory: subject embeddings *and* unembedding frozen at random (frozen_all, same recipe), so
      the MLP must store the facts; and a planted memory whose MLP reads only the subject
      (``build_subject_memory``: no gate depends on the relation);
    * ``frozen`` (subject embeddings frozen, unembedding learned) as a row of its own: neither by construction
      (the unembedding aligns with the random embeddings, docs/mechanisms.md);
    * the key-value memory at twice the width: room enough that its gates turn relation-driven (the keep test's
      known false positive, docs/measures.md, "The selector line");
    * last, the trained geometric model at four times the width, converged (weight decay 1e-3, the matched
      controls' recipe): the paper's model with width to spare, whose gates need not select (its relation
      embedding reaches the unembedding beside the MLP)."""
    N, R = n_subjects, n_relations

    def construction(seed):
        task = random_bijections(N, R, seed)
        for b in range(1, 33):
            model = build_construction(task, b, seed=seed)
            if construction_accuracy(model, task) == 1.0:
                return model, task
        raise RuntimeError("no construction answers every fact")

    def trained(kw: dict, at_fit: bool = False, width: int = d_model, weight_decay: float = 1e-4):
        def build(seed):
            task = random_bijections(N, R, seed)
            cfg = (TrainConfig(progress=False) if at_fit else
                   TrainConfig(lr=0.03, max_steps=steps, weight_decay=weight_decay, past_fit=10 ** 9, progress=False))
            return train(task, width, config=cfg, seed=seed, **kw).model, task
        return build

    def memory(seed):
        task = random_functions(N, R, max(2, N // 8), seed=seed)
        return build_subject_memory(task, seed), task

    frozen_all = {"frozen_subjects": True, "frozen_unembed": True}
    return [SelectorWorld("construction (paper's selector)", construction, True),
            SelectorWorld(f"trainable, d={d_model}, wd, {steps} steps", trained({}), True),
            SelectorWorld(f"trainable, d={d_model}, stopped at fit", trained({}, at_fit=True), True),
            SelectorWorld(f"key-value: frozen_all, d={d_model}, wd", trained(frozen_all), False),
            SelectorWorld("key-value: MLP reads the subject only", memory, False),
            SelectorWorld(f"frozen subjects, d={d_model}, wd", trained({"frozen_subjects": True}), None),
            SelectorWorld(f"key-value: frozen_all, d={2 * d_model}, wd", trained(frozen_all, width=2 * d_model), False),
            SelectorWorld(f"trainable, d={4 * d_model}, wd 1e-3, {steps} steps", trained({}, width=4 * d_model,
                                                                                        weight_decay=1e-3), True)]


def grade_test(test: dict | None, family: int) -> str:
    """The verdict rule on one test of ``llmprobe.report.claims`` (``claim_test``'s p and p_zero), Bonferroni over
    ``family`` tests (Holm's strictest step, as :func:`grade`): supported / weak / not shown."""
    if test is None or test["missing_nulls"] or test["p"] is None:
        return "not shown"
    return ("supported" if min(1.0, family * test["p"]) < ALPHA else
            "weak" if min(1.0, family * test["p_zero"]) < ALPHA else "not shown")


def measure_selector_world(world: SelectorWorld, seed: int, n_items: int, n_boot: int = 1000) -> dict:
    """One draw of ``world``: its model measured by the pretrained run's gate transplant
    (:func:`transplant_test`: the run's code, ``n_items`` test facts the model answers) and by
    the redirection test (:func:`redirection`, as many items), each graded test with it:
    {"transplant", "redirection", "keep_test" (the calibrated line), "break_test" (the line before it),
    "redirect_test"}."""

    model, task = world.build(seed)
    metrics = transplant_test(model, task, n_items, seed=seed, n_boot=n_boot)
    redirect = redirection(model, task, n_items, seed=seed, n_boot=n_boot)
    old = {k: v for k, v in metrics.items() if k != "selector_keep"}
    redirect_test = None
    if redirect.get("redirect"):
        redirect_test = claim_test(SELECTOR, "all relations", None, redirect["redirect"],
                                   {"random_units": redirect["redirect"]["nulls"]["random_units"]},
                                   {"random_units": _informative(redirect["redirect_minus_random"])},
                                   required=SELECTOR_BREAK_NULLS)
    return {"transplant": metrics, "redirection": redirect, "keep_test": selector_test(metrics),
            "break_test": selector_test(old), "redirect_test": redirect_test}


def calibrate_selector(worlds: list[SelectorWorld], n_items: int, replicates: int, family: int,
                       n_boot: int = 1000, on_row=None) -> list[dict]:
    """One row per world: n, replicates, the mean keep rates (same relation, other relation, the random switch-offs
    by count and by count and norm), the mean redirection and its random null, and per test (``keep``: the
    calibrated line; ``break``: the line before it; ``redirect``) the fraction of replicates graded supported and
    supported or weak: power where the claim holds, false-positive rate (supported or weak) where it fails."""
    rows = []
    for world in worlds:
        grades = {"keep": [], "break": [], "redirect": []}
        measured, n_seen = [], []
        for seed in range(replicates):
            got = measure_selector_world(world, seed, n_items, n_boot)
            m, rd = got["transplant"], got["redirection"]
            n_seen.append(m["n_items"])
            values = {key: m[key]["value"] for key in ("same_relation", "other_relation", "random_units",
                                                      "random_units_matched")}
            if rd.get("redirect"):
                values.update(redirect=rd["redirect"]["value"],
                              redirect_random=rd["redirect"]["nulls"]["random_units"]["value"])
            measured.append(values)
            for key in grades:
                grades[key].append(grade_test(got[f"{key}_test"], family))
        row = world_row(world, {"n": min(n_seen)}, replicates, family, measured, grades)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_selector_rows(rows: list[dict]) -> str:
    """The selector calibration table as text: keep rates, then per test supported / supported or weak (power
    where the claim holds, false-positive rate where it fails)."""
    holds = {True: "yes", False: "no", None: "-"}
    out = [f"{'world':40s} {'holds':5s} {'n':>3s} {'reps':>4s} {'same':>5s} {'other':>5s} {'rnd':>5s} {'rnd n':>5s} "
           f"{'redir':>5s} {'r rnd':>5s}  {'keep: supp / +weak':>18s}  {'break: supp / +weak':>19s}  "
           f"{'redirect: supp / +weak':>22s}"]
    for r in rows:
        out.append(f"{r['world']:40s} {holds[r['claim_holds']]:5s} {r['n']:3d} {r['replicates']:4d} "
                   f"{r['same_relation']:5.2f} {r['other_relation']:5.2f} {r['random_units']:5.2f} "
                   f"{r['random_units_matched']:5.2f} {r.get('redirect', float('nan')):5.2f} "
                   f"{r.get('redirect_random', float('nan')):5.2f}  "
                   f"{r['keep_supported']:8.2f} / {r['keep_supported_or_weak']:5.2f}  "
                   f"{r['break_supported']:9.2f} / {r['break_supported_or_weak']:5.2f}  "
                   f"{r['redirect_supported']:12.2f} / {r['redirect_supported_or_weak']:5.2f}")
    return "\n".join(out)


# ------------------------------------------------ the pretrained run's selector tests on the one-layer model
def transplant_test(model: FactRecallModel, task: FactTask, n_items: int | None = None, seed: int = 0,
                    n_boot: int = 1000) -> dict:
    """The pretrained run's gate transplant on the one-layer model, by its own code
    (:func:`llmprobe.analyses.selector.gate_transplant` at block [0], :func:`~llmprobe.analyses.selector.
    transplant_metrics`) on :func:`transplant_items`: the keep rates under another subject's gates of the same
    relation and under the subject's own gates of another relation, the random switch-offs (count; count and
    norm), and the selector line's test ``selector_keep`` with its paired margins. JSON-ready, with ``n_items``."""
    items = transplant_items(task, n_items, seed, model)
    if items["s"].numel() == 0:
        return {"n_items": 0, "error": "no fact with a donor"}
    N = task.n_subjects
    rows = lambda subj, rel: PromptSet.of_ids(torch.stack([subj, N + rel], 1))  # noqa: E731
    hits = run_transplant(model, rows(items["s"], items["r"]), rows(items["s_same"], items["r"]),
                          rows(items["s"], items["r_other"]), items["answer"], [0],
                          torch.Generator().manual_seed(seed + 53), batch_size=max(1, items["s"].numel()),
                          matched_gen=torch.Generator().manual_seed(seed + 59))
    return {"n_items": int(items["s"].numel()), **transplant_metrics(hits, n_boot=n_boot, seed=seed)}


def redirection(model: FactRecallModel, task: FactTask, n_items: int | None = None, seed: int = 0,
                n_boot: int = 1000, shuffled: bool = False) -> dict:
    """The selector's redirection test on the one-layer model, by the code that measures pretrained models
    (:func:`llmprobe.analyses.selector.redirect_transplant`, block [0]): each item (s, r) of
    :func:`redirection_items` runs with the ReLU on/off mask of (s'', r') -- another subject, another relation --
    and its own pre-activations. A relation-conditioned selector answers a_{r'}(s) (the gates pick the relation,
    the values carry the subject); a key-value memory keyed on (s, r) does not. Null: a random switch-off matched
    in count and norm (``random_units``). Returns :func:`llmprobe.analyses.selector.redirect_metrics` with
    ``n_items``."""
    items = redirection_items(task, n_items, seed, shuffled)
    if items["s"].numel() == 0:
        return {"n_items": 0, "redirect": None, "redirect_minus_random": None, "redirect_keeps_old": None}
    N = task.n_subjects
    rows = lambda subj, rel: PromptSet.of_ids(torch.stack([subj, N + rel], 1))  # noqa: E731
    preds = redirect_transplant(model, rows(items["s"], items["r"]), rows(items["s_cross"], items["r_new"]), [0],
                                torch.Generator().manual_seed(seed + 43), batch_size=max(1, items["s"].numel()))
    return {"n_items": int(items["s"].numel()),
            **redirect_metrics(preds, items["new"], items["old"], n_boot=n_boot, seed=seed)}
