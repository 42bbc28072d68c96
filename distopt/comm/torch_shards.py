"""The torch backend's sharded collectives: reduce-scatter, in-place all-gather, all-to-all.

:class:`TorchShards` is a mixin of :class:`~distopt.comm.torchdist.TorchCommunicator` (it uses its control block,
process group and bounded waits). The blocking forms first agree on the call through the control block, its inline data
a CRC-32 of ``counts`` (:meth:`~distopt.comm.control.ControlBlock.agree_counts`), so ranks with different counts, dtypes
or ops raise :class:`~distopt.errors.CollectiveMismatchError` on every rank; the ``_async`` forms do not. Gathers move
any dtype (as bytes); reductions take the dtypes gloo reduces.

``reduce_scatter`` on CPU memory is one ``all_to_all_single`` with per-rank splits (no padding, no copy of ``array``):
rank r receives every rank's copy of segment r and combines them in rank order (16-bit floats in float32, rounded once;
``"avg"`` then divides in the array's dtype, as ``all_reduce`` does), since gloo's reduce-scatters cannot be bounded
(their ``Work.is_completed()`` never turns True, torch 2.13). On CUDA (NCCL) it is one ``reduce_scatter_single`` into a
new tensor, the segments padded to ``max(counts)`` elements in a zeroed ``(size, max(counts))`` copy if counts differ.

``all_gather_into`` on CPU memory is one ``broadcast`` per rank of its segment, in place: no copy, no padding, no buffer
of the whole array (gloo's all-gather fills one of its own and copies it back: 34 ms against 10 ms for 13.6 MB per rank
at W = 2). On CUDA with equal counts it is one ``all_gather_single`` in place; with unequal counts it gathers padded
copies into a new ``(size, max(counts))`` tensor and copies the segments back. ``all_to_all`` is one
``all_to_all_single`` into a new tensor.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ..core.spares import Spares
from .base import REDUCE_OPS, _starts, check_counts, check_reduce_args, check_rows
from .lifecycle import collective, timed_call
from .torch_arrays import FlatTensor, descriptor_code as _code, movable, torch_op

if TYPE_CHECKING:
    from .control import ControlBlock

__all__ = ["TorchShards", "TorchShardHandle"]

_COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}
_BOOL_COMBINE = {"sum": torch.logical_or, "max": torch.logical_or, "min": torch.logical_and,
                 "product": torch.logical_and}
#: torch's current names (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` warn FutureWarning since
#: they became ``*_single``); the old ones on a torch that lacks them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_rows(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Combine ``rows`` (shape ``(size, m)``, one per rank) in rank order into a new tensor of ``m`` elements and their
    dtype; float16 and bfloat16 accumulate in float32, rounded once; ``"avg"`` as ``"sum"`` (the caller divides)."""
    dtype = rows.dtype
    combine = _BOOL_COMBINE[op] if dtype == torch.bool else _COMBINE[op]
    wide = dtype in (torch.float16, torch.bfloat16)
    if wide:
        acc, rest = rows[0].to(torch.float32), rows[1:]
    else:  # a new tensor from the first two rows: row 0 is not copied first
        acc, rest = (combine(rows[0], rows[1]), rows[2:]) if rows.shape[0] > 1 else (rows[0].clone(), rows[1:])
    for row in rest:
        combine(acc, row.to(torch.float32) if wide else row, out=acc)
    return acc.to(dtype) if wide else acc


