"""Flat buffers kept from one step to the next: a sharded step's transient bucket memory, allocated once.

At ``zero=2`` a bucket's fusion buffer lives only until its reduce-scatter has completed, and the torch backend's
reduce-scatter receives every rank's copy of this rank's segment into a buffer of the bucket's size. Allocated anew on
every step, each such buffer is fresh pages from the operating system (large allocations are ``mmap``-ed and returned
on free), zero-filled at first touch: a cost proportional to the gradient's bytes on every step, which a kept buffer
does not pay (PyTorch DDP and DeepSpeed ZeRO-2 keep theirs too). :class:`Spares` keeps a few freed buffers, at most
``limit``, so the memory held between steps stays bounded by ``limit`` buffers whatever the model's size.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["Spares"]


class Spares:
    """A bounded free list of 1-D buffers (NumPy, CuPy or torch), reused by size and dtype.

    Args:
        limit: the most buffers kept (the largest ones win); 0 keeps none.

    Raises:
        ValueError: ``limit`` is negative.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"Spares: limit must be >= 0, got {limit}")
        self.limit = limit
        self._free: list[Any] = []

    def take(self, size: int, dtype: Any, new: Callable[[int], Any]) -> Any:
        """A 1-D buffer of ``dtype`` holding at least ``size`` ELEMENTS: the smallest kept one that fits (removed from
        the list; the caller slices ``[:size]``), else ``new(size)``."""
        fits = [i for i, buf in enumerate(self._free) if buf.dtype == dtype and buf.shape[0] >= size]
        if not fits:
            return new(size)
        return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))

    def give(self, buffer: Any) -> None:
        """Keep ``buffer`` (a whole buffer from :meth:`take`, no longer used by anyone) for a later :meth:`take`,
        unless ``limit`` larger ones are kept already."""
        self._free.append(buffer)
        self._free.sort(key=lambda buf: -int(buf.nbytes))
        del self._free[self.limit:]

    @property
    def held_bytes(self) -> int:
        """BYTES of the buffers kept."""
        return sum(int(buf.nbytes) for buf in self._free)
