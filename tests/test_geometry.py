"""Geometry code path: planted structure is recovered, controls fall to chance, edits do what they say."""
import json

import numpy as np
import pytest
import torch
from sklearn.base import clone

from llmprobe.geometry import (
    LinearRelationDecoder,
    LinearRelationOperator,
    RelationReadout,
    RidgeDecoder,
    SuperpositionFit,
    cross_val_score,
    kfold_indices,
    r2_score,
    shuffle_table,
    superposition_readout,
    train_test_split,
    truncate_rank,
)

N, R, D, DU, NA = 300, 4, 64, 8, 20


def planted(n=N, r_=R, d=D, du=DU, na=NA, noise=0.05, seed=0, missing=0.0):
    """H = c + sum_r W_r u_{a_r(s)} + noise, with random attribute vectors and a random fact table."""
    g = torch.Generator().manual_seed(seed)
    U = [torch.randn(na, du, generator=g) for _ in range(r_)]
    W = [torch.randn(d, du, generator=g) / du ** 0.5 for _ in range(r_)]
    c = torch.randn(d, generator=g)
    A = torch.randint(0, na, (n, r_), generator=g)
    H = c + sum(U[r][A[:, r]] @ W[r].T for r in range(r_)) + noise * torch.randn(n, d, generator=g)
    if missing:
        A = torch.where(torch.rand(n, r_, generator=g) < missing, torch.full_like(A, -1), A)
    return H, A, U, W, c


@pytest.fixture(scope="module")
def world():
    H, A, U, W, c = planted()
    train, test = train_test_split(N, 0.25, seed=0)
    return H, A, U, W, c, train, test


# ------------------------------------------------------------------------------------------ superposition fit
def test_superposition_fit_recovers_planted_W(world):
    H, A, U, W, c, tr, te = world
    fit = SuperpositionFit(alpha=1e-3).fit(H[tr], A[tr], U)
    assert fit.score(H[te], A[te]) > 0.95
    for r in range(R):
        assert fit.W_[r].shape == (D, DU)
        assert (fit.W_[r] - W[r]).norm() / W[r].norm() < 0.05
    assert r2_score(H[te], fit.predict(A[te]), fit.h_mean_) == pytest.approx(fit.score(H[te], A[te]), abs=1e-4)
    assert (fit.decode(H[te]) == A[te]).double().mean() > 0.95


def test_shuffled_control_falls_to_chance(world):
    H, A, U, W, c, tr, te = world
    A_s = shuffle_table(A, seed=1)
    # per relation: same multiset of attributes, different pairing with subjects
    for r in range(R):
        assert torch.equal(A_s[:, r].sort().values, A[:, r].sort().values)
    assert (A_s != A).double().mean() > 0.8
    assert SuperpositionFit(alpha=1e-3).fit(H[tr], A_s[tr], U).score(H[te], A_s[te]) < 0.1
    for r in range(R):
        real = RelationReadout(alpha=1e-2).fit(H[tr], A[tr, r], U[r])
        shuf = RelationReadout(alpha=1e-2).fit(H[tr], A_s[tr, r], U[r])
        assert real.score(H[te], A[te, r]) > 0.95
        # chance is ~1/20 here; 75 test subjects -> binomial sd ~0.025
        assert shuf.score(H[te], A_s[te, r]) < 0.2
        assert 0 < shuf.chance_ < 0.2


def test_swap_edit_flips_only_relation_r(world):
    H, A, U, W, c, tr, te = world
    fit = SuperpositionFit(alpha=1e-3).fit(H[tr], A[tr], U)
    readouts = [RelationReadout(alpha=1e-2).fit(H[tr], A[tr, r], U[r]) for r in range(R)]
    r = 2
    new = (A[te, r] + 1 + torch.arange(len(te)) % (NA - 1)) % NA            # always a different attribute
    assert bool((new != A[te, r]).all())
    H2 = fit.swap_edit(H[te], A[te], r, new)
    assert torch.equal(readouts[r].predict(H2), new)
    for q in range(R):
        if q != r:
            assert torch.equal(readouts[q].predict(H2), readouts[q].predict(H[te]))
    A2 = A[te].clone()
    A2[:, r] = new
    assert torch.equal(fit.decode(H2), A2)
    # the edit is exactly the change of component r
    assert torch.allclose(H2 - H[te], fit.component(A2, r) - fit.component(A[te], r), atol=1e-5)


