"""The mechanism analyses (``llmprobe synth analyze RUN_DIR``) of a trained one-hop run, beside its controls.

:func:`analyze` loads the run (``synthetic.train.load_run``), trains the control models on the *same* fact table
with the run's own architecture and training settings, and measures all of them with the same code:

* ``trainable``: the run itself.
* ``frozen``: subject embeddings frozen at random init (the paper's frozen-embedding control; the unembedding still
  learns).
* ``frozen_all``: subject embeddings *and* unembedding frozen at random init (the associative memory of earlier
  work: only the MLP and relation embeddings learn, so the MLP must store the facts).
* ``untrained``: the same architecture at a fresh init (:func:`llmprobe.model.random_init.random_init` at model
  seed + 1; readout control only).

Analyses (see :mod:`synthetic.mechanisms` and :mod:`synthetic.swap`): superposition readouts of e_s with the
shuffled-table control and swap edits; MLP unit selectivity, relation-gating index, ablation matrix (with a
random-unit control), gate transplant and relation patch; logit attribution (own vs cross-relation components);
freeze-and-swap with random re-initialisation baselines.

Results: ``RUN_DIR/analysis.json`` (every number), ``RUN_DIR/analysis.md`` (side-by-side table) and PNG plots in
RUN_DIR drawn by :func:`synthetic.render.analysis_figures` (``analysis_readout.png``, ``analysis_selector.png``,
``analysis_ablation.png``, ``analysis_swap.png``); with ``img_dir`` the plots are also written there with a
``mech_`` prefix (e.g. ``docs/img/mech_readout.png``).

If RUN_DIR holds no checkpoint, ``analyze(..., train_spec=...)`` (CLI: ``--subjects --relations --d``) trains the
run first with :func:`synthetic.train.train`, so one command reproduces a claim from nothing.
"""
from __future__ import annotations

import os
import time

from llmprobe.io import write_json, write_text
from llmprobe.metric import pooled, pooled_readout
from llmprobe.model.random_init import random_init
from synthetic import mechanisms as mech
from synthetic.model import FactRecallModel, ModelConfig, mode_flags
from synthetic.render import analysis_figures
from synthetic.swap import freeze_and_swap
from synthetic.tasks import FactTask, KHopTask, random_bijections
from synthetic.train import STATE, TrainConfig, load_run, train

ANALYSIS = "analysis.json"
NULLS = ("frozen", "frozen_all")             # embedding modes (llmprobe.names.EMBEDDING_MODES) of the null models

# Defaults of a run trained by ``analyze`` itself: past 100% with a small weight decay, which removes the random
# init from e_s (the superposition is then clean; see docs/mechanisms.md).
DEFAULT_TRAIN = {"lr": 0.03, "max_steps": 1000, "weight_decay": 1e-4, "target_acc": 1.01}


def control_config(config: ModelConfig, kind: str) -> ModelConfig:
    """The run's architecture with the control's frozen parts (``kind`` in :data:`NULLS`)."""
    if kind not in NULLS:
        raise ValueError(f"unknown control {kind!r}; choose from {', '.join(NULLS)}")
    return ModelConfig.from_dict({**config.to_dict(), **mode_flags(kind)})


def train_control(task: FactTask, config: ModelConfig, train_config: TrainConfig, kind: str
                  ) -> tuple[FactRecallModel, dict]:
    """Train a control model (``kind`` in NULLS) on ``task``; returns (model, summary of the run)."""
    res = train(task, model_config=control_config(config, kind), config=train_config)
    return res.model.eval(), _run_summary(res.to_dict())


def _run_summary(info: dict) -> dict:
    keys = ("accuracy", "steps", "wall_time_s", "n_params", "n_trainable", "bits", "bits_per_param",
            "loss", "d_model", "d_mlp", "frozen_subjects", "attention")
    out = {k: info.get(k) for k in keys}
    out["all_facts_correct"] = (info.get("accuracy") or 0.0) >= 1.0   # (train's "success" is relative to target_acc)
    return out


def train_run(run_dir: str, subjects: int, relations: int, d: int, seed: int = 0, d_mlp: int | None = None,
              attention: str = "uniform", train_config: TrainConfig | None = None) -> dict:
    """Train a one-hop run on R random bijections into ``run_dir`` (used when RUN_DIR is empty)."""
    task = random_bijections(subjects, relations, seed)
    cfg = train_config or TrainConfig(**DEFAULT_TRAIN, progress=False)
    res = train(task, d, config=cfg, out_dir=run_dir, d_mlp=d_mlp, attention=attention, seed=seed)
    return _run_summary(res.to_dict())


