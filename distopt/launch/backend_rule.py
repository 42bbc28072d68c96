"""The rule that picks the backend for the launch mode; the backend then builds itself from the launch.

The rule is the table of ``docs/launch.md``, first match wins: the multiprocessing mode (``nccl_id``,
:func:`distopt.launch.spawn`) gets ``nccl`` if CuPy loads NCCL and the node has ``gpu_per_node`` devices, else
``shm``; otherwise :func:`choose_backend` picks from the launcher variables found.

``backend=`` forces a choice; a backend that does not fit the launch mode is a ``ValueError`` saying what fits, and
one whose dependency is missing a :class:`~distopt.errors.BackendUnavailableError`: there is never a fallback. The
chosen backend's class builds the communicator from a :class:`Launch` (``from_launch``; the MPI-based ones also find
the ranks, from MPI). The choice is logged once, on rank 0.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from .. import comm as _comm
from . import ranks, torch_group
from .info import JOB_ID_ENV, Launch
from ..comm.base import Communicator
from ..comm.wait import resolve_timeout

__all__ = ["build_world", "choose_backend"]

log = logging.getLogger("distopt")


def choose_backend(source: str | None, env: Mapping[str, str]) -> str:
    """The backend for a launch without ``nccl_id`` or ``backend=``: ``single`` without launcher variables; under
    torchrun's variables ``shm`` with ``DISTOPT_JOB_ID`` (``python -m distopt.launch``), else ``torch``; under Slurm's
    ``torch`` with ``MASTER_ADDR`` and ``MASTER_PORT``, else ``mpi``; under an MPI launcher's ``mpi``.

    Args:
        source: :attr:`distopt.launch.ranks.RankInfo.source` of the launcher variables found (``"torchrun"``,
            ``"OMPI"``, ``"MPICH"``, ``"Slurm"``), or None when there are none.
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


def _spawned_backend(launch: Launch, backend: str | None) -> str:
    """The backend of the multiprocessing mode: NCCL when CuPy can load NCCL and this node has a device for each of
    its ``gpu_per_node`` processes, else shm (the GPUs, if any, then shared over host memory; the reason is logged on
    rank 0 where CuPy is installed). Every process of the job sees the same machine, so all choose alike; a forced
    ``backend="nccl"`` with too few devices fails on every rank, naming the count."""
    if launch.gpu_num is None or launch.gpu_per_node is None:
        raise ValueError("nccl_id needs gpu_num (this process's rank) and gpu_per_node (the world size)")
    chosen = backend
    if chosen is None:
        why_not = nccl_unfit(launch.gpu_per_node)
        chosen = "shm" if why_not else "nccl"
        if why_not not in ("", _NO_CUPY) and launch.gpu_num == 0:  # a GPU machine: say why not NCCL
            log.info("multiprocessing mode over shared memory: %s", why_not)
    if chosen not in ("shm", "nccl"):
        raise ValueError(f"backend={chosen!r} does not fit the multiprocessing mode (nccl_id given); use 'shm' or "
                         "'nccl'")
    return chosen


_NO_CUPY = "CuPy is not installed"


def nccl_unfit(processes: int) -> str:
    """Why NCCL cannot serve ``processes`` processes on this node ('' when it can): CuPy missing, NCCL not
    loadable by CuPy, or fewer visible devices than processes (NCCL refuses two ranks on one GPU)."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        return _NO_CUPY
    if not getattr(nccl, "available", True):
        return "CuPy cannot load NCCL (cupy.cuda.nccl.available is False)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no usable CUDA device ({exc})"
    if count < processes:
        return (f"{processes} processes but {count} visible CUDA device{'s' if count != 1 else ''}: NCCL needs one "
                "device per process, so the processes share the GPUs through host memory")
    return ""


def _launched_backend(launch: Launch, backend: str | None) -> str:
    """The backend of a launch by a launcher (or none): the rule, and whether a forced backend fits."""
    launcher = ranks.from_env(launch.env)
    chosen = backend or choose_backend(None if launcher is None else launcher.source, launch.env)
    if chosen not in _comm.BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_comm.BACKENDS)}, got {backend!r}")
    if chosen in ("shm", "torch") and launch.rank_info().source == "single":
        raise ValueError(f"backend={chosen!r} needs launcher variables (RANK, WORLD_SIZE, ...): start the "
                         "script with torchrun or python -m distopt.launch, or leave backend unset for one process")
    _check_not_independent(launch, chosen)
    if chosen == "shm" and launch.job_id is None:
        raise ValueError("backend='shm' needs the job id that python -m distopt.launch sets "
                         f"({JOB_ID_ENV}), or distopt.launch.spawn with an NcclIdHolder")
    return chosen


def _check_not_independent(launch: Launch, chosen: str) -> None:
    """Raise ValueError on every process (naming the launcher and both sizes) when the backend's world is smaller than
    the MPI launch this process is part of (each process would train alone), unless ``$DISTOPT_INDEPENDENT_PROCESSES``
    is 1."""
    found = ranks.mpi_launcher(launch.env)
    if found is None or found[1] <= 1 or chosen in ("mpi", "nccl") or launch.env.get(ranks.INDEPENDENT_ENV) == "1":
        return
    size = 1 if chosen == "single" else launch.rank_info().world_size
    if size == found[1]:
        return
    raise ValueError(
        f"this process was started by {found[0]}, a job of {found[1]} processes, but backend {chosen!r} "
        f"would make a world of {size}: every process would train on its own. Leave backend unset (or "
        f"backend='mpi') to train together over MPI, start the script with torchrun for the torch backend, "
        f"or set {ranks.INDEPENDENT_ENV}=1 to run the copies independently on purpose")


def build_world(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
                backend: str | None = None, timeout: float | None = None,
                env: Mapping[str, str] | None = None) -> tuple[Communicator, ranks.RankInfo]:
    """Return ``(communicator, rank info)`` for this process.

    Args:
        nccl_id: the job's :class:`~distopt.launch.nccl_id.NcclIdHolder` in the multiprocessing mode, else None.
        gpu_num: this process's device number on its node (its rank in the multiprocessing mode).
        gpu_per_node: processes per node (the world size in the multiprocessing mode).
        backend: ``"mpi"``, ``"nccl"``, ``"shm"``, ``"torch"`` or ``"single"`` to force a backend; None: the rule above.
        timeout: collective deadline in seconds (default ``$DISTOPT_TIMEOUT`` or 300).
        env: the environment to read; default ``os.environ``.

    Raises:
        ValueError: ``nccl_id`` without ``gpu_num``/``gpu_per_node``; a backend that does not fit the launch mode;
            under an MPI launcher (``PMI_SIZE`` or ``OMPI_COMM_WORLD_SIZE`` > 1), a backend whose world size differs
            from the launcher's (e.g. ``backend="single"``, or torchrun variables saying one process), on every
            process, unless ``$DISTOPT_INDEPENDENT_PROCESSES=1``; launcher variables that are incomplete, or that
            disagree with MPI (the message names the launcher whose variables were read, and the fix).
        BackendUnavailableError: the chosen backend cannot be imported (e.g. no loadable MPI library).
    """
    launch = Launch(os.environ if env is None else env, timeout, gpu_num, gpu_per_node, nccl_id)
    chosen = _spawned_backend(launch, backend) if nccl_id is not None else _launched_backend(launch, backend)
    comm, info = _comm.from_launch(chosen, launch)
    if info.global_rank == 0:
        log.info("backend %s, world size %d (%s)", comm.name, info.world_size, info.source)
    if chosen == "mpi":
        torch_group.init_default_group(comm, resolve_timeout(timeout))
    return comm, info
