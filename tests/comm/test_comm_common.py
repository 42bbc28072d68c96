"""What every backend shares: the timeout rule, closed errors, profiler ranges, wait time, logging, shm's platform check."""
from __future__ import annotations

import io
import logging

import numpy as np
import pytest

from distopt.comm import create
from distopt.comm.base import check_counts, split_counts
from distopt.comm.shm import ShmCommunicator
from distopt.comm.wait import Backoff, resolve_timeout, wait_until
from distopt.errors import BackendUnavailableError, CollectiveTimeoutError, CommunicatorClosedError
from distopt.launch.logs import setup_logging
from distopt.launch.nccl_id import NcclIdHolder
from tests.support import conformance

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("raw", ["-5", "0", "abc", "inf", "nan", ""])
def test_one_timeout_rule_for_every_backend(monkeypatch, raw):
    """Issue 12 item 4: DISTOPT_TIMEOUT is validated the same way by every backend (shm used to take -5)."""
    monkeypatch.setenv("DISTOPT_TIMEOUT", raw)
    message = f"DISTOPT_TIMEOUT must be a positive, finite number of seconds, got '{raw}'"
    with pytest.raises(ValueError, match=message):
        resolve_timeout(None)
    with pytest.raises(ValueError, match=message):
        ShmCommunicator(0, 1, NcclIdHolder().job_id)
    with pytest.raises(ValueError, match=message):
        create("mpi")
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match=message):
        create("torch", rank=0, size=1)


def test_timeout_argument_validated():
    assert resolve_timeout(2) == 2.0
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds, got -1"):
        ShmCommunicator(0, 1, NcclIdHolder().job_id, timeout=-1)


def test_wait_until_deadline_and_check():
    with pytest.raises(CollectiveTimeoutError, match="late"):
        wait_until(lambda: False, 0.0, lambda: CollectiveTimeoutError("late"), backoff=Backoff(0, 0, 1e-4, 1e-3))
    calls = []

    def check():
        calls.append(1)
        raise RuntimeError("peer gone")

    import time
    with pytest.raises(RuntimeError, match="peer gone"):
        wait_until(lambda: False, time.monotonic() + 5, lambda: CollectiveTimeoutError("late"), check=check,
                   check_every_s=0.01)
    assert calls == [1]
    wait_until(lambda: True, 0.0, lambda: CollectiveTimeoutError("never"))  # done at once: no timeout


def test_h39_closed_single_and_shm_raise_naming_the_communicator():
    shm = ShmCommunicator(0, 1, NcclIdHolder().job_id, timeout=5)
    for comm in (create("single"), shm):
        comm.all_reduce(np.ones(2))
        comm.close()
        comm.close()  # idempotent
        assert comm.closed
        for call in (lambda: comm.all_reduce(np.ones(2)), lambda: comm.broadcast(np.ones(2)), comm.barrier,
                     lambda: comm.all_gather(np.ones(2)), lambda: comm.all_gather_v(np.ones(2)),
                     lambda: comm.reduce_scatter(np.ones(2)), lambda: comm.all_gather_into(np.ones(2)),
                     lambda: comm.all_to_all(np.ones((1, 2)))):
            with pytest.raises(CommunicatorClosedError, match=f"on the closed {comm.name} communicator .rank 0 of 1."):
                call()


def test_wait_seconds_counts_blocking_calls():
    comm = create("single")
    assert comm.wait_seconds == 0.0
    comm.barrier()
    comm.all_reduce(np.ones(10))
    assert 0.0 < comm.wait_seconds < 1.0


def test_collectives_are_named_ranges_in_torch_profiler():
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    comm = create("single")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comm.all_reduce(np.ones(4))
        comm.broadcast(np.ones(4))
        comm.all_reduce_async(np.ones(4)).wait()
    names = {e.key for e in prof.key_averages()}
    assert {"distopt.all_reduce", "distopt.broadcast", "distopt.all_reduce_async"} <= names, names
    assert torch is not None


def test_shm_refuses_weakly_ordered_cpus(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(BackendUnavailableError, match=r"x86-64 store ordering .*\('aarch64'\): use backend='torch'"):
        ShmCommunicator(0, 2, NcclIdHolder().job_id, timeout=1)
    with ShmCommunicator(0, 1, NcclIdHolder().job_id, timeout=1) as one:  # one process: nothing to order
        one.barrier()


@pytest.mark.parametrize("env, rank, shown", [({}, 0, ["INFO"]), ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
                                                                  1, [])])
def test_setup_logging_prefixes_rank_info_on_rank_0_only(monkeypatch, env, rank, shown):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert setup_logging(stream=stream) == rank
        setup_logging(stream=stream)  # idempotent: still one handler
        logging.getLogger("distopt").info("hello")
        logging.getLogger("distopt").warning("careful")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    expected = [f"[rank {rank}] INFO distopt: hello"] if shown else []
    assert lines == expected + [f"[rank {rank}] WARNING distopt: careful"], lines


@pytest.mark.parametrize("n, size, expected", [(10, 4, [3, 3, 2, 2]), (0, 3, [0, 0, 0]), (2, 3, [1, 1, 0]),
                                               (8, 1, [8]), (9, 3, [3, 3, 3])])
def test_split_counts(n, size, expected):
    assert split_counts(n, size) == expected
    assert check_counts(np.zeros(n), None, size) == expected


@pytest.mark.parametrize("n, size, name", [(-1, 2, "n"), (3, 0, "size"), (2.5, 2, "n"), (True, 2, "n")])
def test_split_counts_rejects_bad_input(n, size, name):
    with pytest.raises(ValueError, match=rf"^{name} must be an int"):
        split_counts(n, size)


@pytest.mark.parametrize("check", conformance.SHARD_CHECKS, ids=lambda f: f.__name__)
def test_single_sharded_collectives(check):
    """The single communicator validates the sharded collectives' arguments as every backend does."""
    with create("single") as comm:
        check(comm)


def test_single_sharded_collectives_on_torch_tensors():
    torch = pytest.importorskip("torch")
    comm = create("single")
    t = torch.arange(4.0)
    got = comm.reduce_scatter(t, op="avg")
    assert isinstance(got, torch.Tensor) and got.tolist() == [0, 1, 2, 3] and got is not t
    assert comm.all_gather_into(t, [4]) is t
    with pytest.raises(ValueError, match="counts must sum"):
        comm.reduce_scatter(t, [3])
    with pytest.raises(ValueError, match="array must be 1-D"):
        comm.all_gather_into(t.reshape(2, 2))
    assert comm.all_to_all(t.reshape(1, 4)).tolist() == [[0, 1, 2, 3]]
