"""DGC and PowerSGD under a real ``mpiexec -n 2`` job (inner suite ``tests/support/mpi/mpi_dgc_powersgd.py``)."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world

SUITE = "mpi_dgc_powersgd.py"


def test_dgc_powersgd_under_mpiexec_n2():
    outs = run_mpi_suite(SUITE, 2, 120.0)  # every rank of the MPI pool at W=2
    assert len(outs) == 2, outs
    for out in outs:
        assert "2 passed" in out and "skipped" not in out, out[-4000:]
