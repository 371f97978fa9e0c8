"""Batched training (synthetic/batched.py): M models at once give what training each alone gives."""
import pytest
import torch

from synthetic.batched import train_batched
from synthetic.tasks import random_bijections
from synthetic.train import TrainConfig, load_run, model_config_for, train


def _alone(task, mcfg, cfg):
    return train(task, model_config=mcfg, config=cfg)


def _assert_same_params(a, b, atol=2e-4):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.shape == q.shape, name
        assert torch.allclose(p, q, atol=atol, rtol=1e-3), (name, float((p - q).abs().max()))


@pytest.mark.parametrize("attention", ["uniform", "learned"])
def test_batched_equals_one_at_a_time(attention):
    # three models of different widths, seeds, fact tables and frozen parts, trained together for a few steps
    cfg = TrainConfig(max_steps=12, lr=0.05, progress=False, weight_decay=1e-3)
    tasks = [random_bijections(24, 2, seed) for seed in (0, 1, 1)]
    mcfgs = [model_config_for(tasks[0], 3, seed=0, attention=attention),
             model_config_for(tasks[1], 6, seed=5, d_mlp=20, frozen_subjects=True, attention=attention),
             model_config_for(tasks[2], 4, seed=7, frozen_subjects=True, frozen_unembed=True, attention=attention)]
    batched = train_batched(tasks, mcfgs, cfg)
    for task, mcfg, res in zip(tasks, mcfgs, batched):
        alone = _alone(task, mcfg, cfg)
        assert res.steps == alone.steps == 12
        assert res.loss == pytest.approx(alone.loss, rel=1e-4)
        _assert_same_params(res.model, alone.model)
        assert res.batch_models == 3
    # frozen parts did not move
    from synthetic.model import FactRecallModel
    init = FactRecallModel(mcfgs[2])
    assert torch.equal(batched[2].model.subject_embed, init.subject_embed)
    assert torch.equal(batched[2].model.unembed_weight, init.unembed_weight)
    assert not torch.equal(batched[2].model.W_in, init.W_in)


def test_early_stopped_model_stops_where_it_would_alone(tmp_path):
    # a wide model reaches 100% early and leaves the stack; a narrow one keeps training to the step cap
    cfg = TrainConfig(max_steps=80, progress=False)
    task = random_bijections(16, 1, 0)
    mcfgs = [model_config_for(task, 1, seed=0), model_config_for(task, 12, seed=1)]
    dirs = [str(tmp_path / "narrow"), str(tmp_path / "wide")]
    narrow, wide = train_batched([task, task], mcfgs, cfg, out_dirs=dirs)
    assert wide.success and not narrow.success
    assert wide.steps < narrow.steps == 80
    for mcfg, res in ((mcfgs[0], narrow), (mcfgs[1], wide)):
        alone = _alone(task, mcfg, cfg)
        assert (res.steps, res.success) == (alone.steps, alone.success)
        _assert_same_params(res.model, alone.model)
    # its checkpoint holds the model that scored 100%, and a rerun resumes it as finished
    saved, _, info = load_run(dirs[1])
    _assert_same_params(saved, wide.model, atol=0)
    assert info["steps"] == wide.steps and info["batch_models"] == 2
    again = train_batched([task], [mcfgs[1]], cfg, out_dirs=[dirs[1]])[0]
    assert again.steps == wide.steps and again.success
    _assert_same_params(again.model, wide.model, atol=0)


def test_seeds_in_one_stack_get_what_each_gets_alone_with_a_fixed_chunk():
    """The controls' stacks: models of one width past their fit (past_fit, snapshots) give bit for bit what each
    gives alone when the softmax chunk is fixed; the default chunk is divided among the models, so it does not."""
    task = random_bijections(600, 2, 0)                 # 600 outputs: the default chunk (436 rows) splits the facts
    configs = [model_config_for(task, 12, seed=s) for s in (0, 1, 2)]
    for chunk, same in ((436, True), (None, False)):
        cfg = TrainConfig(max_steps=20, progress=False, past_fit=5, target_acc=0.0, chunk=chunk)
        alone = train_batched([task], configs[:1], cfg, snapshot_at=(0, 3))[0]
        three = train_batched([task] * 3, configs, cfg, snapshot_at=(0, 3))
        assert alone.fit_step == three[0].fit_step == 0 and alone.steps == three[0].steps == 5
        assert sorted(alone.snapshots) == [0, 3]
        equal = all(torch.equal(p, q) for p, q in zip(alone.model.parameters(), three[0].model.parameters()))
        assert equal == same
        assert torch.equal(alone.snapshots[3]["subject_embed"], three[0].snapshots[3]["subject_embed"]) == same
    one = train(task, model_config=configs[0], config=cfg, snapshot_at=(0, 3))        # the other trainer
    assert (one.fit_step, one.steps) == (alone.fit_step, alone.steps)
    _assert_same_params(one.model, alone.model)


