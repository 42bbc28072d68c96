"""Single-node CPU collectives over POSIX shared memory.

Every process of one job attaches to a *control segment* (created by rank 0,
named from the job id) and owns one *data segment* that it grows on demand.
Three modules, one job each:

* :mod:`~distopt.comm.shm.segments`: naming, creating, attaching and
  unlinking the segments (:func:`segment_prefix`, :func:`unlink_segments`);
* :mod:`~distopt.comm.shm.rows`: the control rows and the arrive/wait/check
  protocol every collective follows on them, its memory-ordering rule
  (:func:`check_platform`: x86 only for more than one process) and its waits;
* :mod:`~distopt.comm.shm.communicator`: :class:`ShmCommunicator`, the
  collectives (the sharded ones, reduce-scatter, in-place all-gather and
  all-to-all, from :mod:`~distopt.comm.shm.shards`).

One communicator per job id may be open at a time; derive distinct ids
(``f"{job_id}-2"``) for several.
"""
from __future__ import annotations

from .communicator import ShmCommunicator
from .rows import check_platform
from .segments import segment_prefix, unlink_segments

__all__ = ["ShmCommunicator", "segment_prefix", "unlink_segments", "check_platform"]
