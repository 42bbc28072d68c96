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


def test_half_sums_in_flight_complete_whatever_order_ranks_poll_them(comm):
    """Several float16 all-reduces in flight, polled in a rank-dependent order with a blocking call in
    between: their second stages must still start in the same order on every rank (no hang, exact sums)."""
    import time

    import numpy as np

    sizes = [70001, 3, 1001, 65536]
    arrays = [((np.arange(n) % 8) * (comm.rank + 1)).astype(np.float16) for n in sizes]
    handles = [comm.all_reduce_async(a, op="sum") for a in arrays]
    order = list(range(len(handles)))[::-1] if comm.rank % 2 else list(range(len(handles)))
    deadline = time.monotonic() + 1.0 + 0.2 * comm.rank  # ranks stop polling at different moments
    while time.monotonic() < deadline:
        for i in order:
            handles[i].test()
    comm.all_reduce(np.ones(2, np.float32))  # a blocking collective while sums may still be pending
    for i in order:
        handles[i].wait()
    total = comm.size * (comm.size + 1) // 2
    for n, a in zip(sizes, arrays):
        np.testing.assert_array_equal(a.astype(np.float32), (np.arange(n) % 8) * total)
