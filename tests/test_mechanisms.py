"""Mechanism analyses of small trained synthetic models (each trains in a few seconds on one thread)."""
import json
import os

import pytest
import torch

from llmprobe.model.random_init import random_init
from synthetic import mechanisms as M
from synthetic.analyze import analyze, control_config, train_control
from synthetic.multihop import MultihopConfig, run_multihop, smallest_on_grid
from synthetic.swap import freeze_and_swap, new_table
from synthetic.tasks import random_bijections, random_khop
from synthetic.train import TrainConfig, train

N, R, D = 64, 4, 32


@pytest.fixture(scope="module")
def task():
    return random_bijections(N, R, seed=0)


@pytest.fixture(scope="module")
def trainable(task):
    # past 100% with a small weight decay: the random init leaves e_s and the superposition shows
    cfg = TrainConfig(lr=0.03, max_steps=600, weight_decay=1e-4, target_acc=1.01, progress=False)
    res = train(task, D, d_mlp=4 * D, config=cfg)
    assert res.accuracy == 1.0
    return res.model.eval()


@pytest.fixture(scope="module")
def frozen_all(task, trainable):
    model, info = train_control(task, trainable.config, TrainConfig(lr=0.03, max_steps=300, progress=False),
                                "frozen_all")
    assert info["accuracy"] == 1.0
    return model


def test_local_table_maps_global_ids_per_relation():
    from synthetic.tasks import random_functions

    t = random_functions(10, 2, [3, 4], seed=1)
    A = M.local_table(t)
    assert A[:, 0].max() < 3 and A[:, 1].max() < 4
    for r in range(2):
        assert torch.equal(t.relation_attributes(r)[A[:, r]], t.table[:, r])


def test_readout_trainable_beats_frozen_all_and_shuffled(task, trainable, frozen_all):
    out = M.superposition(trainable, task, nulls={"frozen_all": frozen_all}, n_boot=50, max_edits=64)
    s = out["summary"]
    assert s["real"]["readout_acc"] > 0.5 and s["real"]["r2"] > 0.6
    assert s["shuffled"]["readout_acc"] < 0.1 and abs(s["shuffled"]["r2"]) < 0.05
    assert s["frozen_all"]["readout_acc"] < 0.1 and abs(s["frozen_all"]["r2"]) < 0.05
    json.dumps(out)                                       # JSON-ready
    se = out["swap_edit"]
    assert se["n_edits"] > 0 and all(se[k]["n"] == se["n_edits"] for k in ("flip", "others_kept", "success"))
    assert se["success"]["value"] >= se["flip"]["nulls"]["random_direction"]["value"]


def planted_selector(n_subjects: int = 60, n_relations: int = 3, n_attr: int = 4, spare: int = 16, seed: int = 0):
    """A hand-built one-layer selector with an exact, causal superposition: relation r's K attributes own block r
    of the residual (u_(r,a) = the one-hot of dim r*K + a), e_s = sum_r u_(r, a_r(s)), relation r's embedding is a
    gate channel (10 at the MLP input), and MLP unit (r, a) fires only for relation r and copies dim r*K + a up
    10-fold. Relation r answers the largest entry of block r (5.5 against 0.5 elsewhere), so
    e_s + u_(r,a') - u_(r,a) must make r answer a' and leave every other relation's answer alone. ``spare`` unused
    dimensions (d > R*K, as in a real model)."""
    from synthetic.model import ModelConfig
    from synthetic.tasks import random_functions

    task = random_functions(n_subjects, n_relations, n_attr, seed=seed)
    R, K = n_relations, n_attr
    d = R * K + R + spare
    model = M.FactRecallModel(ModelConfig(n_subjects, R, task.n_outputs, d, d_mlp=R * K)).eval()
    E = torch.zeros(n_subjects, d)
    E[torch.arange(n_subjects)[:, None], M.local_table(task) + torch.arange(R) * K] = 1.0
    gate = 10.0                                                  # the queried relation's channel at the MLP
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.subject_embed.copy_(E)
        model.relation_embed[torch.arange(R), R * K + torch.arange(R)] = gate / 1.5   # last state: 1.5 x_r
        unembed = torch.zeros(task.n_outputs, d)
        for r in range(R):
            unembed[task.relation_attributes(r), r * K + torch.arange(K)] = 1.0
            for a in range(K):
                unit = r * K + a
                model.W_in[unit, unit] = 1.0                      # reads 0.5 e_s at its dim ...
                model.W_in[R * K + r, unit] = 1.0                 # ... and is open only when relation r is asked
                model.b_in[unit] = -gate
                model.W_out[unit, unit] = 10.0
        model.unembed_weight.copy_(unembed)
    assert M.accuracy_by_relation(model, task).min() == 1.0
    return model, task


