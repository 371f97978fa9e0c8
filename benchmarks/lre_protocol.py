"""Benchmark: the LRE reference's protocol (``--protocol lre``) on the bundled LRE dataset, beside the published means.

For each relation of ``--relations`` (default ``lre:all``, the 47 relations of Hernandez et al. 2023) the known
facts are checked as the reference does (per trial, the top-1 token under that trial's in-context prompt a prefix
of the object: ``llmprobe.model.known.known_facts(protocol="lre")``), and the relations with at least one trial of
more known facts than training facts are measured by ``run_analyses(protocol="lre")`` in both selection modes:
``as-published`` (beta, edit rank and layer chosen on the test facts, as the reference's sweep) and ``validation``
(chosen on held-out facts of each trial). Printed per category, the paper's table shape: the mean over relations
of faithfulness and causality at each relation's selected layer, with n = relations (test facts), beside the
published means (GPT-J, GPT-2-XL, LLaMA-13B).

    python benchmarks/lre_protocol.py --relations lre:all --out runs/lre_protocol.json    # embedded SmolLM2
    python benchmarks/lre_protocol.py --table runs/lre_protocol.json     # the table of a saved (partial) run
    python benchmarks/lre_protocol.py --table runs/a.json runs/b.json --markdown   # runs pooled, for the docs
    python benchmarks/lre_protocol.py --layers 15 --modes as-published --revert draw --relations \
        lre:country_capital_city --out runs/draw.json       # one step of as-published put back to before

It sets what it measures: exact Jacobians (``--jacobian-rank``, recorded in every row), as-published on the rows'
text as the reference reads the file (``lre_as_read``; ``--decoded-escapes`` for our reading, validation's);
``--revert`` puts one step of the reference back to what llmprobe did before (``rank``: rank 128; ``escapes``;
``draw``: uniform; ``grid``: the GPT-J grid on every model; ``start``: no start text), to measure that step.

Only relations the model knows enough of are measured, so a category mean here covers fewer relations than the
paper's; the table says how many.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import llmprobe.analyses.decoders as decoders  # noqa: E402
import llmprobe.analyses.splits as splits  # noqa: E402
import llmprobe.model.known as known  # noqa: E402
from llmprobe.analyses.run import run_analyses  # noqa: E402
from llmprobe.checks import parse_layers, read_json  # noqa: E402
from llmprobe.datasets import LRE_CATEGORIES, load_relations, lre_as_read  # noqa: E402
from llmprobe.io import write_json  # noqa: E402
from llmprobe.jobs.probe import locatable  # noqa: E402
from llmprobe.model.known import KNOWN, known_facts  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402

MODES = ("as-published", "validation")
STEPS = ("rank", "escapes", "draw", "grid", "start")     # --revert: a step of the reference put back to before
# published means over each category's relations: (faithfulness, causality), Hernandez et al. 2023
PUBLISHED = {"GPT-J": {"factual": (.644, .720), "linguistic": (.831, .917), "commonsense": (.779, .883),
                       "bias": (.909, .977)},
             "GPT-2-XL": {"factual": (.545, .650)},
             "LLaMA-13B": {"factual": (.603, .672)}}


def measurable(results: list, n_icl: int) -> bool:
    """True when some trial of the known-fact check has more known facts than training facts (the reference's
    condition for testing a trial)."""
    n_draws = len(results[0].draws) if results else 0
    return any(sum(r.draws[k] == KNOWN for r in results) > n_icl for k in range(n_draws))


@contextlib.contextmanager
def shared_jacobians():
    """Within it, ``subject_jacobians`` of the same prompts, layers and options is computed once: the two selection
    modes of a relation draw the same trials (same training facts, same leave-one-out prompts), so the second mode
    reuses the first one's Jacobians (the same tensors, so the same numbers; about a third of a relation's time on
    SmolLM2)."""
    real = decoders.subject_jacobians
    memo: dict = {}

    def once(lm, template, subjects, layer, **options):
        key = (id(lm), template if isinstance(template, str) else tuple(template), tuple(subjects),
               layer if isinstance(layer, int) else tuple(layer), tuple(sorted(options.items())))
        if key not in memo:
            memo[key] = real(lm, template, subjects, layer, **options)
        return memo[key]
    decoders.subject_jacobians = once
    try:
        yield
    finally:
        decoders.subject_jacobians = real


def category(relation) -> str:
    return relation.properties.get("relation_type", "other")


@contextlib.contextmanager
def reverted(steps: tuple[str, ...]):
    """Within it, the protocol steps named (of ``draw``, ``grid``, ``start``; ``rank`` and ``escapes`` are options
    of :func:`measure`) do what llmprobe did before it followed the reference: a uniform draw of the training facts,
    the GPT-J grid on every model, no start text."""
    saved = [(known, "context_draws", known.context_draws), (splits, "context_draws", splits.context_draws),
             (decoders, "reference_family", decoders.reference_family),
             (known, "reference_start", known.reference_start), (decoders, "reference_start", decoders.reference_start)]
    real_draws = known.context_draws
    if "draw" in steps:
        known.context_draws = splits.context_draws = lambda n, k, d, seed, name, objects=None: real_draws(
            n, k, d, seed, name)
    if "grid" in steps:
        decoders.reference_family = lambda lm: "default"
    if "start" in steps:
        known.reference_start = decoders.reference_start = lambda tokenizer: ""
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def measure(lm, relations: list, layers: list[int], n_icl: int = 5, n_splits: int = 3, seed: int = 0,
            options: dict | None = None, log=print, out_path: str | None = None, max_facts: int | None = None,
            modes: tuple[str, ...] = MODES, literal: bool = True, revert: tuple[str, ...] = (),
            resume: bool = False) -> dict:
    """Known facts and the selection ``modes`` of every relation: {"relations": {name: {category, n_rows (checked),
    n_rows_file, n_known per trial, measured, jacobian_rank, modes: {mode: relation entry}}}, "seconds"};
    ``max_facts`` keeps the first rows of a longer relation; as published on the rows' text as the reference reads
    it (``literal``: ``lre_as_read``, its known facts checked apart where that text differs); ``revert``: steps put
    back to before (:data:`STEPS`); written to ``out_path`` (atomically) after every relation, so a long run that
    is stopped keeps the relations it finished, and ``resume`` starts from them (ValueError when ``out_path``
    holds a run of other settings: its rows would not pool). Options default to exact Jacobians (``jacobian_rank="full"``;
    ``revert`` "rank": 128)."""
    t0 = time.perf_counter()
    options = {"jacobian_rank": "full", **(options or {}), **({"jacobian_rank": 128} if "rank" in revert else {})}
    literal = literal and "escapes" not in revert
    out: dict = {"relations": {}, "layers": layers, "n_icl": n_icl, "n_splits": n_splits,
                 "jacobian_rank": options["jacobian_rank"], "literal": literal, "revert": list(revert)}
    if resume and out_path and os.path.exists(out_path):
        before = read_json(out_path)
        differ = [k for k in ("layers", "n_icl", "n_splits", "jacobian_rank", "literal", "revert")
                  if before.get(k) != out[k]]
        if differ:
            raise ValueError(f"{out_path} holds a run of other settings ({', '.join(differ)} differ); resume it "
                             f"with its own settings or write to another --out")
        out["relations"] = {name: entry for name, entry in before["relations"].items()
                            if not entry["measured"] or set(modes) <= set(entry["modes"])}
        t0 -= before.get("seconds") or 0
        log(f"resuming {out_path}: {len(out['relations'])} relations done")
    for relation in relations:
        if relation.name in out["relations"]:
            continue
        n_file = len(relation.facts)
        if max_facts:
            relation = relation.with_facts(relation.facts[:max_facts])
        facts, _ = locatable(lm, relation)
        relation = relation.with_facts(facts)
        texts = {mode: lre_as_read(relation) if literal and mode == "as-published" else relation for mode in modes}
        with reverted(revert):
            checked = {id(r): (r, known_facts(lm, r, protocol="lre", n_icl=n_icl, n_draws=n_splits, seed=seed))
                       for r in texts.values()}
        first = checked[id(texts[modes[0]])][1]
        entry = {"category": category(relation), "n_rows": len(first), "n_rows_file": n_file,
                 "n_known": [sum(r.draws[k] == KNOWN for r in first)        # none: too few rows for a trial
                             for k in range(len(first[0].draws) if first else 0)],
                 "measured": any(measurable(res, n_icl) for _, res in checked.values()),
                 "jacobian_rank": options["jacobian_rank"], "as_read_rows": sum(
                     f != g for f, g in zip(relation.facts, lre_as_read(relation).facts)), "modes": {}}
        out["relations"][relation.name] = entry
        log(f"{relation.name}: known per trial {entry['n_known']} of {len(first)} rows")
        if entry["measured"]:
            with shared_jacobians(), reverted(revert):     # both modes: the same trials, so the same Jacobians
                for mode in modes:
                    rel, results = checked[id(texts[mode])]
                    got = run_analyses(lm, [rel], {rel.name: results}, layers, analyses=("lre",),
                                       seed=seed, n_splits=n_splits, progress=False, protocol="lre", n_icl=n_icl,
                                       lre_selection=mode, lre_layers=tuple(layers), **options)
                    entry["modes"][mode] = got["relations"][rel.name]
        out["seconds"] = round(time.perf_counter() - t0, 1)
        if out_path:
            write_json(out_path, out)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _at_selected_layer(entry: dict) -> dict | None:
    """The ``lre`` block of one relation entry at its selected layer (None where not measured)."""
    sel = (entry.get("selected") or {}).get("lre")
    if entry.get("error") or sel is None:
        return None
    return entry["layers"][str(sel["layer"])]["lre"]


def selected(entry: dict) -> tuple[float | None, int, float | None, int]:
    """(faithfulness, n, causality, n) of one relation entry at its selected layer (None where not measured)."""
    lre = _at_selected_layer(entry)
    if lre is None:
        return None, 0, None, 0
    causal = lre.get("causality") or {}
    return lre["faithfulness"]["value"], lre["faithfulness"]["n"], causal.get("value"), causal.get("n", 0)


def primary_nulls(entry: dict) -> tuple[float | None, float | None]:
    """(faithfulness's majority null, causality's random-direction null) at the selected layer: what always
    answering the training facts' most common object, and a step of the edit's norm in a random direction, score
    on the same facts (None where not measured)."""
    lre = _at_selected_layer(entry)
    if lre is None:
        return None, None
    majority = lre["faithfulness"]["nulls"]["majority"]["value"]
    causal = lre.get("causality")
    return majority, causal["nulls"]["random_direction"]["value"] if causal else None


def table(measured: dict) -> list[list[str]]:
    """Rows of the printed table: per category (and all), per mode, the mean over measured relations of
    faithfulness and causality, with n relations (test facts / test pairs), then the mean of each relation's
    margin over its primary null (faithfulness - majority, causality - random direction: a relation whose known
    facts share one object scores high on both and shows ~0 here), beside the published means (which are
    values, not margins)."""
    rows = [["category", "mode", "faithfulness (n rel., n facts)", "causality (n rel., n pairs)",
             "F - majority", "C - random dir.", *(f"{model} F / C" for model in PUBLISHED)]]
    for cat in (*LRE_CATEGORIES, "all"):
        entries = [e for e in measured["relations"].values() if cat in ("all", e["category"])]
        for mode in MODES:
            chosen = [e["modes"][mode] for e in entries if mode in e["modes"]]
            values = [(selected(e), primary_nulls(e)) for e in chosen]
            faith = [(f, n) for (f, n, _, _), _ in values if f is not None]
            causal = [(c, n) for (_, _, c, n), _ in values if c is not None]
            faith_margin = [f - m for (f, _, _, _), (m, _) in values if f is not None]
            causal_margin = [c - r for (_, _, c, _), (_, r) in values if c is not None]

            def mean(pairs):
                if not pairs:
                    return "-"
                return (f"{sum(v for v, _ in pairs) / len(pairs):.3f} ({len(pairs)}, "
                        f"{sum(n for _, n in pairs)})")
            published = [" / ".join(f"{v:.3f}" for v in PUBLISHED[m][cat]) if cat in PUBLISHED[m] else "-"
                         for m in PUBLISHED]
            margins = [f"{sum(v) / len(v):.3f}" if v else "-" for v in (faith_margin, causal_margin)]
            rows.append([cat, mode, mean(faith), mean(causal), *margins, *published])
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def merge(runs: list[dict]) -> dict:
    """Several saved runs (``--out`` files) as one: their relations pooled (a relation measured twice: the later
    file's), seconds summed; ValueError when they differ in layers, N or trials (their numbers would not pool)."""
    settings = {(tuple(r["layers"]), r["n_icl"], r["n_splits"]) for r in runs}
    if len(settings) != 1:
        raise ValueError(f"these runs differ in (layers, n_icl, trials): {sorted(settings)}; pool only runs of the "
                         f"same settings")
    relations: dict = {}
    for run in runs:
        relations.update(run["relations"])
    return {**runs[0], "relations": relations, "seconds": round(sum(r.get("seconds") or 0 for r in runs), 1)}


def relation_rows(measured: dict) -> list[str]:
    """One markdown row per relation, in the order measured: rows, known per trial, each mode's faithfulness vs
    its majority null / causality vs its random-direction null (n distinct test facts) at the selected layer,
    seconds of both modes."""
    def cell(entry: dict) -> str:
        f, n, c, _ = selected(entry)
        if f is None:
            return "-"
        majority, random = primary_nulls(entry)
        causal = "-" if c is None else f"{c:.3f} vs {random:.3f}"
        return f"{f:.3f} vs {majority:.3f} / {causal} ({n})"
    lines = ["| relation | category | rows | known per trial | as published: F vs majority / C vs random dir. "
             "(n facts) | validation: the same | s | J |", "|---|---|---|---|---|---|---|---|"]
    for name, e in measured["relations"].items():
        modes = e.get("modes") or {}
        cells = [cell(modes[m]) if m in modes else "not measurable" for m in MODES]
        seconds = round(sum(m.get("seconds") or 0 for m in modes.values()))
        rows = e["n_rows"] if e.get("n_rows_file", e["n_rows"]) == e["n_rows"] else \
            f"{e['n_rows']} of {e['n_rows_file']}"
        rank = e.get("jacobian_rank", 128)           # runs before exact Jacobians were recorded: rank 128
        lines.append(f"| {name} | {e['category']} | {rows} | {', '.join(map(str, e['n_known'])) or '-'} | "
                     f"{' | '.join(cells)} | {seconds} | {'exact' if rank in ('full', None) else rank} |")
    return lines


def coverage(measured: dict) -> list[str]:
    """Per category: relations measured of the bundled ones (checked), and the bundled relations not run."""
    lines = []
    for cat in LRE_CATEGORIES:
        bundled = [r.name for r in load_relations(f"lre:{cat}")]
        checked = [n for n in bundled if n in measured["relations"]]
        done = [n for n in checked if measured["relations"][n]["measured"]]
        missing = [n for n in bundled if n not in measured["relations"]]
        lines.append(f"* {cat}: {len(done)} measured of {len(bundled)} ({len(checked)} checked); not run: "
                     f"{', '.join(missing) or 'none'}")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model name or folder (default: the embedded SmolLM2)")
    parser.add_argument("--relations", nargs="+", default=["lre:all"])
    parser.add_argument("--layers", default="every:3", help="LRE layers: all | every:K | a comma list")
    parser.add_argument("--n-icl", type=int, default=5, help="training facts per trial (the reference's N)")
    parser.add_argument("--trials", type=int, default=3, help="trials per relation (the reference's 3)")
    parser.add_argument("--max-facts", type=int, default=None, help="keep the first N rows of each relation")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="write every relation's entries here (JSON, after each one)")
    parser.add_argument("--resume", action="store_true",
                        help="with --out: keep the relations that file holds (same settings) and measure the rest")
    parser.add_argument("--table", nargs="+", default=None,
                        help="print the table of saved --out files, pooled (measure nothing)")
    parser.add_argument("--markdown", action="store_true",
                        help="with --table: also each relation's row and the coverage by category (markdown)")
    parser.add_argument("--jacobian-rank", default="full", help="full (exact, the reference's) or a rank K")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--decoded-escapes", action="store_true",
                        help="as published on our reading of the rows (escapes decoded, spaces stripped)")
    parser.add_argument("--revert", nargs="+", choices=STEPS, default=[],
                        help="put these steps of the reference back to what llmprobe did before, to measure them")
    args = parser.parse_args(argv)
    if args.table:
        measured = merge([read_json(path) for path in args.table])
        print(format_table(table(measured)))
        print(f"({measured['seconds']} s; layers {measured['layers']}; relations measured: "
              f"{sum(e['measured'] for e in measured['relations'].values())} of {len(measured['relations'])})")
        if args.markdown:
            print("\n" + "\n".join(relation_rows(measured)) + "\n\n" + "\n".join(coverage(measured)))
        return measured
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    relations = load_relations(args.relations)
    layers = [l for l in parse_layers(args.layers, lm.adapter.n_layers) if l != lm.adapter.n_layers - 1]
    rank = args.jacobian_rank if args.jacobian_rank == "full" else int(args.jacobian_rank)
    measured = measure(lm, relations, layers, args.n_icl, args.trials, options={"jacobian_rank": rank},
                       out_path=args.out, max_facts=args.max_facts, modes=tuple(args.modes),
                       literal=not args.decoded_escapes, revert=tuple(args.revert), resume=args.resume)
    print(format_table(table(measured)))
    print(f"({measured['seconds']} s; layers {layers}; relations measured: "
          f"{sum(e['measured'] for e in measured['relations'].values())} of {len(measured['relations'])})")
    return measured


if __name__ == "__main__":
    main()