def analyze(run_dir: str, *, nulls=NULLS, swap: bool = True, n_boot: int = 500, seed: int = 0,
            swap_steps=(0, 10, 25, 50, 100), swap_lr: float = 0.03, plots: bool = True,
            img_dir: str | None = None, train_spec: dict | None = None, progress: bool = True) -> dict:
    """All mechanism analyses of the one-hop run in ``run_dir``; writes ``analysis.json``, ``analysis.md`` and the
    plots (see module docstring) and returns the result dict."""
    t0 = time.perf_counter()
    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    trained_here = None
    if not os.path.exists(os.path.join(run_dir, STATE)):
        if not train_spec:
            raise ValueError(f"{run_dir} holds no trained run (no {STATE}); train one with `llmprobe synth train` "
                             f"or give --subjects, --relations and --d to train it here")
        tc = train_spec.get("train_config")
        log(f"training {run_dir}: N={train_spec['subjects']} R={train_spec['relations']} d={train_spec['d']}"
            + (f", lr={tc.lr:g}, {tc.max_steps} steps, weight decay {tc.weight_decay:g}" if tc else ""))
        trained_here = train_run(run_dir, **train_spec)
    model, task, info = load_run(run_dir)
    model.eval()
    if isinstance(task, KHopTask):
        raise ValueError("analyze needs a one-hop run; k-hop models are studied by `llmprobe synth multihop`")
    train_cfg = TrainConfig.from_dict({**(info.get("train") or {}), "progress": False})
    models = {"trainable": model}
    runs = {"trainable": _run_summary(info)}
    for kind in nulls:
        log(f"training control '{kind}' (same table, d={model.config.d_model}, d_mlp={model.config.d_mlp})")
        models[kind], runs[kind] = train_control(task, model.config, train_cfg, kind)
    result = {"run_dir": os.path.abspath(run_dir), "task": {"kind": task.kind, "n_subjects": task.n_subjects,
                                                             "n_relations": task.n_relations,
                                                             "n_facts": task.n_facts, "seed": task.seed},
              "model_config": model.config.to_dict(), "train_config": train_cfg.to_dict(), "runs": runs,
              "trained_here": trained_here}

    log("superposition readouts (trainable, shuffled, controls, untrained)")
    readout_nulls = {k: m for k, m in models.items() if k != "trainable"}
    readout_nulls["untrained"] = random_init(model, model.config.seed + 1)
    result["superposition"] = mech.superposition(model, task, nulls=readout_nulls, n_boot=n_boot, seed=seed)

    log("selector: unit selectivity, ablation matrix, gate transplant, relation patch")
    unit_stats = {}
    result["selector"] = {}
    for name, m in models.items():
        sel = mech.selector(m, task, seed=seed)
        unit_stats[name] = sel.pop("_unit_stats")
        result["selector"][name] = sel

    log("logit attribution (own vs cross-relation components)")
    result["logit_attribution"] = {}
    for name, m in models.items():
        if name == "frozen_all":
            continue                  # no superposition to attribute (R^2 ~ 0): the split is meaningless
        result["logit_attribution"][name] = mech.logit_attribution(m, task, seed=seed)

    if swap:
        log("freeze-and-swap")
        result["swap"] = {name: freeze_and_swap(m, task, seed=seed + 1, steps=swap_steps, lr=swap_lr,
                                                conditions=None if name == "trainable" else
                                                ("swap", "random_init", "old_table"))
                          for name, m in models.items()}

    table = {}
    sup = result["superposition"]
    for name in models:
        row = {"train_accuracy": runs[name]["accuracy"]}
        if name == "trainable":
            row.update(mech.key_numbers(sup, result["selector"][name]))
        else:
            s = sup["summary"].get(name, {})
            row.update({"readout_acc": s.get("readout_acc"), "superposition_r2": s.get("r2"),
                        "decode_acc": s.get("decode_acc")})
            row.update(mech.key_numbers(None, result["selector"][name]))
            se = sup.get(f"swap_edit_{name}")
            if se:
                row["swap_edit_success"] = se["success"]["value"]
        la = result["logit_attribution"].get(name)
        if la:
            row["relation_operator_r2"] = sum(la["operator_r2"]) / len(la["operator_r2"])
            row["logit_own"] = la["own"]
            row["logit_cross_trained_table"] = la["cross_total"]
            row["logit_cross_new_table"] = la["cross_total_new"]
        if swap:
            sw = result["swap"][name]
            row["swap_zero_shot"] = sw["zero_shot"]["swap"]
            row["random_init_zero_shot"] = sw["zero_shot"]["random_init"]
            k_mid = sorted(int(k) for k in sw["curves"]["swap"])
            k_mid = k_mid[min(2, len(k_mid) - 1)]
            row[f"swap_after_{k_mid}_steps"] = sw["curves"]["swap"][str(k_mid)]
            row[f"random_init_after_{k_mid}_steps"] = sw["curves"]["random_init"][str(k_mid)]
        table[name] = mech._round(row)
    table["untrained"] = mech._round({k: sup["summary"]["untrained"].get(k2) for k, k2 in
                                      (("readout_acc", "readout_acc"), ("superposition_r2", "r2"),
                                       ("decode_acc", "decode_acc"))})
    result["table"] = table
    result["table_intervals"] = table_intervals(result)
    result["table_md"] = table_markdown(table, result["table_intervals"])
    result["plots"] = []
    if plots:
        result["plots"] = analysis_figures(run_dir, result, unit_stats, img_dir=img_dir)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(os.path.join(run_dir, ANALYSIS), result)
    write_text(os.path.join(run_dir, "analysis.md"), markdown(result))
    return result


