"""Single-node CPU collectives over POSIX shared memory.

Every process of one job attaches to a *control segment* (created by rank 0,
named from the job id) and owns one *data segment* that it grows on demand
(to a new segment name, one generation up, which peers map when they see the
new generation number; sizes double, in bytes, from 64 KiB).
The control segment holds one row of int64 slots per rank: its PID, state,
three monotonically increasing counters (``arrive``, ``reduced``, ``done``,
each set to the number of the collective the rank has reached), the
generation of its data segment and two collective descriptors (kind, element
count, dtype, op or root), used alternately by odd and even collectives.

A collective ``#c`` on rank ``r`` runs:

1. wait until every rank has ``done >= c - 1`` (nobody still reads the
   previous collective's data from r's segment), copy the input into r's
   data segment (a new, larger generation if needed), write the descriptor,
   then publish ``arrive = c``;
2. wait until every rank has ``arrive >= c`` and compare the descriptors:
   any difference raises :class:`~distopt.errors.CollectiveMismatchError`
   on every rank (all ranks read the same descriptors) before any data moves;
3. move the data; publish ``done = c``.

``all_reduce`` is a reduce-scatter followed by an all-gather, as in the
bandwidth-optimal algorithms of Patarasuk & Yuan (2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations") and NCCL's ring. With N
ranks, rank r reduces the r-th 1/N slice of the elements across all ranks'
inputs, writes it into its own segment and publishes ``reduced = c``; every
rank then copies the other N - 1 slices out. Rank r never copies its own
input slice into shared memory (it reads it from the caller's array), so each
rank copies (N-1)/N of the array's bytes in and as many out. Reductions add
in rank order (``((x0 + x1) + x2) + ...``), so float results are
deterministic and identical on every rank; float16 is accumulated in float32.
The reduction runs over 256 KiB chunks so the accumulator stays in cache.
An array of at most 8 KiB skips the reduce-scatter: every rank publishes
all of it and reduces the whole array from every rank's copy, in the same
rank order (the same bits), so it waits for its peers once instead of
twice.

Memory ordering: a rank writes data and descriptors with plain NumPy stores,
then the counter (one aligned 8-byte store); readers load the counter, then
the data. On x86-64 (total store order) this is sufficient; glibc's memcpy
fences its non-temporal stores. Weakly ordered CPUs (ARM, POWER) would need
explicit fences, which CPython does not expose: on any other CPU a world of
more than one process is refused with
:class:`~distopt.errors.BackendUnavailableError` naming the platform and
the backends that work there (``torch``, ``mpi``).

Waiting busy-polls the counters for 0.2 ms (keeping the core, as MPI does:
under load, giving it up costs a scheduler time slice; ``time.sleep(0)`` is
no cheap poll, it sleeps for the timer slack, about 50-75 us), then polls
with ``os.sched_yield()`` until 20 ms (letting another runnable rank have the
core when there are more ranks than cores; a longer busy phase slowed 1 MiB
all-reduces when two ranks shared a core), then sleeps with exponential
backoff from 50 us up to 1 ms. Every wait has the collective's deadline;
while waiting, the PIDs of missing peers are checked every 0.5 s, so a dead
(or closed) peer raises within about a second instead of at the deadline.

Segments are unlinked by the rank that created them on :meth:`close` or at
interpreter exit (``weakref.finalize``). A rank killed by a signal cannot clean
up: its resource tracker unlinks its segments when the tracker's last user
exits, and :func:`distopt.launch.spawn` sweeps them with
:func:`unlink_segments` as soon as the job ends.

One communicator per job id may be open at a time; derive distinct ids
(``f"{job_id}-2"``) for several.
"""
from __future__ import annotations

import mmap
import os
import platform
import re
import time
import weakref
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import _posixshmem
import numpy as np

from ..errors import BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError
from . import descriptor
from .base import REDUCE_OPS, check_reduce_args
from .staging import staged
from .lifecycle import CommunicatorState, collective
from .wait import Backoff, resolve_timeout, wait_until

__all__ = ["ShmCommunicator", "segment_prefix", "unlink_segments"]

# Bytes of accumulator a reduction works on at a time (stays in L2 cache;
# 256 KiB measured fastest against 64 KiB, 1 MiB and 4 MiB).
_CHUNK_BYTES = 1 << 18

