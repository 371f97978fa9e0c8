"""Superposition readouts from relation-free subject states, per layer, with controls, and the swap edit through
real forward passes (``docs/measures.md``).

The subjects shared by several relations (the largest group with one ``subject_type``) form a fact table A
[n_subjects, n_relations]; u_a = the unembedding row of attribute a's first token (``attribute_vectors="first"``)
or the mean of its tokens' rows (``"mean"``). ``llmprobe.geometry.superposition_readout`` measures per-relation
readout accuracy and the held-out R^2 of h_s ~ c + sum_r W_r u_{a_r(s)}, beside the shuffled-table control, random
vectors of the true norms (``random_attributes``: the reported effect is the gain over it), the chance rate and
the same architecture with random weights. Relations whose u vectors sit at their subjects' own tokens are
flagged lexical (:func:`is_lexical`) and left out of a second fit, the claim's (:func:`relation_parts`, which also
measures each relation's contribution to the gain). Attributes whose first tokens collide have one u vector with
``"first"``: they are merged into one answer and listed (``merged_attributes``). The same table trains the matched
synthetic controls (:func:`superposition_table` needs only the tokenizer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmprobe.analyses.passes import cached_edit_batches, jacobian_prompts, padded_batches
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.results import SuperpositionResult
from llmprobe.analyses.settings import AnalysisError, AnalysisSettings, Log, planned_lre_layers
from llmprobe.datasets import FactTable
from llmprobe.geometry import (
    SuperpositionFit,
    kfold_indices,
    merge_equal_attributes,
    random_direction_like,
    relation_contributions,
    superposition_readout,
)
from llmprobe.metric import proportion
from llmprobe.model.capture import module_weight
from llmprobe.model.engine import edited_predictions, layer_sequences, next_token_predictions, subject_states
from llmprobe.model.random_init import random_init
from llmprobe.model.scoring import attribute_token_ids, first_token_collisions, first_token_targets
from llmprobe.model.subjects import SubjectNotFoundError, encode, locate_errors


@dataclass
class SuperpositionTable:
    """The shared-subject fact table: ``A`` LongTensor [n_subjects, n_relations] (-1 = no fact) indexing
    ``attributes[r]``; ``relations`` the Relation objects; ``neutral`` the relation-free templates used."""

    subjects: list[str]
    relations: list
    attributes: list[list[str]]
    A: torch.Tensor
    neutral: list[str]
    neutral_dropped: list[str]

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.relations]

    def fact_table(self):
        """As a :class:`llmprobe.datasets.FactTable` (what the matched synthetic controls train on)."""
        return FactTable(list(self.subjects), self.names, [list(a) for a in self.attributes], self.A.clone())


def shared_group(relations) -> list:
    """The largest group of relations with the same subject type (>= 2), else all relations."""
    groups: dict[str, list] = {}
    for rel in relations:
        kind = (rel.properties or {}).get("subject_type")
        if kind:
            groups.setdefault(kind, []).append(rel)
    best = max(groups.values(), key=len, default=[])
    return best if len(best) >= 2 else list(relations)


def subject_at_start(tokenizer, template: str, probe: str = "France") -> bool:
    """Does the subject open the token sequence (no special token before it)? Its state then sits at position
    0, where models without a BOS token keep their attention sink (norms ~100x larger in SmolLM2)."""
    try:
        return int(encode(tokenizer, template, [probe]).subject_first[0]) == 0
    except SubjectNotFoundError:
        return False


def neutral_templates(tokenizer, group, override) -> tuple[list[str], list[str]]:
    """Relation-free templates: ``override``, else those of the group's first relation minus the ones that put
    the subject at position 0 (kept when nothing else is left). Returns (used, dropped)."""
    if override:
        return list(override), []
    templates = list(dict.fromkeys(group[0].neutral_templates)) or ["{}"]
    keep = [t for t in templates if not subject_at_start(tokenizer, t)]
    if not keep:
        return templates, []
    return keep, [t for t in templates if t not in keep]


def _locatable(tokenizer, template: str, subjects: list[str]) -> list[bool]:
    return [error is None for error in locate_errors(tokenizer, template, subjects)]


def superposition_table(tokenizer, relations, known: dict, cfg: AnalysisSettings) -> SuperpositionTable:
    """The fact table the superposition readouts measure (and the matched controls train on)."""
    group = shared_group(relations)
    table = FactTable.from_relations(group, min_relations=2 if len(group) >= 2 else 1)
    neutral, dropped = neutral_templates(tokenizer, group, cfg.neutral_templates)
    ok = torch.tensor([all(_locatable(tokenizer, t, [s])[0] for t in neutral) for s in table.subjects])
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
    return SuperpositionTable([subjects[i] for i in sel.tolist()], [group[r] for r in usable],
                              [table.attributes[r] for r in usable], A[sel][:, usable], neutral, dropped)


def _unembedding(lm) -> torch.Tensor:
    """The LM head's weight [vocab, d] (rows = u vectors of tokens)."""
    head = lm.adapter.lm_head
    if head is None and hasattr(lm.model, "get_output_embeddings"):
        head = lm.model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise AnalysisError("superposition: the model has no LM head weight to take attribute vectors from")
    return module_weight(head).detach().float().cpu()     # (offloaded weights: read from the offload)


