"""Benchmark: the decodable line's tests calibrated on planted answers at the real run's sample sizes.

The embedded SmolLM2-135M-Instruct's superposition table (193 subjects x 6 relations), its u vectors and its
subjects' static token embeddings, as ``benchmarks/calibration.py`` loads them. Two parts
(``llmprobe.jobs.calibration``):

* the readout's testability: relation 0 replaced by a random map onto k answers, planted with the other five
  relations, its cross-fitted readout graded against shuffled and lexical; the fraction graded supported per k
  sets ``llmprobe.report.claims.READOUT_MAX_ANSWERS_PER_SUBJECT``;
* the line's worlds (a planted linear code on top of the subjects' tokens; the code of a shuffled table; the
  tokens carrying the code with nothing added after block 0; the token embeddings alone), each relation graded by
  the readout (5 folds, the 20-group jackknife) and by LRE faithfulness at the SmolLM2 run's known facts and test
  subjects (``LRE_SIZES``), Bonferroni over ``--family`` tests: power where the claim holds, false-positive rate
  where it fails, per test, per relation (the better of the two) and for the line (the median relation).

    python benchmarks/calibration_decodable.py                      # snr 1 and 0.25, 5 replicates (~10 min, 1 core)
    python benchmarks/calibration_decodable.py --snr 1 --replicates 2 --out runs/calibration_decodable.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.jobs.calibration import (
    DECODABLE_FAMILY,
    calibrate_decodable,
    decodable_worlds,
    finish,
    format_decodable_rows,
    format_testability_rows,
    progress,
    readout_testability,
    smollm2_table,
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snr", type=float, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--replicates", type=int, default=5)
    parser.add_argument("--answers", type=int, nargs="+", default=[24, 64, 96, 112, 128, 144, 160, 193],
                        help="answers of the testability sweep's relation (0: skip the sweep)")
    parser.add_argument("--family", type=int, default=DECODABLE_FAMILY,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 28 with the LRE "
                             "tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    lm, cfg, table, U, E = smollm2_table()
    U, E = [u.double() for u in U], E.double()
    names = list(table.names)
    print(f"{lm.info.get('name')}: {len(table.subjects)} subjects x {len(names)} relations ({', '.join(names)}), "
          f"d = {E.shape[1]}; {args.replicates} replicates, Bonferroni over {args.family} tests", flush=True)
    done = progress(t, lambda row: f"{row.get('world', row.get('answers'))} {row.get('relation', '')}")
    sweep = [row for snr in args.snr for row in readout_testability(
        table.A, U, E, names, [k for k in args.answers if k], snr, max(2, args.replicates // 2), args.family,
        cfg.folds, cfg.jackknife_groups, on_row=done)] if any(args.answers) else []
    worlds = [w for snr in args.snr for w in decodable_worlds(snr) if w.kind != "tokens"]
    worlds += [w for w in decodable_worlds(args.snr[0]) if w.kind == "tokens"]
    rows = calibrate_decodable(worlds, table.A, U, E, names, args.replicates, family=args.family, folds=cfg.folds,
                               jackknife_groups=cfg.jackknife_groups,
                               on_row=lambda row: done(row) if row["relation"] == "line" else None)
    if sweep:
        print("The readout's testability (relation 0 a random map onto k answers):")
        print(format_testability_rows(sweep))
    return finish({"testability": sweep, "worlds": rows}, format_decodable_rows(rows), t, args.out)


if __name__ == "__main__":
    main()
