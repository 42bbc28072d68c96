"""The MPI communicator suite under real mpiexec jobs of 1, 2 and 4 ranks."""
from __future__ import annotations

import pytest

from tests.support.harness import run_mpi_suite


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.world
def test_mpi_conformance(n):
    run_mpi_suite("mpi_comm.py", n)


SKIP_ONE = """
import numpy as np
from distopt.comm import create
from distopt.errors import CollectiveTimeoutError
c = create("mpi", timeout=2)
c.all_reduce(np.ones(4))
if c.rank != 1:
    try:
        c.barrier()
    except CollectiveTimeoutError as e:
        print(f"TIMEOUT {c.rank} {e}", flush=True)
"""


@pytest.mark.world
def test_timeout_names_the_rank_that_did_not_arrive():
    """Rank 1 skips a barrier: ranks 0 and 2 time out naming rank 1 and where it is."""
    import sys

    from tests.support.harness import rank_streams, run_job

    res = run_job([sys.executable, "-c", SKIP_ONE], n=3, timeout=60)
    streams = rank_streams(res.stdout)  # ranks' lines interleave, even mid-line
    timed_out = {r for r, text in streams.items() if f"TIMEOUT {r} " in text}
    assert timed_out == {0, 2}, res.stdout[-4000:]
    for r in timed_out:
        line = streams[r][streams[r].index(f"TIMEOUT {r} "):].splitlines()[0]
        assert "barrier #2" in line and "ranks that did not arrive: 1 (at all_reduce #1)" in line, line


@pytest.mark.unit
def test_control_block_exchange_persistent_and_without_persistent_collectives():
    """The control block goes by MPI 4's persistent all-gather (restarted for every call, so each
    exchange carries the block's current bytes), or by one Iallgather per call on an MPI library
    without persistent collectives."""
    import numpy as np
    from mpi4py import MPI

    from distopt.comm.mpi import _control_exchange

    class Mpi3Comm:  # mpi4py raises NotImplementedError where the library lacks MPI_Allgather_init
        def Allgather_init(self, *spec):  # noqa: N802
            raise NotImplementedError("MPI_Allgather_init")

        def Iallgather(self, *spec):  # noqa: N802
            return MPI.COMM_SELF.Iallgather(*spec)

    for comm, persistent_expected in ((MPI.COMM_SELF, True), (Mpi3Comm(), False)):
        block, table = np.zeros(16, np.uint8), np.zeros((1, 16), np.uint8)
        persistent, start = _control_exchange(comm, block, table)
        assert (persistent is not None) == persistent_expected
        for value in (3, 7):
            block[:] = np.arange(16) + value
            start().Wait()
            assert (table[0] == block).all(), (persistent_expected, value, table)
        if persistent is not None:
            persistent.Free()
