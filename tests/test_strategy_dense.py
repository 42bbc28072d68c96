"""Dense (:mod:`distopt.strategies.dense`): one sum all-reduce per bucket, the division folded where it is cheapest.

Driven bucket by bucket in a simulated world (no ``DistOpt``): a bucket
that IS the gradient is divided in place; a packed copy leaves the division
to the unpack (:class:`~distopt.strategies.Done`'s ``divisor``).
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt.core.buckets import plan_buckets
from distopt.core.counters import Counters
from distopt.strategies import BucketContext, Dense
from tests.simworld import run_world

pytestmark = pytest.mark.unit


def _ctx(comm, n: int, viewed: bool) -> BucketContext:
    bucket, = plan_buckets([((n,), np.dtype(np.float64))], 1, n)
    return BucketContext(0, 1, 0, bucket, viewed, comm, comm.all_reduce_async, Counters())


@pytest.mark.parametrize("viewed", [True, False], ids=["viewed", "packed"])
def test_dense_sums_and_divides_in_place_only_when_the_buffer_is_the_gradient(viewed):
    def rank_fn(rank, comm):
        strategy, ctx = Dense(), _ctx(comm, 3, viewed)
        flat = np.array([1.0, 2.0, 4.0]) * (rank + 1)
        started = strategy.start(ctx, flat)
        done = strategy.finish(ctx, flat, started, comm.size)
        return flat, done

    for flat, done in run_world(3, rank_fn):
        assert done.wire_bytes == 3 * 8
        if viewed:
            assert done.divisor == 1
            np.testing.assert_array_equal(flat, [2.0, 4.0, 8.0])   # the mean of x1, x2, x3
        else:
            assert done.divisor == 3
            np.testing.assert_array_equal(flat, [6.0, 12.0, 24.0])  # the sum: the unpack divides


def test_dense_declares_overlap_and_join_and_has_no_settings():
    assert Dense.supports_overlap and Dense.supports_join and not Dense.per_rank_state
    assert Dense().describe() == {"strategy": "plain"} and Dense() == Dense()
