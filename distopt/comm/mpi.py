"""MPI backend on mpi4py: buffer (uppercase) calls only, every wait bounded.

Each collective is issued non-blocking (``Iallreduce``, ``Ibcast``, ...) and
tested against a deadline, so a rank that never arrives turns into a
:class:`~distopt.errors.CollectiveTimeoutError` instead of a hang. Before the
data moves, the ranks exchange a 4-integer descriptor (collective kind,
sequence number, element count, dtype/op code) with one small all-gather (a
persistent collective, set up once: MPI 4's ``Allgather_init``); a difference
raises :class:`~distopt.errors.CollectiveMismatchError` on every rank instead
of a partial or garbled result. Small calls (up to 512 bytes per
rank) carry their data in that same exchange (see
:mod:`~distopt.comm.descriptor`): one collective per call. On a
timeout, the error names the ranks that did not arrive and the collective
each one is in, read from a small RMA window where every rank posts its
collective sequence number (passive one-sided ``Rget``, itself bounded).

float16 and bfloat16 have no MPI datatype: they travel as 16-bit words
(``MPI.UINT16_T``, 2 bytes per element on the wire) and are summed by a
reduce-scatter, a float32 sum rounded once, and an all-gather
(:mod:`~distopt.comm.mpi_half`).
"""
from __future__ import annotations

import struct
import time
from typing import Any, Callable

import numpy as np

try:
    from mpi4py import MPI
except RuntimeError as exc:  # mpi4py 4 loads libmpi at import: "cannot load MPI library"
    raise ImportError(
        f"mpi4py cannot load an MPI library ({str(exc).splitlines()[-1]}). Install one with "
        "pip install 'distopt[mpich]' (or point MPI4PY_LIBMPI at your MPI's libmpi.so), or launch "
        "without MPI: torchrun (backend 'torch'), python -m distopt.launch (backend 'shm'), or a "
        "plain single process"
    ) from exc

from ..errors import CollectiveTimeoutError, DistOptError
from ..core._fastcast import cast_into
from . import descriptor
from .descriptor import KINDS as _KINDS, dtype_code as _dtype_code, kind_name as _kind
from .base import REDUCE_OPS, check_reduce_args
from .staging import staged, staged_async
from .mpi_half import HalfQueue, HalfSum, half_dtypes, half_op
from .lifecycle import CommunicatorState, close_at_exit, collective, forget_at_exit, timed_call
from .wait import Backoff, resolve_timeout, wait_until

__all__ = ["MPICommunicator"]

_MPI_TYPES: dict[np.dtype, Any] = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.bool_): MPI.C_BOOL,
}
_WHERE = struct.Struct("<2q")  # this rank's (collective sequence number, kind) in the side channel
_NATIVE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}
#: Seconds a wait polls MPI without sleeping before it starts backing off.
BUSY_POLL = 0.02
_BACKOFF = Backoff(busy_s=BUSY_POLL, yield_s=BUSY_POLL, min_sleep_s=1e-5, max_sleep_s=2e-4)


def _reduce_op(dtype: np.dtype, mpi_type: Any, op: str) -> Any:
    """The MPI operation for ``op`` on ``dtype`` (logical for bool, user-defined for 16-bit floats)."""
    if dtype == np.bool_:
        return _BOOL_OPS[op]
    if mpi_type is MPI.UINT16_T and dtype != np.uint16:
        return half_op(dtype, op)
    return _NATIVE_OPS[op]


def _control_exchange(comm: Any, block: np.ndarray, table: np.ndarray) -> tuple[Any, Callable[[], Any]]:
    """How the control block is all-gathered: a persistent collective (MPI 4's ``Allgather_init``,
    set up once, then only started: less than half the cost of an ``Iallgather`` per call), or, on an
    MPI library without persistent collectives, an ``Iallgather`` per call.

    Returns:
        The persistent request (None without one) and a function that starts one exchange and
        returns its request.
    """
    spec = ([block, MPI.BYTE], [table, MPI.BYTE])
    try:
        request = comm.Allgather_init(*spec)
    except NotImplementedError:  # mpi4py's answer when the MPI library predates MPI 4
        return None, lambda: comm.Iallgather(*spec)

    def start() -> Any:
        request.Start()
        return request

    return request, start


