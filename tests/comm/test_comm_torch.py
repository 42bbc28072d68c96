"""The torch.distributed backend: conformance at 1, 2 and 4 processes (the torch pools), timeouts, close."""
from __future__ import annotations

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
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT, which are not set: start the script with torchrun"):
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