def test_batched_rejects_what_it_cannot_stack():
    cfg = TrainConfig(max_steps=2, progress=False)
    a, b = random_bijections(16, 1, 0), random_bijections(20, 1, 0)
    with pytest.raises(ValueError, match="data of one shape"):
        train_batched([a, b], [model_config_for(a, 2), model_config_for(b, 2)], cfg)
    with pytest.raises(ValueError, match="must share attention"):
        train_batched([a, a], [model_config_for(a, 2), model_config_for(a, 2, attention="learned")], cfg)
    with pytest.raises(ValueError, match="full batch only"):
        train_batched([a], [model_config_for(a, 2)], TrainConfig(max_steps=2, batch_size=4, progress=False))
    with pytest.raises(ValueError, match="1 tasks but 2"):
        train_batched([a], [model_config_for(a, 2)] * 2, cfg)


def _swept(cfg, out: str) -> tuple[dict, list[dict]]:
    """Run the sweep ``cfg`` into ``out``: ({(N, R, seed, mode): (d*, exact)}, its result rows)."""
    from synthetic.sweep import load_results, run_sweep, thresholds

    run_sweep(cfg, out)
    rows = load_results(out)
    return {k[:4]: (t["d_star"], t["exact"]) for k, t in thresholds(rows).items()}, rows


def test_batched_sweep_finds_the_same_thresholds_and_resumes(tmp_path, monkeypatch):
    import synthetic.batched as batched
    from synthetic.sweep import SweepConfig, load_results, run_sweep

    found = {}
    for mode in (False, True):
        cfg = SweepConfig(subjects=[16], relations=[2], seeds=[0, 1], modes=["trainable", "frozen"], d_min=2,
                          d_max=16, batched=mode, train=TrainConfig(max_steps=200, progress=False))
        out = str(tmp_path / f"batched{mode}")
        found[mode], rows = _swept(cfg, out)
    assert found[True] == found[False] and len(found[True]) == 4
    assert any(exact for _, exact in found[True].values())
    assert max(r["batch_models"] for r in rows) == 4            # the four searches trained together
    assert len({r["key"] for r in rows}) == len(rows)

    def boom(*a, **k):
        raise AssertionError("resumed batched sweep retrained a finished point")

    monkeypatch.setattr(batched, "train_batched", boom)
    run_sweep(cfg, out)
    assert len(load_results(out)) == len(rows)
    with pytest.raises(ValueError, match="full batch only"):
        run_sweep(SweepConfig(batched=True, train=TrainConfig(batch_size=8)), str(tmp_path / "x"))


def test_batched_equals_one_at_a_time_on_chain_of_thought():
    # k-hop sequences with positional embeddings and several target positions (the cumsum attention path)
    from synthetic.tasks import random_khop

    cfg = TrainConfig(max_steps=8, lr=0.05, progress=False)
    tasks = [random_khop(12, 2, 2, cot=True, seed=seed) for seed in (0, 1)]
    mcfgs = [model_config_for(tasks[0], 4, seed=0), model_config_for(tasks[1], 7, seed=3)]
    assert mcfgs[0].pos_embed and tasks[0].data().target_pos.numel() == 2
    for task, mcfg, res in zip(tasks, mcfgs, train_batched(tasks, mcfgs, cfg)):
        alone = _alone(task, mcfg, cfg)
        assert res.steps == alone.steps == 8
        _assert_same_params(res.model, alone.model)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_widths_per_round_find_the_same_threshold_in_fewer_rounds(k):
    # planted monotone thresholds: k widths a round end at the same exact d* as one, in fewer rounds overall
    from synthetic.sweep import Bisection, find_threshold

    rounds = {1: 0, k: 0}
    for t in range(3, 70):
        for start in (2, 5, t - 2, t, t + 3, 60):
            for per in (1, k):
                found = find_threshold(lambda d, i: d >= t, 2, 512, max(2, start), per_round=per)
                assert (found["d_star"], found["exact"]) == (t, True), (t, start, per, found["tried"])
                rounds[per] += found["rounds"]
    assert rounds[k] < 0.8 * rounds[1]
    search = Bisection(2, 512, 20)
    assert search.next_round(3) == [(20, 0), (18, 0), (22, 0)]      # the start and a step on either side
    for d, ok in ((18, False), (20, False), (22, False)):
        search.record(d, ok)
    assert search.next_round(3) == [(28, 0), (40, 0), (80, 0)]      # the walk up as if each failed (22, then 28:
    for d, ok in ((28, False), (40, True), (80, True)):             # the steps of the one-at-a-time walk)
        search.record(d, ok)
    assert search.next_round(3) == [(31, 0), (34, 0), (37, 0)]      # the bracket (28, 40) split into 4 parts
    for d, ok in ((31, False), (34, True), (37, True)):
        search.record(d, ok)
    assert search.next_round(3) == [(32, 0), (33, 0)]
    search.record(32, False)
    search.record(33, True)
    assert search.next_round(3) == [(32, 1)]                        # confirmation: alone
    search.record(32, False, 1)
    assert search.next_round(3) == [] and search.d_star == 33 and search.exact


