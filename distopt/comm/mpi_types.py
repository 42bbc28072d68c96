"""How the MPI backend hands a NumPy array to MPI: its buffer and datatype, and the reduction to use.

Every NumPy dtype with an MPI datatype travels as itself (``MPI.FLOAT``, ``MPI.INT64_T``, ``MPI.C_BOOL``, ...). float16
and bfloat16 have none: they travel as 16-bit words (``MPI.UINT16_T``, 2 bytes per element) and are reduced by
:mod:`~distopt.comm.mpi_half` (its user-defined operations for max and min; sums go another way). Booleans reduce with
logical OR (``"sum"``, ``"max"``) and AND (``"min"``, ``"product"``); ``"avg"`` is an MPI sum the backend then divides.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .mpi_half import half_dtypes, half_op

__all__ = ["mpi_buffer", "reduce_op"]

_MPI_TYPES: dict[np.dtype, Any] = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.bool_): MPI.C_BOOL,
}
_NATIVE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "product": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}


def mpi_buffer(array: Any) -> tuple[np.ndarray, Any]:
    """The buffer MPI reads and writes for ``array`` (itself, or its 16-bit words) and its MPI datatype.

    Raises:
        TypeError: not a NumPy array (CuPy arrays need the NCCL backend), not C-contiguous, or a dtype MPI cannot move.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"the MPI backend takes NumPy arrays, got {type(array).__name__}; use backend='nccl' for CuPy "
                        "arrays")
    if not array.flags.c_contiguous:
        raise TypeError("array must be C-contiguous")
    dt = array.dtype
    if dt in _MPI_TYPES:
        return array, _MPI_TYPES[dt]
    if dt.itemsize == 2 and dt in half_dtypes():
        return array.view(np.uint16), MPI.UINT16_T
    raise TypeError(f"dtype {dt} is not supported by the MPI backend")


def reduce_op(dtype: np.dtype, mpi_type: Any, op: str) -> Any:
    """The MPI operation for ``op`` on ``dtype`` moved as ``mpi_type`` (logical for bool, user-defined for 16-bit
    floats)."""
    if dtype == np.bool_:
        return _BOOL_OPS[op]
    if mpi_type is MPI.UINT16_T and dtype != np.uint16:
        return half_op(dtype, op)
    return _NATIVE_OPS[op]
