"""DistOpt strategies (half, sparse, partial) under mpiexec, with the shared cases.

Runs on every rank (``run_mpi_suite("mpi_strategies.py", n)``). Tests are
size-agnostic unless a shared case states its world size; those skip
themselves at other sizes and the outer file runs them at their W.

Conventions: every test performs all its collectives first and asserts at
the end (or asserts values that are identical on every rank), so a failing
check fails on every rank alike instead of leaving one rank in a collective.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile

import numpy as np
import pytest

from distopt import SGD, CollectiveMismatchError
from distopt.strategies import Partial

PAIR = 4 + 4  # bytes per (int32 index, float32 value)


def dense_transport(n: int, k: int, world) -> bool:
    """True where the sparse strategy moves its selection densely (k*W pairs >= n floats)."""
    return k * world.size * PAIR >= n * 4


# ------------------------------------------------------------------ helpers
def same_everywhere(world, arrays) -> bool:
    """True when every rank holds bitwise-identical ``arrays`` (same dtypes, shapes, bytes)."""
    mine = [(a.dtype.str, a.shape, a.tobytes()) for a in arrays]
    return all(other == mine for other in world.allgather(mine))


def rank_mean(world, array) -> np.ndarray:
    """Mean over ranks of ``array`` (float64)."""
    return np.mean([np.asarray(a, dtype=np.float64) for a in world.allgather(array.copy())], axis=0)


def residual_list(opt) -> list[np.ndarray]:
    """This rank's residual buffers, in bucket order."""
    return [v for _, v in sorted(opt.active_strategy.residuals.buffers.items(), key=lambda kv: repr(kv[0]))]


def need(world, size):
    if world.size != size:
        pytest.skip(f"shared case stated for W={size} (world size is {world.size})")


def need_even(world):
    if world.size % 2:
        pytest.skip("needs an even world size")


def gathered_indices(rec) -> list[np.ndarray]:  # rec: the conftest's Recording communicator
    """Integer arrays this rank handed to the gathers (the sparse indices)."""
    return [a for a in rec.gathered if a.dtype == np.int32]


