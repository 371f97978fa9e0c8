"""Synthetic factual recall: tasks, model, training, resume, sweeps, construction, bounds, CLI (fast, CPU)."""
import argparse
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from synthetic import bounds
from synthetic.construction import build_construction, construction_accuracy, quantize_, smallest_construction
from synthetic.model import HOOK_NAMES, FactRecallModel, ModelConfig, softmax_cross_entropy
from synthetic.sweep import (
    Bisection,
    SweepConfig,
    cell_task,
    config_key,
    find_threshold,
    fit_constant,
    fit_trend,
    load_results,
    run_sweep,
    summarize,
    thresholds,
)
from synthetic.tasks import FactTask, from_fact_table, random_bijections, random_functions, random_khop
from synthetic.train import TrainConfig, load_run, lr_at, train


# ----------------------------------------------------------------------------- tasks
def test_bijections_are_seeded_and_bijective():
    a, b, c = random_bijections(50, 3, seed=1), random_bijections(50, 3, seed=1), random_bijections(50, 3, seed=2)
    assert torch.equal(a.table, b.table) and not torch.equal(a.table, c.table)
    assert a.table.shape == (50, 3) and a.n_outputs == 50 and a.n_facts == 150
    for r in range(3):
        assert sorted(a.table[:, r].tolist()) == list(range(50))
    data = a.data()
    assert data.input_ids.shape == (150, 2) and data.targets.shape == (150, 1)
    s, r = data.input_ids[:, 0], data.input_ids[:, 1] - 50
    assert torch.equal(a.table[s, r], data.targets[:, 0])
    assert math.isclose(a.bits(), 3 * math.lgamma(51) / math.log(2), rel_tol=1e-9)


def test_general_tables_functions_and_fact_table():
    t = random_functions(40, 3, [2, 5, 7], seed=0)
    assert t.n_outputs == 14 and t.table.max() < 14
    assert set(t.table[:, 1].tolist()) <= set(t.attr_index[1].tolist())
    assert torch.equal(t.table, random_functions(40, 3, [2, 5, 7], seed=0).table)
    # an llmprobe.datasets.FactTable-shaped object (contract: subjects, relations, attributes, table with -1)
    ft = SimpleNamespace(subjects=["France", "Peru", "Chile"], relations=["capital", "language"],
                         attributes=[["Paris", "Lima", "Santiago"], ["French", "Spanish"]],
                         table=torch.tensor([[0, 0], [1, 1], [2, -1]]))
    task = from_fact_table(ft)
    assert task.n_facts == 5 and task.n_outputs == 5
    assert task.attributes[int(task.table[1, 1])] == "Spanish" and int(task.table[2, 1]) == -1
    assert task.data().input_ids.shape == (5, 2)
    # bits: capital is a bijection on 3 (log2 3!), language has counts {1, 1} over 2 subjects (log2 2!)
    assert math.isclose(task.bits(), math.log2(6) + math.log2(2), rel_tol=1e-9)
    again = FactTask.from_json(json.loads(json.dumps(task.to_json())))
    assert torch.equal(again.table, task.table) and again.attributes == task.attributes



def test_joint_bits_charge_a_relation_that_is_a_function_of_another_only_for_the_function():
    """continent is a function of subregion (6 subjects, 3 subregions -> 2 continents): jointly it costs the
    3 subregions' map onto the continents, log2(3! / (2! 1!)), not the 6 subjects' log2(6! / (4! 2!)); a subject
    without a subregion fact is a group of its own."""
    def multinomial(*counts):
        return (math.lgamma(sum(counts) + 1) - sum(math.lgamma(k + 1) for k in counts)) / math.log(2)

    capital = torch.arange(6)
    subregion = torch.tensor([0, 0, 1, 1, 2, 2])
    continent = torch.tensor([0, 0, 0, 0, 1, 1])                # subregions 0, 1 -> continent 0; 2 -> 1
    task = FactTask(torch.stack([capital, 6 + subregion, 9 + continent], dim=1), n_outputs=11)
    assert math.isclose(task.bits(), multinomial(*[1] * 6) + multinomial(2, 2, 2) + multinomial(4, 2), rel_tol=1e-12)
    assert math.isclose(task.bits_joint(), multinomial(*[1] * 6) + multinomial(2, 2, 2) + multinomial(2, 1),
                        rel_tol=1e-12)
    # the subregion of subject 5 unknown: it is a group of its own (continent 1), so 4 groups -> (2, 2)
    task.table[5, 1] = -1
    assert math.isclose(task.bits_joint(), multinomial(*[1] * 6) + multinomial(2, 2, 1) + multinomial(2, 2),
                        rel_tol=1e-12)
    # continent no longer a function of subregion (subjects 0 and 1 differ): no discount
    task.table[5, 1], task.table[1, 2] = 8, 10
    assert math.isclose(task.bits_joint(), task.bits(), rel_tol=1e-12)