def test_batched_sweep_with_three_widths_per_round_finds_the_same_thresholds(tmp_path):
    from synthetic.sweep import SweepConfig

    found, n_rows = {}, {}
    for per in (1, 3):
        cfg = SweepConfig(subjects=[32], relations=[2], seeds=[0, 1], modes=["trainable", "frozen"], d_min=2,
                          d_max=32, per_round=per, train=TrainConfig(max_steps=200, progress=False))
        found[per], rows = _swept(cfg, str(tmp_path / f"per{per}"))
        n_rows[per] = (len(rows), max(r["batch_models"] for r in rows))
    assert found[3] == found[1] and len(found[1]) == 4 and all(exact for _, exact in found[1].values())
    assert n_rows[3][1] > 4                 # more than one width per search trained in one stack


def test_extrapolated_guess_follows_the_smaller_n():
    from synthetic.sweep import extrapolated_guess

    def rows(N, d_star, mode="trainable"):         # d*-1 failed twice, d* succeeded: an exact cell
        return [{"n_subjects": N, "n_relations": 4, "seed": 0, "mode": mode, "config": "c", "d_model": d,
                 "init": i, "success": d >= d_star} for d, i in ((d_star - 1, 0), (d_star - 1, 1), (d_star, 0))]

    table = rows(256, 7) + rows(512, 8) + rows(1024, 9) + rows(1024, 20, "frozen")
    assert extrapolated_guess(table, 4096, 4, "trainable", "c") == 11           # 7 + (log2 N - 8)
    assert extrapolated_guess(table, 4096, 4, "trainable", "other config") is None
    assert extrapolated_guess(table, 4096, 4, "frozen", "c") is None           # one N only
    assert extrapolated_guess(table, 4096, 2, "trainable", "c") is None        # no cell of that R


def test_ray_tasks_reserve_the_sweeps_threads(monkeypatch, tmp_path):
    # a fake ray module: each task asks Ray for as many CPUs as the sweep runs torch threads
    import sys
    import types

    from synthetic.sweep import SweepConfig, run_sweep

    asked = []
    fake = types.SimpleNamespace(is_initialized=lambda: True, get=lambda ref: ref,
                                 wait=lambda pending, num_returns: (pending[:1], pending[1:]))

    def remote(num_cpus, max_retries):
        asked.append(num_cpus)
        return lambda fn: types.SimpleNamespace(remote=fn)

    fake.remote = remote
    monkeypatch.setitem(sys.modules, "ray", fake)
    cfg = SweepConfig(subjects=[8], relations=[1], modes=["trainable"], d_max=4, threads=3, executor="ray",
                      train=TrainConfig(max_steps=20, progress=False))
    run_sweep(cfg, str(tmp_path))
    assert asked == [3]


def test_training_flushes_denormals_only_while_it_trains(monkeypatch):
    # a tiny model trained 300 steps past its fit: its softmax has probabilities below float32's normal range
    # (the case the flush is for); both trainers run their steps with the flush on by default, off when asked,
    # and leave the caller's mode as it was
    import synthetic.batched as batched
    from synthetic.train import flushing_denormals

    task = random_bijections(16, 2, 0)
    mcfg = model_config_for(task, 8, seed=0)
    seen = []
    real_ce = batched.softmax_cross_entropy
    monkeypatch.setattr(batched, "softmax_cross_entropy", lambda *a: seen.append(flushing_denormals()) or real_ce(*a))
    params = {}
    for flush in (True, False):
        cfg = TrainConfig(max_steps=400, past_fit=300, progress=False, flush_denormals=flush)
        alone = train(task, model_config=mcfg, config=cfg, callback=lambda *a: seen.append(flushing_denormals()))
        assert set(seen) == {flush} and not flushing_denormals()
        seen.clear()
        stacked = train_batched([task], [mcfg], cfg)[0]
        assert set(seen) == {flush} and not flushing_denormals()
        seen.clear()
        assert alone.fit_step == stacked.fit_step and alone.steps == stacked.steps == alone.fit_step + 300
        params[flush] = alone.model
        if not flush:
            with torch.no_grad():
                p = torch.softmax(alone.model(task.data().input_ids)[:, -1], dim=-1)
            assert int(((p > 0) & (p < torch.finfo(torch.float32).tiny)).sum()) > 0
    # flushing moves the trained model by rounding at most (here not at all)
    _assert_same_params(params[True], params[False], atol=1e-6)
    # a caller that flushes still flushes after training
    torch.set_flush_denormal(True)
    try:
        train(task, model_config=mcfg, config=TrainConfig(max_steps=5, progress=False))
        assert flushing_denormals()
    finally:
        torch.set_flush_denormal(False)
