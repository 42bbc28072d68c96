"""The control rows of a shm job and the protocol every collective follows on them.

The control segment holds one row of int64 slots per rank: its PID, state, three monotonically increasing counters
(``arrive``, ``reduced``, ``done``, each set to the number of the collective the rank has reached), the generation of
its data segment and two collective descriptors (kind, element count, dtype, op or root), used alternately by odd and
even collectives.

A collective ``#c`` on rank ``r`` runs:

1. wait until every rank has ``done >= c - 1`` (nobody still reads the previous collective's data from r's segment),
   copy the input into r's data segment (a new, larger generation if needed), write the descriptor, then publish
   ``arrive = c``;
2. wait until every rank has ``arrive >= c`` and compare the descriptors: any difference raises
   :class:`~distopt.errors.CollectiveMismatchError` on every rank (all ranks read the same descriptors) before any
   data moves;
3. move the data; publish ``done = c``.

Memory ordering: a rank writes data and descriptors with plain NumPy stores, then the counter (one aligned 8-byte
store); readers load the counter, then the data. On x86-64 (total store order) this is sufficient; glibc's memcpy
fences its non-temporal stores. Weakly ordered CPUs (ARM, POWER) would need explicit fences, which CPython does not
expose: on any other CPU a world of more than one process is refused (:func:`check_platform`).

Waiting busy-polls the counters for 0.2 ms (keeping the core, as MPI does: under load, giving it up costs a scheduler
time slice, and ``time.sleep(0)`` sleeps for the timer slack, about 50-75 us), then yields with ``os.sched_yield()``
until 20 ms (a longer busy phase slowed 1 MiB all-reduces when two ranks shared a core), then sleeps with exponential
backoff from 50 us up to 1 ms. Every wait has the collective's deadline; the PIDs of missing peers are checked every
0.5 s, so a dead (or closed) peer raises within about a second.
"""
from __future__ import annotations

import os
import platform
import time

import numpy as np

from ...errors import BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError
from .. import control
from ..base import REDUCE_OPS
from ..consensus import check_agreed
from ..messages import STALLED, failure_message, mismatch_message, timeout_message, where
from ..wait import Backoff, wait_until
from .segments import Segments

__all__ = ["ControlRows", "check_platform", "dtype_code", "TSO_MACHINES"]

_BACKOFF = Backoff(busy_s=2e-4, yield_s=0.02, min_sleep_s=5e-5, max_sleep_s=1e-3)
#: CPUs whose store order makes the plain-store protocol above correct (total store order).
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")
_LIVENESS_PERIOD_S = 0.5

_MAGIC = 0x3174706F74736964  # b"distopt1", written last by rank 0
_PID, _STATE, ARRIVE, REDUCED, DONE, _GEN = range(6)
_DESC = 8  # descriptors (kind, count, dtype, arg) at slots 8..11 and 12..15
_SLOTS = 16  # int64 slots per row: 128 bytes, two cache lines
_JOINED, _CLOSED = 1, 2

_KINDS = ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_v", "reduce_scatter", "all_gather_into",
          "all_to_all", "all_to_all_v")
_SHARDED = ("reduce_scatter", "all_gather_into", "all_to_all_v")  # their arg: op index + 8 * CRC-32 of the counts

#: The dtypes the shm backend moves, by descriptor code; code ``BFLOAT16`` is ml_dtypes' bfloat16 (NumPy has
#: none), looked up by name so that importing the backend does not import ml_dtypes (about 1 s of CPU).
_DTYPES = tuple(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                      np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128))
BFLOAT16 = len(_DTYPES)


def _dtype_name(code: int) -> str:
    """The name of the dtype with descriptor ``code``."""
    return "bfloat16" if code == BFLOAT16 else str(_DTYPES[code])


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


def dtype_code(dtype: np.dtype) -> int:
    """The descriptor code of a dtype the shm backend moves.

    Raises:
        TypeError: any other dtype (the message lists the supported ones).
    """
    dtype = np.dtype(dtype)
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    if dtype.name == "bfloat16" and dtype.kind == "V":  # ml_dtypes' bfloat16
        return BFLOAT16
    raise TypeError(f"dtype {dtype} is not supported by the shm backend; use one of "
                    + ", ".join(map(_dtype_name, range(BFLOAT16 + 1))))


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


