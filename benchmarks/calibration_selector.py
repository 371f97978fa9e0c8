"""Benchmark: the selector line's measure calibrated on planted one-layer models at the real run's sample size.

Worlds (``llmprobe.jobs.calibration.selector_worlds``; a fresh random table and model per replicate): the
paper's construction and a trained geometric model (trainable subject embeddings, with weight decay, and stopped
at its first 100% step), where the MLP is a relation-conditioned selector; the key-value memory (frozen_all: the
MLP stores the facts) and a memory whose MLP reads only the subject, where it is not; and the frozen-subject model
as a row of its own. Each is measured by the pretrained run's gate transplant code
(``llmprobe.jobs.calibration.transplant_test``: ``--items`` test facts, the SmolLM2 run's 64) and by the redirection
test, and graded by the report's rule with Bonferroni over ``--family`` tests (the SmolLM2 report's Holm family):
the calibrated keep test (the line now), the break test it replaced, and redirection. Printed per world: the mean
keep rates and the fraction of replicates graded supported and supported-or-weak under each test (power where the
claim holds, false-positive rate where it fails).

    python benchmarks/calibration_selector.py                        # 20 replicates (~4 min, 1 core)
    python benchmarks/calibration_selector.py --replicates 5 --items 32 --out runs/calibration_selector.json
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmprobe.analyses.selector import TRANSPLANT_ITEMS  # noqa: E402
from llmprobe.jobs.calibration import calibrate_selector, finish, format_selector_rows, progress, selector_worlds  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=TRANSPLANT_ITEMS, help="test facts per replicate")
    parser.add_argument("--replicates", type=int, default=20)
    parser.add_argument("--family", type=int, default=20,
                        help="Holm family size of the graded report (tests; the SmolLM2 run has 20)")
    parser.add_argument("-N", type=int, default=64, help="subjects of each planted table")
    parser.add_argument("-R", type=int, default=4, help="relations of each planted table")
    parser.add_argument("--d", type=int, default=16, help="width of the trained worlds")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of the trained worlds")
    parser.add_argument("--n-boot", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worlds", default=None,
                        help="only the worlds whose name contains one of these comma-separated words (default: all)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    print(f"{args.N} subjects x {args.R} relations, {args.items} test facts, {args.replicates} replicates per world, "
          f"Bonferroni over {args.family} tests", flush=True)
    worlds = [w for w in selector_worlds(args.N, args.R, args.d, args.steps)
              if args.worlds is None or any(word in w.name for word in args.worlds.split(","))]
    if not worlds:
        parser.error(f"no world's name contains any of {args.worlds!r}")
    rows = calibrate_selector(worlds, args.items, args.replicates,
                              args.family, args.n_boot,
                              on_row=progress(t))
    return finish(rows, format_selector_rows(rows), t, args.out)


if __name__ == "__main__":
    main()
