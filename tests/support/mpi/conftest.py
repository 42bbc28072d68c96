"""Inner plugin for suites run under mpiexec (a fresh job, or a worker of the MPI pool): record where each rank is."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from distopt import SGD, DistOpt
from distopt.comm.mpi import MPICommunicator

RANK = MPI.COMM_WORLD.Get_rank()


def _write(state: str) -> None:
    """Record ``state`` for the stall report: in a fresh job's progress folder (``DISTOPT_TEST_PROGRESS``),
    or after the case in a pool worker's progress file (``DISTOPT_TEST_POOL_AT``)."""
    progress = os.environ.get("DISTOPT_TEST_PROGRESS")
    if progress:
        Path(progress, f"rank{RANK}").write_text(state)
    at = os.environ.get("DISTOPT_TEST_POOL_AT")
    if at:
        case = Path(at).read_text().split(" > ")[0] if Path(at).exists() else "a case"
        Path(at).write_text(f"{case} > {state}")


def pytest_runtest_logstart(nodeid: str, location) -> None:  # noqa: ARG001
    _write(nodeid)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001
    _write("done" if exitstatus in (0, 5) else f"failed (pytest exit {exitstatus})")


@pytest.fixture(scope="session")
def world():
    """mpi4py's COMM_WORLD."""
    return MPI.COMM_WORLD


class Recording:
    """A communicator that forwards to another and records every call."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.size, self.name = inner.rank, inner.size, inner.name
        self.calls: list[tuple[str, int]] = []
        self.gathered: list[np.ndarray] = []  # what this rank handed to all_gather / all_gather_v

    def all_reduce(self, array, op="sum"):
        self.calls.append(("all_reduce", array.size))
        return self.inner.all_reduce(array, op=op)

    def broadcast(self, array, root=0):
        self.calls.append(("broadcast", array.size))
        return self.inner.broadcast(array, root=root)

    def all_gather(self, array):
        self.calls.append(("all_gather", array.size))
        self.gathered.append(array.copy())
        return self.inner.all_gather(array)

    def all_gather_v(self, array):
        self.calls.append(("all_gather_v", array.size))
        self.gathered.append(array.copy())
        return self.inner.all_gather_v(array)

    def barrier(self):
        self.calls.append(("barrier", 0))
        return self.inner.barrier()

    def close(self):
        return self.inner.close()


@pytest.fixture
def make(world):  # noqa: ARG001 (every rank builds in the same order)
    """Factory of DistOpt instances (plain SGD lr=1 by default), all closed at the end of the test.

    ``record=True`` wraps a fresh MPI communicator in :class:`Recording`.
    """
    made = []

    def build(sgd=None, *, record=False, **kwargs):
        if record:
            kwargs["comm"] = Recording(MPICommunicator())
        opt = DistOpt(sgd if sgd is not None else SGD(lr=1.0), **kwargs)
        made.append(opt)
        return opt

    yield build
    for opt in made:
        opt.close()
