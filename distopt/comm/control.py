"""The control block MPI and torch.distributed exchange before every collective.

MPI and torch.distributed do not check that every rank called the same collective with the same element count and dtype;
a difference gives a partial sum, garbage or a hang. Those backends therefore all-gather a fixed-size *control block*
per call (:class:`ControlBlock`): four int64s, ``(kind, sequence number, element count, code)``, then up to
:func:`inline_bytes` bytes of the call's own data; :func:`check` raises :class:`~distopt.errors.CollectiveMismatchError`
on every rank (all see the same table) naming the first field that differs. A small collective travels inside its block,
so it costs one exchange, and a small all-reduce is then reduced locally in rank order (:func:`reduce_inline`: the same
bits on every rank). Every block has the same size, so ranks in different calls still exchange well-formed blocks.
"""
from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import DistOptError
from .base import counts_digest
from .consensus import check_agreed
from .messages import where
from .rank_order import accumulator_dtype, reduce_in_rank_order

__all__ = ["KINDS", "HEAD_BYTES", "MAX_INLINE_BYTES", "inline_bytes", "block_bytes", "encode", "kind_name",
           "dtype_code", "same", "check", "reduce_inline", "ControlBlock", "new_buffers", "DIFFERENT_CALLS",
           "DIFFERENT_COUNTS"]

#: Collective kinds, by code.
KINDS = ("all_reduce", "broadcast", "all_gather", "all_gather_v", "barrier", "reduce_scatter", "all_gather_into",
         "all_to_all", "all_to_all_v")

#: Bytes of the descriptor at the start of a control block (four int64).
HEAD_BYTES = 32

#: Most BYTES of data one rank's control block carries inline. Larger blocks make the descriptor exchange of every
#: larger call slower (2 ranks, MPICH: 8.7 us for an 8 KiB block, 2.5 us for 512 B); 2 KiB blocks were no faster.
MAX_INLINE_BYTES = 512

#: Most BYTES all ranks' inline data may add up to (the block shrinks on large worlds).
_GATHERED_BYTES = 32768

#: The likely cause of ranks in different collectives (or different calls of one), for messages.
DIFFERENT_CALLS = "ranks reached different collectives or different step counts"
#: The likely cause of different element counts, for messages.
DIFFERENT_COUNTS = "different buffers, or ranks at unequal step counts calling different collectives"


