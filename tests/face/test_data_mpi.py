"""Data-across-ranks suite (join, accumulation, metrics, stop decisions) at 2, 3 and 4 ranks."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite

pytestmark = pytest.mark.world


@pytest.mark.parametrize("n", [2, 3, 4])
def test_data_suite(n):
    run_mpi_suite("mpi_data.py", n)