class MpiHandle:
    """An all-reduce in flight (see :meth:`MPICommunicator.all_reduce_async`)."""

    def __init__(self, comm: "MPICommunicator", request: Any, array: np.ndarray, op: str) -> None:
        self._comm, self._request, self._array, self._op = comm, request, array, op

    def test(self) -> bool:
        """Drive MPI progress; True once the reduction is complete."""
        return self._request is None or bool(self._request.Test())

    def wait(self) -> np.ndarray:
        """Complete the reduction (bounded by the communicator's timeout); returns the array.

        Raises:
            CollectiveTimeoutError: the deadline passed.
            CommunicatorClosedError: the communicator was closed meanwhile.
        """
        if self._request is not None:
            self._comm._check_open("all_reduce_async wait")
            timed_call(self._comm, "distopt.all_reduce_async.wait", self._comm._wait, self._request,
                       f"all_reduce_async of {self._array.size} elements")
            self._request = None
            if self._op == "avg":
                np.divide(self._array, self._comm.size, out=self._array)
        return self._array


class MPICommunicator(CommunicatorState):
    """Collectives over an MPI communicator (CPU NumPy arrays).

    Args:
        comm: an ``mpi4py.MPI.Comm``; default ``MPI.COMM_WORLD``. It is
            duplicated, so distopt's traffic never matches the caller's.
        timeout: deadline of one collective in seconds; default
            ``DISTOPT_TIMEOUT`` from the environment, else 300.

    Raises:
        ValueError: ``timeout`` (or ``DISTOPT_TIMEOUT``) is not a positive number.
        TypeError: an array that is not a NumPy array (CuPy arrays need the
            NCCL backend), or a dtype MPI cannot reduce.

    A communicator that is never closed is closed at interpreter exit
    (before MPI is finalized), after a bounded barrier.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, timeout: float | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._control = self._comm.Dup()  # only for close's vote: never matched with a collective in flight
        self._halves = HalfQueue(self._comm.Dup())  # the all-gathers of 16-bit sums, in start order
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self._seq = 0
        self._broken: str | None = None
        # side channel "who is where": each rank exposes (collective seq, kind) in an RMA window that
        # peers read passively when a collective times out, to name the ranks that did not arrive
        self._win = MPI.Win.Allocate(16, disp_unit=8, comm=self._comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._where = self._win.tomemory()
        _WHERE.pack_into(self._where, 0, 0, -1)
        self._inline = descriptor.inline_bytes(self.size)
        self._block = np.zeros(descriptor.block_bytes(self.size), dtype=np.uint8)
        self._table = np.empty((self.size, self._block.size), dtype=np.uint8)
        self._persistent, self._start_exchange = _control_exchange(self._comm, self._block, self._table)
        self._heads = self._table.view(np.int64)[:, :4]  # every rank's descriptor, after an exchange
        self._typed: dict[np.dtype, np.ndarray] = {}  # the table viewed as each dtype reduced inline
        close_at_exit(self)

    @property
    def raw(self) -> Any:
        """The underlying (duplicated) ``mpi4py.MPI.Comm``."""
        return self._comm

    # ------------------------------------------------------------------ helpers
    def _wait(self, request: Any, what: str) -> None:
        if not self._halves.waiting and request.Test():  # the common case of a small call, cheaply
            return
        # MPI advances a non-blocking collective only inside MPI calls: poll without sleeping for
        # BUSY_POLL seconds, then back off (yielding the core to oversubscribed ranks), bounded
        def expired() -> CollectiveTimeoutError:
            self._broken = what
            return CollectiveTimeoutError(
                f"{what} on rank {self.rank} did not complete within {self.timeout:g} s: "
                f"{self._missing_report()}; a rank that died, is stuck, or ran a different number "
                "of steps; the communicator is unusable now")

        halves = self._halves

        def done() -> bool:  # every wait also starts the 16-bit sums' all-gathers that are due, in order
            if halves.waiting:
                halves.drive()
            return request.Test()

        wait_until(done, time.monotonic() + self.timeout, expired, backoff=_BACKOFF)

    def _missing_report(self, per_rank_s: float = 1.0) -> str:
        """Read every rank's (seq, kind) from the side channel: who has not reached this collective."""
        behind = []
        for r in range(self.size):
            if r == self.rank:
                continue
            got = np.zeros(2, dtype=np.int64)
            request = self._win.Rget([got, MPI.INT64_T], r)
            start = time.monotonic()
            while not request.Test():
                if time.monotonic() - start > per_rank_s:
                    behind.append(f"{r} (unresponsive)")
                    break
            else:
                if got[0] < self._seq:
                    at = f"{_kind(got[1])} #{got[0]}" if got[1] >= 0 else "no collective yet"
                    behind.append(f"{r} (at {at})")
        if not behind:
            return "every rank reached it; the collective itself stalled"
        return "ranks that did not arrive: " + ", ".join(behind)

    def _agree(self, kind: str, count: int, code: int, payload: np.ndarray | None = None
               ) -> tuple[str, np.ndarray]:
        """Exchange (kind, seq, count, code) and ``payload`` (at most ``self._inline`` bytes) in one
        fixed-size control block; raise on every rank if ranks differ.

        Returns:
            The call's name for messages, and every rank's inline bytes
            (uint8, shape ``(size, inline)``; row r is rank r's).
        """
        if self._broken is not None:
            raise DistOptError(f"communicator unusable after a failed collective ({self._broken})")
        self._seq = seq = self._seq + 1
        code_of_kind = _KINDS.index(kind)
        _WHERE.pack_into(self._where, 0, seq, code_of_kind)
        self._win.Sync()
        what = f"{kind} #{seq}"
        descriptor.encode(self._block, code_of_kind, seq, count, code, payload)
        self._wait(self._start_exchange(), what)
        if not descriptor.same(self._heads):
            descriptor.check(self._heads.copy(), what)
        return what, self._table[:, descriptor.HEAD_BYTES:]  # read by the caller before the next call

    def _inline_rows(self, like: np.ndarray) -> np.ndarray:
        """Every rank's inline copy of an array like ``like`` as a view into the table (no copy: read it
        before the next call): shape ``(size, like.size)``."""
        typed = self._typed.get(like.dtype)
        if typed is None:  # blocks and the descriptor are multiples of 8 bytes, the largest item size
            typed = self._typed[like.dtype] = self._table.view(like.dtype)
        start = descriptor.HEAD_BYTES // like.itemsize
        return typed[:, start:start + like.size]

    def _buffer(self, array: Any) -> tuple[Any, Any]:
        if not isinstance(array, np.ndarray):
            raise TypeError(
                f"the MPI backend takes NumPy arrays, got {type(array).__name__}; "
                "use backend='nccl' for CuPy arrays"
            )
        if not array.flags.c_contiguous:
            raise TypeError("array must be C-contiguous")
        dt = array.dtype
        if dt in _MPI_TYPES:
            return array, _MPI_TYPES[dt]
        if dt.itemsize == 2 and dt in half_dtypes():
            return array.view(np.uint16), MPI.UINT16_T
        raise TypeError(f"dtype {dt} is not supported by the MPI backend")

    # --------------------------------------------------------------- protocol
    @staged
    @collective
    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``array`` in place across ranks; see :class:`Communicator`.

        Wire: ``array.nbytes`` per rank per direction of the MPI algorithm;
        float16/bfloat16 travel as 2-byte words (:class:`~distopt.comm.mpi_half.HalfSum`).
        """
        check_reduce_args(array, op)
        buf, mpi_type = self._buffer(array)
        code = _dtype_code(array.dtype) * 8 + REDUCE_OPS.index(op)
        if array.nbytes <= self._inline:
            self._agree("all_reduce", array.size, code, array)
            descriptor.reduce_rows(self._inline_rows(array), op, array)
            return array
        what, _ = self._agree("all_reduce", array.size, code)
        if array.size and self.size > 1:
            self._wait(self._start(array, buf, mpi_type, op), what)
        if op == "avg":
            np.divide(array, self.size, out=array)
        return array

    @staged_async
    @collective
    def all_reduce_async(self, array: np.ndarray, op: str = "sum") -> "MpiHandle":
        """Start an in-place all-reduce (``Iallreduce``) and return at once.

        Unlike :meth:`all_reduce` there is no per-call agreement check (it
        would block); DistOpt checks its bucket layout across ranks before
        the first step instead. Every rank must start the same reductions in
        the same order. MPI may progress the reduction only inside MPI calls:
        call ``handle.test()`` now and then, or set ``MPIR_CVAR_ASYNC_PROGRESS=1``
        (MPICH) for a progress thread.

        Returns:
            A handle; ``wait()`` completes the reduction (bounded by the
            timeout) and divides by the world size for ``op="avg"``.
        """
        check_reduce_args(array, op)
        buf, mpi_type = self._buffer(array)
        request = self._start(array, buf, mpi_type, op) if array.size and self.size > 1 else None
        return MpiHandle(self, request, array, op)

    def _start(self, array: np.ndarray, buf: np.ndarray, mpi_type: Any, op: str) -> Any:
        """Start the in-place reduction of ``array``; a request (``Test()``)."""
        if mpi_type is MPI.UINT16_T and array.dtype != np.uint16 and op in ("sum", "avg"):
            return HalfSum(self._comm, array, self._halves)
        return self._comm.Iallreduce(MPI.IN_PLACE, [buf, mpi_type], _reduce_op(array.dtype, mpi_type, op))

    @staged
    @collective
    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` with root's contents on every rank (in place)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        buf, mpi_type = self._buffer(array)
        code = _dtype_code(array.dtype) * 64 + root
        if array.nbytes <= self._inline:
            self._agree("broadcast", array.size, code, array if self.rank == root else None)
            array.reshape(-1)[...] = self._inline_rows(array)[root]
            return array
        what, _ = self._agree("broadcast", array.size, code)
        if array.size and self.size > 1:
            self._wait(self._comm.Ibcast([buf, mpi_type], root=root), what)
        return array

    @staged
    @collective
    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Gather equal-sized arrays; returns shape ``(size, *array.shape)``."""
        buf, mpi_type = self._buffer(array)
        out = np.empty((self.size, *array.shape), dtype=array.dtype)
        if array.nbytes <= self._inline:
            self._agree("all_gather", array.size, _dtype_code(array.dtype), array)
            out.reshape(self.size, -1)[...] = self._inline_rows(array)
            return out
        what, _ = self._agree("all_gather", array.size, _dtype_code(array.dtype))
        if array.size:
            self._wait(self._comm.Iallgather([buf, mpi_type], [self._buffer(out)[0], mpi_type]), what)
        return out

    @staged
    @collective
    def all_gather_v(self, array: np.ndarray) -> list[np.ndarray]:
        """Gather 1-D arrays of per-rank lengths (0 allowed); list of ``size`` arrays."""
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes a 1-D array, got shape {array.shape}")
        buf, mpi_type = self._buffer(array)
        # the block carries this rank's length, then its data if it fits (and every rank's fits)
        fits = array.nbytes + 8 <= self._inline
        mine = np.concatenate([np.array([array.size], dtype=np.int64).view(np.uint8),
                               array.view(np.uint8) if fits else np.zeros(0, np.uint8)])
        what, inline = self._agree("all_gather_v", 0, _dtype_code(array.dtype), mine)
        counts = np.ascontiguousarray(inline[:, :8]).view(np.int64).reshape(-1)
        if (counts * array.itemsize + 8 <= self._inline).all():
            return [inline[r, 8:8 + int(c) * array.itemsize].copy().view(array.dtype)  # copies: the table is reused
                    for r, c in enumerate(counts)]
        out = np.empty(int(counts.sum()), dtype=array.dtype)
        if out.size:
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            recv = [self._buffer(out)[0], (counts.tolist(), displs.tolist()), mpi_type]
            self._wait(self._comm.Iallgatherv([buf, mpi_type], recv), what)
        return np.split(out, np.cumsum(counts)[:-1].tolist())

    @collective
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the timeout)."""
        self._agree("barrier", 0, 0)  # the exchange completes only when every rank has arrived

    def close(self) -> None:
        """Free the side-channel window and the duplicated communicator; idempotent.

        Freeing is collective, so the ranks first vote on a communicator of
        their own (one bounded ``Iallreduce``): the resources are freed only
        when every rank arrives within the timeout and none of them saw a
        collective fail. Otherwise (a rank is missing or broken) nothing is
        freed and close returns; MPI_Finalize cleans up. A communicator that
        was never closed is closed this way at interpreter exit, before MPI
        is finalized (no ``UCX WARN ... mpool`` lines at exit). Every later
        call raises :class:`~distopt.errors.CommunicatorClosedError`.
        """
        if self.closed:
            return
        self.closed = True
        forget_at_exit(self)
        vote = np.array([0 if self._broken else 1], dtype=np.int32)
        try:
            self._wait(self._control.Iallreduce(MPI.IN_PLACE, [vote, MPI.INT32_T], MPI.MIN), "close")
        except CollectiveTimeoutError:
            return
        if vote[0]:
            if self._persistent is not None:
                self._persistent.Free()
            self._win.Unlock_all()
            self._win.Free()
            self._comm.Free()
            self._control.Free()
            self._halves.gather_comm.Free()

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, size={self.size}, timeout={self.timeout:g})"