@pytest.mark.parametrize("make", [lambda: random_bijections(64, 5, seed=3),
                                  lambda: random_functions(193, 6, [193, 6, 73, 141, 191, 22], seed=0)])
def test_joint_bits_of_independent_maps_are_their_sum(make):
    """A relation that is a function of a bijection costs what it costs alone, and independent random maps are
    not functions of one another: R bijections carry R log2 N! jointly too."""
    task = make()
    assert task.bits_joint() == pytest.approx(task.bits(), abs=1e-6)


def test_khop_answers_compose_the_maps():
    task = random_khop(30, 3, hops=2, seed=4)
    data = task.data()
    assert data.input_ids.shape == (30 * 9, 3)
    T = task.base.table
    s, r1, r2 = data.input_ids[:, 0], data.input_ids[:, 1] - 30, data.input_ids[:, 2] - 30
    assert torch.equal(data.targets[:, 0], T[T[s, r1], r2])
    assert int(data.target_pos[0]) == 2


def test_cot_sequences_emit_intermediates():
    task = random_khop(20, 2, hops=3, cot=True, seed=0)
    data = task.data()
    assert data.input_ids.shape == (20 * 8, 6) and data.targets.shape == (20 * 8, 3)
    assert data.target_pos.tolist() == [3, 4, 5]
    T = task.base.table
    s = data.input_ids[:, 0]
    rel = data.input_ids[:, 1:4] - 20
    e1 = T[s, rel[:, 0]]
    e2 = T[e1, rel[:, 1]]
    e3 = T[e2, rel[:, 2]]
    assert torch.equal(data.input_ids[:, 4], e1) and torch.equal(data.input_ids[:, 5], e2)
    assert torch.equal(data.targets, torch.stack([e1, e2, e3], 1))


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("attention", ["uniform", "learned"])
def test_model_shapes_and_hook_points(attention):
    cfg = ModelConfig(n_subjects=10, n_relations=3, n_outputs=7, d_model=8, max_len=4, attention=attention)
    model = FactRecallModel(cfg)
    ids = torch.tensor([[0, 11, 12, 3], [4, 10, 10, 5]])
    logits = model(ids)
    assert logits.shape == (2, 4, 7)
    points = model.hook_points()
    assert tuple(points) == HOOK_NAMES
    seen = {}
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.shape)) for n, m in points.items()]
    model(ids)
    for h in handles:
        h.remove()
    assert set(seen) == set(HOOK_NAMES)
    assert seen["blocks.0.mlp_hidden"] == (2, 4, 64) and seen["blocks.0.resid_post"] == (2, 4, 8)
    # the training path (states at target positions only) agrees with the full forward
    pos = torch.tensor([1, 3])
    states = model.final_states(ids, pos)
    assert torch.allclose(model.unembed(states), logits[:, pos], atol=1e-5)
    assert model.subject_embeddings().shape == (10, 8) and model.attribute_vectors().shape == (7, 8)
    # editing a hook's output changes what follows (hooks sit on the real tensors)
    handle = points["blocks.0.resid_mid"].register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    assert not torch.allclose(model(ids), logits)
    handle.remove()


def test_capture_reads_the_synthetic_model():
    capture = pytest.importorskip("llmprobe.model.capture")
    model = FactRecallModel(ModelConfig(n_subjects=6, n_relations=2, n_outputs=6, d_model=4))
    ids = torch.tensor([[0, 6], [5, 7]])
    got = capture.capture(model, ["blocks.0.resid_post", "blocks.0.resid_pre"], ids)
    x = model.embed(ids)
    assert torch.allclose(got["blocks.0.resid_pre"], x)
    assert torch.allclose(model.unembed(got["blocks.0.resid_post"]), model(ids), atol=1e-5)


def test_fused_cross_entropy_matches_torch():
    torch.manual_seed(0)
    h = torch.randn(70, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (70,))
    loss, correct = softmax_cross_entropy(h, w, None, y, chunk=16)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.nn.functional.cross_entropy(h @ w.T, y)
    ref.backward()
    assert torch.allclose(loss, ref) and torch.allclose(gh, h.grad) and torch.allclose(gw, w.grad)
    assert int(correct) == int(((h @ w.T).argmax(1) == y).sum())