def inline_bytes(size: int) -> int:
    """BYTES of data one control block carries in a world of ``size`` ranks (512 up to 64 ranks, then less, so one
    exchange gathers at most 32 KiB; at least 64)."""
    return max(64, min(MAX_INLINE_BYTES, _GATHERED_BYTES // max(size, 1) // 8 * 8))


def block_bytes(size: int) -> int:
    """BYTES of one rank's control block in a world of ``size`` ranks (descriptor + inline data)."""
    return HEAD_BYTES + inline_bytes(size)


_HEAD = struct.Struct("<4q")
_INT64 = np.dtype(np.int64)


def encode(block: np.ndarray, kind: int, seq: int, count: int, code: int, payload: np.ndarray | None) -> None:
    """Write a descriptor and an optional inline ``payload`` into a control block.

    Args:
        block: uint8, shape ``(block_bytes(size),)``: this rank's control block.
        kind: the collective's code (index in :data:`KINDS`).
        seq: the call's sequence number on this communicator.
        count: the element count.
        code: the dtype/op (or root) code.
        payload: None, or a C-contiguous array of any dtype, at most :func:`inline_bytes` bytes, to copy after it.
    """
    _HEAD.pack_into(block, 0, kind, seq, count, code)
    if payload is not None and payload.nbytes:
        end = HEAD_BYTES + payload.nbytes
        if payload.dtype.isbuiltin == 1:  # a NumPy dtype: its buffer casts to bytes directly
            block.data[HEAD_BYTES:end] = payload.data.cast("B")
        else:  # a user dtype (bfloat16) exports no buffer format
            block[HEAD_BYTES:end] = payload.reshape(-1).view(np.uint8)


def reduce_inline(rows: Sequence[np.ndarray], op: str, out: np.ndarray) -> None:
    """Reduce every rank's inline copy into ``out``: in rank order
    (:func:`~distopt.comm.rank_order.reduce_in_rank_order`), 16-bit floats in float32 rounded once, then ``"avg"``
    divided by the number of ranks in ``out``'s dtype (as the backends' large paths do).

    Args:
        rows: one array per rank, in rank order, of ``out``'s shape and dtype (16-bit floats: or widened to float32).
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; booleans reduce as OR (sum, max) and AND (min).
        out: the result (the caller's array), written in place.
    """
    wide = accumulator_dtype(out.dtype)
    acc = out if wide == out.dtype else np.empty(out.shape, wide)
    reduce_in_rank_order(rows, op, acc)
    if acc is not out:
        out[...] = acc
    if op == "avg":
        np.divide(out, len(rows), out=out)


def kind_name(code: int) -> str:
    """Name of a collective kind code (robust to garbage from a mismatched exchange)."""
    return KINDS[code] if 0 <= code < len(KINDS) else f"an unknown collective (code {code})"


@functools.lru_cache(maxsize=64)
def dtype_code(dtype: np.dtype) -> int:
    """An int64 that differs between dtypes (byte order, kind, item size)."""
    return int.from_bytes(dtype.str.encode()[:6].ljust(6, b"\0"), "little") ^ (dtype.itemsize << 48)


def same(everyone: np.ndarray) -> bool:
    """True when every row of a gathered descriptor table (int64, shape ``(size, 4)``) is rank 0's."""
    rows = everyone.tolist()
    return rows.count(rows[0]) == len(rows)


def check(everyone: np.ndarray, place: str) -> None:
    """Raise on every rank if the rows of ``everyone`` differ.

    Args:
        everyone: int64, shape ``(size, 4)``: every rank's descriptor.
        place: the call, for the message (:func:`~distopt.comm.messages.where`).

    Raises:
        CollectiveMismatchError: naming every rank's collective, element count or dtype/op code (the first differing).
    """
    rows = everyone.tolist()
    if rows.count(rows[0]) == len(rows):
        return
    check_agreed(place, {"collective": [(k, s) for k, s, _, _ in rows], "element count": [c for _, _, c, _ in rows],
                         "dtype or op (as its code)": [c for _, _, _, c in rows]},
                 show={"collective": lambda ks: f"{kind_name(ks[0])} #{ks[1]}", "element count": str,
                       "dtype or op (as its code)": lambda c: f"{c:#x}"},
                 hint={"collective": DIFFERENT_CALLS, "element count": DIFFERENT_COUNTS})


class ControlBlock:
    """One communicator's control-block protocol: sequence number, broken flag, exchange and check.

    Args:
        backend: the backend's name, for messages (``"mpi"``, ``"torch"``).
        rank: this process's rank.
        block: uint8, shape ``(block_bytes(size),)``: this rank's block, the exchange's send buffer.
        table: uint8, shape ``(size, block_bytes(size))``: the receive buffer, row r rank r's block after an exchange.
        exchange: all-gathers ``block`` into ``table``, bounded; called with the call's name (``"all_reduce #3"``), it
            raises :class:`~distopt.errors.CollectiveTimeoutError` (and sets :attr:`broken`) past the deadline.

    Attributes:
        seq: the number of the last call (1 for the first).
        kind: the kind code (index in :data:`KINDS`) of the last call.
        broken: the name of the call that failed, or None while usable.
        inline: BYTES of data a block carries.
    """

    def __init__(self, backend: str, rank: int, block: np.ndarray, table: np.ndarray,
                 exchange: Callable[[str], None]) -> None:
        self.backend, self.rank, self.block, self.table, self._exchange = backend, rank, block, table, exchange
        self.seq, self.kind = 0, -1
        self.broken: str | None = None
        self.inline = inline_bytes(table.shape[0])
        self._heads = table.view(np.int64)[:, :4]  # every rank's descriptor, after an exchange
        self._typed: dict[np.dtype, np.ndarray] = {}  # the table viewed as each dtype read inline

    def agree(self, kind: str, count: int, code: int, payload: np.ndarray | None = None) -> str:
        """Exchange (kind, seq, count, code) and ``payload`` (at most :attr:`inline` bytes); raise if ranks differ.

        Returns:
            The call's name for messages (``"all_reduce #3"``); the inline bytes stay in :attr:`table` until the next
            call.

        Raises:
            DistOptError: an earlier call failed (the communicator is unusable).
            CollectiveMismatchError: the descriptors differ.
            CollectiveTimeoutError: from the exchange.
        """
        if self.broken is not None:
            raise DistOptError(f"communicator unusable after a failed collective ({self.broken})")
        self.seq = seq = self.seq + 1
        self.kind = code_of_kind = KINDS.index(kind)
        what = f"{kind} #{seq}"
        encode(self.block, code_of_kind, seq, count, code, payload)
        self._exchange(what)
        if not same(self._heads):
            check(self._heads.copy(), where(self.backend, what, self.rank))
        return what

    def agree_counts(self, kind: str, count: int, code: int, counts: Sequence[int]) -> str:
        """:meth:`agree` on a sharded call, its inline data the :func:`~distopt.comm.base.counts_digest` of ``counts``.

        Returns:
            The call's name for messages (``"reduce_scatter #3"``).

        Raises:
            CollectiveMismatchError: on every rank (all see the same table), when the descriptors or the counts differ;
                the message names every rank's digest and this rank's counts.
            DistOptError / CollectiveTimeoutError: as :meth:`agree`.
        """
        what = self.agree(kind, count, code, np.array([counts_digest(counts)], dtype=np.int64))
        values = self.rows(_INT64, 1)[:, 0].tolist()
        if values.count(values[0]) != len(values):  # the message only when they differ (this is per call)
            check_agreed(where(self.backend, what, self.rank), {"counts (as a CRC-32)": values},
                         show=lambda v: f"{v:#010x}", hint=f"ranks passed different counts (this rank: {list(counts)})")
        return what

    def rows(self, dtype: np.dtype, count: int) -> np.ndarray:
        """Every rank's inline array of ``count`` elements of ``dtype``, shape ``(size, count)``: a view into the table
        (no copy: read it before the next call)."""
        typed = self._typed.get(dtype)
        if typed is None:  # blocks and the descriptor are multiples of 8 bytes, the largest item size
            typed = self._typed[dtype] = self.table.view(dtype)
        start = HEAD_BYTES // dtype.itemsize
        return typed[:, start:start + count]


def new_buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """A zeroed block (uint8, ``(block_bytes(size),)``) and table (uint8, ``(size, block_bytes(size))``) for a
    :class:`ControlBlock` of a world of ``size`` ranks."""
    return np.zeros(block_bytes(size), np.uint8), np.zeros((size, block_bytes(size)), np.uint8)
