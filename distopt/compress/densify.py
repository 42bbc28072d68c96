"""Scatter-add of sparse (index, value) pairs into a dense gradient vector."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._xp import xp


def densify(indices: Any, values: Any, n: int, dtype: Any = None, out: Any = None) -> Any:
    """Dense vector of length ``n`` holding the sum of ``values`` at ``indices``.

    The receiving side of sparse (top-k or threshold) gradient exchange
    (Aji & Heafield 2017): the pairs gathered from all ranks are summed, so
    values at duplicate indices ADD and positions not listed are 0.

    Precision: values are accumulated in float64 (``np.bincount`` /
    ``cupy.bincount`` with weights) and rounded once to ``dtype``. Float16
    and float32 values convert to float64 exactly, so their sums carry far
    less rounding error than sums in the input dtype (``1e8 + 1 - 1e8`` is
    1, not 0, in float32); float64 values are added in float64 as by a
    plain loop. On NumPy duplicates are added in
    the order given; on CuPy the order is unspecified (atomic adds), so
    float64 sums can differ in the last bit between runs.

    Args:
        indices: 1-D integer array of positions in ``[0, n)``, or a sequence
            of such arrays (one per rank), concatenated in order.
        values: 1-D array of the same length as ``indices`` (or a sequence
            of arrays matching ``indices``).
        n: Length of the result, in elements.
        dtype: Result dtype; defaults to the dtype of ``values``.
        out: optional 1-D array of ``n`` elements of ``dtype`` to write the
            result into (zeroed first). Used in place of a scratch array
            when ``dtype`` is the accumulation dtype (float32 or float64):
            one pass fewer and no allocation, the same result.

    Returns:
        1-D array of ``n`` elements of ``dtype``, on the device of ``values``
        (``out`` when it was used).

    Raises:
        ValueError: If lengths differ, ``indices`` is not integer, an index
            is negative or ``>= n``, or ``n < 0``.
    """
    if isinstance(indices, Sequence):
        indices, values = _concat(indices, np.intp), _concat(values, np.float64)
    mod = xp(values)
    if n < 0:
        raise ValueError(f"length n must be >= 0, got {n}")
    if indices.ndim != 1 or indices.shape != values.shape:
        raise ValueError(
            f"indices and values must be 1-D of the same length, got {indices.shape} and {values.shape}"
        )
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be integers, got {indices.dtype}")
    dtype = values.dtype if dtype is None else np.dtype(dtype)
    if out is not None and (out.shape != (n,) or out.dtype != dtype):
        raise ValueError(f"out must be 1-D of {n} elements of {dtype}, got {out.shape} {out.dtype}")
    if indices.size == 0:
        if out is None:
            return mod.zeros(n, dtype=dtype)
        out.fill(0)
        return out
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= n:
        raise ValueError(f"index {low if low < 0 else high} out of range for length {n}")
    # accumulate in float32 (float64 for float64 values): what a dense float32 all-reduce does;
    # a float64 scratch of n elements would cost more than the exchange it serves
    acc = np.float64 if np.dtype(values.dtype) == np.float64 or dtype == np.float64 else np.float32
    if out is not None and out.dtype == acc:
        dense = out
        dense.fill(0)
    else:
        dense = mod.zeros(n, dtype=acc)
    mod.add.at(dense, indices, values.astype(acc, copy=False))  # NumPy, and CuPy >= 13 (atomic adds)
    if out is not None and dense is not out:
        out[...] = dense
        return out
    return dense.astype(dtype, copy=False)


def _concat(arrays: Sequence[Any], empty_dtype: Any) -> Any:
    """Concatenation of ``arrays``; an empty NumPy array of ``empty_dtype`` for no arrays."""
    if not arrays:
        return np.empty(0, dtype=empty_dtype)
    return xp(arrays[0]).concatenate(arrays)
