"""Freeze-and-swap: does the trained MLP hold a *general* relation selector, or the specific facts?

Keep everything of a trained one-hop model frozen (MLP, attention, relation embeddings, unembedding) and give it
new subject embeddings that encode *new* random maps (an independent permutation of each relation's column of the
fact table across subjects: for bijections, new random bijections onto the same attribute set). Conditions:

* ``swap``: e'_s = c + sum_r W_r u_{a'_r(s)}, with c and W_r from :class:`llmprobe.geometry.SuperpositionFit` fitted
  on the trained embeddings (the learned attribute directions W_r u_a; u_a = unembedding rows).
* ``random_init``: fresh embeddings drawn as at model initialisation, N(0, embed_std^2): the subject embeddings of
  :func:`llmprobe.model.random_init.random_init` at model seed + new-table seed + 101 (the re-initialisation baseline). ``random_matched``: random
  directions with the norms of the ``swap`` embeddings (:func:`llmprobe.geometry.random_direction_like`, the
  random-direction control of every edit).
* ``construction``: the explicit construction's encoding rule (:mod:`synthetic.construction`: e_s = sum_q P_q c_{a_q(s)},
  one code per relation, where relation q's read-out row for attribute a *is* the code P_q c_a) applied to the
  trained model's own read-out. Once r is fixed the model is linear in e (docs/mechanisms.md section 3), so its
  centred logits over r's attributes are z_r(e) ~ M_r e + k_r (M_r = U_r A_r, ridge fit of the final state on the
  trained e_s: :func:`readout_maps`); the code of (q, a) is the read-out row M_q[a], and e'_s = c + beta sum_q
  M_q[a'_q(s)] (c, beta: mean and mean norm of the trained e_s). ``construction_inverse``: the same rule with
  decoupled codes: e'_s solves z_r(e) = m (onehot(a'_r(s)) - 1/n_r) for all r at once in least squares (each
  relation reads its own attribute, the others ignore it). Both: :func:`construction_embeddings`; no training.
* ``old_table``, ``construction_old``, ``construction_inverse_old``: those encoders applied to the *trained* table
  (sanity: do they reproduce the original facts?).

The construction's own model with the codes of a new table swapped in (the positive control, exact by design) is
:func:`construction_control`; :func:`swap_sweep` runs all of this over d/d*, seeds and training settings.

Each condition reports zero-shot accuracy on the new table, then the accuracy after a few steps of training the
subject embeddings alone (Adam, constant learning rate; the rest of the model frozen) and the first step count at
which every new fact is answered.
"""
from __future__ import annotations

import copy
import math
import os
import time

import torch
from scipy.stats import t as student_t

from llmprobe.geometry import ALPHA_GRID, SuperpositionFit, random_direction_like, ridge_fit, shuffle_table
from llmprobe.io import append_jsonl, read_jsonl, write_json
from llmprobe.metric import wilson
from llmprobe.model.random_init import random_init
from llmprobe.names import SWAP_MODES
from synthetic.construction import build_construction, construction_accuracy, smallest_construction
from synthetic.mechanisms import _round, local_table, readout_inputs
from synthetic.model import FactRecallModel, mode_flags
from synthetic.tasks import FactTask, random_bijections, random_functions
from synthetic.train import TrainConfig, model_config_for, train

DEFAULT_STEPS = (0, 10, 25, 50, 100)
CONDITIONS = ("swap", "construction", "construction_inverse", "random_init", "random_matched", "old_table",
              "construction_old", "construction_inverse_old")
ZERO_ONLY = ("old_table", "construction_old", "construction_inverse_old")


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


def readout_maps(model: FactRecallModel, task: FactTask, alpha: float = 1e-3) -> tuple[list, list]:
    """Per relation r, the linear read-out of the subject embedding: centred logits over r's attributes
    z_r(e) ~ M_r e + k_r, from a ridge fit of the final state h(s, r) on the trained e_s (float64).
    Returns (M list of R [n_r, d], k list of R [n_r])."""
    data = task.data()
    s, r, _ = task.facts()
    with torch.no_grad():
        h = model.final_states(data.input_ids, data.target_pos)[:, 0].double()       # [F, d]
    H = model.subject_embeddings().double()
    W = model.attribute_vectors().double()
    bias = model.unembed_bias.detach().double() if model.unembed_bias is not None else None
    Ms, ks = [], []
    for q in range(task.n_relations):
        rows = r == q
        A, b = ridge_fit(H[s[rows]], h[rows], alpha)                                  # h ~ A e + b
        ids = task.relation_attributes(q)
        M, k = W[ids] @ A, W[ids] @ b + (bias[ids] if bias is not None else 0.0)
        Ms.append(M - M.mean(0))
        ks.append(k - k.mean())
    return Ms, ks


