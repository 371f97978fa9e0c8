"""Matched synthetic controls, like for like: the paper's one-layer model trained on the *same* fact table that a
pretrained model's superposition fit uses (same subjects, relations and attribute sets), measured with the same
readout code, as a curve over width, over seeds.

:func:`train_matched` (what ``llmprobe run`` calls in its worker process):

1. finds the threshold width d* for each mode (:func:`control_threshold`) by the capacity sweep's public
   bisection (:func:`synthetic.sweep.find_threshold`: d* is exact only when d*-1 failed with two initialisations),
   on the table as given, every training stopped at its first step at 100% train accuracy (d* asks only whether
   the facts fit);
2. trains the curve d*, 2 d*, 4 d*, ... up to ``d_model`` / 1.5, and ``d_model`` itself (the pretrained model's
   width) with ``n_seeds`` seeds, to the recipe's rule (:data:`RULES`): weight_decay its whole cosine schedule of
   ``max_steps`` (1000), adam ``past_fit`` steps past the first step at 100% (at most to ``max_steps``). A wide
   control fits after a few dozen steps with its embeddings barely off their random init, so its R^2 at that step
   measures the stopping rule more than the model. Seed i (0, 1, ...) is the model
   seed ``seed + i`` and, for i > 0, the subjects in the order :func:`synthetic.tasks.reorder_subjects` draws from
   ``seed + i`` (which embedding row each subject gets). The seeds of one width train in one batched stack
   (:func:`synthetic.batched.train_batched`, softmax chunk fixed: each seed's numbers are those it gets alone);
3. measures every point as the pretrained subject states are measured: the superposition fit
   h_s ~ c + sum_r W_r u_{a_r(s)} (held-out R^2) and each relation's linear readout accuracy, through
   :func:`llmprobe.geometry.superposition_readout` on the subject embeddings e_s: in full (intervals, the
   shuffled-table and random-init controls, every number a typed :class:`llmprobe.metric.Metric`, and the
   MLP-as-selector measurements of :func:`synthetic.mechanisms.selector`) for seed 0 at the end of training; the
   R^2 value (and its shuffled control) of every seed at its first 100% step (``r2_at_fit``), at each budget of
   :data:`BUDGETS` below ``past_fit`` (``r2_by_budget``) and at the end (``r2_final``), with intervals over seeds,
   every seed's readout accuracies and gate-transplant keep rates at the end (``over_seeds``: Student-t intervals
   over seeds; from the fit the R^2 already makes and two forward passes, so they cost nothing measurable), and
   how far the embeddings moved from their init (``movement``). The claims compare the pretrained model with
   these over-seeds numbers and say when a comparison word would flip between seeds.

Nothing finished is lost (``checkpoints``): each finished unit, every training of the threshold search (one width,
one initialisation) and every width of the curve (its seeds trained in one stack, measured), is written as soon as it
finishes to ``checkpoints/<mode>/`` (:class:`Units`, one small JSON file each, atomically), keyed by everything its
numbers depend on (the table, ``d_model``, the seed and every training setting, the mode, the width, its
initialisation or d*); with ``resume`` a unit whose file holds its key is read back instead of trained again, so an
interrupted run resumed gives the numbers of an uninterrupted one, and a unit whose key differs is trained again
(said on ``progress``).

Reproducible: everything runs on one torch thread (:func:`fixed_threads`). Another thread count sums floats in
another order; the first step at 100% of a wide model jumps with that rounding (SmolLM2's table, d = 576, seed 0:
step 63 on one thread, 41 on two; R^2 there 0.184 and 0.098), so the controls' numbers would be a function of the
machine's load and thread settings, not of their seed. On one CPU build they are a function of the seed and the
settings (on a CUDA device, up to CUDA's non-deterministic kernels: not checked).

Modes: ``trainable`` (every parameter learns) and ``frozen`` (subject embeddings frozen at random init, the
unembedding learns). ``frozen_all`` (subject embeddings and unembedding frozen) is a sweep mode, not trained here.
Recipes (:data:`RECIPES`, their rules :data:`RULES`): ``weight_decay`` (lr 0.03, weight decay 1e-3, its whole
1000-step cosine schedule: the paper's regime, converged at every width; the default) and ``adam`` (lr 0.1, no weight
decay, 100 steps past the first fit: the capacity sweep's). Tables (``facts``): ``known`` (the facts the
pretrained model knows of its superposition fit's table: what ``llmprobe run`` grades) or ``all`` (every fact of
that table: the all-facts control, shown apart, ``all_facts``).

The returned block (``report["matched"]``)::

    {"compared_with": "<one sentence: what is compared with what>",
     "table": {"facts", "n_subjects", "relations", "n_facts", "bits", "bits_joint"}, "d_model": 576, "seed": 0,
     "seeds": [0, 1, 2],
     "training": {TrainConfig fields that matter, "recipe", "past_fit", "stopping_rule", "schedule", "budgets",
                  "threads", ...},
     "all_facts": {a block of the same form: the all-facts control, when asked for},
     "wall_seconds": ..., "cpu_seconds": ...,
     "modes": {"trainable": {"threshold": {"d_star", "exact", "tried": [...], "search_seconds"},
                             "points": [{"d", "d_over_dstar", "d_mlp", "train": {"accuracy", "success", "steps",
                                         "fit_step", ...} (seed 0), "r2": Metric (seed 0, end of training),
                                         "readout": {relation: Metric}, "readout_mean": Metric (pooled over
                                         relations), "selector": {...}, "r2_at_fit", "r2_final": Metric over
                                         seeds, "r2_by_budget": {steps past fit: Metric over seeds},
                                         "movement": {"at_fit", "final": {"subject_embed", "unembed"}},
                                         "over_seeds": {"readout": {relation: Metric}, "readout_mean": Metric,
                                                        "gate_transplant": {"same_relation", "same_subject":
                                                                            Metric}} (over seeds, end of training),
                                         "seeds": [per seed: fit_step, steps, r2s, readout, readout_mean,
                                                   gate_transplant, movements], "wall_seconds",
                                         "cpu_seconds"}, ...]},
               "frozen": {...}}}
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llmprobe.datasets import Fact, FactTable, Relation
from llmprobe.geometry import superposition_readout
from llmprobe.io import json_digest, write_text
from llmprobe.metric import pooled_readout, t_over_seeds
from llmprobe.model.random_init import random_init
from llmprobe.names import MATCHED_MODES
from synthetic.batched import train_batched
from synthetic.mechanisms import embedding_inputs, gate_transplant, readout_inputs
from synthetic.mechanisms import selector as measure_selector
from synthetic.model import FactRecallModel, auto_chunk
from synthetic.sweep import SweepConfig, find_threshold, initial_guess, train_width, width_config
from synthetic.tasks import from_fact_table, reorder_subjects
from synthetic.train import SNAPSHOT, TrainConfig

MODES = MATCHED_MODES
MAX_STEPS = 2000          # adam's step cap of every control's training (the bisection's too)
PAST_FIT = 100            # adam's stopping rule: steps trained past the first step at 100% train accuracy
                          # (SmolLM2's all-facts table: R^2 within 0.01 of 300 steps past at every width)
N_SEEDS = 3               # seeds of every curve point (model seed and subject order)
BUDGETS = (0, 30, 100, 300, 1000)     # steps past the fit at which the R^2 is read too (those below past_fit)
RECIPES = {"adam": {"lr": 0.1, "weight_decay": 0.0}, "weight_decay": {"lr": 0.03, "weight_decay": 1e-3}}
# each recipe's step cap and stopping rule (``max_steps``, ``past_fit``; past_fit None: the whole schedule, i.e.
# past_fit = max_steps): adam stops PAST_FIT steps past its first 100% step; weight_decay trains its whole cosine
# schedule of 1000 steps, away from the random init to the geometric solution at every width up to SmolLM2's 576
# (weight decay 1e-3: the same R^2 as a 2000-step schedule; 1e-4 is not there at d >= 192: docs/measures.md,
# "Matched synthetic controls", R^2 against steps)
RULES = {"adam": {"max_steps": MAX_STEPS, "past_fit": PAST_FIT}, "weight_decay": {"max_steps": 1000, "past_fit": None}}


def recipe_rule(recipe: str, max_steps: int | None = None, past_fit: int | None = None) -> tuple[int, int]:
    """(max_steps, past_fit) of ``recipe`` with the caller's values where given (None: the recipe's,
    :data:`RULES`; a rule of the whole schedule trains ``max_steps``, past_fit = max_steps)."""
    rule = RULES[recipe]
    max_steps = rule["max_steps"] if max_steps is None else max_steps
    past_fit = past_fit if past_fit is not None else rule["past_fit"] if rule["past_fit"] is not None else max_steps
    return max_steps, past_fit
FACTS = ("known", "all")  # the tables a control trains on: the facts the model knows, or every fact of the fit's table
ALL_FACTS = "all_facts"   # the block key (and checkpoint folder) of the all-facts control shown apart
THREADS = 1               # torch threads of all the controls' training and measuring (reproducibility)
N_BOOT = 500              # bootstrap resamples of the controls' R^2 intervals
PLACE = "subject embeddings e_s (blocks.0.resid_pre at the subject token)"
UNIT_FORMAT = "matched unit 2"      # the format of a unit's checkpoint, part of its key (2: per-seed readouts
                                    # and keep rates; a unit of format 1 is trained again)
KEEP_RATES = ("same_relation", "same_subject")   # the gate transplant's keep rates stored per seed


@contextlib.contextmanager
def fixed_threads(n: int = THREADS):
    """Run the block on ``n`` torch threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def known_table(report_relations: dict, known: dict, min_facts: int = 5) -> tuple[FactTable, list[str]]:
    """The fact table of known facts only, and the relations left out for having fewer than ``min_facts``.

    ``known`` maps relation name -> list of FactResult. Too few facts cannot be split into cross-fitting folds.
    """
    relations, dropped = [], []
    for name, results in known.items():
        facts = [Fact(r.subject, r.object) for r in results if r.known]
        if len(facts) < min_facts:
            dropped.append(f"{name} ({len(facts)} known)")
            continue
        meta = report_relations.get(name, {})
        relations.append(Relation(name, meta.get("templates") or ["{}"], meta.get("neutral_templates") or [],
                                  facts, meta.get("properties") or {}))
    if not relations:
        raise ValueError(f"no relation has {min_facts} or more known facts, so there is no table to train "
                         f"controls on (known: {', '.join(dropped) or 'none'})")
    return FactTable.from_relations(relations), dropped


