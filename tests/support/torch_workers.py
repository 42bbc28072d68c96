"""Worker functions for the spawned torch.distributed backend tests (importable, so ``spawn`` can pickle them)."""
from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support import conformance

#: Collective deadline inside test workers, in seconds.
TIMEOUT = 20.0


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what outgoing connections are given)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range: a port the kernel
    handed out (``bind(0)``) may be given to one of gloo's outgoing connections before the store binds it.

    Raises:
        RuntimeError: no free port found in 200 tries.
    """
    low = _ephemeral_low()
    for port in random.Random().sample(range(10000, low), min(200, low - 10000)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in 10000-{low - 1} on 127.0.0.1 after 200 tries")


def make_comm(port: int, rank: int, size: int, timeout: float = TIMEOUT):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from distopt.comm.torchdist import TorchCommunicator

    return TorchCommunicator(rank, size, timeout=timeout)


def check_tensors_and_half(comm) -> None:
    """torch tensors in and out; float16 and bfloat16 (NumPy, via ml_dtypes) reduce."""
    import ml_dtypes
    import torch

    t = torch.full((5,), comm.rank + 1.0)
    assert comm.all_reduce(t) is t and t.tolist() == [comm.size * (comm.size + 1) / 2] * 5
    g = comm.all_gather(torch.tensor([comm.rank]))
    assert isinstance(g, torch.Tensor) and g.reshape(-1).tolist() == list(range(comm.size))
    for dtype in (np.float16, ml_dtypes.bfloat16):
        h = np.full(3, 1.5, dtype=dtype)
        comm.all_reduce(h, op="avg")
        assert h.dtype == dtype and (h.astype(np.float32) == 1.5).all()
    handle = comm.all_reduce_async(np.full(4, float(comm.rank)), op="avg")
    np.testing.assert_allclose(handle.wait(), (comm.size - 1) / 2)
    assert comm.wait_seconds > 0


def check_small_calls_take_one_collective(comm) -> None:
    """A call of at most 512 bytes on CPU memory (e.g. the step header) travels inside its control
    block: one torch.distributed collective; a larger one takes the block and then its own."""
    from unittest import mock

    import torch.distributed as dist

    from distopt.comm import torchdist

    calls = []

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    with mock.patch.object(torchdist, "_gather_flat", counted("gather", torchdist._gather_flat)), \
            mock.patch.object(dist, "all_reduce", counted("all_reduce", dist.all_reduce)), \
            mock.patch.object(dist, "broadcast", counted("broadcast", dist.broadcast)):
        header = comm.all_gather(np.arange(6, dtype=np.int64) + comm.rank)
        assert calls == ["gather"] * (comm.size > 1), calls
        assert header.tolist() == [[r + i for i in range(6)] for r in range(comm.size)]
        calls.clear()
        metric = comm.all_reduce(np.full(64, comm.rank + 1.0), op="avg")  # 512 bytes: inline
        flag = comm.broadcast(np.array([comm.rank + 7], dtype=np.int32), root=comm.size - 1)
        comm.barrier()
        assert calls == ["gather"] * (3 * (comm.size > 1)), calls
        assert (metric == (comm.size + 1) / 2).all() and flag.tolist() == [comm.size + 6]
        calls.clear()
        comm.all_reduce(np.ones(65))  # 520 bytes: the block, then the all-reduce
        assert calls == ["gather", "all_reduce"] * (comm.size > 1), calls


def conformance_case(rank: int, comm) -> int:  # noqa: ARG001 (a pool case's signature)
    """A pool case (:mod:`tests.support.pool`) on the case's communicator (a new default process group
    on a new port): the conformance suite, tensors and 16-bit floats, one collective per small call;
    returns the number of shared checks run."""
    conformance.run_all(comm)
    check_tensors_and_half(comm)
    check_small_calls_take_one_collective(comm)
    return len(conformance.CHECKS)


def skip_worker(holder, rank: int, size: int, port: int) -> None:  # noqa: ARG001
    """Rank 1 skips a barrier: rank 0 times out (CollectiveTimeoutError), then closes cleanly."""
    from distopt.errors import CollectiveTimeoutError, DistOptError

    comm = make_comm(port, rank, size, timeout=1)
    comm.barrier()
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"torch barrier #2 on rank 0 did not complete within 1 s"):
            comm.barrier()
        assert time.monotonic() - start < 10
        with pytest.raises(DistOptError, match="unusable"):
            comm.barrier()
    else:
        time.sleep(2.5)
    comm.close()
