"""The NCCL backend's sharded collectives: reduce-scatter, in-place all-gather, all-to-all.

:class:`NcclShards` is a mixin of :class:`~distopt.comm.nccl.NcclCommunicator` (it uses the communicator's NCCL
communicator, its stream-ordered ``_run`` and the host path ``_host_call`` for NumPy arrays). ``reduce_scatter`` is
``ncclReduceScatter`` into a new array (``array`` is left unchanged), ``all_gather_into`` an in-place ``ncclAllGather``,
``all_to_all`` grouped ``ncclSend``/``ncclRecv`` into a new array. With unequal counts each segment is padded to
``max(counts)`` in a zeroed ``(size, max(counts))`` copy (the gather copies back). The ``_async`` forms return completed
handles: the work is already ordered on the caller's stream. There is no cross-rank agreement check (see
:mod:`~distopt.comm.nccl`). A failing send or receive inside the group still ends the group (``groupEnd`` in
``finally``), so the thread's later NCCL calls are not left collected forever.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .base import _starts, check_counts, check_reduce_args, check_rows
from .lifecycle import Completed, collective
from .nccl_types import cupy, nccl, nccl_dtype, nccl_op

__all__ = ["NcclShards", "on_device"]

F = TypeVar("F", bound=Callable[..., Any])


def on_device(method: F) -> F:
    """Run a communicator method with the communicator's device current (CuPy's current device is per host thread),
    after checking that the communicator was not aborted."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_live(method.__name__)
        with self.device:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class NcclShards:
    """The sharded collectives of :class:`~distopt.comm.nccl.NcclCommunicator` (see the module docs)."""

    rank: int
    size: int
    _comm: Any  # the NCCL communicator
    _run: Callable[[Callable[[int], None]], None]  # runs fn(stream) ordered after and before the caller's stream
    _host_call: Callable[..., Any]  # a sharded collective on a NumPy array (the control communicator's)
    device: Any  # the CUDA device (cupy.cuda.Device)
    _check_live: Callable[[str], None]  # raises once the communicator was aborted

    @collective
    @on_device
    def reduce_scatter(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Any:
        """Reduce-scatter on the comm stream into a new array of ``counts[rank]`` elements; ``array`` is left unchanged.
        See :meth:`distopt.comm.base.Communicator.reduce_scatter` (no cross-rank agreement check, see the module docs)
        and, for unequal counts, the padding above."""
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        if isinstance(array, np.ndarray):
            return self._host_call("reduce_scatter", array, counts, op)
        dtype, reduction = nccl_dtype(array), nccl_op(array, op)
        width = max(counts)
        out = cupy.empty(width, dtype=array.dtype)
        src = array
        if min(counts) != width:
            src = cupy.zeros((self.size, width), dtype=array.dtype)
            for r, (start, c) in enumerate(zip(_starts(counts), counts)):
                src[r, :c] = array[start:start + c]
        if width:
            self._run(lambda s: self._comm.reduceScatter(src.data.ptr, out.data.ptr, width, dtype, reduction, s))
        out = out[:counts[self.rank]]
        if op == "avg":
            out /= self.size
        return out

    @collective
    def reduce_scatter_async(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Completed:
        """:meth:`reduce_scatter`, already ordered on the caller's stream: a completed handle."""
        return Completed(self.reduce_scatter(array, counts, op))

    @collective
    @on_device
    def all_gather_into(self, array: Any, counts: Sequence[int] | None = None) -> Any:
        """In-place all-gather of per-rank segments on the comm stream; returns ``array``. See
        :meth:`distopt.comm.base.Communicator.all_gather_into` and, for unequal counts, the padding above."""
        counts = check_counts(array, counts, self.size)
        if isinstance(array, np.ndarray):
            return self._host_call("all_gather_into", array, counts)
        dtype, width = nccl_dtype(array), max(counts)
        starts, mine = _starts(counts), counts[self.rank]
        if not width:
            return array
        if min(counts) == width:  # NCCL's in-place form: the send buffer is this rank's slot of the output
            send = array.data.ptr + starts[self.rank] * array.itemsize
            self._run(lambda s: self._comm.allGather(send, array.data.ptr, width, dtype, s))
            return array
        src = cupy.zeros(width, dtype=array.dtype)
        src[:mine] = array[starts[self.rank]:starts[self.rank] + mine]
        out = cupy.empty((self.size, width), dtype=array.dtype)
        self._run(lambda s: self._comm.allGather(src.data.ptr, out.data.ptr, width, dtype, s))
        for r, (start, c) in enumerate(zip(starts, counts)):
            array[start:start + c] = out[r, :c]
        return array

    @collective
    def all_gather_into_async(self, array: Any, counts: Sequence[int] | None = None) -> Completed:
        """:meth:`all_gather_into`, already ordered on the caller's stream: a completed handle."""
        return Completed(self.all_gather_into(array, counts))

    @collective
    @on_device
    def all_to_all(self, array: Any) -> Any:
        """Row j of ``array`` to rank j by grouped send/receive on the comm stream; a new array of ``array``'s shape
        (NumPy in, NumPy out). See :meth:`distopt.comm.base.Communicator.all_to_all`."""
        check_rows(array, self.size)
        if isinstance(array, np.ndarray):
            return self._host_call("all_to_all", array)
        dtype = nccl_dtype(array)
        out = cupy.empty_like(array)
        k = array.size // self.size

        def exchange(stream: int) -> None:
            nccl.groupStart()
            try:
                for p in range(self.size):
                    offset = p * k * array.itemsize
                    self._comm.send(array.data.ptr + offset, k, dtype, p, stream)
                    self._comm.recv(out.data.ptr + offset, k, dtype, p, stream)
            finally:
                nccl.groupEnd()

        if k:
            self._run(exchange)
        return out
