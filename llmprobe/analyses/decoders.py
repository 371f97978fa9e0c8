"""Linear relation decoders on a model's known facts, per relation and layer (``docs/measures.md``).

* **LRE** (Hernandez et al. 2023): W = mean Jacobian d o / d h over the re-fit's Jacobian prompts, o_hat =
  beta W_k h + b. Faithfulness: test subjects whose ``adapter.logits(o_hat)`` top token is the object's (control:
  the training majority answer). Causality, as in the reference: for a test pair (s, t), h_s -> h_s +
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
over its n test items); the spread is the standard deviation over re-fits.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, Log
from llmprobe.analyses.splits import Refit, RelationSplit, candidate_grid, generator, relation_split
from llmprobe.geometry import LinearRelationDecoder, RidgeDecoder, random_direction_like, random_spectrum_factors
from llmprobe.metric import Metric, proportion
from llmprobe.model.lre import (
    JacobianResult,
    jacobian_cost,
    layer_sequences,
    logits_fn,
    next_token_predictions,
    relation_states,
    subject_jacobians,
)
from llmprobe.model.scoring import first_token_collisions, first_token_targets, sequence_logprobs
from llmprobe.names import FIRST_TOKEN, SEQUENCE

FULL_PATCH_NOTE = ("reference, not a bound: h_s replaced by h_t (an edit can exceed it); does not depend on the "
                   "fit: measured once")
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


class Scorer:
    """Hits of predicted next tokens against objects: the exact first token (protocol "strict") or the LRE
    reference's rule (protocol "lre": the decoded token, stripped and lower-cased, is a non-empty prefix of the
    object)."""

    def __init__(self, tokenizer, y: torch.Tensor, objects: list[str], protocol: str):
        self.tokenizer, self.y, self.objects, self.protocol = tokenizer, y, objects, protocol
        self._text: dict[int, str] = {}

    def _decoded(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token]).strip().lower()
        return self._text[token]

    def hits(self, predicted: torch.Tensor, objects: torch.Tensor) -> torch.Tensor:
        """predicted [m] token ids, objects [m] indices of the facts whose object is the target -> Bool [m]."""
        if self.protocol == "strict":
            return predicted.cpu() == self.y[objects]
        return torch.tensor([bool(t := self._decoded(int(p))) and self.objects[i].strip().lower().startswith(t)
                             for p, i in zip(predicted.tolist(), objects.tolist())], dtype=torch.bool)


@dataclass
class RelationData:
    name: str
    template: str
    subjects: list[str]
    objects: list[str]
    H: dict[int, torch.Tensor]
    O: torch.Tensor
    y: torch.Tensor
    scorer: Scorer
    sequences: dict[int, list] = field(default_factory=dict)   # clean states per prompt at the causal layers


def known_facts_of(relation, results, cfg: AnalysisSettings) -> list:
    """The relation's known facts (the first ``max_subjects``), or an AnalysisError naming it."""
    if results is None:
        raise AnalysisError(f"relation {relation.name}: no known-facts results were given for it")
    facts = [r for r in results if r.known]
    if len(facts) < cfg.min_known:
        raise AnalysisError(f"relation {relation.name}: {len(facts)} known facts of {len(results)} checked; the "
                            f"decoders need at least {cfg.min_known}")
    return facts[:cfg.max_subjects]


def icl_prefix(template: str, subjects: list[str], objects: list[str]) -> str:
    """In-context examples of the "lre" protocol: one filled template and its object per line."""
    return "".join(template.replace("{}", s, 1) + " " + o.strip() + "\n" for s, o in zip(subjects, objects))


def causality_hits(lm, data: RelationData, layer: int, deltas: list[torch.Tensor], src: torch.Tensor,
                   tgt: torch.Tensor, cfg: AnalysisSettings) -> list[torch.Tensor]:
    """Hits [m] of each edit set (deltas [m, d] added to h_src at ``layer``) on the pairs (src, tgt): one batched
    run of real forward passes for all sets."""
    if not len(src):
        return [torch.zeros(0, dtype=torch.bool) for _ in deltas]
    k = len(deltas)
    subjects = [data.subjects[i] for i in src.tolist()] * k
    delta = torch.cat(deltas).float()
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
        hits = data.scorer.hits(pred, tgt.repeat(k))
    return list(hits.view(k, -1))


