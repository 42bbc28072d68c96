"""DGC and PowerSGD under a real ``mpiexec -n 2`` job (inner suite ``tests/support/mpi/mpi_dgc_powersgd.py``)."""
from __future__ import annotations

import sys

import pytest

from tests.support.harness import MPI_DIR, run_job

pytestmark = pytest.mark.world

SUITE = "mpi_dgc_powersgd.py"


def test_dgc_powersgd_under_mpiexec_n2():
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-o", "python_files=mpi_*.py", "-rsxX", str(MPI_DIR / SUITE)]
    res = run_job(argv, 2, 120.0)
    assert res.returncode == 0, f"{SUITE} failed at -n 2 (exit {res.returncode}):\n{res.stdout[-8000:]}"
    assert "2 passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-4000:]
