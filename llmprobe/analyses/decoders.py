"""Linear relation decoders on a model's known facts, per relation and layer (``docs/measures.md``).

* **LRE** (Hernandez et al. 2023): W = mean Jacobian d o / d h over the re-fit's Jacobian prompts, o_hat =
  beta W_k h + b. Faithfulness: test subjects whose ``adapter.logits(o_hat)`` top token is the object's (control:
  the training majority answer; lexical: the same beta W, its b refitted, on the subject's state after block 0,
  when layer 0 is measured). Causality, as in the reference: for a test pair (s, t), h_s -> h_s +
  W_r^+ (o_t - o_s) with o_s, o_t the model's *real* last-block states at the last token of each subject's own
  prompt, patched into a real forward pass; success when the model then answers t's object. Controls, each of
  the edit's norm per pair: a random direction, the same edit with a random matrix of W's singular values
  (random_operator, rescaled), and the step h_t - h_s rescaled (scaled_patch); beside them h_s replaced by h_t
  (full_patch: a reference, not a bound). The whole (beta, k) grid is scored by K-fold cross-validated
  faithfulness over the re-fit's train + validation subjects; the edit rank r on pairs of those subjects; the
  layer on the mean of those scores; never on the test subjects.
* **Ridge**: a learned affine o ~ W h + b (alpha chosen on validation), scored the same way (controls: ridge on
  shuffled pairs, majority; causality with its pseudo-inverse beside a random direction and scaled_patch).

Every value is the mean over re-fits of the hit rate on one fixed test set (proportion with a Wilson interval
over its n test items); the spread is the standard deviation over re-fits. With ``n_icl`` in-context examples
(drawn by the known-fact stage, never tested) every prompt starts with them.

Protocol ``lre`` runs the LRE reference's pipeline instead (:func:`lre_protocol`: trials of training facts that
are each other's in-context examples, its bias, beta and edit-rank grids, pair rule and layer choice; selection
on validation facts or, labelled so, on the test facts as published).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from llmprobe.analyses.passes import cached_edit_batches, jacobian_prompts, padded_batches
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.results import RelationDecoders
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, Log, planned_lre_layers
from llmprobe.analyses.splits import (
    Refit,
    RelationSplit,
    candidate_grid,
    generator,
    in_context_draws,
    object_pairs,
    relation_split,
    trial_split,
)
from llmprobe.geometry import LinearRelationDecoder, RidgeDecoder, random_direction_like, random_spectrum_factors
from llmprobe.metric import Metric, proportion, t_over_seeds
from llmprobe.model.chat import chat_split
from llmprobe.model.engine import (
    edited_predictions,
    layer_sequences,
    line_argmax,
    logits_fn,
    next_token_predictions,
    relation_states,
)
from llmprobe.model.known import icl_template, reference_start, resolve_n_icl
from llmprobe.model.lre import JacobianResult, jacobian_cost, subject_jacobians
from llmprobe.model.scoring import Scorer, first_token_collisions, first_token_targets, sequence_logprobs
from llmprobe.model.subjects import fill
from llmprobe.names import FIRST_TOKEN, SEQUENCE

FULL_PATCH_NOTE = ("reference, not a bound: h_s replaced by h_t (an edit can exceed it); does not depend on the "
                   "fit: measured once")
LEXICAL_LAYER = 0                   # LRE faithfulness' lexical null reads the subject's state after block 0
LEXICAL_NOTE = ("the same operator beta W (b refitted on the same subjects) applied to the subject's state after "
                "block 0, its tokens' component of h: what the LRE reads from the subject's tokens alone")
PREFIX_CACHE = True                 # causality's edits: edited_predictions (False: the full resumed pass)
AUTO_JACOBIAN_RANK = 128             # the smallest rank whose numbers matched exact ones on SmolLM2 (docs/analyses.md)


def jacobian_rank_for(cfg: AnalysisSettings, d_model: int | None, layers: list[int], n_blocks: int) -> int | None:
    """The Jacobian rank to use (None: exact): ``cfg.jacobian_rank`` K as given, None for "full", or for "auto" the
    rank ``AUTO_JACOBIAN_RANK`` when it costs less than the exact Jacobian at these LRE ``layers`` of an
    ``n_blocks``-block model (``llmprobe.model.lre.jacobian_cost``: products x blocks crossed), else None."""
    rank = cfg.jacobian_rank
    if rank in ("full", None):
        return None
    if rank != "auto":
        return int(rank)
    cheaper = d_model is not None and (jacobian_cost(d_model, layers, n_blocks, AUTO_JACOBIAN_RANK,
                                                     cfg.jacobian_oversample) < jacobian_cost(d_model, layers, n_blocks))
    return AUTO_JACOBIAN_RANK if cheaper else None


class SVD:
    """One SVD of W [d_out, d_in] serving every truncation rank and pseudo-inverse rank; from W, or from its
    factors U [d_out, r], S [r], Vh [r, d_in] (then W = U diag(S) Vh, e.g. a low-rank Jacobian's)."""

    def __init__(self, W: torch.Tensor | None = None, S: torch.Tensor | None = None, Vh: torch.Tensor | None = None):
        self.factored = S is not None          # W is the product of its factors (then they reproduce it exactly)
        if S is None:
            self.W = W.double()
            self.U, self.S, self.Vh = torch.linalg.svd(self.W, full_matrices=False)
        else:
            self.U, self.S, self.Vh = W.double(), S.double(), Vh.double()
            self.W = (self.U * self.S) @ self.Vh
        tol = self.S.max().clamp_min(0) * max(W.shape) * torch.finfo(torch.float64).eps if self.S.numel() else 0.0
        self.keep = int((self.S > tol).sum())

    def truncated(self, rank: int | None) -> torch.Tensor:
        if rank is None or rank >= len(self.S):
            return self.W
        return (self.U[:, :rank] * self.S[:rank]) @ self.Vh[:rank]

    def factors(self, rank: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(U, S, Vh) whose product is exactly ``truncated(rank)`` (same arithmetic), or None where that matrix is
        not such a product (the untruncated W of an SVD computed from W)."""
        if rank is not None and rank < len(self.S):
            return self.U[:, :rank], self.S[:rank], self.Vh[:rank]
        return (self.U, self.S, self.Vh) if self.factored else None

    def pinv(self, rank: int | None) -> torch.Tensor:
        """Rank-``rank`` pseudo-inverse [d_in, d_out] (None: every singular value above tolerance)."""
        k = self.keep if rank is None else min(rank, self.keep)
        return (self.Vh[:k].T / self.S[:k]) @ self.U[:, :k].T


@dataclass
class RelationData:
    """One relation's facts as the decoders see them: prompt templates (one per fact), subjects, objects, subject
    states H[layer] [n, d], last-block states O [n, d], first-token targets y [n] and the protocol's scorer."""

    name: str
    templates: list[str]
    subjects: list[str]
    objects: list[str]
    H: dict[int, torch.Tensor]
    O: torch.Tensor
    y: torch.Tensor
    scorer: Scorer
    sequences: dict[int, list] = field(default_factory=dict)   # clean states per prompt at the causal layers


def known_facts_of(relation, results, cfg: AnalysisSettings) -> tuple[list, list]:
    """(known facts, in-context examples) of the strict protocol: the facts known with the in-context draw, or
    zero-shot without one (``splits.in_context_draws``), one per (subject, object), the first ``max_subjects``;
    an AnalysisError naming the relation when too few are known."""
    if results is None:
        raise AnalysisError(f"relation {relation.name}: no known-facts results were given for it")
    n_icl = resolve_n_icl("strict", cfg.n_icl)
    draws = in_context_draws(results, "strict", n_icl, 1, cfg.seed, relation.name)
    known = draws[0].known if draws else [i for i, r in enumerate(results) if r.known]
    context = [results[i] for i in draws[0].context] if draws else []
    facts, seen = [], set()
    for i in known:                  # duplicate rows (the LRE dataset has some) count once
        if (results[i].subject, results[i].object) not in seen:
            seen.add((results[i].subject, results[i].object))
            facts.append(results[i])
    if len(facts) < cfg.min_known:
        hint = "" if n_icl else "; few-shot prompts (--n-icl) may find more"
        raise AnalysisError(f"relation {relation.name}: {len(facts)} known facts of {len(results)} checked; the "
                            f"decoders need at least {cfg.min_known}{hint}")
    return facts[:cfg.max_subjects], context


def zero_shot_counts(results, n_known: int, cfg: AnalysisSettings) -> dict:
    """``n_known_zero_shot`` (facts known zero-shot) and ``known_only_few_shot`` (true when fewer than
    ``min_known`` are known zero-shot but at least that many with the in-context examples) of a relation."""
    few_shot = any(r.draws for r in results)
    zero = sum(bool(r.known_zero_shot) for r in results) if few_shot else sum(r.known for r in results)
    return {"n_known_zero_shot": zero, "known_only_few_shot": few_shot and zero < cfg.min_known <= n_known}


def causality_hits(lm, data: RelationData, layer: int, deltas: list[torch.Tensor], src: torch.Tensor,
                   tgt: torch.Tensor, cfg: AnalysisSettings) -> list[torch.Tensor]:
    """Hits [m] of each edit set (deltas [m, d] added to h_src at ``layer``) on the pairs (src, tgt): one batched
    run of real forward passes for all sets. With first-token scoring and resume states (``data.sequences``) and
    ``PREFIX_CACHE`` on: ``llmprobe.model.engine.edited_predictions``, each source prompt's tokens before the subject
    run once for all its edit sets and every edit only the tokens from the subject on, the rows near a tie again
    by the full pass, so the ids are the full pass's bit for bit (off: the full resumed pass for every row)."""
    if not len(src):
        return [torch.zeros(0, dtype=torch.bool) for _ in deltas]
    k = len(deltas)
    subjects = [data.subjects[i] for i in src.tolist()] * k
    templates = [data.templates[i] for i in src.tolist()] * k
    delta = torch.cat(deltas).float()
    if cfg.scoring == SEQUENCE:
        tgt_obj = [data.objects[j] for j in tgt.tolist()] * k
        src_obj = [data.objects[i] for i in src.tolist()] * k
        lp_t = sequence_logprobs(lm, templates, subjects, tgt_obj, layer=layer, delta=delta,
                                 batch_size=cfg.batch_size)
        lp_s = sequence_logprobs(lm, templates, subjects, src_obj, layer=layer, delta=delta,
                                 batch_size=cfg.batch_size)
        hits = lp_t > lp_s
    else:
        resume = [data.sequences[layer][i] for i in src.tolist()] * k if layer in data.sequences else None
        if PREFIX_CACHE and resume is not None:
            pred = edited_predictions(lm, templates, subjects, layer, delta, resume, batch_size=cfg.batch_size)
        else:
            pred = next_token_predictions(lm, templates, subjects, layer, delta, batch_size=cfg.batch_size,
                                          resume=resume)
        hits = data.scorer.hits(pred, tgt.repeat(k))
    return list(hits.view(k, -1))


def _summary(per_refit: list[torch.Tensor], note: str | None = None) -> Metric:
    """Per-item hits of each re-fit on the same items -> proportion (mean over re-fits per item), spread over
    re-fits."""
    stacked = torch.stack([h.double() for h in per_refit])                         # [n_refits, n_items]
    return proportion(stacked.mean(0).tolist(), refits=stacked.mean(1).tolist(), note=note)


def _item_means(per_refit: list[torch.Tensor]) -> list[float]:
    """Per-item hits of each re-fit on the same items -> each item's mean over re-fits (the values
    :func:`_summary` averages)."""
    return torch.stack([h.double() for h in per_refit]).mean(0).tolist()


CAUSALITY_CONTROLS = ("random_direction", "random_operator", "scaled_patch")   # LRE causality's nulls
EDITS = ("edit",) + CAUSALITY_CONTROLS


def paired_t(a: list[float], b: list[float]) -> Metric:
    """Mean of a - b over the same items (values in [0, 1]) with the Student-t interval of the per-item
    differences (df = n - 1), clipped to [-1, 1]; of zero width (every item the same difference, or one item):
    [-1, 1], "paired t (widened)". Not the percentile bootstrap: at the 3-8 test pairs of a relation it is too
    narrow (docs/measures.md, Calibration)."""
    diffs = [x - y for x, y in zip(a, b)]
    if not diffs:
        return Metric(float("nan"), (float("nan"), float("nan")), 0, "paired t")
    over = t_over_seeds(diffs, (-1.0, 1.0))     # the Student-t interval of the items' differences
    if over.ci[0] is None:                      # one item, or every item the same difference
        return Metric(over.value, (-1.0, 1.0), over.n, "paired t (widened)")
    return Metric(over.value, over.ci, over.n, "paired t")


def causality_json(edit: Metric, controls: dict[str, Metric], per_item: dict[str, list[float]]) -> dict:
    """The causality metric (JSON form): the edit's success rate with its ``controls`` as nulls (random_direction
    shown) and ``margins``: edit - each control over the same test pairs (:func:`paired_t` of the per-pair values
    ``per_item``, by name, "edit" included, aligned over the pairs), which the claims block grades."""
    out = edit.with_nulls(controls, "random_direction").to_dict()
    out["margins"] = {name: paired_t(per_item["edit"], per_item[name]).to_dict() for name in controls
                      if name in per_item}
    return out


def causality_metric(per_refit: dict[str, list[torch.Tensor]], full: torch.Tensor | None = None) -> dict:
    """LRE causality of one layer from each re-fit's hits [n_pairs] of every edit of ``EDITS`` on the same test
    pairs, and ``full`` [n_pairs] the full patch's hits (a reference, measured once): :func:`causality_json`."""
    controls = {name: _summary(per_refit[name]) for name in CAUSALITY_CONTROLS}
    per_item = {name: _item_means(per_refit[name]) for name in EDITS}
    if full is not None:
        controls["full_patch"] = proportion(full.double().tolist(), note=FULL_PATCH_NOTE)
        per_item["full_patch"] = full.double().tolist()
    return causality_json(_summary(per_refit["edit"]), controls, per_item)


def lre_causality(H: torch.Tensor, O: torch.Tensor, svd: SVD, val_pairs, test_pairs, edit_ranks, gen:
                  torch.Generator, hits_of) -> dict:
    """One re-fit's LRE causality: the edit rank of ``edit_ranks`` whose edits W_r^+ (o_t - o_s) succeed most on
    ``val_pairs`` (ties: the larger rank; none: the largest), then the edit and its controls (:func:`lre_edits`)
    on ``test_pairs``. ``hits_of(deltas, src, tgt)`` -> hits [m] of each edit set [m, d] added to h_src (a real
    forward pass: :func:`causality_hits`; a planted world's readout in ``llmprobe.jobs.calibration``).
    Returns {"edit_rank", "val_causality" (None without validation pairs), "hits" {name of ``EDITS``: [m]},
    "edit_norm_ratio"}."""
    (vs, vt), (ts, tt) = val_pairs, test_pairs
    if len(vs):
        candidates = [(O[vt] - O[vs]) @ svd.pinv(r).T for r in edit_ranks]
        rates = [float(h.double().mean()) for h in hits_of(candidates, vs, vt)]
        best = max(range(len(rates)), key=lambda i: (rates[i], i))               # ties: the larger rank
    else:
        rates, best = [], len(edit_ranks) - 1
    edits = lre_edits(H, O, ts, tt, svd, edit_ranks[best], gen)
    return {"edit_rank": edit_ranks[best], "val_causality": rates[best] if rates else None,
            "hits": dict(zip(EDITS, hits_of([edits[n] for n in EDITS], ts, tt))),
            "edit_norm_ratio": float((edits["edit"].norm(dim=1) / H[ts].norm(dim=1)).mean())}


def _majority_hits(data: RelationData, train: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    mode = Counter(data.y[train].tolist()).most_common(1)[0][0]
    return data.scorer.hits(torch.full((len(test),), mode), test)


def norm_matched(edits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Rows of ``edits`` [m, d] rescaled to the norms of the rows of ``reference`` [m, d] (float64)."""
    edits, reference = edits.double(), reference.double()
    tiny = torch.finfo(torch.float64).tiny
    return edits * (reference.norm(dim=1, keepdim=True) / edits.norm(dim=1, keepdim=True).clamp_min(tiny))


def scaled_patch(delta: torch.Tensor, H: torch.Tensor, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The scaled_patch control of an edit ``delta`` [m, d] on the pairs (src, tgt): per pair the step
    h_t - h_s toward the target's own state, rescaled to the edit's norm (float64 [m, d])."""
    return norm_matched(H[tgt] - H[src], delta)


def lre_edits(H: torch.Tensor, O: torch.Tensor, src: torch.Tensor, tgt: torch.Tensor, svd: SVD, edit_rank: int,
              gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The LRE edit of the pairs (src, tgt) and its controls, each [m, d] and of the edit's norm per pair:
    ``edit`` W_r^+ (o_t - o_s); ``random_operator`` W'_r^+ (o_t - o_s) with W' of W's singular values and random
    singular vectors, rescaled to the edit's norm; ``random_direction``; ``scaled_patch``."""
    step = O[tgt] - O[src]
    delta = step @ svd.pinv(edit_rank).T
    random_op = step @ SVD(*random_spectrum_factors(svd.S, svd.W.shape, gen)).pinv(edit_rank).T
    return {"edit": delta, "random_direction": random_direction_like(delta, gen),
            "random_operator": norm_matched(random_op, delta), "scaled_patch": scaled_patch(delta, H, src, tgt)}


def _lre_decoder(beta: float, W: torch.Tensor, H: torch.Tensor, O: torch.Tensor, fit: torch.Tensor
                 ) -> LinearRelationDecoder:
    """o_hat = beta W h + b with W [d_out, d_in] as given (already truncated) and b fitted on the subjects ``fit``."""
    return LinearRelationDecoder(beta=beta).fit(H[fit], O[fit], W)


def cv_faithfulness(lm, data: RelationData, H: torch.Tensor, O: torch.Tensor, refit: Refit,
                    truncated: dict[int | None, torch.Tensor], grid: list[tuple[float, int | None]]) -> torch.Tensor:
    """Cross-validated faithfulness [len(grid)] of every (beta, rank) candidate: each of the re-fit's selection
    subjects is scored by a decoder fitted on train + validation without its fold (b does not depend on beta, so
    per rank every beta is one line beta * W h + b: ``line_argmax``)."""
    everyone = torch.cat([refit.train, refit.val])
    scored = torch.cat(refit.folds)
    rates = {}
    for rank in dict.fromkeys(r for _, r in grid):
        betas = [beta for beta, r in grid if r == rank]
        ops = [_lre_decoder(1.0, truncated[rank], H, O, everyone[~torch.isin(everyone, fold)]).operator_
               for fold in refit.folds]                 # o_hat = beta W h + b, b fitted without the fold
        A = torch.cat([H[fold] @ op.W.T for op, fold in zip(ops, refit.folds)])
        B = torch.cat([op.b.expand(len(fold), -1) for op, fold in zip(ops, refit.folds)])
        for beta, ids in zip(betas, line_argmax(lm, A, B, betas)):
            rates[beta, rank] = data.scorer.hits(ids, scored).double().mean()
    return torch.stack([rates[c] for c in grid])


def lre_layer(lm, data: RelationData, layer: int, jac: JacobianResult, jac_rows: dict[int, int],
              split: RelationSplit, causal: bool, cfg: AnalysisSettings) -> tuple[dict, dict]:
    """LRE at one layer: (entry {faithfulness, causality: Metric dicts, chosen: per re-fit}, validation scores).

    ``jac``: the Jacobians (exact or low-rank) of the subjects in ``jac_rows`` (subject index -> its row).
    (beta, rank) by K-fold cross-validated faithfulness over the whole grid (:func:`cv_faithfulness`), then
    refitted on train + validation; the edit rank by causality on the selection pairs."""
    H, O = data.H[layer].double(), data.O.double()
    to_logits = logits_fn(lm)
    test, (ts, tt) = split.test, split.test_pairs
    grid = candidate_grid(cfg)
    lexical_H = data.H[LEXICAL_LAYER].double() if LEXICAL_LAYER in data.H else None
    faith, majority, lexical, hits = [], [], [], {name: [] for name in EDITS}
    chosen, val_f, val_c, fits = [], [], [], []
    for k, refit in enumerate(split.refits):
        rows = [jac_rows[i] for i in refit.jacobian.tolist()]
        svd = SVD(*jac.svd(rows))
        truncated = {rank: svd.truncated(rank) for rank in cfg.ranks}
        scores = cv_faithfulness(lm, data, H, O, refit, truncated, grid)
        best = int(scores.argmax())              # ties: the first candidate (full rank first, then the smaller beta)
        beta, rank = grid[best]
        everyone = torch.cat([refit.train, refit.val])
        dec = _lre_decoder(beta, truncated[rank], H, O, everyone)
        val_f.append(float(scores[best]))
        faith.append(data.scorer.hits(to_logits(dec.predict(H[test])).argmax(-1), test))
        majority.append(_majority_hits(data, everyone, test))
        if lexical_H is not None:       # the same beta W on the block-0 component of the state, its b refitted
            lex = _lre_decoder(beta, truncated[rank], lexical_H, O, everyone)
            lexical.append(data.scorer.hits(to_logits(lex.predict(lexical_H[test])).argmax(-1), test))
        record = {"beta": beta, "rank": rank, "val_faithfulness": val_f[-1], "n_candidates": len(grid),
                  "n_selection": len(refit.selection), "n_folds": len(refit.folds)}
        if causal and len(ts):
            got = lre_causality(H, O, svd, refit.val_pairs, split.test_pairs, cfg.edit_ranks,
                                generator(cfg, data.name, layer, k, "lre controls"),
                                lambda deltas, src, tgt: causality_hits(lm, data, layer, deltas, src, tgt, cfg))
            for name in EDITS:
                hits[name].append(got["hits"][name])
            val_c.append(float("nan") if got["val_causality"] is None else got["val_causality"])
            record.update({key: got[key] for key in ("edit_rank", "val_causality", "edit_norm_ratio")})
        chosen.append(record)
        fits.append({"W": dec.operator_.W, "b": dec.operator_.b, "J": svd.W if rank is not None else None,
                     "W_factors": svd.factors(rank), "J_factors": svd.factors(None) if rank is not None else None,
                     "beta": beta, "rank": rank, "edit_rank": record.get("edit_rank"), "refit": k,
                     "val_faithfulness": val_f[-1]})
    nulls = {"majority": _summary(majority)} | ({"lexical": _summary(lexical, note=LEXICAL_NOTE)} if lexical else {})
    entry = {"faithfulness": _summary(faith).with_nulls(nulls).to_dict(), "chosen": chosen}
    scores = {"faithfulness": sum(val_f) / len(val_f), "fit": max(fits, key=lambda f: f["val_faithfulness"])}
    if hits["edit"]:
        full = causality_hits(lm, data, layer, [H[tt] - H[ts]], ts, tt, cfg)[0]
        entry["causality"] = causality_metric(hits, full)
        finite = [v for v in val_c if v == v]
        scores["causality"] = sum(finite) / len(finite) if finite else float("nan")
    return entry, scores


def ridge_layer(lm, data: RelationData, layer: int, split: RelationSplit, causal: bool,
                cfg: AnalysisSettings) -> tuple[dict, dict]:
    """Ridge affine decoder at one layer: faithfulness (controls: shuffled pairs, majority) and causality."""
    H, O = data.H[layer].double(), data.O.double()
    to_logits = logits_fn(lm)
    test, (ts, tt) = split.test, split.test_pairs
    faith, shuffled, majority, edit, rdir, spatch = [], [], [], [], [], []
    chosen, val_f, fits = [], [], []
    for k, refit in enumerate(split.refits):
        train, val = refit.train, refit.val
        decs = [RidgeDecoder(alpha=a).fit(H[train], O[train]) for a in cfg.ridge_alphas]
        preds = to_logits(torch.cat([d.predict(H[val]) for d in decs])).argmax(-1)
        val_hits = data.scorer.hits(preds, val.repeat(len(decs))).view(len(decs), -1).double().mean(1)
        best = max(range(len(decs)), key=lambda i: (float(val_hits[i]), i))    # ties: the stronger penalty
        dec, alpha = decs[best], cfg.ridge_alphas[best]
        val_f.append(float(val_hits[best]))
        faith.append(data.scorer.hits(to_logits(dec.predict(H[test])).argmax(-1), test))
        gen = generator(cfg, data.name, layer, k, "ridge controls")
        shuf = RidgeDecoder(alpha=alpha).fit(H[train], O[train[torch.randperm(len(train), generator=gen)]])
        shuffled.append(data.scorer.hits(to_logits(shuf.predict(H[test])).argmax(-1), test))
        majority.append(_majority_hits(data, train, test))
        if causal and len(ts):
            delta = dec.operator_.edit_delta(O[ts], O[tt])
            got = causality_hits(lm, data, layer, [delta, random_direction_like(delta, gen),
                                                   scaled_patch(delta, H, ts, tt)], ts, tt, cfg)
            for store, h in zip((edit, rdir, spatch), got):
                store.append(h)
        chosen.append({"alpha": alpha, "val_faithfulness": float(val_hits[best])})
        fits.append({"W": dec.operator_.W, "b": dec.operator_.b, "beta": 1.0, "rank": None, "alpha": alpha,
                     "refit": k, "val_faithfulness": val_f[-1]})
    entry = {"faithfulness": _summary(faith).with_nulls({"shuffled": _summary(shuffled),
                                                           "majority": _summary(majority)}).to_dict(),
             "chosen": chosen}
    if edit:
        entry["causality"] = _summary(edit, note="full-rank pseudo-inverse of the ridge W").with_nulls(
            {"random_direction": _summary(rdir), "scaled_patch": _summary(spatch)}).to_dict()
    return entry, {"faithfulness": sum(val_f) / len(val_f), "fit": max(fits, key=lambda f: f["val_faithfulness"])}


LRE_SELECTIONS = ("validation", "as-published")
# The reference's grids (src/sweeps.py): beta 21 values from 0, edit ranks 0, 8, ... below the limit, test rows
# capped (after sorting them by subject), by its model name: "llama" for every LlamaForCausalLM (SmolLM2 too),
# its default for the others it runs (GPT-J, GPT-2-XL, GPT-NeoX) and here for every other family as well.
REFERENCE_GRIDS = {"llama": {"beta_max": 10.0, "rank_limit": 512, "test_cap": 200},
                   "default": {"beta_max": 5.0, "rank_limit": 320, "test_cap": None}}


def reference_family(lm) -> str:
    """The reference's grid of this model: "llama" for a ``LlamaForCausalLM`` (its ``mt.name``), else "default"."""
    return "llama" if type(lm.model).__name__ == "LlamaForCausalLM" else "default"


def lre_jacobian_rank(cfg: AnalysisSettings) -> int | None:
    """Protocol lre's Jacobian rank: exact (None), as the reference, unless a rank K is asked for
    (``jacobian_rank`` K); "auto" is exact here (its rank 128 changed W by 0.2 relative to exact on SmolLM2)."""
    rank = cfg.jacobian_rank
    return None if rank in ("auto", "full", None) else int(rank)


def lre_grids(lm, cfg: AnalysisSettings, rank: int | None) -> dict:
    """The beta and edit-rank grids and the test cap of protocol lre on this model: the reference's for its family
    (:data:`REFERENCE_GRIDS`) where ``lre_betas`` / ``lre_edit_ranks`` are left at their defaults, else as given;
    edit ranks above a low Jacobian ``rank`` left out (all give its pseudo-inverse); the cap as published (the
    reference's), ``max_subjects`` known facts per trial in validation mode."""
    family = reference_family(lm)
    grid = REFERENCE_GRIDS[family]
    fields = AnalysisSettings.__dataclass_fields__
    betas = tuple(cfg.lre_betas) if tuple(cfg.lre_betas) != fields["lre_betas"].default else \
        tuple(grid["beta_max"] * i / 20 for i in range(21))
    ranks = tuple(cfg.lre_edit_ranks) if tuple(cfg.lre_edit_ranks) != fields["lre_edit_ranks"].default else \
        tuple(range(0, grid["rank_limit"], 8))
    if rank is not None:
        ranks = tuple(r for r in ranks if r <= rank) or (min(ranks),)
    cap = grid["test_cap"] if cfg.lre_selection == "as-published" else cfg.max_subjects
    return {"family": family, "betas": betas, "edit_ranks": ranks, "test_cap": cap}


def reference_drops(subjects: list[str], objects: list[str]) -> bool:
    """True where the reference's sweep stops on a trial: some known test fact has no edit target (no other of
    another subject and another object: ``random_edit_targets`` skips it and the sweep's ``assert target is not
    None`` fails), e.g. when the known test facts share one object."""
    return any(not any(s != t and o != u for t, u in zip(subjects, objects)) for s, o in zip(subjects, objects))


SELECTION_NOTES = {
    "validation": "beta, edit rank and layer chosen on each trial's validation facts (its test facts never used)",
    "as-published": "AS PUBLISHED: beta, edit rank and layer chosen on the test facts themselves, as the reference's "
                    "sweep does; not held-out numbers",
}


def protocol_note(cfg: AnalysisSettings) -> str:
    """One line saying what the decoders' protocol does (``result["settings"]["protocol_note"]``)."""
    if cfg.protocol == "strict":
        n_icl = resolve_n_icl("strict", cfg.n_icl)
        return ("zero-shot prompts (the relation's first template)" if not n_icl else
                f"{n_icl} in-context examples (facts of the relation, drawn once, never tested) before the prompt")
    return (f"the LRE reference's protocol: per trial ({cfg.n_splits}) {resolve_n_icl('lre', cfg.n_icl)} training "
            f"facts, each prompted with the others as in-context examples for J and b (W = mean J_i, b = mean of "
            f"o_i - J_i h_i, o_hat = beta W h + b), the test facts with all of them; known and correct by the "
            f"prefix rule; {SELECTION_NOTES[cfg.lre_selection]}")


def _per_fact(parts: list[tuple[list[int], torch.Tensor]], note: str | None = None) -> Metric:
    """A proportion over distinct facts from each trial's (fact ids, hits): a fact tested in several trials
    counts once, with its mean hit; the spread is over the trials' rates."""
    return proportion(_fact_means(parts), refits=[float(h.double().mean()) for _, h in parts if len(h)], note=note)


def _fact_means(parts: list[tuple[list[int], torch.Tensor]]) -> list[float]:
    """Each distinct fact's mean hit over the trials that tested it (``parts``: each trial's (fact ids, hits)),
    in the order the facts first appear."""
    by_fact: dict[int, list[float]] = {}
    for ids, hits in parts:
        for i, h in zip(ids, hits.double().tolist()):
            by_fact.setdefault(i, []).append(h)
    return [sum(v) / len(v) for v in by_fact.values()]


def _lre_trial_layer(lm, data: RelationData, layer: int, jac: JacobianResult, val: torch.Tensor, test: torch.Tensor,
                     val_pairs, test_pairs, majority: int, causal: bool, cfg: AnalysisSettings,
                     gen: torch.Generator) -> dict:
    """One trial of the reference protocol at one layer: W = mean of the training facts' Jacobians, b = mean of
    their o_i - J_i h_i; beta from ``cfg.lre_betas`` by faithfulness on ``val``, the edit rank from
    ``cfg.lre_edit_ranks`` by causality on ``val_pairs`` (first best, as the reference's max); hits on ``test``
    and ``test_pairs`` at those choices (the edit with its controls, ``lre_edits``)."""
    H, O = data.H[layer].double(), data.O.double()
    svd = SVD(*jac.svd())
    rows = list(range(len(jac.H)))
    b = (jac.O.double() - jac.apply(rows, jac.H)).mean(0)
    WH = H @ svd.W.T
    everyone = torch.arange(len(H))
    hits = torch.stack([data.scorer.hits(ids, everyone)
                        for ids in line_argmax(lm, WH, b.expand(len(H), -1), cfg.lre_betas)])
    best = int(hits[:, val].double().mean(1).argmax())             # ties: the first (smallest) beta
    out = {"beta": cfg.lre_betas[best], "val_faithfulness": float(hits[best, val].double().mean()),
           "faithfulness": hits[best, test], "majority": data.scorer.hits(torch.full((len(test),), majority), test),
           "fit": {"W": svd.W, "b": b, "J": None, "W_factors": svd.factors(None), "J_factors": None,
                   "beta": cfg.lre_betas[best], "rank": None}}
    (vs, vt), (ts, tt) = val_pairs, test_pairs
    if causal and len(vs) and len(ts):
        candidates = [(O[vt] - O[vs]) @ svd.pinv(r).T for r in cfg.lre_edit_ranks]
        rates = torch.stack([h.double().mean() for h in causality_hits(lm, data, layer, candidates, vs, vt, cfg)])
        edit_rank = cfg.lre_edit_ranks[int(rates.argmax())]          # ties: the first (smallest) rank
        edits = lre_edits(H, O, ts, tt, svd, edit_rank, gen)
        got = causality_hits(lm, data, layer, [edits[n] for n in EDITS], ts, tt, cfg)
        out.update({"edit_rank": edit_rank, "val_causality": float(rates.max()), "causality": dict(zip(EDITS, got))})
        out["fit"]["edit_rank"] = edit_rank
    return out


def lre_protocol(lm, relation, results, lre_layers: list[int], causal_layers: list[int], cfg: AnalysisSettings,
                 log: Log, fitted: dict | None = None) -> dict:
    """The LRE reference's pipeline (Hernandez et al. 2023, github.com/evandez/relations; docs/analyses.md, "The
    reference protocol") on one relation, per trial (one in-context draw each, ``cfg.n_splits`` of them):

    * the trial's training facts (its in-context draw, duplicate rows kept) and the facts known with them
      (``results``: the known-fact stage filters with each trial's prompt, by the prefix rule);
    * J_i, h_i, o_i of each training fact prompted with the other training facts before it (a line with its own
      subject left out); W = mean J_i, b = mean (o_i - J_i h_i); each known fact prompted with all of them;
    * faithfulness: top-1 of logits(beta W h + b) a prefix of the object, beta from ``cfg.lre_betas``;
      causality: h_s + W_r^+ (o_t - o_s) at the subject in a real forward pass, the top-1 a prefix of t's object,
      each known fact paired with a random other of another subject and object (``object_pairs``), r from
      ``cfg.lre_edit_ranks``;
    * beta and r per trial and layer, the layer by mean faithfulness over trials (causality reported there),
      chosen on validation facts or, ``cfg.lre_selection == "as-published"``, on the test facts as the reference.

    Both modes: exact Jacobians unless a rank is asked for (:func:`lre_jacobian_rank`; then the edit ranks above
    it are left out), the reference's grids for the model's family (:func:`lre_grids`), every prompt opened by
    the reference's start text (``llmprobe.model.known.reference_start``; the known-fact stage's prompts too), the
    training facts drawn one per distinct object first (the known-fact stage's draws). As published, the test
    facts are a trial's known facts sorted by subject, capped as the reference caps them (LLaMA: 200).

    A trial with no more known facts than training facts is skipped, as the reference does. A trial the
    reference's sweep would drop (a known test fact with no edit target: :func:`reference_drops`) is kept, its
    causality measured on the pairs there are; each layer's ``reference_mean`` gives the numbers the reference's
    way: the mean over the trials it keeps of each trial's rate."""
    t0 = time.perf_counter()
    if cfg.lre_selection not in LRE_SELECTIONS:
        raise ValueError(f"lre_selection must be one of {LRE_SELECTIONS}, got {cfg.lre_selection!r}")
    if results is None:
        raise AnalysisError(f"relation {relation.name}: no known-facts results were given for it")
    if not lre_layers:
        raise AnalysisError(f"relation {relation.name}: protocol lre measures the LRE only: ask for the lre "
                            f"analysis (and LRE layers)")
    as_published = cfg.lre_selection == "as-published"
    n_icl = resolve_n_icl("lre", cfg.n_icl)
    if n_icl < 1:
        raise AnalysisError(f"relation {relation.name}: protocol lre needs at least one training fact (n_icl)")
    draws = in_context_draws(results, "lre", n_icl, cfg.n_splits, cfg.seed, relation.name)
    chat, base = chat_split(lm.tokenizer, relation.templates[0])   # a wrapped template: examples in the assistant turn
    tok = lm.tokenizer
    rank = lre_jacobian_rank(cfg)
    grids = lre_grids(lm, cfg, rank)
    cfg = replace(cfg, lre_betas=grids["betas"], lre_edit_ranks=grids["edit_ranks"])
    start = reference_start(tok) + chat
    n_known = sum(r.known for r in results)
    out = {"template": icl_template(base, [results[i] for i in draws[0].context], start=start), "protocol": "lre",
           "context_subjects": [results[i].subject for i in draws[0].context], "test_subjects": None,
           "selection": cfg.lre_selection, "selection_note": SELECTION_NOTES[cfg.lre_selection], "n_icl": n_icl,
           "n_known": n_known, "n_checked": len(results), **zero_shot_counts(results, n_known, cfg),
           "jacobian_rank": rank, "grid": grids, "start_text": start, "trials": [], "layers": {}, "selected": {},
           "error": None}
    per_layer: dict[int, list[dict]] = {layer: [] for layer in lre_layers}
    for k, draw in enumerate(draws):
        train = [results[i] for i in draw.context]
        published = sorted(draw.known, key=lambda i: results[i].subject)[:REFERENCE_GRIDS[grids["family"]][
            "test_cap"]]                                    # the reference's test facts (known, by subject, capped)
        known = published if as_published else draw.known[:grids["test_cap"]]
        val, test = trial_split(known, relation.name, k, cfg, as_published)
        record = {"train_subjects": [f.subject for f in train], "n_known": len(draw.known), "n_val": len(val),
                  "n_test": len(test), "skipped": None,
                  "reference_drops": reference_drops([results[i].subject for i in published],
                                                     [results[i].object for i in published])}
        out["trials"].append(record)
        if len(known) <= len(train) or min(len(val), len(test)) < 2:
            record["skipped"] = (f"{len(known)} known facts with these {len(train)} training facts: too few to test "
                                 f"(the reference needs more known than training facts)")
            continue
        facts = sorted(set(val) | set(test))
        local = {i: j for j, i in enumerate(facts)}
        subjects, objects = [results[i].subject for i in facts], [results[i].object for i in facts]
        templates = [icl_template(base, train, s, start) for s in subjects]
        states = relation_states(lm, templates, subjects, lre_layers, batch_size=cfg.batch_size)
        y = first_token_targets(tok, states.prompts, objects)
        data = RelationData(relation.name, templates, subjects, objects, states.H, states.O, y,
                            Scorer(tok, y, objects, "lre"))
        vi, ti = torch.tensor([local[i] for i in val]), torch.tensor([local[i] for i in test])
        record["model_accuracy"] = float(data.scorer.hits(logits_fn(lm)(states.O[ti]).argmax(-1), ti).double().mean())
        record["test_subjects"] = [subjects[j] for j in ti.tolist()]
        out["test_subjects"] = out["test_subjects"] or record["test_subjects"]      # the first measured trial's
        pair_gen = generator(cfg, relation.name, "lre pairs", k)
        test_pairs = object_pairs(subjects, objects, ti, pair_gen)
        val_pairs = test_pairs if as_published else object_pairs(subjects, objects, vi, pair_gen)
        record["n_test_pairs"] = len(test_pairs[0])
        train_templates = [icl_template(base, train, f.subject, start) for f in train]
        tj = time.perf_counter()
        jac = subject_jacobians(lm, train_templates, [f.subject for f in train], lre_layers,
                                batch_size=cfg.jacobian_batch_size, chunk=cfg.jacobian_chunk, rank=rank,
                                oversample=cfg.jacobian_oversample, seed=cfg.seed)
        log(f"{relation.name}: trial {k}: Jacobians of {len(train)} prompts in {time.perf_counter() - tj:.0f}s")
        train_y = first_token_targets(tok, [fill(t, f.subject)[0] for t, f in zip(train_templates, train)],
                                      [f.object for f in train])
        majority = Counter(train_y.tolist()).most_common(1)[0][0]     # faithfulness control: the training answer
        for layer in lre_layers:
            causal = layer in causal_layers
            data.sequences = {layer: layer_sequences(lm, templates, subjects, layer, batch_size=cfg.batch_size)} \
                if causal and cfg.scoring == FIRST_TOKEN else {}
            got = _lre_trial_layer(lm, data, layer, jac[layer], vi, ti, val_pairs, test_pairs, majority, causal, cfg,
                                   generator(cfg, relation.name, layer, k, "lre controls"))
            ids = [facts[j] for j in ti.tolist()]
            got.update(trial=k, test_ids=ids, pair_ids=[facts[j] for j in test_pairs[0].tolist()],
                       reference_drops=record["reference_drops"])
            per_layer[layer].append(got)
    measured = {layer: trials for layer, trials in per_layer.items() if trials}
    if not measured:
        raise AnalysisError(f"relation {relation.name}: no trial has enough known facts: "
                            + "; ".join(t["skipped"] for t in out["trials"]))
    for layer, trials in measured.items():
        chosen = [{"trial": t["trial"], "beta": t["beta"], "val_faithfulness": t["val_faithfulness"],
                   "test_faithfulness": float(t["faithfulness"].double().mean()), "edit_rank": t.get("edit_rank"),
                   "val_causality": t.get("val_causality"),
                   "test_causality": float(t["causality"]["edit"].double().mean()) if "causality" in t else None}
                  for t in trials]
        faith = _per_fact([(t["test_ids"], t["faithfulness"]) for t in trials], out["selection_note"])
        entry = {"faithfulness": faith.with_nulls(
            {"majority": _per_fact([(t["test_ids"], t["majority"]) for t in trials])}).to_dict(), "chosen": chosen}
        edited = [t for t in trials if "causality" in t]          # trials with edit pairs
        if edited:
            parts = {name: [(t["pair_ids"], t["causality"][name]) for t in edited] for name in EDITS}
            entry["causality"] = causality_json(_per_fact(parts["edit"]), {
                name: _per_fact(parts[name]) for name in CAUSALITY_CONTROLS}, {
                name: _fact_means(got) for name, got in parts.items()})
        kept = [c for c, t in zip(chosen, trials) if not t["reference_drops"]]
        entry["reference_mean"] = {   # the reference's number: the mean of each trial's rate over the trials it keeps
            "faithfulness": sum(c["test_faithfulness"] for c in kept) / len(kept) if kept else None,
            "causality": sum(c["test_causality"] for c in kept) / len(kept) if kept and all(
                c["test_causality"] is not None for c in kept) else None,
            "n_trials": len(kept), "dropped_trials": len(trials) - len(kept)}
        out["layers"][str(layer)] = {"lre": entry}
    score = {layer: sum(t["val_faithfulness"] for t in trials) / len(trials) for layer, trials in measured.items()}
    layer = max(score, key=lambda l: (score[l], -l))          # ties: the first layer, as the reference's max
    by = "mean faithfulness over trials on " + ("the test facts (as published)" if as_published else
                                                 "validation facts (test facts never used)")
    out["selected"]["lre"] = {"layer": layer, "by": by}
    if "causality" in out["layers"][str(layer)]["lre"]:
        out["selected"]["lre"]["causality_layer"] = layer
    accuracies = [t["model_accuracy"] for t in out["trials"] if t["skipped"] is None]
    out["model_accuracy"] = sum(accuracies) / len(accuracies)      # on the test facts: 1 by construction
    if fitted is not None:
        best = max(measured[layer], key=lambda t: t["val_faithfulness"])
        fitted.setdefault(relation.name, {})["lre"] = {**best["fit"], "refit": best["trial"],
                                                        "val_faithfulness": best["val_faithfulness"], "layer": layer}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def decoders_for_relation(lm, relation, results, layers: list[int], lre_layers: list[int], causal_layers: list[int],
                          do_lre: bool, do_ridge: bool, cfg: AnalysisSettings, log: Log, fitted: dict | None = None
                          ) -> dict:
    """Both decoders at every layer for one relation, with the layers chosen on validation (protocol "lre":
    :func:`lre_protocol`, the LRE only).

    ``fitted``, if given, receives ``{relation: {decoder: fit}}``: the decoder at its chosen layer, of the re-fit
    with the best validation faithfulness (ties: the first): W [d_out, d_in] and b [d_out] as applied (o = beta W
    h + b), J [d_out, d_in] the untruncated mean Jacobian whose rank-``edit_rank`` pseudo-inverse makes the edits
    (LRE with a truncated W only), beta, rank, edit_rank, alpha (ridge), refit, layer (``llmprobe.report.notebook``
    saves them)."""
    if cfg.protocol == "lre":
        return lre_protocol(lm, relation, results, lre_layers if do_lre else [], causal_layers, cfg, log, fitted)
    t0 = time.perf_counter()
    facts, context = known_facts_of(relation, results, cfg)
    subjects = [f.subject for f in facts]
    objects = [f.object for f in facts]
    template = icl_template(relation.templates[0], context)
    y = first_token_targets(lm.tokenizer, [fill(template, s)[0] for s in subjects], objects)
    split = relation_split(y, relation.name, cfg)
    states = relation_states(lm, template, subjects, layers, batch_size=cfg.batch_size)
    data = RelationData(relation.name, [template] * len(subjects), subjects, objects, states.H, states.O, y,
                        Scorer(lm.tokenizer, y, objects, cfg.protocol))
    model_hits = data.scorer.hits(logits_fn(lm)(states.O).argmax(-1), torch.arange(len(y)))
    n_known = sum(r.known for r in results)
    out = {
        "template": template, "n_known": n_known, "n_checked": len(results),
        "n_used": len(subjects), "protocol": cfg.protocol, "n_icl": len(context),
        **zero_shot_counts(results, n_known, cfg),
        "model_accuracy": float(model_hits.double().mean()),
        "first_token_collisions": first_token_collisions(y.tolist(), objects),
        "test_subjects": [subjects[i] for i in split.test.tolist()],
        "context_subjects": [f.subject for f in context],
        "n_test_pairs": len(split.test_pairs[0]),
        "refits": [{"jacobian_subjects": [subjects[i] for i in r.jacobian.tolist()], "n_train": len(r.train),
                    "n_val": len(r.val), "n_val_pairs": len(r.val_pairs[0]), "n_selection": len(r.selection),
                    "n_folds": len(r.folds), "n_candidates": len(candidate_grid(cfg))} for r in split.refits],
        "candidates": {"lre": [[beta, rank] for beta, rank in candidate_grid(cfg)],
                       "edit_rank": list(cfg.edit_ranks), "ridge_alpha": list(cfg.ridge_alphas)},
        "layers": {}, "selected": {}, "error": None,
    }
    jac, jac_rows = {}, {}
    if do_lre:
        tj = time.perf_counter()
        union = split.jacobian_union().tolist()
        jac_rows = {i: row for row, i in enumerate(union)}
        rank = jacobian_rank_for(cfg, lm.adapter.d_model, lre_layers, lm.adapter.n_layers)
        jac = subject_jacobians(lm, template, [subjects[i] for i in union], lre_layers,
                                batch_size=cfg.jacobian_batch_size, chunk=cfg.jacobian_chunk, rank=rank,
                                oversample=cfg.jacobian_oversample, seed=cfg.seed)
        out["jacobian_rank"] = rank
        out["jacobian_seconds"] = round(time.perf_counter() - tj, 1)
        log(f"{relation.name}: Jacobians of {len(union)} prompts at layers {lre_layers} in "
            f"{out['jacobian_seconds']}s")
    val_scores: dict[str, dict[int, dict[str, float]]] = {"lre": {}, "ridge": {}}
    for layer in layers:
        causal = layer in causal_layers
        data.sequences = {layer: layer_sequences(lm, data.templates, subjects, layer, batch_size=cfg.batch_size)} \
            if causal and cfg.scoring == FIRST_TOKEN else {}
        entry = {}
        if do_lre and layer in jac:
            entry["lre"], val_scores["lre"][layer] = lre_layer(lm, data, layer, jac[layer], jac_rows, split,
                                                               causal, cfg)
        if do_ridge:
            entry["ridge"], val_scores["ridge"][layer] = ridge_layer(lm, data, layer, split, causal, cfg)
        out["layers"][str(layer)] = entry
    for method, scores in val_scores.items():
        if not scores:
            continue
        sel = {"layer": max(scores, key=lambda l: (scores[l]["faithfulness"], -l)),
               "by": "validation faithfulness, mean over re-fits (test subjects never used)"}
        causal_scores = {l: s["causality"] for l, s in scores.items() if s.get("causality", float("nan")) == s.get(
            "causality")}
        if causal_scores:
            sel["causality_layer"] = max(causal_scores, key=lambda l: (causal_scores[l], -l))
        out["selected"][method] = sel
        if fitted is not None:
            fitted.setdefault(relation.name, {})[method] = {**scores[sel["layer"]]["fit"], "layer": sel["layer"]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------------------ its record
def decoders_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int, cfg: AnalysisSettings,
                      analyses: tuple) -> dict:
    """The work of :func:`decoders_for_relation` over ``relations``, each on its first known facts (as many as
    ``known`` marks known, at most ``cfg.max_subjects``; a relation with fewer than ``cfg.min_known`` or too few to
    split is skipped): "forward" [(batches, blocks)] (its states, then its layer sequences at each LRE layer),
    "jacobian" [its Jacobian prompts] (lre), "edits" [(batches, blocks, LM head)] (its causality edits, cached, at
    each LRE layer), and the CPU fits: "lre_fits", "ridge_fits", "head_rows" (LM-head rows of validation and
    test scoring)."""
    do_lre, do_ridge = "lre" in analyses, "ridge" in analyses
    lre_layers = planned_lre_layers(cfg, layers, n_layers)
    w: dict = {"forward": [], "jacobian": [], "edits": [], "lre_fits": 0, "ridge_fits": 0, "head_rows": 0}
    for rel in relations if do_lre or do_ridge else []:
        template = rel.templates[0]
        n = min(sum(f.known for f in known.get(rel.name, ())), cfg.max_subjects)
        if n < cfg.min_known:
            continue
        facts = rel.facts[:n]
        subjects = [f.subject for f in facts]
        prompts = [template.replace("{}", s, 1) for s in subjects]
        y = first_token_targets(tok, prompts, [f.object for f in facts])
        try:
            split = relation_split(y, rel.name, cfg)
        except AnalysisError:                                                    # too few facts: skipped
            continue
        batches = padded_batches(tok, prompts, cfg.batch_size)
        w["forward"].append((batches, n_layers))                                  # relation_states
        if do_lre:
            union = split.jacobian_union().tolist()
            w["jacobian"].append(jacobian_prompts(tok, template, [subjects[i] for i in union]))
        n_test_pairs = len(split.test_pairs[0])
        for layer in layers:
            for refit in split.refits:
                if do_ridge:
                    w["ridge_fits"] += len(cfg.ridge_alphas) + 1
                    w["head_rows"] += len(cfg.ridge_alphas) * len(refit.val) + 2 * len(split.test)
                if do_lre and layer in lre_layers:
                    w["lre_fits"] += 1
                    w["head_rows"] += 21 * len(refit.val) + len(split.test) * (2 if LEXICAL_LAYER in layers else 1)
        edits = sum(len(cfg.edit_ranks) * len(r.val_pairs[0]) + 3 * n_test_pairs + 2 * n_test_pairs
                    for r in split.refits) + n_test_pairs
        causal = cached_edit_batches(jacobian_prompts(tok, template, subjects), edits, cfg.batch_size) \
            if do_lre else []
        for layer in lre_layers if do_lre else []:                               # causality layers = LRE layers
            w["forward"].append((batches, layer + 1))                            # layer_sequences
            w["edits"] += [(b, n_layers - 1 - layer, head) for b, head in causal]
    return w


def _decoders(job, relation, fits: dict) -> dict:
    return decoders_for_relation(job.lm, relation, job.known.get(relation.name), job.layers, job.lre_layers,
                                 job.causal_layers, job.do_lre, job.do_ridge, job.cfg, job.log, fits)


DECODERS = Analysis("decoders", ("lre", "ridge"), _decoders, decoders_workload, "decoders",
                    claims=("LRE edits causal",), per_relation=True, priced="decoders", result=RelationDecoders)
