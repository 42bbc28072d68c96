"""Build the communicator and the rank information for one process.

Two launch modes, as in SINGA's DistOpt:

* ``mpiexec -n N python train.py``: no ``nccl_id``; ranks come from MPI.
  Backend ``"mpi"`` (CPU arrays) by default, or ``"nccl"`` (GPU arrays) whose
  unique id rank 0 creates and MPI broadcasts.
* one process per device started by :func:`distopt.launch.spawn` (or any
  multiprocessing code): every process gets the same
  :class:`~distopt.nccl_id.NcclIdHolder` plus ``gpu_num`` (its rank) and
  ``gpu_per_node`` (the world size, single node). Backend ``"nccl"`` when the
  holder carries an NCCL id, else ``"shm"``.

The choice is made once, logged once, and can be forced with ``backend=``;
a forced backend whose dependency is missing raises, never falls back.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from . import comm as _comm
from . import ranks
from .comm.base import Communicator

__all__ = ["build_world"]

log = logging.getLogger("distopt")


def build_world(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
                backend: str | None = None, timeout: float | None = None) -> tuple[Communicator, ranks.RankInfo]:
    """Return ``(communicator, rank info)`` for this process.

    Args:
        nccl_id: the job's :class:`~distopt.nccl_id.NcclIdHolder` in the
            multiprocessing mode, None under MPI.
        gpu_num: this process's device number on its node (its rank in the
            multiprocessing mode).
        gpu_per_node: processes per node (the world size in the
            multiprocessing mode).
        backend: ``"mpi"``, ``"shm"`` or ``"nccl"`` to force a backend.
        timeout: collective deadline in seconds (default ``$DISTOPT_TIMEOUT``
            or 300).

    Raises:
        ValueError: ``nccl_id`` without ``gpu_num``/``gpu_per_node``, or a
            backend that does not fit the launch mode.
        BackendUnavailableError: the chosen backend cannot be imported.
        DistOptError: the MPI rank disagrees with the launcher's variables.
    """
    if nccl_id is not None:
        if gpu_num is None or gpu_per_node is None:
            raise ValueError("nccl_id needs gpu_num (this process's rank) and gpu_per_node (the world size)")
        info = ranks.from_explicit(gpu_num, gpu_per_node)
        if backend is None:
            backend = "nccl" if getattr(nccl_id, "nccl_id", None) is not None else "shm"
        if backend == "shm":
            comm = _comm.create("shm", rank=info.global_rank, size=info.world_size,
                                job_id=nccl_id.job_id, timeout=timeout)
        elif backend == "nccl":
            comm = _comm.create("nccl", rank=info.global_rank, size=info.world_size,
                                unique_id=nccl_id.nccl_id,
                                device=ranks.device_index(info.local_rank, os.environ, local_size=info.local_size),
                                timeout=timeout)
        else:
            raise ValueError(f"backend={backend!r} does not fit the multiprocessing mode; use 'shm' or 'nccl'")
    else:
        backend = backend or "mpi"
        if backend == "shm":
            raise ValueError("backend='shm' needs an nccl_id (NcclIdHolder) with gpu_num and gpu_per_node")
        mpi = _comm.create("mpi", timeout=timeout)
        info = ranks.resolve(gpu_num=gpu_num, gpu_per_node=gpu_per_node, mpi_comm=mpi.raw)
        if info.global_rank != mpi.rank or info.world_size != mpi.size:
            raise ValueError(
                f"rank information ({info.source}: rank {info.global_rank} of {info.world_size}) disagrees "
                f"with MPI (rank {mpi.rank} of {mpi.size}); check gpu_num/gpu_per_node"
            )
        if backend == "mpi":
            comm = mpi
        elif backend == "nccl":
            from .comm.nccl import unique_id_from_mpi

            unique_id = unique_id_from_mpi(mpi)
            mpi.close()
            comm = _comm.create("nccl", rank=info.global_rank, size=info.world_size, unique_id=unique_id,
                                device=ranks.device_index(info.local_rank, os.environ, local_size=info.local_size),
                                timeout=timeout)
        else:
            raise ValueError(f"backend must be 'mpi' or 'nccl' under MPI, got {backend!r}")
    if info.global_rank == 0:
        log.info("backend %s, world size %d (%s)", comm.name, info.world_size, info.source)
    return comm, info
