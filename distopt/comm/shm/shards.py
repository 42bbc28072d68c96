"""The shm backend's sharded collectives: reduce-scatter, in-place all-gather, all-to-all (even and uneven).

:class:`ShmShards` is a mixin of :class:`~distopt.comm.shm.communicator.ShmCommunicator`; each collective is one
arrive/check/finish round on the control rows (:mod:`~distopt.comm.shm.rows`), so it waits for its peers once:

* ``reduce_scatter``: every rank publishes its array except its own segment (no peer reads that), then reduces
  segment ``rank`` of every rank's array into a new array, in the rank order ``all_reduce`` adds in
  (:func:`~distopt.comm.rank_order.reduce_in_rank_order`; float16/bfloat16 accumulate in float32).
* ``all_gather_into``: every rank publishes its own segment, then copies the others' into ``array``.
* ``all_to_all``: every rank publishes its array except row ``rank``, then copies row ``rank`` of every peer's into a
  new array.
* ``all_to_all_v``: the same with per-rank segments of ``matrix[i][j]`` elements (:mod:`distopt.comm.uneven`).

The descriptors carry the element count, dtype, op and a CRC-32 of the counts, so ranks that differ raise
:class:`~distopt.errors.CollectiveMismatchError` on every rank before any data moves.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..base import REDUCE_OPS, check_counts, check_reduce_args, check_rows, counts_digest
from ..lifecycle import collective
from ..staging import staged
from ..uneven import check_matrix, received
from .rows import dtype_code

if TYPE_CHECKING:
    from .rows import ControlRows

__all__ = ["ShmShards", "require_ndarray"]


def require_ndarray(array: Any) -> None:
    """Raise TypeError unless ``array`` is a NumPy array (CuPy arrays are staged before)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"the shm backend takes NumPy arrays, got {type(array).__name__}")


