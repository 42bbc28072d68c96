"""How the torch backend joins the job: its own rendezvous, or a new group of the script's process group.

With no default process group yet, :func:`join` initialises one with ``env://`` (as ``torchrun`` sets it up) and the
communicator owns it; its keys in the store are prefixed per initialisation (see :data:`_GROUPS`). When the script has
initialised one already, it makes a new group of all its ranks instead, so distopt's traffic never interleaves with the
caller's. With CUDA the group is ``"cpu:gloo,cuda:nccl"`` (torch routes each tensor by its device), else ``"gloo"``.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistOptError

__all__ = ["join"]

#: Default groups this process has initialised: each one's keys in the job's store get their own prefix, so
#: a DistOpt made after ``close()`` of another (torch resets its group count on destroy) never reads the
#: first group's stale addresses (gloo's "connectFullMesh failed").
_GROUPS = [0]


def join(rank: int | None, size: int | None, timeout: float, device: int | None) -> tuple[Any, str, bool]:
    """Join the job (collective over every process of the job).

    Args:
        rank: this process's rank, or None for ``$RANK``.
        size: the world size, or None for ``$WORLD_SIZE``.
        timeout: seconds, the rendezvous' deadline and the process group's timeout.
        device: CUDA device index to make current (``torch.cuda.set_device``), or None.

    Returns:
        The process group (None: the default group, which this call created), the backend string
        (``"cpu:gloo,cuda:nccl"`` or ``"gloo"``), and whether the caller owns the default group (destroys it on close).

    Raises:
        ValueError: ``MASTER_ADDR``/``MASTER_PORT`` missing when no process group is initialised.
        DistOptError: the rendezvous failed (e.g. a peer never came).
    """
    pg_timeout = datetime.timedelta(seconds=timeout)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if device is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return dist.new_group(backend=backend, timeout=pg_timeout), backend, False
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"the torch backend joins the job through {' and '.join(missing)}, which are not set: "
            "start the script with torchrun, or export MASTER_ADDR (rank 0's host) and MASTER_PORT "
            "(a free port) on every rank")
    kwargs = {key: int(value) for key, value in (("rank", rank), ("world_size", size)) if value is not None}
    _GROUPS[0] += 1
    try:
        store, rank, size = next(dist.rendezvous("env://", timeout=pg_timeout, **kwargs))
        dist.init_process_group(backend, store=dist.PrefixStore(f"distopt/{_GROUPS[0]}", store), rank=rank,
                                world_size=size, timeout=pg_timeout)
    except (RuntimeError, ValueError) as exc:
        raise DistOptError(f"torch.distributed rendezvous at {os.environ['MASTER_ADDR']}:"
                           f"{os.environ['MASTER_PORT']} failed: {exc}") from exc
    return None, backend, True
