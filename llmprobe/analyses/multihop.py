"""Multi-hop recall on the pretrained model, with and without chain-of-thought (``docs/measures.md``, "Multi-hop
recall on the pretrained model").

A composition is declared by its first relation (``properties.composed_templates``, ``prompts/SCHEMA.md``): a key
``"country_capital"`` (or ``"company_hq_country/country_capital"`` for k = 3) names the relations that follow, its
value the question templates with the first subject's slot. Items are chains s -> b_1 -> ... -> a whose every
hop the model knows (its known facts of each hop relation). For each item, with ``FEW_SHOT`` example chains
before it (true chains of the same composition, never an item):

* ``direct``: ``Q: <question>\\nA:`` after examples answered directly; hit = the greedy next token is the
  answer's first token;
* ``cot``: the examples state each bridge first (``A: <hop 1 statement> b_1. <hop 2 statement> a.``, each
  statement the hop relation's first template); the model completes each hop statement greedily, its own bridge
  goes into the next statement, and the last one is scored like ``direct``;
* ``ceiling``: the same chain-of-thought prompt with the true bridges (the last hop given the true bridge);
* ``wrong_bridge``: the ceiling's prompt with another item's bridges of the same composition whose answer's first
  token differs (a seeded choice; chains with no such item are counted in ``n_without_wrong_bridge``), scored on
  the chain's own answer (a model that composes in the longer prompt and ignores its bridge keeps it) and, as
  ``wrong_bridge_follows``, on the other item's answer (the model follows the bridge);
* ``latent_bridge``: whether each bridge is linearly decodable from the direct prompt's last-token states
  (``blocks.{l}.resid_post``), with the superposition readout's estimator (ridge into the unembedding rows of
  the bridges' first tokens, nearest by cosine; cross-fitted over items), beside shuffled labels and the
  random-init model. No selection is made (every layer is reported).
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch

from llmprobe.analyses.passes import empty_passes, generation_batches, padded_batches
from llmprobe.analyses.record import Analysis
from llmprobe.analyses.results import MultihopResult
from llmprobe.analyses.settings import AnalysisSettings, Log
from llmprobe.analyses.splits import generator
from llmprobe.analyses.superposition import attribute_vectors
from llmprobe.geometry import ALPHA_GRID, RelationReadout, kfold_indices
from llmprobe.metric import paired_difference, proportion
from llmprobe.model.batching import run_batched
from llmprobe.model.capture import capture
from llmprobe.model.engine import logits_fn, output_name, state_name
from llmprobe.model.known import greedy_continuations, is_known
from llmprobe.model.random_init import random_init
from llmprobe.model.scoring import first_token_targets

FEW_SHOT = 2                # example chains before each prompt
MAX_ITEMS = 16              # known chains per composition
MIN_ITEMS = 2               # fewer known chains: the composition is listed as skipped
RANDOM_SEED = 12345         # the random-init control: the superposition analysis' model (seed + this)
_END = re.compile(r"[.\n,]")


@dataclass
class Composition:
    """Relations ``hops`` (k of them) composed; ``question`` a template with the first subject's slot."""

    hops: list
    question: str

    @property
    def name(self) -> str:
        return "/".join(r.name for r in self.hops)


@dataclass
class Chain:
    """s -> bridges[0] -> ... -> answer."""

    subject: str
    bridges: list[str]
    answer: str


def compositions(relations) -> list[Composition]:
    """The compositions the relations declare whose every hop is among ``relations``."""
    by_name = {r.name: r for r in relations}
    out = []
    for rel in relations:
        for key, templates in ((rel.properties or {}).get("composed_templates") or {}).items():
            rest = key.split("/")
            if all(n in by_name for n in rest) and templates:
                out.append(Composition([rel] + [by_name[n] for n in rest], templates[0]))
    return out


