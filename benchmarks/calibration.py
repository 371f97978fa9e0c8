"""Benchmark: the superposition line's measure calibrated on planted answers at the real run's sample sizes.

The embedded SmolLM2-135M-Instruct's superposition table (the bundled relations' shared subjects, every fact:
193 subjects x 6 relations), its u vectors (unembedding rows of the attributes' first tokens) and its subjects'
static token embeddings (``llmprobe.analyses.superposition.lexical_states``). On those shapes, worlds where the
claim holds by construction (an exact planted superposition of the named u vectors, alone and on top of the
subjects' token embeddings) and where it fails (the superposition of a shuffled table; the token embeddings
alone), each measured by ``superposition_readout`` (5 folds, the 20-group jackknife) over ``--replicates`` draws
and graded by the report's verdict rule with Bonferroni over ``--family`` tests (the SmolLM2 report's Holm family
size), against the nulls the line had before the lexical null and with it
(``llmprobe.jobs.calibration``). Printed per world: R^2, its gains over random_attributes and lexical, and
the fraction graded supported and supported-or-weak under each null set (power where the claim holds,
false-positive rate where it fails).

    python benchmarks/calibration.py                           # snr 0.25 and 1, 10 replicates (~25 min, 1 core)
    python benchmarks/calibration.py --snr 0.5 --replicates 4 --out runs/calibration.json

``--minimal-effect``: the line's minimal effect from the planted negatives instead, on the relations the claim
is graded on (those the lexical rule of ``llmprobe.analyses.superposition`` does not flag): per negative world
(the shuffled table at each ``--snr``, the subjects' token embeddings alone) its R^2 gain over random_attributes
in each replicate and the 95% quantile; the minimal effect is the largest of these (``minimal_effect``); then
the table above on those relations, graded with it (power where the claim holds).

    python benchmarks/calibration.py --minimal-effect --snr 0.25 1 4 --replicates 10   # ~9 min, 1 core, loaded
    python benchmarks/calibration.py --minimal-effect --snr 0.25 1 4 --replicates 40   # the full table
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.analyses.superposition import (  # noqa: E402
    lexical_overlap,
)
from llmprobe.jobs.calibration import (
    calibrate,
    finish,
    format_rows,
    minimal_effect,
    null_gains,
    progress,  # noqa: E402
    smollm2_table,
    superposition_worlds,
)
from llmprobe.report.claims import MIN_EFFECT, SUPERPOSITION  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snr", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--replicates", type=int, default=10)
    parser.add_argument("--family", type=int, default=20,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--minimal-effect", action="store_true",
                        help="derive the minimal effect from the negatives on the non-lexical relations first")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    lm, cfg, table, U, E = smollm2_table()
    A = table.A
    if args.minimal_effect:
        overlap = lexical_overlap(lm, table, U, E, cfg.seed)
        keep = [r for r, name in enumerate(table.names) if not overlap[name]["lexical"]]
        print(f"left out as lexical: {[n for n in table.names if overlap[n]['lexical']]}", flush=True)
        A, U = A[:, keep], [U[r] for r in keep]
        negatives = [w for snr in args.snr for w in superposition_worlds(snr) if "shuffled" in w.name]
        negatives += [w for w in superposition_worlds(args.snr[0]) if "lexical only" in w.name]
        gains = null_gains(negatives, A, U, E, args.replicates, cfg.folds, cfg.jackknife_groups)
        for name, values in gains.items():
            print(f"  {name:40s} gain over random_attributes: mean {sum(values) / len(values):+.4f}, max "
                  f"{max(values):+.4f}, 95% quantile {minimal_effect({name: values}):.4f}", flush=True)
        MIN_EFFECT[SUPERPOSITION] = math.ceil(minimal_effect(gains) * 1000) / 1000
        print(f"minimal effect (largest 95% quantile, rounded up): {MIN_EFFECT[SUPERPOSITION]:g} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    print(f"{lm.info.get('name')}: {A.shape[0]} subjects x {A.shape[1]} relations, d = {E.shape[1]}; "
          f"{args.replicates} replicates per world, Bonferroni over {args.family} tests, minimal effect "
          f"{MIN_EFFECT[SUPERPOSITION]:g}", flush=True)
    worlds = [w for snr in args.snr for w in superposition_worlds(snr) if "lexical only" not in w.name]
    worlds += [w for w in superposition_worlds(args.snr[0]) if "lexical only" in w.name]
    rows = calibrate(worlds, A, U, E, args.replicates, args.family, cfg.folds, cfg.jackknife_groups,
                     on_row=progress(t))
    return finish(rows, format_rows(rows), t, args.out)


if __name__ == "__main__":
    main()