_MIN_CAPACITY = 1 << 16  # bytes, smallest data segment
_BUSY_S = 2e-4  # seconds of pure busy polling (keeps the core)
_SPIN_S = 0.02  # seconds of polling with sched_yield before backing off to sleeps
_MIN_SLEEP_S, _MAX_SLEEP_S = 5e-5, 1e-3
_BACKOFF = Backoff(busy_s=_BUSY_S, yield_s=_SPIN_S, min_sleep_s=_MIN_SLEEP_S, max_sleep_s=_MAX_SLEEP_S)
#: CPUs whose store order makes the plain-store protocol above correct (total store order).
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")
_LIVENESS_PERIOD_S = 0.5
_SLICE_ALIGN = 64  # bytes; reduce-scatter slices start on cache lines
_SMALL_BYTES = 8192  # an all-reduce of at most this many bytes is reduced whole by every rank

_MAGIC = 0x3174706F74736964  # b"distopt1", written last by rank 0
_PID, _STATE, _ARRIVE, _REDUCED, _DONE, _GEN = range(6)
_DESC = 8  # descriptors (kind, count, dtype, arg) at slots 8..11 and 12..15
_SLOTS = 16  # int64 slots per row: 128 bytes, two cache lines
_JOINED, _CLOSED = 1, 2

_KINDS = ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_v")
_DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
))
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def segment_prefix(job_id: str) -> str:
    """Name prefix of every shared-memory segment of ``job_id`` (no leading slash).

    Job ids contain no dots, so the prefix of one job never matches another's.
    """
    return f"distopt.{job_id}."


def unlink_segments(job_id: str, *, untrack: bool = False) -> list[str]:
    """Unlink the segments of ``job_id`` still listed in ``/dev/shm``.

    For use after every process of the job has exited (one killed by a signal
    cannot unlink its own segments). Linux only; elsewhere returns ``[]``.

    Args:
        job_id: the job's id.
        untrack: also forget the names in this process's resource tracker.
            Pass True when the workers were started by this process with
            multiprocessing: they share its tracker, which would otherwise
            warn about (and retry) these names when it shuts down.

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
    """Map an existing segment without registering it with the resource tracker.

    ``SharedMemory(name)`` registers attachments too (Python < 3.13), and the
    usual fix, unregistering afterwards, also drops the creator's registration
    when both processes share one tracker (multiprocessing children do).

    Raises:
        FileNotFoundError: no such segment, or it is not sized yet.
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise FileNotFoundError(f"shared memory segment {name} is not sized yet")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink_owned(owned: dict[str, SharedMemory]) -> None:
    """Unlink and unmap the segments a communicator created (finalizer)."""
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


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _fmt_ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _dtype_code(dtype: np.dtype) -> int:
    try:
        return _DTYPES.index(np.dtype(dtype))
    except ValueError:
        raise TypeError(
            f"dtype {dtype} is not supported by the shm backend; use one of "
            + ", ".join(map(str, _DTYPES))
        ) from None


def _require_ndarray(array: Any) -> None:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"the shm backend takes NumPy arrays, got {type(array).__name__}")


def check_platform(size: int) -> None:
    """Refuse a world of more than one process on a CPU without total store order.

    Raises:
        BackendUnavailableError: ``platform.machine()`` is not x86 and ``size > 1``.
    """
    machine = platform.machine()
    if size > 1 and machine.lower() not in TSO_MACHINES:
        raise BackendUnavailableError(
            f"the shm backend relies on x86-64 store ordering and does not run on this CPU ({machine!r}): "
            "use backend='torch' (torch.distributed over gloo; e.g. torchrun) or backend='mpi' (mpiexec)")


