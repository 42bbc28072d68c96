"""Half-precision wire format for dense gradient exchange, with scaling.

Gradients are multiplied by a pre-scale and cast to float16 or bfloat16 before the reduction, and cast back and
multiplied by a post-scale after it (fp16 compression as in PyTorch's ``fp16_compress_hook``). The split of the
1/world_size averaging into a pre- and a post-divide follows fairscale PR 565, Horovod #1699 and PyTorch #57410.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core._fastcast import cast_into
from ..core._array import cupy_major
from ._xp import is_cupy, xp

WIRE_DTYPES = ("float16", "bfloat16")


def to_wire(x: Any, wire_dtype: str, scale: float = 1.0) -> Any:
    """``(x * scale)`` cast to the wire dtype.

    The product is taken in ``x.dtype`` (skipped when ``scale == 1``), then rounded to nearest; magnitudes past the wire
    dtype's range become ``inf`` (float16: 65504) and those below its smallest subnormal become 0 (float16: about 6e-8).

    Args:
        x: Array of any shape (NumPy or CuPy), floating point.
        wire_dtype: ``"float16"`` or ``"bfloat16"`` (ml_dtypes' type: NumPy, and CuPy 14 or later, which holds
            ml_dtypes' bfloat16 arrays).
        scale: Factor applied before the cast, e.g. ``pre`` of :func:`half_scales`.

    Returns:
        Array of the shape of ``x`` in the wire dtype (2 bytes per element).

    Raises:
        ValueError: If ``wire_dtype`` is not one of ``WIRE_DTYPES``.
        TypeError: If ``wire_dtype`` is bfloat16 and ``x`` is an array of CuPy 13 or older.
        ImportError: If bfloat16 is asked for and ml_dtypes is not installed.
    """
    wire = _wire_dtype(wire_dtype, x)
    if scale != 1:
        x = x * x.dtype.type(scale)
    if isinstance(x, np.ndarray) and x.dtype == np.float32:  # fast kernels where PyTorch is installed
        return cast_into(np.ascontiguousarray(x), np.empty(x.shape, dtype=wire))
    return x.astype(wire)


def from_wire(w: Any, dtype: Any, scale: float = 1.0, out: Any = None) -> Any:
    """``w`` cast to ``dtype``, then multiplied by ``scale`` (in ``dtype``).

    Args:
        w: Array in a wire dtype (NumPy or CuPy), e.g. the reduced sum.
        dtype: Result dtype, e.g. ``"float32"``.
        scale: Factor applied after the cast, e.g. ``post`` of :func:`half_scales`.
        out: the result array (``w``'s size and device, ``dtype``), e.g. the gradient bucket itself: no new array, no
            copy; None allocates.

    Returns:
        Array of the shape of ``w`` (``out``'s shape if given) in ``dtype``, on the device of ``w``.
    """
    if isinstance(w, np.ndarray) and np.dtype(dtype) == np.float32 and (out is None or out.flags.c_contiguous):
        target = np.empty(w.shape, dtype=np.float32) if out is None else out
        out = cast_into(np.ascontiguousarray(w).reshape(target.shape), target)  # PyTorch's kernels if installed
    elif out is None:
        out = w.astype(dtype)
    else:
        out[...] = w.reshape(out.shape)
    if scale != 1:
        out *= out.dtype.type(scale)
    return out


def half_scales(world_size: int, predivide: float | None = None) -> tuple[float, float]:
    """Pre- and post-reduction factors that together average over ``world_size`` ranks.

    ``pre = 1 / predivide`` multiplies each rank's gradient before the cast to the wire dtype (:func:`to_wire`);
    ``post = predivide / world_size`` multiplies the reduced sum after the cast back (:func:`from_wire`);
    ``pre * post == 1 / world_size``.

    The default ``predivide = world_size`` divides fully before the sum, so the wire sum never exceeds the largest rank
    value: 4 ranks each sending 40000 in float16 send 10000 each and sum to 40000, no overflow. ``predivide = 1``
    divides only after the sum: small gradients survive the cast better (8 ranks' 1.2e-7 stays nonzero in float16,
    where 1.2e-7 / 8 would round to 0), but the sum of large ones can overflow to inf (4 × 40000 > 65504). Values in
    between (e.g. ``sqrt(world_size)``) trade one risk against the other.

    Args:
        world_size: Number of ranks in the reduction, ``>= 1``.
        predivide: Factor divided out before the reduction, finite and ``> 0``; ``None`` means ``world_size``.

    Returns:
        ``(pre, post)``.

    Raises:
        ValueError: If ``world_size < 1`` or ``predivide`` is not a finite positive number.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    predivide = world_size if predivide is None else predivide
    if not (predivide > 0 and math.isfinite(predivide)):
        raise ValueError(f"predivide must be finite and > 0, got {predivide}")
    return 1.0 / predivide, predivide / world_size


def _wire_dtype(name: str, x: Any) -> Any:
    """The dtype object for the wire dtype ``name``, for arrays like ``x``."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {name!r}")
    if name == "float16":
        return xp(x).float16
    if is_cupy(x) and cupy_major(xp(x)) < 14:
        raise TypeError(f"bfloat16 wire dtype on CuPy arrays needs CuPy 14 or later (bfloat16 through ml_dtypes), "
                        f"this is CuPy {xp(x).__version__}; use 'float16'")
    try:
        import ml_dtypes
    except ImportError as e:
        raise ImportError("bfloat16 wire dtype on NumPy needs the ml_dtypes package: pip install ml_dtypes") from e
    return ml_dtypes.bfloat16
