"""Launch: starting the processes of a job and telling each one who it is.

* :mod:`~distopt.launch.launcher`: :func:`spawn` (SINGA's multiprocess mode),
  and :mod:`~distopt.launch.cli`: ``python -m distopt.launch`` (both one node,
  fail-fast; how they end on signals: :mod:`~distopt.launch.exits`);
* :mod:`~distopt.launch.ranks`: global rank, local rank and device from MPI,
  launcher variables or arguments;
* :mod:`~distopt.launch.world`: the rule that picks a backend for the launch
  mode, and :func:`~distopt.launch.world.init`;
* :mod:`~distopt.launch.nccl_id`: the NCCL id holder every process of a job shares;
* :mod:`~distopt.launch.logs`, :mod:`~distopt.launch.failfast`: rank-0
  logging and progress bars, and aborting an MPI job on an uncaught exception.
"""
from __future__ import annotations

from .cli import main
from .launcher import WorkerFailedError, spawn
from .logs import progress

__all__ = ["WorkerFailedError", "spawn", "progress", "main"]