def chains(comp: Composition, facts: dict[str, dict[str, str]]) -> list[Chain]:
    """Every chain through ``facts`` ({relation: {subject: object}}), in the first relation's fact order."""
    out = []
    for subject in facts.get(comp.hops[0].name, {}):
        path, x = [], subject
        for rel in comp.hops:
            x = facts.get(rel.name, {}).get(x)
            if x is None:
                break
            path.append(x)
        if len(path) == len(comp.hops):
            out.append(Chain(subject, path[:-1], path[-1]))
    return out


def statement(rel, subject: str) -> str:
    return rel.templates[0].replace("{}", subject, 1)


def reasoning(comp: Composition, chain: Chain) -> str:
    """``<hop 1 statement> b_1. ... <hop k statement> a.``"""
    inputs, outputs = [chain.subject] + chain.bridges, chain.bridges + [chain.answer]
    return " ".join(f"{statement(h, x)} {y}." for h, x, y in zip(comp.hops, inputs, outputs))


def _question(comp: Composition, subject: str) -> str:
    return "Q: " + comp.question.replace("{}", subject, 1) + "\nA:"


def prompts_for(comp: Composition, examples: list[Chain], chain: Chain) -> dict[str, str]:
    """The direct prompt and the chain-of-thought prefix (up to ``A:``) of ``chain`` after ``examples``."""
    direct = "".join(f"{_question(comp, ex.subject)} {ex.answer}\n\n" for ex in examples)
    cot = "".join(f"{_question(comp, ex.subject)} {reasoning(comp, ex)}\n\n" for ex in examples)
    return {"direct": direct + _question(comp, chain.subject), "cot": cot + _question(comp, chain.subject)}


