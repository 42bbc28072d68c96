"""Half (:mod:`distopt.strategies.half`): clip, scale by 1/predivide, 16-bit sum, scale back.

Driven bucket by bucket in a simulated world on values every step of which
is exact in float16, so the expected average is exact; the constructor's
and ``bind``'s checks.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, DistOpt
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


def test_h07_fp16_no_underflow_predivide_1_at_w8():
    """H07 at its stated world size W=8: 1.2e-7 on every rank; predivide=1 keeps it (> 0, within 6e-8), the
    default predivide (W) never gives a NaN; every rank ends with the same bytes."""
    def rank_fn(rank, comm):  # noqa: ARG001
        kept_opt = DistOpt(SGD(lr=1.0), comm=comm)
        p, g = np.zeros(4, np.float32), np.full(4, 1.2e-7, np.float32)
        kept_opt.step_half([p], [g], predivide=1)
        default_opt = DistOpt(SGD(lr=1.0), comm=comm)
        q, g2 = np.zeros(4, np.float32), np.full(4, 1.2e-7, np.float32)
        default_opt.step_half([q], [g2])  # default predivide = W: may flush to 0 at W=8 (documented trade-off)
        return g, p, g2, q

    results = run_world(8, rank_fn)
    kept, p, g2, q = results[0]
    assert (kept > 0).all(), kept
    np.testing.assert_allclose(kept, 1.2e-7, rtol=0, atol=6e-8)
    np.testing.assert_allclose(p, -kept)
    assert not np.isnan(g2).any() and not np.isnan(q).any()
    assert (g2 >= 0).all() and np.isfinite(g2).all()
    for other in results[1:]:
        assert [a.tobytes() for a in other] == [a.tobytes() for a in results[0]]
