"""The MPI backend's sharded collectives: reduce-scatter, in-place all-gather, all-to-all (even and uneven).

:class:`MpiShards` is a mixin of :class:`~distopt.comm.mpi.MPICommunicator` (it uses the communicator's control block
and bounded waits; buffers and datatypes come from :mod:`~distopt.comm.mpi_types`). ``reduce_scatter`` is
``Ireduce_scatter`` with the per-rank counts into a new array (``array`` is left unchanged), ``all_gather_into`` an
in-place ``Iallgatherv`` (``MPI.IN_PLACE``), ``all_to_all`` an ``Ialltoall`` and ``all_to_all_v`` an ``Ialltoallv``
into a new array. The blocking forms first agree on the call through the control block, its inline data carrying a
CRC-32 of ``counts`` (:func:`~distopt.comm.base.counts_digest`), so ranks with different counts, dtypes or ops raise
:class:`~distopt.errors.CollectiveMismatchError` on every rank; the ``_async`` forms do not (as ``all_reduce_async``).

float16 and bfloat16 sums (and averages) go as in :mod:`~distopt.comm.mpi_half`: rank r receives every rank's copy of
its segment as 16-bit words (``Ialltoallv``) and adds them in float32 in rank order, rounded once; max and min use its
user-defined operations in ``Ireduce_scatter``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from mpi4py import MPI

from ..core._array import is_cupy
from ..core._fastcast import sum_rows
from .base import REDUCE_OPS, _starts, check_counts, check_reduce_args, check_rows
from .control import dtype_code
from .lifecycle import Completed, collective, timed_call
from .mpi_types import mpi_buffer, reduce_op
from .staging import staged
from .uneven import check_matrix, received

if TYPE_CHECKING:
    from .control import ControlBlock

__all__ = ["MpiShards", "MpiShardHandle"]


class MpiShardHandle:
    """A collective in flight (see :meth:`MpiShards.reduce_scatter_async`).

    Args:
        comm: the communicator.
        request: the MPI request (``Test()``), or None when nothing moves.
        finish: run once, after completion; returns the result.
        what: the call, for timeout messages (``"reduce_scatter_async of 10 elements"``).
    """

    def __init__(self, comm: "MpiShards", request: Any, finish: Callable[[], Any], what: str) -> None:
        self._comm, self._request, self._finish, self._what = comm, request, finish, what
        self._result: Any = None
        self._done = False

    def test(self) -> bool:
        """Drive MPI progress; True once the collective is complete (never blocks)."""
        return self._request is None or bool(self._request.Test())

    def wait(self) -> Any:
        """Complete the collective (bounded by the communicator's timeout); returns its result, the same on every call.

        Raises:
            CollectiveTimeoutError: the deadline passed (naming the ranks that did not arrive).
            CommunicatorClosedError: the communicator was closed meanwhile.
        """
        if self._request is not None:
            label = self._what.split(" ")[0]
            self._comm._check_open(f"{label} wait")
            timed_call(self._comm, f"distopt.{label}.wait", self._comm._wait, self._request, self._what)
            self._request = None
        if not self._done:
            self._result, self._done = self._finish(), True
            self._finish = None  # its buffers: no longer held here
        return self._result


class MpiShards:
    """The sharded collectives of :class:`~distopt.comm.mpi.MPICommunicator` (a mixin)."""

    rank: int
    size: int
    _comm: Any
    _ctl: ControlBlock
    _wait: Callable[[Any, str], None]

    def _start_reduce_scatter(self, array: np.ndarray, counts: list[int], op: str
                              ) -> tuple[Any, Callable[[], np.ndarray]]:
        """Start the reduce-scatter: its request (None: nothing moves) and the function returning this rank's
        segment."""
        buf, mpi_type = mpi_buffer(array)
        mine = counts[self.rank]
        out = np.empty(mine, dtype=array.dtype)
        half = mpi_type is MPI.UINT16_T and array.dtype != np.uint16
        request, recv = None, None
        if self.size == 1:
            out[...] = array
        elif array.size and half and op in ("sum", "avg"):
            recv = np.empty((self.size, mine), dtype=np.uint16)  # every rank's copy of my segment
            request = self._comm.Ialltoallv([buf, (counts, _starts(counts)), MPI.UINT16_T],
                                            [recv, ([mine] * self.size, [mine * r for r in range(self.size)]),
                                             MPI.UINT16_T])
        elif array.size:
            request = self._comm.Ireduce_scatter([buf, mpi_type], [mpi_buffer(out)[0], mpi_type], counts,
                                                 reduce_op(array.dtype, mpi_type, op))

        def finish() -> np.ndarray:
            if recv is not None and mine:
                sum_rows(recv.view(array.dtype), out)
            if op == "avg":
                np.divide(out, self.size, out=out)
            return out

        return request, finish

    def _start_all_gather_into(self, array: np.ndarray, counts: list[int]) -> Any:
        """Start the in-place ``Iallgatherv``; its request, or None when nothing moves."""
        buf, mpi_type = mpi_buffer(array)
        if not array.size or self.size == 1:
            return None
        return self._comm.Iallgatherv(MPI.IN_PLACE, [buf, (counts, _starts(counts)), mpi_type])

    @staged
    @collective
    def reduce_scatter(self, array: np.ndarray, counts: Sequence[int] | None = None, op: str = "sum"
                       ) -> np.ndarray:
        """Reduce-scatter; see :meth:`distopt.comm.base.Communicator.reduce_scatter`.

        Returns a new array of ``counts[rank]`` elements; ``array`` is left unchanged (CuPy arrays: staged through
        host).

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: not a NumPy (or CuPy) array, non-contiguous, or an unsupported dtype or op.
            CollectiveMismatchError: ranks passed different counts, element counts, dtypes or ops (on every rank).
            CollectiveTimeoutError: the deadline passed.
        """
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        mpi_buffer(array)  # the dtype check, before any communication
        code = dtype_code(array.dtype) * 8 + REDUCE_OPS.index(op)
        what = self._ctl.agree_counts("reduce_scatter", array.size, code, counts)
        request, finish = self._start_reduce_scatter(array, counts, op)
        if request is not None:
            self._wait(request, what)
        return finish()

    @collective
    def reduce_scatter_async(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Any:
        """Start a reduce-scatter (``Ireduce_scatter``) and return at once; no per-call agreement check (as
        :meth:`all_reduce_async`). A CuPy array is reduced at once through host copies (a completed handle).

        Returns:
            A handle: ``test()``, and ``wait()`` (bounded, callable twice) returning what :meth:`reduce_scatter`
            returns.

        Raises:
            ValueError, TypeError: as :meth:`reduce_scatter`, before anything moves.
        """
        if is_cupy(array):
            return Completed(self.reduce_scatter(array, counts, op))
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        request, finish = self._start_reduce_scatter(array, counts, op)
        return MpiShardHandle(self, request, finish, f"reduce_scatter_async of {array.size} elements")

    @staged
    @collective
    def all_gather_into(self, array: np.ndarray, counts: Sequence[int] | None = None) -> np.ndarray:
        """In-place all-gather of per-rank segments (``Iallgatherv`` with ``MPI.IN_PLACE``); see
        :meth:`distopt.comm.base.Communicator.all_gather_into`. Any dtype MPI moves; returns ``array``.

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: not a NumPy (or CuPy) array, non-contiguous, or a dtype MPI cannot move.
            CollectiveMismatchError: element counts, dtypes or counts differ (on every rank).
            CollectiveTimeoutError: the deadline passed.
        """
        counts = check_counts(array, counts, self.size)
        mpi_buffer(array)  # the dtype check, before any communication
        what = self._ctl.agree_counts("all_gather_into", array.size, dtype_code(array.dtype), counts)
        request = self._start_all_gather_into(array, counts)
        if request is not None:
            self._wait(request, what)
        return array

    @collective
    def all_gather_into_async(self, array: Any, counts: Sequence[int] | None = None) -> Any:
        """Start an in-place all-gather (``Iallgatherv``) and return at once; no agreement check, CuPy arrays gathered
        at once (as :meth:`reduce_scatter_async`).

        Returns:
            A handle whose ``wait()`` returns ``array``.

        Raises:
            ValueError, TypeError: as :meth:`all_gather_into`, before anything moves.
        """
        if is_cupy(array):
            return Completed(self.all_gather_into(array, counts))
        counts = check_counts(array, counts, self.size)
        request = self._start_all_gather_into(array, counts)
        return MpiShardHandle(self, request, lambda: array, f"all_gather_into_async of {array.size} elements")

    @staged
    @collective
    def all_to_all(self, array: np.ndarray) -> np.ndarray:
        """Row j of ``array`` to rank j (``Ialltoall``); see :meth:`distopt.comm.base.Communicator.all_to_all`.

        Returns:
            A new array of ``array``'s shape; row i is rank i's row ``rank``.

        Raises:
            ValueError: ``array.shape[0] != size``.
            TypeError: not a NumPy array, non-contiguous, unsupported dtype.
            CollectiveMismatchError: element counts or dtypes differ.
            CollectiveTimeoutError: the deadline passed.
        """
        check_rows(array, self.size)
        buf, mpi_type = mpi_buffer(array)
        out = np.empty_like(array)
        what = self._ctl.agree("all_to_all", array.size, dtype_code(array.dtype))
        if self.size == 1:
            out[...] = array
        elif array.size:
            self._wait(self._comm.Ialltoall([buf, mpi_type], [mpi_buffer(out)[0], mpi_type]), what)
        return out

    @staged
    @collective
    def all_to_all_v(self, array: np.ndarray, matrix: Sequence[Sequence[int]]) -> np.ndarray:
        """Uneven all-to-all (``Ialltoallv``): ``matrix[i][j]`` ELEMENTS from rank i to rank j; see
        :mod:`distopt.comm.uneven`.

        Returns:
            A new 1-D array of ``sum(matrix[i][rank] for i)`` elements, rank i's segment after rank i-1's.

        Raises:
            ValueError: ``array`` not 1-D, a bad matrix (:func:`~distopt.comm.uneven.check_matrix`).
            TypeError: not a NumPy array, non-contiguous, unsupported dtype.
            CollectiveMismatchError: the matrices (compared as a CRC-32) or dtypes differ, on every rank.
            CollectiveTimeoutError: the deadline passed.
        """
        rows = check_matrix(array, matrix, self.rank, self.size)
        buf, mpi_type = mpi_buffer(array)
        sends, gets = rows[self.rank], received(rows, self.rank)
        out = np.empty(sum(gets), dtype=array.dtype)
        flat = [c for row in rows for c in row]
        what = self._ctl.agree_counts("all_to_all_v", sum(flat), dtype_code(array.dtype), flat)
        if self.size == 1:
            out[...] = array
        elif sum(flat):
            self._wait(self._comm.Ialltoallv([buf, (sends, _starts(sends)), mpi_type],
                                             [mpi_buffer(out)[0], (gets, _starts(gets)), mpi_type]), what)
        return out
