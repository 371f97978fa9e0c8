"""Geometry code path: planted structure is recovered, controls fall to chance, edits do what they say."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.base import clone

from llmprobe.geometry import (
    ALPHA_GRID,
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
from llmprobe.geometry.readouts import _cross_fit, _DualFits, merge_equal_attributes, random_attributes

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


def test_superposition_readout_report_with_nulls():
    H, A, U, W, c = planted(n=200, seed=5)
    rand = torch.randn_like(H)
    rep = superposition_readout(H, A, U, nulls={"random_init": rand}, k=4, n_boot=200)   # alpha: LOO grid
    d = json.loads(json.dumps(rep.to_dict()))
    real, shuf, ctrl = (d["conditions"][k] for k in ("real", "shuffled", "random_init"))
    assert real["r2"]["value"] > 0.95 and shuf["r2"]["value"] < 0.1 and ctrl["r2"]["value"] < 0.1
    for name in ("r0", "r1", "r2", "r3"):
        acc = real["readout_acc"][name]
        assert acc["ci"][0] > 0.9 and acc["n"] == 200 and acc["interval"] == "wilson (jackknife)"
        assert len(acc["spread"]["values"]) == 4                              # one value per cross-fitting fold
        assert len(acc["jackknife"]) == 20                                    # one value per left-out group
        assert shuf["readout_acc"][name]["value"] < 0.2
        assert d["margins"]["shuffled"]["readout_acc"][name]["ci"][0] > 0.7
    assert len(real["alpha_per_fold"]) == 4
    m = d["margins"]["random_init"]["r2"]
    assert m["ci"][0] <= m["value"] <= m["ci"][1] and m["ci"][0] > 0.8 and m["interval"] == "jackknife"
    typed = rep.measure("readout_acc", "r0")
    assert set(typed.nulls) == {"shuffled", "random_attributes", "random_init", "chance"}
    assert typed.primary_null == "shuffled" and typed.nulls["chance"].value < 0.2
    assert rep.settings["merged_attributes"] == {}


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


# ------------------------------------------------------------------------------- the attribute vectors' control
def test_true_attribute_vectors_beat_random_ones_of_the_same_norms():
    """h = c + sum_r W_r u_a with 20 attributes in 8 dims: no linear map of random vectors reproduces the states, so
    the gain over random_attributes (real - random, paired over subjects) is large."""
    H, A, U, W, c = planted(n=200, seed=5)
    rep = superposition_readout(H, A, U, k=4, decode=False)
    rand = rep.conditions["random_attributes"]
    assert rep.conditions["real"]["r2"].value > 0.95 and rand["r2"].value < 0.6
    gain = rep.gain("r2")
    assert gain.ci[0] > 0.35 and gain is rep.margins["random_attributes"]["r2"]
    for r in range(R):
        assert rep.gain("readout_acc", f"r{r}").ci[0] > 0.2
    for U_r, V_r in zip(U, random_attributes(U, seed=1000)):                # the control: the true norms
        torch.testing.assert_close(V_r.norm(dim=1), U_r.norm(dim=1))
        assert (F.normalize(V_r, dim=1) * F.normalize(U_r, dim=1)).sum(1).abs().max() < 0.95


def test_one_hot_structure_alone_shows_no_gain_over_random_attributes():
    """Each attribute moves h by its own arbitrary vector E_r[a] (nothing to do with u_a) and every relation's u
    vectors are linearly independent (n_attr <= d_u): W_r u_a can then place any vector at each attribute, and so
    can W_r applied to random vectors. R^2 and readouts are high, yet the vectors add nothing: the gain is ~0 and
    the verdict rule (lower end above the strongest null's upper end) does not pass against random_attributes."""
    g = torch.Generator().manual_seed(2)
    n, d, du, n_attr = 240, 32, 16, 10
    U = [torch.randn(n_attr, du, generator=g) for _ in range(3)]
    E = [torch.randn(n_attr, d, generator=g) for _ in range(3)]
    A = torch.randint(n_attr, (n, 3), generator=g)
    H = sum(E[r][A[:, r]] for r in range(3)) + 0.3 * torch.randn(n, d, generator=g)
    rep = superposition_readout(H, A, U, k=4, decode=False)
    r2 = rep.measure("r2", primary="random_attributes")
    assert r2.value > 0.8 and r2.nulls["shuffled"].value < 0.1
    gain = rep.gain("r2")
    assert abs(gain.value) < 0.03 and gain.ci[0] < 0 < gain.ci[1]
    null = max((m for k, m in r2.nulls.items()), key=lambda m: m.value)
    assert null is r2.nulls["random_attributes"] and not r2.ci[0] > null.ci[1]
    for r in range(3):
        acc = rep.measure("readout_acc", f"r{r}")
        assert acc.value > 0.9 and abs(rep.gain("readout_acc", f"r{r}").value) < 0.05
        assert not acc.ci[0] > acc.nulls["random_attributes"].ci[1]


def test_attributes_with_equal_vectors_are_merged_into_one_answer():
    """Attributes 0 and 1 of relation 0 share one u vector (like two countries' capitals with one first token) but
    move h differently. A readout of u cannot tell them apart; random vectors could, and would 'improve' on the
    true ones. Merged, both count as one answer for every condition, and the report lists the merge."""
    g = torch.Generator().manual_seed(4)
    n, d, du, n_attr = 200, 24, 12, 6
    U = [torch.randn(n_attr, du, generator=g) for _ in range(2)]
    U[0][1] = U[0][0]
    E = [torch.randn(n_attr, d, generator=g) for _ in range(2)]
    A = torch.randint(n_attr, (n, 2), generator=g)
    H = sum(E[r][A[:, r]] for r in range(2)) + 0.3 * torch.randn(n, d, generator=g)
    A_m, U_m, maps = merge_equal_attributes(A, U)
    assert maps[0].tolist() == [0, 0, 1, 2, 3, 4] and maps[1].tolist() == list(range(n_attr))
    assert U_m[0].shape == (5, du) and torch.equal(A_m[:, 0], maps[0][A[:, 0]]) and torch.equal(A_m[:, 1], A[:, 1])
    rep = superposition_readout(H, A, U, k=4, decode=False)
    assert rep.settings["merged_attributes"] == {"r0": [[0, 1]]}
    real, rand = rep.conditions["real"]["readout_acc"]["r0"], rep.conditions["random_attributes"]["readout_acc"]["r0"]
    assert real.value > 0.9 and rand.value < real.value + 0.03
    merged = superposition_readout(H, A_m, [U_m[0], U[1]], k=4, decode=False)
    assert merged.conditions["real"]["readout_acc"]["r0"].value == real.value


# --------------------------------------------------------------------------------- intervals that include refits
def test_dual_refits_equal_the_estimators_fits():
    """The jackknife refits solve n x n dual systems; at the same alphas they give the estimators' out-of-fold
    values (SSE, SST, readout, decode and chance hits), with missing facts and every readout metric."""
    g = torch.Generator().manual_seed(0)
    n, counts = 90, (5, 12, 30)
    A = torch.stack([torch.randint(c, (n,), generator=g) for c in counts], 1)
    A[torch.rand(n, 3, generator=g) < 0.1] = -1
    A[:, 2][A[:, 2] < 0] = 3
    A[5, 2] = -1                                     # most training folds of relation 2 have no missing fact
    U = [torch.randn(c, 24, generator=g, dtype=torch.float64) + 2 for c in counts]
    H = torch.randn(n, 40, generator=g, dtype=torch.float64) + 5 + A[:, :1]
    splits = kfold_indices(n, 5, 1)
    fold = torch.zeros(n, dtype=torch.long)
    for f, (_, test) in enumerate(splits):
        fold[test] = f
    for metric, alpha in (("cosine", ALPHA_GRID), ("euclidean", 1.0), ("dot", 100.0)):
        kw = {"alpha": alpha, "metric": metric}
        values, alphas, readout_alphas = _cross_fit(H, A, U, splits, alpha, None, kw, True)
        dual = _DualFits(H, A, U, kw).cross_fit(torch.arange(n), fold, alphas, readout_alphas, True)
        torch.testing.assert_close(dual[:, :2], values[:, :2], rtol=1e-9, atol=1e-9)
        assert torch.equal(dual[:, 2:].nan_to_num(-1), values[:, 2:].nan_to_num(-1))


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


@pytest.mark.parametrize("n, p, q", [(30, 8, 5), (12, 40, 6), (9, 9, 3)])
def test_leave_one_out_errors_equal_refits_without_each_row(n, p, q):
    """The closed-form leave-one-out errors equal refitting without each row in turn, with more rows than columns
    (a residual outside the span of X) and fewer; ridge_fit_cv takes the alpha of the least and ridge_fit's W."""
    from llmprobe.geometry.stats import leave_one_out_errors, ridge_fit, ridge_fit_cv
    grid = (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(n, p, generator=g, dtype=torch.float64)
        Y = X[:, :min(p, q)].repeat(1, q)[:, :q] * 0.3 + torch.randn(n, q, generator=g, dtype=torch.float64)
        refits = []
        for alpha in grid:
            sse = 0.0
            for i in range(n):
                rest = torch.arange(n) != i
                W, b = ridge_fit(X[rest], Y[rest], alpha)
                sse += float(((X[i] @ W.T + b - Y[i]) ** 2).sum())
            refits.append(sse)
        assert np.allclose(leave_one_out_errors(X, Y, grid), refits, rtol=1e-9, atol=0)
        W, b, chosen = ridge_fit_cv(X, Y, grid)
        assert chosen == grid[int(np.argmin(refits))]
        W_ref, b_ref = ridge_fit(X, Y, chosen)
        assert torch.allclose(W, W_ref, atol=1e-10) and torch.allclose(b, b_ref, atol=1e-10)


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
    with pytest.raises(ValueError, match="rank"):
        superposition_readout(H, A, U, rank=2)                               # no refit interval for truncation
    with pytest.raises(ValueError, match="jackknife_groups"):
        superposition_readout(H, A, U, jackknife_groups=1)
    with pytest.raises(ValueError, match="attribute counts"):
        superposition_readout(H, A, U, nulls={"c": (H, [u[:5] for u in U])})
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


def test_refit_interval_covers_the_r2_where_the_residual_bootstrap_does_not():
    """30 planted samples of 40 subjects (fixed seeds). The truth is what the cross-fitted R^2 estimates: the
    expected held-out R^2 of the fit trained on a fold's 32 subjects (Monte Carlo, 50 fits on 2000 fresh subjects).
    The jackknife with refits covers it in >= 90% of the samples; switched back to the residual bootstrap
    (jackknife_groups=0: out-of-fold values resampled, fits held fixed) the same intervals cover it in < 90%."""
    g = torch.Generator().manual_seed(0)
    U = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    W = [torch.randn(8, 8, generator=g, dtype=torch.float64) / 8 ** 0.5 for _ in range(2)]

    def draw(n):
        A = torch.randint(4, (n, 2), generator=g)
        H = 0.5 * sum(U[r][A[:, r]] @ W[r].T for r in range(2))
        return H + torch.randn(n, 8, generator=g, dtype=torch.float64), A
    g.manual_seed(1)
    H_test, A_test = draw(2000)
    truth = np.mean([SuperpositionFit(alpha=ALPHA_GRID).fit(*draw(32), U).score(H_test, A_test) for _ in range(50)])
    covered = {0: 0, 20: 0}
    for i in range(30):
        H, A = draw(40)
        for groups in covered:
            rep = superposition_readout(H, A, U, seed=i, decode=False, n_random=0, n_boot=200,
                                        jackknife_groups=groups)
            lo, hi = rep.conditions["real"]["r2"].ci
            covered[groups] += lo <= truth <= hi
    assert covered[20] >= 27 and covered[0] < 27, covered
