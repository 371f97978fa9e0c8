"""How a trained one-layer model recalls: superposition readouts of the subject embeddings and the MLP as a
relation-conditioned selector, measured beside the frozen_all control (subject embeddings and unembedding frozen at
random init: an associative key-value memory).

Everything here takes a trained :class:`synthetic.model.FactRecallModel` and its one-hop
:class:`synthetic.tasks.FactTask` and returns plain, JSON-ready dicts.

1. **Superposition readouts** (:func:`superposition`): the subject embeddings e_s (relation-free states) go through
   the *same* geometry code that measures pretrained models (:func:`llmprobe.geometry.superposition_readout`):
   per-relation linear readout accuracy of a_r(s) from e_s, the fit e_s ~ c + sum_r W_r u_{a_r(s)} with held-out
   R^2 (k-fold over subjects), the shuffled-table control, any control models (a frozen-embedding model of the same
   width, the untrained model), and a *causal* swap edit: e_s + W_r (u_{a'} - u_{a_r(s)}) patched into the subject
   position should make relation r answer a' and leave the other relations alone. u_a = the model's unembedding row
   of attribute a (:meth:`FactRecallModel.attribute_vectors`).
2. **Selector** (:func:`selector`): per MLP hidden unit (``blocks.0.mlp_hidden`` at the answer position) its mean
   activation and firing rate per relation; a *selectivity index* SI = (mu_max - mean_{r != max} mu_r) /
   (mu_max + mean_{r != max} mu_r) in [0, 1] and a *relation-gating index* I(gate; relation) / H(gate) (how much of
   a unit's on/off pattern the relation alone explains); each unit is assigned to its top relation. The
   **ablation matrix** M[r, r'] = drop in accuracy on relation r' when the units assigned to r are zeroed, beside a
   control that zeroes the same number of random units; diagonal-dominant = each row's diagonal drop exceeds every
   off-diagonal drop. **Gate transplant**: run (s, r) with the ReLU on/off mask taken from a *different* subject
   with the same relation (selector: accuracy stays high) or from the same subject with another relation (control:
   accuracy falls). **Relation patch**: shift the MLP input of (s, r) by the mean difference between relation r2's
   and r's MLP inputs (estimated on other subjects): the answer should follow the new relation for the same
   subject (and a plain swap of the relation token's embedding, as a sanity check).
   ``exclusive_ablation`` repeats the matrix for units that fire for one relation only.
3. **Logit attribution** (:func:`logit_attribution`): with r fixed the model is (nearly) linear in e_s; the right
   answer's logit splits into the queried relation's component and the other relations' components (the latter can
   only help on the table the attribute vectors were co-adapted with).
4. :func:`key_numbers` / :func:`compare` lay several models (trainable, frozen, frozen_all) side by side.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterator

import torch

from llmprobe.geometry import (
    ALPHA_GRID,
    SuperpositionFit,
    kfold_indices,
    random_direction_like,
    ridge_fit,
    shuffle_table,
    superposition_readout,
)
from llmprobe.metric import proportion
from llmprobe.model.capture import capture, patch
from synthetic.model import FactRecallModel
from synthetic.tasks import FactTask

HIDDEN = "blocks.0.mlp_hidden"
RESID_PRE = "blocks.0.resid_pre"


# ------------------------------------------------------------------------------------------------------ helpers
def readout_inputs(model: FactRecallModel, task: FactTask) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(H [N, d] subject embeddings, A [N, R] *local* attribute indices (-1 = missing), U list of R
    [n_attr_r, d] unembedding rows of each relation's attributes) as the geometry code expects them."""
    return embedding_inputs(model.subject_embeddings(), model.attribute_vectors(), task)