# one line per measure of the analysis table (``mech.key_numbers`` and the rows analyze adds); the swap rows'
# names carry their step count (swap_after_25_steps)
LEGEND = {
    "train_accuracy": "fraction of the table's facts whose argmax answer is right after training",
    "readout_acc": "per-relation linear readout of a_r(s) from the subject embedding e_s (nearest attribute "
                   "vector, cross-fitted over subjects), mean over relations",
    "superposition_r2": "held-out R^2 of e_s ~ c + sum_r W_r u_{a_r(s)} (cross-fitted over subjects)",
    "decode_acc": "attributes recovered by decoding e_s with the fitted superposition components, mean over relations",
    "shuffled_readout_acc": "readout_acc with the table shuffled across subjects (control)",
    "shuffled_r2": "superposition_r2 with the table shuffled across subjects (control)",
    "swap_edit_success": "swap edits e_s + W_r (u_a' - u_a) that make relation r answer a' and keep the others",
    "swap_edit_random_flip": "edits along a random direction of the same norm that make r answer a' (control)",
    "selectivity_index": "MLP units' (mu_max - mean of the other relations' mu) / (sum of both), mean over live units",
    "relation_gating": "I(unit on/off; relation) / H(unit on/off): how much of a unit's gating the relation "
                       "explains, mean over units",
    "ablation_diag_dominant_rows": "relations r whose units, zeroed, drop r's accuracy more than any other's",
    "ablation_diag_minus_offdiag": "zeroing relation r's units: mean accuracy drop on r minus that on the others",
    "random_ablation_diag_minus_offdiag": "the same with as many random live units zeroed (control)",
    "exclusive_units": "units firing for >= half of one relation's facts and < half of every other's",
    "exclusive_ablation_diag_drop": "zeroing relation r's exclusive units: mean accuracy drop on r",
    "exclusive_ablation_offdiag_drop": "zeroing relation r's exclusive units: mean accuracy drop on the other "
                                       "relations",
    "gate_transplant_same_relation": "accuracy with the MLP's on/off mask of another subject, same relation (a "
                                     "selector keeps it high)",
    "gate_transplant_same_subject": "accuracy with the mask of the same subject, another relation (control: low)",
    "relation_patch_follows_new": "MLP input shifted from relation r to r2: answers that follow r2",
    "relation_patch_keeps_old": "the same shift: answers still r's (where the two differ)",
    "relation_operator_r2": "R^2 of the final state as a linear map of e_s with the relation fixed, mean over "
                            "relations (1 = linear)",
    "logit_own": "right answer's logit lift from the queried relation's component of e_s",
    "logit_cross_trained_table": "lift from the other relations' components, on the trained table",
    "logit_cross_new_table": "the same on a new random table (what swapped embeddings face)",
    "swap_zero_shot": "frozen model, new subject embeddings c + sum_r W_r u_a'(s) for a new table: accuracy "
                      "before any training",
    "random_init_zero_shot": "the same with freshly initialised subject embeddings (control)",
    "swap_after": "swap_zero_shot's embeddings after that many steps of training them alone",
    "random_init_after": "random_init_zero_shot's after that many steps (control)",
}
MODELS = {"trainable": "every parameter trained (the run)", "frozen": "subject embeddings frozen at init",
          "frozen_all": "subject embeddings and unembedding frozen (associative memory)",
          "untrained": "the run's architecture at random init"}


