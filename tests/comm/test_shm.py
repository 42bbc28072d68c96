"""The shared-memory backend: conformance at 1, 2 and 4 processes (the shm pools), failures, cleanup."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from distopt.comm import create
from distopt.comm.shm import ShmCommunicator, unlink_segments
from distopt.errors import CollectiveTimeoutError
from distopt.launch import spawn
from distopt.launch.nccl_id import NcclIdHolder
from tests.support import conformance, shm_workers
from tests.support.backends import run_case
from tests.support.shm_workers import job_segments


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
@pytest.mark.world
def test_conformance(nprocs):
    """On the shm pool of W = nprocs (a fresh job id per case): every check, then nothing left in /dev/shm."""
    job_ids = run_case("shm", nprocs, shm_workers.conformance_case, timeout=50)
    assert len(set(job_ids)) == 1 and job_segments(job_ids[0]) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.world
def test_sharded_collectives(nprocs):
    """reduce_scatter, all_gather_into and all_to_all (tests/support/conformance.py's SHARD_CHECKS)."""
    assert run_case("shm", nprocs, conformance.shard_case, timeout=100) == [len(conformance.SHARD_CHECKS)] * nprocs


@pytest.mark.unit
def test_registry_and_local_checks():
    holder = NcclIdHolder()
    with create("shm", rank=0, size=1, job_id=holder.job_id, timeout=5) as comm:
        assert comm.name == "shm" and (comm.rank, comm.size) == (0, 1)
        with pytest.raises(TypeError, match="avg"):
            comm.all_reduce(np.ones(3, np.int64), op="avg")
        with pytest.raises(TypeError, match="not supported"):
            comm.all_reduce(np.ones(3, np.dtype(">f4")))
        with pytest.raises(FileExistsError, match="already open"):
            ShmCommunicator(0, 1, holder.job_id)
        h = np.ones(3, np.float16)
        assert comm.all_reduce(h, op="avg") is h
    assert job_segments(holder.job_id) == []
    with pytest.raises(ValueError, match="job_id"):
        ShmCommunicator(0, 1, "../etc")
    with pytest.raises(ValueError, match="closed"):
        comm.barrier()


@pytest.mark.timeout(60)
@pytest.mark.world
def test_dead_peer_is_named_promptly():
    """Rank 1 is SIGKILLed mid-sequence: ranks 0 and 2 raise naming it, long before the timeout."""
    holder = NcclIdHolder()
    outcomes, _ = shm_workers.run_with_killed_rank(
        shm_workers.dead_peer_worker, lambda r, results: (holder, r, 3, results), 3, survivors=[0, 2])
    assert sorted(outcomes) == [0, 2]
    for rank, (text, secs) in outcomes.items():
        assert "rank 1 (pid" in text and "has exited" in text, f"rank {rank}: {text}"
        assert secs < shm_workers.TIMEOUT / 2, f"rank {rank} took {secs:.1f} s to notice"
    # only the killed rank's own segments can be left; the job sweep removes them
    leftovers = unlink_segments(holder.job_id, untrack=True)
    assert all(".r1." in name for name in leftovers), leftovers
    assert job_segments(holder.job_id) == []


@pytest.mark.timeout(60)
@pytest.mark.world
def test_skipped_collective_times_out_naming_rank():
    holder = NcclIdHolder()
    all_done = multiprocessing.get_context("spawn").Barrier(3)
    spawn(shm_workers.skip_worker, 3, (all_done,), nccl_id=holder, timeout=50)
    assert job_segments(holder.job_id) == []


@pytest.mark.unit
def test_rendezvous_times_out_naming_missing_rank():
    holder = NcclIdHolder()
    with pytest.raises(CollectiveTimeoutError, match=r"rendezvous .*rank 1 did not join"):
        ShmCommunicator(0, 2, holder.job_id, timeout=0.3)
    assert job_segments(holder.job_id) == []