def lexical_states(lm, subjects: list[str]) -> torch.Tensor | None:
    """The lexical null's states [n, d]: each subject's static input embedding, the mean of the input-embedding
    rows of its tokens (``" " + subject``, no special token): what a lexical shortcut reads, with no block of the
    transformer run (a tied model's u vectors are these same rows). None for a model without an input embedding
    (``get_input_embeddings``): the null is then not measured."""
    embedding = lm.model.get_input_embeddings() if hasattr(lm.model, "get_input_embeddings") else None
    if embedding is None or not hasattr(embedding, "weight"):
        return None
    weight = module_weight(embedding).detach().float().cpu()
    ids = lm.tokenizer([" " + s for s in subjects], add_special_tokens=False)["input_ids"]
    return torch.stack([weight[t].mean(0) for t in ids])


# The lexical rule (docs/measures.md, "The lexical rule"): Tukey's 1.5 x IQR outlier fences of the two overlaps
# over the 56 bundled relations with >= 20 subjects (13 + 43 LRE) on SmolLM2-135M-Instruct, 2026-12-05: excess
# cosine q3 0.083 + 1.5 x 0.076 = 0.196, shared first token q3 0.042 + 1.5 x 0.042 = 0.104 (both fences fall in
# gaps of the distribution: 0.17-0.27 and 0.10-0.17).
LEXICAL_EXCESS = 0.20   # median cos(u_a(s), E_s) - the same over a permutation of the subjects
LEXICAL_SHARE = 0.10    # share of facts whose attribute's first token is the subject's first token
PARTS_READOUTS = 0.6     # relation_parts at a graded layer (the fit without the lexical relations and each relation's
                         # contribution), in readouts: 2.7 s against 4.7 s of process CPU at SmolLM2's n = 193, d = 576,
                         # R = 6 (random states, one thread, 2026-12-06)


def is_lexical(overlap: dict) -> bool:
    """The lexical rule on one relation's :func:`lexical_overlap` entry: its attribute vectors sit nearer their own
    subjects' token embeddings than other subjects' by more than ``LEXICAL_EXCESS`` (median cosine), or more than
    ``LEXICAL_SHARE`` of its attributes start with the subject's own first token."""
    excess = overlap.get("excess_cosine")
    share = overlap["shared_first_token"] / overlap["n"] if overlap.get("n") else 0.0
    return (excess is not None and excess > LEXICAL_EXCESS) or share > LEXICAL_SHARE


def lexical_overlap(lm, table: SuperpositionTable, U: list[torch.Tensor], E: torch.Tensor,
                    seed: int = 0) -> dict[str, dict]:
    """Per relation, how lexical its facts are: the median cosine between each fact's attribute vector u_a(s)
    and the subject's static embedding E_s (:func:`lexical_states`), the same with the subjects permuted (seeded:
    the cosine any token pair of these kinds has, ``median_cosine_shuffled``), their difference
    (``excess_cosine``), how many facts' attributes share the subject's first token (" " + each), of ``n`` facts,
    and ``lexical`` (:func:`is_lexical`). A relation whose u sit near its subjects' own tokens (a country's
    demonym) can be read from the subject's token alone; the lexical null measures how much."""
    firsts = [ids[0] if ids else None for ids in
              lm.tokenizer([" " + s for s in table.subjects], add_special_tokens=False)["input_ids"]]
    gen = torch.Generator().manual_seed(seed + 29)
    out = {}
    for r, name in enumerate(table.names):
        rows = torch.nonzero(table.A[:, r] >= 0).flatten()
        if not len(rows):
            continue
        attribute_ids = lm.tokenizer([" " + table.attributes[r][int(a)] for a in table.A[rows, r]],
                                     add_special_tokens=False)["input_ids"]
        shared = sum(bool(ids) and ids[0] == firsts[int(i)] for i, ids in zip(rows, attribute_ids))
        out[name] = relation_overlap(U[r][table.A[rows, r]], E[rows], shared, gen)
    return out