class _Works:
    """Several ``torch.distributed`` works waited on as one (``wait`` with one deadline for all of them)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for each work in turn, within ``timeout`` in all (None: each work's own); RuntimeError when one failed
        or the time ran out (torch's "Operation timed out!")."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self._works:
            if deadline is None or w.is_completed():
                w.wait()  # a completed work returns at once, or raises its own error
            else:
                w.wait(datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return True


class TorchShardHandle:
    """A collective in flight (see :meth:`TorchShards.reduce_scatter_async`).

    Args:
        comm: the communicator.
        work: the ``torch.distributed`` work, or None when nothing moves.
        t: the caller's array as a :class:`~distopt.comm.torch_arrays.FlatTensor`.
        finish: run once, after completion; returns the result.
        what: the call, for timeout messages.
    """

    def __init__(self, comm: "TorchShards", work: Any, t: FlatTensor, finish: Callable[[], Any], what: str) -> None:
        self._comm, self._work, self._t, self._finish, self._what = comm, work, t, finish, what
        self._result: Any = None
        self._done = False

    def test(self) -> bool:
        """True once the collective is complete (never blocks)."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> Any:
        """Complete the collective (bounded by the communicator's timeout); returns its result, the same on every call.

        Raises:
            CollectiveTimeoutError: the deadline passed, or a peer exited.
            CommunicatorClosedError: the communicator was closed meanwhile.
        """
        if self._work is not None:
            label = self._what.split(" ")[0]
            self._comm._check_open(f"{label} wait")
            timed_call(self._comm, f"distopt.{label}.wait", self._comm._complete, self._work, self._t, self._what)
            self._work = None
        if not self._done:
            self._result, self._done = self._finish(), True
            self._t = self._finish = None  # the caller's array and the receive buffer: no longer held here
        return self._result