def table_digest(table: FactTable) -> str:
    """sha256 of a fact table's content: its subjects, relations, attribute sets and index table."""
    return json_digest(table.subjects, table.relations, table.attributes, table.table.tolist())


class Units:
    """The finished units of the matched controls in ``folder`` (None: nothing written or read): each training of
    the threshold search and each width of the curve, one JSON file ``folder/<mode>/<name>.json`` written
    atomically as soon as it finishes, holding its key (a digest of ``settings``, everything the controls'
    numbers depend on, with its mode and ``unit``) and its value (NaN kept). With ``resume`` a file of the same
    key is read back instead of training the unit again; one of another key, or that cannot be read, is trained
    again and said on ``progress``. ``taken``: the units read back."""

    def __init__(self, folder: str | Path | None, settings: dict, resume: bool = False, progress=print):
        self.folder = None if folder is None else Path(folder)
        self.settings, self.resume, self.progress = settings, resume, progress
        self.taken = 0

    def path(self, mode: str, name: str) -> Path:
        return self.folder / mode / f"{name}.json"

    def key(self, mode: str, unit: dict) -> str:
        return json_digest(UNIT_FORMAT, self.settings, mode, unit)

    def get(self, mode: str, name: str, unit: dict) -> dict | None:
        """The value of a finished unit (``resume`` only), or None: train it."""
        if self.folder is None or not self.resume or not self.path(mode, name).is_file():
            return None
        path = self.path(mode, name)
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            key, value = saved["key"], saved["value"]
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as error:
            self.progress(f"{mode} {name}: {path} cannot be read ({type(error).__name__}), so it is trained again")
            return None
        if key != self.key(mode, unit) or not isinstance(value, dict):
            self.progress(f"{mode} {name}: {path} was written for other settings or another table (its key "
                          f"differs), so it is trained again")
            return None
        self.taken += 1
        return value

    def put(self, mode: str, name: str, unit: dict, value: dict) -> None:
        """Write a finished unit (atomically; nothing without a folder)."""
        if self.folder is not None:
            record = {"format": UNIT_FORMAT, "key": self.key(mode, unit), "mode": mode, "unit": unit, "value": value}
            write_text(self.path(mode, name), json.dumps(record, ensure_ascii=False) + "\n")