def relation_overlap(u: torch.Tensor, E: torch.Tensor, shared: int, gen: torch.Generator) -> dict:
    """One relation's :func:`lexical_overlap` entry from its m facts' attribute vectors u [m, d] and their subjects'
    static embeddings E [m, d] (row i: fact i), ``shared`` of them with the subject's first token; ``gen`` draws
    the permutation of the baseline."""
    u, E = u.double(), E.double()
    cosine = torch.nn.functional.cosine_similarity(u, E, dim=1).median()
    shuffled = torch.nn.functional.cosine_similarity(u, E[torch.randperm(len(E), generator=gen)], dim=1).median()
    entry = {"median_cosine": round(float(cosine), 4), "median_cosine_shuffled": round(float(shuffled), 4),
             "excess_cosine": round(float(cosine - shuffled), 4), "shared_first_token": int(shared), "n": len(E)}
    return {**entry, "lexical": is_lexical(entry)}


def attribute_vectors(lm, attributes: list[list[str]], how: str) -> tuple[list[torch.Tensor], list[int]]:
    """Per relation, u vectors [n_attr, d] of its attributes, and how many attributes share a first token."""
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


def merged_attributes(table: SuperpositionTable, U: list[torch.Tensor]) -> dict[str, list[list[str]]]:
    """Per relation, the groups of attributes with one u vector (colliding first tokens), which every readout
    measures as one answer (``merge_equal_attributes``); relations without a merge are left out."""
    _, _, maps = merge_equal_attributes(table.A, U)
    out = {}
    for name, attrs, new in zip(table.names, table.attributes, maps):
        groups = [[attrs[i] for i in torch.nonzero(new == j).flatten().tolist()] for j in range(int(new.max()) + 1)]
        if any(len(g) > 1 for g in groups):
            out[name] = [g for g in groups if len(g) > 1]
    return out


def superposition(lm, table: SuperpositionTable, layers: list[int], swap_layers: list[int], cfg: AnalysisSettings,
                  log: Log, graded_layers: list[int] | None = None) -> dict:
    """Readouts, R^2 and (at ``swap_layers``) swap edits per layer: JSON-ready dict of typed metrics; at
    ``graded_layers`` (default: every layer) also :func:`relation_parts` (the fit without the lexical relations
    and each relation's contribution)."""
    graded_layers = layers if graded_layers is None else graded_layers
    t0 = time.perf_counter()
    subjects, A, names = table.subjects, table.A, table.names
    U, collisions = attribute_vectors(lm, table.attributes, cfg.attribute_vectors)
    log(f"superposition: {len(subjects)} subjects x {len(names)} relations, states at {len(layers)} layers")
    H = subject_states(lm, table.neutral, subjects, layers, batch_size=cfg.batch_size)
    lexical = lexical_states(lm, subjects)
    null_H, U_c = None, None
    if cfg.random_control:
        rlm = random_init(lm, seed=cfg.seed + 12345)
        null_H = subject_states(rlm, table.neutral, subjects, layers, batch_size=cfg.batch_size)
        U_c, _ = attribute_vectors(rlm, table.attributes, cfg.attribute_vectors)
        del rlm
    out = {
        "relations": names, "subjects": len(subjects), "n_facts": int((A >= 0).sum()),
        "facts": cfg.superposition_facts, "neutral_templates": table.neutral,
        "neutral_templates_dropped": table.neutral_dropped,
        "attribute_vectors": ("unembedding row of the attribute's first token (' ' + attribute)"
                              if cfg.attribute_vectors == "first" else
                              "mean of the unembedding rows of the attribute's tokens (' ' + attribute)"),
        "n_attributes": {nm: len(a) for nm, a in zip(names, table.attributes)},
        "first_token_collisions": dict(zip(names, collisions)),
        "merged_attributes": merged_attributes(table, U),
        "lexical_null": ("each subject's static input embedding (the mean of its tokens' rows, ' ' + subject), "
                         "read with the model's u vectors: what the subject's tokens alone give") if lexical is not None
        else "not measured: the model has no input embedding",
        "lexical_overlap": lexical_overlap(lm, table, U, lexical, cfg.seed) if lexical is not None else {},
        "layers": {}, "error": None,
    }
    out["lexical_relations"] = [nm for nm in names if out["lexical_overlap"].get(nm, {}).get("lexical")]
    out["graded_layers"] = [layer for layer in layers if layer in graded_layers]
    for layer in layers:
        nulls = {**({"random_init": (null_H[layer], U_c)} if null_H is not None else {}),
                 **({"lexical": lexical} if lexical is not None else {})}
        rep = superposition_readout(H[layer], A, U, nulls=nulls, relation_names=names, k=cfg.folds,
                                    seed=cfg.seed, n_boot=cfg.n_boot, decode=False,
                                    jackknife_groups=cfg.jackknife_groups)
        r2 = r2_entry(rep)
        readout = {}
        for nm in names:
            m = rep.measure("readout_acc", nm, primary="random_attributes")
            if m is None:
                continue
            entry = m.to_dict()
            entry["chance"] = rep.conditions["real"]["chance"][nm].value
            entry["margins"] = {c: x["readout_acc"][nm].to_dict() for c, x in rep.margins.items()
                                if x["readout_acc"][nm] is not None}
            entry["gain"] = entry["margins"].get("random_attributes")
            readout[nm] = entry
        entry = {"r2": r2, "readout": readout, "alpha_per_fold": rep.conditions["real"]["alpha_per_fold"]}
        if layer in graded_layers:
            entry.update(relation_parts(H[layer], A, U, nulls, names, out["lexical_relations"], rep, cfg))
        if layer in swap_layers:
            entry["swap"] = swap(lm, table, U, H[layer], layer, cfg)
        out["layers"][str(layer)] = entry
        log(f"superposition: layer {layer} done (R^2 {r2['value']:.3f}, random_attributes "
            f"{r2['nulls']['random_attributes']['value']:.3f}, shuffled {r2['nulls']['shuffled']['value']:.3f})")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def r2_entry(rep) -> dict:
    """The R^2 of a :func:`llmprobe.geometry.superposition_readout` report as the analysis records it: the metric
    (primary null random_attributes), its paired ``margins`` over every null, and ``gain`` (the one over
    random_attributes)."""
    r2 = rep.measure("r2", primary="random_attributes").to_dict()
    r2["margins"] = {c: m["r2"].to_dict() for c, m in rep.margins.items()}
    r2["gain"] = r2["margins"]["random_attributes"]
    return r2


