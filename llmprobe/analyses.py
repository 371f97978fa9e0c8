"""Per relation and layer: linear relation decoders (LRE, ridge) and superposition readouts, with controls.

``run_analyses`` is what ``llmprobe probe --analyses lre,ridge,superposition`` calls. Every number comes as
``{"value", "ci", "control", ...}`` (see ``docs/analyses.md`` for the exact meaning of each):

* **LRE** (Hernandez et al. 2023), per relation and layer, on the model's *known* facts: W = mean Jacobian
  d o / d h over ``n_jacobian`` fixed training prompts (batched, ``llmprobe.lre``), b = mean(o - W h) over the
  training subjects, o_hat = beta W_k h + b. Faithfulness: held-out subjects whose ``adapter.logits(o_hat)``
  argmax is the object's first token (control: always answering the training majority first token).
  Causality: held-out edits h -> h + W_r^+ (o' - o) toward another held-out subject's object, patched into a real
  forward pass; success when the next token is the target object's first token (controls: a random direction
  of the same norm; reference: patching in the target subject's whole state). beta and the truncation rank k are
  chosen on a validation split by faithfulness, the edit rank r by causality, never on the test split.
* **Ridge**: a learned affine decoder o ~ W h + b on the training subjects (alpha chosen on validation), scored
  like the LRE (control: the same ridge fitted on shuffled (h, o) pairs).
* **Superposition**: relation-free subject states (mean over the relations' neutral templates) of the subjects
  shared by several relations; per-relation readout accuracy (nearest attribute vector), held-out R^2 of
  h_s ~ c + sum_r W_r u_{a_r(s)}, and the swap edit through a real forward pass; controls: attributes shuffled
  across subjects, and the same architecture with random weights. u_a = the unembedding row of the attribute's
  first token (``attribute_vectors="first"``; ``"mean"`` averages the rows of all its tokens).

Splits: the Jacobian subjects are drawn once per relation and stay in every training set; the other known
subjects are re-split ``n_splits`` times into train / validation / test. Intervals: percentile bootstrap over
subjects (per-subject hit rates averaged over the splits that tested them); ``spread`` is the standard deviation
of the test score over splits.
"""
from __future__ import annotations

import math
import sys
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from .geometry import (LinearRelationDecoder, LinearRelationOperator, RidgeDecoder, SuperpositionFit,
                       bootstrap_ci, kfold_indices, superposition_readout)
from .lre import (layer_sequences, logits_fn, next_token_predictions, random_like, relation_states,
                  subject_jacobians, subject_states)
from .scoring import (FIRST_TOKEN, SCORING_MODES, SEQUENCE, attribute_token_ids, first_token_collisions,
                      first_token_targets, sequence_logprobs)
from .subjects import SubjectNotFoundError, encode, locate_errors

__all__ = ["ANALYSES", "AnalysisError", "AnalysisSettings", "run_analyses", "default_layers", "pick_layers",
           "table_rows", "format_table"]

ANALYSES = ("lre", "ridge", "superposition")
O_PLACE = ("o = output of the last block (blocks.{L-1}.resid_post, before the final norm) at the prompt's last "
           "token; logits = adapter.logits(o) = final norm + LM head")
H_PLACE = "h = blocks.{l}.resid_post at the subject's last token"
FIRST_TOKEN_NOTE = "objects scored by their first token (the first token of ' ' + object after the prompt)"


class AnalysisError(ValueError):
    """An analysis could not run on one relation (the message names it); the others go on."""


@dataclass
class AnalysisSettings:
    """Options of ``run_analyses`` (all recorded in the result's ``settings``)."""

    n_splits: int = 3
    seed: int = 0
    max_subjects: int = 90            # known facts used per relation (the first ones: most populous countries)
    min_known: int = 8                # fewer known facts -> the relation's decoders are skipped with an error
    n_jacobian: int = 3               # prompts whose Jacobians are averaged into W (fixed per relation)
    test_fraction: float = 1 / 3
    val_fraction: float = 1 / 6
    betas: tuple = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    ranks: tuple = (None, 128, 32)              # truncation of W for faithfulness (None = full)
    edit_ranks: tuple = (8, 32, 128)            # rank of the pseudo-inverse used by causality edits
    max_val_pairs: int = 8                      # causality edits per split used to choose the edit rank
    max_test_pairs: int = 12                    # causality edits per split on the test subjects
    ridge_alphas: tuple = tuple(10.0 ** k for k in range(-2, 6))
    edit_target: str = "operator"     # o, o' of the edit: "operator" (LRE outputs) or "state" (the model's o)
    scoring: str = FIRST_TOKEN        # causality success: first token, or "sequence" (full-sequence log-prob)
    lre_layers: tuple | None = None   # None: up to max_lre_layers of the layers (Jacobians cost the most)
    max_lre_layers: int = 3
    causality_layers: tuple | None = None       # None: the LRE layers
    superposition_facts: str = "all"  # "all" facts of the shared-subject table, or "known" ones only
    neutral_templates: tuple | None = None      # None: the relations' own, minus those that open with the
                                                # subject when the tokenizer adds no leading special token
    attribute_vectors: str = "first"  # "first" token's unembedding row, or "mean" over the attribute's tokens
    max_superposition_subjects: int | None = None
    folds: int = 5                    # cross-fitting folds of the superposition readouts
    random_control: bool = True       # the random-init model of the same architecture
    swap_layers: tuple | None = None  # None: the LRE layers
    max_swap_subjects: int = 12
    swap_scales: tuple = (1.0, 4.0, 16.0)       # swap edits also at these multiples of the fitted edit (dose-response)
    n_boot: int = 1000
    batch_size: int = 32
    jacobian_batch_size: int = 16
    jacobian_chunk: int = 96           # output dims per batched backward (96 vs 32: 36 s vs 41 s on one relation
                                      # under load; no clear difference within a full run)