def construction_embeddings(model: FactRecallModel, task: FactTask, fresh: FactTask, rule: str = "filter",
                            ridge: float = 1e-6) -> torch.Tensor:
    """The construction's encoding rule on the trained model's read-out maps (conditions ``construction`` and
    ``construction_inverse``; module docstring) for the table of ``fresh`` [N, d].

    ``filter``: e'_s = c + beta sum_q M_q[a'_q(s)] -- the code of (q, a) is the direction relation q's read-out
    scores as a (as in the construction, where that row is the code P_q c_a itself); c = mean trained e_s, beta
    matches the mean norm of the trained e_s - c. ``inverse``: e'_s = argmin_e sum_r ||M_r e + k_r -
    m (onehot(a'_r(s)) - 1/n_r)||^2 + lam ||e||^2 (every relation decodes its own attribute with the trained mean
    right-answer logit m and the others ignore it), lam = ``ridge`` * tr(G)/d, G = sum_r M_r^T M_r."""
    Ms, ks = readout_maps(model, task)
    A_old, A_new = local_table(task), local_table(fresh)
    H = model.subject_embeddings().double()
    d = H.shape[1]
    if rule == "filter":
        c = H.mean(0)
        S = torch.zeros(A_new.shape[0], d, dtype=torch.float64)
        for q, M in enumerate(Ms):
            ok = A_new[:, q] >= 0
            S[ok] += M[A_new[ok, q]]
        beta = (H - c).norm(dim=1).mean() / S.norm(dim=1).mean().clamp_min(1e-12)
        return (c + beta * S).float()
    if rule != "inverse":
        raise ValueError("rule must be 'filter' or 'inverse'")
    margins = []
    for q, (M, k) in enumerate(zip(Ms, ks)):                                            # trained right-answer logit
        ok = A_old[:, q] >= 0
        margins.append((H[ok] @ M.T + k).gather(1, A_old[ok, q][:, None]))
    m = float(torch.cat(margins).mean())
    G = sum(M.T @ M for M in Ms)
    G = G + ridge * float(G.trace()) / d * torch.eye(d, dtype=G.dtype)
    rhs = torch.zeros(A_new.shape[0], d, dtype=torch.float64)
    for q, (M, k) in enumerate(zip(Ms, ks)):
        ok = A_new[:, q] >= 0
        T = torch.full((int(ok.sum()), M.shape[0]), -m / M.shape[0], dtype=torch.float64)
        T.scatter_(1, A_new[ok, q][:, None], m - m / M.shape[0])
        rhs[ok] += (T - k) @ M
    return torch.linalg.solve(G, rhs.T).T.float()


def linear_crosstalk(model: FactRecallModel, task: FactTask, fresh: FactTask) -> dict:
    """Why an encoder that sums per-relation codes fails on a new table, in the linear picture (:func:`readout_maps`):
    the ``construction`` embeddings of the new table scored by the linear read-out (``linear_zero_shot``; compare
    the model's own zero-shot), the same with every cross-relation term M_r M_q[a'_q] (q != r) removed
    (``own_only``: what the codes would give if the read-outs did not overlap, as in the construction), and the mean
    overlap of two relations' read-outs ||M_r M_q^T||_F / sqrt(||M_r M_r^T||_F ||M_q M_q^T||_F), q != r (0 in the
    construction; None for R = 1)."""
    Ms, ks = readout_maps(model, task)
    A = local_table(fresh)
    E = construction_embeddings(model, task, fresh).double()
    H = model.subject_embeddings().double()
    c = H.mean(0)
    S = torch.zeros_like(E)
    for q, M in enumerate(Ms):
        ok = A[:, q] >= 0
        S[ok] += M[A[ok, q]]
    beta = float((E - c).norm() / S.norm().clamp_min(1e-12))
    full, own, n = 0, 0, 0
    for r, (M, k) in enumerate(zip(Ms, ks)):
        ok = A[:, r] >= 0
        full += int(((E[ok] @ M.T + k).argmax(1) == A[ok, r]).sum())
        own += int(((c + beta * M[A[ok, r]]) @ M.T + k).argmax(1).eq(A[ok, r]).sum())
        n += int(ok.sum())
    norms = [float((M @ M.T).norm()) for M in Ms]
    over = [float((Ms[r] @ Ms[q].T).norm()) / (norms[r] * norms[q]) ** 0.5
            for r in range(len(Ms)) for q in range(len(Ms)) if q != r]
    return {"linear_zero_shot": full / n, "own_only": own / n,
            "readout_overlap": sum(over) / len(over) if over else None}


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


