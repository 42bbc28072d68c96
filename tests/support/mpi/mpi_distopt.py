"""DistOpt dense strategy under mpiexec: equivalence and shared cases."""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, CollectiveMismatchError, DistOpt
from tests.support import models

B = 4  # per-rank batch
STEPS = 5


@pytest.fixture(scope="module")
def dist():
    opt = DistOpt(SGD(lr=0.1))
    yield opt
    opt.close()


def test_rank_attributes(dist, world):
    assert dist.world_size == world.size
    assert dist.rank_in_global == dist.global_rank == world.rank
    assert 0 <= dist.rank_in_local == dist.local_rank < dist.world_size


def _train_distributed(sgd_kwargs, steps=STEPS):
    opt = DistOpt(SGD(**sgd_kwargs))
    params = models.mlp_params(seed=opt.rank_in_global)  # rank-dependent init: sync must fix it
    opt.sync_params(params)
    for step in range(steps):
        x, y = models.batch(step, B * opt.world_size)
        mine = slice(opt.rank_in_global * B, (opt.rank_in_global + 1) * B)
        opt.step(params, models.mlp_grads(params, x[mine], y[mine]))
    opt.close()
    return opt, params


@pytest.mark.parametrize("sgd_kwargs", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
])
def test_equivalence_with_single_process_global_batch(world, sgd_kwargs):
    """N ranks x batch B with plain all-reduce == one process on the N*B batch (float64, 1e-10)."""
    opt, params = _train_distributed(sgd_kwargs)
    ref = models.mlp_params(seed=0)
    sgd = SGD(**sgd_kwargs)
    for step in range(STEPS):
        x, y = models.batch(step, B * world.size)
        for p, g in zip(ref, models.mlp_grads(ref, x, y)):
            sgd.update(p, g)
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p, r, rtol=0, atol=1e-10)
    assert opt.stats["steps"] == STEPS


def test_h05_none_grad_no_misalignment(dist, world):
    """H05: missing grads count as zero, never shift later parameters; all-None stays unchanged."""
    r = world.rank
    opt = DistOpt(SGD(lr=1.0), buffSize=64)
    ps = [np.zeros(2, np.float32), np.zeros(3, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)]
    g1 = np.full(2, 1.0 + 4 * (r % 2), np.float32)            # rank0: 1, rank1: 5
    g2 = np.full(3, 2.0, np.float32) if r % 2 == 0 else None  # missing on odd ranks
    g3 = np.full(2, 3.0 + 4 * (r % 2), np.float32)            # rank0: 3, rank1: 7
    opt.step(ps, [g1, g2, g3, None])
    W = world.size
    odd = W // 2
    np.testing.assert_allclose(ps[0], -np.full(2, (1 * (W - odd) + 5 * odd) / W), atol=1e-6)
    np.testing.assert_allclose(ps[1], -np.full(3, 2.0 * (W - odd) / W), atol=1e-6)
    np.testing.assert_allclose(ps[2], -np.full(2, (3 * (W - odd) + 7 * odd) / W), atol=1e-6)
    np.testing.assert_array_equal(ps[3], np.zeros(2))
    if W == 2:  # the case's exact numbers
        np.testing.assert_array_equal(ps[0], [-3, -3])
        np.testing.assert_array_equal(ps[2], [-5, -5])
        np.testing.assert_array_equal(ps[1], [-1, -1, -1])


def test_h08_divided_by_world_size_once(world):
    """H08: p has 3 elements (!= W); rank r grad [r+1, 2(r+1), -(r+1)]; lr 1."""
    opt = DistOpt(SGD(lr=1.0))
    p = np.zeros(3)
    r = world.rank
    opt.step([p], [np.array([r + 1, 2 * (r + 1), -(r + 1)], dtype=np.float64)])
    mean = (world.size + 1) / 2
    np.testing.assert_allclose(p, [-mean, -2 * mean, mean], atol=1e-12)
    if world.size == 4:
        np.testing.assert_allclose(p, [-2.5, -5.0, 2.5], atol=1e-6)