def _summary(per_refit: list[torch.Tensor], note: str | None = None) -> Metric:
    """Per-item hits of each re-fit on the same items -> proportion (mean over re-fits per item), spread over
    re-fits."""
    stacked = torch.stack([h.double() for h in per_refit])                         # [n_refits, n_items]
    return proportion(stacked.mean(0).tolist(), refits=stacked.mean(1).tolist(), note=note)


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


def _lre_decoder(beta: float, W: torch.Tensor, H: torch.Tensor, O: torch.Tensor, fit: torch.Tensor,
                 reference_bias: torch.Tensor | None) -> LinearRelationDecoder:
    """o_hat = beta W h + b with W [d_out, d_in] as given (already truncated) and b fitted on the subjects ``fit``,
    or the reference's bias [d_out] where given (protocol "lre")."""
    dec = LinearRelationDecoder(beta=beta).fit(H[fit], O[fit], W)
    if reference_bias is not None:
        dec.operator_.b = reference_bias
    return dec


def cv_faithfulness(data: RelationData, H: torch.Tensor, O: torch.Tensor, refit: Refit,
                    truncated: dict[int | None, torch.Tensor], grid: list[tuple[float, int | None]],
                    reference_bias: torch.Tensor | None, to_logits) -> torch.Tensor:
    """Cross-validated faithfulness [len(grid)] of every (beta, rank) candidate: each of the re-fit's selection
    subjects is scored by a decoder fitted on train + validation without its fold (one head call a candidate)."""
    everyone = torch.cat([refit.train, refit.val])
    scored = torch.cat(refit.folds)
    rates = []
    for beta, rank in grid:
        o_hat = torch.cat([_lre_decoder(beta, truncated[rank], H, O, everyone[~torch.isin(everyone, fold)],
                                        reference_bias).predict(H[fold]) for fold in refit.folds])
        rates.append(data.scorer.hits(to_logits(o_hat).argmax(-1), scored).double().mean())
    return torch.stack(rates)


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
    names = ("edit", "random_direction", "random_operator", "scaled_patch")
    faith, majority, hits = [], [], {name: [] for name in names}
    chosen, val_f, val_c, fits = [], [], [], []
    for k, refit in enumerate(split.refits):
        rows = [jac_rows[i] for i in refit.jacobian.tolist()]
        svd = SVD(*jac.svd(rows))
        truncated = {rank: svd.truncated(rank) for rank in cfg.ranks}
        reference_bias = (O[refit.jacobian] - jac.apply(rows, H[refit.jacobian])).mean(0) \
            if cfg.protocol == "lre" else None     # the reference's bias: the mean of o_i - J_i h_i
        scores = cv_faithfulness(data, H, O, refit, truncated, grid, reference_bias, to_logits)
        best = int(scores.argmax())              # ties: the first candidate (full rank first, then the smaller beta)
        beta, rank = grid[best]
        everyone = torch.cat([refit.train, refit.val])
        dec = _lre_decoder(beta, truncated[rank], H, O, everyone, reference_bias)
        val_f.append(float(scores[best]))
        faith.append(data.scorer.hits(to_logits(dec.predict(H[test])).argmax(-1), test))
        majority.append(_majority_hits(data, everyone, test))
        record = {"beta": beta, "rank": rank, "val_faithfulness": val_f[-1], "n_candidates": len(grid),
                  "n_selection": len(refit.selection), "n_folds": len(refit.folds)}
        if causal and len(ts):
            vs, vt = refit.val_pairs
            if len(vs):
                cand = [(O[vt] - O[vs]) @ svd.pinv(r).T for r in cfg.edit_ranks]
                rates = [float(h.double().mean()) for h in causality_hits(lm, data, layer, cand, vs, vt, cfg)]
                r_best = max(range(len(rates)), key=lambda i: (rates[i], i))           # ties: the larger rank
            else:
                rates, r_best = [], len(cfg.edit_ranks) - 1
            edit_rank = cfg.edit_ranks[r_best]
            edits = lre_edits(H, O, ts, tt, svd, edit_rank, generator(cfg, data.name, layer, k, "lre controls"))
            for name, got in zip(names, causality_hits(lm, data, layer, [edits[n] for n in names], ts, tt, cfg)):
                hits[name].append(got)
            val_c.append(rates[r_best] if rates else float("nan"))
            record.update({"edit_rank": edit_rank, "val_causality": rates[r_best] if rates else None,
                           "edit_norm_ratio": float((edits["edit"].norm(dim=1) / H[ts].norm(dim=1)).mean())})
        chosen.append(record)
        fits.append({"W": dec.operator_.W, "b": dec.operator_.b, "J": svd.W if rank is not None else None,
                     "W_factors": svd.factors(rank), "J_factors": svd.factors(None) if rank is not None else None,
                     "beta": beta, "rank": rank, "edit_rank": record.get("edit_rank"), "refit": k,
                     "val_faithfulness": val_f[-1]})
    entry = {"faithfulness": _summary(faith).with_controls({"majority": _summary(majority)}).to_dict(),
             "chosen": chosen}
    scores = {"faithfulness": sum(val_f) / len(val_f), "fit": max(fits, key=lambda f: f["val_faithfulness"])}
    if hits["edit"]:
        full = causality_hits(lm, data, layer, [H[tt] - H[ts]], ts, tt, cfg)[0]
        controls = {name: _summary(hits[name]) for name in names[1:]}
        controls["full_patch"] = proportion(full.double().tolist(), note=FULL_PATCH_NOTE)
        entry["causality"] = _summary(hits["edit"]).with_controls(controls, "random_direction").to_dict()
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
    entry = {"faithfulness": _summary(faith).with_controls({"shuffled": _summary(shuffled),
                                                           "majority": _summary(majority)}).to_dict(),
             "chosen": chosen}
    if edit:
        entry["causality"] = _summary(edit, note="full-rank pseudo-inverse of the ridge W").with_controls(
            {"random_direction": _summary(rdir), "scaled_patch": _summary(spatch)}).to_dict()
    return entry, {"faithfulness": sum(val_f) / len(val_f), "fit": max(fits, key=lambda f: f["val_faithfulness"])}