def relation_parts(H: torch.Tensor, A: torch.Tensor, U: list[torch.Tensor], nulls: dict, names: list[str],
                   lexical: list[str], rep, cfg: AnalysisSettings) -> dict:
    """At one layer (H [n, d], the table A [n, R], U, the readout's ``nulls`` and its report ``rep``):

    * ``r2_non_lexical``: the R^2 of the same readout over the relations not in ``lexical`` (:func:`is_lexical`)
      with every null (the random-init model's u vectors taken for the same relations), its margins and gain, and
      ``relations``; absent when no relation is lexical, None when every one is;
    * ``contributions``: per relation, the gain over random_attributes without its term (``gain_without``) and
      ``contribution`` = the gain with every relation - that (``llmprobe.geometry.relation_contributions``: at
      the alphas the readout chose, paired jackknife), what the relation's term adds to the line's effect."""
    fit = {"k": cfg.folds, "seed": cfg.seed, "n_boot": cfg.n_boot, "decode": False,
           "jackknife_groups": cfg.jackknife_groups, "readouts": False}
    out: dict = {}
    keep = [r for r, nm in enumerate(names) if nm not in lexical]
    if lexical:
        out["r2_non_lexical"] = None
        if keep:
            sub = {name: ((ctrl[0], [ctrl[1][r] for r in keep]) if isinstance(ctrl, tuple) else ctrl)
                   for name, ctrl in nulls.items()}
            part = superposition_readout(H, A[:, keep], [U[r] for r in keep], nulls=sub,
                                         relation_names=[names[r] for r in keep], **fit)
            out["r2_non_lexical"] = {**r2_entry(part), "relations": [names[r] for r in keep]}
    contributions = relation_contributions(
        H, A, U, {c: rep.conditions[c]["alpha_per_fold"] for c in ("real", "random_attributes")}, k=cfg.folds,
        seed=cfg.seed, jackknife_groups=cfg.jackknife_groups, relation_names=names)
    if contributions:
        out["contributions"] = contributions
    return out


