"""How the NCCL backend imports NCCL, and names a CuPy array's dtype and a reduction to NCCL.

The one place that imports ``cupy.cuda.nccl``. CuPy's own module catches the ``ImportError`` of a libnccl it cannot load
and leaves ``available = False`` with none of NCCL's names (``cupy/cuda/nccl.py``), so importing it is not enough: this
module raises ``ImportError`` then, which :func:`distopt.comm.backend_class` turns into ``BackendUnavailableError``.

NCCL has float16, bfloat16 (CuPy 14 with ml_dtypes), float32, float64, int8, uint8, int32, uint32, int64 and uint64;
bool travels as uint8 and is reduced with MAX (logical OR: ``"sum"``, ``"max"``) or MIN (logical AND: ``"min"``,
``"product"``).
``"avg"`` is an NCCL sum, which the backend then divides by the world size (NCCL's own ``ncclAvg`` pre-multiplies each
rank's value by 1/W: other bits than the host backends' sum-then-divide).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core._array import cupy_major

try:
    import cupy
    from cupy.cuda import nccl
except ImportError as exc:  # turned into BackendUnavailableError by distopt.comm.backend_class
    raise ImportError(f"the NCCL backend needs CuPy with NCCL: {exc}") from exc
if not getattr(nccl, "available", True):
    raise ImportError("CuPy is installed but cannot load NCCL (cupy.cuda.nccl.available is False): install the "
                      "NCCL wheel of CuPy's CUDA version (nvidia-nccl-cu12 for cupy-cuda12x, nvidia-nccl-cu13 "
                      "for cupy-cuda13x)")

__all__ = ["NCCL_TYPES", "nccl_dtype", "nccl_op", "bfloat16_supported"]


def bfloat16_supported() -> bool:
    """CuPy 14 and later hold ``ml_dtypes.bfloat16`` arrays ("minimal support for bfloat16")."""
    if cupy_major(cupy) < 14 or not hasattr(nccl, "NCCL_BFLOAT16"):
        return False
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


#: NumPy dtype -> NCCL datatype.
NCCL_TYPES: dict[np.dtype, int] = {
    np.dtype(np.float16): nccl.NCCL_FLOAT16,
    np.dtype(np.float32): nccl.NCCL_FLOAT32,
    np.dtype(np.float64): nccl.NCCL_FLOAT64,
    np.dtype(np.int8): nccl.NCCL_INT8,
    np.dtype(np.uint8): nccl.NCCL_UINT8,
    np.dtype(np.int32): nccl.NCCL_INT32,
    np.dtype(np.uint32): nccl.NCCL_UINT32,
    np.dtype(np.int64): nccl.NCCL_INT64,
    np.dtype(np.uint64): nccl.NCCL_UINT64,
    np.dtype(np.bool_): nccl.NCCL_UINT8,  # reduced with MAX (OR) / MIN (AND)
}
if bfloat16_supported():
    import ml_dtypes

    NCCL_TYPES[np.dtype(ml_dtypes.bfloat16)] = nccl.NCCL_BFLOAT16
_OPS = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN,
        "product": nccl.NCCL_PROD}


def nccl_dtype(array: Any) -> int:
    """The NCCL datatype of a CuPy array.

    Raises:
        TypeError: not a CuPy array, or a dtype NCCL has no type for.
    """
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"the NCCL backend takes CuPy arrays, got {type(array).__name__}")
    if array.dtype not in NCCL_TYPES:
        raise TypeError(f"dtype {array.dtype} is not supported by the NCCL backend (supported: "
                        f"{', '.join(sorted(str(t) for t in NCCL_TYPES))})")
    return NCCL_TYPES[array.dtype]


def nccl_op(array: Any, op: str) -> int:
    """The NCCL reduction of ``op`` (of :data:`~distopt.comm.base.REDUCE_OPS`) on ``array``'s dtype (bool: MAX for OR,
    MIN for AND)."""
    return {"sum": nccl.NCCL_MAX, "product": nccl.NCCL_MIN}.get(op, _OPS[op]) if array.dtype == np.bool_ else _OPS[op]
