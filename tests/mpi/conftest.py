"""Inner plugin for suites run under mpiexec: record where each rank is."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from mpi4py import MPI

_PROGRESS = os.environ.get("DISTOPT_TEST_PROGRESS")
RANK = MPI.COMM_WORLD.Get_rank()


def _write(state: str) -> None:
    if _PROGRESS:
        Path(_PROGRESS, f"rank{RANK}").write_text(state)


def pytest_runtest_logstart(nodeid: str, location) -> None:  # noqa: ARG001
    _write(nodeid)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001
    _write("done" if exitstatus in (0, 5) else f"failed (pytest exit {exitstatus})")


@pytest.fixture(scope="session")
def world():
    """mpi4py's COMM_WORLD."""
    return MPI.COMM_WORLD