# ------------------------------------------------ sparse == dense in the limit
def _random_model(rank, seed, dtype=np.float32):
    rng = np.random.default_rng(seed + 97 * rank)
    shapes = [(7, 5), (5,), (300,), (2, 3)]
    return shapes, [rng.normal(size=s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("mode", ["topk_spars_1", "threshold_spars_0"])
def test_sparse_limit_equals_dense(make, world, mode):
    """topK with spars=1 and threshold mode with spars=0 send everything: same params as step (1e-6)."""
    dense, sparse = make(SGD(lr=0.1)), make(SGD(lr=0.1))
    shapes, _ = _random_model(0, 0)
    pd = [np.full(s, 0.5, np.float32) for s in shapes]
    ps = [p.copy() for p in pd]
    for t in range(3):
        _, grads = _random_model(world.rank, 10 + t)
        dense.step(pd, [g.copy() for g in grads], threshold=40)
        if mode == "topk_spars_1":
            sparse.step_sparse(ps, [g.copy() for g in grads], threshold=40, spars=1.0, topK=True)
        else:
            sparse.step_sparse(ps, [g.copy() for g in grads], threshold=40, spars=0.0, topK=False)
    for a, b in zip(ps, pd):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# --------------------------------------------------- error-feedback invariant
@pytest.mark.parametrize("topK,spars", [(True, 0.05), (False, 1.5)], ids=["topk", "threshold"])
def test_error_feedback_conservation(make, world, topK, spars):
    """Over T=6 steps: sum of applied averages + sum_r residual_r / W == sum of true averages (1e-10)."""
    opt = make(SGD(lr=1.0))
    T, sizes = 6, (200, 150)
    params = [np.zeros(n) for n in sizes]  # threshold 100: each parameter is its own bucket
    rng = np.random.default_rng(1234 + world.rank)
    true_sum = [np.zeros(n) for n in sizes]
    applied = [np.zeros(n) for n in sizes]
    for _ in range(T):
        grads = [rng.normal(size=n) * 0.3 for n in sizes]
        for acc, g in zip(true_sum, grads):
            acc += rank_mean(world, g)
        opt.step_sparse(params, grads, threshold=100, spars=spars, topK=topK, corr=True)
        for acc, g in zip(applied, grads):  # grads now hold the applied average
            acc += g
    residuals = residual_list(opt)
    res_mean = [rank_mean(world, r) for r in residuals]
    assert [r.size for r in residuals] == list(sizes)
    for p, app, tru, res in zip(params, applied, true_sum, res_mean):
        np.testing.assert_allclose(-p, app, rtol=0, atol=1e-12)  # SGD lr=1 from zeros
        np.testing.assert_allclose(app + res, tru, rtol=0, atol=1e-10)
    assert opt.stats.get("sparse_dense_fallbacks", 0) == 0  # the sparse path really ran
    assert np.count_nonzero(np.concatenate(residuals)) > 0


# ---------------------------------------------- replicas stay bitwise equal
@pytest.mark.parametrize("kind", ["topk", "threshold", "half_fp16", "half_bf16", "half_clip"])
def test_params_bitwise_identical_after_every_step(make, world, kind):
    opt = make(SGD(lr=0.05, momentum=0.9))
    shapes = [(40, 30), (30,), (1200,), (3, 3)]
    params = [np.random.default_rng(s).normal(size=sh).astype(np.float32) for s, sh in enumerate(shapes)]
    rng = np.random.default_rng(77 + world.rank)
    ok = []
    for _ in range(4):
        grads = [rng.normal(size=s).astype(np.float32) * 3 for s in shapes]
        if kind == "topk":
            opt.step_sparse(params, grads, threshold=500, spars=0.02, topK=True)
        elif kind == "threshold":
            opt.step_sparse(params, grads, threshold=500, spars=8.0, topK=False)
        elif kind == "half_fp16":
            opt.step_half(params, grads, threshold=500)
        elif kind == "half_bf16":
            opt.step_half(params, grads, threshold=500, wire="bfloat16")
        else:
            opt.step_half(params, grads, threshold=500, clipping=True, clip_Value=1.0)
        ok.append(same_everywhere(world, params))
    assert all(ok), ok
    assert all(np.isfinite(p).all() for p in params)


# ------------------------------------------------------------------- partial
def _partial_model():
    # threshold 6: chunks {p0, p1} (2+3 fused), {p2} (8 > 6, alone), {p3} -> K = 3
    return [np.zeros(2), np.zeros(3), np.zeros(8), np.zeros(4)], [[0, 1], [2], [3]]


def test_partial_one_chunk_per_call_then_all_averaged(make, world):
    """After the first (syncing) call, rank-dependent params: K calls average exactly one chunk each."""
    opt = make(SGD(lr=0.5))
    params, chunks = _partial_model()
    zeros = lambda: [np.zeros_like(p) for p in params]  # noqa: E731
    opt.step_partial(params, zeros(), threshold=6)  # layout sync: broadcasts rank 0's params
    rng = np.random.default_rng(500 + world.rank)
    for p in params:
        p[...] = rng.normal(size=p.shape) + world.rank
    means = [rank_mean(world, p) for p in params]
    start = opt.active_strategy.cursor.position
    agree, values, positions = [], [], []
    for j in range(len(chunks)):
        opt.step_partial(params, zeros(), threshold=6)
        agree.append({i for i, p in enumerate(params) if same_everywhere(world, [p])})
        values.append([p.copy() for p in params])
        positions.append(world.allgather(opt.active_strategy.cursor.position))
    taken = set()
    for j, (got, vals, pos) in enumerate(zip(agree, values, positions)):
        taken |= set(chunks[(start + j) % len(chunks)])
        assert got == taken, f"after call {j + 1}: params agreeing across ranks {got}, chunks taken {taken}"
        for i in taken:
            np.testing.assert_allclose(vals[i], means[i], rtol=0, atol=1e-12)
        assert len(set(pos)) == 1  # cursor equal on all ranks
    assert taken == set(range(len(params)))
    sd = opt.state_dict()
    cursor = sd["strategies"]["singa.partial"]["cursor"]
    assert cursor == {"position": opt.active_strategy.cursor.position}
    assert len(set(world.allgather(cursor["position"]))) == 1
    fresh = make(SGD(lr=0.5))
    fresh.load_state_dict(pickle.loads(pickle.dumps(sd)))
    assert fresh.state_dict()["strategies"]["singa.partial"]["cursor"] == cursor  # held until the next call


def test_partial_cursor_wraps_and_counts(make, world):
    opt = make(SGD(lr=0.5), strategy=Partial(chunk_size=6))
    params, chunks = _partial_model()
    seen = []
    for _ in range(2 * len(chunks) + 1):
        seen.append(opt.strategy.cursor.position)
        opt.step(params, [np.zeros_like(p) for p in params])
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert opt.stats["steps"] == 2 * len(chunks) + 1


def test_average_params_all_at_once(make, world):
    opt = make(SGD(lr=0.5))
    params, _ = _partial_model()
    params.append(np.zeros((3, 2), np.float32))
    counter = np.array([3 + world.rank], np.int64)
    opt.step_partial(params + [counter], [np.zeros_like(p) for p in params] + [None], threshold=6)
    rng = np.random.default_rng(900 + world.rank)
    for p in params:
        p[...] = rng.normal(size=p.shape) * (world.rank + 1)
    counter[0] = 40 + world.rank
    means = [rank_mean(world, p) for p in params]
    opt.average_params(params + [counter])
    same = same_everywhere(world, params)
    assert same
    for p, m in zip(params, means):
        np.testing.assert_allclose(p, m, rtol=0, atol=1e-6 if p.dtype == np.float32 else 1e-12)
    assert counter[0] == 40 + world.rank  # integers are not averaged


def test_partial_average_momentum(make, world):
    """average_momentum=True: the chunk's momentum buffers become identical (the mean) across ranks."""
    sgd = SGD(lr=0.1, momentum=0.9)
    opt = make(sgd)
    params, chunks = _partial_model()
    rng = np.random.default_rng(40 + world.rank)
    g1 = [rng.normal(size=p.shape) for p in params]
    opt.step_partial(params, [g.copy() for g in g1], threshold=6, average_momentum=True)
    bufs1 = [sgd.momentum_buffer(p).copy() for p in params]
    agree1 = {i for i, b in enumerate(bufs1) if same_everywhere(world, [b])}
    mean_g1 = [rank_mean(world, g) for g in g1]
    g2 = [rng.normal(size=p.shape) for p in params]
    opt.step_partial(params, [g.copy() for g in g2], threshold=6, average_momentum=True)
    bufs2 = [sgd.momentum_buffer(p).copy() for p in params]
    agree2 = {i for i, b in enumerate(bufs2) if same_everywhere(world, [b])}
    params_agree = {i for i, p in enumerate(params) if same_everywhere(world, [p])}
    # expected chunk-1 buffer: mean over ranks of (0.9 * g1_r + g2_r)
    expect_b1 = [rank_mean(world, 0.9 * a + b) for a, b in zip(g1, g2)]
    if world.size > 1:
        assert agree1 == set(chunks[0])
    for i in chunks[0]:
        np.testing.assert_allclose(bufs1[i], mean_g1[i], rtol=0, atol=1e-12)
    if world.size > 1:
        assert agree2 == set(chunks[1])  # chunk 0's buffers diverged again with local g2
        assert chunks[1][0] in params_agree
    for i in chunks[1]:
        np.testing.assert_allclose(bufs2[i], expect_b1[i], rtol=0, atol=1e-12)


def test_partial_average_momentum_without_momentum_errors_everywhere(make, world):
    opt = make(SGD(lr=0.1))
    params, _ = _partial_model()
    with pytest.raises(ValueError, match="momentum"):
        opt.step_partial(params, [np.ones_like(p) for p in params], threshold=6, average_momentum=True)


# ------------------------------------------------------------------- H06/H07
def test_h06_fp16_no_overflow_sum(make, world):
    """H06 (W=4): [40000, -40000, 1] on every rank, fp16 all-reduce, lr 1e-6 -> [-0.04, 0.04, -1e-6]."""
    opt = make(SGD(lr=1e-6))
    p = np.zeros(3, np.float32)
    g = np.array([40000, -40000, 1.0], np.float32)
    opt.step_half([p], [g])
    same = same_everywhere(world, [p])
    assert np.isfinite(g).all() and np.isfinite(p).all()
    np.testing.assert_allclose(g, [40000, -40000, 1.0], rtol=1e-3)
    np.testing.assert_allclose(p, [-0.04, 0.04, -1e-6], rtol=1e-3)
    assert same


def test_h07_fp16_no_underflow_predivide_1(make, world):
    """H07 (W=8): 1.2e-7 everywhere; predivide=1 keeps it (> 0, within 6e-8); default: never NaN."""
    opt = make(SGD(lr=1.0))
    p = np.zeros(4, np.float32)
    g = np.full(4, 1.2e-7, np.float32)
    opt.step_half([p], [g], predivide=1)
    kept = g.copy()
    opt2 = make(SGD(lr=1.0))
    q = np.zeros(4, np.float32)
    g2 = np.full(4, 1.2e-7, np.float32)
    opt2.step_half([q], [g2])  # default predivide = W: may flush to 0 at W=8 (documented trade-off)
    same = same_everywhere(world, [p, q])
    assert (kept > 0).all(), kept
    np.testing.assert_allclose(kept, 1.2e-7, rtol=0, atol=6e-8)
    np.testing.assert_allclose(p, -kept)
    assert not np.isnan(g2).any() and not np.isnan(q).any()
    assert (g2 >= 0).all() and np.isfinite(g2).all()
    assert same


def test_bfloat16_wire_accuracy(make, world):
    opt = make(SGD(lr=1.0))
    rng = np.random.default_rng(3 + world.rank)
    sizes = (50, 7, 300)
    params = [np.zeros(n, np.float32) for n in sizes]
    grads = [rng.uniform(1.0, 2.0, size=n).astype(np.float32) * 10 ** (i - 1) for i, n in enumerate(sizes)]
    want = [rank_mean(world, g) for g in grads]
    opt.step_half(params, grads, threshold=60, wire="bfloat16")
    same = same_everywhere(world, params)
    for g, w, p in zip(grads, want, params):
        np.testing.assert_allclose(g, w, rtol=1e-2)
        np.testing.assert_allclose(-p, w, rtol=1e-2)
    assert same
    assert opt.stats["wire_bytes"] == 2 * sum(sizes)


# ---------------------------------------------------------------------- H11
def _h11(world):
    r = world.rank
    params = [np.zeros(3, np.float32), np.zeros((1, 0, 2), np.float32), np.zeros(2, np.float32)]
    grads = [np.full(3, r + 1.0, np.float32), np.zeros((1, 0, 2), np.float32), np.full(2, 10.0 * (r + 1), np.float32)]
    return params, grads, (world.size + 1) / 2


@pytest.mark.parametrize("mode", ["dense", "half", "topk"])
def test_h11_zero_size_parameter_each_mode(make, world, mode):
    """H11: A (3,), E (1,0,2), B (2,): averages mean(r+1) and 10x that; E keeps its shape."""
    opt = make(SGD(lr=1.0))
    params, grads, mean = _h11(world)
    if mode == "dense":
        opt.step(params, grads)
    elif mode == "half":
        opt.step_half(params, grads)
    else:
        opt.step_sparse(params, grads, spars=0.5, topK=True, corr=True)
    same = same_everywhere(world, params)
    res = [rank_mean(world, r) for r in residual_list(opt)] if mode == "topk" else []
    assert params[1].shape == (1, 0, 2) and grads[1].shape == (1, 0, 2)
    assert same
    if mode == "topk":
        # one fused bucket [A(3), E(0), B(2)]: applied + mean residual == true mean (error feedback)
        (r,) = res
        np.testing.assert_allclose(grads[0] + r[:3], mean, rtol=0, atol=1e-6)
        np.testing.assert_allclose(grads[2] + r[3:], 10 * mean, rtol=0, atol=1e-5)
        np.testing.assert_allclose(-params[0], grads[0], atol=0)
    else:
        np.testing.assert_allclose(grads[0], mean, rtol=1e-3)
        np.testing.assert_allclose(grads[2], 10 * mean, rtol=1e-3)
        np.testing.assert_allclose(params[0], -mean, rtol=1e-3)
        np.testing.assert_allclose(params[2], -10 * mean, rtol=1e-3)


@pytest.mark.parametrize("threshold", [2097152, 0], ids=["one_chunk", "three_chunks"])
def test_h11_zero_size_parameter_partial(make, world, threshold):
    """H11, partial: local update with own grads, then K calls: A = -mean, B = -10 mean, E (1,0,2)."""
    opt = make(SGD(lr=1.0))
    params, grads, mean = _h11(world)
    opt.step_partial(params, grads, threshold=threshold)
    k = 1 if threshold else 3  # threshold 0: chunks [A], [E] (empty), [B]
    for _ in range(k - 1):
        opt.step_partial(params, [np.zeros_like(p) for p in params], threshold=threshold)
    same = same_everywhere(world, params)
    assert params[1].shape == (1, 0, 2)
    assert same
    assert opt.active_strategy.cursor.position == 0
    np.testing.assert_allclose(params[0], -mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(params[2], -10 * mean, rtol=0, atol=1e-5)


def test_h11_zero_size_alone_all_strategies(make, world):
    """Only a zero-size parameter: every strategy and average_params run without crash or hang."""
    opt = make(SGD(lr=1.0))
    e = np.zeros((1, 0, 2))
    opt.step([e], [np.zeros((1, 0, 2))])
    opt.step_half([e], [np.zeros((1, 0, 2))])
    opt.step_sparse([e], [np.zeros((1, 0, 2))], spars=0.5, topK=True)
    opt.step_sparse([e], [np.zeros((1, 0, 2))], spars=1.0, topK=False)
    opt.step_partial([e], [np.zeros((1, 0, 2))])
    opt.average_params([e])
    assert e.shape == (1, 0, 2)


# ---------------------------------------------------------------------- H12
@pytest.mark.parametrize("corr", [False, True])
def test_h12a_threshold_selects_nothing(make, world, corr):
    """H12 (a): g=[0.1,-0.2,0.05] everywhere, threshold 1.0: params unchanged; residual == g with feedback."""
    opt = make(SGD(lr=1.0))
    p = np.zeros(3, np.float32)
    g0 = np.array([0.1, -0.2, 0.05], np.float32)
    g = g0.copy()
    opt.step_sparse([p], [g], spars=1.0, topK=False, corr=corr)
    res = residual_list(opt)
    np.testing.assert_array_equal(p, np.zeros(3))
    np.testing.assert_array_equal(g, np.zeros(3))
    if corr:
        assert len(res) == 1
        np.testing.assert_array_equal(res[0], g0)
    else:
        assert res == []


def _h12b(world, n):
    g = np.zeros(n, np.float32)
    g[:3] = [0.1, -0.2, 0.05] if world.rank % 2 == 0 else [5, 0, -3]
    return g


def _h12b_run(make, world, n):
    opt = make(SGD(lr=1.0), record=True)
    p = np.zeros(n, np.float32)
    opt.step_sparse([p], [_h12b(world, n)], spars=1.0, topK=False, corr=False)
    return opt, p


def test_h12b_threshold_counts_differ(make, world):
    """H12 (b), W=2, n=3: rank 0 sends 0 entries, rank 1 sends 2 -> p = -[2.5, 0, -1.5] on both."""
    need(world, 2)
    opt, p = _h12b_run(make, world, 3)
    np.testing.assert_allclose(p, -np.array([2.5, 0, -1.5]), rtol=0, atol=1e-6)
    assert opt.stats["sparse_entries"] == (0 if world.rank == 0 else 2)
    assert opt.stats["sparse_dense_fallbacks"] == 1  # 2 pairs (16 B) >= 3 floats (12 B)


def test_h12b_threshold_counts_differ_sparse_path(make, world):
    """H12 (b) on n=100 (the sparse path really runs): 0 vs 2 entries per rank, no hang, sum / W."""
    need_even(world)
    opt, p = _h12b_run(make, world, 100)
    sent = [i.size for i in gathered_indices(opt.comm)]
    want = np.zeros(100)
    want[:3] = -np.array([5, 0, -3]) / 2  # half the ranks contribute [5, 0, -3]
    np.testing.assert_allclose(p, want, rtol=0, atol=1e-6)
    assert sent == [0 if world.rank % 2 == 0 else 2]
    if world.size == 2:
        np.testing.assert_allclose(p[:3], -np.array([2.5, 0, -1.5]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- H14
def test_h14a_ratio_rounds_to_zero_uses_k1(make, world):
    """H14 (a), n=3, spars 0.1: k=1 per rank: 1 index gathered, 8 wire bytes, 2 nonzeros left in the residual."""
    opt = make(SGD(lr=1.0), record=True)
    p = np.zeros(3, np.float32)
    opt.step_sparse([p], [np.array([3.0, -1.0, 2.0], np.float32)], spars=0.1, topK=True, corr=True)
    (res,) = residual_list(opt)
    assert opt.stats["sparse_entries"] == 1
    if dense_transport(3, 1, world):
        assert opt.stats["sparse_dense_fallbacks"] == 1 and opt.stats["wire_bytes"] == 3 * 4
        assert gathered_indices(opt.comm) == []
    else:
        assert [i.size for i in gathered_indices(opt.comm)] == [1]
        assert opt.stats["wire_bytes"] == 1 * PAIR
    assert np.count_nonzero(res) == 2
    np.testing.assert_array_equal(res, [0, -1, 2])
    np.testing.assert_array_equal(p, [-3, 0, 0])


def test_h14a_small_ratio_uses_k1_sparse_path(make, world):
    """H14 (a) on n=30 (ceil(0.3)=1 -> k=1, sparse path): exactly one entry per rank."""
    opt = make(SGD(lr=1.0), record=True)
    g = np.arange(1, 31, dtype=np.float32) * (1 if world.rank % 2 == 0 else -1)
    p = np.zeros(30, np.float32)
    opt.step_sparse([p], [g.copy()], spars=0.01, topK=True, corr=True)
    sent = [i.size for i in gathered_indices(opt.comm)]
    (res,) = residual_list(opt)
    assert sent == [1]
    assert opt.stats["wire_bytes"] == 1 * (4 + 4)
    assert np.count_nonzero(res) == 29 and res[29] == 0


def test_h14b_ratio_one_equals_dense(make, world):
    """H14 (b), n=4, spars=1.0 -> identical to the dense path (1e-6)."""
    dense, sparse = make(SGD(lr=1.0)), make(SGD(lr=1.0))
    g = np.array([1.0, -2.0, 3.5, 0.25], np.float32) * (world.rank + 1)
    pd, ps = np.zeros(4, np.float32), np.zeros(4, np.float32)
    dense.step([pd], [g.copy()])
    sparse.step_sparse([ps], [g.copy()], spars=1.0, topK=True)
    np.testing.assert_allclose(ps, pd, rtol=0, atol=1e-6)
    np.testing.assert_allclose(pd, -np.array([1.0, -2.0, 3.5, 0.25]) * (world.size + 1) / 2, atol=1e-6)


@pytest.mark.parametrize("spars", [1.5, 0.0, -0.1])
def test_h14c_bad_ratio_raises_before_communication(make, world, spars):
    """H14 (c): ratio outside (0, 1] -> ValueError on every rank, no collective started; later steps work."""
    opt = make(SGD(lr=1.0), record=True)
    p = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="spars"):
        opt.step_sparse([p], [np.ones(4, np.float32)], spars=spars, topK=True)
    assert opt.comm.calls == []
    assert opt.stats["steps"] == 0
    if spars < 0:
        with pytest.raises(ValueError, match="spars"):
            opt.step_sparse([p], [np.ones(4, np.float32)], spars=spars, topK=False)
        assert opt.comm.calls == []
    opt.step_sparse([p], [np.ones(4, np.float32)], spars=1.0, topK=True)  # no desync afterwards
    np.testing.assert_allclose(p, -1.0)


def test_h14d_exactly_ten_entries_per_rank(make, world):
    """H14 (d): n=1000, ratio 0.01 -> exactly 10 (index, value) pairs per rank: 10 * (4 + 4) bytes."""
    opt = make(SGD(lr=1.0), record=True)
    rng = np.random.default_rng(14 + world.rank)
    g = rng.normal(size=1000).astype(np.float32)
    g[:20] = 100 + np.arange(20)  # ties elsewhere cannot matter; top 10 are indices 10..19
    p = np.zeros(1000, np.float32)
    opt.step_sparse([p], [g.copy()], spars=0.01, topK=True, corr=True)
    idx = gathered_indices(opt.comm)
    assert [i.size for i in idx] == [10]
    np.testing.assert_array_equal(np.sort(idx[0]), np.arange(10, 20))
    assert opt.stats["wire_bytes"] == 10 * (4 + 4)
    assert np.count_nonzero(p) == 10
    (res,) = residual_list(opt)
    assert np.count_nonzero(res) == np.count_nonzero(g) - 10


def _h14e(make, world, n):
    """Three topK k=2 steps of g=[1,1,1,1,0.5] (zero-padded to n), then zero grads; snapshots per step."""
    opt = make(SGD(lr=1.0), record=True)
    g = np.zeros(n, np.float32)
    g[:5] = [1, 1, 1, 1, 0.5]
    spars = 2 / n
    p = np.zeros(n, np.float32)
    snaps = []
    for t in range(3):
        before = opt.stats.get("sparse_entries", 0)
        grad = g.copy() if t == 0 else np.zeros(n, np.float32)
        opt.step_sparse([p], [grad], spars=spars, topK=True, corr=True)
        (res,) = residual_list(opt)
        sent = [opt.stats["sparse_entries"] - before]
        snaps.append((p.copy(), grad.copy(), res.copy(), sent))
    same = same_everywhere(world, [p])
    return g, snaps, same


def _check_h14e(g, snaps, same):
    (p1, avg1, r1, s1), (p2, _, r2, s2), (p3, _, r3, s3) = snaps
    assert s1 == s2 == s3 == [2]  # exactly 2 per rank per step, never 4 on ties
    np.testing.assert_array_equal(avg1 + r1, g)  # sent (same on every rank) + residual == g
    assert p1.sum() == -2
    want2 = np.zeros_like(g)
    want2[:4] = -1
    np.testing.assert_array_equal(p2, want2)
    want_r2 = np.zeros_like(g)
    want_r2[4] = 0.5
    np.testing.assert_array_equal(r2, want_r2)
    want3 = want2.copy()
    want3[4] = -0.5
    np.testing.assert_array_equal(p3, want3)
    np.testing.assert_array_equal(r3, np.zeros_like(g))
    assert same


def test_h14e_ties_exactly_k_with_feedback(make, world):
    """H14 (e), n=5, k=2 (spars 0.4), feedback on, then two zero-gradient steps."""
    _check_h14e(*_h14e(make, world, 5))


def test_h14e_ties_exactly_k_with_feedback_sparse_path(make, world):
    """H14 (e) zero-padded to n=50 (k=2, spars 0.04, the sparse path really runs): same numbers."""
    _check_h14e(*_h14e(make, world, 50))


# ---------------------------------------------------------------------- H17
def _h17_grads(world, n, step):
    g = np.zeros(n, np.float32)
    if step == 0:
        g[:3] = [4, 0, 1] if world.rank % 2 == 0 else [0, 2, 1]
    return g


def _h17_run(make, world, n, steps, opt=None, p=None, first=0):
    opt = opt or make(SGD(lr=1.0))
    p = np.zeros(n, np.float32) if p is None else p
    snaps = []
    for t in range(first, steps):
        opt.step_sparse([p], [_h17_grads(world, n, t)], spars=1 / n, topK=True, corr=True)
        snaps.append((p.copy(), [r.copy() for r in residual_list(opt)]))
    return opt, p, snaps


def _check_h17(snaps, n):
    (p1, (r1,)), (p2, (r2,)) = snaps
    want1, want_r1, want2 = np.zeros(n), np.zeros(n), np.zeros(n)
    want1[:3] = [-2, -1, 0]
    want_r1[2] = 1
    want2[:3] = [-2, -1, -1]
    np.testing.assert_allclose(p1, want1, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(r1, want_r1)  # never [2, -1, 1] (computed against the average)
    np.testing.assert_allclose(p2, want2, rtol=0, atol=1e-6)  # feedback applied
    np.testing.assert_array_equal(r2, np.zeros(n))


def test_h17_error_feedback_residual(make, world):
    """H17, W=2, n=3, k=1: p=[-2,-1,0], residuals [0,0,1]; then p=[-2,-1,-1], residuals 0."""
    need(world, 2)
    _, _, snaps = _h17_run(make, world, 3, 2)
    _check_h17(snaps, 3)


def test_h17_error_feedback_residual_sparse_path(make, world):
    """H17 zero-padded to n=100 (k=1, the sparse path really runs); any even W."""
    need_even(world)
    _, _, snaps = _h17_run(make, world, 100, 2)
    _check_h17(snaps, 100)


# ---------------------------------------------------------------------- H18
def _h18(make, world, n):
    _, p_a, _ = _h17_run(make, world, n, 3)
    opt, p_b, _ = _h17_run(make, world, n, 1)
    folder = world.bcast(tempfile.mkdtemp(prefix="distopt-h18-") if world.rank == 0 else None, root=0)
    path = os.path.join(folder, f"rank{world.rank}.pkl")
    with open(path, "wb") as f:
        pickle.dump({"opt": opt.state_dict(), "params": [p_b.copy()]}, f)
    world.Barrier()
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        fresh = make(SGD(lr=1.0))
        error = None
        try:
            fresh.load_state_dict(saved["opt"])
        except Exception as e:  # noqa: BLE001 - re-raised after the ranks agree
            error = e
        errors = world.allgather(repr(error) if error else None)
        if error is not None:
            raise error
        assert not any(errors), errors
        (p_restored,) = saved["params"]
        _, p_b2, _ = _h17_run(make, world, n, 3, opt=fresh, p=p_restored, first=1)
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    want = np.zeros(n)
    want[:3] = [-2, -1, -1]
    np.testing.assert_allclose(p_a, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(p_b2, p_a, rtol=0, atol=1e-6)


def test_h18_checkpoint_restore_residuals(make, world):
    """H18, W=2, n=3: 1 step, save, fresh DistOpt + SGD, load, steps 2-3 == uninterrupted [-2,-1,-1]."""
    need(world, 2)
    _h18(make, world, 3)


def test_h18_checkpoint_restore_residuals_sparse_path(make, world):
    """H18 zero-padded to n=100: the residual [0,0,1,...] must survive save/load (any even W)."""
    need_even(world)
    _h18(make, world, 100)


# ---------------------------------------------------------------------- H09
@pytest.mark.parametrize("kind", ["half", "topk", "threshold", "partial"])
def test_h09_integer_counter_untouched(make, world, kind):
    """H09 (c) for the other strategies: the int64 counter is never reduced/zeroed; the float is averaged."""
    opt = make(SGD(lr=1.0))
    counter = np.array([5 + 2 * world.rank], np.int64)
    w = np.zeros(4, np.float32)
    mean = (world.size + 1) / 2

    def step(grad, cgrad=None):
        params, grads = [w, counter], [grad, cgrad]
        if kind == "half":
            opt.step_half(params, grads)
        elif kind == "topk":
            opt.step_sparse(params, grads, spars=1.0, topK=True)
        elif kind == "threshold":
            opt.step_sparse(params, grads, spars=0.0, topK=False)
        else:
            opt.step_partial(params, grads)

    step(np.full(4, world.rank + 1.0, np.float32))
    after1 = (w.copy(), counter.copy())
    counter += 1
    step(np.zeros(4, np.float32), np.ones(1, np.int64))  # even an integer "gradient" is ignored
    after2 = counter.copy()
    np.testing.assert_array_equal(after1[1], [5])  # rank 0's value, broadcast at the first sync
    np.testing.assert_allclose(after1[0], -mean, rtol=1e-3)
    np.testing.assert_array_equal(after2, [6])
    assert counter.dtype == np.int64


# ----------------------------------------------------------- mismatched ranks
@pytest.mark.parametrize("which", ["spars", "topK", "predivide"])
def test_mismatched_strategy_setting_errors_on_every_rank(make, world, which):
    if world.size < 2:
        pytest.skip("needs two ranks")
    opt = make(SGD(lr=1.0))
    p = np.zeros(64, np.float32)
    odd = world.rank % 2
    error = None
    try:
        if which == "spars":
            opt.step_sparse([p], [np.ones(64, np.float32)], spars=0.1 if odd else 0.2, topK=True)
        elif which == "topK":
            opt.step_sparse([p], [np.ones(64, np.float32)], spars=0.5, topK=bool(odd))
        else:
            opt.step_half([p], [np.ones(64, np.float32)], predivide=1.0 if odd else None)
    except CollectiveMismatchError as e:
        error = e
    everyone = world.allgather(type(error).__name__ if error else None)
    assert everyone == ["CollectiveMismatchError"] * world.size, everyone