def test_superposition_rank_and_missing():
    H, A, U, W, c = planted(seed=3, missing=0.1)
    tr, te = train_test_split(N, 0.25, seed=1)
    fit = SuperpositionFit(alpha=1e-3, rank=2).fit(H[tr], A[tr], U)
    for W_r in fit.W_:
        assert torch.linalg.matrix_rank(W_r.double()) == 2
    full = SuperpositionFit(alpha=1e-3).fit(H[tr], A[tr], U)
    assert full.score(H[te], A[te]) > fit.score(H[te], A[te])
    assert full.score(H[te], A[te]) > 0.8                                     # missing facts cost some R^2
    assert fit.predict(A[te]).shape == (len(te), D)
    acc = full.decode_accuracy(H[te], A[te])
    assert acc.shape == (R,) and bool((acc > 0.9).all())


def test_superposition_readout_report_with_controls():
    H, A, U, W, c = planted(n=200, seed=5)
    rand = torch.randn_like(H)
    rep = superposition_readout(H, A, U, controls={"random_init": rand}, k=4, n_boot=200)   # alpha: LOO grid
    d = json.loads(json.dumps(rep.to_dict()))
    real, shuf, ctrl = (d["conditions"][k] for k in ("real", "shuffled", "random_init"))
    assert real["r2"]["value"] > 0.95 and shuf["r2"]["value"] < 0.1 and ctrl["r2"]["value"] < 0.1
    for name in ("r0", "r1", "r2", "r3"):
        acc = real["readout_acc"][name]
        assert acc["ci"][0] > 0.9 and acc["n"] == 200 and acc["interval"] == "wilson"
        assert len(acc["spread"]["values"]) == 4                              # one value per cross-fitting fold
        assert shuf["readout_acc"][name]["value"] < 0.2
        assert d["margins"]["shuffled"]["readout_acc"][name]["ci"][0] > 0.7
    assert len(real["alpha_per_fold"]) == 4
    m = d["margins"]["random_init"]["r2"]
    assert m["ci"][0] <= m["value"] <= m["ci"][1] and m["ci"][0] > 0.8
    typed = rep.measure("readout_acc", "r0")
    assert set(typed.controls) == {"shuffled", "random_init"} and typed.control == "shuffled"


def test_superposition_fit_on_held_out_rows_is_caught():
    """Pure noise with more features than subjects per fold: an in-sample fit explains much of H, the held-out
    R^2 (what is reported) must not. Fitting on the rows it scores (the mutation) fails this test."""
    gen = torch.Generator().manual_seed(0)
    n, d, R, n_attr = 60, 8, 4, 12
    H = torch.randn(n, d, generator=gen, dtype=torch.float64)
    A = torch.randint(n_attr, (n, R), generator=gen)
    U = [torch.randn(n_attr, 16, generator=gen, dtype=torch.float64) for _ in range(R)]
    in_sample = SuperpositionFit(alpha=1e-3).fit(H, A, U).score(H, A)
    assert in_sample > 0.4                                                    # what a leak would report
    rep = superposition_readout(H, A, U, k=5, n_boot=200, alpha=1e-3, decode=False)
    r2 = rep.conditions["real"]["r2"]
    assert r2.value < 0.1 and r2.ci[0] < r2.value < r2.ci[1]


def test_decode_in_superposition_regime():
    # sum_r d_u = 64 > d = 32: the attributes share dimensions; restarts get coordinate descent out of local minima
    H, A, U, W, c = planted(n=600, d=32, du=16, na=30, noise=0.02, seed=11)
    tr, te = train_test_split(600, 0.25, seed=0)
    fit = SuperpositionFit(alpha=(1e-3, 1e-2, 1e-1, 1.0)).fit(H[tr], A[tr], U)
    assert fit.alpha_ in (1e-3, 1e-2, 1e-1, 1.0)
    assert fit.score(H[te], A[te]) > 0.99
    assert bool((fit.decode_accuracy(H[te], A[te]) > 0.97).all())