def swap(lm, table: SuperpositionTable, U: list[torch.Tensor], H: torch.Tensor, layer: int,
         cfg: AnalysisSettings) -> dict:
    """Swap edit h + W_r (u_a' - u_a) (``SuperpositionFit.swap_edit``, fitted without the edited subject) through
    real forward passes on relation prompts: success = relation r's next token becomes a''s first token;
    others_unchanged = another relation's answer stays. Items: the edits (n); controls: a random direction of the
    same norm, at every scale of ``swap_scales``."""
    tok = lm.tokenizer
    subjects, A, attributes = table.subjects, table.A, table.attributes
    n, R = A.shape
    gen = torch.Generator().manual_seed(cfg.seed + 11)
    templates = [r.templates[0] for r in table.relations]
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
    rand = random_direction_like(deltas, gen)
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
    preds = edited_predictions(lm, (t_r + t_q + t_r + t_q) * len(scales), subj * 4 * len(scales), layer,
                               torch.cat(edit_sets), resume * 2 * len(scales), batch_size=cfg.batch_size)
    m = len(edits)
    preds = preds.view(len(scales), 4, m)

    def measured(p):  # p [4, m]: edit read on r, edit read on q, random read on r, random read on q
        return {"success": proportion((p[0] == target).double().tolist()).with_nulls(
                    {"random_direction": proportion((p[2] == target).double().tolist())}).to_dict(),
                "others_unchanged": proportion((p[1] == clean_q).double().tolist()).with_nulls(
                    {"random_direction": proportion((p[3] == clean_q).double().tolist())}).to_dict()}
    norm_ratio = float((deltas.double().norm(dim=1) / H[torch.tensor(idx)].double().norm(dim=1)).mean())
    return {
        "by_scale": [{"scale": scale, **measured(preds[k])} for k, scale in enumerate(scales)],
        "n_edits": m, "n_subjects": len(set(idx)), "edit_norm_ratio": norm_ratio,
    }


# ------------------------------------------------------------------------------------------------ its record
def superposition_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                           cfg: AnalysisSettings, analyses: tuple) -> dict:
    """The work of :func:`superposition` on :func:`superposition_table`: "states" [(rows, tokens)] (each neutral
    template's states, the model's and its random twin's), "readouts" (one fit per layer, and
    :data:`PARTS_READOUTS` of one at each graded layer for :func:`relation_parts`) of "readout_subjects", and at each swap layer
    (the LRE layers) its swap edits, cached ("edits" [(batches, blocks, LM head)]), the clean answers and the
    layer sequences ("forward" [(batches, blocks)]). Nothing when the relations share too few subjects."""
    w: dict = {"states": [], "edits": [], "forward": [], "readouts": 0, "readout_subjects": 0}
    try:
        table = superposition_table(tok, relations, known, cfg)
    except AnalysisError:
        return w
    subjects = table.subjects
    graded = planned_lre_layers(cfg, layers, n_layers) if "lre" in analyses else layers    # as _superposition's
    w["readouts"] = len(layers) + PARTS_READOUTS * len(graded)
    w["readout_subjects"] = len(subjects)
    for template in table.neutral:                                              # the model and its random twin
        neutral = [template.replace("{}", s, 1) for s in subjects]
        w["states"] += padded_batches(tok, neutral, cfg.batch_size * 2) * 2
    R = len(table.relations)
    m = min(cfg.max_swap_subjects, len(subjects)) * R                          # swap edits (at most)
    swap_templates = [table.relations[i % R].templates[0] for i in range(m)]
    swap_subjects = [subjects[i % len(subjects)] for i in range(m)]
    sample = padded_batches(tok, [t.replace("{}", s, 1) for t, s in zip(swap_templates, swap_subjects)],
                            cfg.batch_size)
    swapped = cached_edit_batches(jacobian_prompts(tok, swap_templates, swap_subjects), m * 4 * len(cfg.swap_scales),
                                  cfg.batch_size)
    for layer in planned_lre_layers(cfg, layers, n_layers):
        w["edits"] += [(b, n_layers - 1 - layer, head) for b, head in swapped]
        w["forward"].append((sample, n_layers))                                 # clean answers
        w["forward"].append((sample, layer + 1))                                # layer_sequences
    return w


def _superposition(job) -> dict:
    # the claim's R^2 is graded at the layer the LRE decoders chose (one of the LRE layers); at every layer when
    # the decoders do not run
    return superposition(job.lm, superposition_table(job.lm.tokenizer, job.relations, job.known, job.cfg),
                         job.layers, job.swap_layers, job.cfg, job.log,
                         graded_layers=job.lre_layers if job.do_lre else job.layers)


SUPERPOSITION = Analysis("superposition", ("superposition",), _superposition, superposition_workload,
                         "superposition", claims=("attributes linearly decodable",
                                                  "subject states a superposition of attribute vectors"),
                         priced="superposition", result=SuperpositionResult)