def test_one_cross_entropy_kernel_for_one_model_and_a_stack():
    """softmax_cross_entropy takes one model ([B, d]) or a stack ([M, B, D], synthetic.batched): each stacked model
    gets its own loss, correct count and gradients, as alone (with a bias, in chunks)."""
    torch.manual_seed(0)
    h = torch.randn(3, 50, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 11, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (3, 50))
    loss, correct = softmax_cross_entropy(h, w, b, y, chunk=16)
    assert loss.shape == correct.shape == (3,)
    (loss * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    for i in range(3):
        hi, wi, bi = (t.detach()[i].clone().requires_grad_() for t in (h, w, b))
        one, right = softmax_cross_entropy(hi, wi, bi, y[i], chunk=16)
        ((i + 1.0) * one).backward()
        assert torch.allclose(loss[i], one) and int(correct[i]) == int(right)
        assert torch.allclose(h.grad[i], hi.grad) and torch.allclose(w.grad[i], wi.grad)
        assert torch.allclose(b.grad[i], bi.grad)


def test_a_tie_is_not_correct():
    """Strict argmax: with identical unembedding rows every logit ties, and no prediction counts as correct."""
    h = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    _, correct = softmax_cross_entropy(h, torch.ones(3, 4), None, y, chunk=4)
    assert int(correct) == 0
    w = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]])    # outputs 0 and 1 tie, 2 is apart
    _, correct = softmax_cross_entropy(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]), w, None,
                                       torch.tensor([0, 2]))
    assert int(correct) == 1                                                # only the untied row is right


def test_correct_count_is_the_strict_argmax_with_ties_and_saturated_rows():
    """The count equals "the target's logit is the row's unique maximum" on logits with many ties (small integers),
    rows saturated to probability exactly 1 and 0 (float32 underflow) and a tie at the top beside the target, for
    one model and a stack."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (3, 40, 7), generator=g).float()          # ties everywhere
    logits[:, 0] = torch.tensor([300.0, 0, 0, 0, 0, 0, 0])                  # p = 1.0 exactly at output 0
    logits[:, 1] = torch.tensor([0.0, 300, 0, 0, 0, 0, 0])                  # p = 0.0 at output 0 (the target)
    logits[:, 2] = torch.tensor([0.0, 5, 5, 0, 0, 0, 0])                    # the top tied, the target below
    y = torch.randint(0, 7, (3, 40), generator=g)
    y[:, :3] = 0
    top = logits.amax(-1, keepdim=True)
    strict = ((logits.gather(-1, y[..., None]) == top)[..., 0] & ((logits == top).sum(-1) == 1)).sum(-1)
    h, w = logits, torch.eye(7).expand(3, 7, 7).contiguous()               # h @ w.T = the logits
    _, correct = softmax_cross_entropy(h, w, None, y, chunk=16)
    assert correct.tolist() == strict.tolist() and 0 < int(strict.sum()) < 120
    for i in range(3):
        assert int(softmax_cross_entropy(h[i], w[i], None, y[i], chunk=16)[1]) == int(strict[i])


# ----------------------------------------------------------------------------- training
def test_small_run_reaches_100_percent():
    task = random_bijections(64, 2, seed=0)
    res = train(task, 16, config=TrainConfig(max_steps=400, progress=False))
    assert res.success and res.accuracy == 1.0 and res.steps < 400
    assert res.n_trainable == res.n_params
    assert res.bits == pytest.approx(2 * math.log2(math.factorial(64)), abs=0.1)
    assert math.isclose(res.bits_per_param, res.bits / res.n_trainable, rel_tol=1e-3)
    data = task.data()
    pred = res.model.predict(data.input_ids, data.target_pos)
    assert torch.equal(pred, data.targets)


def test_training_goes_past_the_first_fit_by_the_stated_budget():
    """past_fit = k: k more steps after the first step at 100% (fit_step), the model there kept in a snapshot;
    None (the sweep's rule): stop at that step, with the very parameters of the snapshot at 0."""
    task = random_bijections(64, 2, seed=0)
    stop = train(task, 32, config=TrainConfig(max_steps=400, progress=False))
    past = train(task, 32, config=TrainConfig(max_steps=400, progress=False, past_fit=60), snapshot_at=(0, 30))
    assert stop.success and stop.fit_step == stop.steps < 100
    assert past.success and past.fit_step == stop.fit_step and past.steps == stop.fit_step + 60
    assert sorted(past.snapshots) == [0, 30] and stop.snapshots == {}
    assert torch.equal(past.snapshots[0]["subject_embed"], stop.model.subject_embed.detach())
    moved = (past.model.subject_embed.detach() - past.snapshots[0]["subject_embed"]).norm()
    assert moved > 0.1 * past.snapshots[0]["subject_embed"].norm()     # the embeddings move on after the fit
    capped = train(task, 32, config=TrainConfig(max_steps=400, progress=False, past_fit=1000))
    assert capped.steps == 400 and capped.fit_step == stop.fit_step                       # the cap still holds
    never = train(task, 2, config=TrainConfig(max_steps=30, progress=False, past_fit=60))
    assert never.fit_step is None and not never.success and never.steps == 30


def test_frozen_subjects_do_not_change():
    task = random_bijections(32, 2, seed=0)
    model = FactRecallModel(ModelConfig(n_subjects=32, n_relations=2, n_outputs=32, d_model=8,
                                        frozen_subjects=True))
    before = model.subject_embed.detach().clone()
    unemb = model.unembed_weight.detach().clone()
    res = train(task, model=model, config=TrainConfig(max_steps=20, target_acc=1.1, progress=False))
    assert res.steps == 20 and not model.subject_embed.requires_grad
    assert torch.equal(model.subject_embed, before)
    assert not torch.equal(model.unembed_weight, unemb)
    assert res.n_trainable == res.n_params - 32 * 8


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    task = random_bijections(32, 2, seed=3)
    cfg = TrainConfig(max_steps=40, target_acc=1.1, progress=False, lr=0.05)
    full = train(task, 8, config=cfg, out_dir=str(tmp_path / "a"))

    def interrupt(step, loss, acc):
        if step == 17:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, 8, config=cfg, out_dir=str(tmp_path / "b"), callback=interrupt)
    state = json.load(open(tmp_path / "b" / "checkpoint.json"))
    assert state["step"] == 17
    resumed = train(task, 8, config=cfg, out_dir=str(tmp_path / "b"))
    assert resumed.steps == full.steps == 40
    for (n, p), (_, q) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n
    model, task2, info = load_run(str(tmp_path / "b"))
    assert torch.equal(task2.table, task.table) and info["steps"] == 40
    assert torch.equal(model.W_in, resumed.model.W_in)