# ---------------------------------------------------------------------------------------------------- helpers
def default_layers(n_layers: int, every: int = 3) -> list[int]:
    """Every ``every``-th layer and the last one."""
    return sorted(set(range(0, n_layers, every)) | {n_layers - 1})


def pick_layers(layers: list[int], k: int, n_layers: int) -> list[int]:
    """Up to ``k`` of ``layers`` spread through depth (at the fractions 1/(k+1) ... k/(k+1) of the list),
    leaving out the last layer (where an edit at the subject cannot reach the last token)."""
    candidates = [l for l in sorted(layers) if l != n_layers - 1] or sorted(layers)
    if len(candidates) <= k:
        return candidates
    picks = {candidates[min(len(candidates) - 1, round((i + 1) * len(candidates) / (k + 1)))] for i in range(k)}
    return sorted(picks)


class _Log:
    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled, time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[analyses {time.perf_counter() - self.start:6.0f}s] {message}", file=sys.stderr, flush=True)


def _interval(per_subject: torch.Tensor, n_boot: int, seed: int) -> tuple[float, list[float]]:
    """Mean and percentile bootstrap interval of per-subject values (NaN = not measured)."""
    v = per_subject[~torch.isnan(per_subject)].double()
    if v.numel() == 0:
        return float("nan"), [float("nan"), float("nan")]
    if v.numel() == 1:
        return float(v[0]), [float(v[0]), float(v[0])]
    point, lo, hi = bootstrap_ci(v, n_boot=n_boot, seed=seed)
    return point, [lo, hi]


class _Hits:
    """Per-split, per-subject hits of one measurement: value = mean over splits, ci = bootstrap over subjects."""

    def __init__(self, n_subjects: int):
        self.n = n_subjects
        self.splits: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, subjects: torch.Tensor, hits: torch.Tensor) -> None:
        self.splits.append((subjects.long().cpu(), hits.double().cpu()))

    def per_subject(self) -> torch.Tensor:
        total, count = torch.zeros(self.n, dtype=torch.float64), torch.zeros(self.n, dtype=torch.float64)
        for idx, hits in self.splits:
            total.index_add_(0, idx, hits)
            count.index_add_(0, idx, torch.ones_like(hits))
        return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))

    def summary(self, n_boot: int, seed: int) -> dict:
        per_split = [float(h.mean()) if h.numel() else float("nan") for _, h in self.splits]
        finite = [x for x in per_split if not math.isnan(x)]
        value = sum(finite) / len(finite) if finite else float("nan")
        spread = float(torch.tensor(finite).std()) if len(finite) > 1 else 0.0
        _, ci = _interval(self.per_subject(), n_boot, seed)
        n = int((~torch.isnan(self.per_subject())).sum())
        return {"value": value, "ci": ci, "spread": spread, "per_split": per_split, "n": n}


def _metric(main: _Hits, controls: dict[str, _Hits], cfg: AnalysisSettings, primary: str | None = None,
            **extra) -> dict:
    out = main.summary(cfg.n_boot, cfg.seed)
    ctrl = {name: {k: v for k, v in h.summary(cfg.n_boot, cfg.seed).items() if k in ("value", "ci", "spread")}
            for name, h in controls.items()}
    if ctrl:
        name = primary or next(iter(ctrl))
        out["control"] = {"name": name, **ctrl[name]}
        out["controls"] = ctrl
    out.update(extra)
    return out


