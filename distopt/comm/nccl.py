"""NCCL backend through CuPy (``cupy.cuda.nccl``), for CuPy arrays on GPUs.

Stream order: every collective runs on the communicator's own CUDA stream, which first waits (``cudaStreamWaitEvent``)
for an event recorded on the caller's current stream, so the kernels that filled the buffer finish before NCCL reads it
(ChainerMN PR 201); the caller's current stream then waits for the collective, so later kernels see the result. The host
synchronises only where a count must reach it (``all_gather_v``).

Set-up: rank 0 makes the NCCL unique id of each communicator (an id serves one ``ncclCommInitRank`` round only) and
broadcasts it over the host control plane (MPI or shared memory), whose barrier right before the init turns a missing
rank into a bounded :class:`~distopt.errors.CollectiveTimeoutError` instead of an init that blocks for good. NCCL
refuses two ranks on one GPU ("Duplicate GPU detected").

Each call runs with the communicator's device current, so a call from another host thread allocates its temporaries on
the right GPU. After an abort (an NCCL error or a host wait past its deadline) every call raises
:class:`~distopt.errors.DistOptError`. Calls are not checked for matching counts and dtypes across ranks (a host round
trip per call); DistOpt checks its bucket layout across ranks once per layout instead. The sharded collectives are in
:mod:`~distopt.comm.nccl_shards`, the dtype and reduction names in :mod:`~distopt.comm.nccl_types`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import CollectiveTimeoutError, DistOptError
from ..launch.devices import device_index
from .base import _check_contiguous, check_reduce_args
from .lifecycle import CommunicatorState, Completed, collective
from .messages import STALLED, failure_message, timeout_message, where
from .nccl_shards import NcclShards, on_device
from .nccl_types import cupy, nccl, nccl_dtype, nccl_op
from .wait import Backoff, resolve_timeout, wait_until

if TYPE_CHECKING:
    from ..launch.info import Launch
    from ..launch.ranks import RankInfo

_BACKOFF = Backoff(busy_s=0.0, yield_s=0.0, min_sleep_s=1e-5, max_sleep_s=1e-3)

__all__ = ["NcclCommunicator", "unique_id_from", "new_unique_id", "on_device"]


def new_unique_id() -> tuple[int, ...]:
    """A fresh NCCL unique id as 128 ints (``bytes`` in CuPy 14 give 0..255, C ``char`` in CuPy 13 gives -128..127 on
    x86-64 and 0..255 on aarch64). It starts NCCL's bootstrap root in this process and serves ONE communicator."""
    return tuple(int(v) for v in nccl.get_unique_id())


def _open(size: int, unique_id: Any, rank: int) -> Any:
    """``ncclCommInitRank`` through CuPy, whose id type changed: ``bytes`` (CuPy 14), or a tuple of C ``char`` (CuPy 13:
    signed on x86-64, unsigned on aarch64, where a negative value is OverflowError)."""
    ints = [int(v) for v in unique_id]
    forms = (bytes(v % 256 for v in ints), tuple(v - 256 if v > 127 else v for v in ints),
             tuple(v % 256 for v in ints))
    for form in forms[:-1]:
        try:
            return nccl.NcclCommunicator(size, form, rank)
        except (TypeError, OverflowError):
            continue
    return nccl.NcclCommunicator(size, forms[-1], rank)


def unique_id_from(control: Any) -> tuple[int, ...]:
    """Rank 0 of ``control`` (a host communicator: MPI, shared memory) makes a fresh NCCL unique id and broadcasts it
    (an int64 buffer of 128 elements); every rank returns it."""
    buf = np.zeros(128, dtype=np.int64)
    if control.rank == 0:
        buf[:] = new_unique_id()
    control.broadcast(buf, root=0)
    return tuple(int(v) for v in buf)


