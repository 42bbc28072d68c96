"""NCCL backend through CuPy (``cupy.cuda.nccl``), for CuPy arrays on GPUs.

Stream order: every collective runs on the communicator's own CUDA stream,
which first waits (``cudaStreamWaitEvent``) for an event recorded on the
caller's current stream, so the kernels that filled the buffer finish
before NCCL reads it (ChainerMN PR 201); the caller's
current stream then waits for the collective, so later kernels see the
result. No host synchronisation happens except where a count must reach
the host (``all_gather_v``).

The sharded collectives (reduce-scatter, in-place all-gather, all-to-all,
with ``_async`` forms) are in :mod:`~distopt.comm.nccl_shards`, the dtype and
reduction names in :mod:`~distopt.comm.nccl_types`.

Unlike the MPI backend, calls are not pre-checked for matching counts and
dtypes across ranks (that would cost a host round trip per call); DistOpt
checks its bucket layout across ranks once per layout instead. NCCL refuses
two ranks on one GPU ("Duplicate GPU detected").
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    import cupy
    from cupy.cuda import nccl
except ImportError as exc:  # turned into BackendUnavailableError by distopt.comm.create
    raise ImportError(f"the NCCL backend needs CuPy with NCCL: {exc}") from exc

from ..errors import CollectiveTimeoutError, DistOptError
from ..launch.devices import device_index
from .base import check_reduce_args
from .lifecycle import CommunicatorState, Completed, collective
from .messages import STALLED, failure_message, timeout_message, where
from .nccl_shards import NcclShards
from .nccl_types import nccl_dtype, nccl_op
from .wait import Backoff, resolve_timeout, wait_until

if TYPE_CHECKING:
    from ..launch.ranks import RankInfo
    from ..launch.info import Launch

_BACKOFF = Backoff(busy_s=0.0, yield_s=0.0, min_sleep_s=1e-5, max_sleep_s=1e-3)

__all__ = ["NcclCommunicator", "unique_id_from_mpi", "new_unique_id"]

def new_unique_id() -> tuple[int, ...]:
    """A fresh NCCL unique id (128 ints), the job's "ticket"."""
    return tuple(int(v) for v in nccl.get_unique_id())


def _open(size: int, unique_id: Any, rank: int) -> Any:
    """``ncclCommInitRank`` through CuPy, whose id type changed: bytes (CuPy 14) or 128 signed ints (13)."""
    ints = [int(v) for v in unique_id]
    try:
        return nccl.NcclCommunicator(size, bytes(v % 256 for v in ints), rank)
    except TypeError:
        return nccl.NcclCommunicator(size, tuple(v - 256 if v > 127 else v for v in ints), rank)


def unique_id_from_mpi(mpi: Any) -> tuple[int, ...]:
    """Rank 0 creates the NCCL unique id and MPI broadcasts it (an int64 buffer)."""
    buf = np.zeros(128, dtype=np.int64)
    if mpi.rank == 0:
        buf[:] = new_unique_id()
    mpi.broadcast(buf, root=0)
    return tuple(int(v) for v in buf)