def _pairs(y: torch.Tensor, idx: torch.Tensor, gen: torch.Generator, limit: int,
           targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For up to ``limit`` source subjects in ``idx`` (random, seeded) a target subject among ``targets``
    (default ``idx``) whose object has another first token."""
    src, tgt = [], []
    pool = (idx if targets is None else targets).tolist()
    chosen = idx[torch.randperm(len(idx), generator=gen)[:limit]].sort().values
    for i in chosen.tolist():
        options = [j for j in pool if j != i and int(y[j]) != int(y[i])]
        if options:
            src.append(i)
            tgt.append(options[int(torch.randint(len(options), (1,), generator=gen))])
    return torch.tensor(src, dtype=torch.long), torch.tensor(tgt, dtype=torch.long)


def _random_like_norm(delta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    r = torch.randn(delta.shape, generator=gen, dtype=torch.float64)
    r = r / r.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (r * delta.double().norm(dim=1, keepdim=True)).to(delta.dtype)


class _SVD:
    """One SVD of W [d_out, d_in] serving every truncation rank and pseudo-inverse rank (the same math as
    ``geometry.truncate_rank`` and ``geometry.pinv_rank``, without an SVD per call)."""

    def __init__(self, W: torch.Tensor):
        self.W = W.double()
        self.U, self.S, self.Vh = torch.linalg.svd(self.W, full_matrices=False)
        tol = self.S.max().clamp_min(0) * max(W.shape) * torch.finfo(W.dtype).eps if self.S.numel() else 0.0
        self.keep = int((self.S > tol).sum())

    def truncated(self, rank: int | None) -> torch.Tensor:
        if rank is None or rank >= min(self.W.shape):
            return self.W
        return (self.U[:, :rank] * self.S[:rank]) @ self.Vh[:rank]

    def pinv(self, rank: int | None) -> torch.Tensor:
        k = self.keep if rank is None else min(rank, self.keep)
        return (self.Vh[:k].T / self.S[:k]) @ self.U[:, :k].T


def _edit_delta(pinv: torch.Tensor, beta: float, o_source: torch.Tensor, o_target: torch.Tensor) -> torch.Tensor:
    """delta_h = W_r^+ (o_target - o_source) / beta (as ``LinearRelationOperator.edit_delta``)."""
    return ((o_target.double() - o_source.double()) @ pinv.T / beta).float()


# ------------------------------------------------------------------------------------------ relation decoders
@dataclass
class _RelationData:
    name: str
    template: str
    subjects: list[str]
    objects: list[str]
    prompts: list[str]
    H: dict[int, torch.Tensor]
    O: torch.Tensor
    y: torch.Tensor
    sequences: dict[int, list] = field(default_factory=dict)   # clean states per prompt at the causal layers


def _known_facts(relation, results, cfg: AnalysisSettings) -> list:
    if results is None:
        raise AnalysisError(f"relation {relation.name}: no known-facts results were given for it")
    facts = [r for r in results if r.known]
    if len(facts) < cfg.min_known:
        raise AnalysisError(f"relation {relation.name}: {len(facts)} known facts of {len(results)} checked; the "
                            f"decoders need at least {cfg.min_known}")
    return facts[:cfg.max_subjects]


def _splits(n: int, cfg: AnalysisSettings, name: str) -> tuple[torch.Tensor, list[tuple]]:
    """Fixed Jacobian subjects and ``n_splits`` (train, val, test) index triples (train includes them)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
    perm = torch.randperm(n, generator=gen)
    n_jac = max(1, min(cfg.n_jacobian, n // 4))
    jac, rest = perm[:n_jac], perm[n_jac:]
    splits = []
    for _ in range(cfg.n_splits):
        p = rest[torch.randperm(len(rest), generator=gen)]
        n_test = max(2, round(cfg.test_fraction * len(rest)))
        n_val = max(2, round(cfg.val_fraction * len(rest)))
        if n_test + n_val >= len(rest):
            raise AnalysisError(f"relation {name}: {n} known facts are too few for train/validation/test splits")
        test, val, train = p[:n_test], p[n_test:n_test + n_val], torch.cat([jac, p[n_test + n_val:]])
        splits.append((train.sort().values, val.sort().values, test.sort().values))
    return jac.sort().values, splits


def _causality_hits(lm, data: _RelationData, layer: int, deltas: list[torch.Tensor], src: torch.Tensor,
                    tgt: torch.Tensor, cfg: AnalysisSettings) -> list[torch.Tensor]:
    """Hits of several edit sets on the same (source, target) pairs, in one batched run per set of forwards."""
    k = len(deltas)
    subjects = [data.subjects[i] for i in src.tolist()] * k
    delta = torch.cat(deltas)
    if cfg.scoring == SEQUENCE:
        tgt_obj = [data.objects[j] for j in tgt.tolist()] * k
        src_obj = [data.objects[i] for i in src.tolist()] * k
        lp_t = sequence_logprobs(lm, data.template, subjects, tgt_obj, layer=layer, delta=delta,
                                 batch_size=cfg.batch_size)
        lp_s = sequence_logprobs(lm, data.template, subjects, src_obj, layer=layer, delta=delta,
                                 batch_size=cfg.batch_size)
        hits = lp_t > lp_s
    else:
        resume = [data.sequences[layer][i] for i in src.tolist()] * k if layer in data.sequences else None
        pred = next_token_predictions(lm, data.template, subjects, layer, delta, batch_size=cfg.batch_size,
                                      resume=resume)
        hits = pred == data.y[tgt].repeat(k)
    return list(hits.view(k, -1))


def _decoders_for_relation(lm, relation, results, layers: list[int], lre_layers: list[int],
                           causal_layers: list[int], do_lre: bool, do_ridge: bool, cfg: AnalysisSettings,
                           log: _Log) -> dict:
    t0 = time.perf_counter()
    facts = _known_facts(relation, results, cfg)
    template = relation.templates[0]
    subjects = [f.subject for f in facts]
    objects = [f.object for f in facts]
    states = relation_states(lm, template, subjects, layers, batch_size=cfg.batch_size)
    y = first_token_targets(lm.tokenizer, states.prompts, objects)
    data = _RelationData(relation.name, template, subjects, objects, states.prompts, states.H, states.O, y)
    to_logits = logits_fn(lm)
    model_top1 = to_logits(states.O).argmax(-1) == y
    n = len(subjects)
    jac_idx, splits = _splits(n, cfg, relation.name)
    out = {
        "template": template, "n_known": sum(r.known for r in results), "n_checked": len(results), "n_used": n,
        "model_first_token_accuracy": float(model_top1.double().mean()),
        "first_token_collisions": first_token_collisions(y.tolist(), objects),
        "jacobian_subjects": [subjects[i] for i in jac_idx.tolist()],
        "subject_at_start": _subject_at_start(lm.tokenizer, template),
        "split_sizes": [{"train": len(a), "val": len(b), "test": len(c)} for a, b, c in splits],
        "layers": {}, "selected": {}, "error": None,
    }
    W_all = {}
    if do_lre:
        tj = time.perf_counter()
        jac = subject_jacobians(lm, template, [subjects[i] for i in jac_idx.tolist()], lre_layers,
                                batch_size=cfg.jacobian_batch_size, chunk=cfg.jacobian_chunk)
        W_all = {l: r.W.double() for l, r in jac.items()}
        out["jacobian_seconds"] = round(time.perf_counter() - tj, 1)
        log(f"{relation.name}: Jacobians of {len(jac_idx)} prompts at layers {lre_layers} in "
            f"{out['jacobian_seconds']}s")
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    val_scores: dict[str, dict[int, dict[str, float]]] = {"lre": {}, "ridge": {}}
    for layer in layers:
        H = data.H[layer].double()
        O = data.O.double()
        entry = {}
        causal = layer in causal_layers
        if causal and cfg.scoring == FIRST_TOKEN:
            data.sequences = {layer: layer_sequences(lm, template, subjects, layer, batch_size=cfg.batch_size)}
        # test edits take their targets from all held-out subjects (validation and test): a few objects cannot
        # be reached even by patching in the target's whole state, and a wider pool averages over them
        pairs = [(_pairs(y, va, gen, cfg.max_val_pairs),
                  _pairs(y, te, gen, cfg.max_test_pairs, targets=torch.cat([va, te])))
                 for _, va, te in splits] if causal else None
        if do_lre and layer in W_all:
            entry["lre"], val_scores["lre"][layer] = _lre_layer(lm, data, layer, H, O, W_all[layer], splits, pairs,
                                                               to_logits, gen, cfg)
        if do_ridge:
            entry["ridge"], val_scores["ridge"][layer] = _ridge_layer(lm, data, layer, H, O, splits, pairs,
                                                                     to_logits, gen, cfg)
        out["layers"][str(layer)] = entry
    for method in ("lre", "ridge"):
        scores = val_scores[method]
        if not scores:
            continue
        best = max(scores, key=lambda l: (scores[l]["faithfulness"], -l))
        sel = {"layer": best, "by": "mean validation faithfulness over splits",
               "faithfulness": out["layers"][str(best)][method]["faithfulness"]}
        causal_scores = {l: s["causality"] for l, s in scores.items() if "causality" in s}
        if causal_scores:
            best_c = max(causal_scores, key=lambda l: (causal_scores[l], -l))
            sel["causality_layer"] = best_c
            sel["causality"] = out["layers"][str(best_c)][method]["causality"]
        out["selected"][method] = sel
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _lre_layer(lm, data, layer, H, O, W, splits, pairs, to_logits, gen, cfg):
    """LRE at one layer over the splits: faithfulness (+ majority control) and causality (+ controls)."""
    n = H.shape[0]
    y = data.y
    svd = _SVD(W)
    truncated = {k: svd.truncated(k) for k in cfg.ranks}
    pinvs = {r: svd.pinv(r) for r in cfg.edit_ranks}
    faith, majority = _Hits(n), _Hits(n)
    causal, random_dir, full_patch = _Hits(n), _Hits(n), _Hits(n)
    chosen, val_f, val_c = [], [], []
    for s, (train, val, test) in enumerate(splits):
        # beta and rank by validation faithfulness (one batched LM-head pass for the whole grid)
        decs = [(beta, k, LinearRelationDecoder(beta=beta, rank=None).fit(H[train], O[train], truncated[k]))
                for k in cfg.ranks for beta in cfg.betas]
        preds = torch.cat([d.predict(H[val]) for _, _, d in decs])
        hits = (to_logits(preds).argmax(-1) == y[val].repeat(len(decs))).view(len(decs), -1).double().mean(1)
        best = int(hits.argmax())
        beta, rank, dec = decs[best]
        val_f.append(float(hits[best]))
        faith.add(test, to_logits(dec.predict(H[test])).argmax(-1) == y[test])
        mode = Counter(y[train].tolist()).most_common(1)[0][0]
        majority.add(test, y[test] == mode)
        record = {"beta": beta, "rank": rank, "val_faithfulness": float(hits[best])}
        if pairs is not None:
            op = LinearRelationOperator(W.to(H.dtype), dec.b_.to(H.dtype), beta)

            def ends(src, tgt):
                if cfg.edit_target == "state":
                    return O[src], O[tgt]
                return op(H[src]), op(H[tgt])
            (vs, vt), (ts, tt) = pairs[s]
            if len(vs) and len(ts):
                o_s, o_t = ends(vs, vt)
                cand = [_edit_delta(pinvs[r], beta, o_s, o_t) for r in cfg.edit_ranks]
                rates = [float(h.double().mean()) for h in _causality_hits(lm, data, layer, cand, vs, vt, cfg)]
                r_best = max(range(len(rates)), key=lambda i: (rates[i], i))  # ties: the larger rank
                edit_rank = cfg.edit_ranks[r_best]
                val_c.append(rates[r_best])
                o_s, o_t = ends(ts, tt)
                delta = _edit_delta(pinvs[edit_rank], beta, o_s, o_t)
                patch_all = (H[tt] - H[ts]).float()
                h_edit, h_rand, h_full = _causality_hits(lm, data, layer,
                                                         [delta, _random_like_norm(delta, gen), patch_all],
                                                         ts, tt, cfg)
                causal.add(ts, h_edit)
                random_dir.add(ts, h_rand)
                full_patch.add(ts, h_full)
                record.update({"edit_rank": edit_rank, "val_causality": rates[r_best],
                               "edit_norm_ratio": float((delta.double().norm(dim=1) /
                                                         H[ts].norm(dim=1)).mean())})
        chosen.append(record)
    result = {"faithfulness": _metric(faith, {"majority": majority}, cfg), "chosen": chosen}
    scores = {"faithfulness": sum(val_f) / len(val_f)}
    if causal.splits:
        result["causality"] = _metric(causal, {"random_direction": random_dir, "full_patch": full_patch}, cfg,
                                      primary="random_direction")
        scores["causality"] = sum(val_c) / len(val_c)
    return result, scores


def _ridge_layer(lm, data, layer, H, O, splits, pairs, to_logits, gen, cfg):
    """Ridge affine decoder at one layer: faithfulness (+ shuffled-pairs and majority controls), causality."""
    n = H.shape[0]
    y = data.y
    faith, shuffled, majority = _Hits(n), _Hits(n), _Hits(n)
    causal, random_dir = _Hits(n), _Hits(n)
    chosen, val_f = [], []
    for s, (train, val, test) in enumerate(splits):
        decs = [RidgeDecoder(alpha=a).fit(H[train], O[train]) for a in cfg.ridge_alphas]
        preds = torch.cat([d.predict(H[val]) for d in decs])
        hits = (to_logits(preds).argmax(-1) == y[val].repeat(len(decs))).view(len(decs), -1).double().mean(1)
        best = max(range(len(decs)), key=lambda i: (float(hits[i]), i))  # ties: the stronger penalty
        dec, alpha = decs[best], cfg.ridge_alphas[best]
        val_f.append(float(hits[best]))
        faith.add(test, to_logits(dec.predict(H[test])).argmax(-1) == y[test])
        perm = train[torch.randperm(len(train), generator=gen)]
        shuf = RidgeDecoder(alpha=alpha).fit(H[train], O[perm])
        shuffled.add(test, to_logits(shuf.predict(H[test])).argmax(-1) == y[test])
        mode = Counter(y[train].tolist()).most_common(1)[0][0]
        majority.add(test, y[test] == mode)
        record = {"alpha": alpha, "val_faithfulness": float(hits[best])}
        if pairs is not None:
            op = dec.operator_
            _, (ts, tt) = pairs[s]
            if len(ts):
                ends = (lambda a, b: (O[a], O[b])) if cfg.edit_target == "state" else \
                    (lambda a, b: (op(H[a]), op(H[b])))
                delta = op.edit_delta(*ends(ts, tt)).float()
                h_edit, h_rand = _causality_hits(lm, data, layer, [delta, _random_like_norm(delta, gen)], ts, tt,
                                                 cfg)
                causal.add(ts, h_edit)
                random_dir.add(ts, h_rand)
        chosen.append(record)
    result = {"faithfulness": _metric(faith, {"shuffled": shuffled, "majority": majority}, cfg),
              "chosen": chosen}
    scores = {"faithfulness": sum(val_f) / len(val_f)}
    if causal.splits:
        result["causality"] = _metric(causal, {"random_direction": random_dir}, cfg,
                                      note="full-rank pseudo-inverse of the ridge W; nothing chosen on validation")
    return result, scores


# ----------------------------------------------------------------------------------------------- superposition
def _shared_group(relations) -> list:
    """The largest group of relations with the same subject type (>= 2), else all relations."""
    groups: dict[str, list] = {}
    for rel in relations:
        kind = (rel.properties or {}).get("subject_type")
        if kind:
            groups.setdefault(kind, []).append(rel)
    best = max(groups.values(), key=len, default=[])
    return best if len(best) >= 2 else list(relations)


def _subject_at_start(tokenizer, template: str, probe: str = "France") -> bool:
    """Does the subject open the token sequence (no special token before it)? Its state then sits at position
    0, where models without a BOS token keep their attention sink (norms ~100x larger in SmolLM2)."""
    try:
        return int(encode(tokenizer, template, [probe]).subject_first[0]) == 0
    except SubjectNotFoundError:
        return False


def _neutral_templates(tokenizer, group, override) -> tuple[list[str], list[str]]:
    """Relation-free templates: ``override``, else those of the group's first relation minus the ones that put
    the subject at position 0 (kept when nothing else is left). Returns (used, dropped)."""
    if override:
        return list(override), []
    templates = list(dict.fromkeys(group[0].neutral_templates)) or ["{}"]
    keep = [t for t in templates if not _subject_at_start(tokenizer, t)]
    if not keep:
        return templates, []
    return keep, [t for t in templates if t not in keep]


def _locatable(tokenizer, template: str, subjects: list[str]) -> list[bool]:
    return [error is None for error in locate_errors(tokenizer, template, subjects)]


def _unembedding(lm) -> torch.Tensor:
    """The LM head's weight [vocab, d] (rows = u vectors of tokens)."""
    head = lm.adapter.lm_head
    if head is None and hasattr(lm.model, "get_output_embeddings"):
        head = lm.model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise AnalysisError("superposition: the model has no LM head weight to take attribute vectors from")
    return head.weight.detach().float().cpu()


def _attribute_vectors(lm, attributes: list[list[str]], how: str) -> tuple[list[torch.Tensor], list[int]]:
    weight = _unembedding(lm)
    U, collisions = [], []
    for attrs in attributes:
        ids = attribute_token_ids(lm.tokenizer, attrs)
        if how == "first":
            U.append(weight[[t[0] for t in ids]].clone())
        elif how == "mean":
            U.append(torch.stack([weight[t].mean(0) for t in ids]))
        else:
            raise ValueError(f"attribute_vectors must be 'first' or 'mean', got {how!r}")
        collisions.append(first_token_collisions([t[0] for t in ids], attrs))
    return U, collisions


def _ci_of(d: dict | None) -> dict:
    if d is None:
        return {"value": float("nan"), "ci": [float("nan"), float("nan")]}
    return {"value": d["estimate"], "ci": [d["lo"], d["hi"]]}


def _superposition(lm, relations, known, layers: list[int], swap_layers: list[int], cfg: AnalysisSettings,
                   log: _Log) -> dict:
    from .datasets import FactTable

    t0 = time.perf_counter()
    group = _shared_group(relations)
    table = FactTable.from_relations(group, min_relations=2 if len(group) >= 2 else 1)
    neutral, dropped = _neutral_templates(lm.tokenizer, group, cfg.neutral_templates)
    ok = torch.tensor([all(_locatable(lm.tokenizer, t, [s])[0] for t in neutral) for s in table.subjects])
    keep = torch.nonzero(ok).flatten()
    if cfg.max_superposition_subjects:
        keep = keep[:cfg.max_superposition_subjects]
    subjects = [table.subjects[i] for i in keep.tolist()]
    A = table.table[keep].clone()
    if cfg.superposition_facts == "known":
        for r, rel in enumerate(group):
            status = {f.subject: f.known for f in (known.get(rel.name) or [])}
            for i, s in enumerate(subjects):
                if not status.get(s, False):
                    A[i, r] = -1
    elif cfg.superposition_facts != "all":
        raise ValueError(f"superposition_facts must be 'all' or 'known', got {cfg.superposition_facts!r}")
    present = (A >= 0).sum(0)
    usable = [r for r in range(A.shape[1]) if int(present[r]) >= max(cfg.folds, 3) * 2]
    rows = (A[:, usable] >= 0).any(1) if usable else torch.zeros(len(subjects), dtype=torch.bool)
    if len(usable) < 1 or int(rows.sum()) < 2 * cfg.folds:
        raise AnalysisError(f"superposition: relations {[r.name for r in group]} share too few subjects with facts "
                            f"({int(rows.sum())} subjects, {len(usable)} relations with enough facts)")
    sel = torch.nonzero(rows).flatten()
    subjects = [subjects[i] for i in sel.tolist()]
    A = A[sel][:, usable]
    rels = [group[r] for r in usable]
    names = [r.name for r in rels]
    attributes = [table.attributes[r] for r in usable]
    U, collisions = _attribute_vectors(lm, attributes, cfg.attribute_vectors)
    log(f"superposition: {len(subjects)} subjects x {len(rels)} relations, states at {len(layers)} layers")
    H = subject_states(lm, neutral, subjects, layers, batch_size=cfg.batch_size * 2)
    controls_H, U_c = None, None
    if cfg.random_control:
        rlm = random_like(lm, seed=cfg.seed + 12345)
        controls_H = subject_states(rlm, neutral, subjects, layers, batch_size=cfg.batch_size * 2)
        U_c, _ = _attribute_vectors(rlm, attributes, cfg.attribute_vectors)
        del rlm
    out = {
        "relations": names, "subjects": len(subjects), "n_facts": int((A >= 0).sum()),
        "facts": cfg.superposition_facts, "neutral_templates": neutral, "neutral_templates_dropped": dropped,
        "attribute_vectors": ("unembedding row of the attribute's first token (' ' + attribute)"
                              if cfg.attribute_vectors == "first" else
                              "mean of the unembedding rows of the attribute's tokens (' ' + attribute)"),
        "n_attributes": {nm: len(a) for nm, a in zip(names, attributes)},
        "first_token_collisions": dict(zip(names, collisions)),
        "layers": {}, "error": None,
    }
    for layer in layers:
        controls = {"random_init": (controls_H[layer], U_c)} if controls_H is not None else None
        rep = superposition_readout(H[layer], A, U, controls=controls, relation_names=names, k=cfg.folds,
                                    seed=cfg.seed, n_boot=cfg.n_boot, decode=False)
        conds, margins = rep.conditions, rep.margins
        ctrl_names = [c for c in conds if c != "real"]

        def with_controls(get):
            main = _ci_of(get(conds["real"]))
            ctrls = {c: _ci_of(get(conds[c])) for c in ctrl_names}
            return {**main, "control": {"name": "shuffled", **ctrls["shuffled"]}, "controls": ctrls}
        r2 = with_controls(lambda c: c["r2"])
        r2["margins"] = {c: _ci_of(margins[c]["r2"]) for c in margins}
        readout = {}
        for nm in names:
            m = with_controls(lambda c: c["readout_acc"][nm])
            m["chance"] = _ci_of(conds["real"]["chance"][nm])["value"]
            m["margins"] = {c: _ci_of(margins[c]["readout_acc"][nm]) for c in margins}
            readout[nm] = m
        entry = {"r2": r2, "readout": readout, "alpha_per_fold": conds["real"].get("alpha_per_fold")}
        if layer in swap_layers:
            entry["swap"] = _swap(lm, rels, subjects, A, U, attributes, H[layer], layer, cfg)
        out["layers"][str(layer)] = entry
        log(f"superposition: layer {layer} done (R^2 {r2['value']:.3f}, shuffled {r2['control']['value']:.3f})")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _swap(lm, rels, subjects, A, U, attributes, H, layer, cfg) -> dict:
    """Swap edit h + W_r (u_a' - u_a) through real forward passes on relation prompts of held-out subjects:
    success = relation r's next token becomes a''s first token; unchanged = another relation's answer stays."""
    tok = lm.tokenizer
    n, R = A.shape
    gen = torch.Generator().manual_seed(cfg.seed + 11)
    templates = [r.templates[0] for r in rels]
    ok = torch.tensor([_locatable(tok, t, subjects) for t in templates]).T          # [n, R]
    chosen = torch.randperm(n, generator=gen)[:cfg.max_swap_subjects]
    fold_of = {}
    for f, (train, test) in enumerate(kfold_indices(n, cfg.folds, cfg.seed)):
        for i in test.tolist():
            fold_of[i] = (f, train)
    # first token of each attribute after each relation's prompt (the tokens after the prompt do not depend on
    # the subject, so one prompt per relation gives them)
    firsts = [first_token_targets(tok, [templates[r].replace("{}", subjects[0], 1)] * len(attributes[r]),
                                  attributes[r]) for r in range(R)]
    fits: dict[int, SuperpositionFit] = {}
    edits = []  # (subject index, r, r_other, delta, target token)
    for i in sorted(chosen.tolist()):
        f, train = fold_of[i]
        if f not in fits:
            fits[f] = SuperpositionFit(alpha=tuple(10.0 ** k for k in range(-4, 6))).fit(H[train], A[train], U)
        fit = fits[f]
        for r in range(R):
            a = int(A[i, r])
            if a < 0 or not ok[i, r]:
                continue
            first = firsts[r]
            options = [b for b in range(len(U[r])) if b != a and int(first[b]) != int(first[a])]
            others = [q for q in range(R) if q != r and ok[i, q]]
            if not options or not others:
                continue
            b = options[int(torch.randint(len(options), (1,), generator=gen))]
            q = others[int(torch.randint(len(others), (1,), generator=gen))]
            h = H[i:i + 1]
            delta = (fit.swap_edit(h, A[i:i + 1], r, b) - h)[0]
            edits.append((i, r, q, delta, int(first[b])))
    if not edits:
        return {"error": "no swap edit could be built (no subject with facts in two locatable relations)"}
    idx = [e[0] for e in edits]
    deltas = torch.stack([e[3] for e in edits]).float()
    rand = _random_like_norm(deltas, gen)
    subj = [subjects[i] for i in idx]
    t_r = [templates[e[1]] for e in edits]
    t_q = [templates[e[2]] for e in edits]
    target = torch.tensor([e[4] for e in edits])
    clean_q = next_token_predictions(lm, t_q, subj, batch_size=cfg.batch_size)
    seqs = {}
    for r in range(R):
        rows = sorted({e[0] for e in edits if r in (e[1], e[2])})
        if rows:
            got = layer_sequences(lm, templates[r], [subjects[i] for i in rows], layer, batch_size=cfg.batch_size)
            seqs.update({(r, i): s for i, s in zip(rows, got)})
    resume = [seqs[(e[1], e[0])] for e in edits] + [seqs[(e[2], e[0])] for e in edits]
    scales = [1.0] + [float(x) for x in cfg.swap_scales if float(x) != 1.0]   # the fitted edit comes first
    edit_sets = [x * scale for scale in scales for x in (deltas, deltas, rand, rand)]
    preds = next_token_predictions(lm, (t_r + t_q + t_r + t_q) * len(scales), subj * 4 * len(scales), layer,
                                   torch.cat(edit_sets), batch_size=cfg.batch_size, resume=resume * 2 * len(scales))
    m = len(edits)
    preds = preds.view(len(scales), 4, m)
    subj_idx = torch.tensor(idx)

    def per_subject(hits):
        h = _Hits(n)
        h.add(subj_idx, hits)
        return h

    def measured(p):  # p [4, m]: edit on r, edit read on q, random on r, random read on q
        return {"success": _metric(per_subject(p[0] == target), {"random_direction": per_subject(p[2] == target)},
                                   cfg),
                "others_unchanged": _metric(per_subject(p[1] == clean_q),
                                            {"random_direction": per_subject(p[3] == clean_q)}, cfg)}
    norm_ratio = float((deltas.double().norm(dim=1) / H[subj_idx].double().norm(dim=1)).mean())
    return {
        **measured(preds[0]),
        "scale": scales[0],
        "by_scale": [{"scale": scale, **measured(preds[k])} for k, scale in enumerate(scales)],
        "n_edits": m, "n_subjects": len(set(idx)), "edit_norm_ratio": norm_ratio,
    }


# ------------------------------------------------------------------------------------------------------- main
def run_analyses(lm, relations, known: dict, layers, analyses=ANALYSES, n_splits: int = 3, seed: int = 0,
                 max_subjects: int = 90, progress: bool = True, **options) -> dict:
    """Run the requested analyses on a loaded model; returns a JSON-ready dict.

    ``relations``: ``llmprobe.datasets.Relation`` list; ``known``: relation name -> list of
    ``llmprobe.known.FactResult`` (LRE and ridge use the known facts only); ``layers``: layer indices;
    ``analyses``: any subset of ``ANALYSES``. ``options``: any field of :class:`AnalysisSettings`.
    A relation that cannot be analysed gets an ``error`` entry and the others go on.
    """
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    bad = [k for k in options if k not in AnalysisSettings.__dataclass_fields__]
    if bad:
        raise TypeError(f"unknown options {bad}; see AnalysisSettings")
    cfg = AnalysisSettings(n_splits=n_splits, seed=seed, max_subjects=max_subjects, **options)
    if cfg.scoring not in SCORING_MODES:
        raise ValueError(f"scoring must be one of {SCORING_MODES}, got {cfg.scoring!r}")
    if cfg.edit_target not in ("operator", "state"):
        raise ValueError(f"edit_target must be 'operator' or 'state', got {cfg.edit_target!r}")
    if n_splits < 1:
        raise ValueError("n_splits must be >= 1")
    log = _Log(progress)
    n_layers = lm.adapter.n_layers
    layers = sorted({lm.adapter.layer_index(l) for l in layers})
    if not layers:
        raise ValueError("run_analyses needs at least one layer")
    def chosen(spec, default):
        picked = sorted({lm.adapter.layer_index(l) for l in spec}) if spec is not None else default
        return [l for l in picked if l in layers]
    lre_layers = chosen(cfg.lre_layers, pick_layers(layers, cfg.max_lre_layers, n_layers))
    causal_layers = [l for l in chosen(cfg.causality_layers, lre_layers) if l in lre_layers or "lre" not in analyses]
    swap_layers = chosen(cfg.swap_layers, lre_layers)
    start = time.perf_counter()
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    settings.update({"analyses": list(analyses), "layers": layers, "lre_layers": lre_layers,
                     "causality_layers": causal_layers,
                     "swap_layers": swap_layers, "h": H_PLACE, "o": O_PLACE,
                     "objects": FIRST_TOKEN_NOTE if cfg.scoring == FIRST_TOKEN else
                     FIRST_TOKEN_NOTE + " for faithfulness; causality success = full-sequence log-prob of the "
                                        "target object above that of the original object",
                     "intervals": f"95% percentile bootstrap over subjects ({cfg.n_boot} resamples)",
                     "spread": "standard deviation of the test score over splits"})
    result = {"settings": settings, "relations": {}, "errors": [], "timing": {}}
    do_lre, do_ridge = "lre" in analyses, "ridge" in analyses
    if do_lre or do_ridge:
        for relation in relations:
            log(f"{relation.name}: decoders ({', '.join(a for a in analyses if a != 'superposition')})")
            try:
                entry = _decoders_for_relation(lm, relation, known.get(relation.name), layers, lre_layers,
                                               causal_layers, do_lre, do_ridge, cfg, log)
            except Exception as error:  # noqa: BLE001 - one relation's failure must not stop the others
                text = str(error) if isinstance(error, (AnalysisError, ValueError)) else \
                    f"{type(error).__name__}: {error}"
                message = text if relation.name in text else f"relation {relation.name}: {text}"
                entry = {"error": message}
                result["errors"].append(message)
                log(message)
            result["relations"][relation.name] = entry
        result["timing"]["decoders_seconds"] = round(time.perf_counter() - start, 1)
    if "superposition" in analyses:
        t = time.perf_counter()
        try:
            result["superposition"] = _superposition(lm, relations, known, layers, swap_layers, cfg, log)
        except Exception as error:  # noqa: BLE001 - reported, the decoders' results are kept
            error = error if isinstance(error, (AnalysisError, ValueError)) else f"{type(error).__name__}: {error}"
            result["superposition"] = {"error": str(error)}
            result["errors"].append(f"superposition: {error}")
            log(f"superposition: {error}")
        result["timing"]["superposition_seconds"] = round(time.perf_counter() - t, 1)
    result["timing"]["total_seconds"] = round(time.perf_counter() - start, 1)
    result["table"] = table_rows(result)
    return result


# ------------------------------------------------------------------------------------------------------ tables
def table_rows(result: dict) -> list[dict]:
    """Flat rows (relation, layer, analysis, metric, value, ci, control name/value/ci) for reports."""
    rows = []

    def add(relation, layer, analysis, metric, m):
        if not m or "value" not in m:
            return
        ctrl = m.get("control") or {}
        rows.append({"relation": relation, "layer": int(layer), "analysis": analysis, "metric": metric,
                     "value": m["value"], "ci": m.get("ci"), "spread": m.get("spread"),
                     "control": ctrl.get("name"), "control_value": ctrl.get("value"),
                     "control_ci": ctrl.get("ci"),
                     "controls": {k: v.get("value") for k, v in (m.get("controls") or {}).items()}})
    for name, rel in result.get("relations", {}).items():
        for layer, entry in (rel.get("layers") or {}).items():
            for analysis in ("lre", "ridge"):
                for metric in ("faithfulness", "causality"):
                    add(name, layer, analysis, metric, (entry.get(analysis) or {}).get(metric))
    sup = result.get("superposition") or {}
    for layer, entry in (sup.get("layers") or {}).items():
        add("(all)", layer, "superposition", "r2", entry.get("r2"))
        for name, m in entry.get("readout", {}).items():
            add(name, layer, "superposition", "readout_accuracy", m)
        swap = entry.get("swap") or {}
        add("(all)", layer, "superposition", "swap_success", swap.get("success"))
        add("(all)", layer, "superposition", "swap_others_unchanged", swap.get("others_unchanged"))
    return rows


def _fmt(m: dict | None) -> str:
    if not m or m.get("value") is None or (isinstance(m["value"], float) and math.isnan(m["value"])):
        return "-"
    ci = m.get("ci") or [float("nan")] * 2
    return f"{m['value']:.2f} [{ci[0]:.2f},{ci[1]:.2f}]"


def format_table(result: dict, layers: list[int] | None = None) -> str:
    """Markdown table per relation and layer: value [95% CI] (primary control value) for each measurement.
    ``layers``: only these layers (default: all analysed)."""
    keep = None if layers is None else {str(l) for l in layers}
    head = ("| relation | layer | LRE faithfulness (majority) | LRE causality (random dir.) | ridge faithfulness "
            "(shuffled) | readout accuracy (shuffled / random init) |")
    lines = [head, "|" + "---|" * 6]
    sup = (result.get("superposition") or {}).get("layers") or {}

    def ctl(m, name=None):
        if not m or "controls" not in m:
            return ""
        c = m["controls"].get(name) if name else m.get("control")
        return f" ({c['value']:.2f})" if c and c.get("value") is not None else ""
    for name, rel in result.get("relations", {}).items():
        if rel.get("error"):
            lines.append(f"| {name} | - | error: {rel['error']} | | | |")
            continue
        for layer, entry in rel.get("layers", {}).items():
            if keep is not None and layer not in keep:
                continue
            lre, ridge = entry.get("lre") or {}, entry.get("ridge") or {}
            ro = (sup.get(layer) or {}).get("readout", {}).get(name)
            ro_txt = _fmt(ro) + (f" ({ro['controls']['shuffled']['value']:.2f} / "
                                 f"{ro['controls'].get('random_init', {}).get('value', float('nan')):.2f})"
                                 if ro else "")
            lines.append(f"| {name} | {layer} | {_fmt(lre.get('faithfulness'))}{ctl(lre.get('faithfulness'))} | "
                         f"{_fmt(lre.get('causality'))}{ctl(lre.get('causality'))} | "
                         f"{_fmt(ridge.get('faithfulness'))}{ctl(ridge.get('faithfulness'), 'shuffled')} | "
                         f"{ro_txt} |")
    if sup:
        lines += ["", "| layer | superposition R^2 (shuffled / random init) | swap success (random dir.) | "
                      "others unchanged (random dir.) |", "|---|---|---|---|"]
        for layer, entry in sup.items():
            if keep is not None and layer not in keep:
                continue
            r2 = entry["r2"]
            sw = entry.get("swap") or {}
            lines.append(f"| {layer} | {_fmt(r2)} ({r2['controls']['shuffled']['value']:.3f} / "
                         f"{r2['controls'].get('random_init', {}).get('value', float('nan')):.3f}) | "
                         f"{_fmt(sw.get('success'))}{ctl(sw.get('success'))} | "
                         f"{_fmt(sw.get('others_unchanged'))}{ctl(sw.get('others_unchanged'))} |")
    return "\n".join(lines)
