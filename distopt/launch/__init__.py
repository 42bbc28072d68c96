"""Launch: starting the processes of a job and telling each one who it is.

:func:`spawn` (:mod:`~distopt.launch.launcher`, SINGA's multiprocess mode) and ``python -m distopt.launch``
(:mod:`~distopt.launch.cli`) start one-node jobs, fail-fast (ending on signals: :mod:`~distopt.launch.exits`);
:mod:`~distopt.launch.ranks` finds the global rank, local rank and device from MPI, launcher variables or arguments;
:mod:`~distopt.launch.world` holds the rule that picks a backend for the launch mode, and
:func:`~distopt.launch.world.init`; :mod:`~distopt.launch.nccl_id` the NCCL id holder every process of a job shares;
:mod:`~distopt.launch.logs` and :mod:`~distopt.launch.failfast` rank-0 logging and progress bars, and aborting an MPI
job on an uncaught exception.
"""
from __future__ import annotations

from .cli import main
from .launcher import WorkerFailedError, spawn
from .logs import progress

__all__ = ["WorkerFailedError", "spawn", "progress", "main"]
