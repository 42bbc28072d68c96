"""Overlap suite under mpiexec at 2 and 4 ranks."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world


@pytest.mark.parametrize("n", [2, 4])
def test_overlap(n):
    pytest.importorskip("torch")
    run_mpi_suite("mpi_overlap.py", n)