def test_swap_edit_flips_relation_r_on_a_planted_selector_and_a_random_direction_does_not():
    model, task = planted_selector()
    se = M.swap_edits(model, task, max_edits=60)
    n = se["n_edits"]
    assert n == 60
    for key in ("flip", "others_kept", "success"):
        m = se[key]
        assert m["value"] == 1.0 and m["n"] == n and m["interval"] == "wilson"
        assert m["ci"][0] < 1.0 == m["ci"][1] and m["primary_null"] == "random_direction"
    rand = {key: se[key]["nulls"]["random_direction"] for key in ("flip", "others_kept", "success")}
    assert rand["flip"]["n"] == n and rand["flip"]["value"] <= 0.05 and rand["success"]["value"] <= 0.05
    assert rand["success"]["ci"][1] < se["success"]["ci"][0]           # the intervals do not overlap
    assert rand["others_kept"]["value"] >= 0.95          # same norm, no direction: (almost) nothing moves
    # the untrained model of the same architecture has nothing to edit
    untrained = M.swap_edits(random_init(model, model.config.seed + 1), task, max_edits=60)
    assert untrained["success"]["value"] < 0.1


def test_random_init_control_is_the_config_rebuilt_with_a_new_seed(trainable):
    """The synthetic random-init control is llmprobe.model.random_init.random_init: the architecture rebuilt from
    its config with the given seed; the global RNG is not touched."""
    from synthetic.model import ModelConfig

    state = torch.random.get_rng_state()
    fresh = random_init(trainable, trainable.config.seed + 5)
    assert torch.equal(torch.random.get_rng_state(), state) and not fresh.training
    assert fresh.config == ModelConfig.from_dict({**trainable.config.to_dict(), "seed": trainable.config.seed + 5})
    expected = M.FactRecallModel(fresh.config)
    for (name, a), b, t in zip(fresh.named_parameters(), expected.parameters(), trainable.parameters()):
        assert torch.equal(a, b), name                   # exactly the model's own init at that seed ...
        assert a.shape == t.shape and not torch.equal(a, t), name   # ... not the trained weights


def test_selector_ablation_matrix_is_diagonal_dominant(task, trainable, frozen_all):
    sel = M.selector(trainable, task)
    st = sel.pop("_unit_stats")
    assert st["rate"].shape == (R, trainable.config.d_mlp)
    assert sel["ablation"]["diagonal_dominant"], sel["ablation_drop"]
    assert sel["ablation"]["diag_minus_offdiag"] > sel["random_ablation"]["diag_minus_offdiag"] + 0.2
    # gates are set by the relation: a mask from another subject (same relation) keeps the answers
    gt = sel["gate_transplant"]
    assert gt["same_relation"] > 0.9 and gt["same_subject"] < 0.3
    assert sel["relation_patch"]["follows_new"] > 0.95
    # the frozen_all model's gates are subject-specific
    kv = M.selector(frozen_all, task)
    assert kv["gate_transplant"]["same_relation"] < gt["same_relation"] - 0.3
    assert kv["relation_gating"]["mean"] < sel["relation_gating"]["mean"]
    json.dumps({k: v for k, v in sel.items()})


def test_diagonal_dominance_helper():
    d = M.diagonal_dominance(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))
    assert d["diagonal_dominant"] and d["dominant_rows"] == 2
    d = M.diagonal_dominance(torch.tensor([[0.1, 0.9], [0.2, 0.8]]))
    assert not d["diagonal_dominant"] and d["dominant_rows"] == 1


def test_logit_attribution_splits_own_and_cross(task, trainable):
    la = M.logit_attribution(trainable, task)
    assert min(la["operator_r2"]) > 0.95                  # linear in e_s once the relation is fixed
    assert la["own"] > 0
    assert abs(la["cross_total_new"]) < 0.5 * la["own"]   # no cross help on a table it never saw


def test_freeze_and_swap_zero_shot_beats_random_init(task, trainable):
    out = freeze_and_swap(trainable, task, steps=(0, 25))
    zs = out["zero_shot"]
    assert zs["old_table"] > 0.95                          # the fit reproduces the trained facts
    assert zs["swap"] > zs["random_init"] + 0.2, zs        # wide margin over re-initialisation
    assert zs["swap"] > 10 * out["chance"]
    assert out["curves"]["swap"]["25"] >= zs["swap"]
    fresh = new_table(task, seed=1)
    assert not torch.equal(fresh.table, task.table)
    assert all(torch.equal(fresh.table[:, r].sort().values, task.table[:, r].sort().values) for r in range(R))


def test_freeze_and_swap_scores_a_tie_as_wrong(task, trainable):
    """Zero subject embeddings and a zero MLP: every answer's logits tie (up to the unembedding bias, zeroed too), so
    strict argmax scores 0, where counting ties as correct (``pt >= max``) scored 1.0."""
    from synthetic.swap import train_subjects, with_subjects

    model = with_subjects(trainable, torch.zeros_like(trainable.subject_embed))
    with torch.no_grad():
        for p in model.parameters():
            if p is not model.subject_embed:
                p.zero_()
    assert train_subjects(model, task, steps=(0,))["accuracy"][0] == 0.0