def test_minibatch_training_and_schedule():
    cfg = TrainConfig(max_steps=100, warmup_frac=0.1, lr=1.0, min_lr_frac=0.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.0, abs=1e-9)
    task = random_bijections(48, 2, seed=0)
    res = train(task, 16, config=TrainConfig(max_steps=1500, batch_size=32, progress=False))
    assert res.success


# ----------------------------------------------------------------------------- sweep
def test_sweep_bisects_and_resumes(tmp_path, monkeypatch):
    cfg = SweepConfig(subjects=[32], relations=[2], seeds=[0], modes=["trainable"], d_min=2, d_max=24,
                      train=TrainConfig(max_steps=300, progress=False))
    out = str(tmp_path / "sweep")
    summary = run_sweep(cfg, out)
    rows = load_results(out)
    assert rows and all("key" in r and r["config"] == config_key(cfg) for r in rows)
    th = thresholds(rows)[(32, 2, 0, "trainable", config_key(cfg))]
    d_star = th["d_star"]
    assert d_star is not None and th["exact"] and th["inits_failed_below"] == 2
    below = [r for r in rows if r["d_model"] == d_star - 1]      # d*-1 trained with two initialisations
    assert sorted(r["init"] for r in below) == [0, 1] and not any(r["success"] for r in below)
    assert [c for c in summary["cells"] if c["mode"] == "trainable"][0]["d_star"] == [d_star]
    assert summary["fit"]["trainable"]["c_by_n"]["32"]["value"] == pytest.approx(d_star / (2 * 5))
    assert os.path.exists(os.path.join(out, "table.md")) and os.path.exists(os.path.join(out, "dstar_vs_RlogN.png"))
    # a rerun trains nothing new
    import synthetic.sweep as sw

    def boom(*a, **k):
        raise AssertionError("resumed sweep retrained a finished point")

    monkeypatch.setattr(sw, "_run_point", boom)
    run_sweep(cfg, out)
    assert len(load_results(out)) == len(rows)