class NcclCommunicator(NcclShards, CommunicatorState):
    """Collectives on CuPy arrays over one NCCL communicator.

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: world size.
        unique_id: the NCCL unique id shared by all ranks (see
            :func:`new_unique_id`, :class:`distopt.nccl_id.NcclIdHolder`).
        device: CUDA device index (relative to ``CUDA_VISIBLE_DEVICES``).
        control: a host communicator of the same ranks (MPI or shared
            memory) for collectives on NumPy arrays (DistOpt's step header
            and flags): they then never wait on the device, so a
            steady-state plain or half step synchronises the host zero
            times (``host_syncs`` stays put). Without it they are staged
            through the device, one host wait each. Closed with this one.
        timeout: deadline in seconds of every host-side wait (default
            ``$DISTOPT_TIMEOUT`` or 300). Device-side, collectives are only
            enqueued; wherever the host waits for one (host arrays, counts,
            ``barrier``, ``close``) it polls a CUDA event and NCCL's
            asynchronous error, and on an error or the deadline it aborts the
            NCCL communicator (``ncclCommAbort``) so that no kernel stays
            blocked, then raises.
    """

    name = "nccl"

    def __init__(self, rank: int, size: int, unique_id: Any, device: int = 0,
                 timeout: float | None = None, control: Any = None) -> None:
        if unique_id is None:
            raise ValueError("unique_id is required for the NCCL backend (an NcclIdHolder carrying an NCCL id)")
        self.rank = int(rank)
        self.size = int(size)
        if control is not None and (control.rank, control.size) != (self.rank, self.size):
            raise ValueError(f"control communicator is rank {control.rank} of {control.size}, "
                             f"the NCCL one rank {self.rank} of {self.size}")
        self.control = control
        self.host_syncs = 0  # host waits on the device (see the class docs)
        self.timeout = resolve_timeout(timeout)
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self._comm = _open(self.size, unique_id, self.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[NcclCommunicator, RankInfo]:
        """Build it with its host control plane: in the multiprocessing mode shared memory and the
        holder's NCCL id, else MPI (ranks from MPI, rank 0's new NCCL id broadcast over it).

        Raises:
            BackendUnavailableError: MPI is needed but cannot be imported.
            ValueError: as the control plane's ``from_launch``, or a holder without an NCCL id.
        """
        from . import backend_class

        if launch.holder is not None:
            control, info = backend_class("shm").from_launch(launch)
            unique_id = launch.holder.nccl_id
        else:
            control, info = backend_class("mpi").from_launch(launch)
            unique_id = unique_id_from_mpi(control)
        device = device_index(info.local_rank, launch.env, local_size=info.local_size)
        return cls(info.global_rank, info.world_size, unique_id, device, launch.timeout, control), info

    def _host_wait(self, what: str) -> None:
        """Wait on the host until the caller's stream has passed the last collective, bounded.

        Raises:
            DistOptError: NCCL reported an asynchronous error (the
                communicator is aborted).
            CollectiveTimeoutError: the deadline passed (the communicator is
                aborted, so no rank stays blocked in a kernel).
        """
        self.host_syncs += 1
        done = cupy.cuda.get_current_stream().record()

        def check() -> None:
            try:
                self._comm.check_async_error()
            except nccl.NcclError as exc:
                self._abort()
                raise DistOptError(failure_message(where("nccl", what, self.rank), f"NCCL error {exc}",
                                                   "communicator aborted")) from exc

        def expired() -> CollectiveTimeoutError:
            self._abort()
            return CollectiveTimeoutError(timeout_message(where("nccl", what, self.rank), self.timeout,
                                                          f"{STALLED}; NCCL communicator aborted"))

        wait_until(lambda: done.done, time.monotonic() + self.timeout, expired, backoff=_BACKOFF, check=check,
                   check_every_s=0.0)

    def _abort(self) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None

    def _run(self, fn: Any) -> None:
        """Run ``fn(stream_ptr)`` on the comm stream, ordered after and before the caller's stream."""
        caller = cupy.cuda.get_current_stream()
        ready = caller.record()
        self._stream.wait_event(ready)
        fn(self._stream.ptr)
        caller.wait_event(self._stream.record())

    def _host_call(self, name: str, array: np.ndarray, *args: Any) -> Any:
        """A sharded collective on a NumPy array: by the control communicator, else staged through the
        device (one host wait); the result on the host (``all_gather_into``: written into ``array``)."""
        if self.control is not None:
            return getattr(self.control, name)(array, *args)
        staged = getattr(self, name)(cupy.asarray(array), *args)
        self._host_wait(f"{name} of {array.size} host elements")
        if name == "all_gather_into":
            array[...] = staged.get()
            return array
        return staged.get()

    @collective
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """In-place all-reduce on the comm stream; see :class:`~distopt.comm.base.Communicator`.

        A NumPy array (DistOpt's small control buffers: flags, metrics) is
        staged through the device and copied back, synchronously.
        """
        if isinstance(array, np.ndarray) and self.control is not None:
            return self.control.all_reduce(array, op)
        if isinstance(array, np.ndarray):
            staged = self.all_reduce(cupy.asarray(array), op)
            self._host_wait(f"all_reduce of {array.size} host elements")
            array[...] = staged.get()
            return array
        check_reduce_args(array, op)
        dtype = nccl_dtype(array)
        reduction = nccl_op(array, op)
        if array.size:
            self._run(lambda s: self._comm.allReduce(array.data.ptr, array.data.ptr, array.size, dtype, reduction, s))
        if op == "avg":
            array /= self.size
        return array

    @collective
    def all_reduce_async(self, array: Any, op: str = "sum") -> Completed:
        """Enqueue the all-reduce on the comm stream and return at once.

        The host never blocks: the caller's current stream already waits for
        the result, so ``wait()`` only returns the array.
        """
        return Completed(self.all_reduce(array, op))

    @collective
    def broadcast(self, array: Any, root: int = 0) -> Any:
        """In-place broadcast from ``root`` on the comm stream (NumPy arrays staged, synchronously)."""
        if isinstance(array, np.ndarray) and self.control is not None:
            return self.control.broadcast(array, root)
        if isinstance(array, np.ndarray):
            staged = self.broadcast(cupy.asarray(array), root)
            self._host_wait(f"broadcast of {array.size} host elements")
            array[...] = staged.get()
            return array
        dtype = nccl_dtype(array)
        if array.size:
            self._run(lambda s: self._comm.bcast(array.data.ptr, array.size, dtype, root, s))
        return array

    @collective
    def all_gather(self, array: Any) -> Any:
        """Equal-size all-gather; returns a new array of shape ``(size, *array.shape)`` (NumPy in, NumPy out)."""
        if isinstance(array, np.ndarray) and self.control is not None:
            return self.control.all_gather(array)
        if isinstance(array, np.ndarray):
            staged = self.all_gather(cupy.asarray(array))
            self._host_wait(f"all_gather of {array.size} host elements")
            return staged.get()
        dtype = nccl_dtype(array)
        src = cupy.ascontiguousarray(array)
        out = cupy.empty((self.size, *array.shape), dtype=array.dtype)
        if array.size:
            self._run(lambda s: self._comm.allGather(src.data.ptr, out.data.ptr, src.size, dtype, s))
        return out

    @collective
    def all_gather_v(self, array: Any) -> list[Any]:
        """Variable-length all-gather of 1-D arrays: counts first (one host sync), then padded data."""
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes a 1-D array, got shape {array.shape}")
        if isinstance(array, np.ndarray) and self.control is not None:
            return self.control.all_gather_v(array)
        if isinstance(array, np.ndarray):
            return [part.get() for part in self.all_gather_v(cupy.asarray(array))]
        counts = self.all_gather(np.array([array.size], dtype=np.int64)).reshape(-1)
        padded = cupy.zeros(int(counts.max(initial=0)), dtype=array.dtype)
        padded[:array.size] = array
        gathered = self.all_gather(padded)
        return [gathered[r, :int(c)] for r, c in enumerate(counts)]

    @collective
    def barrier(self) -> None:
        """All-reduce one element and wait for it on the host."""
        self.all_reduce(cupy.zeros(1, dtype=cupy.float32))
        self._host_wait("barrier")

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent); a pending collective is waited for, bounded.

        Every later call raises :class:`~distopt.errors.CommunicatorClosedError`.
        """
        if self.closed:
            return
        self.closed = True
        if self._comm is not None:
            self._host_wait("close")
            self._comm.destroy()
            self._comm = None
        if self.control is not None:
            self.control.close()
