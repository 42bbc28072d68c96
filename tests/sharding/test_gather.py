"""The parameters' all-gather after a sharded update (:class:`distopt.sharding.gather.ParamGather`)."""
from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import pytest

from distopt.comm.single import SingleCommunicator
from distopt.core.buckets import plan_buckets
from distopt.core.bucket_run import BucketRun
from distopt.sharding.gather import ParamGather
from distopt.sharding.plan import plan_shards
from tests.support.backends import run_case

#: Eight parameters of 64K float32 elements, fused two by two: four packed buckets of 512 KiB.
SHAPES = [(65536,)] * 8
BUCKET_BYTES = 2 * 65536 * 4


def _buckets() -> list:
    buckets = plan_buckets([(s, np.float32) for s in SHAPES], 65536, 2 * 65536)
    assert [b.size for b in buckets] == [2 * 65536] * 4
    return buckets


def _runs(buckets: list) -> list[BucketRun]:
    return [BucketRun(i, b, 0) for i, b in enumerate(buckets)]


def case_gather(rank: int, comm, keep: bool) -> tuple[list[np.ndarray], int]:
    """Each rank's segments hold its rank number + 1, the rest NaN; one synchronous gather. Returns the
    parameters and the number of buffers kept for later steps."""
    buckets = _buckets()
    plan = plan_shards(buckets, rank, comm.size)
    params = [np.full(s, np.nan, dtype=np.float32) for s in SHAPES]
    for p in plan.pieces:
        params[p.index].reshape(-1)[p.start:p.stop] = rank + 1
    buffers: list[np.ndarray | None] = [None] * len(buckets)
    ParamGather(comm, _runs(buckets), plan, params, buffers, lambda what: contextlib.nullcontext(), False, keep).start()
    return params, sum(b is not None for b in buffers)


def _gather_peak(keep: bool) -> int:
    """BYTES of new memory at the peak of one synchronous gather on one rank (traced)."""
    comm = SingleCommunicator()
    buckets = _buckets()
    plan = plan_shards(buckets, 0, 1)
    params = [np.ones(s, dtype=np.float32) for s in SHAPES]
    tracemalloc.start()
    try:
        ParamGather(comm, _runs(buckets), plan, params, [None] * len(buckets), lambda what: contextlib.nullcontext(), False,
                    keep).start()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        comm.close()


@pytest.mark.unit
def test_stage2_gather_packs_every_bucket_into_one_scratch_buffer():
    """``keep=False`` (stage 2): every parameter ends bitwise whole on both ranks, and the gather holds one
    bucket's bytes at a time (a scratch per rank) instead of every bucket's; ``keep=True`` (stage 1) keeps
    a buffer per bucket for the next steps."""
    counts = plan_shards(_buckets(), 0, 2).counts
    want = [np.concatenate([np.full(c, r + 1, dtype=np.float32) for r, c in enumerate(cs)]) for cs in counts]
    for keep, kept_buffers in ((False, 0), (True, 4)):
        for params, kept in run_case("sim", 2, case_gather, keep):
            got = [np.concatenate([params[2 * b], params[2 * b + 1]]) for b in range(4)]
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), keep
            assert kept == kept_buffers
    scratch, kept = _gather_peak(False), _gather_peak(True)
    assert scratch < 1.5 * BUCKET_BYTES, scratch
    assert kept >= 4 * BUCKET_BYTES, kept