def test_sweep_of_general_maps_trains_functions_and_keeps_them_apart(tmp_path):
    """--maps functions: the cell's table is R random many-to-one maps with the given attribute counts (fewer bits
    than bijections, so a smaller d*), its points keyed apart from the bijections' of the same cell."""
    base = dict(subjects=[32], relations=[2], seeds=[0], modes=["trainable"], d_min=1, d_max=24,
                train=TrainConfig(max_steps=300, progress=False))
    functions = SweepConfig(**base, maps="functions", n_attributes=[4])
    bijections = SweepConfig(**base)
    task = cell_task(32, 2, 0, functions)
    assert task.kind == "function" and [len(a) for a in task.attr_index] == [4, 4] and task.n_outputs == 8
    assert task.bits() < 0.5 * cell_task(32, 2, 0, bijections).bits()
    assert config_key(functions) != config_key(bijections)
    out = str(tmp_path / "functions")
    summary = run_sweep(functions, out)
    rows = load_results(out)
    assert rows and all(r["maps"] == "functions" and r["n_attributes"] == [4] for r in rows)
    assert all(r["bits"] == pytest.approx(task.bits(), abs=0.1) for r in rows)
    cell = summary["cells"][0]
    assert summary["config"]["maps"] == "functions" and cell["d_star"]
    run_sweep(bijections, str(tmp_path / "bijections"))
    d_bij = thresholds(load_results(str(tmp_path / "bijections")))[(32, 2, 0, "trainable", config_key(bijections))]
    assert cell["d_star"][0] < d_bij["d_star"]
    with pytest.raises(ValueError, match="kind of map"):
        cell_task(32, 2, 0, SweepConfig(maps="surjections"))


def _monotone(threshold, calls=None):
    def train_fn(d, init):
        if calls is not None:
            calls.append((d, init))
        return d >= threshold
    return train_fn


def _fails_once_at(threshold):
    """Success iff d >= threshold, except the first initialisation at the threshold itself (a noisy failure)."""
    return lambda d, init: d >= threshold and (d, init) != (threshold, 0)


@pytest.mark.parametrize("threshold", [3, 7, 10, 37, 100, 128])
@pytest.mark.parametrize("start", [2, 12, 128])
def test_bisection_finds_a_monotone_threshold(threshold, start):
    calls = []
    found = find_threshold(_monotone(threshold, calls), 2, 128, start)
    assert found["d_star"] == threshold and found["exact"]
    assert calls.count((threshold - 1, 1)) == 1                   # d*-1 confirmed with a second initialisation
    assert len(calls) == len(set(calls)) <= 16                    # nothing trained twice; a bisection, not a scan
    assert find_threshold(_monotone(200), 2, 128, start)["d_star"] is None        # nothing in range: censored
    low = find_threshold(_monotone(1), 2, 128, start)
    assert low["d_star"] == 2 and not low["exact"]                # d*-1 = 1 lies outside the range: not exact


@pytest.mark.parametrize("start,prior", [(16, False), (64, False), (4, False), (10, True), (12, True), (9, True)])
def test_bisection_survives_one_noisy_failure_at_the_threshold(start, prior):
    found = find_threshold(_fails_once_at(10), 2, 128, start, prior=prior)
    assert found["d_star"] == 10 and found["exact"], found["tried"]
    # with one initialisation the noisy failure would have returned 11 flagged exact (the old behaviour)
    assert find_threshold(_fails_once_at(10), 2, 128, 16, confirm=1)["d_star"] == 11


def test_bisection_api_step_by_step():
    search = Bisection(2, 64, start=8)
    assert search.next() == (8, 0)
    search.record(8, True)
    assert search.next() == (7, 0) and search.d_star == 8 and not search.exact
    search.record(7, False)
    assert search.next() == (7, 1)                 # confirm d*-1 with a second initialisation
    search.record(7, False, init=1)
    assert search.next() is None and search.d_star == 8 and search.exact


def test_one_width_config_for_sweep_controls_and_modes():
    """A search point's model (synthetic.sweep.width_config, what the sweep, its batched rounds and the matched
    controls train): the mode's frozen parts from llmprobe.names.EMBEDDING_MODES, the MLP rule, the init's seed."""
    from llmprobe.names import EMBEDDING_MODES, MATCHED_MODES, SWAP_MODES, SWEEP_MODES
    from synthetic import matched, swap
    from synthetic.model import mode_flags
    from synthetic.sweep import MODES, width_config

    task = random_bijections(16, 2, seed=0)
    mc = width_config(task, "frozen_all", 5, SweepConfig(mlp_ratio=8.0), seed=3, init=1)
    assert (mc.frozen_subjects, mc.frozen_unembed, mc.d_model, mc.d_mlp, mc.seed) == (True, True, 5, 40, 1003)
    mc = width_config(task, "frozen", 5, SweepConfig(d_mlp=7, attention="learned"))
    assert (mc.frozen_subjects, mc.frozen_unembed, mc.d_mlp, mc.attention, mc.seed) == (True, False, 7, "learned", 0)
    assert mode_flags("trainable") == {} and mode_flags("frozen_unembed") == {"frozen_unembed": True}
    with pytest.raises(ValueError, match="unknown embedding mode"):
        mode_flags("frozen_subjects")
    assert (MODES, matched.MODES, swap.MODES) == (SWEEP_MODES, MATCHED_MODES, SWAP_MODES)
    assert set(SWEEP_MODES) | set(MATCHED_MODES) | set(SWAP_MODES) == set(EMBEDDING_MODES)
    with pytest.raises(ValueError, match="unknown swap-sweep mode"):
        swap.sweep_points([256], [2], modes=("frozen_all",))


