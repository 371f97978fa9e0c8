"""Freeze-and-swap: the construction positive control (exact), random re-init at chance, a trained model's encoders
on its own table, and the sweep's summary intervals."""
import math

import pytest
import torch

from synthetic.construction import build_construction
from synthetic.swap import (
    construction_control,
    construction_embeddings,
    freeze_and_swap,
    new_table,
    summarize_sweep,
    with_subjects,
)
from synthetic.tasks import random_bijections
from synthetic.train import TrainConfig, train


def _acc(model, task):
    data = task.data()
    return float((model.predict(data.input_ids, data.target_pos) == data.targets).float().mean())


def test_construction_control_is_exact_and_reinit_at_chance():
    task = random_bijections(64, 3, 0)
    out = construction_control(task, seed=7, steps=(0,))
    assert out["trained_table_accuracy"] == 1.0
    assert out["zero_shot"]["native"] == 1.0          # the construction's own codes of a new table: exact
    assert out["zero_shot"]["swap"] == 1.0            # (a) the least-squares fit recovers the codes
    assert out["zero_shot"]["construction"] == 1.0    # (b) the construction rule from the read-out maps
    assert out["zero_shot"]["random_init"] <= 0.06    # (c) chance is 1/64; 192 facts
    assert out["chance"] == pytest.approx(1 / 64, abs=1e-4)
    assert out["crosstalk"]["readout_overlap"] < 1e-3   # the construction's relation read-outs do not overlap
    assert out["crosstalk"]["own_only"] == 1.0


def test_new_table_needs_new_codes():
    """The construction with the *trained* table's codes answers a new table at about chance: the swap carries
    the facts, nothing else does."""
    task = random_bijections(64, 3, 0)
    fresh = new_table(task, 7)
    model = build_construction(task, 2).float()
    assert (fresh.table != task.table).float().mean() > 0.9
    assert _acc(model, fresh) < 0.1
    assert _acc(with_subjects(model, build_construction(fresh, 2).float().subject_embeddings()), fresh) == 1.0


def test_trained_model_encoders_reproduce_their_own_table():
    torch.manual_seed(0)
    task = random_bijections(32, 2, 0)
    res = train(task, 16, config=TrainConfig(lr=0.03, max_steps=300, weight_decay=1e-4, target_acc=1.01,
                                             progress=False), seed=0)
    model = res.model.eval()
    assert res.to_dict()["accuracy"] == 1.0
    out = freeze_and_swap(model, task, seed=5, steps=(0, 25),
                          conditions=("swap", "random_init", "old_table", "construction_old"))
    assert out["zero_shot"]["old_table"] >= 0.95
    assert out["zero_shot"]["construction_old"] >= 0.95
    assert out["zero_shot"]["random_init"] <= 0.15     # chance 1/32 on 64 facts
    assert out["zero_shot"]["swap"] > out["zero_shot"]["random_init"]
    E = construction_embeddings(model, task, new_table(task, 5))
    assert E.shape == (32, 16) and torch.isfinite(E).all()


def test_summary_t_interval():
    rows = [{"key": f"N8_R1_trainable_x1_s{s}_wd0_t10", "mode": "trainable", "seed": s, "N": 8, "R": 1, "ratio": 1,
             "chance": 0.125, "zero_shot": {"swap": v}, "curves": {"swap": {"0": v}}, "steps_to_100": {"swap": None},
             "train_accuracy": 1.0} for s, v in enumerate((0.1, 0.2, 0.3))]
    g = summarize_sweep(rows)["settings"]["N8_R1_trainable_x1_wd0_t10"]
    z = g["conditions"]["swap"]["zero_shot"]
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert z["mean"] == pytest.approx(0.2) and z["n"] == 3
    assert z["ci"] == pytest.approx([max(0.0, 0.2 - half), 0.2 + half], abs=1e-4)    # clipped at 0
    assert g["seeds"] == [0, 1, 2]
