"""What a backend builds itself from: the launch information of one process.

:class:`Launch` is filled by :mod:`distopt.launch.world` (from the arguments of ``DistOpt`` or ``distopt.init`` and the
environment) and handed to the chosen backend's ``from_launch`` (:func:`distopt.comm.from_launch`). It sits below the
communicators: they read it, and nothing here imports them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import ranks

__all__ = ["Launch", "JOB_ID_ENV", "RUN_ID_ENV", "RESTART_COUNT_ENV", "GROW_FILE_ENV", "REGROUP_EXIT"]

#: Set by ``python -m distopt.launch``: the id the copies of one job share (their shm segments' names), fresh per
#: elastic world.
JOB_ID_ENV = "DISTOPT_JOB_ID"
#: Set by ``python -m distopt.launch --min-np/--max-np`` (elastic mode): its ``--run-id``, the same for every
#: world of the run (it names the commits in ``/dev/shm``, as torchrun's ``TORCHELASTIC_RUN_ID``).
RUN_ID_ENV = "DISTOPT_RUN_ID"
#: Elastic mode: how many times the launcher restarted the world after a failure (0 in the first world; a
#: world started to grow does not count), as torchrun's ``TORCHELASTIC_RESTART_COUNT``.
RESTART_COUNT_ENV = "DISTOPT_RESTART_COUNT"
#: Elastic mode: a path; while a file exists there the launcher waits for a larger world, and the copies stop
#: at their next commit (``distopt.elastic.State.commit``) and exit with :data:`REGROUP_EXIT`.
GROW_FILE_ENV = "DISTOPT_GROW_FILE"
#: The exit status of a copy that stopped at a commit so that the launcher starts a larger world
#: (``EX_TEMPFAIL``: not a failure, the launcher restarts the world without counting a restart).
REGROUP_EXIT = 75


@dataclass(frozen=True)
class Launch:
    """What a backend builds itself from: its class's ``from_launch(launch)`` returns ``(communicator,
    rank info)`` (see :func:`distopt.comm.from_launch`).

    Attributes:
        env: the environment.
        timeout: collective deadline in seconds, or None for ``$DISTOPT_TIMEOUT`` / 300.
        gpu_num: this process's device number on its node, when given explicitly.
        gpu_per_node: processes per node, when given explicitly.
        holder: the job's :class:`~distopt.launch.nccl_id.NcclIdHolder` in the multiprocessing mode
            (:func:`distopt.launch.spawn`), else None.
    """

    env: Mapping[str, str]
    timeout: float | None = None
    gpu_num: int | None = None
    gpu_per_node: int | None = None
    holder: Any = None

    @property
    def job_id(self) -> str | None:
        """The id that names the job's shm segments: the holder's, else ``$DISTOPT_JOB_ID``, else None."""
        return self.holder.job_id if self.holder is not None else self.env.get(JOB_ID_ENV)

    def rank_info(self, mpi_comm: Any = None) -> ranks.RankInfo:
        """This process's ranks (:func:`distopt.launch.ranks.resolve`; with ``mpi_comm``, from MPI where
        neither arguments nor launcher variables tell: collective over it).

        Raises:
            ValueError: as :func:`~distopt.launch.ranks.resolve`.
        """
        return ranks.resolve(gpu_num=self.gpu_num, gpu_per_node=self.gpu_per_node, env=self.env, mpi_comm=mpi_comm)