def test_sweep_figures_draw_without_pyplot(tmp_path):
    """synthetic.render draws with llmprobe.io.subplots: pyplot is never imported (so no backend is chosen)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from synthetic.render import sweep_figures\n"
            "rows = [{'n_subjects': 16, 'n_relations': 2, 'mode': m, 'd_model': d, 'accuracy': a}\n"
            "        for m in ('trainable', 'frozen') for d, a in ((2, 0.5), (4, 1.0))]\n"
            "cells = [{'N': 16, 'R': 2, 'mode': m, 'R_log2N': 8.0, 'd_star': [4], 'upper_bounds': []}\n"
            "         for m in ('trainable', 'frozen')]\n"
            "fit = {'c': {'value': 0.5}, 'r2': 0.9}\n"
            f"paths = sweep_figures(rows, {{'cells': cells, 'fit': {{'trainable': fit}}}}, {str(tmp_path)!r})\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n"
            "print(len(paths))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    assert all((tmp_path / name).stat().st_size > 1000 for name in ("accuracy_vs_d.png", "dstar_vs_RlogN.png"))


def test_later_seeds_do_not_inherit_a_wrong_exact_threshold(tmp_path, monkeypatch):
    """Seed 0 (d* 12) starts seed 1 (true d* 9, whose first initialisation fails once at 9)."""
    import synthetic.sweep as sw

    truth = {0: 12, 1: 9}

    def fake_point(N, R, seed, mode, d, cfg, init=0):
        ok = d >= truth[seed] and (seed, d, init) != (1, 9, 0)
        return {"n_subjects": N, "n_relations": R, "seed": seed, "init": init, "mode": mode, "d_model": d,
                "success": ok, "accuracy": 1.0 if ok else 0.9, "steps": 1, "wall_time_s": 0.0, "bits_per_param": 1.0,
                "key": sw.point_key(N, R, seed, mode, d, cfg, init), "config": sw.config_key(cfg)}

    monkeypatch.setattr(sw, "_run_point", fake_point)
    cfg = SweepConfig(subjects=[64], relations=[2], seeds=[0, 1], modes=["trainable"], d_max=64)
    out = str(tmp_path / "sweep")
    res = sw._sweep_unit((64, 2, "trainable", cfg, out, {}))
    assert [(r["d_star"], r["exact"]) for r in res] == [(12, True), (9, True)]
    th = thresholds(load_results(out))
    assert [th[(64, 2, s, "trainable", config_key(cfg))]["d_star"] for s in (0, 1)] == [12, 9]


def test_thresholds_keep_training_configs_apart():
    rows = [{"n_subjects": 8, "n_relations": 2, "seed": 0, "mode": "trainable", "d_model": d, "init": i,
             "success": d >= t, "config": c} for c, t in (("short", 6), ("long", 4)) for d in range(2, 9)
            for i in (0, 1)]
    th = thresholds(rows)
    assert th[(8, 2, 0, "trainable", "short")]["d_star"] == 6 and th[(8, 2, 0, "trainable", "long")]["d_star"] == 4
    assert all(t["exact"] for t in th.values())
    single = thresholds([r for r in rows if r["init"] == 0])     # one initialisation below d*: an upper bound only
    assert not any(t["exact"] for t in single.values()) and all(t["exact"] for t in thresholds(
        [r for r in rows if r["init"] == 0], confirm=1).values())


def test_fit_constant():
    pts = [(10.0, 2.0), (20.0, 4.0), (40.0, 8.0)]
    fit = fit_constant(pts, n_boot=200)
    assert fit.value == pytest.approx(0.2) and fit.ci[0] <= 0.2 <= fit.ci[1] and fit.n == 3


def _cells(c_of_n, noise=0.02, seeds=(0, 1)):
    rng = torch.Generator().manual_seed(0)
    return [(N, R, max(1, round(c * R * math.log2(N) * (1 + noise * float(torch.randn(1, generator=rng))))))
            for N, c in c_of_n.items() for R in (2, 4, 8, 16) for _ in seeds]


def test_fit_trend_recovers_a_constant_and_flags_none():
    fit = fit_trend(_cells({256: 0.2, 512: 0.2, 1024: 0.2}), n_boot=500)
    assert fit["c"]["value"] == pytest.approx(0.2, abs=0.01) and fit["n_cells"] == 24
    assert all(m["ci"][0] <= m["value"] <= m["ci"][1] and m["n"] == 8 for m in fit["c_by_n"].values())
    assert fit["p"]["ci"][0] <= 1.0 <= fit["p"]["ci"][1]
    assert not fit["drift"] and fit["drift_reason"].startswith("No drift")


def test_fit_trend_flags_a_rising_constant():
    """The issue's case: c per N rising 0.152 -> 0.175 -> 0.194 (N = 256, 512, 1024)."""
    fit = fit_trend(_cells({256: 0.152, 512: 0.175, 1024: 0.194}, noise=0.01), n_boot=500)
    by_n = {int(N): m["value"] for N, m in fit["c_by_n"].items()}
    assert by_n[256] == pytest.approx(0.152, abs=0.006) and by_n[1024] == pytest.approx(0.194, abs=0.006)
    assert fit["p"]["value"] > 1.5 and fit["p"]["ci"][0] > 1.0
    assert fit["drift"] and "N=256" in fit["drift_reason"] and "excludes 1" in fit["drift_reason"]