class TorchShards:
    """The sharded collectives of :class:`~distopt.comm.torchdist.TorchCommunicator` (a mixin)."""

    rank: int
    size: int
    _group: Any
    _ctl: ControlBlock
    _complete: Callable[[Any, FlatTensor, str], None]
    _spares: Spares

    def _start_reduce_scatter(self, t: FlatTensor, counts: list[int], op: str) -> tuple[Any, Callable[[], Any]]:
        """Start the reduce-scatter of ``t``; returns its work (None: nothing moves) and the function that finishes it
        and returns this rank's segment as the caller's array type."""
        reduction = torch_op(t.flat.dtype, op)
        width, mine = max(counts), counts[self.rank]
        work, rows, kept = None, None, None
        if self.size == 1:
            out = t.flat.clone()
        elif not width:
            out = t.new(0)
        elif not t.flat.is_cuda:  # every rank's copy of my segment, reduced here (see the module docs)
            kept = self._spares.take(self.size * mine, t.flat.dtype, t.new)  # no fresh pages on every call
            out, k = kept[:self.size * mine], t.flat.element_size()
            work = dist.all_to_all_single(out.view(torch.uint8), t.flat.view(torch.uint8),
                                          output_split_sizes=[mine * k] * self.size,
                                          input_split_sizes=[c * k for c in counts], group=self._group,
                                          async_op=True)
            rows = out.reshape(self.size, mine)
        else:
            src = t.flat
            if min(counts) != width:  # pad every segment to the widest: one copy of the array
                src = t.flat.new_zeros(self.size, width)
                for r, (start, c) in enumerate(zip(_starts(counts), counts)):
                    src[r, :c] = t.flat[start:start + c]
                src = src.reshape(-1)
            out = t.new(width)
            work = _reduce_scatter_single(out, src, op=reduction, group=self._group, async_op=True)

        def finish() -> Any:
            result = out[:mine] if rows is None else _reduce_rows(rows, op)  # a new tensor from the rows
            if kept is not None:
                self._spares.give(kept)
            if op == "avg":
                result.div_(self.size)
            return t.back(result)

        return work, finish

    def _start_all_gather_into(self, t: FlatTensor, counts: list[int]) -> tuple[Any, Callable[[], Any]]:
        """Start the in-place all-gather; its work (None: nothing moves) and the function that finishes it (copying the
        padded segments back) and returns the caller's array."""
        width = max(counts)
        if self.size == 1 or not width:
            return None, lambda: t.array
        starts = _starts(counts)
        if not t.flat.is_cuda:  # gloo: each segment broadcast in place from its owner (see the module docs)
            works = [dist.broadcast(movable(t.flat[starts[r]:starts[r] + c]), group=self._group, async_op=True,
                                    src=dist.get_global_rank(self._group, r) if self._group is not None else r)
                     for r, c in enumerate(counts) if c]
            return _Works(works), lambda: t.array
        mine = t.flat[starts[self.rank]:starts[self.rank] + counts[self.rank]]
        if min(counts) == width:  # gathered straight into the caller's array, from its own segment (gloo
            inp, out = mine, t.flat  # gathers into a buffer of its own first; NCCL gathers in place)
        else:
            inp, out = t.flat.new_zeros(width), t.new(self.size * width)
            inp[:mine.numel()] = mine
        work = _all_gather_single(movable(out), movable(inp), group=self._group, async_op=True)

        def finish() -> Any:
            if out is not t.flat:
                rows = out.reshape(self.size, width)
                for r, c in enumerate(counts):
                    t.flat[starts[r]:starts[r] + c] = rows[r, :c]
            return t.array

        return work, finish

    @collective
    def reduce_scatter(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Any:
        """Reduce-scatter; see :meth:`distopt.comm.base.Communicator.reduce_scatter`.

        Returns a new array (the caller's type) of ``counts[rank]`` elements; ``array`` is left unchanged (on CUDA,
        unequal counts pad a copy of it; see the module docs).

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: unsupported array type or dtype, non-contiguous, integer ``avg``.
            CollectiveMismatchError: ranks passed different counts, element counts, dtypes or ops (on every rank).
            CollectiveTimeoutError: the deadline passed or a peer exited.
        """
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        t = FlatTensor(array)
        torch_op(t.flat.dtype, op)  # the dtype check, before any communication
        what = self._ctl.agree_counts("reduce_scatter", t.flat.numel(), _code(t, REDUCE_OPS.index(op)), counts)
        work, finish = self._start_reduce_scatter(t, counts, op)
        if work is not None:
            self._complete(work, t, what)
        return finish()

    @collective
    def reduce_scatter_async(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum"
                             ) -> TorchShardHandle:
        """Start a reduce-scatter and return at once; no per-call agreement check (as :meth:`all_reduce_async`): every
        rank must start the same calls in the same order.

        Returns:
            A handle: ``test()``, and ``wait()`` (bounded, callable twice) returning what :meth:`reduce_scatter`
            returns.

        Raises:
            ValueError, TypeError: as :meth:`reduce_scatter`, before anything moves.
        """
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        t = FlatTensor(array)
        work, finish = self._start_reduce_scatter(t, counts, op)
        return TorchShardHandle(self, work, t, finish, f"reduce_scatter_async of {t.flat.numel()} elements")

    @collective
    def all_gather_into(self, array: Any, counts: Sequence[int] | None = None) -> Any:
        """In-place all-gather of any dtype; see :meth:`distopt.comm.base.Communicator.all_gather_into`; returns
        ``array``.

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: unsupported array type or dtype, or non-contiguous.
            CollectiveMismatchError: element counts, dtypes or counts differ (on every rank).
            CollectiveTimeoutError: the deadline passed.
        """
        counts = check_counts(array, counts, self.size)
        t = FlatTensor(array)
        what = self._ctl.agree_counts("all_gather_into", t.flat.numel(), _code(t, 0), counts)
        work, finish = self._start_all_gather_into(t, counts)
        if work is not None:
            self._complete(work, t, what)
        return finish()

    @collective
    def all_gather_into_async(self, array: Any, counts: Sequence[int] | None = None) -> TorchShardHandle:
        """Start an in-place all-gather and return at once (no agreement check).

        Returns:
            A handle whose ``wait()`` returns ``array``.

        Raises:
            ValueError, TypeError: as :meth:`all_gather_into`, before anything moves.
        """
        counts = check_counts(array, counts, self.size)
        t = FlatTensor(array)
        work, finish = self._start_all_gather_into(t, counts)
        return TorchShardHandle(self, work, t, finish, f"all_gather_into_async of {t.flat.numel()} elements")

    @collective
    def all_to_all(self, array: Any) -> Any:
        """Row j of ``array`` to rank j (``all_to_all_single``); see :meth:`distopt.comm.base.Communicator.all_to_all`.

        Returns:
            A new array (the caller's type) of ``array``'s shape; row i is rank i's row ``rank``.

        Raises:
            ValueError: ``array.shape[0] != size``.
            TypeError: unsupported array type, non-contiguous.
            CollectiveMismatchError: element counts or dtypes differ.
            CollectiveTimeoutError: the deadline passed or a peer exited.
        """
        check_rows(array, self.size)
        t = FlatTensor(array)
        out = t.new(t.flat.numel())
        what = self._ctl.agree("all_to_all", t.flat.numel(), _code(t, 0))
        if self.size == 1:
            out.copy_(t.flat)
        elif t.flat.numel():
            self._complete(dist.all_to_all_single(movable(out), movable(t.flat), group=self._group,
                                                  async_op=True), t, what)
        return t.back(out.reshape(tuple(array.shape)))
