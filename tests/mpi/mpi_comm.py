"""Communicator conformance on the MPI backend (run under mpiexec -n 1/2/4)."""
from __future__ import annotations

import pytest

from distopt.comm import create
from tests import conformance


@pytest.fixture(scope="module")
def comm():
    c = create("mpi")
    yield c
    c.close()


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
def test_conformance(comm, check):
    check(comm)