def test_summarize_keeps_to_one_config(tmp_path):
    from llmprobe.io import append_jsonl

    cfg = SweepConfig(subjects=[8], relations=[2], modes=["trainable"])
    other = SweepConfig(subjects=[8], relations=[2], modes=["trainable"], train=TrainConfig(max_steps=7))
    for c, t in ((cfg, 4), (other, 6)):
        for d in range(2, 9):
            for i in (0, 1):
                append_jsonl(str(tmp_path / "results.jsonl"), {
                    "n_subjects": 8, "n_relations": 2, "seed": 0, "mode": "trainable", "d_model": d, "init": i,
                    "success": d >= t, "config": config_key(c), "bits_per_param": 1.0, "steps": 1,
                    "wall_time_s": 0.1, "accuracy": 1.0})
    assert summarize(str(tmp_path), cfg)["cells"][0]["d_star"] == [4]
    # rows of a sweep older than recorded configs count for the config whose point key they carry
    import synthetic.sweep as sw

    for d in range(2, 9):
        append_jsonl(str(tmp_path / "results.jsonl"), {
            "n_subjects": 8, "n_relations": 2, "seed": 1, "mode": "trainable", "d_model": d, "success": d >= 5,
            "key": sw.point_key(8, 2, 1, "trainable", d, cfg), "bits_per_param": 1.0, "steps": 1,
            "wall_time_s": 0.1, "accuracy": 1.0})
    th = summarize(str(tmp_path), cfg)["cells"][0]
    assert th["d_star"] == [4] and th["upper_bounds"] == [5]         # one initialisation at d*-1: an upper bound
    summary = summarize(str(tmp_path), other)
    assert summary["cells"][0]["d_star"] == [6] and summary["other_configs"] == {config_key(cfg): 14,
                                                                                "unrecorded": 7}


# ----------------------------------------------------------------------------- construction and bounds
def test_construction_reaches_100_percent_without_training():
    task = random_bijections(64, 4, seed=0)
    for codes, variant in (("binary", "erase"), ("sphere", "erase"), ("sphere", "extract")):
        b = 6 if codes == "binary" else 3
        model = build_construction(task, b, codes=codes, variant=variant)
        assert construction_accuracy(model, task) == 1.0, (codes, variant)
    model = quantize_(build_construction(task, 6, codes="binary"), 4)
    assert construction_accuracy(model, task) == 1.0
    small = smallest_construction(64, 4, precision_bits=8)
    assert small["accuracy"] == 1.0 and small["d_model"] <= 4 * 6 + 2
    binary = smallest_construction(64, 4, codes="binary")
    assert binary["d_model"] == 4 * 6 + 2          # R * ceil(log2 N) + 2 = O(R log N)


