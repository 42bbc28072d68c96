"""DistOpt under real mpiexec jobs of 1, 2 and 4 ranks."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world


@pytest.mark.parametrize("n", [1, 2, 4])
def test_distopt_dense(n):
    run_mpi_suite("mpi_distopt.py", n)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_torch_adapter(n):
    pytest.importorskip("torch")
    run_mpi_suite("mpi_torch.py", n)
