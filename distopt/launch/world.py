"""Build the communicator and the rank information for one process, from the launch mode.

The rule (one table in ``docs/launch.md``), first match wins:

======================================== ================== ===========================================
launched by                              variables read     backend
======================================== ================== ===========================================
:func:`distopt.launch.spawn` (nccl_id)   the arguments      ``nccl`` if the holder has an NCCL id, else ``shm``
``python -m distopt.launch``             ``RANK`` ... +     ``shm``
                                         ``DISTOPT_JOB_ID``
``torchrun``                             ``RANK`` ... +     ``torch`` (gloo; NCCL for CUDA tensors)
                                         ``MASTER_ADDR``
``mpiexec`` / ``mpirun``                 ``PMI_*``,         ``mpi`` (``backend="nccl"``: NCCL, id over MPI)
                                         ``OMPI_*``
``srun`` with ``MASTER_ADDR``/``PORT``   ``SLURM_*``        ``torch``
``srun`` without them                    ``SLURM_*``        ``mpi`` (the MPI library must know Slurm)
a plain ``python train.py``              none               ``single`` (world size 1, no MPI needed)
======================================== ================== ===========================================

``backend=`` forces a choice; a backend that does not fit the launch mode
is a ``ValueError`` saying what fits, and one whose dependency is missing a
:class:`~distopt.errors.BackendUnavailableError`: there is never a fallback.
The choice is logged once, on rank 0.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import comm as _comm
from . import ranks
from ..comm.base import Communicator

__all__ = ["build_world", "choose_backend", "init", "current", "World", "JOB_ID_ENV", "comm_for"]

log = logging.getLogger("distopt")

#: Set by ``python -m distopt.launch``: the id the copies of one job share (their shm segments' names).
JOB_ID_ENV = "DISTOPT_JOB_ID"

_MPI_SOURCES = ("OMPI", "MPICH")


def choose_backend(source: str | None, env: Mapping[str, str]) -> str:
    """The backend for a launch without ``nccl_id`` or ``backend=``: the rule of the module docstring.

    Args:
        source: :attr:`distopt.ranks.RankInfo.source` of the launcher
            variables found (``"torchrun"``, ``"OMPI"``, ``"MPICH"``,
            ``"Slurm"``), or None when there are none.
        env: the environment.

    Returns:
        ``"single"``, ``"shm"``, ``"torch"`` or ``"mpi"``.
    """
    if source is None:
        return "single"
    if source == "torchrun":
        return "shm" if JOB_ID_ENV in env else "torch"
    if source == "Slurm":
        return "torch" if "MASTER_ADDR" in env and "MASTER_PORT" in env else "mpi"
    return "mpi"


def _launcher_vars(info: ranks.RankInfo, env: Mapping[str, str]) -> str:
    names = {"torchrun": ("RANK", "WORLD_SIZE"), "OMPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
             "MPICH": ("PMI_RANK", "PMI_SIZE"), "Slurm": ("SLURM_PROCID", "SLURM_NTASKS")}.get(info.source, ())
    shown = ", ".join(f"{n}={env[n]}" for n in names if n in env)
    return f"{info.source} variables ({shown})" if shown else info.source


def _device(info: ranks.RankInfo, env: Mapping[str, str], device_count: int | None = None) -> int:
    return ranks.device_index(info.local_rank, env, device_count, local_size=info.local_size)


def _mpi_world(backend: str, gpu_num: int | None, gpu_per_node: int | None, timeout: float | None,
               env: Mapping[str, str]) -> tuple[Communicator, ranks.RankInfo]:
    mpi = _comm.create("mpi", timeout=timeout)
    info = ranks.resolve(gpu_num=gpu_num, gpu_per_node=gpu_per_node, env=env, mpi_comm=mpi.raw)
    if info.global_rank != mpi.rank or info.world_size != mpi.size:
        mpi.close()
        if info.source == "explicit":
            fix = "check gpu_num/gpu_per_node"
        elif info.source in _MPI_SOURCES:
            fix = "start the job with the mpiexec of the MPI library mpi4py loads (pip's mpich: .venv/bin/mpiexec)"
        else:
            fix = ("under torchrun or srun without MPI support, use backend='torch' (torchrun sets MASTER_ADDR and "
                   "MASTER_PORT; under srun export them), or srun --mpi=pmix with an MPI library built for Slurm")
        raise ValueError(
            f"rank information from {_launcher_vars(info, env)} (rank {info.global_rank} of {info.world_size}) "
            f"disagrees with MPI (rank {mpi.rank} of {mpi.size}): {fix}")
    if backend == "mpi":
        return mpi, info
    from ..comm.nccl import unique_id_from_mpi

    unique_id = unique_id_from_mpi(mpi)
    return _comm.create("nccl", rank=info.global_rank, size=info.world_size, unique_id=unique_id,
                        device=_device(info, env), timeout=timeout, control=mpi), info  # MPI: the host control


def _torch_device(info: ranks.RankInfo, env: Mapping[str, str]) -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return _device(info, env, torch.cuda.device_count())


def build_world(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
                backend: str | None = None, timeout: float | None = None,
                env: Mapping[str, str] | None = None) -> tuple[Communicator, ranks.RankInfo]:
    """Return ``(communicator, rank info)`` for this process.

    Args:
        nccl_id: the job's :class:`~distopt.nccl_id.NcclIdHolder` in the
            multiprocessing mode, else None.
        gpu_num: this process's device number on its node (its rank in the
            multiprocessing mode).
        gpu_per_node: processes per node (the world size in the
            multiprocessing mode).
        backend: ``"mpi"``, ``"nccl"``, ``"shm"``, ``"torch"`` or
            ``"single"`` to force a backend; None: the rule above.
        timeout: collective deadline in seconds (default ``$DISTOPT_TIMEOUT``
            or 300).
        env: the environment to read; default ``os.environ``.

    Raises:
        ValueError: ``nccl_id`` without ``gpu_num``/``gpu_per_node``;
            a backend that does not fit the launch mode; launcher variables
            that are incomplete, or that disagree with MPI (the message names
            the launcher whose variables were read, and the fix).
        BackendUnavailableError: the chosen backend cannot be imported
            (e.g. no loadable MPI library).
    """
    env = os.environ if env is None else env
    if nccl_id is not None:
        comm, info = _spawned_world(nccl_id, gpu_num, gpu_per_node, backend, timeout, env)
    else:
        comm, info = _launched_world(gpu_num, gpu_per_node, backend, timeout, env)
    if info.global_rank == 0:
        log.info("backend %s, world size %d (%s)", comm.name, info.world_size, info.source)
    return comm, info


def _spawned_world(nccl_id: Any, gpu_num: int | None, gpu_per_node: int | None, backend: str | None,
                   timeout: float | None, env: Mapping[str, str]) -> tuple[Communicator, ranks.RankInfo]:
    if gpu_num is None or gpu_per_node is None:
        raise ValueError("nccl_id needs gpu_num (this process's rank) and gpu_per_node (the world size)")
    info = ranks.from_explicit(gpu_num, gpu_per_node)
    if backend is None:
        backend = "nccl" if getattr(nccl_id, "nccl_id", None) is not None else "shm"
    if backend == "shm":
        return _comm.create("shm", rank=info.global_rank, size=info.world_size, job_id=nccl_id.job_id,
                            timeout=timeout), info
    if backend == "nccl":
        control = _comm.create("shm", rank=info.global_rank, size=info.world_size, job_id=nccl_id.job_id,
                               timeout=timeout)  # the host control plane: no device waits per step
        return _comm.create("nccl", rank=info.global_rank, size=info.world_size, unique_id=nccl_id.nccl_id,
                            device=_device(info, env), timeout=timeout, control=control), info
    raise ValueError(f"backend={backend!r} does not fit the multiprocessing mode (nccl_id given); use 'shm' or 'nccl'")


def _launched_world(gpu_num: int | None, gpu_per_node: int | None, backend: str | None, timeout: float | None,
                    env: Mapping[str, str]) -> tuple[Communicator, ranks.RankInfo]:
    launcher = ranks.from_env(env)
    source = None if launcher is None else launcher.source
    chosen = backend or choose_backend(source, env)
    if chosen not in _comm.BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_comm.BACKENDS)}, got {backend!r}")
    if chosen in ("mpi", "nccl"):
        return _mpi_world(chosen, gpu_num, gpu_per_node, timeout, env)
    info = ranks.resolve(gpu_num=gpu_num, gpu_per_node=gpu_per_node, env=env)
    if chosen == "single":
        if info.world_size != 1:
            raise ValueError(f"backend='single' is a world of one process, but {_launcher_vars(info, env)} "
                             f"say {info.world_size}; leave backend unset")
        return _comm.create("single"), info
    if info.source == "single":
        raise ValueError(f"backend={chosen!r} needs launcher variables (RANK, WORLD_SIZE, ...): start the "
                         "script with torchrun or python -m distopt.launch, or leave backend unset for one process")
    if chosen == "shm":
        if JOB_ID_ENV not in env:
            raise ValueError("backend='shm' needs the job id that python -m distopt.launch sets "
                             f"({JOB_ID_ENV}), or distopt.launch.spawn with an NcclIdHolder")
        return _comm.create("shm", rank=info.global_rank, size=info.world_size, job_id=env[JOB_ID_ENV],
                            timeout=timeout), info
    return _comm.create("torch", rank=info.global_rank, size=info.world_size, timeout=timeout,
                        device=_torch_device(info, env)), info


@dataclass(frozen=True)
class World:
    """This process's place in the job, before any optimizer exists (see :func:`init`).

    Attributes:
        comm: the communicator (pass the whole World to ``DistOpt``).
        info: where the ranks came from (:class:`~distopt.ranks.RankInfo`).
    """

    comm: Communicator
    info: ranks.RankInfo

    @property
    def rank(self) -> int:
        """Global rank, ``0 <= rank < world_size``."""
        return self.info.global_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        """Rank among the processes of this node (picks the GPU)."""
        return self.info.local_rank

    @property
    def local_size(self) -> int | None:
        """Processes on this node, when known."""
        return self.info.local_size

    @property
    def backend(self) -> str:
        """The communicator's backend name."""
        return self.comm.name

    def close(self) -> None:
        """Close the communicator (idempotent)."""
        self.comm.close()