class NcclCommunicator(NcclShards, CommunicatorState):
    """Collectives on CuPy arrays over one NCCL communicator.

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: world size.
        unique_id: an NCCL unique id (see :func:`new_unique_id`) that no other communicator used, or None to have rank 0
            of ``control`` make one and broadcast it (:func:`unique_id_from`).
        device: CUDA device index (relative to ``CUDA_VISIBLE_DEVICES``), current in the constructing thread and every
            call.
        control: a host communicator of the same ranks (MPI or shared memory) for collectives on NumPy arrays (DistOpt's
            step header and flags), which then never wait on the device (``host_syncs`` stays put); without it they are
            staged through the device, one host wait each. Closed with this one, also when the set-up fails.
        timeout: deadline in seconds of every host-side wait (default ``$DISTOPT_TIMEOUT`` or 300): where the host waits
            for a collective (host arrays, counts, ``barrier``, ``close``) it polls a CUDA event and NCCL's asynchronous
            error, and on an error or the deadline aborts the communicator (``ncclCommAbort``: no kernel stays blocked).

    Raises:
        ValueError: no ``unique_id`` and no ``control``; a control communicator of other ranks.
        CollectiveTimeoutError: a rank did not reach the set-up (control plane's deadline).
        cupy.cuda.nccl.NcclError: NCCL refused the set-up (for example two ranks on one GPU).
    """

    name = "nccl"

    def __init__(self, rank: int, size: int, unique_id: Any = None, device: int = 0,
                 timeout: float | None = None, control: Any = None) -> None:
        self.rank, self.size = int(rank), int(size)
        self.control, self._comm, self._broken = control, None, ""
        try:
            if unique_id is None and control is None:
                raise ValueError("the NCCL backend needs unique_id or a control communicator to agree on one")
            if control is not None and (control.rank, control.size) != (self.rank, self.size):
                raise ValueError(f"control communicator is rank {control.rank} of {control.size}, "
                                 f"the NCCL one rank {self.rank} of {self.size}")
            self.host_syncs = 0  # host waits on the device (see the class docs)
            self.timeout = resolve_timeout(timeout)
            self.device = cupy.cuda.Device(device)
            self.device.use()  # this thread's arrays land on the rank's GPU, as with SINGA's DistOpt
            with self.device:
                if unique_id is None:
                    unique_id = unique_id_from(control)
                if control is not None:
                    control.barrier()  # every rank is here: the init below cannot wait for a dead one
                self._comm = _open(self.size, unique_id, self.rank)
                self._stream = cupy.cuda.Stream(non_blocking=True)
                self._ready, self._finished, self._host_event = (cupy.cuda.Event(disable_timing=True) for _ in range(3))
        except BaseException:
            if control is not None:
                control.close()
            raise

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[NcclCommunicator, RankInfo]:
        """Build it with its host control plane (shared memory in the multiprocessing mode, else MPI), the NCCL id
        broadcast over it.

        Raises:
            BackendUnavailableError: MPI is needed but cannot be imported.
            ValueError: as the control plane's ``from_launch``, or more processes on the node than visible devices.
        """
        from . import backend_class

        count = cupy.cuda.runtime.getDeviceCount()
        if launch.holder is not None and count < int(launch.gpu_per_node):  # the spawned processes see the
            # same devices: every rank fails alike, before any rendezvous
            raise ValueError(f"backend='nccl' with {launch.gpu_per_node} processes but {count} visible CUDA "
                             f"device{'s' if count != 1 else ''}: NCCL needs a device per process ('Duplicate GPU "
                             f"detected'); leave backend unset to share the GPUs over shared memory, or start at "
                             f"most {count} processes")
        control, info = backend_class("shm" if launch.holder is not None else "mpi").from_launch(launch)
        try:
            device = device_index(info.local_rank, launch.env, device_count=count, local_size=info.local_size)
        except BaseException:
            control.close()
            raise
        return cls(info.global_rank, info.world_size, None, device, launch.timeout, control), info

    def _check_live(self, call: str) -> None:
        if self._broken:
            raise DistOptError(f"{call} on rank {self.rank}: the NCCL communicator was aborted ({self._broken}) "
                               "and cannot be used again; build a new one")

    def _host_wait(self, what: str) -> None:
        """Wait on the host until the caller's stream has passed the last collective, bounded.

        Raises:
            DistOptError: NCCL reported an asynchronous error (the communicator is aborted).
            CollectiveTimeoutError: the deadline passed (aborted, so no rank stays blocked in a kernel).
        """
        self.host_syncs += 1
        done = self._host_event
        done.record(cupy.cuda.get_current_stream())

        def check() -> None:
            try:
                self._comm.check_async_error()
            except nccl.NcclError as exc:
                self._abort(f"NCCL error {exc} in {what}")
                raise DistOptError(failure_message(where("nccl", what, self.rank), f"NCCL error {exc}",
                                                   "communicator aborted")) from exc

        def expired() -> CollectiveTimeoutError:
            self._abort(f"{what} past its {self.timeout} s deadline")
            return CollectiveTimeoutError(timeout_message(where("nccl", what, self.rank), self.timeout,
                                                          f"{STALLED}; NCCL communicator aborted"))

        wait_until(lambda: done.done, time.monotonic() + self.timeout, expired, backoff=_BACKOFF, check=check,
                   check_every_s=0.0)
        check()  # an error NCCL reported although the stream went on

    def _abort(self, reason: str) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None
        self._broken = reason

    def _run(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(stream_ptr)`` on the comm stream, ordered after and before the caller's stream."""
        caller = cupy.cuda.get_current_stream()
        self._ready.record(caller)
        self._stream.wait_event(self._ready)
        fn(self._stream.ptr)
        self._finished.record(self._stream)
        caller.wait_event(self._finished)

    def _host_call(self, name: str, array: np.ndarray, *args: Any) -> Any:
        """Collective ``name`` on a NumPy array: by the control communicator, else staged through the device (one host
        wait); the result on the host (the in-place collectives: written into ``array``)."""
        if self.control is not None:
            return getattr(self.control, name)(array, *args)
        staged = getattr(self, name)(cupy.asarray(array), *args)
        self._host_wait(f"{name} of {array.size} host elements")
        if name in ("all_reduce", "broadcast", "all_gather_into"):
            array[...] = staged.get()
            return array
        return staged.get()

    @collective
    @on_device
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """In-place all-reduce on the comm stream; see :class:`~distopt.comm.base.Communicator`.

        A NumPy array (DistOpt's small control buffers: flags, metrics) goes over the control communicator, or without
        one is staged through the device and copied back, synchronously.
        """
        if isinstance(array, np.ndarray):
            return self._host_call("all_reduce", array, op)
        check_reduce_args(array, op)
        dtype, reduction = nccl_dtype(array), nccl_op(array, op)
        if array.size:
            self._run(lambda s: self._comm.allReduce(array.data.ptr, array.data.ptr, array.size, dtype, reduction, s))
        if op == "avg":
            array /= self.size
        return array

    @collective
    def all_reduce_async(self, array: Any, op: str = "sum") -> Completed:
        """Enqueue the all-reduce on the comm stream and return at once.

        The host never blocks: the caller's current stream already waits for the result; ``wait()`` returns the array.
        """
        return Completed(self.all_reduce(array, op))

    @collective
    @on_device
    def broadcast(self, array: Any, root: int = 0) -> Any:
        """In-place broadcast from ``root`` on the comm stream (NumPy arrays: as in :meth:`all_reduce`).

        Raises:
            TypeError: ``array`` is not C-contiguous (NCCL reads ``size`` elements from its first one).
        """
        if isinstance(array, np.ndarray):
            return self._host_call("broadcast", array, root)
        _check_contiguous(array)
        dtype = nccl_dtype(array)
        if array.size:
            self._run(lambda s: self._comm.bcast(array.data.ptr, array.size, dtype, root, s))
        return array

    @collective
    @on_device
    def all_gather(self, array: Any) -> Any:
        """Equal-size all-gather; returns a new array of shape ``(size, *array.shape)`` (NumPy in, NumPy out)."""
        if isinstance(array, np.ndarray):
            return self._host_call("all_gather", array)
        dtype = nccl_dtype(array)
        src = cupy.ascontiguousarray(array)
        out = cupy.empty((self.size, *array.shape), dtype=array.dtype)
        if array.size:
            self._run(lambda s: self._comm.allGather(src.data.ptr, out.data.ptr, src.size, dtype, s))
        return out

    @collective
    @on_device
    def all_gather_v(self, array: Any) -> list[Any]:
        """All-gather of 1-D arrays of per-rank lengths: counts first (control plane, or one host sync), then padded
        data."""
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
    @on_device
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
        try:
            if self._comm is not None:
                with self.device:
                    self._host_wait("close")
                    self._comm.destroy()
                self._comm = None
        finally:
            if self.control is not None:
                self.control.close()