def decoders_for_relation(lm, relation, results, layers: list[int], lre_layers: list[int], causal_layers: list[int],
                          do_lre: bool, do_ridge: bool, cfg: AnalysisSettings, log: Log, fitted: dict | None = None
                          ) -> dict:
    """Both decoders at every layer for one relation, with the layers chosen on validation.

    ``fitted``, if given, receives ``{relation: {decoder: fit}}``: the decoder at its chosen layer, of the re-fit
    with the best validation faithfulness (ties: the first): W [d_out, d_in] and b [d_out] as applied (o = beta W
    h + b), J [d_out, d_in] the untruncated mean Jacobian whose rank-``edit_rank`` pseudo-inverse makes the edits
    (LRE with a truncated W only), beta, rank, edit_rank, alpha (ridge), refit, layer (``llmprobe.report.notebook``
    saves them)."""
    t0 = time.perf_counter()
    facts = known_facts_of(relation, results, cfg)
    subjects = [f.subject for f in facts]
    objects = [f.object for f in facts]
    base = relation.templates[0]
    y_base = first_token_targets(lm.tokenizer, [base.replace("{}", s, 1) for s in subjects], objects)
    split = relation_split(y_base, relation.name, cfg, n_context=cfg.n_icl if cfg.protocol == "lre" else 0)
    template = base
    if cfg.protocol == "lre":
        ctx = split.context.tolist()
        template = icl_prefix(base, [subjects[i] for i in ctx], [objects[i] for i in ctx]) + base
    states = relation_states(lm, template, subjects, layers, batch_size=cfg.batch_size)
    y = first_token_targets(lm.tokenizer, states.prompts, objects)
    data = RelationData(relation.name, template, subjects, objects, states.H, states.O, y,
                        Scorer(lm.tokenizer, y, objects, cfg.protocol))
    model_hits = data.scorer.hits(logits_fn(lm)(states.O).argmax(-1), torch.arange(len(y)))
    out = {
        "template": template, "n_known": sum(r.known for r in results), "n_checked": len(results),
        "n_used": len(subjects), "protocol": cfg.protocol,
        "model_accuracy": float(model_hits.double().mean()),
        "first_token_collisions": first_token_collisions(y.tolist(), objects),
        "test_subjects": [subjects[i] for i in split.test.tolist()],
        "context_subjects": [subjects[i] for i in split.context.tolist()],
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
        data.sequences = {layer: layer_sequences(lm, template, subjects, layer, batch_size=cfg.batch_size)} \
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