class ControlRows:
    """This rank's side of the control rows: the rendezvous, then the arrive/wait/check protocol.

    Args:
        segments: this rank's :class:`~distopt.comm.shm.segments.Segments`.
        size: the number of ranks.
        timeout: deadline of the rendezvous and of each collective, in seconds.

    Raises:
        FileExistsError: rank 0 finds a control segment of this job id.
        CollectiveMismatchError: ranks were given different sizes.
        CollectiveTimeoutError: not every rank joined before the deadline.
    """

    def __init__(self, segments: Segments, size: int, timeout: float) -> None:
        self.segments, self.rank, self.size, self.timeout = segments, segments.rank, size, timeout
        self.completed = 0  # last collective this rank finished
        self._seq = 0  # collectives started
        self.rows: np.ndarray | None = None  # (size, _SLOTS) int64 view of the control rows
        self._rendezvous()

    def _where(self, op: str, c: int) -> str:
        return where("shm", f"{op} #{c}" if c else op, self.rank)

    def _rendezvous(self) -> None:
        nbytes = (self.size + 1) * _SLOTS * 8
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            ctl = np.ndarray((self.size + 1, _SLOTS), np.int64, buffer=self.segments.create_control(nbytes))
            ctl[0, 1] = self.size
            ctl[0, 0] = _MAGIC
        else:
            delay = 1e-3
            while True:
                try:
                    ctl_map = self.segments.attach_control()
                    header = np.frombuffer(ctl_map, np.int64, count=2)
                    if header[0] == _MAGIC:
                        break
                except FileNotFoundError:
                    pass
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(timeout_message(
                        self._where("rendezvous", 0), self.timeout,
                        who=f"rank 0 did not create /dev/shm/{self.segments.control_name}"))
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
            if header[1] != self.size or len(ctl_map) < nbytes:
                raise CollectiveMismatchError(mismatch_message(
                    self._where("rendezvous", 0), "world size", {0: str(int(header[1])), self.rank: str(self.size)}))
            ctl = np.frombuffer(ctl_map, np.int64, count=nbytes // 8).reshape(-1, _SLOTS)
        self.rows = ctl[1:]
        self.rows[self.rank, _PID] = os.getpid()
        self.rows[self.rank, _STATE] = _JOINED
        self.wait(_STATE, _JOINED, range(self.size), "rendezvous", 0, deadline, "did not join")

    def wait(self, slot: int, target: int, ranks: range | list[int], op: str, c: int,
             deadline: float, what: str) -> None:
        """Spin until ``rows[p, slot] >= target`` for every p in ``ranks``.

        Raises:
            CollectiveTimeoutError: the deadline passed (naming the ranks still missing and ``what`` they did not
                do), or a missing peer exited or closed its communicator.
        """
        values = self.rows[:, slot]
        pending = [p for p in ranks if values[p] < target]
        if not pending:  # the common case of a peer that is ahead
            return

        def done() -> bool:
            pending[:] = [p for p in pending if values[p] < target]
            return not pending

        def expired() -> CollectiveTimeoutError:
            return CollectiveTimeoutError(timeout_message(self._where(op, c), self.timeout, STALLED if c else None,
                                                          f"{_fmt_ranks(pending)} {what}"))

        wait_until(done, deadline, expired, backoff=_BACKOFF, check=lambda: self._check_alive(pending, op, c),
                   check_every_s=_LIVENESS_PERIOD_S)

    def _check_alive(self, ranks: list[int], op: str, c: int) -> None:
        for p in ranks:
            pid = int(self.rows[p, _PID])
            if self.rows[p, _STATE] == _CLOSED:
                cause = f"rank {p} closed its communicator and will not arrive"
            elif pid and not _pid_alive(pid):
                cause = f"rank {p} (pid {pid}) has exited"
            else:
                continue
            raise CollectiveTimeoutError(failure_message(self._where(op, c), cause, "the collective cannot complete"))

    def arrive(self, op: str, count: int, code: int, arg: int, payload: np.ndarray | None = None,
               skip: tuple[int, int] = (0, 0)) -> tuple[int, float, list[int]]:
        """Steps 1-2 of a collective.

        Args:
            op: the collective's kind.
            count: its element count.
            code: :func:`dtype_code` of its dtype.
            arg: the op's index in :data:`~distopt.comm.base.REDUCE_OPS`, or the root; for ``reduce_scatter`` and
                ``all_gather_into`` the op's index (0 for the gather) plus 8 times
                :func:`~distopt.comm.base.counts_digest` of the counts.
            payload: flat uint8 view of the bytes to publish in this rank's data segment, or None.
            skip: byte range of ``payload`` not to copy (no peer reads it).

        Returns:
            The collective's number, its deadline (``time.monotonic()``) and every rank's element count.

        Raises:
            CollectiveMismatchError: the descriptors differ (the collective is then finished on this rank, so the
                communicator stays usable).
            CollectiveTimeoutError: as :meth:`wait`.
        """
        c = self._seq = self._seq + 1
        deadline = time.monotonic() + self.timeout
        row = self.rows[self.rank]
        if payload is not None and payload.nbytes:
            self.wait(DONE, c - 1, range(self.size), op, c, deadline, f"did not finish collective #{c - 1}")
            own = self.segments.own(payload.nbytes)
            row[_GEN] = self.segments.generations[self.rank]
            lo, hi = skip
            own[:lo] = payload[:lo]
            own[hi:payload.nbytes] = payload[hi:]
        desc = _DESC + 4 * (c % 2)
        row[desc:desc + 4] = (_KINDS.index(op), count, code, arg)
        row[ARRIVE] = c
        self.wait(ARRIVE, c, range(self.size), op, c, deadline, "did not arrive")
        try:
            counts = self._check_descriptors(op, c, desc)
        except CollectiveMismatchError:
            self.finish(c)
            raise
        return c, deadline, counts

    def finish(self, c: int) -> None:
        """Step 3's end: publish ``done = c``."""
        self.rows[self.rank, DONE] = c
        self.completed = c

    def published(self, p: int) -> np.ndarray:
        """Rank p's data segment (uint8) as published for the current collective."""
        return self.segments.peer(p, int(self.rows[p, _GEN]))

    def _check_descriptors(self, op: str, c: int, desc: int) -> list[int]:
        heads = self.rows[:, desc:desc + 4]
        if op != "all_gather_v" and control.same(heads):  # every rank's is rank 0's
            return heads[:, 1].tolist()
        kinds, counts, codes, args = (heads[:, i].tolist() for i in range(4))
        fields, show = {"collective": kinds}, {"collective": lambda k: _KINDS[k]}
        hint = {"collective": control.DIFFERENT_CALLS, "element count": control.DIFFERENT_COUNTS,
                "counts (as a CRC-32)": "ranks passed different counts"}
        if op != "all_gather_v":
            fields["element count"] = counts
        fields["dtype"], show["dtype"] = codes, _dtype_name
        if op == "broadcast":
            fields["root"] = args
        elif op in _SHARDED:
            fields["op"] = [a % 8 for a in args]
            fields["counts (as a CRC-32)"] = [a // 8 for a in args]
            show["counts (as a CRC-32)"] = lambda d: f"{d:#010x}"
        else:
            fields["op"] = args
        if "op" in fields:
            show["op"] = lambda i: REDUCE_OPS[i]
        check_agreed(self._where(op, c), fields, show=show, hint=hint)
        return counts

    def close(self) -> None:
        """Mark this rank closed, after the wait of :meth:`distopt.comm.shm.communicator.ShmCommunicator.close`."""
        if self.rows is None:
            return
        try:
            self.wait(DONE, self.completed, range(self.size), "close", 0, time.monotonic() + self.timeout,
                      f"did not finish collective #{self.completed}")
        except CollectiveTimeoutError:
            pass  # closing anyway: that peer has failed
        self.rows[self.rank, _STATE] = _CLOSED
        self.rows = None
