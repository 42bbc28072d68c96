"""How the NCCL backend names a CuPy array's dtype and a reduction to NCCL.

NCCL has float16, float32, float64, int8, uint8, int32 and int64; bool
travels as uint8 and is reduced with MAX (logical OR: ``"sum"``, ``"max"``)
or MIN (logical AND: ``"min"``). ``"avg"`` is an NCCL sum, which the backend
then divides by the world size.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import cupy
from cupy.cuda import nccl

__all__ = ["NCCL_TYPES", "nccl_dtype", "nccl_op"]

#: NumPy dtype -> NCCL datatype.
NCCL_TYPES = {
    np.dtype(np.float16): nccl.NCCL_FLOAT16,
    np.dtype(np.float32): nccl.NCCL_FLOAT32,
    np.dtype(np.float64): nccl.NCCL_FLOAT64,
    np.dtype(np.int8): nccl.NCCL_INT8,
    np.dtype(np.uint8): nccl.NCCL_UINT8,
    np.dtype(np.int32): nccl.NCCL_INT32,
    np.dtype(np.int64): nccl.NCCL_INT64,
    np.dtype(np.bool_): nccl.NCCL_UINT8,  # reduced with MAX (OR) / MIN (AND)
}
_OPS = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}


def nccl_dtype(array: Any) -> int:
    """The NCCL datatype of a CuPy array.

    Raises:
        TypeError: not a CuPy array, or a dtype NCCL has no type for.
    """
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"the NCCL backend takes CuPy arrays, got {type(array).__name__}")
    if array.dtype not in NCCL_TYPES:
        raise TypeError(f"dtype {array.dtype} is not supported by the NCCL backend")
    return NCCL_TYPES[array.dtype]


def nccl_op(array: Any, op: str) -> int:
    """The NCCL reduction of ``op`` (a name of :data:`~distopt.comm.base.REDUCE_OPS`) on ``array``'s dtype
    (bool: MAX for OR, MIN for AND)."""
    return {"sum": nccl.NCCL_MAX}.get(op, _OPS[op]) if array.dtype == np.bool_ else _OPS[op]
