"""Freeze-and-swap: does the trained MLP hold a *general* relation selector, or the specific facts?

Keep everything of a trained one-hop model frozen (MLP, attention, relation embeddings, unembedding) and give it
new subject embeddings that encode *new* random maps (an independent permutation of each relation's column of the
fact table across subjects: for bijections, new random bijections onto the same attribute set). Conditions:

* ``swap``: e'_s = c + sum_r W_r u_{a'_r(s)}, with c and W_r from :class:`llmprobe.geometry.SuperpositionFit` fitted
  on the trained embeddings (the learned attribute directions W_r u_a; u_a = unembedding rows).
* ``random_init``: fresh embeddings drawn as at model initialisation, N(0, embed_std^2): the subject embeddings of
  :func:`synthetic.mechanisms.untrained_like` (the re-initialisation baseline). ``random_matched``: random
  directions with the norms of the ``swap`` embeddings (:func:`llmprobe.geometry.random_direction_like`, the
  random-direction control of every edit).
* ``old_table``: the same fit applied to the *trained* table (sanity: the fit reproduces the original facts).

Each condition reports zero-shot accuracy on the new table, then the accuracy after a few steps of training the
subject embeddings alone (Adam, constant learning rate; the rest of the model frozen) and the first step count at
which every new fact is answered.
"""
from __future__ import annotations

import copy
import time

import torch

from llmprobe.geometry import ALPHA_GRID, SuperpositionFit, random_direction_like, shuffle_table

from .mechanisms import _round, local_table, readout_inputs, untrained_like
from .model import FactRecallModel
from .tasks import FactTask

DEFAULT_STEPS = (0, 10, 25, 50, 100)
CONDITIONS = ("swap", "random_init", "random_matched", "old_table")


def new_table(task: FactTask, seed: int = 1) -> FactTask:
    """A new fact table over the same subjects, relations and attribute sets: each relation's column is permuted
    across subjects independently (for bijections: a new uniformly random bijection per relation)."""
    table = shuffle_table(task.table, seed=seed)
    return FactTask(table, n_outputs=task.n_outputs, kind=task.kind, seed=seed, subjects=task.subjects,
                    relations=task.relations, attributes=task.attributes, attr_index=task.attr_index,
                    meta={**task.meta, "swapped_from_seed": task.seed})


def fit_superposition(model: FactRecallModel, task: FactTask, alpha=ALPHA_GRID) -> SuperpositionFit:
    """SuperpositionFit of the trained subject embeddings on the trained table (all subjects)."""
    H, A, U = readout_inputs(model, task)
    return SuperpositionFit(alpha=alpha).fit(H, A, U)


def swapped_embeddings(fit: SuperpositionFit, task: FactTask) -> torch.Tensor:
    """e'_s = c + sum_r W_r u_{a_r(s)} for the table of ``task`` [N, d]."""
    return fit.predict(local_table(task)).float()


def with_subjects(model: FactRecallModel, embeddings: torch.Tensor) -> FactRecallModel:
    """A copy of ``model`` with new subject embeddings; only they are trainable."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        m.subject_embed.copy_(embeddings.to(m.subject_embed.dtype))
    m.subject_embed.requires_grad_(True)
    return m


def train_subjects(model: FactRecallModel, task: FactTask, steps=DEFAULT_STEPS, lr: float = 0.01) -> dict:
    """Train only ``model.subject_embed`` on ``task`` (full batch, Adam, constant lr); accuracy at each step count
    in ``steps`` (0 = zero-shot) and ``steps_to_100`` (first step at which every fact is the argmax, None if not
    within max(steps)). Accuracy is strict argmax: a fact counts only when its answer is the *unique* top logit (a
    tie, e.g. of embeddings that carry nothing, is wrong)."""
    data = task.data()
    opt = torch.optim.Adam([model.subject_embed], lr=lr, betas=(0.9, 0.98))
    want = sorted(set(int(s) for s in steps))
    curve, to_100 = {}, None
    for step in range(want[-1] + 1):
        loss, correct = model.loss(data.input_ids, data.target_pos, data.targets)
        acc = int(correct) / data.n_predictions          # accuracy of the parameters before this update
        if step in want:
            curve[step] = acc
        if acc >= 1.0 and to_100 is None:
            to_100 = step
        if step == want[-1]:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"accuracy": curve, "steps_to_100": to_100}


def freeze_and_swap(model: FactRecallModel, task: FactTask, seed: int = 1, steps=DEFAULT_STEPS, lr: float = 0.03,
                    alpha=ALPHA_GRID, conditions=CONDITIONS) -> dict:
    """Run the ``conditions`` of the module docstring; returns a JSON-ready dict with ``zero_shot`` per condition,
    ``curves`` (accuracy by training step), ``steps_to_100``, the fit's in-sample R^2 and wall time."""
    conditions = CONDITIONS if conditions is None else tuple(conditions)
    unknown = set(conditions) - set(CONDITIONS)
    if unknown:
        raise ValueError(f"unknown condition(s) {sorted(unknown)}; choose from {CONDITIONS}")
    t0 = time.perf_counter()
    fit = fit_superposition(model, task, alpha)
    H, A, _ = readout_inputs(model, task)
    fresh = new_table(task, seed)
    E_swap = swapped_embeddings(fit, fresh)
    E_rand = untrained_like(model, seed_offset=seed + 101).subject_embeddings().detach().float()
    E_match = random_direction_like(E_swap, torch.Generator().manual_seed(seed + 101))
    built = {
        "swap": lambda: (E_swap, fresh),
        "random_init": lambda: (E_rand, fresh),
        "random_matched": lambda: (E_match, fresh),
        "old_table": lambda: (swapped_embeddings(fit, task), task),
    }
    curves, to_100 = {}, {}
    for name in conditions:
        E, t = built[name]()
        res = train_subjects(with_subjects(model, E), t, steps=steps if name != "old_table" else (0,), lr=lr)
        curves[name] = res["accuracy"]
        to_100[name] = res["steps_to_100"]
    chance = 1.0 / max(1, min(int(task.relation_attributes(r).numel()) for r in range(task.n_relations)))
    out = {
        "zero_shot": {name: c[0] for name, c in curves.items()},
        "curves": {name: {str(k): v for k, v in c.items()} for name, c in curves.items()},
        "steps_to_100": to_100,
        "fit_r2_in_sample": fit.score(H, A), "fit_alpha": fit.alpha_,
        "chance": chance, "new_table_seed": seed, "lr": lr, "max_steps": max(steps),
    }
    out = _round(out)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out
