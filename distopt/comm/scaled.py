"""Scaled reductions: ``postscale * reduce(prescale * x)``, Horovod's ``prescale_factor`` / ``postscale_factor``.

The factors multiply the arrays elementwise as Horovod's ``ScaleBufferCPUImpl`` does
(``horovod/common/ops/collective_operations.h``): integers in float64, the product cast back to the integer type
(truncated toward zero, the C++ conversion); float16 and bfloat16 in float32, rounded once; float32 by the factor
rounded to float32; float64 in float64. A factor other than 1 on a bool array is a TypeError (a logical reduction has
nothing to scale). ``"avg"`` with a factor runs as a sum whose result is multiplied by ``postscale / size`` (as
Horovod folds the division into the postscale); without factors nothing changes. ``"product"`` has no reduce-scatter
on every backend (gloo's host reduce-scatter), so :func:`reduce_scatter_scaled` runs it as an all-reduce of the whole
array and keeps this rank's segment (``size`` times the wire of a reduce-scatter).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Communicator

__all__ = ["check_scale", "scale_in_place", "all_reduce_scaled", "reduce_scatter_scaled"]


def check_scale(name: str, factor: Any, dtype: Any) -> float:
    """Validate one scale factor for arrays of ``dtype``; return it as a Python float.

    Args:
        name: the parameter's name, for messages (``"prescale_factor"``).
        factor: a real number (int or float, NumPy's included; not a bool).
        dtype: the NumPy (or CuPy, ml_dtypes) dtype of the arrays it scales.

    Raises:
        TypeError: ``factor`` is not a real number; or it is not 1 and ``dtype`` is bool or not a number type.
        ValueError: ``factor`` is not finite.
    """
    if isinstance(factor, (bool, np.bool_)) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number (int or float), got {factor!r}")
    value = float(factor)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    kind = np.dtype(dtype).kind
    if value != 1.0 and not (kind in "iuf" or np.dtype(dtype).name == "bfloat16"):
        what = "a bool array (a logical reduction has nothing to scale)" if kind == "b" else f"dtype {dtype}"
        raise TypeError(f"{name}={value!r} cannot scale {what}; scale integer or float arrays only")
    return value


def scale_in_place(flat: Any, factor: float) -> Any:
    """Multiply the C-contiguous NumPy or CuPy array ``flat`` (any shape) by ``factor`` in place, in Horovod's
    precision (module docs); returns ``flat``. A factor of 1 changes nothing."""
    if factor == 1.0:
        return flat
    dtype = flat.dtype
    if dtype.kind in "iu":
        wide = flat.astype(np.float64)
        wide *= factor
        flat[...] = wide  # truncated toward zero
    elif dtype.itemsize == 2:  # float16, bfloat16
        wide = flat.astype(np.float32)
        wide *= np.float32(factor)
        flat[...] = wide
    else:
        flat *= dtype.type(factor)
    return flat


def _ops(comm: Communicator, op: str, prescale: float, postscale: float) -> tuple[str, float]:
    """The op the backend runs and the factor applied after it."""
    if op == "avg" and (prescale != 1.0 or postscale != 1.0):
        return "sum", postscale / comm.size
    return op, postscale


def all_reduce_scaled(comm: Communicator, array: Any, op: str = "sum", prescale: float = 1.0,
                      postscale: float = 1.0) -> Any:
    """In-place ``postscale * reduce(prescale * array)`` across ``comm``; returns ``array``.

    Args:
        comm: the communicator.
        array: C-contiguous, any shape, the same shape and dtype on every rank (as :meth:`Communicator.all_reduce`).
        op: as :meth:`Communicator.all_reduce`.
        prescale: applied to this rank's array before the reduction (validated by :func:`check_scale`).
        postscale: applied to the result.

    Raises:
        TypeError: as :meth:`Communicator.all_reduce` (and ValueError, CollectiveMismatchError,
            CollectiveTimeoutError).
    """
    if prescale == 1.0 and postscale == 1.0:
        comm.all_reduce(array, op=op)
        return array
    run, after = _ops(comm, op, prescale, postscale)
    scale_in_place(array, prescale)
    comm.all_reduce(array, op=run)
    scale_in_place(array, after)
    return array


def reduce_scatter_scaled(comm: Communicator, work: Any, counts: Sequence[int], op: str = "sum",
                          prescale: float = 1.0, postscale: float = 1.0) -> Any:
    """This rank's segment of ``postscale * reduce(prescale * work)``: a 1-D array of ``counts[rank]`` ELEMENTS.

    Args:
        comm: the communicator.
        work: 1-D, C-contiguous, ``sum(counts)`` elements; overwritten (pass a copy you own).
        counts: ELEMENTS of each rank's segment (as :meth:`ShardingCommunicator.reduce_scatter`).
        op: as :meth:`Communicator.all_reduce`; ``"product"`` runs as an all-reduce (module docs).
        prescale: applied to ``work`` before the reduction.
        postscale: applied to the segment.

    Returns:
        The segment; not a view into ``work``.

    Raises:
        TypeError: as :meth:`ShardingCommunicator.reduce_scatter` (and ValueError, CollectiveMismatchError,
            CollectiveTimeoutError).
    """
    run, after = _ops(comm, op, prescale, postscale)
    scale_in_place(work, prescale)
    if run == "product":
        comm.all_reduce(work, op=run)
        start = sum(counts[:comm.rank])
        mine = work[start:start + counts[comm.rank]]
    else:
        mine = comm.reduce_scatter(work, list(counts), run)
    if getattr(mine, "base", None) is not None:
        mine = mine.copy()  # not a view that keeps the whole work buffer alive
    return scale_in_place(mine, after)
