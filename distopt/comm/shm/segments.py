"""The shared-memory segments of one job: their names, creation, attachment and removal.

A job id's segments are named ``distopt.<job id>.<what>`` (:func:`segment_prefix`): ``ctl``, the control segment
rank 0 creates, and ``r<rank>.g<generation>``, the data segment of one rank. A rank grows its data segment on demand
to a new name one generation up (sizes double, in bytes, from 64 KiB; the old one is unlinked), and peers map a
generation when they see its number.

Segments are unlinked by the rank that created them on close or at interpreter exit (``weakref.finalize``). A rank
killed by a signal cannot clean up: its resource tracker unlinks its segments when the tracker's last user exits, and
:func:`distopt.launch.spawn` sweeps them with :func:`unlink_segments` as soon as the job ends.
"""
from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import _posixshmem
import numpy as np

__all__ = ["segment_prefix", "unlink_segments", "Segments"]

_MIN_CAPACITY = 1 << 16  # bytes, smallest data segment


def segment_prefix(job_id: str) -> str:
    """Name prefix of every shared-memory segment of ``job_id`` (no leading slash); job ids contain no dots, so the
    prefix of one job never matches another's."""
    return f"distopt.{job_id}."


def unlink_segments(job_id: str, *, untrack: bool = False) -> list[str]:
    """Unlink the segments of ``job_id`` still listed in ``/dev/shm``.

    For use after every process of the job has exited (one killed by a signal cannot unlink its own segments). Linux
    only; elsewhere returns ``[]``.

    Args:
        job_id: the job's id.
        untrack: also forget the names in this process's resource tracker. Pass True when the workers were started
            by this process with multiprocessing: they share its tracker, which would otherwise warn about (and
            retry) these names when it shuts down.

    Returns:
        The names removed.
    """
    prefix = segment_prefix(job_id)
    try:
        names = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            continue
        removed.append(name)
        if untrack:
            resource_tracker.unregister("/" + name, "shared_memory")
    return removed


def _attach(name: str) -> mmap.mmap:
    """Map an existing segment without registering it with the resource tracker; ``FileNotFoundError`` if there is no
    such segment, or it is not sized yet. (``SharedMemory(name)`` registers attachments too (Python < 3.13), and the
    usual fix, unregistering afterwards, also drops the creator's registration when both processes share one tracker,
    as multiprocessing children do.)"""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise FileNotFoundError(f"shared memory segment {name} is not sized yet")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink_owned(owned: dict[str, SharedMemory]) -> None:
    """Unlink and unmap the segments a rank created (finalizer)."""
    for shm in owned.values():
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            shm._mmap = None  # so SharedMemory.__del__ does not retry and print "exported pointers exist"
    owned.clear()


def _unmap(m: mmap.mmap | None) -> None:
    """Close a peer mapping; one still viewed by an array goes with the array."""
    if m is not None:
        try:
            m.close()
        except BufferError:
            pass


class Segments:
    """The segments one rank creates and maps: the control segment and every rank's data segment.

    Args:
        job_id: the job's id (letters, digits, ``_``, ``-``).
        rank: this process's rank.
        size: the number of ranks.

    Attributes:
        generations: the data segment generation mapped, per rank (0: none).
    """

    def __init__(self, job_id: str, rank: int, size: int) -> None:
        self.job_id, self.rank, self.prefix = job_id, rank, segment_prefix(job_id)
        self._owned: dict[str, SharedMemory] = {}
        self._finalizer = weakref.finalize(self, _unlink_owned, self._owned)
        self._ctl_map: mmap.mmap | None = None  # the control segment, on ranks > 0
        self.generations = [0] * size
        self._maps: list[mmap.mmap | None] = [None] * size  # peers' data mappings
        self._views: list[np.ndarray | None] = [None] * size  # uint8 views of data segments

    @property
    def control_name(self) -> str:
        """The control segment's name (no leading slash)."""
        return self.prefix + "ctl"

    def create_control(self, nbytes: int) -> memoryview:
        """Create the control segment of ``nbytes`` bytes, zeroed (rank 0).

        Raises:
            FileExistsError: it exists: a communicator of this job id is open.
        """
        name = self.control_name
        try:
            shm = SharedMemory(name, create=True, size=nbytes)
        except FileExistsError:
            raise FileExistsError(f"a shm communicator for job {self.job_id!r} is already open "
                                  f"(/dev/shm/{name}); use a distinct job_id per communicator") from None
        self._owned[name] = shm
        return shm.buf

    def attach_control(self) -> mmap.mmap:
        """Map the control segment rank 0 created (ranks > 0); the same mapping on later calls.

        Raises:
            FileNotFoundError: it does not exist, or is not sized yet.
        """
        if self._ctl_map is None:
            self._ctl_map = _attach(self.control_name)
        return self._ctl_map

    def own(self, nbytes: int) -> np.ndarray:
        """This rank's data segment (uint8) of at least ``nbytes`` bytes: a new generation if it is smaller. Publish
        :attr:`generations` ``[rank]`` to the peers before they read it."""
        me = self.rank
        seg = self._views[me]
        if seg is not None and seg.nbytes >= nbytes:
            return seg
        capacity = max(nbytes, 2 * (0 if seg is None else seg.nbytes), _MIN_CAPACITY)
        capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        gen = self.generations[me] + 1
        name = f"{self.prefix}r{me}.g{gen}"
        shm = SharedMemory(name, create=True, size=capacity)
        if seg is not None:
            self._views[me] = seg = None
            _unlink_owned({"old": self._owned.pop(f"{self.prefix}r{me}.g{gen - 1}")})
        self._owned[name] = shm
        self._views[me] = np.frombuffer(shm.buf, np.uint8)
        self.generations[me] = gen
        return self._views[me]

    def mine(self) -> np.ndarray:
        """This rank's current data segment (uint8); :meth:`own` must have created it."""
        return self._views[self.rank]

    def peer(self, p: int, gen: int) -> np.ndarray:
        """Rank ``p``'s data segment (uint8) of generation ``gen``, mapped once per generation.

        Raises:
            FileNotFoundError: that generation does not exist (any more).
        """
        if gen != self.generations[p]:
            self._views[p] = None
            _unmap(self._maps[p])
            self._maps[p] = _attach(f"{self.prefix}r{p}.g{gen}")
            self._views[p] = np.frombuffer(self._maps[p], np.uint8)
            self.generations[p] = gen
        return self._views[p]

    def close(self) -> None:
        """Unmap everything and unlink the segments this rank created; idempotent."""
        self._views = [None] * len(self._views)
        for m in [*self._maps, self._ctl_map]:
            _unmap(m)
        self._maps, self._ctl_map = [None] * len(self._maps), None
        self._finalizer()
