"""MPI backend on mpi4py: buffer (uppercase) calls only, every wait bounded.

Each collective is issued non-blocking (``Iallreduce``, ``Ibcast``, ...) and tested against a deadline, so a rank that
never arrives is a :class:`~distopt.errors.CollectiveTimeoutError` naming the ranks that did not arrive and the
collective each one is in (:mod:`~distopt.comm.mpi_where`), not a hang. Before the data moves, the ranks all-gather a
control block (:mod:`~distopt.comm.control`; a persistent collective, MPI 4's ``Allgather_init``), so ranks in different
calls raise :class:`~distopt.errors.CollectiveMismatchError` on every rank instead of a partial or garbled result; small
calls (up to 512 bytes per rank) carry their data in it: one collective per call.

How each dtype travels is :mod:`~distopt.comm.mpi_types` (float16 and bfloat16 sums: :mod:`~distopt.comm.mpi_half`); the
sharded collectives are in :mod:`~distopt.comm.mpi_shards`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

try:
    from mpi4py import MPI
except RuntimeError as exc:  # mpi4py 4 loads libmpi at import: "cannot load MPI library"
    raise ImportError(
        f"mpi4py cannot load an MPI library ({str(exc).splitlines()[-1]}). Install one with pip install "
        "'distopt[mpich]' (or point MPI4PY_LIBMPI at your MPI's libmpi.so), or launch without MPI: torchrun "
        "(backend 'torch'), python -m distopt.launch (backend 'shm'), or a plain single process") from exc

from ..errors import CollectiveTimeoutError
from ..launch.ranks import describe
from . import control
from .base import REDUCE_OPS, _starts, check_reduce_args
from .control import dtype_code as _dtype_code
from .lifecycle import CommunicatorState, close_at_exit, collective, forget_at_exit, timed_call
from .messages import STALLED, UNUSABLE, timeout_message, where
from .mpi_close import channel_for, next_serial
from .mpi_half import HalfQueue, HalfSum
from .mpi_shards import MpiShards
from .mpi_types import mpi_buffer, reduce_op
from .mpi_where import WhereChannel
from .staging import staged, staged_async
from .wait import Backoff, resolve_timeout, wait_until

if TYPE_CHECKING:
    from ..launch.ranks import RankInfo
    from ..launch.info import Launch

__all__ = ["MPICommunicator"]

#: Seconds a wait polls MPI without sleeping before it starts backing off.
BUSY_POLL = 0.02
_BACKOFF = Backoff(busy_s=BUSY_POLL, yield_s=BUSY_POLL, min_sleep_s=1e-5, max_sleep_s=2e-4)

def _control_exchange(comm: Any, block: np.ndarray, table: np.ndarray) -> tuple[Any, Callable[[], Any]]:
    """How the control block is all-gathered: a persistent collective (MPI 4's ``Allgather_init``: less than half the
    cost of an ``Iallgather`` per call), or an ``Iallgather`` per call on an MPI library without them.

    Returns:
        The persistent request (None without one) and a function that starts one exchange and returns its request.
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


