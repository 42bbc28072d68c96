"""DGC and PowerSGD in a simulated world of threads (milliseconds, no mpiexec).

Against hand-computed values (DGC's warm-up, momentum correction and
masking, 3 steps at W=2), against dense averaging (PowerSGD at full rank),
and for the invariants: error feedback conserves mass (float64, 1e-10),
replicas stay bitwise identical, a resumed run takes bitwise the same next
step, a local optimizer with its own momentum is refused before any
collective. The CuPy twins run where CuPy and a GPU are present.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.strategies import DGC, Dense, PowerSGD
from distopt.strategies.powersgd import orthonormalize, plan_bucket
from distopt.buckets import plan_buckets
from tests.simworld import RankFailed, run_world

SHAPES = [(6, 2, 3, 3), (6,), (20, 30), (30,), (4, 5)]  # a conv weight and its bias, two matrices, a bias


def _grads(step: int, rank: int, shapes, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + 17 * rank)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _params(shapes, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _rank_mean(arrays_per_rank):
    return np.mean(np.stack(arrays_per_rank), axis=0)


# ---------------------------------------------------------------- DGC, by hand
# W=2, one bucket of 8 float32 elements, the same gradient every step per rank, momentum 0.5,
# warm-up: step 0 at 75 % sparsity (k=2: 2 ranks x 2 pairs x 8 bytes = 32 >= 32 dense bytes, so the
# selection travels densely), steps 1 and 2 at 87.5 % (k=1, 16 < 32 bytes: pairs).
#
# rank 0, g = [4, 1, 0, 0, 0, 0, 0, 2]:
#   step 0: u = g;                       v = u = [4, 1, 0.., 2];          send {0: 4, 7: 2}; v = u = [0, 1, 0..]
#   step 1: u = .5u + g = [4, 1.5, .., 2]; v += u -> [4, 2.5, .., 2];     send {0: 4};  v = [0, 2.5, .., 2], u = [0, 1.5, .., 2]
#   step 2: u = [4, 1.75, .., 3];        v = [4, 4.25, .., 5];            send {7: 5};  v = [4, 4.25, 0..], u = [4, 1.75, 0..]
# rank 1, g = [1, 0, 3, 0, 0, 0, 0, .5]:
#   step 0: v = g;                       send {2: 3, 0: 1};  v = u = [0.., .5]
#   step 1: u = [1, 0, 3, .., .75];      v = [1, 0, 3, .., 1.25];         send {2: 3};  v = [1, 0.., 1.25], u = [1, 0.., .75]
#   step 2: u = [1.5, 0, 3, .., .875];   v = [2.5, 0, 3, .., 2.125];      send {2: 3};  v = [2.5, 0.., 2.125], u = [1.5, 0.., .875]
# applied averages: step 0 [2.5, 0, 1.5, 0, 0, 0, 0, 1], step 1 [2, 0, 1.5, 0..], step 2 [0, 0, 1.5, 0, 0, 0, 0, 2.5]
HAND_GRADS = [[4, 1, 0, 0, 0, 0, 0, 2], [1, 0, 3, 0, 0, 0, 0, 0.5]]
HAND_APPLIED = [[2.5, 0, 1.5, 0, 0, 0, 0, 1], [2, 0, 1.5, 0, 0, 0, 0, 0], [0, 0, 1.5, 0, 0, 0, 0, 2.5]]
HAND_STATE = {0: ([4, 1.75, 0, 0, 0, 0, 0, 0], [4, 4.25, 0, 0, 0, 0, 0, 0]),          # (u, v) after step 2
              1: ([1.5, 0, 0, 0, 0, 0, 0, 0.875], [2.5, 0, 0, 0, 0, 0, 0, 2.125])}


def test_dgc_warmup_momentum_correction_and_masking_by_hand_w2():
    def rank_fn(rank, comm):
        strategy = DGC(sparsity=0.875, momentum=0.5, warmup_steps=1, warmup_sparsity=(0.75,))
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=strategy)
        w = np.zeros(8, np.float32)
        opt.sync_params([w])
        applied, wire = [], []
        for _ in range(3):
            before = w.copy()
            sent_before = opt.stats.wire_bytes
            opt.step([w], [np.array(HAND_GRADS[rank], np.float32)])
            applied.append(before - w)
            wire.append(opt.stats.wire_bytes - sent_before)
        (u,), (v,) = strategy.velocity.buffers.values(), strategy.accumulated.buffers.values()
        return applied, wire, u.copy(), v.copy(), strategy.state_dict()["steps"], dict(opt.stats)

    for rank, (applied, wire, u, v, steps, stats) in enumerate(run_world(2, rank_fn)):
        np.testing.assert_array_equal(np.array(applied), np.array(HAND_APPLIED, np.float32))
        np.testing.assert_array_equal(u, np.array(HAND_STATE[rank][0], np.float32))
        np.testing.assert_array_equal(v, np.array(HAND_STATE[rank][1], np.float32))
        assert wire == [32, 8, 8]  # dense transport, then one (int32, float32) pair per step
        assert stats["sparse_dense_fallbacks"] == 1 and stats["sparse_entries"] == 4
        assert steps == 3


def test_dgc_default_warmup_schedule_by_step():
    dgc = DGC(warmup_steps=10)  # the paper's 75 %, 93.75 %, 98.4375 %, 99.6 %, then 99.9 %
    assert [dgc.density(s) for s in (0, 9, 10, 19, 20, 30, 39, 40, 10**6)] == \
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.004, 0.004, 0.001, 0.001]
    assert DGC().density(0) == 0.001  # no warm-up
    assert DGC(sparsity=0.999).density(0) * 431080 == 431.08  # decimal form: k = 432, not 433


def test_dgc_selects_per_tensor_not_per_bucket():
    """Two tensors fused in one bucket, one with 100x larger gradients: each still sends its own top 1."""
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=DGC(sparsity=0.9, momentum=0.0))
        params = [np.zeros(10), np.zeros((2, 5))]
        opt.sync_params(params)
        grads = [np.arange(1.0, 11.0) * 100, np.arange(1.0, 11.0).reshape(2, 5)]
        opt.step(params, grads)
        return [np.flatnonzero(p).tolist() for p in params], opt.stats.wire_bytes

    (nonzero, wire), = run_world(1, rank_fn)
    assert nonzero == [[9], [9]] and wire == 2 * (4 + 8)  # int32 index, float64 value


def test_dgc_clips_each_ranks_gradient_to_norm_over_sqrt_w():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=DGC(sparsity=0.0, momentum=0.0, clip_norm=2.0))
        w = np.zeros(4)
        opt.sync_params([w])
        opt.step([w], [np.array([3.0, 4.0, 0, 0]) * (rank + 1)])  # norms 5 and 10, bound 2/sqrt(4) = 1
        return -w

    for applied in run_world(4, rank_fn):
        np.testing.assert_allclose(applied, [0.6, 0.8, 0, 0], rtol=0, atol=1e-15)


# -------------------------------------------------------- PowerSGD == dense
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_at_full_rank_equals_dense_averaging(world):
    """rank >= min(rows, cols), every matrix compressed: the same parameters as Dense (float64, 1e-10)."""
    def rank_fn(rank, comm):
        out = []
        for strategy in (Dense(), PowerSGD(rank=30, min_compression_rate=0)):
            params = _params(SHAPES)
            opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=strategy)
            opt.sync_params(params)
            for s in range(4):
                opt.step(params, _grads(s, rank, SHAPES), threshold=50)
            out.append(params)
        return out, opt.stats.wire_bytes

    for (dense, power), wire in run_world(world, rank_fn):
        for a, b in zip(power, dense):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)
        assert wire != 4 * sum(8 * np.prod(s) for s in SHAPES)  # factors travelled, not the dense gradient


def test_powersgd_plan_and_wire_bytes():
    """(out, rest) matrices for conv weights; 1-D and not-worth-it tensors dense; bytes = dense + P + Q."""
    bucket, = plan_buckets([(s, np.dtype(np.float32)) for s in SHAPES], 10**6, 10**6)
    factors, dense = plan_bucket(bucket, rank=2, min_compression_rate=2.0)
    # conv (6, 18): 108 >= 2 * 24 * 2; (20, 30): 600 >= 200; (4, 5): 20 < 2 * 9 * 2 -> dense
    assert [(f.rows, f.cols, f.rank) for f in factors] == [(6, 18, 2), (20, 30, 2)]
    assert [s.shape for s in dense] == [(6,), (30,), (4, 5)]
    expected = 4 * ((6 + 30 + 20) + (6 + 20) * 2 + (18 + 30) * 2)  # dense, then every P, then every Q

    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, strategy=PowerSGD(rank=2, start_step=2))
        params = _params(SHAPES, np.float32)
        opt.sync_params(params)
        wire = []
        for s in range(4):
            before = opt.stats.wire_bytes
            opt.step(params, _grads(s, rank, SHAPES, np.float32))
            wire.append(opt.stats.wire_bytes - before)
        return wire, comm.calls

    for wire, calls in run_world(2, rank_fn):
        dense_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES)
        assert wire == [dense_bytes, dense_bytes, expected, expected]  # start_step=2 dense steps first
        assert [c for c in calls if c[0] == "all_reduce"][-2:] == [("all_reduce", 56 + 52), ("all_reduce", 96)]


def test_orthonormalize_is_stable_and_keeps_zero_columns():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((50, 1))
    m = np.hstack([base, base + 1e-9 * rng.standard_normal((50, 1)), np.zeros((50, 1)),
                   rng.standard_normal((50, 1))]).astype(np.float32)
    q = orthonormalize(m)
    gram = q.astype(np.float64).T @ q
    np.testing.assert_allclose(gram[np.ix_([0, 1, 3], [0, 1, 3])], np.eye(3), rtol=0, atol=1e-6)
    assert not q[:, 2].any()  # the zero column stays zero, no NaN


# ------------------------------------------------------- error feedback mass
def _mass_case(world, strategy_fn, residual_of):
    T = 6

    def rank_fn(rank, comm):
        strategy = strategy_fn()
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=strategy)
        params = [np.zeros(s) for s in SHAPES]
        opt.sync_params(params)
        true = [np.zeros(s) for s in SHAPES]
        for s in range(T):
            grads = _grads(s, rank, SHAPES)
            for acc, g in zip(true, grads):
                acc += g
            opt.step(params, grads, threshold=100)  # conv, (20, 30) alone; the small ones fused
        return params, true, residual_of(strategy)

    results = run_world(world, rank_fn)
    for params, _, _ in results:
        true_mean = [_rank_mean([r[1][i] for r in results]) for i in range(len(SHAPES))]
        # params = -(sum of applied averages); residuals are flat per bucket: compare flattened in bucket order
        held = _rank_mean([np.concatenate(r[2]) for r in results])
        applied = np.concatenate([-p.ravel() for p in params])
        by_bucket = _bucket_order(SHAPES, 100)
        np.testing.assert_allclose(applied[by_bucket] + held, np.concatenate([t.ravel() for t in true_mean])[by_bucket],
                                   rtol=0, atol=1e-10)
        assert np.abs(held).max() > 1e-3  # something really was held back


def _bucket_order(shapes, threshold):
    """Positions of the parameters' concatenated elements in the order of the buckets' flat buffers."""
    starts = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    buckets = plan_buckets([(s, np.dtype(np.float64)) for s in shapes], threshold, 4194304)
    return np.concatenate([np.arange(starts[sl.index], starts[sl.index + 1]) for b in buckets for sl in b.slots])


def _flat_residuals(residuals):
    return [v for _, v in sorted(residuals.buffers.items())]


@pytest.mark.parametrize("world", [2, 3])
def test_dgc_error_feedback_conserves_mass(world):
    """momentum 0, no clipping: applied + mean residual == sum of the true average gradients (1e-10)."""
    _mass_case(world, lambda: DGC(sparsity=0.95, momentum=0.0), lambda s: _flat_residuals(s.accumulated))


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_error_feedback_conserves_mass(world):
    _mass_case(world, lambda: PowerSGD(rank=1, start_step=1), lambda s: _flat_residuals(s.errors))


# ---------------------------------------------- replicas and state round trips
STRATEGY_FNS = {
    "dgc": lambda: DGC(sparsity=0.9, momentum=0.9, clip_norm=5.0, warmup_steps=2, warmup_sparsity=(0.5, 0.75)),
    "powersgd": lambda: PowerSGD(rank=2, start_step=1),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", sorted(STRATEGY_FNS))
def test_replicas_bitwise_identical_after_every_step(kind, world):
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.05), comm=comm, strategy=STRATEGY_FNS[kind]())
        params = [p.astype(np.float32) for p in _params(SHAPES)]
        opt.sync_params(params)
        after = []
        for s in range(7):
            opt.step(params, _grads(s, rank, SHAPES, np.float32), threshold=100)
            after.append([p.copy() for p in params])
        return after

    results = run_world(world, rank_fn)
    for other in results[1:]:
        for step, (mine, theirs) in enumerate(zip(results[0], other)):
            assert all(np.array_equal(a, b) for a, b in zip(mine, theirs)), f"step {step}"
    assert not np.array_equal(results[0][0][2], results[0][-1][2])  # the parameters moved


@pytest.mark.parametrize("kind", sorted(STRATEGY_FNS))
def test_state_round_trip_gives_bitwise_the_same_next_step(kind):
    """Resume after 3 steps (mid warm-up for DGC, first compressed steps for PowerSGD) from a pickled state."""
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, strategy=STRATEGY_FNS[kind]())
        params = [p.astype(np.float32) for p in _params(SHAPES)]
        opt.sync_params(params)
        for s in range(3):
            opt.step(params, _grads(s, rank, SHAPES, np.float32), threshold=100)
        saved, saved_params = pickle.dumps(opt.state_dict()), [p.copy() for p in params]
        for s in (3, 4):
            opt.step(params, _grads(s, rank, SHAPES, np.float32), threshold=100)
        fresh = DistOpt(SGD(lr=0.1), comm=comm, strategy=STRATEGY_FNS[kind]())
        again = [p.copy() for p in saved_params]
        fresh.sync_params(again)
        fresh.load_state_dict(pickle.loads(saved))
        for s in (3, 4):
            fresh.step(again, _grads(s, rank, SHAPES, np.float32), threshold=100)
        cold = DistOpt(SGD(lr=0.1), comm=comm, strategy=STRATEGY_FNS[kind]())  # no state: must differ
        other = [p.copy() for p in saved_params]
        cold.sync_params(other)
        for s in (3, 4):
            cold.step(other, _grads(s, rank, SHAPES, np.float32), threshold=100)
        return params, again, other, pickle.loads(saved)

    for params, again, cold, state in run_world(2, rank_fn):
        assert all(np.array_equal(a, b) for a, b in zip(params, again))
        assert not all(np.array_equal(a, b) for a, b in zip(params, cold))
        assert state["rank_local"]["strategy"]["steps"] == 3


# ---------------------------------------------------------- misconfiguration
def test_dgc_refuses_distopt_sgd_with_momentum_before_any_collective():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=DGC())
        w = np.zeros(3)
        opt.sync_params([w])
        calls = len(comm.calls)
        with pytest.raises(ValueError, match=r"distopt\.SGD\.momentum is 0\.9, expected 0.*DGC\(momentum=0\.9"):
            opt.step([w], [np.ones(3)])
        return len(comm.calls) - calls

    assert run_world(2, rank_fn) == [0, 0]


def test_dgc_refuses_torch_sgd_with_momentum():
    torch = pytest.importorskip("torch")

    def rank_fn(rank, comm):
        model = torch.nn.Linear(3, 2)
        groups = [{"params": [model.weight]}, {"params": [model.bias], "momentum": 0.5}]
        opt = DistOpt(torch.optim.SGD(groups, lr=0.1, momentum=0.0), comm=comm, strategy=DGC())
        with pytest.raises(ValueError, match=r"torch\.optim\.SGD\.param_groups\[1\]\['momentum'\] is 0\.5"):
            opt.backward_and_update(model(torch.ones(4, 3)).sum())
        opt.close()  # its hooks leave the model (and it closes the world's communicator)
        from distopt.comm import create

        ok = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=create("single"), strategy=DGC(sparsity=0.5))
        ok.backward_and_update(model(torch.ones(4, 3)).sum())  # momentum 0: runs
        return ok.stats.steps

    assert run_world(1, rank_fn) == [1]


def test_constructor_arguments_are_checked():
    assert DGC() == DGC() and hash(DGC()) == hash(DGC()) and DGC() != DGC(sparsity=0.99)  # settings hashable
    assert hash(PowerSGD()) == hash(PowerSGD()) and PowerSGD() != PowerSGD(rank=4)
    for bad, match in [(dict(sparsity=1.0), "sparsity must be in"), (dict(momentum=1.0), "momentum must be"),
                       (dict(clip_norm=0.0), "clip_norm must be"), (dict(warmup_steps=-1), "warmup_steps"),
                       (dict(warmup_sparsity=(0.5, 1.5)), r"warmup_sparsity\[1\]")]:
        with pytest.raises(ValueError, match=match):
            DGC(**bad)
    for bad, match in [(dict(rank=0), "rank must be"), (dict(start_step=-1), "start_step"),
                       (dict(min_compression_rate=float("nan")), "min_compression_rate")]:
        with pytest.raises(ValueError, match=match):
            PowerSGD(**bad)


def test_ranks_with_different_settings_fail_on_every_rank():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, strategy=PowerSGD(rank=1 + rank))
        opt.step([np.zeros((4, 4))], [np.ones((4, 4))])

    with pytest.raises(RankFailed, match="differ"):
        run_world(2, rank_fn)


# ------------------------------------------------------------- CuPy twins
def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cupy


class _HostHop:
    """A simulated-world communicator for CuPy arrays: copies to the host, reduces there, copies back."""

    def __init__(self, inner, cupy):
        self.inner, self.cupy = inner, cupy
        self.rank, self.size, self.name = inner.rank, inner.size, inner.name

    def all_reduce(self, array, op="sum"):
        if not hasattr(array, "get"):
            return self.inner.all_reduce(array, op)
        host = array.get()
        self.inner.all_reduce(host, op)
        array[...] = self.cupy.asarray(host)
        return array

    def broadcast(self, array, root=0):
        host = array.get()
        self.inner.broadcast(host, root)
        array[...] = self.cupy.asarray(host)
        return array

    def all_gather(self, array):
        if not hasattr(array, "get"):
            return self.inner.all_gather(array)
        return self.cupy.asarray(self.inner.all_gather(array.get()))

    def all_gather_v(self, array):
        return [self.cupy.asarray(a) for a in self.inner.all_gather_v(array.get())]

    def barrier(self):
        self.inner.barrier()

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("kind", sorted(STRATEGY_FNS))
def test_cupy_twin_matches_numpy(kind):
    cupy = _cupy()

    def rank_fn(rank, comm):
        out = []
        for on_gpu in (False, True):
            opt = DistOpt(SGD(lr=0.05), comm=_HostHop(comm, cupy), strategy=STRATEGY_FNS[kind]())
            params = [p.astype(np.float32) for p in _params(SHAPES)]
            if on_gpu:
                params = [cupy.asarray(p) for p in params]
            opt.sync_params(params)
            for s in range(6):
                grads = _grads(s, rank, SHAPES, np.float32)
                opt.step(params, [cupy.asarray(g) for g in grads] if on_gpu else grads, threshold=100)
            out.append([cupy.asnumpy(p) for p in params])
        return out

    for cpu, gpu in run_world(2, rank_fn, timeout=120):
        for a, b in zip(gpu, cpu):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
