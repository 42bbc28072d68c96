"""DistOpt strategies (half, sparse, partial) under real mpiexec jobs.

The inner suite ``tests/support/mpi/mpi_strategies.py`` runs on every rank of the MPI pools
at W=2 and W=4; shared cases stated for W=2 (H12, H14, H17, H18) run at W=2,
H06 (W=4) at W=4, and H07 (W=8) in its own W=8 job that runs
only the H07 test (NumPy only, so 8 ranks on 2 cores take a few seconds).
"""
from __future__ import annotations

import sys

import pytest

from tests.support.harness import MPI_DIR, run_job, run_mpi_suite

pytestmark = pytest.mark.world

SUITE = "mpi_strategies.py"


def _run(n: int, *extra: str, timeout: float = 120.0) -> str:
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-o", "python_files=mpi_*.py", "-rsxX", str(MPI_DIR / SUITE), *extra]
    res = run_job(argv, n, timeout)
    assert res.returncode == 0, f"{SUITE} failed at -n {n} (exit {res.returncode}):\n{res.stdout[-8000:]}"
    return res.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_strategies(n):
    outs = run_mpi_suite(SUITE, n, 120.0)  # on the MPI pool
    if n == 2:  # every case stated for W=2 really ran here
        for out in outs:
            assert "stated for W=" not in out, out[-4000:]


def test_h07_fp16_underflow_at_w8():
    """H07 at its stated world size W=8 (only the H07 test of the inner suite)."""
    out = _run(8, "-k", "h07", timeout=90.0)
    assert "1 passed" in out and "skipped" not in out, out[-4000:]