class MPICommunicator(MpiShards, CommunicatorState):
    """Collectives over an MPI communicator (CPU NumPy arrays).

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``MPI.COMM_WORLD``), duplicated to keep distopt's traffic apart.
        timeout: deadline of one collective in seconds; default ``DISTOPT_TIMEOUT`` from the environment, else 300.

    Raises:
        ValueError: ``timeout`` (or ``DISTOPT_TIMEOUT``) is not a positive number.
        TypeError: an array that is not a NumPy array (CuPy arrays need the NCCL backend), or a dtype MPI cannot reduce.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, timeout: float | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._closing, self._close_id = channel_for(self._comm)  # close's rounds: never matched with a collective
        self._halves = HalfQueue(self._comm.Dup())  # the all-gathers of 16-bit sums, in start order
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._where = WhereChannel(self._comm)
        block, table = control.new_buffers(self.size)
        self._persistent, self._start_exchange = _control_exchange(self._comm, block, table)
        self._ctl = control.ControlBlock("mpi", self.rank, block, table, self._exchange)
        self._serial = next_serial()
        close_at_exit(self)

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[MPICommunicator, RankInfo]:
        """Join ``MPI.COMM_WORLD``; the ranks come from the launch (arguments, launcher variables) or, where it tells
        nothing, from MPI itself (node grouping; collective).

        Raises:
            ValueError: the launch's ranks disagree with MPI's (the message names the launcher's variables and the fix).
        """
        comm = cls(timeout=launch.timeout)
        info = launch.rank_info(mpi_comm=comm.raw)
        if (info.global_rank, info.world_size) == (comm.rank, comm.size):
            return comm, info
        comm.close()
        if info.source == "explicit":
            fix = "check gpu_num/gpu_per_node"
        elif info.source in ("OMPI", "MPICH"):
            fix = "start the job with the mpiexec of the MPI library mpi4py loads (pip's mpich: .venv/bin/mpiexec)"
        else:
            fix = ("under torchrun or srun without MPI support, use backend='torch' (torchrun sets MASTER_ADDR and "
                   "MASTER_PORT; under srun export them), or srun --mpi=pmix with an MPI library built for Slurm")
        raise ValueError(
            f"rank information from {describe(info, launch.env)} (rank {info.global_rank} of {info.world_size}) "
            f"disagrees with MPI (rank {comm.rank} of {comm.size}): {fix}")

    @property
    def raw(self) -> Any:
        """The underlying (duplicated) ``mpi4py.MPI.Comm``."""
        return self._comm

    def _wait(self, request: Any, what: str) -> None:
        if not self._halves.waiting and request.Test():  # the common case of a small call, cheaply
            return
        # MPI advances a non-blocking collective only inside MPI calls: poll without sleeping for
        # BUSY_POLL seconds, then back off (yielding the core to oversubscribed ranks), bounded
        def expired() -> CollectiveTimeoutError:
            self._ctl.broken = what
            return CollectiveTimeoutError(timeout_message(where("mpi", what, self.rank), self.timeout,
                                                          f"{STALLED}; {UNUSABLE}", self._where.missing(self._ctl.seq)))

        def done() -> bool:  # every wait also starts the 16-bit sums' all-gathers that are due, in order
            if self._halves.waiting:
                self._halves.drive()
            return request.Test()

        wait_until(done, time.monotonic() + self.timeout, expired, backoff=_BACKOFF)

    def _exchange(self, what: str) -> None:
        """The control block's exchange: post this call's (seq, kind) to the side channel, all-gather."""
        self._where.post(self._ctl.seq, self._ctl.kind)
        self._wait(self._start_exchange(), what)

    @staged
    @collective
    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``array`` in place across ranks; see :class:`Communicator`.

        Wire: ``array.nbytes`` per rank per direction of the MPI algorithm; float16/bfloat16 travel as 2-byte words
        (:class:`~distopt.comm.mpi_half.HalfSum`).
        """
        check_reduce_args(array, op)
        buf, mpi_type = mpi_buffer(array)
        code = _dtype_code(array.dtype) * 8 + REDUCE_OPS.index(op)
        if array.nbytes <= self._ctl.inline:
            self._ctl.agree("all_reduce", array.size, code, array)
            control.reduce_inline(self._ctl.rows(array.dtype, array.size), op, array.reshape(-1))
            return array
        what = self._ctl.agree("all_reduce", array.size, code)
        if array.size and self.size > 1:
            self._wait(self._start(array, buf, mpi_type, op), what)
        if op == "avg":
            np.divide(array, self.size, out=array)
        return array

    @staged_async
    @collective
    def all_reduce_async(self, array: np.ndarray, op: str = "sum") -> MpiHandle:
        """Start an in-place all-reduce (``Iallreduce``) and return at once.

        Unlike :meth:`all_reduce` there is no per-call agreement check (it would block); DistOpt checks its bucket
        layout across ranks before the first step instead. Every rank must start the same reductions in the same order.
        MPI may progress the reduction only inside MPI calls: call ``handle.test()`` now and then, or set
        ``MPIR_CVAR_ASYNC_PROGRESS=1`` (MPICH) for a progress thread.

        Returns:
            A handle; ``wait()`` completes the reduction (bounded) and divides by the world size for ``op="avg"``.
        """
        check_reduce_args(array, op)
        buf, mpi_type = mpi_buffer(array)
        request = self._start(array, buf, mpi_type, op) if array.size and self.size > 1 else None

        return MpiHandle(self, request, array, op)

    def _start(self, array: np.ndarray, buf: np.ndarray, mpi_type: Any, op: str) -> Any:
        """Start the in-place reduction of ``array``; a request (``Test()``)."""
        if mpi_type is MPI.UINT16_T and array.dtype != np.uint16 and op in ("sum", "avg"):
            return HalfSum(self._comm, array, self._halves)
        return self._comm.Iallreduce(MPI.IN_PLACE, [buf, mpi_type], reduce_op(array.dtype, mpi_type, op))

    @staged
    @collective
    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` with root's contents on every rank (in place)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        buf, mpi_type = mpi_buffer(array)
        code = _dtype_code(array.dtype) * 64 + root
        if array.nbytes <= self._ctl.inline:
            self._ctl.agree("broadcast", array.size, code, array if self.rank == root else None)
            array.reshape(-1)[...] = self._ctl.rows(array.dtype, array.size)[root]
            return array
        what = self._ctl.agree("broadcast", array.size, code)
        if array.size and self.size > 1:
            self._wait(self._comm.Ibcast([buf, mpi_type], root=root), what)
        return array

    @staged
    @collective
    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Gather equal-sized arrays; returns shape ``(size, *array.shape)``."""
        buf, mpi_type = mpi_buffer(array)
        out = np.empty((self.size, *array.shape), dtype=array.dtype)
        if array.nbytes <= self._ctl.inline:
            self._ctl.agree("all_gather", array.size, _dtype_code(array.dtype), array)
            out.reshape(self.size, -1)[...] = self._ctl.rows(array.dtype, array.size)
            return out
        what = self._ctl.agree("all_gather", array.size, _dtype_code(array.dtype))
        if array.size:
            self._wait(self._comm.Iallgather([buf, mpi_type], [mpi_buffer(out)[0], mpi_type]), what)
        return out

    @staged
    @collective
    def all_gather_v(self, array: np.ndarray) -> list[np.ndarray]:
        """Gather 1-D arrays of per-rank lengths (0 allowed); list of ``size`` arrays."""
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes a 1-D array, got shape {array.shape}")
        buf, mpi_type = mpi_buffer(array)
        # the block carries this rank's length, then its data if it fits (and every rank's fits)
        fits = array.nbytes + 8 <= self._ctl.inline
        mine = np.concatenate([np.array([array.size], dtype=np.int64).view(np.uint8),
                               array.view(np.uint8) if fits else np.zeros(0, np.uint8)])
        what = self._ctl.agree("all_gather_v", 0, _dtype_code(array.dtype), mine)
        inline = self._ctl.rows(np.dtype(np.uint8), self._ctl.inline)
        counts = np.ascontiguousarray(inline[:, :8]).view(np.int64).reshape(-1)
        if (counts * array.itemsize + 8 <= self._ctl.inline).all():
            return [inline[r, 8:8 + int(c) * array.itemsize].copy().view(array.dtype)  # copies: the table is reused
                    for r, c in enumerate(counts)]
        out = np.empty(int(counts.sum()), dtype=array.dtype)
        if out.size:
            recv = [mpi_buffer(out)[0], (counts.tolist(), _starts(counts.tolist())), mpi_type]
            self._wait(self._comm.Iallgatherv([buf, mpi_type], recv), what)
        return np.split(out, np.cumsum(counts)[:-1].tolist())

    @collective
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the timeout)."""
        self._ctl.agree("barrier", 0, 0)  # the exchange completes only when every rank has arrived

    @collective
    def split(self, ranks: Sequence[int]) -> MPICommunicator | None:
        """A communicator of ``ranks`` (ascending, renumbered from 0) by ``Comm_split``; None outside them.

        Collective: every rank calls it with the same ranks (:func:`distopt.comm.groups.split` checks that first).
        """
        member = self.rank in ranks
        self.barrier()  # bounded: Comm_split itself cannot time out
        sub = self._comm.Split(0 if member else MPI.UNDEFINED, list(ranks).index(self.rank) if member else 0)
        if not member:
            return None
        try:
            return MPICommunicator(sub, timeout=self.timeout)
        finally:
            sub.Free()

    def close(self) -> None:
        """Free the side-channel window and the duplicated communicators; idempotent, bounded, raises nothing.

        A close runs one round on the close channel its group's communicators share (:mod:`~distopt.comm.mpi_close`:
        freeing a window is collective, and a rank that enters it alone waits forever); a communicator whose collectives
        failed on this rank is never offered. Each wait of a round takes at most ``timeout`` seconds, so a close returns
        within ``2 * timeout`` seconds (one ``timeout`` when a peer never comes). What no round freed is freed at
        interpreter exit, right before MPI_Finalize (no ``UCX WARN ... mpool`` lines). Every later call raises
        :class:`~distopt.errors.CommunicatorClosedError`.
        """
        if self.closed:
            return
        self.closed = True
        forget_at_exit(self)
        self._closing.close(self._close_id, self._serial, self._where,
                            None if self._ctl.broken else self._release, self.timeout)

    def _release(self) -> None:
        """Free what this communicator holds (collective: a close round decided it on every rank)."""
        if self._persistent is not None:
            self._persistent.Free()
        self._where.free()
        self._comm.Free()
        self._halves.gather_comm.Free()

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, size={self.size}, timeout={self.timeout:g})"
