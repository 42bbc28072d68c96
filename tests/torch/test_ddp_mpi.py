"""DDP semantics with a PyTorch optimizer under mpiexec -n 2 (tests/support/mpi/mpi_ddp.py)."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world


def test_ddp_idioms_mpi():
    pytest.importorskip("torch")
    run_mpi_suite("mpi_ddp.py", 2, timeout=240.0)