def majority_chance(task: FactTask) -> float:
    """Accuracy of answering each relation's most common attribute (1/N for bijections), facts pooled."""
    hits, n = 0, 0
    for r in range(task.n_relations):
        col = task.table[:, r]
        col = col[col >= 0]
        hits += int(torch.bincount(col).max()) if col.numel() else 0
        n += col.numel()
    return hits / max(n, 1)


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
    E_rand = random_init(model, model.config.seed + seed + 101).subject_embeddings().detach().float()
    E_match = random_direction_like(E_swap, torch.Generator().manual_seed(seed + 101))
    built = {
        "swap": lambda: (E_swap, fresh),
        "construction": lambda: (construction_embeddings(model, task, fresh), fresh),
        "construction_inverse": lambda: (construction_embeddings(model, task, fresh, "inverse"), fresh),
        "construction_old": lambda: (construction_embeddings(model, task, task), task),
        "construction_inverse_old": lambda: (construction_embeddings(model, task, task, "inverse"), task),
        "random_init": lambda: (E_rand, fresh),
        "random_matched": lambda: (E_match, fresh),
        "old_table": lambda: (swapped_embeddings(fit, task), task),
    }
    curves, to_100 = {}, {}
    for name in conditions:
        E, t = built[name]()
        res = train_subjects(with_subjects(model, E), t, steps=(0,) if name in ZERO_ONLY else steps, lr=lr)
        curves[name] = res["accuracy"]
        to_100[name] = res["steps_to_100"]
    chance = majority_chance(fresh)
    out = {
        "zero_shot": {name: c[0] for name, c in curves.items()},
        "curves": {name: {str(k): v for k, v in c.items()} for name, c in curves.items()},
        "steps_to_100": to_100,
        "fit_r2_in_sample": fit.score(H, A), "fit_alpha": fit.alpha_,
        "crosstalk": linear_crosstalk(model, task, fresh) if "construction" in conditions else None,
        "chance": chance, "new_table_seed": seed, "lr": lr, "max_steps": max(steps),
    }
    out = _round(out)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


# ------------------------------------------------------------------------------------ construction positive control
def construction_control(task: FactTask, seed: int = 1, b: int | None = None, steps=DEFAULT_STEPS,
                         lr: float = 0.03) -> dict:
    """The explicit construction for ``task`` (float32 sphere codes, smallest working block size b unless given)
    with the construction's own codes of a new table swapped in (``native``: exact by design, every other weight
    of :func:`build_construction` is independent of the table), beside the encoders of :func:`freeze_and_swap`
    applied to the same built model."""
    b = b or smallest_construction(task=task, precision_bits=None)["b"]
    model = build_construction(task, b).float().eval()
    fresh = new_table(task, seed)
    native = build_construction(fresh, b).float()
    out = freeze_and_swap(model, task, seed=seed, steps=steps, lr=lr,
                          conditions=("swap", "construction", "random_init", "old_table"))
    res = train_subjects(with_subjects(model, native.subject_embeddings()), fresh, steps=steps, lr=lr)
    out["zero_shot"]["native"] = res["accuracy"][0]
    out["curves"]["native"] = {str(k): v for k, v in res["accuracy"].items()}
    out["steps_to_100"]["native"] = res["steps_to_100"]
    out.update(b=b, d_model=model.config.d_model, trained_table_accuracy=construction_accuracy(model, task),
               native_check=construction_accuracy(native, fresh))
    return out


# ------------------------------------------------------------------------------------------------ the sweep
# d* per (N, R) and mode from docs/synthetic.md (capacity sweep, seed 0; Adam lr 0.03, no weight decay, stop at 100%)
DSTAR = {(256, 1): {"trainable": 3, "frozen": 3},     # (256, 1): measured here by the same rule, seed 0
         (256, 4, 4): {"trainable": 4}, (256, 4, 16): {"trainable": 6},  # many-to-one maps onto |A| shared
         (256, 4, 64): {"trainable": 7},                    # attributes: measured here, seed 0, two inits at d*-1
         (256, 2): {"trainable": 4, "frozen": 7}, (256, 4): {"trainable": 7, "frozen": 11},
         (512, 2): {"trainable": 4, "frozen": 8}, (512, 4): {"trainable": 8, "frozen": 14},
         (1024, 4): {"trainable": 9, "frozen": 18}}
MODES = SWAP_MODES
SWEEP_STEPS = (0, 10, 25, 50, 100, 300)


