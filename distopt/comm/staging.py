"""CUDA arrays on the host backends (MPI, shared memory), staged through host memory.

The MPI backend here is not CUDA-aware (MPICH from PyPI moves host memory only) and shared memory is host memory, so a
CuPy array handed to one of their collectives is copied to a NumPy array (``cupy.asnumpy``, which waits for the device),
reduced there, and copied back (``array.set``). The result is the same as for NumPy arrays; the cost is two copies over
PCIe and one host wait per call. This lets multi-rank GPU code paths (CuPy models, CUDA tensors through ``DistOpt``) run
on one GPU, where NCCL refuses two ranks. For speed on GPUs use the NCCL backend.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import numpy as np

from ..core._array import is_cupy
from .lifecycle import Completed

__all__ = ["staged", "staged_async"]

F = TypeVar("F", bound=Callable[..., Any])


def staged(method: F) -> F:
    """Decorate a collective ``method(self, array, ...)``: CuPy arrays go through host copies.

    In-place collectives (the result is the argument) write back into the CuPy array and return it; gathers return CuPy
    arrays (lists of them for ``all_gather_v``). NumPy arrays pass through untouched.
    """

    @functools.wraps(method)
    def call(self: Any, array: Any, *args: Any, **kwargs: Any) -> Any:
        if type(array) is np.ndarray or not is_cupy(array):
            return method(self, array, *args, **kwargs)
        import cupy

        host = cupy.asnumpy(array)
        out = method(self, host, *args, **kwargs)
        if out is host:
            array.set(host)
            return array
        if isinstance(out, list):
            return [cupy.asarray(part) for part in out]
        return cupy.asarray(out)

    return call  # type: ignore[return-value]


def staged_async(method: F) -> F:
    """Decorate ``all_reduce_async``: a CuPy array is reduced at once through the staged ``all_reduce`` (host copies
    cannot overlap the device), and a completed handle is returned."""

    @functools.wraps(method)
    def call(self: Any, array: Any, op: str = "sum") -> Any:
        if type(array) is np.ndarray or not is_cupy(array):
            return method(self, array, op)
        return Completed(self.all_reduce(array, op))

    return call  # type: ignore[return-value]
