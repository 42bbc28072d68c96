"""The per-call descriptor ranks exchange before a collective, and its comparison.

MPI and torch.distributed do not check that every rank called the same
collective with the same element count and dtype; a difference gives a
partial sum, garbage or a hang. Those backends therefore all-gather four
int64s per call first, ``(kind, sequence number, element count, code)``,
and :func:`check` raises :class:`~distopt.errors.CollectiveMismatchError` on
every rank (all see the same table) naming the first difference.

The exchange is a fixed-size *control block* (:func:`block_bytes`): the
descriptor, then up to :func:`inline_bytes` bytes of the call's own data.
A small collective (an all-reduce of a few KiB, a broadcast, a gather)
travels inside its block, so it costs one exchange, and a small all-reduce
is then summed locally, in rank order (the same bits on every rank). Every
block has the same size whatever the call, so two ranks in different calls
still exchange well-formed blocks and the descriptors tell them apart.
"""
from __future__ import annotations

import functools
import struct

import numpy as np

from ..errors import CollectiveMismatchError

__all__ = ["KINDS", "kind_name", "dtype_code", "check", "HEAD_BYTES", "MAX_INLINE_BYTES", "inline_bytes",
           "block_bytes", "encode", "reduce_rows", "same"]

#: Collective kinds, by code.
KINDS = ("all_reduce", "broadcast", "all_gather", "all_gather_v", "barrier")


#: Bytes of the descriptor at the start of a control block (four int64).
HEAD_BYTES = 32

#: Most BYTES of data one rank's control block carries inline. Larger blocks make the descriptor
#: exchange of every larger call slower (2 ranks, MPICH: 8.7 us for an 8 KiB block, 2.5 us for
#: 512 B), and 2 KiB blocks measured no faster per call.
MAX_INLINE_BYTES = 512

#: Most BYTES all ranks' inline data may add up to (the block shrinks on large worlds).
_GATHERED_BYTES = 32768


def inline_bytes(size: int) -> int:
    """BYTES of data one control block carries in a world of ``size`` ranks (512 up to 64 ranks,
    then less, so one exchange gathers at most 32 KiB; at least 64)."""
    return max(64, min(MAX_INLINE_BYTES, _GATHERED_BYTES // max(size, 1) // 8 * 8))


def block_bytes(size: int) -> int:
    """BYTES of one rank's control block in a world of ``size`` ranks (descriptor + inline data)."""
    return HEAD_BYTES + inline_bytes(size)


_HEAD = struct.Struct("<4q")


def encode(block: np.ndarray, kind: int, seq: int, count: int, code: int, payload: np.ndarray | None) -> None:
    """Write a descriptor and an optional inline ``payload`` into a control block.

    Args:
        block: uint8, shape ``(block_bytes(size),)``: this rank's control block.
        kind: the collective's code (index in :data:`KINDS`).
        seq: the call's sequence number on this communicator.
        count: the element count.
        code: the dtype/op (or root) code.
        payload: C-contiguous array of any dtype, at most :func:`inline_bytes`
            bytes, copied after the descriptor; None for none.
    """
    _HEAD.pack_into(block, 0, kind, seq, count, code)
    if payload is not None and payload.nbytes:
        end = HEAD_BYTES + payload.nbytes
        if payload.dtype.isbuiltin == 1:  # a NumPy dtype: its buffer casts to bytes directly
            block.data[HEAD_BYTES:end] = payload.data.cast("B")
        else:  # a user dtype (bfloat16) exports no buffer format
            block[HEAD_BYTES:end] = payload.reshape(-1).view(np.uint8)


_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_BOOL_UFUNCS = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and}


@functools.lru_cache(maxsize=64)
def _sixteen_bit_float(dtype: np.dtype) -> bool:
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def reduce_rows(rows: np.ndarray, op: str, out: np.ndarray) -> None:
    """Reduce every rank's inline copy, in rank order, into ``out``.

    Args:
        rows: shape ``(size, out.size)``, dtype ``out.dtype``: rank r's
            array in row r.
        op: ``"sum"``, ``"avg"`` (the sum divided by the number of rows),
            ``"max"`` or ``"min"``; booleans reduce as OR (sum, max) and AND
            (min); 16-bit floats are summed in float32 and rounded once
            (``"avg"`` then divides in the array's dtype, as the
            backends' large path does).
        out: the result (the caller's array), written in place.
    """
    flat = out if out.ndim == 1 else out.reshape(-1)
    dtype = out.dtype
    if _sixteen_bit_float(dtype):
        acc = rows[0].astype(np.float32)
        for row in rows[1:]:
            _UFUNCS[op](acc, row, out=acc)
        flat[...] = acc.astype(dtype)
    else:
        ufunc = _BOOL_UFUNCS[op] if dtype.kind == "b" else _UFUNCS[op]
        if rows.shape[0] == 1:
            flat[...] = rows[0]
        else:  # rank order: the same bits on every rank
            ufunc(rows[0], rows[1], out=flat)
            for row in rows[2:]:
                ufunc(flat, row, out=flat)
    if op == "avg":
        np.divide(flat, rows.shape[0], out=flat)


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


def check(everyone: np.ndarray, what: str) -> None:
    """Raise on every rank if the rows of ``everyone`` differ.

    Args:
        everyone: int64, shape ``(size, 4)``: every rank's descriptor.
        what: the collective, e.g. ``"all_reduce #12"``, for the message.

    Raises:
        CollectiveMismatchError: naming rank 0's and the first differing
            rank's collective, element count, or dtype/op.
    """
    differs = ~(everyone == everyone[0]).all(axis=1)
    if not differs.any():
        return
    first = int(np.argmax(differs))
    a, b = everyone[0], everyone[first]
    if a[0] != b[0] or a[1] != b[1]:
        detail = (f"rank 0 is in {kind_name(a[0])} #{a[1]}, rank {first} in {kind_name(b[0])} #{b[1]} "
                  "(ranks reached different collectives or different step counts)")
    elif a[2] != b[2]:
        detail = (f"element count differs: rank 0 has {a[2]}, rank {first} has {b[2]} (different buffers, "
                  "or ranks at unequal step counts calling different collectives)")
    else:
        detail = f"dtype or op differs between rank 0 and rank {first}"
    raise CollectiveMismatchError(f"{what}: {detail}")
