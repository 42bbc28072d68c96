"""Sparse (:mod:`distopt.strategies.sparse`): top-K or threshold selection with error feedback.

:func:`~distopt.strategies.average_sparse` by hand at W=2 (the average,
each rank's residual, the bytes and the reported counts, on the sparse and
the dense-fallback transports), the constructor's checks and its
deprecated SINGA names (``spars``, ``topK``, ``corr``).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from distopt.core.counters import Counters
from distopt.strategies import Sparse, average_sparse
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit

# W=2, n=8 float32, int32 indices: a pair is 8 bytes, the dense bucket 32
GRADS = [[4, 1, 0, 0, 0, 0, 0, 2], [1, 0, 3, 0, 0, 0, 0, 0.5]]


def _run(select: str, density: float):
    def rank_fn(rank, comm):
        flat, residual, counters = np.array(GRADS[rank], np.float32), np.zeros(8, np.float32), Counters()
        sent = average_sparse(comm, flat, density=density, select=select, residual=residual, counters=counters)
        return flat, residual, sent, dict(counters)

    return run_world(2, rank_fn)


def test_topk_sends_k_pairs_per_rank_and_keeps_the_rest():
    """density 1/8: k=1; 2 ranks x 1 pair = 16 bytes < 32: sparse. Rank 0 sends {0: 4}, rank 1 {2: 3}."""
    for rank, (flat, residual, sent, counts) in enumerate(_run("topk", 0.125)):
        np.testing.assert_array_equal(flat, [2, 0, 1.5, 0, 0, 0, 0, 0])
        want = [0, 1, 0, 0, 0, 0, 0, 2] if rank == 0 else [1, 0, 0, 0, 0, 0, 0, 0.5]
        np.testing.assert_array_equal(residual, want)
        assert sent == 8 and counts["sparse_entries"] == 1 and counts["sparse_dense_fallbacks"] == 0


def test_topk_falls_back_to_a_dense_all_reduce_with_the_same_result():
    """density 1/4: k=2; 2 x 2 pairs = 32 bytes >= 32: the selection travels densely."""
    for rank, (flat, residual, sent, counts) in enumerate(_run("topk", 0.25)):
        np.testing.assert_array_equal(flat, [2.5, 0, 1.5, 0, 0, 0, 0, 1])
        want = [0, 1, 0, 0, 0, 0, 0, 0] if rank == 0 else [0, 0, 0, 0, 0, 0, 0, 0.5]
        np.testing.assert_array_equal(residual, want)
        assert sent == 32 and counts["sparse_entries"] == 2 and counts["sparse_dense_fallbacks"] == 1


def test_threshold_counts_differ_per_rank():
    """|g| >= 1.5: rank 0 sends {0: 4, 7: 2}, rank 1 {2: 3}; an 8-byte count first."""
    for rank, (flat, residual, sent, counts) in enumerate(_run("threshold", 1.5)):
        np.testing.assert_array_equal(flat, [2, 0, 1.5, 0, 0, 0, 0, 1])
        want = [0, 1, 0, 0, 0, 0, 0, 0] if rank == 0 else [1, 0, 0, 0, 0, 0, 0, 0.5]
        np.testing.assert_array_equal(residual, want)
        assert sent == 8 + 8 * (2 if rank == 0 else 1) and counts["sparse_entries"] == (2 if rank == 0 else 1)


def test_sparse_settings_are_validated_at_construction():
    with pytest.raises(ValueError, match=r"density \(SINGA's spars\) must be in \(0, 1\] with select='topk'"):
        Sparse(density=2.0, select="topk")
    with pytest.raises(ValueError, match="must be >= 0 with select='threshold'"):
        Sparse(density=-1.0)
    with pytest.raises(ValueError, match="select must be one of"):
        Sparse(select="random")
    assert Sparse().settings() == {"density": 0.05, "select": "threshold", "error_feedback": True}


def test_threshold_spells_the_absolute_threshold_of_select_threshold():
    assert Sparse(threshold=1e-3) == Sparse(density=1e-3, select="threshold")
    assert Sparse(threshold=0.5, select="threshold").settings()["density"] == 0.5
    for bad in ({"density": 0.1}, {"select": "topk"}, {"spars": 0.1}):
        with pytest.raises(TypeError, match="Sparse\\(threshold=t\\) is select='threshold'"):
            Sparse(threshold=1e-3, **bad)
    with pytest.raises(ValueError, match="must be >= 0 with select='threshold'"):
        Sparse(threshold=-1.0)


def test_singa_names_are_deprecated_but_mean_the_same():
    new = Sparse(density=0.01, select="topk", error_feedback=False)
    with pytest.warns(DeprecationWarning) as caught:
        assert Sparse(spars=0.01, topK=True, corr=False) == new
        assert Sparse(0.01, True, False) == new  # the old positional Sparse(spars, topK, corr)
    messages = [str(w.message) for w in caught]
    assert any("use density=" in m for m in messages) and any("use select=" in m for m in messages)
    assert any("use error_feedback=" in m for m in messages) and any("bool second argument" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names do not warn
        Sparse(0.01, "topk", False)
    with pytest.raises(TypeError, match="both density= and its deprecated name spars="):
        Sparse(density=0.1, spars=0.1)