_current: World | None = None


def init(backend: str | None = None, timeout: float | None = None) -> World:
    """Join the job now and return where this process stands, e.g. to scale the learning rate.

    Idempotent: a second call returns the same :class:`World` while its
    communicator is open. Example::

        world = distopt.init()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01 * world.world_size)

    Args:
        backend: force a backend (see :func:`build_world`); None: the
            launch-mode rule.
        timeout: collective deadline in seconds (default
            ``$DISTOPT_TIMEOUT`` or 300).

    Raises:
        ValueError: as :func:`build_world`; or a second call asks for another backend.
        BackendUnavailableError: as :func:`build_world`.
    """
    global _current
    if _current is not None and not getattr(_current.comm, "closed", False):
        if backend is not None and backend != _current.comm.name:
            raise ValueError(f"distopt.init() already joined the job over {_current.comm.name!r}; "
                             f"got backend={backend!r}")
        return _current
    comm, info = build_world(backend=backend, timeout=timeout)
    _current = World(comm, info)
    return _current


def current() -> World | None:
    """The :class:`World` of the last :func:`init` while its communicator is open, else None."""
    if _current is None or getattr(_current.comm, "closed", False):
        return None
    return _current


def comm_for(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
             backend: str | None = None, timeout: float | None = None, comm: Communicator | None = None,
             world: World | None = None) -> tuple[Communicator, int, int]:
    """The communicator of a new ``DistOpt`` and its ``(local rank, local size)``.

    In order: an explicit ``comm`` (local rank and size from ``gpu_num`` /
    ``gpu_per_node``, else the communicator's rank and size), an explicit
    ``world``, the :class:`World` of an earlier :func:`init`, else a new
    communicator by :func:`build_world`.

    Raises:
        ValueError: as :func:`build_world`.
        BackendUnavailableError: as :func:`build_world`.
    """
    if comm is not None:
        return (comm, comm.rank if gpu_num is None else gpu_num,
                comm.size if gpu_per_node is None else gpu_per_node)
    world = world if world is not None else (current() if nccl_id is None and backend is None else None)
    if world is not None:
        return world.comm, world.info.local_rank, world.info.local_size
    comm, info = build_world(nccl_id, gpu_num, gpu_per_node, backend, timeout)
    return comm, info.local_rank, info.local_size

