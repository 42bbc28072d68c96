"""The torch.distributed backend: conformance at 1, 2 and 4 processes (the torch pools), timeouts, close."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("torch")

from distopt.comm import create  # noqa: E402
from distopt.launch import spawn  # noqa: E402
from tests.support import conformance, torch_workers  # noqa: E402
from tests.support.backends import run_case  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
@pytest.mark.world
def test_conformance(nprocs):
    """On the torch pool of W = nprocs (a new default process group on a new port per case)."""
    assert run_case("torch", nprocs, torch_workers.conformance_case, timeout=100) == [len(conformance.CHECKS)] * nprocs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.world
def test_sharded_collectives(nprocs):
    """reduce_scatter(_async), all_gather_into(_async) and all_to_all (tests/support/conformance.py's SHARD_CHECKS)."""
    assert run_case("torch", nprocs, conformance.shard_case, timeout=130) == [len(conformance.SHARD_CHECKS)] * nprocs


@pytest.mark.timeout(60)
@pytest.mark.world
def test_skipped_collective_times_out():
    spawn(torch_workers.skip_worker, 2, (torch_workers.free_port(),), timeout=50)


@pytest.mark.unit
def test_needs_master_addr(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError,
                       match="MASTER_ADDR and MASTER_PORT, which are not set: start the script with torchrun"):
        create("torch", rank=0, size=1, timeout=5)


def stalled_reduce_scatter_case(rank, comm):
    """Rank 1 never starts the reduce-scatter: rank 0's wait() times out (1 s) naming the call and rank."""
    import time

    from distopt.errors import CollectiveTimeoutError

    comm.timeout = 1.0
    if rank == 0:
        handle = comm.reduce_scatter_async(np.ones(8))
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError,
                           match=r"torch reduce_scatter_async of 8 elements on rank 0 did not complete within 1 s"):
            handle.wait()
        return time.monotonic() - start
    time.sleep(2.5)
    return 0.0


@pytest.mark.timeout(60)
@pytest.mark.world
def test_async_shard_handle_times_out():
    seconds, _ = run_case("torch", 2, stalled_reduce_scatter_case, timeout=50)
    assert seconds < 10


def skipped_barrier_case(rank, comm, skipping):
    """The ranks in ``skipping`` sleep past the deadline (1 s) instead of calling barrier #2; every
    other rank's CollectiveTimeoutError is returned, as text, with the seconds its barrier took."""
    import time

    from distopt.errors import CollectiveTimeoutError

    comm.timeout = 1.0
    comm.barrier()
    if rank in skipping:
        time.sleep(3.0)
        return None
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        comm.barrier()
    return str(info.value), time.monotonic() - start


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs, skipping", [(3, (1,)), (4, (1, 3))], ids=["W3-rank1", "W4-ranks1and3"])
@pytest.mark.world
def test_timeout_names_the_ranks_that_did_not_arrive(nprocs, skipping):
    """Beyond two ranks the timeout names exactly the ranks that never called the collective (read
    from the process group's store), on every rank that waited."""
    results = run_case("torch", nprocs, skipped_barrier_case, skipping, timeout=60)
    for rank, got in enumerate(results):
        if rank in skipping:
            assert got is None
            continue
        message, seconds = got
        assert message.startswith(f"torch barrier #2 on rank {rank} did not complete within 1 s"), message
        # a rank whose barrier #1 was slow (past a tenth of the deadline) is also told where it was last seen
        named = ", ".join(rf"{r}( \(last seen waiting in barrier #1\))?" for r in skipping)
        assert re.search(rf"timed out after 1 s; ranks that did not arrive: {named}$", message), message
        assert seconds < 5, (rank, seconds)
