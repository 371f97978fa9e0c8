"""Benchmark: low-rank LRE Jacobians against exact ones, on every bundled relation, in one run.

For each relation (known facts of the embedded SmolLM2-135M, the default analysis settings, LRE only, at the
layers the default ``llmprobe run`` fits LREs at), the same decoders are fitted and scored with

* exact Jacobians (``--jacobian-rank full``: d_model backward passes per prompt), and
* low-rank estimates at each K in ``--measured`` (``llmprobe.model.lre.subject_jacobians(rank=K)``: the real products
  through the model, timed), and at each K in ``--emulated`` computed from the exact Jacobians by the same
  algorithm on the dense matrices (numerically the same estimator with other random test vectors; used where
  running it would cost more than the exact Jacobian: at d = 576 with 3 layers, K >= 128).

Printed: per K, the Jacobian seconds of the analyses pass and their ratio to exact (one pass each, in turn: a
change of load between them shows up here; the interleaved measurement at the end, median of rounds, wall and CPU
seconds, is the speed-up to quote), the error of the
mean Jacobian W against the exact one (||W_K - W|| / ||W - W_K*|| where W_K* is the best rank-K approximation),
and faithfulness and causality at each relation's LRE layers: mean over items, and the paired difference
(low-rank - exact) over the same test items with a percentile bootstrap interval, pooled over relations and
layers (items are test subjects / test pairs; pooling ignores that items of one relation share a W).

    python benchmarks/jacobian_rank.py --threads 2 --out docs/jacobian_rank.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from llmprobe.analyses import decoders as dec_module  # noqa: E402
from llmprobe.analyses.settings import (  # noqa: E402
    Log,
    pick_layers,
    settings_from,  # noqa: E402
)
from llmprobe.checks import parse_layers  # noqa: E402
from llmprobe.datasets import Relation, load_relations  # noqa: E402
from llmprobe.io import write_json  # noqa: E402
from llmprobe.jobs.probe import fitting, locatable  # noqa: E402
from llmprobe.metric import paired_difference  # noqa: E402
from llmprobe.model.known import known_facts  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402
from llmprobe.model.lre import JacobianResult, subject_jacobians  # noqa: E402


def lowrank_from_dense(jac: JacobianResult, rank: int, oversample: int, seed: int) -> JacobianResult:
    """The low-rank estimator of ``llmprobe.model.lre._lowrank_rows`` applied to dense per-prompt Jacobians:
    P = orth(J^T G), Q = orth(J P), J ~ Q (Q^T J)."""
    J = jac.J.double()
    n, d_out, d_in = J.shape
    k = rank + oversample
    G = torch.randn(d_out, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    P = torch.linalg.qr(J.transpose(1, 2) @ G).Q
    Q = torch.linalg.qr(J @ P).Q
    return JacobianResult(H=jac.H, O=jac.O, U=Q.float(), Vt=(Q.transpose(1, 2) @ J).float(), rank=rank)


class Recorder:
    """Wraps subject_jacobians and lre_layer of the decoders module: keeps each relation's Jacobians and the
    per-item hits behind each faithfulness and causality metric."""

    def __init__(self):
        self.variant, self.relation, self.exact = None, None, {}
        self.jacobians, self.items, self.seconds = {}, {}, {}
        self.real_jacobians, self.real_summary = dec_module.subject_jacobians, dec_module._summary
        self.real_lre_layer = dec_module.lre_layer
        dec_module.subject_jacobians, dec_module.lre_layer = self.subject_jacobians, self.lre_layer

    def subject_jacobians(self, lm, template, subjects, layers, **kw):
        kind, K = self.variant
        t = time.perf_counter()
        if kind == "emulated":
            got = {l: lowrank_from_dense(j, K, kw["oversample"], kw["seed"] + l)
                   for l, j in self.exact[self.relation].items()}
        else:
            got = self.real_jacobians(lm, template, subjects, layers, **{**kw, "rank": K})
        self.seconds[(self.variant, self.relation)] = time.perf_counter() - t
        if K is None:
            self.exact[self.relation] = got
        self.jacobians[(self.variant, self.relation)] = got
        return got

    def lre_layer(self, lm, data, layer, jac, jac_rows, split, causal, cfg):
        seen = []

        def summary(per_refit, note=None):
            seen.append(torch.stack([h.double() for h in per_refit]).mean(0))
            return self.real_summary(per_refit, note)
        dec_module._summary = summary
        try:
            entry, scores = self.real_lre_layer(lm, data, layer, jac, jac_rows, split, causal, cfg)
        finally:
            dec_module._summary = self.real_summary
        # call order inside lre_layer: faithfulness, majority, then (causal) edit, random direction, operator
        self.items[(self.variant, self.relation, layer)] = {"faithfulness": seen[0],
                                                            "causality": seen[2] if len(seen) > 2 else None}
        return entry, scores


def w_error(exact: JacobianResult, low: JacobianResult, K: int) -> tuple[float, float]:
    """(||W_low - W|| / ||W||, ||W_low - W|| / ||W - W_K*||) for the mean over all prompts."""
    W = exact.W.double()
    U, S, Vh = torch.linalg.svd(W)
    best = (U[:, :K] * S[:K]) @ Vh[:K]
    err = float((low.W.double() - W).norm())
    return err / float(W.norm()), err / float((W - best).norm())


def timing(lm, relations, layers: list[int], ranks: list[int], rounds: int, n_prompts: int = 9) -> list[dict]:
    """Exact and low-rank Jacobians of the same prompts (each relation's first template and first ``n_prompts``
    subjects, the size of a relation's Jacobian union), interleaved over ``rounds`` rounds so that a change of
    load hits every variant alike: median wall and CPU seconds (this process, all threads) per variant."""
    from statistics import median

    variants = [None] + ranks
    wall = {r: [] for r in variants}
    cpu = {r: [] for r in variants}
    for _ in range(rounds):
        for rank in variants:
            w, c = time.perf_counter(), time.process_time()
            for relation in relations:
                subjects = [f.subject for f in relation.facts[:n_prompts]]
                subject_jacobians(lm, relation.templates[0], subjects, layers, batch_size=16, chunk=96, rank=rank)
            wall[rank].append(time.perf_counter() - w)
            cpu[rank].append(time.process_time() - c)
    base_w, base_c = median(wall[None]), median(cpu[None])
    return [{"rank": r, "wall_s": round(median(wall[r]), 1), "cpu_s": round(median(cpu[r]), 1),
             "speedup_wall": round(base_w / median(wall[r]), 2), "speedup_cpu": round(base_c / median(cpu[r]), 2)}
            for r in variants]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default="32,64", help="ranks run through the model (comma list)")
    parser.add_argument("--emulated", default="128,256", help="ranks computed from the exact Jacobians")
    parser.add_argument("--relations", nargs="*", default=None, help="default: every bundled relation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--timing-rounds", type=int, default=3,
                        help="interleaved rounds of the speed measurement (exact and each --measured rank)")
    parser.add_argument("--timing-relations", type=int, default=3, help="relations in the speed measurement")
    parser.add_argument("--timing-only", action="store_true", help="only the interleaved speed measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    measured = [int(k) for k in args.measured.split(",") if k]
    emulated = [int(k) for k in args.emulated.split(",") if k]
    variants = [("exact", None)] + [("measured", k) for k in measured] + [("emulated", k) for k in emulated]

    t0 = time.perf_counter()
    lm = load_model()
    n_layers = lm.adapter.n_layers
    layers = pick_layers(parse_layers("every:3", n_layers), 3, n_layers)     # the default run's LRE layers
    if args.timing_only:
        return {"timing": print_timing(lm, layers, measured, args)}
    relations, known = [], {}
    for relation in load_relations(args.relations):
        fit, _ = fitting(lm, relation)
        facts, _ = locatable(lm, Relation(relation.name, relation.templates, relation.neutral_templates, fit,
                                          relation.properties, relation.source))
        if facts:
            located = Relation(relation.name, relation.templates, relation.neutral_templates, facts,
                               relation.properties, relation.source)
            relations.append(located)
            known[relation.name] = known_facts(lm, located)
    print(f"model and known facts: {time.perf_counter() - t0:.0f}s", flush=True)
    rec = Recorder()
    log = Log(False)
    entries = {}
    for variant in variants:
        cfg = settings_from(jacobian_rank="full" if variant[1] is None else variant[1])
        for relation in relations:
            rec.variant, rec.relation = variant, relation.name
            try:
                entries[(variant, relation.name)] = dec_module.decoders_for_relation(
                    lm, relation, known[relation.name], layers, layers, layers, True, False, cfg, log)
            except ValueError as error:          # too few known facts: skipped in every variant alike
                entries[(variant, relation.name)] = {"error": str(error)}
        print(f"{variant}: done at {time.perf_counter() - t0:.0f}s", flush=True)

    names = [r.name for r in relations if entries[(variants[0], r.name)].get("error") is None]
    exact_s = sum(rec.seconds[(variants[0], n)] for n in names)
    rows = []
    for variant in variants:
        kind, K = variant
        seconds = sum(rec.seconds[(variant, n)] for n in names)
        row = {"variant": kind, "rank": K, "jacobian_seconds": round(seconds, 1),
               "speedup": round(exact_s / seconds, 2) if kind != "emulated" else None}
        if K is not None:
            errs = [w_error(rec.exact[n][l], rec.jacobians[(variant, n)][l], K) for n in names for l in layers]
            row["W_rel_error"] = round(sum(e[0] for e in errs) / len(errs), 3)
            row["W_error_over_best"] = round(sum(e[1] for e in errs) / len(errs), 3)
        for measure in ("faithfulness", "causality"):
            mine, base = [], []
            for n in names:
                for l in layers:
                    a = rec.items.get((variant, n, l), {}).get(measure)
                    b = rec.items.get((variants[0], n, l), {}).get(measure)
                    if a is not None and b is not None:
                        mine += a.tolist()
                        base += b.tolist()
            row[measure] = round(sum(mine) / len(mine), 3) if mine else None
            row[f"n_{measure}"] = len(mine)
            if K is not None and mine:
                diff = paired_difference(mine, base, n_boot=2000, seed=0)
                row[f"{measure}_diff"] = [round(diff.value, 3), round(diff.ci[0], 3), round(diff.ci[1], 3)]
        rows.append(row)
    print(f"\nSmolLM2-135M, {len(names)} relations, LRE layers {layers}, {time.perf_counter() - t0:.0f}s in all; "
          f"torch threads {args.threads}")
    print(f"{'jacobians':<16}{'seconds':>9}{'speed-up':>10}{'W err':>8}{'/best':>7}{'faith':>7}"
          f"{'diff [95% CI]':>24}{'causal':>8}{'diff [95% CI]':>24}")
    for r in rows:
        name = "exact" if r["rank"] is None else f"K={r['rank']} ({r['variant']})"

        def diff(m):
            d = r.get(f"{m}_diff")
            return f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" if d else ""
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        print(f"{name:<16}{r['jacobian_seconds']:>9.1f}{speed:>10}{r.get('W_rel_error', 0):>8.3f}"
              f"{r.get('W_error_over_best', 0):>7.3f}{r['faithfulness']:>7.3f}{diff('faithfulness'):>24}"
              f"{r['causality'] if r['causality'] is not None else float('nan'):>8.3f}{diff('causality'):>24}")
    result = {"model": "SmolLM2-135M-Instruct", "relations": names, "layers": layers, "rows": rows,
              "threads": args.threads, "timing": print_timing(lm, layers, measured, args),
              "seconds": round(time.perf_counter() - t0, 1)}
    if args.out:
        write_json(args.out, result)
    return result


def print_timing(lm, layers: list[int], ranks: list[int], args) -> list[dict]:
    relations = load_relations(args.relations)[:args.timing_relations]
    rows = timing(lm, relations, layers, ranks, args.timing_rounds)
    print(f"\nspeed, interleaved: {len(relations)} relations x 9 prompts, layers {layers}, median of "
          f"{args.timing_rounds} rounds, torch threads {args.threads}")
    print(f"{'jacobians':<12}{'wall s':>9}{'CPU s':>9}{'speed-up wall':>15}{'speed-up CPU':>14}")
    for r in rows:
        name = "exact" if r["rank"] is None else f"K={r['rank']}"
        print(f"{name:<12}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}{r['speedup_wall']:>14.2f}x{r['speedup_cpu']:>13.2f}x")
    return rows


if __name__ == "__main__":
    main()
