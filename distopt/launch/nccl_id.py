"""The ticket every process of one job shares (SINGA's ``singa.NcclIdHolder``).

In SINGA the launching process creates one ``NcclIdHolder`` and passes it to
every worker, which builds its communicator from it. Here it carries:

* ``job_id``: a unique string (uuid4 hex) that the shared-memory backend uses
  to name its segments, so the workers of one job find each other;
* ``nccl_id``: an NCCL unique id (``cupy.cuda.nccl.get_unique_id()``, a tuple
  of 128 ints) when CuPy with NCCL and a CUDA device is available, else None.

It holds plain attributes only, so it pickles and travels to processes started
with the ``spawn`` method. Creating one is cheap (CuPy is imported only when
installed).
"""
from __future__ import annotations

import importlib.util
import uuid

__all__ = ["NcclIdHolder", "new_job_id"]


def new_job_id() -> str:
    """A fresh job id: 32 hex digits (uuid4)."""
    return uuid.uuid4().hex


def _nccl_unique_id() -> tuple[int, ...] | None:
    """NCCL's unique id, or None without CuPy, NCCL or a CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy
        from cupy.cuda import nccl

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return tuple(nccl.get_unique_id())
    except (ImportError, RuntimeError):  # no NCCL build, no driver (CUDARuntimeError)
        return None


class NcclIdHolder:
    """Identifies one job; create it once in the launcher, hand it to every worker.

    Attributes:
        job_id: unique id of the job (32 hex digits), the rendezvous key of
            :class:`distopt.comm.shm.ShmCommunicator`.
        nccl_id: NCCL unique id (128 ints) for ``ncclCommInitRank``, or None
            when CuPy/NCCL/a CUDA device is unavailable.
    """

    def __init__(self) -> None:
        self.job_id: str = new_job_id()
        self.nccl_id: tuple[int, ...] | None = _nccl_unique_id()

    def __repr__(self) -> str:
        nccl = "None" if self.nccl_id is None else f"<{len(self.nccl_id)} ints>"
        return f"NcclIdHolder(job_id={self.job_id!r}, nccl_id={nccl})"