def last_token(lm, prompts: list[str], layers: list[int], batch_size: int = 32,
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Greedy next token after each prompt (LongTensor [n]) and the states ``blocks.{l}.resid_post`` at its last
    token ({layer: [n, d]}, float32 CPU); left-padded batches."""
    tok, out = lm.tokenizer, output_name(lm.model)
    names = list(dict.fromkeys([state_name(l) for l in layers] + [out]))
    to_logits = logits_fn(lm)

    def run(part: slice):
        saved, tok.padding_side = tok.padding_side, "left"
        try:
            batch = tok(prompts[part], return_tensors="pt", padding=True)
        finally:
            tok.padding_side = saved
        last = torch.full((batch["input_ids"].shape[0], 1), batch["input_ids"].shape[1] - 1)
        got = capture(lm.model, names, batch["input_ids"], batch["attention_mask"], positions=last)
        return to_logits(got[out][:, 0]).argmax(-1), {l: got[state_name(l)][:, 0].float() for l in layers}

    parts = run_batched(run, len(prompts), batch_size, stage="multihop prompts", lm=lm, prompts=prompts)
    return torch.cat([p[0] for p in parts]), {l: torch.cat([p[1][l] for p in parts]) for l in layers}


def bridge_budget(tok, names: list[str]) -> int:
    return min(8, 1 + max(len(tok(" " + n, add_special_tokens=False)["input_ids"]) for n in names))


def bridge_partners(groups: list, answers: list, gen: random.Random) -> list[int | None]:
    """Per item, another item of the same group (composition) whose answer differs (``answers``: anything
    comparable, e.g. the answers' first token ids), drawn by ``gen`` in the items' order; None where every other
    item of its group has the same answer."""
    out = []
    for i, (group, answer) in enumerate(zip(groups, answers)):
        others = [j for j, (g, a) in enumerate(zip(groups, answers)) if g == group and a != answer]
        out.append(gen.choice(others) if others else None)
    return out


def ceiling_prompt(comp: Composition, chain: Chain, prompt: dict[str, str], bridges: list[str] | None = None,
                   answer: str | None = None) -> str:
    """The chain-of-thought prompt of ``chain`` with its hop statements filled in up to the last one's object:
    the true bridges (the ceiling), or ``bridges`` leading to ``answer`` (another chain's: the wrong bridge)."""
    bridges, answer = (chain.bridges, chain.answer) if bridges is None else (bridges, answer)
    said = reasoning(comp, Chain(chain.subject, bridges, answer))
    return prompt["cot"] + " " + said.rsplit(" " + answer + ".", 1)[0]


def wrong_bridge_prompts(tok, rows, ceiling: list[str], cfg: AnalysisSettings
                         ) -> tuple[list[int | None], list[str | None]]:
    """(partner per item, its wrong-bridge prompt) of :func:`item_rows`' rows and their ceiling prompts
    (:func:`ceiling_prompt`): the ceiling's prompt with the bridges of another item of the same composition whose
    answer's first token differs (:func:`bridge_partners`, seeded by the run's seed); None where the composition
    has no such item."""
    first = first_token_targets(tok, ceiling, [c.answer for _, c, _ in rows]).tolist()
    gen = random.Random(generator(cfg, "multihop", "wrong_bridge").initial_seed())
    partners = bridge_partners([comp.name for comp, _, _ in rows], first, gen)
    prompts = [None if j is None else ceiling_prompt(comp, c, p, rows[j][1].bridges, rows[j][1].answer)
               for (comp, c, p), j in zip(rows, partners)]
    return partners, prompts


def multihop(lm, relations, known: dict, layers: list[int], cfg: AnalysisSettings, log: Log) -> dict:
    """Direct, chain-of-thought and ceiling accuracy per composition and pooled per k, and the latent-bridge
    readout per layer (module docstring): JSON-ready dict of typed metrics."""
    t0 = time.perf_counter()
    tok = lm.tokenizer
    comps = compositions(relations)
    out = {"few_shot": FEW_SHOT, "compositions": [], "pooled": {}, "skipped": {}, "latent_bridge": None,
           "scoring": "first token of ' ' + answer after the prompt (greedy next token)",
           "examples": "true chains of the composition (facts of the relations, known or not), never an item",
           "wrong_bridges": "the ceiling's prompt with the bridges of another item of the same composition whose "
                            "answer's first token differs (seeded choice)",
           "note": None, "error": None}
    if not comps:
        out["note"] = "no composition of the relations given (properties.composed_templates, prompts/SCHEMA.md)"
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out
    rows, out["skipped"] = item_rows(comps, relations, known, cfg)
    if not rows:
        out["note"] = f"no composition has {MIN_ITEMS} known chains"
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out
    log(f"multihop: {len(rows)} chains over {len({r[0].name for r in rows})} compositions")
    answers = [c.answer for _, c, _ in rows]
    direct = [p["direct"] for *_, p in rows]
    pred, states = last_token(lm, direct, layers, cfg.batch_size)
    hits = {"direct": pred == first_token_targets(tok, direct, answers)}
    hits.update(_chain_of_thought(lm, rows, cfg))
    for key, (comp_name, k) in {**{c: (c, None) for c in dict.fromkeys(r[0].name for r in rows)},
                                **{f"k={k}": (None, k) for k in sorted({len(r[0].hops) for r in rows})}}.items():
        keep = torch.tensor([(comp_name is None or comp.name == comp_name) and (k is None or len(comp.hops) == k)
                             for comp, _, _ in rows])
        entry = _accuracy({name: h[keep] for name, h in hits.items()}, [a for a, x in zip(answers, keep) if x], cfg)
        if comp_name is not None:
            comp = next(r[0] for r in rows if r[0].name == comp_name)
            out["compositions"].append({"name": comp_name, "hops": [h.name for h in comp.hops], "k": len(comp.hops),
                                        "question": comp.question, **entry})
        else:
            out["pooled"][key] = entry
    out["latent_bridge"] = _latent_bridge(lm, rows, direct, states, layers, cfg, log)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def item_rows(comps: list[Composition], relations, known: dict, cfg: AnalysisSettings
              ) -> tuple[list[tuple[Composition, Chain, dict[str, str]]], dict[str, str]]:
    """The items of every composition: (composition, chain, its prompts) per known chain (at most ``MAX_ITEMS``
    per composition, after ``FEW_SHOT`` examples drawn from its other chains), and the compositions skipped
    (name -> why)."""
    facts = {r.name: {f.subject: f.object for f in r.facts} for r in relations}
    known_facts = {name: {f.subject: f.object for f in rows if f.known} for name, rows in known.items()}
    rows, skipped = [], {}             # (composition, chain, prompts)
    for comp in comps:
        every = chains(comp, facts)
        items = chains(comp, known_facts)
        gen = random.Random(generator(cfg, "multihop", comp.name).initial_seed())
        gen.shuffle(items)
        items = items[:MAX_ITEMS]
        taken = {c.subject for c in items}
        pool = [c for c in every if c.subject not in taken] or every
        if len(items) < MIN_ITEMS or len(pool) < FEW_SHOT:
            skipped[comp.name] = f"{len(items)} known chains (of {len(every)})"
            continue
        examples = gen.sample(pool, FEW_SHOT)
        items = [c for c in items if c not in examples]
        rows += [(comp, c, prompts_for(comp, examples, c)) for c in items]
    return rows, skipped


def _chain_of_thought(lm, rows, cfg: AnalysisSettings) -> dict[str, torch.Tensor]:
    """Hits of the chain-of-thought prompt (the model's own bridges), of the ceiling (the true bridges), of every
    bridge the model states ({"cot", "ceiling", "cot_bridges"}: BoolTensors [n]) and of the wrong-bridge prompt
    (:func:`wrong_bridge_prompts`) on the chain's answer and on the wrong bridge's answer ({"wrong_bridge",
    "wrong_bridge_follows"}: float64 [n], NaN where the chain has no wrong bridge)."""
    tok = lm.tokenizer
    texts = [p["cot"] + " " + statement(comp.hops[0], c.subject) for comp, c, p in rows]
    bridges_right = torch.ones(len(rows), dtype=torch.bool)
    for step in range(max(len(comp.hops) for comp, _, _ in rows) - 1):
        todo = [i for i, (comp, _, _) in enumerate(rows) if len(comp.hops) > step + 1]
        names = [rows[i][1].bridges[step] for i in todo]
        said = greedy_continuations(lm, [texts[i] for i in todo], bridge_budget(tok, names), cfg.batch_size)
        for i, text, true in zip(todo, said, names):
            bridge = _END.split(text, 1)[0].strip() or text.strip()
            bridges_right[i] &= is_known(text, true)
            texts[i] += f" {bridge}. " + statement(rows[i][0].hops[step + 1], bridge)
    answers = [c.answer for _, c, _ in rows]
    ceiling = [ceiling_prompt(comp, c, p) for comp, c, p in rows]
    partners, wrong = wrong_bridge_prompts(tok, rows, ceiling, cfg)
    paired = [i for i, j in enumerate(partners) if j is not None]
    wrong_texts = [wrong[i] for i in paired]
    unique = list(dict.fromkeys(texts + ceiling + wrong_texts))  # a chain of true bridges is its own ceiling
    pred = dict(zip(unique, last_token(lm, unique, [], cfg.batch_size)[0].tolist()))
    cot_pred, ceil_pred, wrong_pred = (torch.tensor([pred[t] for t in x], dtype=torch.long)
                                       for x in (texts, ceiling, wrong_texts))
    out = {"cot": cot_pred == first_token_targets(tok, texts, answers),
           "ceiling": ceil_pred == first_token_targets(tok, ceiling, answers), "cot_bridges": bridges_right}
    for key, said in (("wrong_bridge", [answers[i] for i in paired]),
                      ("wrong_bridge_follows", [answers[partners[i]] for i in paired])):
        out[key] = torch.full((len(rows),), float("nan"), dtype=torch.float64)
        if paired:
            out[key][paired] = (wrong_pred == first_token_targets(tok, wrong_texts, said)).double()
    return out


def _accuracy(hits: dict[str, torch.Tensor], answers: list[str], cfg: AnalysisSettings) -> dict:
    """Typed metrics of one set of items (``hits`` as :func:`_chain_of_thought` gives them, with "direct"):
    direct, cot, ceiling (each with the ``majority`` control: the share of items whose answer is the most common
    one), the bridges stated right, wrong_bridge and wrong_bridge_follows over the items with a wrong bridge (their
    number missing: ``n_without_wrong_bridge``), and the paired differences (cot_minus_wrong_bridge over the items
    with a wrong bridge)."""
    h = {k: v.double().tolist() for k, v in hits.items()}
    top = max(set(answers), key=answers.count)
    majority = proportion([float(a == top) for a in answers])
    out = {"n_items": len(answers)}
    for name in ("direct", "cot", "ceiling"):
        out[name] = proportion(h[name]).with_nulls({"majority": majority}).to_dict()
    out["cot_bridges"] = proportion(h["cot_bridges"]).to_dict()
    out["cot_minus_direct"] = paired_difference(h["cot"], h["direct"], n_boot=cfg.n_boot, seed=cfg.seed).to_dict()
    out["ceiling_minus_cot"] = paired_difference(h["ceiling"], h["cot"], n_boot=cfg.n_boot, seed=cfg.seed).to_dict()
    out["n_without_wrong_bridge"] = int(torch.isnan(hits["wrong_bridge"]).sum())
    for name in ("wrong_bridge", "wrong_bridge_follows"):
        out[name] = proportion(h[name]).to_dict()
    out["cot_minus_wrong_bridge"] = paired_difference(h["cot"], h["wrong_bridge"], n_boot=cfg.n_boot,
                                                      seed=cfg.seed).to_dict()
    return out


def _readout_hits(H: torch.Tensor, y: torch.Tensor, U: torch.Tensor, group: torch.Tensor, folds: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-fitted readout hits and training-majority hits (BoolTensors [n]) of labels y [n] (rows of U) from
    states H [n, d]; the folds split the ``group`` ids [n] (a subject's rows are held out together)."""
    hits = torch.zeros(len(y), dtype=torch.bool)
    majority = torch.zeros(len(y), dtype=torch.bool)
    ids = group.unique()
    for train_ids, test_ids in kfold_indices(len(ids), min(folds, len(ids)), seed):
        train, test = torch.isin(group, ids[train_ids]), torch.isin(group, ids[test_ids])
        readout = RelationReadout(alpha=ALPHA_GRID).fit(H[train], y[train], U)
        hits[test] = readout.predict(H[test]).cpu() == y[test]
        majority[test] = y[test] == readout.majority_
    return hits, majority


def bridges_readable(rows) -> bool:
    """Whether the items' bridges are enough to read out (at least 4 bridges of at least 2 entities)."""
    bridges = [b for _, c, _ in rows for b in c.bridges]
    return len(bridges) >= 4 and len(set(bridges)) >= 2


def _latent_bridge(lm, rows, direct: list[str], states: dict[int, torch.Tensor], layers: list[int],
                   cfg: AnalysisSettings, log: Log) -> dict:
    """Per layer, the readout of every bridge (item x bridge position) from the direct prompt's last-token
    states, cross-fitted over those rows, beside shuffled labels and the random-init model's states."""
    index = [(i, step) for i, (_, c, _) in enumerate(rows) for step in range(len(c.bridges))]
    names = sorted({rows[i][1].bridges[s] for i, s in index})
    if not bridges_readable(rows):
        return {"error": f"{len(index)} bridges of {len(names)} entities: too few to read out"}
    y = torch.tensor([names.index(rows[i][1].bridges[s]) for i, s in index])
    shuffled = y[torch.randperm(len(y), generator=generator(cfg, "multihop", "shuffled"))]
    U = attribute_vectors(lm, [names], cfg.attribute_vectors)[0][0]
    rows_of = torch.tensor([i for i, _ in index])
    subjects = sorted({rows[i][1].subject for i, _ in index})
    group = torch.tensor([subjects.index(rows[i][1].subject) for i, _ in index])
    control = None
    if cfg.random_control:
        rlm = random_init(lm, seed=cfg.seed + RANDOM_SEED)
        control = (last_token(rlm, direct, layers, cfg.batch_size)[1], attribute_vectors(rlm, [names],
                                                                                       cfg.attribute_vectors)[0][0])
        del rlm
    groups = {f"{rows[i][0].name} bridge {s + 1}" for i, s in index}
    out = {"n_rows": len(index), "n_entities": len(names), "n_subjects": len(subjects), "folds": cfg.folds,
           "cross_fitting": "folds over subjects: every row of a held-out subject is held out",
           "place": "blocks.{l}.resid_post at the direct prompt's last token", "layers": {}, "error": None}
    for layer in layers:
        H = states[layer][rows_of].double()
        hits, majority = _readout_hits(H, y, U, group, cfg.folds, cfg.seed)
        null, _ = _readout_hits(H, shuffled, U, group, cfg.folds, cfg.seed)
        controls = {"shuffled": proportion(null.double().tolist()), "majority": proportion(majority.double().tolist())}
        if control is not None:
            rand, _ = _readout_hits(control[0][layer][rows_of].double(), y, control[1], group, cfg.folds, cfg.seed)
            controls["random_init"] = proportion(rand.double().tolist())
        entry = {"readout": proportion(hits.double().tolist()).with_nulls(controls).to_dict(), "by_bridge": {}}
        for name in sorted(groups):
            keep = [f"{rows[i][0].name} bridge {s + 1}" == name for i, s in index]
            entry["by_bridge"][name] = proportion([float(h) for h, k in zip(hits, keep) if k]).to_dict()
        out["layers"][str(layer)] = entry
    log(f"multihop: latent bridge readout at {len(layers)} layers ({len(index)} bridges, {len(names)} entities)")
    return out


# ------------------------------------------------------------------------------------------------ its record
def multihop_workload(tok, relations: list, known: dict, layers: list[int], n_layers: int,
                      cfg: AnalysisSettings, analyses: tuple = ()) -> dict:
    """The passes of ``llmprobe.analyses.multihop.multihop``: the direct prompts (the model and its random
    twin), each bridge generated greedily after the chain-of-thought prompt (to its full budget), and the
    chain-of-thought, ceiling and wrong-bridge prompts' next tokens. The model's own bridges are not known before
    it runs: the true ones stand in for them, and each chain-of-thought prompt is counted apart from its ceiling
    (as when a bridge is wrong)."""
    work = empty_passes()
    rows, _ = item_rows(compositions(relations), relations, known, cfg)
    if not rows:
        return work
    batch = cfg.batch_size
    direct = [p["direct"] for *_, p in rows]
    work["forward"].append((padded_batches(tok, direct, batch), n_layers, True))
    texts = [p["cot"] + " " + statement(comp.hops[0], c.subject) for comp, c, p in rows]
    for step in range(max(len(comp.hops) for comp, _, _ in rows) - 1):
        todo = [i for i, (comp, _, _) in enumerate(rows) if len(comp.hops) > step + 1]
        bridges = [rows[i][1].bridges[step] for i in todo]
        work["generate"] += generation_batches(tok, [texts[i] for i in todo],
                                               [bridge_budget(tok, bridges)] * len(todo), batch)
        for i, bridge in zip(todo, bridges):
            texts[i] += f" {bridge}. " + statement(rows[i][0].hops[step + 1], bridge)
    ceiling = [ceiling_prompt(comp, c, p) for comp, c, p in rows]
    wrong = [t for t in wrong_bridge_prompts(tok, rows, ceiling, cfg)[1] if t is not None]
    work["forward"].append((padded_batches(tok, texts + ceiling + wrong, batch), n_layers, True))
    if cfg.random_control and bridges_readable(rows):
        work["forward"].append((padded_batches(tok, direct, batch), n_layers, True))
        work["twins"] += 1
    return work


def _multihop(job) -> dict:
    return multihop(job.lm, job.relations, job.known, job.layers, job.cfg, job.log)


MULTIHOP = Analysis("multihop", ("multihop",), _multihop, multihop_workload, "multihop",
                    claims=("chain-of-thought breaks the multi-hop bottleneck",), result=MultihopResult)
