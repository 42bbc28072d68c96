"""The ticket every process of one job shares (SINGA's ``singa.NcclIdHolder``).

In SINGA the launching process passes one ``NcclIdHolder`` to every worker, which builds its communicator from it.
Here it carries the job's id (uuid4 hex), which names the shared-memory backend's segments, so that the workers of one
job find each other.

It carries no NCCL unique id: an NCCL id serves one communicator only (its bootstrap root answers one init round), and
making one initialises CUDA and starts a thread and a socket in the process that makes it. So the workers agree on a
fresh id for each NCCL communicator over shared memory (rank 0 makes it), and the launcher process never touches CUDA or
NCCL. The holder holds plain attributes only, so it pickles and travels to processes started with the ``spawn`` method.
"""
from __future__ import annotations

import uuid

__all__ = ["NcclIdHolder", "new_job_id"]


def new_job_id() -> str:
    """A fresh job id: 32 hex digits (uuid4)."""
    return uuid.uuid4().hex


class NcclIdHolder:
    """Identifies one job; create it once in the launcher, hand it to every worker.

    Attributes:
        job_id: unique id of the job (32 hex digits), the rendezvous key of
            :class:`distopt.comm.shm.ShmCommunicator` (and of the NCCL id's agreement between the workers).
    """

    def __init__(self) -> None:
        self.job_id: str = new_job_id()

    def __repr__(self) -> str:
        return f"NcclIdHolder(job_id={self.job_id!r})"
