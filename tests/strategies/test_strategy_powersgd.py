"""PowerSGD (:mod:`distopt.strategies.powersgd`) in a simulated world of threads.

At full rank against dense averaging (float64, 1e-10), the plan of a
bucket and the bytes of its two all-reduces, the Gram-Schmidt
orthonormalization, the constructor's checks and its deprecated ``rank=``.
The generic invariants run in ``tests/strategies/test_strategy_conformance.py``;
error-feedback mass in ``tests/strategies/test_strategy_memory.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.core.buckets import plan_buckets
from distopt.strategies import Dense, PowerSGD
from distopt.strategies.powersgd import orthonormalize, plan_bucket
from tests.support.strategy_data import SHAPES
from tests.support.strategy_data import grads_for as _grads
from tests.support.strategy_data import params_for as _params
from tests.support.simworld import RankFailed, run_world

pytestmark = pytest.mark.unit



# -------------------------------------------------------- PowerSGD == dense
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_at_full_rank_equals_dense_averaging(world):
    """matrix_rank >= min(rows, cols), every matrix compressed: the same parameters as Dense (float64, 1e-10)."""
    def rank_fn(rank, comm):
        out = []
        for strategy in (Dense(), PowerSGD(matrix_rank=30, min_compression_rate=0)):
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
    factors, dense = plan_bucket(bucket, matrix_rank=2, min_compression_rate=2.0)
    # conv (6, 18): 108 >= 2 * 24 * 2; (20, 30): 600 >= 200; (4, 5): 20 < 2 * 9 * 2 -> dense
    assert [(f.rows, f.cols, f.rank) for f in factors] == [(6, 18, 2), (20, 30, 2)]
    assert [s.shape for s in dense] == [(6,), (30,), (4, 5)]
    expected = 4 * ((6 + 30 + 20) + (6 + 20) * 2 + (18 + 30) * 2)  # dense, then every P, then every Q

    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, strategy=PowerSGD(matrix_rank=2, start_step=2))
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


def test_powersgd_constructor_arguments_are_checked():
    assert hash(PowerSGD()) == hash(PowerSGD()) and PowerSGD() != PowerSGD(matrix_rank=4)
    for bad, match in [(dict(matrix_rank=0), "matrix_rank must be"), (dict(start_step=-1), "start_step"),
                       (dict(min_compression_rate=float("nan")), "min_compression_rate")]:
        with pytest.raises(ValueError, match=match):
            PowerSGD(**bad)


def test_powersgd_rank_keyword_is_deprecated_for_matrix_rank():
    with pytest.warns(DeprecationWarning, match="use matrix_rank="):
        old = PowerSGD(rank=3)
    assert old == PowerSGD(matrix_rank=3) == PowerSGD(3) and old.settings()["matrix_rank"] == 3
    with pytest.raises(TypeError, match="both matrix_rank= and its deprecated name rank="):
        PowerSGD(matrix_rank=2, rank=2)


def test_ranks_with_different_settings_fail_on_every_rank():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, strategy=PowerSGD(matrix_rank=1 + rank))
        opt.step([np.zeros((4, 4))], [np.ones((4, 4))])

    with pytest.raises(RankFailed, match="differ"):
        run_world(2, rank_fn)