def sweep_points(subjects, relations, ratios=(1, 2, 4, 8), seeds=(0, 1, 2), modes=("trainable", "frozen"),
                 weight_decay: float = 1e-4, max_steps: int = 1000, stop_at_100: bool = False,
                 n_attributes: int | None = None) -> list[dict]:
    """One dict per trained model: N, R, mode, ratio d/d*, d, seed (table and init) and the training recipe.
    ``frozen_unembed`` (subject embeddings learned, unembedding frozen) uses the trainable d*. ``n_attributes``:
    many-to-one maps onto a shared set of that size (:func:`synthetic.tasks.random_functions`, N/|A| subjects per
    attribute) instead of bijections. ``modes``: of :data:`MODES` (ValueError otherwise)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown swap-sweep mode(s) {unknown}; choose from {', '.join(MODES)}")
    pts = []
    for N in subjects:
        for R in relations:
            for mode in modes:
                cell = (N, R) if n_attributes is None else (N, R, n_attributes)
                dstar = DSTAR[cell]["frozen" if mode == "frozen" else "trainable"]
                for ratio in ratios:
                    for seed in seeds:
                        p = {"N": N, "R": R, "mode": mode, "ratio": ratio, "dstar": dstar,
                             "d": max(1, round(ratio * dstar)), "seed": seed, "weight_decay": weight_decay,
                             "max_steps": max_steps, "stop_at_100": stop_at_100, "n_attributes": n_attributes}
                        p["key"] = (f"N{N}_R{R}" + (f"_A{n_attributes}" if n_attributes else "")
                                    + f"_{mode}_x{ratio:g}_s{seed}_wd{weight_decay:g}_t{max_steps}"
                                    + ("_stop" if stop_at_100 else ""))
                        pts.append(p)
    return pts


def run_point(p: dict, steps=SWEEP_STEPS, lr: float = 0.03) -> dict:
    """Train the model of sweep point ``p`` on random_bijections(N, R, seed) and run :func:`freeze_and_swap`
    (new table seed = seed + 1000)."""
    task = random_bijections(p["N"], p["R"], p["seed"]) if not p.get("n_attributes") else \
        random_functions(p["N"], p["R"], p["n_attributes"], p["seed"], shared=True)
    cfg = model_config_for(task, p["d"], seed=p["seed"], **mode_flags(p["mode"]))
    tc = TrainConfig(lr=0.03, max_steps=p["max_steps"], weight_decay=p["weight_decay"],
                     target_acc=1.0 if p["stop_at_100"] else 1.01, progress=False)
    t0 = time.process_time()
    res = train(task, model_config=cfg, config=tc)
    info = res.to_dict()
    out = freeze_and_swap(res.model.eval(), task, seed=p["seed"] + 1000, steps=steps, lr=lr)
    out["swap_steps"] = out.pop("max_steps")
    return {**out, **p, "train_accuracy": info["accuracy"], "train_steps": info["steps"],
            "cpu_s": round(time.process_time() - t0, 1)}


def swap_sweep(out_dir: str, points: list[dict], steps=SWEEP_STEPS, lr: float = 0.03,
               control_seeds=(0, 1, 2), progress: bool = True) -> dict:
    """Run every point not yet in ``out_dir/results.jsonl`` (resumable), plus the construction control per (N, R)
    and seed in ``control_seeds``; write ``out_dir/summary.json`` (:func:`summarize_sweep`) and return it."""
    path = os.path.join(out_dir, "results.jsonl")
    done = {r["key"] for r in read_jsonl(path)}
    todo = [p for p in points if p["key"] not in done]
    for N, R in sorted({(p["N"], p["R"]) for p in points if not p.get("n_attributes")}):
        for seed in control_seeds:
            key = f"N{N}_R{R}_construction_s{seed}"
            if key not in done:
                todo.append({"key": key, "N": N, "R": R, "mode": "construction", "seed": seed})
    for i, p in enumerate(todo):
        if p["mode"] == "construction":
            t0 = time.process_time()
            out = construction_control(random_bijections(p["N"], p["R"], p["seed"]), seed=p["seed"] + 1000,
                                       steps=steps, lr=lr)
            out["swap_steps"] = out.pop("max_steps")
            row = {**out, **p, "dstar": DSTAR[(p["N"], p["R"])]["trainable"],
                   "cpu_s": round(time.process_time() - t0, 1)}
            row["ratio"] = round(row["d_model"] / row["dstar"], 3)
        else:
            row = run_point(p, steps, lr)
        append_jsonl(path, row)
        if progress:
            print(f"[{i + 1}/{len(todo)}] {p['key']}: zero-shot "
                  + " ".join(f"{k} {v:.3f}" for k, v in row["zero_shot"].items()) + f" ({row['cpu_s']} s)",
                  flush=True)
    summary = summarize_sweep(read_jsonl(path))
    write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary


def _mean_ci(values: list[float], level: float = 0.95) -> dict:
    """Mean with a Student-t interval over ``values`` (seeds; accuracies, so clipped to [0, 1]); the interval is
    None for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": round(mean, 4), "ci": None, "n": n}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(student_t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": round(mean, 4), "ci": [round(max(0.0, mean - half), 4), round(min(1.0, mean + half), 4)], "n": n}