def train_at(task, mode: str, d: int, cfg: SweepConfig, seed: int = 0, init: int = 0):
    """Train one control of width d (:func:`synthetic.sweep.train_width`, model seed ``seed + init *
    INIT_OFFSET``): (model, RunResult as a dict)."""
    if mode not in MODES:
        raise ValueError(f"unknown control mode {mode!r}; choose from {MODES}")
    result = train_width(task, mode, d, cfg, seed, init)
    return result.model, result.to_dict()


def control_threshold(task, mode: str, cfg: SweepConfig, seed: int = 0, units: Units | None = None) -> dict:
    """Smallest d in [cfg.d_min, cfg.d_max] reaching 100% train accuracy on ``task``, by the sweep's public
    bisection (:func:`synthetic.sweep.find_threshold`), started from the table's bits per subject. ``units``: each
    training (width, initialisation) is written there as it finishes, and read back instead of trained when it
    holds one of the same key (:class:`Units`).

    Returns {"d_star", "exact", "tried": [{"d", "init", "success", "accuracy", "steps", "wall_time_s"}] (by d,
    then init), "models": {d: (model, result)}} (the successful, else the last, model of every width trained
    here: a training read back from ``units`` has no model)."""
    models: dict[int, tuple] = {}
    rows = []

    def train_fn(d, init):
        name, unit = f"search-d{d}-init{init}", {"kind": "search", "d": d, "init": init}
        row = units.get(mode, name, unit) if units is not None else None
        if row is None:
            model, result = train_at(task, mode, d, cfg, seed, init)
            row = {"d": d, "init": init, "success": bool(result["success"]), "accuracy": result["accuracy"],
                   "steps": result["steps"], "wall_time_s": result["wall_time_s"]}
            if d not in models or result["success"]:
                models[d] = (model, result)
            if units is not None:
                units.put(mode, name, unit, row)
        rows.append(row)
        return bool(row["success"])

    start = initial_guess(task.n_subjects, task.n_relations, mode, task.bits() / max(1, task.n_subjects))
    found = find_threshold(train_fn, cfg.d_min, cfg.d_max, start)
    return {"d_star": found["d_star"], "exact": found["exact"],
            "tried": sorted(rows, key=lambda t: (t["d"], t["init"])), "models": models}


def curve_widths(d_star: int | None, d_model: int, at_model_width: bool = True) -> list[int]:
    """d*, 2 d*, 4 d*, ... up to d_model / 1.5, then ``d_model`` itself (only d_model when d* is None; without
    ``at_model_width`` only d*). A doubling within 1.5x of d_model is left out: it would cost as much as d_model
    (the widest trainings dominate the controls' time) and sit next to it on the log axis."""
    if d_star is None:
        return [d_model]
    if not at_model_width:
        return [d_star]
    widths, d = [], d_star
    while d < d_model and (d == d_star or 1.5 * d <= d_model):
        widths.append(d)
        d *= 2
    return widths + [d_model]


