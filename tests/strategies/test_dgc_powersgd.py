"""DGC and PowerSGD through ``DistOpt`` in a simulated world of threads (milliseconds, no mpiexec).

Replicas stay bitwise identical over warm-up and compression, a resumed
run takes bitwise the same next steps (and a cold one does not), and the
CuPy twins match NumPy where CuPy and a GPU are present. Per-strategy math
lives in ``tests/strategies/test_strategy_dgc.py`` and ``tests/strategies/test_strategy_powersgd.py``;
the invariants every strategy keeps in ``tests/strategies/test_strategy_conformance.py``.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.strategies import DGC, PowerSGD
from tests.support.strategy_data import SHAPES
from tests.support.strategy_data import grads_for as _grads
from tests.support.strategy_data import params_for as _params
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit



# ---------------------------------------------- replicas and state round trips
STRATEGY_FNS = {
    "dgc": lambda: DGC(sparsity=0.9, momentum=0.9, clip_norm=5.0, warmup_steps=2, warmup_sparsity=(0.5, 0.75)),
    "powersgd": lambda: PowerSGD(matrix_rank=2, start_step=1),
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


# ------------------------------------------------------------- CuPy twins
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
        if not hasattr(array, "get"):
            return self.inner.broadcast(array, root)
        host = array.get()
        self.inner.broadcast(host, root)
        array[...] = self.cupy.asarray(host)
        return array

    def all_gather(self, array):
        if not hasattr(array, "get"):
            return self.inner.all_gather(array)
        return self.cupy.asarray(self.inner.all_gather(array.get()))

    def all_gather_v(self, array):
        if not hasattr(array, "get"):
            return self.inner.all_gather_v(array)
        return [self.cupy.asarray(a) for a in self.inner.all_gather_v(array.get())]

    def barrier(self):
        self.inner.barrier()

    def close(self):
        self.inner.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(STRATEGY_FNS))
def test_f20_cupy_twin_matches_numpy(kind):
    """F20: the CuPy twins of DGC and PowerSGD (marked ``gpu``, so ``pytest -m gpu`` runs them) give the
    NumPy bits, with host-staged collectives (the strategies' device code alone)."""
    from tests.support.gpu import devices

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
            out.append([cupy.asnumpy(p) if on_gpu else p for p in params])
        return out

    with devices(1) as cupy:
        for cpu, gpu in run_world(2, rank_fn, timeout=120):
            for a, b in zip(gpu, cpu):
                np.testing.assert_array_equal(a, b)