def summarize_sweep(rows: list[dict]) -> dict:
    """Group rows by setting (N, R, mode, ratio, training recipe); per condition the zero-shot accuracy and the
    accuracy at each step as mean [95% t interval over seeds], the Wilson interval of the pooled facts
    (n = seeds x N x R), steps to 100%, and the chance level (majority answer; 1/N for bijections); plus the train
    accuracy of the models."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        setting = r["key"].rsplit("_s", 1)[0] if r["mode"] == "construction" else \
            r["key"].replace(f"_s{r['seed']}_", "_")
        groups.setdefault(setting, []).append(r)
    out = {}
    for setting, rs in sorted(groups.items()):
        first = rs[0]
        n_facts = first["N"] * first["R"]
        g = {k: first.get(k) for k in ("N", "R", "n_attributes", "mode", "ratio", "dstar", "d", "weight_decay",
                                       "max_steps", "stop_at_100", "chance")}
        g["d"] = first.get("d", first.get("d_model"))
        g["seeds"] = sorted(r["seed"] for r in rs)
        g["train_accuracy"] = _mean_ci([r.get("train_accuracy", r.get("trained_table_accuracy", 1.0)) for r in rs])
        conds = {}
        for c in first["curves"]:
            zs = [r["zero_shot"][c] for r in rs]
            pooled = sum(zs) / len(zs)
            conds[c] = {"zero_shot": _mean_ci(zs),
                        "zero_shot_pooled_wilson": [round(x, 4) for x in wilson(pooled, n_facts * len(zs))],
                        "curve": {k: _mean_ci([r["curves"][c][k] for r in rs]) for k in first["curves"][c]},
                        "steps_to_100": [r["steps_to_100"].get(c) for r in rs]}
        g["conditions"] = conds
        ct = [r["crosstalk"] for r in rs if r.get("crosstalk")]
        if ct:
            g["crosstalk"] = {k: _mean_ci([c[k] for c in ct]) for k in ct[0] if ct[0][k] is not None}
        out[setting] = g
    return {"settings": out, "n_rows": len(rows)}


def sweep_markdown(summary: dict) -> str:
    """Markdown table of a sweep summary: one row per setting; zero-shot per encoder as mean [95% t CI over seeds],
    the sanity rows (encoders on the trained table), the (a) encoder's few-step curve and the linear cross-talk."""
    def cell(c, key="zero_shot"):
        if c is None:
            return "-"
        v = c[key] if key else c
        return f"{v['mean']:.3f}" + (f" [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]" if v.get("ci") else "")

    lines = ["| N | R | mode | recipe | d/d* | d | train acc | (a) fit | (b) construction | (c) re-init | "
             "fit / rule on trained table | (a) after 10 / 25 / 100 / 300 steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in summary["settings"].values():
        c = g["conditions"]
        recipe = "-" if g["mode"] == "construction" else (
            f"wd {g['weight_decay']:g}, " + ("stop at 100%" if g["stop_at_100"] else f"{g['max_steps']} steps"))
        curve = c["swap"]["curve"]
        steps = " / ".join(f"{curve[k]['mean']:.2f}" for k in ("10", "25", "100", "300") if k in curve)
        sanity = f"{c['old_table']['zero_shot']['mean']:.3f} / " + (
            f"{c['construction_old']['zero_shot']['mean']:.3f}" if "construction_old" in c else "-")
        b = c.get("native") if g["mode"] == "construction" else c.get("construction")
        rel = f"{g['R']}" + (f", \\|A\\|={g['n_attributes']}" if g.get("n_attributes") else "")
        lines.append(f"| {g['N']} | {rel} | {g['mode']} | {recipe} | {g['ratio']:g} | {g['d']} | "
                     f"{g['train_accuracy']['mean']:.3f} | {cell(c['swap'])} | {cell(b)} | "
                     f"{cell(c['random_init'])} | {sanity} | {steps or '-'} |")
    return "\n".join(lines)