def _measure(report, key: str, relation: str | None = None) -> dict | None:
    """The real condition's metric with the other conditions as named controls (shuffled primary), JSON form."""
    m = report.measure(key, relation, primary="shuffled")
    return None if m is None else m.to_dict()


def measure_control(model, task, seed: int = 0, n_boot: int = N_BOOT, selector: bool = True) -> dict:
    """Superposition readouts of a trained control's subject embeddings (controls ``shuffled`` and
    ``random_init``), as the pretrained model's subject states are measured, and its MLP-as-selector numbers.

    Returns {"r2": Metric, "readout": {relation: Metric}, "selector": {...} (when asked), "wall_seconds"}."""
    t0 = time.perf_counter()
    H, A, U = readout_inputs(model, task)
    H_c, _, U_c = readout_inputs(random_init(model, model.config.seed + 1), task)
    rep = superposition_readout(H, A, U, nulls={"random_init": (H_c, U_c)}, relation_names=task.relations,
                                n_boot=n_boot, seed=seed, decode=False)
    out = {"r2": _measure(rep, "r2"), "readout": {name: _measure(rep, "readout_acc", name)
                                                  for name in task.relations}}
    if selector:
        sel = measure_selector(model, task, seed=seed)
        keys = ("n_units", "n_alive", "units_per_relation", "relation_gating", "ablation", "random_ablation",
                "gate_transplant", "relation_patch", "base_accuracy", "ablation_drop", "random_ablation_drop")
        out["selector"] = {"relations": list(task.relations), **{k: sel[k] for k in keys}}
    out["wall_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def r2_value(subject_embed: torch.Tensor, unembed: torch.Tensor, task, seed: int = 0) -> tuple[float, float]:
    """(held-out R^2, its shuffled-table control) of the superposition fit of ``subject_embed`` [N, d] on the
    attribute rows of ``unembed`` [n_outputs, d]: the value :func:`measure_control` reports, without intervals."""
    values = seed_values(subject_embed, unembed, task, seed)
    return values["r2"], values["shuffled"]


def seed_values(subject_embed: torch.Tensor, unembed: torch.Tensor, task, seed: int = 0) -> dict:
    """The values :func:`measure_control` reports, without intervals, from one superposition fit of
    ``subject_embed`` [N, d] on the attribute rows of ``unembed`` [n_outputs, d]: {"r2", "shuffled" (its
    shuffled-table control), "readout": {relation: held-out readout accuracy}}."""
    H, A, U = embedding_inputs(subject_embed, unembed, task)
    rep = superposition_readout(H, A, U, relation_names=task.relations, n_boot=1, seed=seed, decode=False,
                                jackknife_groups=0, n_random=0)
    m = rep.measure("r2", primary="shuffled")
    readout = {name: rep.measure("readout_acc", name) for name in task.relations}
    return {"r2": m.value, "shuffled": m.nulls["shuffled"].value,
            "readout": {name: None if r is None else r.value for name, r in readout.items()}}


def over_seeds(values: list[float | None], controls: dict[str, list] | None = None,
               bounds: tuple[float, float] | None = None) -> dict:
    """A Metric (JSON form) over seeds (:func:`llmprobe.metric.t_over_seeds`): the mean of ``values`` (None = that
    seed has none, left out) with its Student-t interval (``n`` = seeds; unbounded with one seed; cut to ``bounds``
    where given, e.g. (0, 1) for a rate) and the values in ``spread``; ``controls`` {name: values per seed} the
    same way."""
    m = t_over_seeds(values, bounds)
    out = m.to_dict()
    if controls:
        out["nulls"] = {name: over_seeds(vals) for name, vals in controls.items()}
        out["primary_null"] = next(iter(controls))
    return out


def movement(now: dict[str, torch.Tensor], init: FactRecallModel) -> dict[str, float]:
    """||X - X_init|| / ||X_init|| (Frobenius) of the subject embeddings and the unembedding (``now``: a
    :func:`synthetic.train.snapshot`)."""
    out = {}
    for name, key in zip(SNAPSHOT, ("subject_embed", "unembed")):
        x0 = getattr(init, name).detach()
        out[key] = round(float((now[name] - x0).norm() / x0.norm()), 4)
    return out


def seed_tasks(task, seed: int, n_seeds: int) -> list:
    """The task of each seed: the table as given for seed 0, the subjects reordered from ``seed + i`` for i > 0."""
    return [task if i == 0 else reorder_subjects(task, seed + i) for i in range(n_seeds)]


def train_point(tasks: list, mode: str, d: int, cfg: SweepConfig, seed: int, budgets: tuple[int, ...]) -> list:
    """Train width ``d`` once per seed (``tasks[i]`` with model seed ``seed + i``) in one batched stack, to
    ``cfg.train``'s stopping rule, keeping snapshots at ``budgets`` steps past the fit: [RunResult] by seed."""
    configs = [width_config(t, mode, d, cfg, seed + i) for i, t in enumerate(tasks)]
    return train_batched(tasks, configs, cfg.train, snapshot_at=budgets)


def seed_row(i: int, result, task, seed: int, budgets: tuple[int, ...], final: dict | None = None) -> dict:
    """What one seed of a point measured: its fit step and steps, R^2 and shuffled R^2 at the fit, at each budget
    and at the end, its readout accuracy per relation and its gate-transplant keep rates at the end (``final``:
    those end values already measured, {"r2", "shuffled", "readout", "gate_transplant"}: seed 0's, in full), and
    the embeddings' movement at the fit and at the end. The end values come from the one superposition fit the
    R^2 needs (:func:`seed_values`) and two forward passes (:func:`synthetic.mechanisms.gate_transplant`)."""
    init = FactRecallModel(result.model.config)
    weights = {name: getattr(result.model, name).detach().cpu() for name in SNAPSHOT}
    at = {k: r2_value(snap["subject_embed"], snap["unembed_weight"], task, seed + i)
          for k, snap in sorted(result.snapshots.items()) if k in budgets}
    if final is None:
        final = {**seed_values(weights["subject_embed"], weights["unembed_weight"], task, seed + i),
                 "gate_transplant": gate_transplant(result.model.cpu(), task, seed + i)}
    fit = result.fit_step
    return {"seed": seed + i, "subject_order": None if i == 0 else seed + i, "fit_step": fit,
            "steps": result.steps, "steps_past_fit": None if fit is None else result.steps - fit,
            "accuracy": result.accuracy, "r2_at_fit": at.get(0, (None,))[0], "r2_final": final["r2"],
            "shuffled_at_fit": at.get(0, (None, None))[1], "shuffled_final": final["shuffled"],
            "r2_by_budget": {str(k): v[0] for k, v in at.items()},
            "readout": final["readout"], "readout_mean": readout_mean(final["readout"], task),
            "gate_transplant": {k: None if (v := final["gate_transplant"].get(k)) is None else round(v, 4)
                                for k in KEEP_RATES},          # rounded as the selector's numbers are
            "movement_at_fit": movement(result.snapshots[0], init) if 0 in result.snapshots else None,
            "movement_final": movement(weights, init)}


def readout_mean(readout: dict[str, float | None], task) -> float | None:
    """Readout accuracy pooled over relations (each subject-relation fact once: relations weighted by their facts),
    as :func:`llmprobe.metric.pooled_readout` pools seed 0's metrics; None when a relation has no value."""
    counts = (task.table >= 0).sum(0).tolist()
    weights = dict(zip(task.relations, counts))
    if not readout or any(v is None for v in readout.values()):
        return None
    return sum(v * weights[name] for name, v in readout.items()) / sum(weights[name] for name in readout)


def seeds_summary(rows: list[dict], budgets: tuple[int, ...]) -> dict:
    """The point's numbers over seeds: ``r2_at_fit``, ``r2_final``, ``r2_by_budget`` (Metrics with the shuffled
    control), ``over_seeds`` (the end values the claims compare with: ``readout`` per relation, ``readout_mean``
    and the gate transplant's ``same_relation`` / ``same_subject`` keep rates, each a Metric over seeds) and the
    mean ``movement`` at the fit and at the end."""
    def mean_movement(key):
        got = [r[key] for r in rows if r[key] is not None]
        return {part: round(sum(m[part] for m in got) / len(got), 4) for part in got[0]} if got else None

    return {"r2_at_fit": over_seeds([r["r2_at_fit"] for r in rows], {"shuffled": [r["shuffled_at_fit"] for r in rows]}),
            "r2_final": over_seeds([r["r2_final"] for r in rows], {"shuffled": [r["shuffled_final"] for r in rows]}),
            "r2_by_budget": {str(k): over_seeds([r["r2_by_budget"].get(str(k)) for r in rows]) for k in budgets},
            "over_seeds": {"readout": {name: over_seeds([r["readout"].get(name) for r in rows], bounds=(0, 1))
                                       for name in rows[0]["readout"]},
                           "readout_mean": over_seeds([r["readout_mean"] for r in rows], bounds=(0, 1)),
                           "gate_transplant": {k: over_seeds([r["gate_transplant"][k] for r in rows], bounds=(0, 1))
                                               for k in KEEP_RATES}},
            "movement": {"at_fit": mean_movement("movement_at_fit"), "final": mean_movement("movement_final")}}


def stopping_rule(past_fit: int, max_steps: int) -> str:
    """A control's stopping rule in words (the curve's; the threshold search stops at the first 100% step)."""
    if past_fit >= max_steps:
        return (f"its whole {max_steps}-step cosine schedule, whenever it first reaches 100% train accuracy (the "
                f"threshold search: that first step, at most {max_steps})")
    return (f"{past_fit} steps past the first step at 100% train accuracy, at most {max_steps} in all (the threshold "
            f"search: that first step)")


FACTS_WORDS = {"known": "the facts the pretrained model knows of the table of the pretrained superposition fit",
               "all": "every fact of the table of the pretrained superposition fit"}


def compared_with(table_info: dict, d_model: int, modes: dict, training: dict, seeds: list[int]) -> str:
    """The sentence that says exactly what the controls' numbers are compared with: the table (``table_info``'s
    ``facts``: known or all; absent: the table as given), the recipe and stopping rule (``training``: the block's
    ``recipe``, ``lr``, ``weight_decay``, ``past_fit``, ``max_steps``), the seeds and widths."""
    stars = ", ".join(f"{m} d* = {v['threshold']['d_star']}" for m, v in modes.items())
    past_fit, max_steps = training["past_fit"], training["max_steps"]
    trained = (f"for its whole {max_steps}-step schedule" if past_fit >= max_steps else
               f"to 100% train accuracy and then {past_fit} steps further (or to its {max_steps}-step cap)")
    table = FACTS_WORDS.get(table_info.get("facts"), "the same fact table as the pretrained superposition fit")
    return (f"Each control is the one-layer model trained with the {training['recipe']} recipe (Adam, lr "
            f"{training['lr']:g}, weight decay {training['weight_decay']:g}, cosine schedule) {trained} on {table} "
            f"({table_info['n_subjects']} subjects x {len(table_info['relations'])} relations, "
            f"{table_info['n_facts']} facts, the same attribute sets), with {len(seeds)} seed"
            f"{'s' if len(seeds) != 1 else ''} (initialisation and subject order), at widths d*, 2 d*, 4 d*, ... and "
            f"the pretrained d_model = {d_model} ({stars}); its subject embeddings e_s are measured with the same "
            f"cross-fitted superposition fit (held-out R^2) and per-relation linear readouts as the pretrained "
            f"model's relation-free subject states, with the same shuffled-table and random-init controls. Widths, "
            f"training and subjects differ from the pretrained model; the table, the measure and the controls do "
            f"not.")


class TimeLeft:
    """The time left of one mode's curve, from the plan's seconds of each width (``planned["width"]``: a function
    of d, picklable for the worker process, or a mapping d -> seconds): before any width is trained the plan's
    seconds of the widths left, "(planned)"; after, those seconds times measured / planned of the widths done."""

    def __init__(self, planned: dict | None, widths: list[int]):
        width = (planned or {}).get("width")
        try:
            self.planned = None if width is None else [float(width(d) if callable(width) else width[d])
                                                       for d in widths]
        except (KeyError, TypeError, ValueError):             # no plan of a width: no time left said
            self.planned = None
        self.done, self.measured = 0, 0.0

    def add(self, seconds: float) -> None:
        """One more width trained and measured, in ``seconds``."""
        self.done, self.measured = self.done + 1, self.measured + seconds

    def left(self) -> str:
        """``~10:24 left`` or ``~16:40 left (planned)``; "" without a plan."""
        if self.planned is None:
            return ""
        after, so_far = sum(self.planned[self.done:]), sum(self.planned[:self.done])
        if self.done and so_far > 0:
            return f"~{tqdm.format_interval(after * self.measured / so_far)} left"
        return f"~{tqdm.format_interval(after)} left (planned)"


def train_matched(table: FactTable, d_model: int, seed: int = 0, at_model_width: bool = True,
                   max_steps: int | None = None, d_max: int | None = None, n_boot: int = N_BOOT,
                   modes: tuple[str, ...] = MODES, progress=print, device: str = "cpu", n_seeds: int = N_SEEDS,
                   past_fit: int | None = None, recipe: str = "weight_decay", planned: dict | None = None,
                   checkpoints: str | Path | None = None, resume: bool = False, facts: str | None = None,
                   all_facts: dict | None = None) -> dict:
    """Train and measure the matched controls on ``table`` (pass the very table of the pretrained superposition
    fit); returns the controls block of the module docstring, on :data:`THREADS` torch threads whatever the
    caller's. ``device``: where the controls train (a CUDA device pays at the pretrained model's width: d = 4096
    with an MLP of 8d is ~2 TFLOP per full-batch step on a 1158-fact table); they are measured on the CPU.
    ``n_seeds`` seeds per point; ``recipe`` a key of :data:`RECIPES` (its optimiser settings); ``max_steps`` the step
    cap and ``past_fit`` the steps trained past the first 100% step (None: the recipe's, :data:`RULES`;
    ``past_fit >= max_steps`` trains the whole cosine schedule). ``facts``: which table ``table`` is ("known": the
    facts the pretrained model knows, "all": every fact of its superposition fit's table; None: not said),
    recorded in the block's ``table.facts`` and its ``compared_with``.

    ``all_facts``: the all-facts control shown apart, trained after this one in the same call: keywords of this
    function ({"table": FactTable, "recipe", "n_seeds", ...}; the others as this call's, ``facts`` "all", its
    units under ``checkpoints/all_facts``); its block is this block's ``all_facts``. None (default): none.

    ``planned``: the plan's seconds of each mode (``llmprobe.jobs.plan.matched_planned``), mode -> {"search":
    seconds of the threshold search, "curve": seconds of the curve as planned (before d* is known), "width": the
    seconds of width d: a function of d (picklable) or a mapping d -> seconds}; with it the progress lines say
    the mode's time left (:class:`TimeLeft`). It changes no number; None (default): no time left said.

    ``checkpoints``: a folder where each finished unit (a training of the threshold search, a width of the curve)
    is written as it finishes (:class:`Units`); with ``resume`` the units found there with the same key are read
    back instead of trained again (the block is the one an uninterrupted call returns; only its seconds differ).
    None (default): nothing written or read."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown controls recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if facts is not None and facts not in FACTS:
        raise ValueError(f"unknown controls table {facts!r}; choose from {', '.join(FACTS)}")
    max_steps, past_fit = recipe_rule(recipe, max_steps, past_fit)
    if n_seeds < 1 or past_fit < 0:
        raise ValueError(f"need n_seeds >= 1 and past_fit >= 0, got {n_seeds} and {past_fit}")
    with fixed_threads():
        t0, cpu0 = time.perf_counter(), time.process_time()
        task = from_fact_table(table)
        search = TrainConfig(max_steps=max_steps, progress=False, device=device,
                             chunk=auto_chunk(task.n_outputs, device), **RECIPES[recipe])
        cfg = SweepConfig(d_max=d_max or d_model, train=search)
        curve = SweepConfig(d_max=cfg.d_max, train=dataclasses.replace(search, past_fit=past_fit))
        budgets = tuple(k for k in BUDGETS if k < past_fit)
        tasks = seed_tasks(task, seed, n_seeds)
        units = Units(checkpoints, {"table": table_digest(table), "d_model": d_model, "seed": seed,
                                    "max_steps": max_steps, "d_max": cfg.d_max, "n_boot": n_boot, "n_seeds": n_seeds,
                                    "past_fit": past_fit, "recipe": recipe, **RECIPES[recipe], "device": str(device),
                                    "threads": THREADS, **({"facts": facts} if facts else {})}, resume, progress)
        info = {**({"facts": facts} if facts else {}), "n_subjects": len(table.subjects),
                "relations": list(table.relations),
                "n_facts": int((task.table >= 0).sum()), "bits": round(task.bits(), 1),
                "bits_joint": round(task.bits_joint(), 1)}
        block_modes = {}
        for mode in modes:
            start = time.perf_counter()
            of_modes = f" ({modes.index(mode) + 1}/{len(modes)} modes)" if len(modes) > 1 else ""
            plan = (planned or {}).get(mode)
            ahead = (f"; ~{tqdm.format_interval(plan['search'] + plan['curve'])} left (planned)"
                     if plan and "search" in plan and "curve" in plan else "")
            progress(f"{mode}{of_modes}, seed {seed}: searching d*, the smallest "
                     f"width in {cfg.d_min}..{cfg.d_max} reaching 100% train accuracy, by bisection" + ahead)
            taken = units.taken
            found = control_threshold(task, mode, cfg, seed=seed, units=units)
            taken = units.taken - taken
            d_star = found["d_star"]
            threshold = {"d_star": d_star, "exact": found["exact"], "tried": found["tried"],
                         "search_seconds": round(time.perf_counter() - start, 1)}
            widths = curve_widths(d_star, d_model, at_model_width)
            clock = TimeLeft(plan, widths)
            left = f"; {clock.left()}" if clock.left() else ""
            progress(f"{mode}: " + (f"d* = {d_star}, " + ("exact (d*-1 failed with every initialisation)"
                                                       if found["exact"] else "an upper bound (d*-1 not seen failing)")
                                    if d_star else f"no width up to {cfg.d_max} reaches 100%")
                     + f", in {threshold['search_seconds']:.0f} s; trained " + ", ".join(
                         f"d={t['d']}" + (f" (initialisation {t['init'] + 1})" if t["init"] else "")
                         + (" 100%" if t["success"] else f" {t['accuracy']:.1%}") for t in found["tried"])
                     + (f" ({taken} of them taken from {units.folder / mode}, --resume)" if taken else "")
                     + f"; next the widths {', '.join(map(str, widths))}" + left)
            points = []
            for k, d in enumerate(widths, 1):
                start, cpu = time.perf_counter(), time.process_time()
                label = f"{mode} d={d} (width {k}/{len(widths)})"
                name, unit = f"width-d{d}", {"kind": "width", "d": d, "d_star": d_star}
                point = units.get(mode, name, unit)
                if point is not None:
                    points.append(point)
                    clock.add(float(point.get("wall_seconds") or 0.0))
                    left = f"; {clock.left()}" if clock.left() else ""
                    progress(f"{label}: taken from {units.path(mode, name)} (--resume)" + left)
                    continue
                progress(f"{label}: training "
                         + (f"seed {seed}" if len(tasks) == 1 else
                            f"{len(tasks)} seeds {seed}..{seed + len(tasks) - 1}")
                         + f", up to {curve.train.max_steps} steps")
                results = train_point(tasks, mode, d, curve, seed, budgets)
                model = results[0].model.cpu()
                measured = measure_control(model, task, seed, n_boot)
                final0 = {"r2": measured["r2"]["value"], "shuffled": measured["r2"]["nulls"]["shuffled"]["value"],
                          "readout": {name: (m or {}).get("value") for name, m in measured["readout"].items()},
                          "gate_transplant": measured["selector"]["gate_transplant"]}
                rows = [seed_row(i, res, tasks[i], seed, budgets, final0 if i == 0 else None)
                        for i, res in enumerate(results)]
                train0 = results[0].to_dict()
                points.append({"d": d, "d_over_dstar": round(d / d_star, 3) if d_star else None,
                               "d_mlp": train0["d_mlp"],
                               "train": {k: train0[k] for k in ("accuracy", "success", "steps", "fit_step",
                                                                "wall_time_s", "n_params", "n_trainable",
                                                                "bits_per_param")},
                               "r2": measured["r2"], "readout": measured["readout"],
                               "readout_mean": pooled_readout(measured["readout"]), "selector": measured["selector"],
                               **seeds_summary(rows, budgets), "seeds": rows,
                               "wall_seconds": round(time.perf_counter() - start, 1),
                               "cpu_seconds": round(time.process_time() - cpu, 1)})
                p = points[-1]
                units.put(mode, name, unit, p)
                clock.add(time.perf_counter() - start)
                left = f"; {clock.left()}" if clock.left() else ""
                plural = "s" if len(rows) > 1 else ""
                if all(r["fit_step"] is None for r in rows):
                    progress(f"{label}: no seed reaches 100% train accuracy in {max_steps} steps (best "
                             f"{max(r['accuracy'] for r in rows):.1%}, {len(rows)} seed{plural}); superposition R^2 "
                             f"{p['r2_final']['value']:.3f} at the cap" + left)
                else:
                    progress(f"{label}: 100% train accuracy at step " + ", ".join(
                        "never" if r["fit_step"] is None else str(r["fit_step"]) for r in rows)
                        + f" ({len(rows)} seed{plural}); superposition R^2 {p['r2_at_fit']['value']:.3f} at that "
                        f"step, {p['r2_final']['value']:.3f} at the end ({stopping_rule(past_fit, max_steps).split(',')[0]})"
                        + left)
            block_modes[mode] = {"threshold": threshold, "points": points}
        seeds = [seed + i for i in range(n_seeds)]
        training = {"max_steps": max_steps, "lr": search.lr, "weight_decay": search.weight_decay,
                    "recipe": recipe, "past_fit": past_fit, "budgets": list(budgets),
                    "stopping_rule": stopping_rule(past_fit, max_steps), "schedule": search.schedule,
                    "mlp_ratio": cfg.mlp_ratio, "attention": cfg.attention,
                    "target_acc": search.target_acc, "device": device, "threads": THREADS,
                    "flush_denormals": search.flush_denormals,
                    "chunk": search.chunk, "batched": "the seeds of one width in one stack"}
        block = {"compared_with": compared_with(info, d_model, block_modes, training, seeds), "place": PLACE,
                 "table": info, "d_model": d_model, "seed": seed, "seeds": seeds, "training": training,
                 "modes": block_modes, "wall_seconds": round(time.perf_counter() - t0, 1),
                 "cpu_seconds": round(time.process_time() - cpu0, 1)}
    if all_facts is not None:
        own = {"seed": seed, "at_model_width": at_model_width, "d_max": d_max, "n_boot": n_boot, "modes": modes,
               "progress": progress, "device": device, "planned": None, "resume": resume, "facts": "all",
               "checkpoints": None if checkpoints is None else Path(checkpoints) / ALL_FACTS, **all_facts}
        progress(f"the all-facts control (shown apart, not graded): {own['table']!r}")
        block[ALL_FACTS] = train_matched(d_model=d_model, **own)
        block["wall_seconds"] = round(time.perf_counter() - t0, 1)
        block["cpu_seconds"] = round(time.process_time() - cpu0, 1)
    return block


def merge_matched(blocks: list[dict]) -> dict:
    """One controls block from blocks of :func:`train_matched` that each trained other modes of the same table
    and settings (one worker process per mode): their modes in :data:`MODES` order, ``compared_with`` for them
    all, ``wall_seconds`` the longest block's (they trained at the same time), ``cpu_seconds`` the sum; their
    all-facts controls (``all_facts``) merged the same way. Each mode's numbers are those ``train_matched`` gives
    it alone: nothing is shared between modes but the table."""
    if not blocks:
        raise ValueError("no controls block to merge")
    first = blocks[0]
    keys = ("table", "d_model", "seed", "seeds", "training")
    for block in blocks[1:]:
        differ = [k for k in keys if block.get(k) != first.get(k)] + (
            [ALL_FACTS] if (ALL_FACTS in block) != (ALL_FACTS in first) else [])
        if differ:
            raise ValueError(f"controls blocks of different runs cannot be merged (they differ in {differ})")
    modes = {mode: block["modes"][mode] for mode in MODES for block in blocks if mode in block["modes"]}
    merged = {**first, "compared_with": compared_with(first["table"], first["d_model"], modes, first["training"],
                                                      first["seeds"]),
              "modes": modes, "wall_seconds": max(b["wall_seconds"] for b in blocks),
              "cpu_seconds": round(sum(b["cpu_seconds"] for b in blocks), 1)}
    if ALL_FACTS in first:
        merged[ALL_FACTS] = merge_matched([b[ALL_FACTS] for b in blocks])
    return merged


__all__ = ["MODES", "RECIPES", "RULES", "recipe_rule", "FACTS", "ALL_FACTS", "stopping_rule", "Units", "table_digest", "known_table", "train_at", "control_threshold", "curve_widths", "measure_control",
           "train_matched", "merge_matched", "compared_with", "fixed_threads", "over_seeds", "r2_value", "seed_values", "movement"]
