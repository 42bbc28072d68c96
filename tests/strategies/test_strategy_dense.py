"""Dense (:mod:`distopt.strategies.dense`): one sum all-reduce per bucket, the division folded where it is cheapest.

Driven bucket by bucket in a simulated world (no ``DistOpt``): the sum is
all-reduced in place (or reduce-scattered to this rank's segment) and the
division is left to the bucket sync (:class:`~distopt.strategies.Done`'s
``divisor``), which folds it into the unpack or divides in place.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt.core.buckets import plan_buckets
from distopt.core.counters import Counters
from distopt.strategies import BucketContext, Dense
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


def _ctx(comm, n: int, viewed: bool) -> BucketContext:
    bucket, = plan_buckets([((n,), np.dtype(np.float64))], 1, n)
    return BucketContext(0, 1, 0, bucket, viewed, comm, comm.all_reduce_async, Counters())


@pytest.mark.parametrize("viewed", [True, False], ids=["viewed", "packed"])
def test_dense_sums_in_place_and_leaves_the_division_to_the_bucket_sync(viewed):
    def rank_fn(rank, comm):
        strategy, ctx = Dense(), _ctx(comm, 3, viewed)
        flat = np.array([1.0, 2.0, 4.0]) * (rank + 1)
        started = strategy.start(ctx, flat)
        done = strategy.finish(ctx, flat, started, comm.size)
        return flat, done

    for flat, done in run_world(3, rank_fn):
        assert done.wire_bytes == 3 * 8 and done.divisor == 3 and done.result is None
        np.testing.assert_array_equal(flat, [6.0, 12.0, 24.0])  # the sum, in place: the sync divides


def test_dense_under_a_reduce_scatter_reports_this_ranks_segment():
    def rank_fn(rank, comm):
        bucket, = plan_buckets([((4,), np.dtype(np.float64))], 1, 4)
        counts = [2, 1, 1]
        ctx = BucketContext(0, 1, 0, bucket, False, comm, lambda a, op: comm.reduce_scatter_async(a, counts, op),
                            Counters())
        flat = np.array([1.0, 2.0, 4.0, 8.0]) * (rank + 1)
        done = Dense().finish(ctx, flat, Dense().start(ctx, flat), comm.size)
        return done

    for rank, done in enumerate(run_world(3, rank_fn)):
        want = np.array([6.0, 12.0, 24.0, 48.0])[[slice(0, 2), slice(2, 3), slice(3, 4)][rank]]
        assert done.divisor == 3 and done.wire_bytes == 4 * 8
        np.testing.assert_array_equal(done.result, want)


def test_dense_declares_overlap_and_join_and_has_no_settings():
    assert Dense.supports_overlap and Dense.supports_join and not Dense.per_rank_state
    assert Dense().describe() == {"strategy": "plain"} and Dense() == Dense()


@pytest.mark.parametrize("views", [True, False], ids=["viewed", "packed"])
def test_bucket_sync_divides_a_viewed_bucket_in_place_and_a_packed_one_while_unpacking(views):
    from distopt.step.outcome import Agreement
    from distopt.comm.launcher import Launcher
    from distopt.step.pipeline import BucketPipeline

    def rank_fn(rank, comm):
        grad = np.array([1.0, 2.0, 4.0]) * (rank + 1)
        buckets = plan_buckets([((3,), np.dtype(np.float64))], 1, 3)
        counters = Counters()
        pipeline = BucketPipeline(Dense(), buckets, [None] * len(buckets), 0, [np.zeros(3)], Launcher(comm), comm,
                                  counters, Agreement(comm, counters, False, True), views=views)
        grads = [grad]
        pipeline.ready(0, grad)
        pipeline.launch_rest(grads)
        pipeline.finish(grads, comm.size)
        return grad, grads[0], pipeline.runs[0].viewed

    for grad, out, viewed in run_world(3, rank_fn):
        assert viewed is views
        np.testing.assert_array_equal(out, [2.0, 4.0, 8.0])  # the mean of x1, x2, x3
        assert (out is grad) or not views  # a viewed bucket IS the gradient: averaged in place