class ShmShards:
    """The sharded collectives of :class:`~distopt.comm.shm.communicator.ShmCommunicator` (a mixin)."""

    rank: int
    size: int
    _ctl: ControlRows
    _reduce: Callable[..., None]  # (views, op, acc, *outs): ShmCommunicator._reduce
    _reduce_range: Callable[..., None]  # (views, lo, hi, op, outs, direct): ShmCommunicator._reduce_range

    @staged
    @collective
    def reduce_scatter(self, array: np.ndarray, counts: Sequence[int] | None = None, op: str = "sum") -> np.ndarray:
        """Reduce-scatter; see :meth:`distopt.comm.base.Communicator.reduce_scatter`.

        Returns:
            A new array of ``counts[rank]`` elements, bitwise equal to that segment of :meth:`all_reduce` on the same
            data; ``array`` is left unchanged.

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: not a NumPy array, non-contiguous, unsupported dtype, integer ``avg``.
            CollectiveMismatchError: element counts, dtypes, ops or counts differ.
            CollectiveTimeoutError: a rank did not arrive in time, exited or closed.
        """
        require_ndarray(array)
        check_reduce_args(array, op)
        counts = check_counts(array, counts, self.size)
        code = dtype_code(array.dtype)
        lo = sum(counts[:self.rank])
        hi = lo + counts[self.rank]
        out = np.empty(hi - lo, array.dtype)
        if self.size == 1:
            self._reduce([array], op, out)
            return out
        n, itemsize = array.size, array.itemsize
        arg = REDUCE_OPS.index(op) + 8 * counts_digest(counts)
        c, _, _ = self._ctl.arrive("reduce_scatter", n, code, arg, array.view(np.uint8), (lo * itemsize, hi * itemsize))
        views = [array if p == self.rank or lo == hi else self._ctl.published(p)[:n * itemsize].view(array.dtype)
                 for p in range(self.size)]
        self._reduce_range(views, lo, hi, op, [out], direct=True)
        self._ctl.finish(c)
        return out

    @staged
    @collective
    def all_gather_into(self, array: np.ndarray, counts: Sequence[int] | None = None) -> np.ndarray:
        """In-place all-gather of per-rank segments; see :meth:`distopt.comm.base.Communicator.all_gather_into`.
        Returns ``array``.

        Raises:
            ValueError: bad ``counts`` or a non-1-D ``array``.
            TypeError: not a NumPy array, non-contiguous, or an unsupported dtype.
            CollectiveMismatchError: element counts, dtypes or counts differ (on every rank).
            CollectiveTimeoutError: the deadline passed.
        """
        require_ndarray(array)
        counts = check_counts(array, counts, self.size)
        code = dtype_code(array.dtype)
        if self.size == 1:
            return array
        starts = [sum(counts[:p]) for p in range(self.size)]
        mine = array[starts[self.rank]:starts[self.rank] + counts[self.rank]]
        c, _, _ = self._ctl.arrive("all_gather_into", array.size, code, 8 * counts_digest(counts), mine.view(np.uint8))
        for p, count in enumerate(counts):
            if p != self.rank and count:
                array[starts[p]:starts[p] + count] = self._ctl.published(p)[:count * array.itemsize].view(array.dtype)
        self._ctl.finish(c)
        return array

    @staged
    @collective
    def all_to_all(self, array: np.ndarray) -> np.ndarray:
        """Row j of ``array`` to rank j; see :meth:`distopt.comm.base.Communicator.all_to_all`.

        Returns:
            A new array of ``array``'s shape; row i is rank i's row ``rank``.

        Raises:
            ValueError: ``array.shape[0] != size``.
            TypeError: not a NumPy array, non-contiguous, unsupported dtype.
            CollectiveMismatchError: element counts or dtypes differ.
            CollectiveTimeoutError: as for :meth:`reduce_scatter`.
        """
        require_ndarray(array)
        check_rows(array, self.size)
        code = dtype_code(array.dtype)
        out = np.empty_like(array)
        if self.size == 1:
            out[...] = array
            return out
        me, row = self.rank, array.nbytes // self.size
        flat = array.reshape(-1).view(np.uint8)
        c, _, _ = self._ctl.arrive("all_to_all", array.size, code, 0, flat, (me * row, (me + 1) * row))
        rows = out.reshape(-1).view(np.uint8).reshape(self.size, row)
        for p in range(self.size if row else 0):
            rows[p] = flat[me * row:(me + 1) * row] if p == me else self._ctl.published(p)[me * row:(me + 1) * row]
        self._ctl.finish(c)
        return out

    @staged
    @collective
    def all_to_all_v(self, array: np.ndarray, matrix: Sequence[Sequence[int]]) -> np.ndarray:
        """Uneven all-to-all: ``matrix[i][j]`` ELEMENTS from rank i to rank j; see :mod:`distopt.comm.uneven`.

        Every rank publishes its array except its own segment, then copies its segment of every peer's.

        Returns:
            A new 1-D array of ``sum(matrix[i][rank] for i)`` elements, rank i's segment after rank i-1's.

        Raises:
            ValueError: ``array`` not 1-D, a bad matrix (:func:`~distopt.comm.uneven.check_matrix`).
            TypeError: not a NumPy array, non-contiguous, unsupported dtype.
            CollectiveMismatchError: the matrices (compared as a CRC-32) or dtypes differ, on every rank.
            CollectiveTimeoutError: as for :meth:`reduce_scatter`.
        """
        require_ndarray(array)
        rows = check_matrix(array, matrix, self.rank, self.size)
        code, me, item = dtype_code(array.dtype), self.rank, array.itemsize
        gets = received(rows, me)
        out = np.empty(sum(gets), array.dtype)
        if self.size == 1:
            out[...] = array
            return out
        flat = [n for row in rows for n in row]
        lo = sum(rows[me][:me])
        c, _, _ = self._ctl.arrive("all_to_all_v", sum(flat), code, 8 * counts_digest(flat), array.view(np.uint8),
                                   (lo * item, (lo + rows[me][me]) * item))
        into = 0
        for p in range(self.size):
            start, count = sum(rows[p][:me]), gets[p]
            if count:
                src = array[lo:lo + count] if p == me else self._ctl.published(p)[start * item:(start + count) * item]
                out[into:into + count] = src if p == me else src.view(array.dtype)
            into += count
        self._ctl.finish(c)
        return out
