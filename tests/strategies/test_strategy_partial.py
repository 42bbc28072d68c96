"""Partial (:mod:`distopt.strategies.partial`): a local update, then one chunk of parameters averaged per step.

The round-robin :class:`~distopt.strategies.ChunkCursor` by itself, then
through ``DistOpt`` in a simulated world: each step averages exactly the
chunk under the cursor, and the others keep every rank's own update.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.strategies import ChunkCursor, Partial, ParameterAverager
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


def test_chunk_cursor_wraps_and_round_trips():
    cursor = ChunkCursor()
    assert [cursor.take(3) for _ in range(4)] == [0, 1, 2, 0]
    assert cursor.take(2) == 1 and cursor.take(2) == 0  # fewer chunks now: wraps at the new count
    cursor.take(5)
    again = ChunkCursor()
    again.load_state_dict(cursor.state_dict())
    assert again.position == cursor.position == 2
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        cursor.take(0)


def test_partial_averages_the_chunk_under_the_cursor_each_step():
    """chunk_size 4: chunks [w (5 elements)] and [b (3)]; step 1 averages w, step 2 b, step 3 w again."""
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=Partial(chunk_size=4))
        w, b = np.zeros(5), np.zeros(3)
        seen = []
        for _ in range(3):
            opt.step([w, b], [np.full(5, rank + 1.0), np.full(3, 10.0 * (rank + 1))])
            seen.append((w.copy(), b.copy()))
        return seen

    ranks = run_world(2, rank_fn)
    for rank, seen in enumerate(ranks):
        (w1, b1), (w2, b2), (w3, b3) = seen
        np.testing.assert_array_equal(w1, np.full(5, -1.5))             # averaged: -mean(1, 2)
        np.testing.assert_array_equal(b1, np.full(3, -10.0 * (rank + 1)))  # this rank's own update
        np.testing.assert_array_equal(w2, np.full(5, -1.5 - (rank + 1)))  # drifts again: own update only
        np.testing.assert_array_equal(b2, np.full(3, -30.0))            # -mean(20, 40): two updates, averaged
        np.testing.assert_array_equal(w3, np.full(5, -4.5))


def test_partial_settings_are_validated_and_declared():
    with pytest.raises(ValueError, match="chunk_size"):
        Partial(chunk_size=0)
    assert issubclass(Partial, ParameterAverager) and not Partial.identical_replicas
    assert Partial(chunk_size=4).settings() == {"chunk_size": 4, "average_momentum": False}
