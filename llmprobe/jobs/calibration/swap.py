"""The freeze-and-swap line (:func:`calibrate_swap`) calibrated on one-layer models.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmprobe.report.claims import swap_test
from synthetic.construction import build_construction, build_subject_memory, construction_accuracy
from synthetic.model import FactRecallModel
from synthetic.swap import freeze_and_swap, new_table, train_subjects, with_subjects
from synthetic.tasks import FactTask, random_bijections, random_functions
from synthetic.train import TrainConfig, train


# ------------------------------------------------------------------------------------------------ freeze-and-swap
@dataclass(frozen=True)
class SwapWorld:
    """A world of the freeze-and-swap line: ``build(seed)`` -> (a one-layer model, its fact task); ``holds``:
    whether the model reads a table from the geometry of its subject embeddings (None: neither by construction)."""

    name: str
    build: Callable
    holds: bool | None


def swap_zero_shot(model: FactRecallModel, task: FactTask, seed: int) -> dict:
    """Zero-shot accuracy (strict argmax, no training step) on a new table (``synthetic.swap.new_table(task,
    seed)``: each relation's column permuted across subjects) of ``model`` frozen, with new subject embeddings:
    ``swap`` (e'_s = c + sum_r W_r u_{a'_r(s)}, the superposition fit of its trained embeddings), and the nulls
    ``random_init`` (embeddings drawn as at initialisation), ``random_matched`` (random directions with the swap
    embeddings' norms) and ``old_embeddings`` (its own trained embeddings, which encode the old table). JSON-ready
    {condition: accuracy}."""
    out = freeze_and_swap(model, task, seed=seed, steps=(0,), conditions=("swap", "random_init", "random_matched"))
    old = train_subjects(with_subjects(model, model.subject_embeddings()), new_table(task, seed), steps=(0,))
    return {**out["zero_shot"], "old_embeddings": round(old["accuracy"][0], 4)}


def swap_worlds(n_subjects: int = 256, n_relations: int = 4, d_model: int = 28, steps: int = 1000
                ) -> list[SwapWorld]:
    """The freeze-and-swap line's worlds, each on a fresh random table per seed:

    * the paper's construction (smallest block size that answers every fact; bijections): the table is its
      subject embeddings' geometry by construction;
    * a trained geometric model (trainable subject embeddings; Adam lr 0.03, weight decay 1e-4, ``steps`` steps,
      bijections: the swap sweep's recipe, ``synthetic.swap.run_point``);
    * the key-value memory whose MLP reads only the subject (``build_subject_memory``: one unit per subject,
      one-hot keys; each relation its own attribute set), and frozen_all (subject embeddings and unembedding
      frozen at random, same recipe): the facts live in the MLP, not in the embeddings' geometry."""
    N, R = n_subjects, n_relations

    def construction(seed):
        task = random_bijections(N, R, seed)
        for b in range(1, 33):
            model = build_construction(task, b, seed=seed).float()
            if construction_accuracy(model, task) == 1.0:
                return model, task
        raise RuntimeError("no construction answers every fact")

    def trained(kw: dict):
        def build(seed):
            task = random_bijections(N, R, seed)
            cfg = TrainConfig(lr=0.03, max_steps=steps, weight_decay=1e-4, target_acc=1.01, progress=False)
            return train(task, d_model, config=cfg, seed=seed, **kw).model.eval(), task
        return build

    def memory(seed):
        task = random_functions(N, R, max(2, N // 8), seed=seed)
        return build_subject_memory(task, seed), task

    return [SwapWorld("construction (paper's)", construction, True),
            SwapWorld(f"trainable, d={d_model}, wd, {steps} steps", trained({}), True),
            SwapWorld("key-value: MLP reads the subject only", memory, False),
            SwapWorld(f"key-value: frozen_all, d={d_model}, wd", trained({"frozen_subjects": True,
                                                                          "frozen_unembed": True}), False)]


def calibrate_swap(worlds: list[SwapWorld], seeds: tuple[int, ...], offset: int = 1000, on_row=None) -> list[dict]:
    """One row per world: its seeds' zero-shot accuracies (:func:`swap_zero_shot`, new table seed = seed +
    ``offset``, as the swap sweep draws it) and the line's test on them (``llmprobe.report.claims.swap_test``:
    grade, difference against the hardest null, power)."""
    rows = []
    for world in worlds:
        per_seed = []
        for seed in seeds:
            model, task = world.build(seed)
            per_seed.append({"seed": seed, **swap_zero_shot(model, task, seed + offset)})
        test = swap_test(per_seed)
        row = {"world": world.name, "claim_holds": world.holds, "seeds": per_seed, "grade": test["grade"],
               "swap": test["metric"]["value"], "null_name": test["null_name"],
               "difference": test["difference"], "power": test["power"]}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_swap_rows(rows: list[dict]) -> str:
    """The freeze-and-swap calibration table as text: mean zero-shot accuracy per condition over seeds, the
    difference against the hardest null with its interval, the grade."""
    names = ("swap", "random_init", "random_matched", "old_embeddings")
    out = [f"{'world':40s} {'holds':5s} {'seeds':>5s} " + " ".join(f"{n:>14s}" for n in names)
           + f"  {'difference [95% t]':>24s}  grade"]
    holds = {True: "yes", False: "no", None: "-"}
    for r in rows:
        means = [sum(s[n] for s in r["seeds"]) / len(r["seeds"]) for n in names]
        diff = r["difference"]
        ci = diff["ci"] if diff else None
        shown = f"{diff['value']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if diff else "-"
        out.append(f"{r['world']:40s} {holds[r['claim_holds']]:5s} {len(r['seeds']):5d} "
                   + " ".join(f"{m:14.3f}" for m in means) + f"  {shown:>24s}  {r['grade']}")
    return "\n".join(out)