def embedding_inputs(subject_embed: torch.Tensor, unembed: torch.Tensor,
                     task: FactTask) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`readout_inputs` from the tables themselves: subject embeddings [N, d] and unembedding [n_outputs, d]
    (a model's, or a snapshot of them taken during training, :func:`synthetic.train.snapshot`)."""
    W = unembed.detach().float()
    return (subject_embed.detach().float(), local_table(task),
            [W[task.relation_attributes(r)] for r in range(task.n_relations)])


def local_table(task: FactTask) -> torch.Tensor:
    """task.table (global output ids) -> per-relation local attribute indices (position in relation_attributes)."""
    A = torch.full_like(task.table, -1)
    for r in range(task.n_relations):
        ids = task.relation_attributes(r)
        lookup = torch.full((task.n_outputs,), -1, dtype=torch.long)
        lookup[ids] = torch.arange(ids.numel())
        col = task.table[:, r]
        ok = col >= 0
        A[ok, r] = lookup[col[ok]]
    return A


def _one_hop(task: FactTask):
    data = task.data()
    s, r, a = task.facts()
    return data.input_ids, s, r, a


@torch.no_grad()
def _logits_last(model: FactRecallModel, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Argmax answers [F] at the last position (full forward, so hooks and patches apply)."""
    out = []
    for i in range(0, ids.shape[0], chunk):
        out.append(model(ids[i:i + chunk])[:, -1].argmax(-1))
    return torch.cat(out)


@contextlib.contextmanager
def _edit_hidden(model: FactRecallModel, fn) -> Iterator[None]:
    """Forward hook on ``blocks.0.mlp_hidden``: ``fn(hidden [b, t, m]) -> hidden``."""
    handle = model.hook_points()[HIDDEN].register_forward_hook(lambda mod, args, out: fn(out))
    try:
        yield
    finally:
        handle.remove()


def accuracy_by_relation(model: FactRecallModel, task: FactTask, pred: torch.Tensor | None = None) -> torch.Tensor:
    """Accuracy [R] of the model's argmax answers on each relation's facts."""
    ids, s, r, a = _one_hop(task)
    if pred is None:
        pred = _logits_last(model, ids)
    hits = (pred == a).double()
    return torch.zeros(task.n_relations, dtype=torch.float64).index_add_(0, r, hits) / \
        torch.bincount(r, minlength=task.n_relations).clamp_min(1)


def _round(x, nd=4):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, float):
        return round(x, nd) if math.isfinite(x) else None
    if isinstance(x, (list, tuple)):
        return [_round(v, nd) for v in x]
    if isinstance(x, dict):
        return {k: _round(v, nd) for k, v in x.items()}
    return x


# -------------------------------------------------------------------------------------------- 1. superposition
def superposition(model: FactRecallModel, task: FactTask, nulls: dict[str, FactRecallModel] | None = None,
                  k: int = 5, n_boot: int = 500, seed: int = 0, swap_edit: bool = True,
                  max_edits: int = 512) -> dict:
    """Superposition readouts of e_s with the shuffled-table control and each control model (same task).

    Returns ``{"report": SuperpositionReport.to_dict(), "summary": {condition: {r2, readout_acc, decode_acc,
    chance}}, "swap_edit": {...}}`` where summary values are means over relations (readout accuracies are the
    fraction of held-out subjects whose nearest attribute under relation r's linear readout is a_r(s)).
    """
    t0 = time.perf_counter()
    H, A, U = readout_inputs(model, task)
    ctrl = {}
    for name, m in (nulls or {}).items():
        H_c, _, U_c = readout_inputs(m, task)
        ctrl[name] = (H_c, U_c)
    rep = superposition_readout(H, A, U, nulls=ctrl, relation_names=task.relations, k=k, n_boot=n_boot,
                                seed=seed).to_dict()
    summary = {}
    for name, cond in rep["conditions"].items():
        summary[name] = {"r2": cond["r2"]["value"], "r2_ci": cond["r2"]["ci"]}
        for key in ("readout_acc", "decode_acc", "chance"):
            vals = [v["value"] for v in (cond.get(key) or {}).values() if v]
            summary[name][key] = sum(vals) / len(vals) if vals else None
    out = {"report": rep, "summary": _round(summary)}
    if swap_edit:
        out["swap_edit"] = swap_edits(model, task, k=k, seed=seed, max_edits=max_edits)
        for name, m in (nulls or {}).items():
            out[f"swap_edit_{name}"] = swap_edits(m, task, k=k, seed=seed, max_edits=max_edits)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


@torch.no_grad()
def swap_edits(model: FactRecallModel, task: FactTask, k: int = 5, seed: int = 0, max_edits: int = 512,
               alpha=None) -> dict:
    """Causal test of the superposition fit on held-out subjects.

    For each fold, fit e_s ~ c + sum_r W_r u_{a_r(s)} on the training subjects; for a held-out subject s and a
    relation r pick a random a' != a_r(s) among r's attributes, patch e_s -> e_s + W_r (u_{a'} - u_{a_r(s)})
    (:meth:`SuperpositionFit.swap_edit`, the edit the pretrained swap uses) at the subject position
    (``blocks.0.resid_pre``, position 0) and ask every relation. Items: the edits (n = ``n_edits``). ``flip`` =
    fraction where relation r now answers a'; ``others_kept`` = fraction where every other relation still answers
    its table answer; ``success`` = both at once. Each is a typed metric (:func:`llmprobe.metric.proportion`,
    Wilson interval) with the control ``random_direction``: the same edits with a random direction of the same
    norm (:func:`llmprobe.geometry.random_direction_like`, drawn from its own generator, so the edits do not depend
    on it).
    """
    H, A, U = readout_inputs(model, task)
    N, R = A.shape
    H64 = H.double()
    g = torch.Generator().manual_seed(seed + 17)
    folds = kfold_indices(N, k, seed)
    per_fold = max(1, max_edits // len(folds))
    n_attr_of = torch.tensor([U_r.shape[0] for U_r in U])
    subjects, relations, new_attrs, deltas = [], [], [], []
    for train_idx, test_idx in folds:
        fit = SuperpositionFit(alpha=ALPHA_GRID if alpha is None else alpha).fit(H[train_idx], A[train_idx], U)
        subj = test_idx[torch.randperm(test_idx.numel(), generator=g)]
        rels = torch.randint(0, R, (subj.numel(),), generator=g)
        keep = (A[subj, rels] >= 0) & (n_attr_of[rels] >= 2)          # something to swap to
        subj, rels = subj[keep][:per_fold], rels[keep][:per_fold]
        if subj.numel() == 0:
            continue
        new_local = torch.empty_like(subj)
        for i, (s, r) in enumerate(zip(subj.tolist(), rels.tolist())):
            a_new = int(torch.randint(0, int(n_attr_of[r]) - 1, (1,), generator=g))
            new_local[i] = a_new + (a_new >= int(A[s, r]))           # any attribute but the current one
        delta = torch.zeros(subj.numel(), H.shape[1], dtype=torch.float64)
        for r in rels.unique().tolist():
            rows = rels == r
            h = H64[subj[rows]]
            delta[rows] = fit.swap_edit(h, A[subj[rows]], r, new_local[rows]) - h
        subjects.append(subj)
        relations.append(rels)
        new_attrs.append(new_local)
        deltas.append(delta.float())
    if not subjects:
        return _round({"n_edits": 0, **{key: proportion([]).to_dict() for key in ("flip", "others_kept", "success")}})
    subj, rels, new_local, delta = (torch.cat(x) for x in (subjects, relations, new_attrs, deltas))
    n = subj.numel()
    target_new = torch.stack([task.relation_attributes(r)[a] for r, a in zip(rels.tolist(), new_local.tolist())])
    table = task.table[subj]
    other = torch.ones(n, R, dtype=torch.bool)
    other[torch.arange(n), rels] = False
    ids = torch.stack([subj.repeat_interleave(R), torch.arange(R).repeat(n) + N], 1)   # every relation of s
    scored = {}
    for name, d_vec in (("edit", delta), ("random_direction",
                                          random_direction_like(delta, torch.Generator().manual_seed(seed + 19)))):
        with patch(model, RESID_PRE, torch.zeros(ids.shape[0], dtype=torch.long),
                   delta=d_vec.repeat_interleave(R, 0)):
            pred = _logits_last(model, ids, chunk=ids.shape[0]).view(n, R)
        flip = pred[torch.arange(n), rels] == target_new
        kept = (((pred == table) | (table < 0)) | ~other).all(1)
        scored[name] = {"flip": flip, "others_kept": kept, "success": flip & kept}
    out = {"n_edits": n}
    for key in ("flip", "others_kept", "success"):
        metric = proportion(scored["edit"][key].double().tolist())
        out[key] = metric.with_nulls({"random_direction": proportion(
            scored["random_direction"][key].double().tolist())}).to_dict()
    return _round(out)


# -------------------------------------------------------------------------------------------------- 2. selector
@torch.no_grad()
def hidden_activations(model: FactRecallModel, task: FactTask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [F, m] at the answer position, subject [F], relation [F]) for every fact."""
    ids, s, r, _ = _one_hop(task)
    pos = torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.long)
    hid = capture(model, [HIDDEN], ids, positions=pos)[HIDDEN][:, 0]
    return hid, s, r


def _entropy(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-12, 1 - 1e-12)
    return -(p * p.log2() + (1 - p) * (1 - p).log2())


def unit_stats(hidden: torch.Tensor, rel: torch.Tensor, n_relations: int) -> dict:
    """Per unit: mean activation [R, m] and firing rate [R, m] by relation, selectivity index [m], relation-gating
    index [m] (I(gate; relation) / H(gate), NaN for units that never or always fire), top relation [m], alive [m]."""
    R = n_relations
    counts = torch.bincount(rel, minlength=R).double().clamp_min(1)[:, None]
    h = hidden.double()
    mean = torch.zeros(R, h.shape[1], dtype=torch.float64).index_add_(0, rel, h) / counts
    rate = torch.zeros(R, h.shape[1], dtype=torch.float64).index_add_(0, rel, (h > 0).double()) / counts
    top = mean.argmax(0)
    mu_max = mean.max(0).values
    rest = (mean.sum(0) - mu_max) / max(R - 1, 1)
    si = (mu_max - rest) / (mu_max + rest).clamp_min(1e-12)
    p = (h > 0).double().mean(0)
    weights = counts[:, 0] / counts.sum()
    h_gate = _entropy(p)
    cond = (weights[:, None] * _entropy(rate)).sum(0)
    gating = (h_gate - cond) / h_gate
    gating[(p <= 0) | (p >= 1)] = float("nan")
    alive = mu_max > 0
    return {"mean": mean, "rate": rate, "si": si, "gating": gating, "top": top, "alive": alive,
            "fire_rate": p}


@torch.no_grad()
def ablation_matrix(model: FactRecallModel, task: FactTask, groups: list[torch.Tensor]) -> dict:
    """Accuracy with each group of hidden units zeroed. groups[r] = unit indices (LongTensor).
    Returns base accuracy [R], accuracy [len(groups), R] and drop = base - accuracy."""
    ids, s, r, a = _one_hop(task)
    base = accuracy_by_relation(model, task)
    m = model.config.d_mlp
    acc = []
    for units in groups:
        mask = torch.ones(m)
        mask[units] = 0.0
        with _edit_hidden(model, lambda h, mask=mask: h * mask):
            acc.append(accuracy_by_relation(model, task))
    acc = torch.stack(acc) if acc else torch.zeros(0, task.n_relations)
    return {"base": base, "accuracy": acc, "drop": base[None, :] - acc}


def diagonal_dominance(drop: torch.Tensor) -> dict:
    """For a square drop matrix: rows whose diagonal exceeds every off-diagonal entry, mean diagonal and mean
    off-diagonal drop, and their difference."""
    R = drop.shape[0]
    drop = drop.double()
    diag = drop.diagonal()
    off = drop.masked_fill(torch.eye(R, dtype=torch.bool), float("-inf"))
    rows = (diag > off.max(1).values) if R > 1 else torch.ones(1, dtype=torch.bool)
    off_mean = float(drop[~torch.eye(R, dtype=torch.bool)].mean()) if R > 1 else 0.0
    return {"dominant_rows": int(rows.sum()), "n_rows": R, "diagonal_dominant": bool(rows.all()),
            "mean_diag_drop": float(diag.mean()), "mean_offdiag_drop": off_mean,
            "diag_minus_offdiag": float(diag.mean()) - off_mean}


@torch.no_grad()
def gate_transplant(model: FactRecallModel, task: FactTask, seed: int = 0) -> dict:
    """Run every fact (s, r) with the MLP's ReLU on/off mask replaced, keeping its own pre-activations.

    ``same_relation``: mask from (s2, r) with a random other subject s2 (a selector keeps accuracy: its gates
    depend on the relation, not the subject). ``same_subject``: mask from (s, r2) with a random other relation
    (control: should fail). ``own``: the unedited accuracy."""
    ids, s, r, a = _one_hop(task)
    N, R = task.n_subjects, task.n_relations
    g = torch.Generator().manual_seed(seed + 29)
    pos = torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.long)
    mid = capture(model, ["blocks.0.resid_mid"], ids, positions=pos)["blocks.0.resid_mid"][:, 0]
    pre = mid @ model.W_in.detach() + model.b_in.detach()
    out = {"own": float(accuracy_by_relation(model, task).mean())}
    fact_index = torch.full((N, R), -1, dtype=torch.long)
    fact_index[s, r] = torch.arange(s.numel())
    s2 = (s + torch.randint(1, N, s.shape, generator=g)) % N
    r2 = (r + torch.randint(1, max(R, 2), r.shape, generator=g)) % max(R, 1) if R > 1 else r
    for name, (ss, rr) in {"same_relation": (s2, r), "same_subject": (s, r2)}.items():
        donor = fact_index[ss, rr]
        ok = donor >= 0
        if not bool(ok.any()) or (name == "same_subject" and R < 2):
            out[name] = None
            continue
        mask = (pre[donor.clamp_min(0)] > 0).to(pre.dtype)
        hid = mask * pre
        with patch(model, HIDDEN, pos[:, 0], values=hid):
            pred = _logits_last(model, ids, chunk=ids.shape[0])
        hits = (pred == a)[ok]
        out[name] = float(hits.double().mean())
    return out


def transplant_items(task: FactTask, n_items: int | None = None, seed: int = 0,
                     model: FactRecallModel | None = None) -> dict[str, torch.Tensor]:
    """Items of the gate-transplant test as the pretrained run draws them (``llmprobe.analyses.selector``,
    ``_transplant_items``), in a seeded random order, at most ``n_items`` (None: every fact that has them): facts
    (s, r) -- with ``model``, only those it answers (the run's known facts) -- each with a donor s' != s of the
    same relation whose answer differs and a random other relation r' of s. {"s", "r", "s_same", "r_other",
    "answer"}: LongTensor [n]."""
    gen = torch.Generator().manual_seed(seed + 47)
    s, r, a = task.facts()
    if model is not None:
        ok = accuracy_mask(model, task)
        s, r, a = s[ok], r[ok], a[ok]
    R = task.n_relations
    rows = {k: [] for k in ("s", "r", "s_same", "r_other", "answer")}
    for k in torch.randperm(s.numel(), generator=gen).tolist():
        i, q = int(s[k]), int(r[k])
        donors = torch.nonzero((task.table[:, q] >= 0) & (task.table[:, q] != a[k])).flatten()
        others = [p for p in range(R) if p != q and int(task.table[i, p]) >= 0]
        if donors.numel() == 0 or not others:
            continue
        for key, value in (("s", i), ("r", q), ("answer", int(a[k])),
                           ("s_same", int(donors[torch.randint(donors.numel(), (1,), generator=gen)])),
                           ("r_other", others[int(torch.randint(len(others), (1,), generator=gen))])):
            rows[key].append(value)
        if n_items is not None and len(rows["s"]) == n_items:
            break
    return {k: torch.tensor(v, dtype=torch.long) for k, v in rows.items()}


@torch.no_grad()
def accuracy_mask(model: FactRecallModel, task: FactTask) -> torch.Tensor:
    """Whether the model answers each fact of ``task.facts()`` (BoolTensor [F])."""
    ids, _, _, a = _one_hop(task)
    return _logits_last(model, ids) == a


@torch.no_grad()
def redirection_items(task: FactTask, n_items: int | None = None, seed: int = 0,
                      shuffled: bool = False) -> dict[str, torch.Tensor]:
    """Items of the redirection test, in a seeded random order, at most ``n_items`` (None: every fact that has
    them): facts (s, r) with another relation r' whose fact of s has another answer (``new`` = a_{r'}(s)) and a
    donor s'' != s with a fact under r' of yet another answer (``cross`` = its prompt (s'', r')). ``shuffled``:
    score against a table whose rows are permuted within each relation (the new answer a_{r'}(pi(s)): facts that
    are not the model's, a planted negative). {"s", "r", "r_new", "s_cross", "old", "new"}: LongTensor [n]."""
    gen = torch.Generator().manual_seed(seed + 41)
    table = task.table
    if shuffled:
        table = torch.stack([col[torch.randperm(col.numel(), generator=gen)] for col in table.T], 1)
        table = torch.where(task.table >= 0, table, task.table)
    s, r, a = task.facts()
    order = torch.randperm(s.numel(), generator=gen).tolist()
    N, R = task.n_subjects, task.n_relations
    rows = {k: [] for k in ("s", "r", "r_new", "s_cross", "old", "new")}
    for k in order:
        i, q = int(s[k]), int(r[k])
        rels = [p for p in range(R) if p != q and int(table[i, p]) >= 0 and int(table[i, p]) != int(a[k])]
        if not rels:
            continue
        p = rels[int(torch.randint(len(rels), (1,), generator=gen))]
        donors = torch.nonzero((task.table[:, p] >= 0) & (task.table[:, p] != table[i, p])
                               & (torch.arange(N) != i)).flatten()
        if donors.numel() == 0:
            continue
        for key, value in (("s", i), ("r", q), ("r_new", p), ("old", int(a[k])), ("new", int(table[i, p])),
                           ("s_cross", int(donors[torch.randint(donors.numel(), (1,), generator=gen)]))):
            rows[key].append(value)
        if n_items is not None and len(rows["s"]) == n_items:
            break
    return {k: torch.tensor(v, dtype=torch.long) for k, v in rows.items()}


@torch.no_grad()
@torch.no_grad()
def relation_patch(model: FactRecallModel, task: FactTask, seed: int = 0) -> dict:
    """Move the query from relation r to r2 for the same subject by a *subject-independent* edit.

    ``embedding_swap``: replace the relation token's state (``blocks.0.resid_pre``, position 1) by r2's embedding
    (the same as feeding token r2: a sanity check). ``mid_shift``: add the mean difference
    mean_s' [mid(s', r2) - mid(s', r)] of the MLP input (``blocks.0.resid_mid`` at the answer position), estimated
    on the other half of the subjects, to the held-out half. If the relation enters the MLP as a direction that
    does not depend on the subject (exactly so with uniform attention), the answer follows r2: ``follows_new`` =
    fraction answering a_{r2}(s), ``keeps_old`` = fraction still answering a_r(s) (where the two differ)."""
    ids, s, r, a = _one_hop(task)
    N, R = task.n_subjects, task.n_relations
    if R < 2:
        return {"embedding_swap": None, "mid_shift": None, "follows_new": None}
    g = torch.Generator().manual_seed(seed + 31)
    r2 = (r + torch.randint(1, R, r.shape, generator=g)) % R
    target = task.table[s, r2]
    ok = target >= 0
    last = ids.shape[1] - 1

    def score(pred, rows):
        sel = ok & rows
        differ = sel & (target != a)
        return {"follows_new": float((pred == target)[sel].double().mean()) if bool(sel.any()) else None,
                "keeps_old": float((pred == a)[differ].double().mean()) if bool(differ.any()) else None}

    pos_vec = model.pos[1].detach() if model.pos is not None else 0.0
    values = model.relation_embeddings()[r2] + pos_vec
    with patch(model, RESID_PRE, torch.ones(ids.shape[0], dtype=torch.long), values=values):
        pred = _logits_last(model, ids, chunk=ids.shape[0])
    out = {"embedding_swap": score(pred, torch.ones_like(ok))}
    # mean relation-difference vectors at the MLP input, from one half of the subjects
    pos = torch.full((ids.shape[0], 1), last, dtype=torch.long)
    mid = capture(model, ["blocks.0.resid_mid"], ids, positions=pos)["blocks.0.resid_mid"][:, 0].double()
    half = torch.zeros(N, dtype=torch.bool)
    half[torch.randperm(N, generator=g)[: N // 2]] = True
    fact = torch.full((N, R), -1, dtype=torch.long)
    fact[s, r] = torch.arange(s.numel())
    mean_mid = torch.zeros(R, mid.shape[1], dtype=torch.float64)
    for q in range(R):
        rows = fact[half, q]
        rows = rows[rows >= 0]
        mean_mid[q] = mid[rows].mean(0) if rows.numel() else 0.0
    delta = (mean_mid[r2] - mean_mid[r]).float()
    with patch(model, "blocks.0.resid_mid", pos[:, 0], delta=delta):
        pred = _logits_last(model, ids, chunk=ids.shape[0])
    out["mid_shift"] = score(pred, ~half[s])
    out["follows_new"] = out["mid_shift"]["follows_new"]
    return out


def selector(model: FactRecallModel, task: FactTask, seed: int = 0, min_si: float = 0.0) -> dict:
    """The MLP-as-selector analyses of one model (see module docstring). Units count for the ablation when they
    fire for some fact and their selectivity index is >= ``min_si``; the random control zeroes as many random
    live units per row. ``exclusive_ablation``: the same matrix for the units that fire for at least half of
    relation r's facts and for fewer than half of every other relation's (a stricter "selective for r")."""
    t0 = time.perf_counter()
    hidden, s, rel = hidden_activations(model, task)
    R = task.n_relations
    st = unit_stats(hidden, rel, R)
    use = st["alive"] & (st["si"] >= min_si)
    groups = [torch.nonzero(use & (st["top"] == r)).flatten() for r in range(R)]
    abl = ablation_matrix(model, task, groups)
    g = torch.Generator().manual_seed(seed + 37)
    alive_idx = torch.nonzero(st["alive"]).flatten()
    rand_groups = [alive_idx[torch.randperm(alive_idx.numel(), generator=g)[:grp.numel()]] for grp in groups]
    ctrl = ablation_matrix(model, task, rand_groups)
    # exclusive units: fire for most facts of relation r and for fewer than half of every other relation's facts
    rate = st["rate"]
    excl = []
    for r in range(R):
        others = torch.cat([rate[:r], rate[r + 1:]]).max(0).values if R > 1 else torch.zeros(rate.shape[1])
        excl.append(torch.nonzero(st["alive"] & (rate[r] >= 0.5) & (others < 0.5)).flatten())
    excl_abl = ablation_matrix(model, task, excl)
    gating = st["gating"][~torch.isnan(st["gating"])]
    si_alive = st["si"][st["alive"]]
    out = {
        "n_units": int(hidden.shape[1]), "n_alive": int(st["alive"].sum()),
        "units_per_relation": [int(x.numel()) for x in groups],
        "selectivity_index": {"mean": float(si_alive.mean()) if si_alive.numel() else None,
                              "median": float(si_alive.median()) if si_alive.numel() else None,
                              "frac_above_0.5": float((si_alive > 0.5).double().mean()) if si_alive.numel() else None,
                              "hist": torch.histc(si_alive.float(), bins=10, min=0, max=1).int().tolist()},
        "relation_gating": {"mean": float(gating.mean()) if gating.numel() else None,
                            "median": float(gating.median()) if gating.numel() else None,
                            "frac_above_0.5": float((gating > 0.5).double().mean()) if gating.numel() else None},
        "mean_fire_rate": float(st["fire_rate"].mean()),
        "base_accuracy": abl["base"],
        "ablation_drop": abl["drop"],
        "ablation": diagonal_dominance(abl["drop"]),
        "random_ablation_drop": ctrl["drop"],
        "random_ablation": diagonal_dominance(ctrl["drop"]),
        "exclusive_units_per_relation": [int(x.numel()) for x in excl],
        "exclusive_ablation_drop": excl_abl["drop"],
        "exclusive_ablation": diagonal_dominance(excl_abl["drop"]),
        "gate_transplant": gate_transplant(model, task, seed),
        "relation_patch": relation_patch(model, task, seed),
    }
    out = _round(out)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    out["_unit_stats"] = st                       # tensors for plots; dropped by analyze before writing JSON
    return out


@torch.no_grad()
def logit_attribution(model: FactRecallModel, task: FactTask, new_table: torch.Tensor | None = None,
                      seed: int = 0) -> dict:
    """Where the right answer's logit comes from, in the linear picture of a selector.

    Per relation r, fit the relation operator h(s, r) ~ A_r e_s + k_r (ridge from the subject embedding to the
    final state at the answer position; ``operator_r2`` = how linear the model is in e_s once r is fixed, 1 for a
    pure ReLU selector with relation-fixed gates), and the superposition fit e_s ~ c + sum_q W_q u_{a_q(s)}. The
    right answer's logit then splits into one term per relation component q:
    S_rq[a, b] = u_a . A_r W_q u_b. ``advantage[r][q]`` = mean over subjects of
    S_rq[a_r(s), a_q(s)] - mean_a' S_rq[a', a_q(s)] (how much component q lifts the right answer above an average
    attribute). q = r is the selector's own read-out; q != r is *cross-relation* help, which can only be nonzero
    when the attribute vectors are co-adapted with this particular table (associations). ``advantage_new`` is the
    same on a new random table (what freeze-and-swap embeddings face), where cross help should vanish, and
    ``cross_sd`` the spread of the cross terms there (noise that competes with the own term).
    """
    H, A, U = readout_inputs(model, task)
    N, R = A.shape
    ids, s, r, a = _one_hop(task)
    h = capture(model, ["blocks.0.resid_post"], ids,
                positions=torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.long)
                )["blocks.0.resid_post"][:, 0].double()
    fit = SuperpositionFit(alpha=ALPHA_GRID).fit(H, A, U)
    if new_table is None:
        new_table = local_table(FactTask(shuffle_table(task.table, seed + 1), n_outputs=task.n_outputs,
                                         attr_index=task.attr_index))
    ops, op_r2 = [], []
    for q in range(R):
        rows = r == q
        W, b = ridge_fit(H[s[rows]].double(), h[rows], 1e-3)
        pred = H[s[rows]].double() @ W.T + b
        op_r2.append(1 - float(((h[rows] - pred) ** 2).sum() / ((h[rows] - h[rows].mean(0)) ** 2).sum()))
        ops.append(W)
    adv, adv_new, sd = [], [], []
    for rr in range(R):
        row, row_new, row_sd = [], [], []
        U_r = U[rr].double()
        for q in range(R):
            S = U_r @ ops[rr] @ fit.W_[q] @ U[q].double().T              # [n_attr_r, n_attr_q]
            col_mean = S.mean(0)
            vals = []
            for table in (A, new_table):
                ok = (table[:, rr] >= 0) & (table[:, q] >= 0)
                ar, bq = table[ok, rr], table[ok, q]
                vals.append(float((S[ar, bq] - col_mean[bq]).mean()) if bool(ok.any()) else float("nan"))
            row.append(vals[0])
            row_new.append(vals[1])
            row_sd.append(float((S - col_mean).std()))
        adv.append(row)
        adv_new.append(row_new)
        sd.append(row_sd)
    adv_t, new_t = torch.tensor(adv), torch.tensor(adv_new)
    eye = torch.eye(R, dtype=torch.bool)
    own = float(adv_t[eye].mean())
    cross = float(adv_t[~eye].view(R, -1).sum(1).mean()) if R > 1 else 0.0
    cross_new = float(new_t[~eye].view(R, -1).sum(1).mean()) if R > 1 else 0.0
    return _round({"operator_r2": op_r2, "advantage": adv, "advantage_new": adv_new, "cross_sd": sd,
                   "own": own, "cross_total": cross, "cross_total_new": cross_new,
                   "own_share": own / (own + cross) if own + cross else None})


# ------------------------------------------------------------------------------------------------ 3. comparison
def key_numbers(sup: dict | None, sel: dict | None) -> dict:
    """The headline numbers of one model's analyses (for side-by-side tables)."""
    out = {}
    if sup:
        real = sup["summary"]["real"]
        out.update({"readout_acc": real["readout_acc"], "superposition_r2": real["r2"],
                    "decode_acc": real["decode_acc"],
                    "shuffled_readout_acc": sup["summary"]["shuffled"]["readout_acc"],
                    "shuffled_r2": sup["summary"]["shuffled"]["r2"]})
        if "swap_edit" in sup:
            se = sup["swap_edit"]
            out["swap_edit_success"] = se["success"]["value"]
            out["swap_edit_random_flip"] = se["flip"]["nulls"]["random_direction"]["value"]
    if sel:
        out.update({"selectivity_index": sel["selectivity_index"]["mean"],
                    "relation_gating": sel["relation_gating"]["mean"],
                    "ablation_diag_dominant_rows": f"{sel['ablation']['dominant_rows']}/{sel['ablation']['n_rows']}",
                    "ablation_diag_minus_offdiag": sel["ablation"]["diag_minus_offdiag"],
                    "random_ablation_diag_minus_offdiag": sel["random_ablation"]["diag_minus_offdiag"],
                    "exclusive_units": sum(sel["exclusive_units_per_relation"]),
                    "exclusive_ablation_diag_drop": sel["exclusive_ablation"]["mean_diag_drop"],
                    "exclusive_ablation_offdiag_drop": sel["exclusive_ablation"]["mean_offdiag_drop"],
                    "gate_transplant_same_relation": sel["gate_transplant"]["same_relation"],
                    "gate_transplant_same_subject": sel["gate_transplant"]["same_subject"],
                    "relation_patch_follows_new": sel["relation_patch"]["follows_new"],
                    "relation_patch_keeps_old": sel["relation_patch"]["mid_shift"]["keeps_old"]
                    if sel["relation_patch"].get("mid_shift") else None})
    return _round(out)


def compare(rows: dict[str, dict], intervals: dict | None = None) -> str:
    """Markdown table: one column per model (``rows[name] = key_numbers(...)``), one row per number, its 95%
    interval beside it where ``intervals[name][key]`` holds one."""
    names, intervals = list(rows), intervals or {}
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    lines = ["| measure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in keys:
        cells = []
        for n in names:
            v, ci = rows[n].get(key), intervals.get(n, {}).get(key)
            text = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            cells.append(text + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and v is not None else ""))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