def test_cot_solves_two_hop_where_direct_does_not():
    cfg = TrainConfig(lr=0.03, max_steps=800, schedule="constant", progress=False)
    accs = {}
    for cot in (False, True):
        t = random_khop(32, 4, 2, cot=cot, seed=0)
        accs[cot] = train(t, 8, attention="learned", d_mlp=32, config=cfg).accuracy
    assert accs[True] == 1.0 and accs[False] < 0.9, accs


def test_smallest_on_grid():
    grid = [2, 4, 8, 16, 32, 64]
    for thr in (2, 5, 16, 64):
        calls = []
        v, tried = smallest_on_grid(lambda d: calls.append(d) or d >= thr, grid, start=8)
        assert v == min(g for g in grid if g >= thr)
        assert len(set(calls)) == len(calls)                # no point trained twice
    assert smallest_on_grid(lambda d: False, grid)[0] is None


def test_monotone_violations():
    from synthetic.multihop import _violations

    pts = [{"hops": 2, "cot": False, "seed": 0, "d": 4, "d_mlp": 16, "success": True},
           {"hops": 2, "cot": False, "seed": 0, "d": 8, "d_mlp": 32, "success": False},
           {"hops": 2, "cot": True, "seed": 0, "d": 16, "d_mlp": 64, "success": False}]
    bad = _violations(pts, mlp_ratio=4.0)
    assert [(b["d"], b["cot"]) for b in bad] == [(8, False)]


def test_multihop_runs_and_resumes(tmp_path):
    cfg = MultihopConfig(subjects=8, relations=2, hops=[1, 2], d_grid=[4, 8, 16], width_d=[8], m_grid=[4, 16, 64],
                         max_steps=150, lr=0.03)
    s = run_multihop(cfg, str(tmp_path), log=lambda m: None)
    assert [r["hops"] for r in s["d_star"]] == [1, 2] and s["n_points"] > 0
    assert os.path.exists(tmp_path / "points.jsonl") and os.path.exists(tmp_path / "table.md")
    again = run_multihop(cfg, str(tmp_path), log=lambda m: None)
    assert again["d_star"] == s["d_star"] and again["train_wall_s"] == s["train_wall_s"]   # nothing retrained


def test_analyze_writes_report(tmp_path):
    run = tmp_path / "run"
    spec = {"subjects": 24, "relations": 2, "d": 16, "d_mlp": 32,
            "train_config": TrainConfig(lr=0.03, max_steps=120, weight_decay=1e-4, target_acc=1.01, progress=False)}
    res = analyze(str(run), nulls=("frozen_all",), n_boot=20, swap_steps=(0, 5), img_dir=str(tmp_path / "img"),
                  train_spec=spec, progress=False)
    obj = json.loads((run / "analysis.json").read_text())
    assert set(obj["table"]) == {"trainable", "frozen_all", "untrained"}
    assert obj["selector"]["trainable"]["ablation"]["n_rows"] == 2
    assert "swap" in obj and "logit_attribution" in obj
    for name in ("readout", "selector", "ablation", "swap"):
        assert (run / f"analysis_{name}.png").exists() and (tmp_path / "img" / f"mech_{name}.png").exists()
    assert (run / "analysis.md").read_text().startswith("# Mechanisms")
    assert res["table"]["trainable"]["train_accuracy"] == 1.0
    with pytest.raises(ValueError):
        analyze(str(tmp_path / "empty"), progress=False)


def test_control_config_freezes_parts(trainable):
    assert control_config(trainable.config, "frozen").frozen_subjects
    kv = control_config(trainable.config, "frozen_all")
    assert kv.frozen_subjects and kv.frozen_unembed and kv.d_model == trainable.config.d_model


def test_cli_registers_every_synth_subcommand():
    """synthetic.cli.add_parser alone registers the whole synth group; a bad int list is a usage error (2)."""
    import argparse

    from synthetic.cli import add_parser, cmd_analyze, cmd_multihop

    parser = argparse.ArgumentParser(prog="llmprobe")
    synth = add_parser(parser.add_subparsers(dest="command"))
    assert set(synth.synth_subparsers.choices) == {"train", "sweep", "construct", "bounds", "analyze", "swap-sweep",
                                                   "multihop", "multihop-seeds"}
    for bad in (["multihop", "--out", "X", "--hops", "1,x"], ["multihop-seeds", "--out", "X", "--seeds", "-1"],
                ["swap-sweep", "OUT", "--relations", ""]):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["synth", *bad])
        assert stop.value.code == 2
    args = parser.parse_args(["synth", "analyze", "RUN", "--controls", "frozen_all", "-N", "16", "-R", "2",
                              "--d", "8"])
    assert args.func is cmd_analyze and args.run_dir == "RUN" and args.subjects == 16
    args = parser.parse_args(["synth", "multihop", "--out", "X", "--hops", "1,2"])
    assert args.func is cmd_multihop and args.hops == "1,2"