def test_bounds_by_hand():
    assert bounds.log2_factorial(4) == pytest.approx(math.log2(24))
    assert bounds.bits_needed(4, 3) == pytest.approx(3 * math.log2(24))
    assert bounds.bits_needed(4, 3, hops=2, cot=True) == pytest.approx(3 * math.log2(24))
    # 2 hops without CoT, N=16, R=2: each subject's tree has 4 leaves: log2(16*15*14*13) bits, times 16 subjects
    assert bounds.bits_needed(16, 2, hops=2) == pytest.approx(16 * math.log2(16 * 15 * 14 * 13))
    assert bounds.bits_available(1000, 2.0) == 2000
    assert bounds.min_params(4, 3, bits_per_param=2.0) == math.ceil(3 * math.log2(24) / 2)
    d = bounds.min_d(512, 8, 2.0)
    assert bounds.trainable_params(512, 8, d) * 2 >= bounds.bits_needed(512, 8)
    assert bounds.trainable_params(512, 8, d - 1) * 2 < bounds.bits_needed(512, 8)
    assert bounds.min_d(512, 8, 2.0, frozen_subjects=True) > d


# ----------------------------------------------------------------------------- CLI
def test_cli_train_and_parsers(tmp_path, capsys):
    from synthetic.cli import add_parser

    parser = argparse.ArgumentParser(prog="llmprobe")
    subs = parser.add_subparsers(dest="command")
    add_parser(subs)
    out = str(tmp_path / "run")
    args = parser.parse_args(["synth", "train", "--subjects", "32", "--relations", "2", "--d", "12",
                              "--out", out, "--no-progress", "--max-steps", "400"])
    result = args.func(args)
    assert result["success"] and os.path.exists(os.path.join(out, "run.json"))
    assert os.path.exists(os.path.join(out, "checkpoint.safetensors"))
    args = parser.parse_args(["synth", "sweep", "--subjects", "256,512", "--relations", "2,4", "--frozen-subjects",
                              "--out", str(tmp_path / "s")])
    assert args.func.__name__ == "cmd_sweep" and args.subjects == "256,512" and args.frozen_subjects
    args = parser.parse_args(["synth", "train", "--subjects", "8", "--relations", "2", "--d", "4", "--hops", "2",
                              "--cot", "--out", out])
    assert args.hops == 2 and args.cot
    args = parser.parse_args(["synth", "bounds", "-N", "4", "-R", "3"])
    assert args.func(args)["bits_one_hop"] == pytest.approx(3 * math.log2(24))


def test_int_list_is_the_one_int_list_parser():
    from llmprobe.checks import UsageError, int_list

    assert int_list("256, 512,", "--subjects") == [256, 512] and int_list("0", "--seeds", minimum=0) == [0]
    for bad, minimum in (("", 1), (" , ", 1), ("2,x", 1), ("0", 1), ("1.5", 1), ("-1", 0)):
        with pytest.raises(UsageError, match="--x"):
            int_list(bad, "--x", minimum)


def test_cli_sweep_takes_seed_zero_and_exits_0(tmp_path):
    """Seeds are whole numbers >= 0 (the default seed is 0); sizes must be >= 1."""
    from llmprobe.cli import main

    out = tmp_path / "s"
    assert main(["synth", "sweep", "--subjects", "16", "--relations", "2", "--seeds", "0,1", "--out", str(out)]) == 0
    seeds = {row["seed"] for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert seeds == {0, 1}
    with pytest.raises(SystemExit) as stop:
        main(["synth", "sweep", "--subjects", "0", "--relations", "2", "--out", str(tmp_path / "t")])
    assert stop.value.code == 2


def test_capacity_reference_lines_hold_the_facts_bits_at_their_rate():
    """The 2 and 3.6 bits/param lines of the d* plot: at each (N, R) the smallest width whose trainable parameters
    times the rate cover the facts' bits (one less does not), lower at the higher rate."""
    from synthetic.bounds import bits_needed, capacity_reference, trainable_params

    cells = [{"N": N, "R": R} for N in (256, 1024) for R in (2, 8)]
    lines = {b: capacity_reference(cells, b) for b in (2.0, 3.6)}
    for b, line in lines.items():
        assert sorted(line) == [256, 1024]
        for N, points in line.items():
            for (x, d), R in zip(points, (2, 8)):
                assert x == pytest.approx(R * math.log2(N))
                assert trainable_params(N, R, d, 8 * d) * b >= bits_needed(N, R)
                assert trainable_params(N, R, d - 1, 8 * (d - 1)) * b < bits_needed(N, R)
    assert all(d36 < d2 for N in (256, 1024) for (_, d2), (_, d36) in zip(lines[2.0][N], lines[3.6][N]))
