"""Half (:mod:`distopt.strategies.half`): clip, scale by 1/predivide, 16-bit sum, scale back.

Driven bucket by bucket in a simulated world on values every step of which
is exact in float16, so the expected average is exact; the constructor's
and ``bind``'s checks.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt.core.buckets import plan_buckets
from distopt.core.counters import Counters
from distopt.strategies import BucketContext, Half
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


def test_half_clips_predivides_and_averages_on_a_16_bit_wire():
    grads = [[3.0, -0.25, 1.0, 0.0], [1.0, 0.5, -5.0, 0.25]]  # clip 2: [2, -.25, 1, 0] and [1, .5, -2, .25]

    def rank_fn(rank, comm):
        strategy = Half(clip=2.0)
        strategy.bind(comm.size, None)
        bucket, = plan_buckets([((4,), np.dtype(np.float32))], 1, 4)
        flat = np.array(grads[rank], np.float32)
        ctx = BucketContext(0, 1, 0, bucket, True, comm, comm.all_reduce_async, Counters(), out=flat)
        started = strategy.start(ctx, flat)
        wire = started.wait()
        return strategy.finish(ctx, flat, started, comm.size), flat, wire.dtype

    for done, flat, wire_dtype in run_world(2, rank_fn):
        assert wire_dtype == np.float16 and done.wire_bytes == 2 * 4 and done.divisor == 1 and done.result is None
        np.testing.assert_array_equal(flat, np.array([1.5, 0.125, -0.5, 0.125], np.float32))


def test_half_settings_are_validated():
    with pytest.raises(ValueError, match="wire must be one of"):
        Half(wire="int8")
    with pytest.raises(ValueError, match="clip must be > 0"):
        Half(clip=0.0)
    with pytest.raises(ValueError):
        Half(predivide=0.0).bind(2, None)  # checked against the world size at the first step
    assert Half(wire="bfloat16").settings() == {"wire": "bfloat16", "predivide": None, "clip": None}
