"""Communicator conformance on the MPI backend (run under mpiexec -n 1/2/4)."""
from __future__ import annotations

import pytest

from distopt.comm import create
from tests.support import conformance


@pytest.fixture(scope="module")
def comm():
    c = create("mpi")
    yield c
    c.close()


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
def test_conformance(comm, check):
    check(comm)


@pytest.mark.parametrize("check", conformance.SHARD_CHECKS, ids=lambda f: f.__name__)
def test_sharded_collectives(comm, check):
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


def test_async_shard_handle_times_out_and_waits_twice(comm):
    """A reduce-scatter one rank never starts: the others' wait() raises CollectiveTimeoutError naming
    the call and the rank, bounded by the timeout (a communicator of its own, left broken)."""
    import time

    import numpy as np
    from mpi4py import MPI

    from distopt.errors import CollectiveTimeoutError

    if comm.size < 2:
        pytest.skip("needs two ranks")
    stalled = create("mpi", timeout=1)
    if stalled.rank != 1:
        handle = stalled.reduce_scatter_async(np.ones(4 * stalled.size))
        start = time.monotonic()
        for _ in range(2):
            with pytest.raises(CollectiveTimeoutError,
                               match=rf"mpi reduce_scatter_async of {4 * stalled.size} elements on rank "
                                     rf"{stalled.rank} did not complete within 1 s"):
                handle.wait()
        assert time.monotonic() - start < 10
        assert not handle.test()
    MPI.COMM_WORLD.Barrier()
    stalled.close()