# ----------------------------------------------------------------------------------------------------- decoders
def affine_world(n=200, d_in=12, d_out=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(d_out, generator=g, dtype=torch.float64)
    H = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    return H, H @ W.T + b, W, b


def test_lre_recovers_exact_affine_map():
    H, O, W, b = affine_world()
    J = W.expand(len(H), -1, -1)
    dec = LinearRelationDecoder().fit(H, O, J)
    assert torch.allclose(dec.W_, W, atol=1e-10) and torch.allclose(dec.b_, b, atol=1e-10)
    assert torch.allclose(dec.predict(H), O, atol=1e-10)
    E = torch.randn(W.shape[0], 50, dtype=torch.float64)                       # linear "LM head"
    logits_fn = lambda o: o @ E                                               # noqa: E731
    y = logits_fn(O).argmax(1)
    assert dec.score(H, y, logits_fn) == 1.0
    assert dec.score_topk(H, y, logits_fn, k=3) == 1.0
    # a mean Jacobian can be passed directly
    assert torch.allclose(LinearRelationDecoder().fit(H, O, W).W_, W)
    # beta scales the slope only; b stays mean(O - W H)
    d2 = LinearRelationDecoder(beta=2.0).fit(H, O, J)
    assert torch.allclose(d2.predict(H), 2 * H @ W.T + b, atol=1e-10)
    meta = json.loads(json.dumps(dec.operator_.to_dict()))
    assert meta["d_in"] == 12 and meta["d_out"] == 10 and meta["estimator"] == "lre"


def test_lre_rank_truncation_matches_svd():
    H, O, W, b = affine_world(seed=1)
    dec = LinearRelationDecoder(rank=3).fit(H, O, W.expand(len(H), -1, -1))
    U, S, Vh = torch.linalg.svd(W)
    W3 = U[:, :3] @ torch.diag(S[:3]) @ Vh[:3]
    assert torch.allclose(dec.W_, W3, atol=1e-10)
    assert torch.allclose(truncate_rank(W, 3), W3, atol=1e-10)
    assert torch.allclose(dec.b_, (O - H @ W3.T).mean(0), atol=1e-10)
    assert dec.operator_.rank == 3


def test_edit_delta_hits_target():
    H, O, W, b = affine_world(d_in=12, d_out=10, seed=2)
    op = LinearRelationDecoder(beta=1.5).fit(H, O, W).operator_
    o_src, o_tgt = op(H[:20]), op(H[20:40])
    delta = op.edit_delta(o_src, o_tgt)
    assert delta.shape == (20, 12)
    # the reference edit does not divide by beta: W h moves by exactly o_tgt - o_src, op's output by beta times it
    assert torch.allclose(op(H[:20] + delta) - o_src, 1.5 * (o_tgt - o_src), atol=1e-8)
    # low-rank edit: moves the output only within W's top-k output subspace
    U = torch.linalg.svd(W).U[:, :2]
    d2 = op.edit_delta(o_src, o_tgt, edit_rank=2)
    moved = op(H[:20] + d2) - o_src
    assert torch.allclose(moved, 1.5 * (o_tgt - o_src) @ U @ U.T, atol=1e-8)
    # single vectors work too
    assert op.edit_delta(o_src[0], o_tgt[0]).shape == (12,)


def test_ridge_decoder_recovers_affine_map():
    H, O, W, b = affine_world(seed=3)
    O = O + 0.01 * torch.randn(O.shape, generator=torch.Generator().manual_seed(0), dtype=O.dtype)
    dec = RidgeDecoder(alpha=1e-3).fit(H, O)
    assert (dec.W_ - W).norm() / W.norm() < 0.01 and (dec.b_ - b).norm() / b.norm() < 0.01
    assert dec.operator_.beta == 1.0
    # matches scikit-learn's Ridge / RidgeCV (leave-one-out alpha choice)
    from sklearn.linear_model import Ridge, RidgeCV
    sk = Ridge(alpha=3.0).fit(H.numpy(), O.numpy())
    mine = RidgeDecoder(alpha=3.0).fit(H, O)
    assert np.allclose(mine.W_.numpy(), sk.coef_) and np.allclose(mine.b_.numpy(), sk.intercept_)
    grid = (1e-3, 1e-1, 10.0, 1e3)
    skcv = RidgeCV(alphas=grid).fit(H.numpy(), O.numpy())
    cv = RidgeDecoder(alpha=grid).fit(H, O)
    assert cv.alpha_ == skcv.alpha_ and np.allclose(cv.W_.numpy(), skcv.coef_)
    # underdetermined (d_in > n) uses the dual form and still interpolates
    H2, O2, _, _ = affine_world(n=8, d_in=30, d_out=5, seed=4)
    assert torch.allclose(RidgeDecoder(alpha=1e-8).fit(H2, O2).predict(H2), O2, atol=1e-4)


def test_float32_and_numpy_inputs():
    H, O, W, b = affine_world(seed=5)
    dec = RidgeDecoder(alpha=1e-6).fit(H.float().numpy(), O.float().numpy())
    assert dec.W_.dtype == torch.float32
    assert dec.predict(H.float()).dtype == torch.float32
    assert torch.allclose(dec.W_.double(), W, atol=1e-3)


# -------------------------------------------------------------------------------------------------------- stats
def test_splits_and_cross_val():
    folds = kfold_indices(23, k=5, seed=0)
    assert torch.equal(torch.cat([te for _, te in folds]).sort().values, torch.arange(23))
    for tr, te in folds:
        assert len(set(tr.tolist()) & set(te.tolist())) == 0 and len(tr) + len(te) == 23
    assert all(torch.equal(a[1], b[1]) for a, b in zip(folds, kfold_indices(23, k=5, seed=0)))
    tr, te = train_test_split(100, 0.2, seed=0)
    assert len(te) == 20 and len(tr) == 80

    H, A, U, W, c = planted(n=150, seed=7)
    cv = cross_val_score(RelationReadout(alpha=1e-2), (H, A[:, 0]), kfold_indices(150, 3), fit_kwargs={"U_r": U[0]})
    assert len(cv) == 3 and min(cv) > 0.95
    cv2 = cross_val_score(lambda: SuperpositionFit(alpha=1e-3), (H, A), kfold_indices(150, 3),
                          fit_kwargs={"U": U})
    assert min(cv2) > 0.95
    Hd, O, Wd, bd = affine_world(seed=8)
    E = torch.randn(10, 30, dtype=torch.float64)
    y = (O @ E).argmax(1)
    J = Wd.expand(len(Hd), -1, -1)
    for est in (LinearRelationDecoder(), RidgeDecoder(alpha=1e-6)):
        cv3 = cross_val_score(est, (Hd, O, J), kfold_indices(len(Hd), 4), score_data=(Hd, y),
                              score_kwargs={"logits_fn": lambda o: o @ E})
        assert cv3 == [1.0] * 4


def test_sklearn_clone():
    for est in (LinearRelationDecoder(beta=2.0, rank=3), RidgeDecoder(alpha=0.5),
                RelationReadout(alpha=0.1, metric="euclidean"), SuperpositionFit(alpha=0.2, rank=1)):
        c = clone(est)
        assert c is not est and c.get_params() == est.get_params()
    d = LinearRelationDecoder().set_params(rank=2)
    assert d.rank == 2
    H, O, W, b = affine_world()
    fitted = RidgeDecoder().fit(H, O)
    assert not hasattr(clone(fitted), "W_")


def test_errors_on_bad_shapes():
    H, A, U, W, c = planted(n=40, seed=9)
    with pytest.raises(ValueError, match="rows"):
        SuperpositionFit().fit(H[:30], A, U)
    with pytest.raises(ValueError, match="empty"):
        SuperpositionFit().fit(H[:0], A[:0], U)
    with pytest.raises(ValueError, match="relations"):
        SuperpositionFit().fit(H, A, U[:3])
    with pytest.raises(ValueError, match="outside"):
        SuperpositionFit().fit(H, A + NA, U)
    with pytest.raises(ValueError, match="integer"):
        SuperpositionFit().fit(H, A.float(), U)
    fit = SuperpositionFit().fit(H, A, U)
    with pytest.raises(ValueError, match="columns"):
        fit.score(H[:, :10], A)
    with pytest.raises(ValueError, match="rows"):
        RelationReadout().fit(H, A[:20, 0], U[0])
    with pytest.raises(ValueError, match="metric"):
        RelationReadout(metric="manhattan").fit(H, A[:, 0], U[0])
    with pytest.raises(RuntimeError, match="not fitted"):
        RelationReadout().predict(H)
    Hd, O, Wd, bd = affine_world()
    with pytest.raises(ValueError, match="J"):
        LinearRelationDecoder().fit(Hd, O, Wd.T)
    with pytest.raises(ValueError, match="rows"):
        LinearRelationDecoder().fit(Hd, O[:5], Wd)
    with pytest.raises(ValueError, match="logits_fn"):
        LinearRelationDecoder().fit(Hd, O, Wd).score(Hd, torch.zeros(len(Hd), dtype=torch.long))
    with pytest.raises(ValueError, match="columns"):
        LinearRelationOperator(Wd, bd)(Hd[:, :3])
    with pytest.raises(ValueError, match="NaN"):
        RidgeDecoder().fit(Hd * float("nan"), O)
    with pytest.raises(ValueError):
        kfold_indices(3, k=5)
    with pytest.raises(ValueError):
        shuffle_table(np.zeros(5, dtype=np.int64))