def table_intervals(result: dict) -> dict:
    """{model: {measure: [lo, hi]}}: the 95% intervals of the table's numbers that the analysis measured (R^2:
    jackknife over subjects; readout and decode accuracy: pooled over relations; swap edits: Wilson over edits).
    The selector, logit and freeze-and-swap numbers are one measurement over all facts, without an interval."""
    sup = result["superposition"]
    conditions = sup["report"]["conditions"]
    out = {}
    for name in result["table"]:
        measured = conditions.get("real" if name == "trainable" else name) or {}
        shuffled = (conditions.get("shuffled") or {}) if name == "trainable" else {}
        edit = sup.get("swap_edit" if name == "trainable" else f"swap_edit_{name}") or {}
        metrics = {"superposition_r2": measured.get("r2"), "readout_acc": pooled_readout(measured.get("readout_acc")),
                   "decode_acc": pooled(measured.get("decode_acc"), "pooled over relations"),
                   "shuffled_r2": shuffled.get("r2"),
                   "shuffled_readout_acc": pooled_readout(shuffled.get("readout_acc")),
                   "swap_edit_success": edit.get("success"),
                   "swap_edit_random_flip": ((edit.get("flip") or {}).get("nulls") or {}).get("random_direction")
                   if name == "trainable" else None}
        out[name] = {key: [round(m["ci"][0], 4), round(m["ci"][1], 4)] for key, m in metrics.items()
                     if m and m.get("ci") and None not in m["ci"][:2] and key in result["table"][name]}
    return out


def legend(key: str) -> str:
    """What a measure of the analysis table means (``LEGEND``; the swap rows by their prefix)."""
    for prefix in ("swap_after", "random_init_after"):
        if key.startswith(prefix + "_"):
            return LEGEND[prefix]
    return LEGEND.get(key, "")


def table_markdown(table: dict, intervals: dict) -> str:
    """The side-by-side table (a column per model, a row per measure; a 95% interval beside the numbers that
    have one), then what each column and each measure is."""
    names = list(table)
    keys = list(dict.fromkeys(k for row in table.values() for k in row))
    lines = [mech.compare(table, intervals)]
    lines += ["", "Columns: " + "; ".join(f"{name} = {MODELS.get(name, name)}" for name in names) + ". [95% "
              "interval] where measured (R^2: jackknife over subjects; accuracies: pooled over relations; swap "
              "edits: Wilson).", ""]
    lines += [f"* {key}: {legend(key)}" for key in keys]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """A short Markdown summary of an analysis (the side-by-side table and the ablation matrices)."""
    t = result["task"]
    mc = result["model_config"]
    lines = [f"# Mechanisms of {result['run_dir']}", "",
             f"N={t['n_subjects']} subjects, R={t['n_relations']} relations ({t['kind']}), d={mc['d_model']}, "
             f"d_mlp={mc['d_mlp']}, attention={mc['attention']}; analysis took {result.get('wall_s')} s.", "",
             result["table_md"], ""]
    for name, sel in result["selector"].items():
        for key, what in (("ablation_drop", "units assigned to relation r"),
                          ("exclusive_ablation_drop", "units exclusive to relation r"),
                          ("random_ablation_drop", "as many random live units")):
            mat = sel[key]
            lines += [f"Ablation drop matrix, {name}, {what} zeroed (row r; column: accuracy drop on r'):", "",
                      "| r \\ r' | " + " | ".join(str(i) for i in range(len(mat))) + " |", "|---|" + "---|" * len(mat)]
            lines += [f"| {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |" for i, row in enumerate(mat)]
            lines.append("")
    lines += [f"![{p}]({os.path.basename(p)})" for p in result.get("plots", [])]
    return "\n".join(lines) + "\n"
