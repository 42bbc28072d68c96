"""The error-feedback memory (:mod:`distopt.strategies.memory`) and the mass it conserves.

:class:`Residuals` by itself (zeros on first use, the same array after,
a layout change dropped with a warning, state copies that round-trip), then
the invariant error feedback exists for, through ``DistOpt`` in a
simulated world: over T steps, the applied averages plus the ranks' mean
memory equal the sum of the true average gradients (float64, 1e-10), for
every strategy that keeps one (Sparse, DGC, PowerSGD).
"""
from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.core.buckets import plan_buckets
from distopt.strategies import DGC, PowerSGD, Residuals, Sparse
from tests.support.strategy_data import SHAPES
from tests.support.strategy_data import grads_for as _grads
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------- Residuals
def test_residuals_start_at_zero_and_are_updated_in_place():
    memory = Residuals()
    like = np.arange(4.0, dtype=np.float32)
    r = memory.get((7, 0), like)
    assert r.dtype == np.float32 and r.shape == (4,) and not r.any() and r is not like
    r += 1
    assert memory.get((7, 0), like) is r and memory.get((7, 1), like) is not r  # per bucket


def test_residuals_dropped_with_a_warning_when_the_layout_changes(caplog):
    memory = Residuals()
    memory.get((1, 0), np.ones(4))[...] = 5
    with caplog.at_level(logging.WARNING, logger="distopt"):
        resized = memory.get((1, 0), np.ones(6))
        retyped = memory.get((1, 0), np.ones(6, np.float32))
    assert resized.shape == (6,) and retyped.dtype == np.float32 and not retyped.any()
    assert caplog.text.count("layout changed") == 2 and "(4,) float64 -> (6,) float64" in caplog.text


def test_residuals_state_round_trip_copies():
    memory = Residuals()
    memory.get((2, 1), np.ones(3))[...] = [1, 2, 3]
    memory.get((1, 0), np.ones(2))[...] = [4, 5]
    state = memory.state_dict()
    assert state["keys"] == [[1, 0], [2, 1]]  # sorted, plain lists
    memory.buffers[(1, 0)][...] = 0  # the state is a copy
    restored = Residuals()
    restored.load_state_dict(pickle.loads(pickle.dumps(state)))
    state["values"][0][...] = -1  # and so is what a load keeps
    assert sorted(restored.buffers) == [(1, 0), (2, 1)]
    np.testing.assert_array_equal(restored.buffers[(1, 0)], [4, 5])
    np.testing.assert_array_equal(restored.buffers[(2, 1)], [1, 2, 3])


# ------------------------------------------------------------ mass conservation


def _rank_mean(arrays_per_rank):
    return np.mean(np.stack(arrays_per_rank), axis=0)


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
    _mass_case(world, lambda: PowerSGD(matrix_rank=1, start_step=1), lambda s: _flat_residuals(s.errors))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("select,density", [("topk", 0.05), ("threshold", 1.5)])
def test_sparse_error_feedback_conserves_mass(world, select, density):
    _mass_case(world, lambda: Sparse(density=density, select=select), lambda s: _flat_residuals(s.residuals))
