"""Worker functions for the spawned shm and launch tests.

They live at the top level of an importable module so that the ``spawn``
start method can pickle them by reference. Each takes SINGA's
``(nccl_id, gpu_num, gpu_per_node, *args)``.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from distopt.comm.shm import ShmCommunicator, segment_prefix
from distopt.errors import CollectiveTimeoutError
from tests.support import conformance

#: Collective deadline inside test workers, in seconds.
TIMEOUT = 10.0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a reaped worker does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def job_segments(job_id: str) -> list[str]:
    """Names in /dev/shm that belong to ``job_id``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix(job_id)))


def make_comm(nccl_id, rank: int, size: int, timeout: float = TIMEOUT) -> ShmCommunicator:
    return ShmCommunicator(rank=rank, size=size, job_id=nccl_id.job_id, timeout=timeout)


def check_rank_order_sums(comm: ShmCommunicator) -> None:
    """Float sums add in rank order, identically on every rank, whether the array is reduced whole
    (at most 8 KiB) or by reduce-scatter; float16 accumulates in float32."""
    for n in (5, 2048, 2049, 300_001):  # 2048 float32 = 8 KiB: the largest reduced whole
        inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(comm.size)]
        expect = inputs[0].copy()
        for x in inputs[1:]:
            expect += x
        for op, want in (("sum", expect), ("avg", expect / np.float32(comm.size))):
            a = inputs[comm.rank].copy()
            comm.all_reduce(a, op=op)
            np.testing.assert_array_equal(a, want, err_msg=f"{n} elements, {op}")
    # 2048 + 1 + 1 + 1: float16 steps by 2 there, so float16 accumulation would stay at 2048
    h = np.full(3, 2048.0 if comm.rank == 0 else 1.0, np.float16)
    comm.all_reduce(h)
    np.testing.assert_array_equal(h, np.float16(np.float32(2048 + comm.size - 1)))


def conformance_case(rank: int, comm: ShmCommunicator) -> str:
    """A pool case (:mod:`tests.support.pool`) on the case's communicator: the conformance suite, shm's
    own checks, close; rank 0 then checks every segment was unlinked. Returns the job id (the test
    process checks /dev/shm once more)."""
    conformance.run_all(comm)
    check_rank_order_sums(comm)
    job_id = comm.job_id
    comm.close()  # the pool's own close() afterwards is a second close: a no-op
    if rank == 0:  # the others close concurrently: give them a moment
        deadline = time.monotonic() + 5
        while job_segments(job_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job_segments(job_id) == [], "close() left segments behind"
    return job_id


def dead_peer_worker(nccl_id, rank: int, size: int, results) -> None:
    """Rank 1 SIGKILLs itself after one all-reduce; the others report what they saw."""
    comm = make_comm(nccl_id, rank, size)
    a = np.ones(100_000, np.float32)
    comm.all_reduce(a)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(a)
        outcome = "no error"
    except CollectiveTimeoutError as exc:
        outcome = str(exc)
    results.put((rank, outcome, time.monotonic() - start))
    comm.close()


def skip_worker(nccl_id, rank: int, size: int, all_done) -> None:
    """Rank 1 skips a barrier; the others must time out naming it.

    ``all_done`` is a multiprocessing Barrier for every rank: rank 1 stays
    open until the others have seen their timeout.
    """
    with make_comm(nccl_id, rank, size, timeout=1.5) as comm:
        comm.barrier()
        if rank != 1:
            with pytest.raises(CollectiveTimeoutError, match=r"barrier #2 .*rank 1 did not arrive"):
                comm.barrier()
        all_done.wait(30)


def boom_worker(nccl_id, rank: int, size: int, pid_dir: str) -> None:
    """H02: rank 1 raises after building the communicator; the others wait in collectives."""
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    comm = make_comm(nccl_id, rank, size, timeout=60)
    if rank == 1:
        raise ValueError("boom")
    comm.barrier()
    comm.all_reduce(np.ones(4))


def log_worker(nccl_id, rank: int, size: int) -> None:
    """H25c: one INFO and one WARNING per rank."""
    log = logging.getLogger("distopt")
    log.info("starting on %d ranks", size)
    log.warning("warning from rank %d", rank)


def run_with_killed_rank(target, args_of, nprocs: int, survivors: list[int], wait_s: float = 40.0):
    """Start ``nprocs`` spawned workers ``target(*args_of(rank, results))`` without fail-fast; collect one
    ``(rank, text, seconds)`` report from each survivor; reap every worker. Returns (outcomes, processes)."""
    import multiprocessing
    import queue

    import pytest

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(r, results)) for r in range(nprocs)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, float]] = {}
    try:
        for _ in survivors:
            try:
                rank, text, secs = results.get(timeout=wait_s)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(survivors) - set(outcomes))} reported nothing within {wait_s:.0f} s")
            outcomes[rank] = (text, secs)
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
    return outcomes, procs
