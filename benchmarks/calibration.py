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
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.analyses.settings import settings_from  # noqa: E402
from llmprobe.analyses.superposition import attribute_vectors, lexical_states, superposition_table  # noqa: E402
from llmprobe.datasets import load_relations  # noqa: E402
from llmprobe.io import write_json  # noqa: E402
from llmprobe.jobs.calibration import calibrate, format_rows, superposition_worlds  # noqa: E402
from llmprobe.model.loading import load_model  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snr", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--replicates", type=int, default=10)
    parser.add_argument("--family", type=int, default=20,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    lm = load_model(device="cpu")
    cfg = settings_from()
    table = superposition_table(lm.tokenizer, load_relations(None), {}, cfg)
    U, _ = attribute_vectors(lm, table.attributes, cfg.attribute_vectors)
    E = lexical_states(lm, table.subjects)
    print(f"{lm.info.get('name')}: {len(table.subjects)} subjects x {len(table.names)} relations "
          f"({', '.join(table.names)}), d = {E.shape[1]}; {args.replicates} replicates per world, Bonferroni over "
          f"{args.family} tests", flush=True)
    worlds = [w for snr in args.snr for w in superposition_worlds(snr) if "lexical only" not in w.name]
    worlds += [w for w in superposition_worlds(args.snr[0]) if "lexical only" in w.name]
    rows = calibrate(worlds, table.A, U, E, args.replicates, args.family, cfg.folds, cfg.jackknife_groups,
                     on_row=lambda row: print(f"  {row['world']}: done ({time.perf_counter() - t:.0f} s)", flush=True))
    print(format_rows(rows))
    print(f"({time.perf_counter() - t:.0f} s)")
    if args.out:
        write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