class ShmCommunicator(CommunicatorState):
    """Collectives between the processes of one machine through shared memory.

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: the number of processes.
        job_id: the id every process of the job shares
            (:attr:`distopt.nccl_id.NcclIdHolder.job_id`); letters, digits,
            ``_`` and ``-``.
        timeout: deadline of the rendezvous and of each collective, in
            seconds. Default: ``$DISTOPT_TIMEOUT``, else
            :data:`~distopt.comm.base.DEFAULT_TIMEOUT`.

    Raises:
        ValueError: bad rank, size, job id or timeout.
        BackendUnavailableError: ``size > 1`` on a CPU other than x86
            (see the module docstring).
        FileExistsError: a communicator for ``job_id`` is already open.
        CollectiveMismatchError: ranks were given different sizes.
        CollectiveTimeoutError: not every rank joined before the deadline.

    Every collective raises :class:`~distopt.errors.CollectiveTimeoutError`
    naming the operation, its number and the missing ranks when they do not
    arrive in time, or promptly when one has exited or closed; the
    communicator should be closed after that. A
    :class:`~distopt.errors.CollectiveMismatchError` leaves it usable.
    """

    name = "shm"

    def __init__(self, rank: int, size: int, job_id: str, timeout: float | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank={rank}, size={size}")
        if not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id must be 1-200 letters, digits, '_' or '-', got {job_id!r}")
        check_platform(size)
        self.rank, self.size, self.job_id, self.timeout = rank, size, job_id, resolve_timeout(timeout)
        self._prefix = segment_prefix(job_id)
        self._seq = 0  # collectives started
        self._completed = 0  # last collective this rank finished
        self._owned: dict[str, SharedMemory] = {}
        self._finalizer = weakref.finalize(self, _unlink_owned, self._owned)
        self._ctl_map: mmap.mmap | None = None  # control segment, on ranks > 0
        self._rows: np.ndarray | None = None  # (size, _SLOTS) int64 view of the control rows
        self._gens = [0] * size  # data segment generation mapped, per rank (0: none)
        self._maps: list[mmap.mmap | None] = [None] * size  # peers' data mappings
        self._segs: list[np.ndarray | None] = [None] * size  # uint8 views of data segments
        self._scratch = np.empty(_CHUNK_BYTES, np.uint8)
        try:
            self._rendezvous()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup

    def _rendezvous(self) -> None:
        name = self._prefix + "ctl"
        nbytes = (self.size + 1) * _SLOTS * 8
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            try:
                shm = SharedMemory(name, create=True, size=nbytes)
            except FileExistsError:
                raise FileExistsError(
                    f"a shm communicator for job {self.job_id!r} is already open "
                    f"(/dev/shm/{name}); use a distinct job_id per communicator"
                ) from None
            self._owned[name] = shm
            ctl = np.ndarray((self.size + 1, _SLOTS), np.int64, buffer=shm.buf)
            ctl[0, 1] = self.size
            ctl[0, 0] = _MAGIC
        else:
            delay = 1e-3
            while True:
                try:
                    if self._ctl_map is None:
                        self._ctl_map = _attach(name)
                    header = np.frombuffer(self._ctl_map, np.int64, count=2)
                    if header[0] == _MAGIC:
                        break
                except FileNotFoundError:
                    pass
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(
                        f"shm rendezvous on rank {self.rank}: rank 0 did not create "
                        f"/dev/shm/{name} within {self.timeout:g} s"
                    )
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
            if header[1] != self.size or len(self._ctl_map) < nbytes:
                raise CollectiveMismatchError(
                    f"shm rendezvous: world size differs: rank 0 has {int(header[1])}, "
                    f"rank {self.rank} has {self.size}"
                )
            ctl = np.frombuffer(self._ctl_map, np.int64, count=nbytes // 8).reshape(-1, _SLOTS)
        self._rows = ctl[1:]
        self._rows[self.rank, _PID] = os.getpid()
        self._rows[self.rank, _STATE] = _JOINED
        self._wait(_STATE, _JOINED, range(self.size), "rendezvous", 0, deadline, "did not join")

    # -------------------------------------------------------------- machinery

    def _where(self, op: str, c: int) -> str:
        return f"shm {op} #{c} on rank {self.rank}" if c else f"shm {op} on rank {self.rank}"

    def _wait(self, slot: int, target: int, ranks: range | list[int], op: str, c: int,
              deadline: float, what: str) -> None:
        """Spin until ``rows[p, slot] >= target`` for every p in ``ranks``."""
        values = self._rows[:, slot]
        pending = [p for p in ranks if values[p] < target]
        if not pending:  # the common case of a peer that is ahead
            return

        def done() -> bool:
            pending[:] = [p for p in pending if values[p] < target]
            return not pending

        def expired() -> CollectiveTimeoutError:
            return CollectiveTimeoutError(
                f"{self._where(op, c)}: timed out after {self.timeout:g} s; {_fmt_ranks(pending)} {what}")

        wait_until(done, deadline, expired, backoff=_BACKOFF, check=lambda: self._check_alive(pending, op, c),
                   check_every_s=_LIVENESS_PERIOD_S)

    def _check_alive(self, ranks: list[int], op: str, c: int) -> None:
        for p in ranks:
            pid = int(self._rows[p, _PID])
            if self._rows[p, _STATE] == _CLOSED:
                raise CollectiveTimeoutError(
                    f"{self._where(op, c)}: rank {p} closed its communicator and will not arrive")
            if pid and not _pid_alive(pid):
                raise CollectiveTimeoutError(
                    f"{self._where(op, c)}: rank {p} (pid {pid}) has exited; "
                    "the collective cannot complete")

    def _arrive(self, op: str, count: int, dtype_code: int, arg: int,
                payload: np.ndarray | None = None, skip: tuple[int, int] = (0, 0)
                ) -> tuple[int, float, list[int]]:
        """Steps 1-2 of a collective; returns (number, deadline, element counts).

        Args:
            payload: flat uint8 view of the bytes to publish, or None.
            skip: byte range of ``payload`` not to copy (no peer reads it).
        """
        c = self._seq = self._seq + 1
        deadline = time.monotonic() + self.timeout
        row = self._rows[self.rank]
        if payload is not None and payload.nbytes:
            self._wait(_DONE, c - 1, range(self.size), op, c, deadline,
                       f"did not finish collective #{c - 1}")
            own = self._own_segment(payload.nbytes)
            lo, hi = skip
            own[:lo] = payload[:lo]
            own[hi:payload.nbytes] = payload[hi:]
        desc = _DESC + 4 * (c % 2)
        row[desc:desc + 4] = (_KINDS.index(op), count, dtype_code, arg)
        row[_ARRIVE] = c
        self._wait(_ARRIVE, c, range(self.size), op, c, deadline, "did not arrive")
        try:
            counts = self._check_descriptors(op, c, desc)
        except CollectiveMismatchError:
            self._finish(c)
            raise
        return c, deadline, counts

    def _finish(self, c: int) -> None:
        self._rows[self.rank, _DONE] = c
        self._completed = c

    def _check_descriptors(self, op: str, c: int, desc: int) -> list[int]:
        heads = self._rows[:, desc:desc + 4]
        if op != "all_gather_v" and descriptor.same(heads):  # every rank's is rank 0's
            return heads[:, 1].tolist()
        kinds, counts, codes, args = (heads[:, i].tolist() for i in range(4))

        def differs(values: list[int], label: str, show) -> None:
            if len(set(values)) > 1:
                detail = ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
                raise CollectiveMismatchError(
                    f"{self._where(op, c)}: {label} differs across ranks ({detail})")

        differs(kinds, "operation", lambda k: _KINDS[k])
        if op != "all_gather_v":
            differs(counts, "element count", str)
        differs(codes, "dtype", lambda i: str(_DTYPES[i]))
        if op == "broadcast":
            differs(args, "root", str)
        else:
            differs(args, "op", lambda i: REDUCE_OPS[i])
        return counts

    def _own_segment(self, nbytes: int) -> np.ndarray:
        """This rank's data segment, replaced by a larger generation if needed."""
        me = self.rank
        seg = self._segs[me]
        if seg is not None and seg.nbytes >= nbytes:
            return seg
        capacity = max(nbytes, 2 * (0 if seg is None else seg.nbytes), _MIN_CAPACITY)
        capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        gen = self._gens[me] + 1
        name = f"{self._prefix}r{me}.g{gen}"
        shm = SharedMemory(name, create=True, size=capacity)
        if seg is not None:
            self._segs[me] = seg = None
            _unlink_owned({"old": self._owned.pop(f"{self._prefix}r{me}.g{gen - 1}")})
        self._owned[name] = shm
        self._segs[me] = np.frombuffer(shm.buf, np.uint8)
        self._gens[me] = gen
        self._rows[me, _GEN] = gen
        return self._segs[me]

    def _segment(self, p: int) -> np.ndarray:
        """Rank p's data segment as published for the current collective."""
        gen = int(self._rows[p, _GEN])
        if gen != self._gens[p]:
            self._segs[p] = None
            _unmap(self._maps[p])
            self._maps[p] = _attach(f"{self._prefix}r{p}.g{gen}")
            self._segs[p] = np.frombuffer(self._maps[p], np.uint8)
            self._gens[p] = gen
        return self._segs[p]

    def _bounds(self, n: int, itemsize: int, p: int) -> tuple[int, int]:
        """Element range of rank p's reduce-scatter slice of n elements."""
        unit = max(1, _SLICE_ALIGN // itemsize)
        units = -(-n // unit)
        return (min(n, units * p // self.size * unit),
                min(n, units * (p + 1) // self.size * unit))

    # ------------------------------------------------------------ collectives

    @staged
    @collective
    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``array`` across ranks in place (reduce-scatter + all-gather).

        Args:
            array: C-contiguous NumPy array, same element count and dtype on
                every rank.
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; see
                :meth:`distopt.comm.base.Communicator.all_reduce`.

        Returns:
            ``array``, holding the result (identical on every rank).

        Raises:
            TypeError: not a NumPy array, unsupported dtype, integer ``avg``
                or a non-contiguous array (checked locally, before any
                communication).
            CollectiveMismatchError: element counts, dtypes or ops differ.
            CollectiveTimeoutError: a rank did not arrive in time, exited or
                closed.
        """
        _require_ndarray(array)
        check_reduce_args(array, op)
        code = _dtype_code(array.dtype)
        if self.size == 1:
            return array
        n, itemsize, me = array.size, array.itemsize, self.rank
        flat = array.reshape(-1)
        if 0 < array.nbytes <= _SMALL_BYTES:
            c, _, _ = self._arrive("all_reduce", n, code, REDUCE_OPS.index(op), flat.view(np.uint8))
            views = [self._segment(p)[:array.nbytes].view(array.dtype) for p in range(self.size)]
            self._reduce_whole(views, op, flat)
            self._finish(c)
            return array
        lo, hi = self._bounds(n, itemsize, me)
        c, deadline, _ = self._arrive("all_reduce", n, code, REDUCE_OPS.index(op),
                                      flat.view(np.uint8), (lo * itemsize, hi * itemsize))
        row = self._rows[me]
        if n == 0:
            self._finish(c)
            return array
        views = [flat if p == me else self._segment(p)[:n * itemsize].view(array.dtype)
                 for p in range(self.size)]
        self._reduce_slice(views, lo, hi, op)
        row[_REDUCED] = c
        for k in range(1, self.size):
            p = (me + k) % self.size
            self._wait(_REDUCED, c, [p], "all_reduce", c, deadline, "did not finish its reduction")
            plo, phi = self._bounds(n, itemsize, p)
            flat[plo:phi] = views[p][plo:phi]
        self._finish(c)
        return array

    @staticmethod
    def _ufuncs(dtype: np.dtype, op: str) -> tuple[Any, np.dtype]:
        """The reduction's ufunc and accumulator dtype (float32 for float16)."""
        if dtype == np.bool_:
            ufunc = np.logical_and if op == "min" else np.logical_or
        else:
            ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
        return ufunc, np.dtype(np.float32) if dtype == np.float16 else dtype

    def _reduce_whole(self, views: list[np.ndarray], op: str, out: np.ndarray) -> None:
        """Reduce every rank's published copy (``views``, rank order) of a small array into ``out``:
        the operations of :meth:`_reduce_slice`, so the same bits."""
        ufunc, acc_dtype = self._ufuncs(out.dtype, op)
        acc = out if acc_dtype == out.dtype else np.empty(out.size, acc_dtype)
        ufunc(views[0], views[1], out=acc, dtype=acc_dtype)
        for view in views[2:]:
            ufunc(acc, view, out=acc, dtype=acc_dtype)
        if op == "avg":
            np.divide(acc, self.size, out=acc)
        if acc is not out:
            out[...] = acc

    def _reduce_slice(self, views: list[np.ndarray], lo: int, hi: int, op: str) -> None:
        """Reduce elements [lo, hi) of every rank's input in rank order.

        The result goes into this rank's data segment (for the peers) and into
        ``views[rank]``, the caller's array. Ranks 0 and 1 accumulate directly
        in the caller's array (their input is consumed by the first addition);
        the others, and float16, go through a scratch chunk.
        """
        dtype = views[0].dtype
        ufunc, acc_dtype = self._ufuncs(dtype, op)
        scratch = self._scratch.view(acc_dtype)
        own = self._segs[self.rank][:views[0].nbytes].view(dtype)
        mine = views[self.rank]
        direct = self.rank < 2 and acc_dtype == dtype
        for start in range(lo, hi, scratch.size):
            stop = min(start + scratch.size, hi)
            acc = mine[start:stop] if direct else scratch[:stop - start]
            ufunc(views[0][start:stop], views[1][start:stop], out=acc, dtype=acc_dtype)
            for view in views[2:]:
                ufunc(acc, view[start:stop], out=acc, dtype=acc_dtype)
            if op == "avg":
                np.divide(acc, self.size, out=acc)
            own[start:stop] = acc
            if not direct:
                mine[start:stop] = acc

    @staged
    @collective
    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with root's contents, in place.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            ValueError: ``root`` out of range.
            CollectiveMismatchError: element counts, dtypes or roots differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        _require_ndarray(array)
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        code = _dtype_code(array.dtype)
        is_root = self.rank == root
        payload = np.ascontiguousarray(array).reshape(-1).view(np.uint8) if is_root else None
        c, _, _ = self._arrive("broadcast", array.size, code, root, payload)
        if not is_root and array.nbytes:
            src = self._segment(root)[:array.nbytes].view(array.dtype)
            np.copyto(array, src.reshape(array.shape))
        self._finish(c)
        return array

    @staged
    @collective
    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Gather equal-sized arrays from every rank.

        Returns:
            A new array of shape ``(size, *array.shape)``; row r is rank r's input.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            CollectiveMismatchError: element counts or dtypes differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        _require_ndarray(array)
        code = _dtype_code(array.dtype)
        payload = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        c, _, _ = self._arrive("all_gather", array.size, code, 0, payload)
        out = np.empty((self.size, *array.shape), array.dtype)
        rows = out.reshape(self.size, array.size).view(np.uint8)
        for p in range(self.size):
            if payload.nbytes:
                rows[p] = payload if p == self.rank else self._segment(p)[:payload.nbytes]
        self._finish(c)
        return out

    @staged
    @collective
    def all_gather_v(self, array: np.ndarray) -> list[np.ndarray]:
        """Gather 1-D arrays whose lengths (in elements, may be 0) differ per rank.

        Returns:
            ``size`` new arrays; entry r is rank r's input.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            ValueError: ``array`` is not 1-D.
            CollectiveMismatchError: dtypes differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        _require_ndarray(array)
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes 1-D arrays, got shape {array.shape}")
        code = _dtype_code(array.dtype)
        payload = np.ascontiguousarray(array).view(np.uint8)
        c, _, counts = self._arrive("all_gather_v", array.size, code, 0, payload)
        out = []
        for p, count in enumerate(counts):
            if p == self.rank:
                out.append(array.copy())
            elif count == 0:
                out.append(np.empty(0, array.dtype))
            else:
                nbytes = count * array.itemsize
                out.append(self._segment(p)[:nbytes].view(array.dtype).copy())
        self._finish(c)
        return out

    @collective
    def barrier(self) -> None:
        """Block until every rank has reached the barrier.

        Raises:
            CollectiveMismatchError: another rank called a different collective.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        c, _, _ = self._arrive("barrier", 0, 0, 0)
        self._finish(c)

    def close(self) -> None:
        """Unmap everything and unlink the segments this rank created; idempotent.

        First waits (up to the timeout; not for peers that exited or closed)
        until every peer has finished the last collective this rank
        completed, since a peer may still be reading this rank's segment.
        Peers waiting on this rank in a later collective then fail promptly.
        """
        if self.closed:
            return
        self.closed = True
        if self._rows is not None:
            try:
                self._wait(_DONE, self._completed, range(self.size), "close", 0,
                           time.monotonic() + self.timeout,
                           f"did not finish collective #{self._completed}")
            except CollectiveTimeoutError:
                pass  # closing anyway: that peer has failed
            self._rows[self.rank, _STATE] = _CLOSED
        self._rows = None
        self._segs = [None] * self.size
        for m in [*self._maps, self._ctl_map]:
            _unmap(m)
        self._maps, self._ctl_map = [None] * self.size, None
        self._finalizer()

    def __repr__(self) -> str:
        return (f"ShmCommunicator(rank={self.rank}, size={self.size}, "
                f"job_id={self.job_id!r}, timeout={self.timeout:g})")
