"""The inner MPI suite ``tests/support/mpi/mpi_checkpoint.py`` on the MPI pools: check_finite NaN/inf skipping
on every rank, strategy-mismatch messages (W=2), and H24's checkpoint writer at its stated W=4.

(Moved from tests/launch/test_reliability.py: a running world is all these need, not a fresh job.)
"""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite


def _inner_suite(n: int, timeout: float = 60.0) -> str:
    """Rank 0's output of the inner suite mpi_checkpoint.py on the MPI pool at W=n (a running world
    is all it needs: no fresh job)."""
    outs = run_mpi_suite("mpi_checkpoint.py", n, timeout, collective_timeout=10.0)
    assert len(outs) == n, outs  # every rank reported
    return outs[0]


@pytest.mark.timeout(90)
@pytest.mark.world
def test_mpi_suite_w2_nonfinite_and_mismatch():
    """check_finite NaN/inf skipping on every rank (plain, half, sparse, partial) and mismatch messages at W=2."""
    out = _inner_suite(2)
    assert "12 passed, 1 skipped" in out, out[-4000:]  # 8 non-finite, 4 mismatch; H24 skipped


@pytest.mark.timeout(90)
@pytest.mark.world
def test_mpi_suite_w4_h24_checkpoint_writer():
    """H24 at its stated W=4 (plus the size-agnostic tests again at W=4)."""
    out = _inner_suite(4)
    assert "13 passed" in out and "skipped" not in out, out[-4000:]  # H24 really ran
