"""DistOpt strategies (half, sparse, partial) under real mpiexec jobs.

The inner suite ``tests/support/mpi/mpi_strategies.py`` runs on every rank of the MPI pools
at W=2 and W=4; shared cases stated for W=2 (H12, H14, H17, H18) run at W=2,
and H06 (W=4) at W=4; H07 at its stated W=8 runs in the simulated world
(tests/strategies/test_strategy_half.py), and at W=2 and 4 here.
"""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world

SUITE = "mpi_strategies.py"


@pytest.mark.parametrize("n", [2, 4])
def test_strategies(n):
    outs = run_mpi_suite(SUITE, n, 120.0)  # on the MPI pool
    if n == 2:  # every case stated for W=2 really ran here
        for out in outs:
            assert "stated for W=" not in out, out[-4000:]