def test_h11_zero_size_parameter(world):
    """H11: A (3,), E (1,0,2), B (2,): averages 1.5-style and E keeps its shape."""
    opt = DistOpt(SGD(lr=1.0))
    r = world.rank
    a, e, b = np.zeros(3, np.float32), np.zeros((1, 0, 2), np.float32), np.zeros(2, np.float32)
    ga = np.full(3, r + 1.0, np.float32)
    gb = np.full(2, 10.0 * (r + 1), np.float32)
    opt.step([a, e, b], [ga, np.zeros((1, 0, 2), np.float32), gb])
    mean = (world.size + 1) / 2
    np.testing.assert_allclose(ga, mean)
    np.testing.assert_allclose(gb, 10 * mean)
    assert e.shape == (1, 0, 2)
    np.testing.assert_allclose(a, -mean)
    alone = np.zeros((1, 0, 2))
    opt.all_reduce(alone)
    assert alone.shape == (1, 0, 2)


def test_h20_initial_and_late_parameters_broadcast(world):
    """H20: rank-seeded W1 equals rank 0's W1 - lr after one step; a late W2 is synced too."""
    rng = np.random.default_rng(world.rank)
    w1 = rng.normal(size=(4, 4))
    w1_rank0 = np.random.default_rng(0).normal(size=(4, 4))
    opt = DistOpt(SGD(lr=0.5))
    opt.step([w1], [np.ones((4, 4))])
    np.testing.assert_array_equal(w1, w1_rank0 - 0.5)
    w2 = rng.normal(size=2)
    opt.step([w1, w2], [np.ones((4, 4)), np.ones(2)])
    gathered = world.allgather(w2.copy())
    for other in gathered:
        np.testing.assert_array_equal(other, gathered[0])
    gathered = world.allgather(w1.copy())
    assert all(np.array_equal(g, gathered[0]) for g in gathered)


def test_h03_extra_parameter_on_one_rank(world):
    """H03 (c): rank 1's model has one extra parameter (2,): every rank errors naming it."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    opt = DistOpt(SGD(lr=1.0))
    params = [np.zeros(3), np.zeros((2, 2))] + ([np.zeros(2)] if world.rank == 1 else [])
    grads = [np.ones_like(p) for p in params]
    with pytest.raises(CollectiveMismatchError, match=r"parameter #2 .*rank 1: shape \(2,\)"):
        opt.step(params, grads)
    np.testing.assert_array_equal(params[0], np.zeros(3))  # nothing applied on a failed step


def test_h09_integer_buffer_untouched_float_averaged(world):
    """H09 (c): an int64 counter is broadcast from rank 0 at sync, never reduced or zeroed."""
    opt = DistOpt(SGD(lr=1.0))
    counter = np.array([5 + 2 * world.rank], dtype=np.int64)
    w = np.zeros(2)
    opt.step([w, counter], [np.full(2, world.rank + 1.0), None])
    np.testing.assert_allclose(w, -(world.size + 1) / 2)
    np.testing.assert_array_equal(counter, [5])  # rank 0's value, documented
    counter += 1  # later changes stay local, never zeroed
    opt.step([w, counter], [np.zeros(2), None])
    assert counter[0] == 6


def test_fusion_buffer_bounds(world):
    """A tensor larger than buffSize goes alone; small ones fuse; results exact."""
    opt = DistOpt(SGD(lr=1.0), buffSize=10)
    sizes = [3, 25, 4, 4, 9, 1]
    ps = [np.zeros(n) for n in sizes]
    gs = [np.arange(n, dtype=np.float64) * (world.rank + 1) for n in sizes]
    opt.step(ps, gs, threshold=8)
    for n, p in zip(sizes, ps):
        np.testing.assert_allclose(p, -np.arange(n) * (world.size + 1) / 2, atol=1e-12)


def test_metrics_and_broadcast_object(dist, world):
    loss = np.float64(1.0 + 2 * world.rank)
    got = dist.all_reduce_metrics({"loss": loss, "correct": 3 if world.rank == 0 else 1,
                                   "count": 4 if world.rank == 0 else 1}, mean=("loss",))
    assert loss == 1.0 + 2 * world.rank  # caller's value unchanged
    assert got["loss"] == pytest.approx(float(world.size))
    obj = dist.broadcast_object({"vocab": ["a", "b"], "rank": world.rank})
    assert obj == {"vocab": ["a", "b"], "rank": 0}
