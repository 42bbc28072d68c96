"""Single-node CPU collectives over POSIX shared memory.

Every process of one job attaches to a *control segment* (created by rank 0, named from the job id) and owns one
*data segment* that it grows on demand. :mod:`~distopt.comm.shm.segments` names, creates, attaches and unlinks the
segments (:func:`segment_prefix`, :func:`unlink_segments`); :mod:`~distopt.comm.shm.rows` holds the control rows, the
protocol every collective follows on them and its memory-ordering rule (:func:`check_platform`: x86 only for more
than one process); :class:`ShmCommunicator` (:mod:`~distopt.comm.shm.communicator`, with the sharded collectives of
:mod:`~distopt.comm.shm.shards`) holds the collectives.

One communicator per job id may be open at a time; derive distinct ids (``f"{job_id}-2"``) for several.
"""
from __future__ import annotations

from .communicator import ShmCommunicator
from .rows import check_platform
from .segments import segment_prefix, unlink_segments

__all__ = ["ShmCommunicator", "segment_prefix", "unlink_segments", "check_platform"]
