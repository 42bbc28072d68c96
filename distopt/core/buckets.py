"""Bucket layout: which gradients are fused into which flat buffer (pure).

A bucket holds parameters of one dtype, packed back to back in the fixed parameter order that every rank shares. A
parameter with more than ``min(threshold, buff_size)`` elements is a bucket of its own (reduced without a copy when its
gradient is contiguous); smaller ones are fused into buckets of at most ``buff_size`` elements, as SINGA's DistOpt does
with its ``threshold`` and ``buffSize`` (both in ELEMENTS, not bytes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ._array import xp_of

__all__ = ["Slot", "Bucket", "plan_buckets", "pack", "put", "unpack", "is_float", "DEFAULT_THRESHOLD",
           "VIEW_THRESHOLD"]

DEFAULT_THRESHOLD = 2097152
"""Default ``threshold`` in ELEMENTS: larger parameters are reduced alone (SINGA's default)."""

VIEW_THRESHOLD = 65536
"""Default ``threshold`` in ELEMENTS of the strategies whose result does not depend on the layout (plain, half): a
parameter above 256 KiB of float32 is reduced in place, with no copy into a bucket."""


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a bucket.

    Attributes:
        index: position of the parameter in the caller's parameter list.
        offset: first element of the parameter in the bucket's flat buffer.
        size: number of elements (may be 0).
        shape: the parameter's shape.
    """

    index: int
    offset: int
    size: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of ``size`` elements of ``dtype`` holding ``slots``."""

    dtype: np.dtype
    slots: tuple[Slot, ...]
    size: int

    @property
    def alone(self) -> bool:
        """True when the bucket is one parameter reduced without packing."""
        return len(self.slots) == 1 and self.slots[0].offset == 0 and self.slots[0].size == self.size


def plan_buckets(specs: Sequence[tuple[tuple[int, ...], np.dtype]], threshold: int,
                 buff_size: int, *, reverse: bool = False, first_bucket: int | None = None) -> list[Bucket]:
    """Cut parameters into buckets.

    Args:
        specs: ``(shape, dtype)`` per parameter, in the shared order.
        threshold: parameters with more than this many elements are reduced alone (elements, >= 0).
        buff_size: capacity of a fused buffer in elements (>= 1); a parameter larger than it is always alone.
        reverse: walk the parameters last to first (the order backward produces gradients), so the first bucket holds
            the last layers.
        first_bucket: capacity in elements of the first fused bucket of each dtype (PyTorch DDP starts with 1 MiB so
            the first reduction starts early); None means ``buff_size``.

    Returns:
        Buckets in the order they are reduced (by their first parameter in the walk). Zero-size parameters get a slot
        of size 0.

    Raises:
        ValueError: ``threshold < 0``, ``buff_size < 1`` or ``first_bucket < 1``.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 elements, got {threshold}")
    if buff_size < 1:
        raise ValueError(f"buffSize must be >= 1 element, got {buff_size}")
    if first_bucket is not None and first_bucket < 1:
        raise ValueError(f"first_bucket must be >= 1 element, got {first_bucket}")
    limit = min(threshold, buff_size)
    order = range(len(specs) - 1, -1, -1) if reverse else range(len(specs))
    buckets: list[tuple[int, Bucket]] = []  # (position in the walk of the first parameter, bucket)
    open_slots: dict[np.dtype, list[Slot]] = {}
    open_fill: dict[np.dtype, int] = {}
    open_start: dict[np.dtype, int] = {}
    flushed: set[np.dtype] = set()

    def flush(dtype: np.dtype) -> None:
        slots = open_slots.pop(dtype, [])
        if slots:
            buckets.append((open_start.pop(dtype), Bucket(dtype, tuple(slots), open_fill.pop(dtype))))
            flushed.add(dtype)

    for position, index in enumerate(order):
        shape, dtype = specs[index]
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        if size > limit:
            buckets.append((position, Bucket(dtype, (Slot(index, 0, size, tuple(shape)),), size)))
            continue
        capacity = buff_size if dtype in flushed or first_bucket is None else min(first_bucket, buff_size)
        if open_fill.get(dtype, 0) + size > capacity and open_slots.get(dtype):
            flush(dtype)
        fill = open_fill.get(dtype, 0)
        open_start.setdefault(dtype, position)
        open_slots.setdefault(dtype, []).append(Slot(index, fill, size, tuple(shape)))
        open_fill[dtype] = fill + size
    for dtype in list(open_slots):
        flush(dtype)
    return [bucket for _, bucket in sorted(buckets, key=lambda pb: pb[0])]


def is_float(array: Any) -> bool:
    """True for floating-point arrays and dtypes (bfloat16 included): the ones a step reduces."""
    dtype = getattr(array, "dtype", array)
    return np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16"


def pack(bucket: Bucket, arrays: Sequence[Any], buffer: Any = None) -> tuple[Any, bool]:
    """The bucket's flat buffer: ``(flat, viewed)``.

    A lone C-contiguous array is returned as a flat view (``viewed=True``: the collective then works on the array
    itself, no copy). Otherwise the arrays are copied into ``buffer`` (a 1-D array of ``bucket.size`` elements of
    ``bucket.dtype``; None allocates one like the first array), a None entry packed as zeros.

    Raises:
        ValueError: ``buffer`` does not have ``bucket.size`` elements.
    """
    if bucket.alone:
        a = arrays[bucket.slots[0].index]
        if a is not None and a.flags.c_contiguous:
            return a.reshape(-1), True
    if buffer is None:
        ref = next((arrays[s.index] for s in bucket.slots if arrays[s.index] is not None), None)
        buffer = (np if ref is None else xp_of(ref)).empty(bucket.size, dtype=bucket.dtype)
    elif buffer.size != bucket.size:
        raise ValueError(f"buffer has {buffer.size} elements, the bucket needs {bucket.size}")
    for s in bucket.slots:
        put(buffer, s, arrays[s.index])
    return buffer, False


def put(flat: Any, slot: Slot, array: Any) -> None:
    """Copy one array into its slot of a packed flat buffer (None: zeros)."""
    flat[slot.offset:slot.offset + slot.size] = 0 if array is None else array.reshape(-1)


def unpack(bucket: Bucket, flat: Any, arrays: list[Any], divisor: int = 1) -> None:
    """Write a bucket's flat buffer, divided by ``divisor``, back into ``arrays`` (by slot index). A None entry gets a
    new array. Dividing here saves a separate pass over the bucket; the result equals dividing the buffer first."""
    for s in bucket.slots:
        part = flat[s.offset:s.offset + s.size].reshape(s.shape)
        target = arrays[s.index]
        if target is None:
            arrays[s.index] = part / divisor if divisor != 1 else part.copy()
        elif divisor == 1:
            target[...] = part
        elif target.flags.c_contiguous:
            xp_of(target).divide(part, divisor, out=target)
        else:
            target[...] = part / divisor
