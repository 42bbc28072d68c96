"""Device memory of the stand-in: host memory, addressed by plain integer pointers as CUDA's is.

Every array's memory is registered with the device that was current when it
was allocated, so an NCCL call can resolve ``(pointer, count, dtype)`` back to
memory, as the real library does: a pointer into no allocation, or into one on
another device, is an error; a strided view's pointer reads the contiguous
bytes that follow it, whatever the view meant.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

__all__ = ["MemoryPointer", "UnownedMemory", "register", "resolve", "owner_of", "BadPointer"]


class BadPointer(ValueError):
    """A pointer that no live allocation of the expected device holds."""


class _Alloc:
    __slots__ = ("ptr", "size", "device_id", "owner", "__weakref__")

    def __init__(self, ptr: int, size: int, device_id: int, owner: Any) -> None:
        self.ptr, self.size, self.device_id, self.owner = ptr, size, device_id, owner


_ALLOCS: dict[int, _Alloc] = {}


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def register(a: np.ndarray, device_id: int) -> _Alloc:
    """The allocation holding ``a`` (registered on ``device_id`` the first time it is seen)."""
    root = _root(a)
    found = _ALLOCS.get(id(root))
    if found is None or found.owner() is not root:
        ptr = root.__array_interface__["data"][0]
        found = _Alloc(ptr, root.nbytes, device_id, weakref.ref(root))
        _ALLOCS[id(root)] = found
        weakref.finalize(root, _ALLOCS.pop, id(root), None)
    return found


def owner_of(ptr: int) -> Any:
    """The memory holding ``ptr`` (kept alive by queued work that uses it, as CuPy's memory pool keeps a
    freed block from other uses until the stream it was freed on has passed that work), or None."""
    for alloc in list(_ALLOCS.values()):
        if alloc.ptr <= ptr < alloc.ptr + max(alloc.size, 1):
            return alloc.owner()
    return None


def resolve(ptr: int, nbytes: int, device_id: int | None = None) -> np.ndarray:
    """``nbytes`` bytes of device memory at ``ptr``, as a writable uint8 array.

    Raises:
        BadPointer: no live allocation holds ``[ptr, ptr + nbytes)``, or it is on another device.
    """
    for alloc in list(_ALLOCS.values()):
        if alloc.ptr <= ptr and ptr + nbytes <= alloc.ptr + alloc.size and alloc.owner() is not None:
            if device_id is not None and alloc.device_id != device_id:
                raise BadPointer(f"pointer {ptr:#x} is memory of device {alloc.device_id}, not {device_id}")
            break
    else:
        raise BadPointer(f"pointer {ptr:#x} (+{nbytes} bytes) is in no live device allocation")
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class UnownedMemory:
    """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id=None)``: memory allocated elsewhere."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        if ptr == 0 and device_id is None:
            raise RuntimeError("UnownedMemory of a null pointer needs device_id")  # as memory.pyx
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        if device_id is None:
            device_id = _device_of(self.ptr)
        self.device_id = device_id
        self._host = resolve(self.ptr, self.size) if self.size else np.empty(0, np.uint8)


def _device_of(ptr: int) -> int:
    for alloc in list(_ALLOCS.values()):
        if alloc.ptr <= ptr < alloc.ptr + max(alloc.size, 1):
            return alloc.device_id
    raise BadPointer(f"pointer {ptr:#x} is in no live device allocation")


class MemoryPointer:
    """``cupy.cuda.MemoryPointer(mem, offset)``: ``ptr`` is an int, as CuPy's."""

    def __init__(self, mem: Any, offset: int) -> None:
        self.mem, self.offset = mem, int(offset)

    @property
    def ptr(self) -> int:
        return self.mem.ptr + self.offset

    @property
    def device_id(self) -> int:
        return self.mem.device_id

    def __int__(self) -> int:
        return self.ptr
