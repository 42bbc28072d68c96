"""Scatter-add of sparse (index, value) pairs into a dense gradient vector."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._xp import xp


def densify(indices: Any, values: Any, n: int, dtype: Any = None, out: Any = None) -> Any:
    """Dense vector of length ``n`` holding the sum of ``values`` at ``indices``.

    The receiving side of sparse (top-k or threshold) gradient exchange (Aji & Heafield 2017): the pairs gathered from
    all ranks are summed, so values at duplicate indices ADD and positions not listed are 0.

    Order and precision: the pairs are added in the order given (rank order when one part per rank is passed), in
    float32 (float64 when the values or ``dtype`` are float64), then rounded once to ``dtype``: what a dense float32
    all-reduce in rank order does. NumPy and CuPy give the same bits, on every rank: CuPy's scatter-add
    (``cupy.add.at``) uses atomics, whose order is unspecified, so on CuPy each part (whose positions are distinct, as
    top-k and threshold selections are) is added by one plain indexed add, part after part; a single array with
    repeated positions is added in passes over a stable sort by position (one host synchronisation per pass, plus one).

    Args:
        indices: 1-D integer array of positions in ``[0, n)``, or a sequence of such arrays (one per rank, or the rows
            of a gathered ``(ranks, k)`` array), added in order.
        values: 1-D array of the same length as ``indices`` (or a sequence of arrays matching ``indices``).
        n: Length of the result, in elements.
        dtype: Result dtype; defaults to the dtype of ``values``.
        out: optional 1-D array of ``n`` elements of ``dtype`` to write the result into (zeroed first). Used in place
            of a scratch array when ``dtype`` is the accumulation dtype (float32 or float64): no extra pass or
            allocation, the same result.

    Returns:
        1-D array of ``n`` elements of ``dtype``, on the device of ``values`` (``out`` when it was used).

    Raises:
        ValueError: If lengths differ, ``indices`` is not integer, an index is negative or ``>= n`` (checked on NumPy
            only: on CuPy the check would cost a host synchronisation per call), or ``n < 0``.
    """
    parts, split = _parts(indices, values)
    val0 = parts[0][1] if parts else np.empty(0, np.float64 if dtype is None else dtype)
    mod = xp(val0)
    if n < 0:
        raise ValueError(f"length n must be >= 0, got {n}")
    for idx, val in parts:
        if idx.ndim != 1 or idx.shape != val.shape:
            raise ValueError(f"indices and values must be 1-D of the same length, got {idx.shape} and {val.shape}")
        if idx.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got {idx.dtype}")
    dtype = val0.dtype if dtype is None else np.dtype(dtype)
    if out is not None and (out.shape != (n,) or out.dtype != dtype):
        raise ValueError(f"out must be 1-D of {n} elements of {dtype}, got {out.shape} {out.dtype}")
    parts = [(idx, val) for idx, val in parts if idx.size]
    if not parts:
        if out is None:
            return mod.zeros(n, dtype=dtype)
        out.fill(0)
        return out
    on_host = mod is np
    if on_host:
        low = min(int(idx.min()) for idx, _ in parts)
        high = max(int(idx.max()) for idx, _ in parts)
        if low < 0 or high >= n:
            raise ValueError(f"index {low if low < 0 else high} out of range for length {n}")
    # accumulate in float32 (float64 for float64 values) as a dense all-reduce does: a float64 scratch costs more
    acc = np.float64 if np.dtype(val0.dtype) == np.float64 or dtype == np.float64 else np.float32
    if out is not None and out.dtype == acc:
        dense = out
        dense.fill(0)
    else:
        dense = mod.zeros(n, dtype=acc)
    if on_host:
        idx = parts[0][0] if len(parts) == 1 else np.concatenate([i for i, _ in parts])
        val = parts[0][1] if len(parts) == 1 else np.concatenate([v for _, v in parts])
        np.add.at(dense, idx, val.astype(acc, copy=False))  # sequential, in the order given
    elif split:
        for idx, val in parts:  # distinct positions within a part: a plain indexed add, no atomics
            dense[idx] += val.astype(acc, copy=False)
    else:
        _add_in_passes(mod, dense, parts[0][0], parts[0][1].astype(acc, copy=False))
    if out is not None and dense is not out:
        out[...] = dense
        return out
    return dense.astype(dtype, copy=False)


def _parts(indices: Any, values: Any) -> tuple[list[tuple[Any, Any]], bool]:
    """``(indices, values)`` pairs, one per part of a sequence or row of a 2-D array (and True), else the one pair (and
    False)."""
    if isinstance(indices, Sequence) or getattr(indices, "ndim", 1) == 2:
        if len(indices) != len(values):
            raise ValueError(f"indices and values must have as many parts, got {len(indices)} and {len(values)}")
        return [(indices[r], values[r]) for r in range(len(indices))], True
    return [(indices, values)], False


def _add_in_passes(mod: Any, dense: Any, idx: Any, val: Any) -> None:
    """``dense[idx] += val`` with repeated positions added in the order given, on a device without atomics: a stable
    sort by position groups each position's values in their order; pass ``j`` adds the ``j``-th value of every group
    (distinct positions within a pass)."""
    order = mod.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    first = mod.ones(idx.size, dtype=bool)
    first[1:] = idx[1:] != idx[:-1]
    starts = mod.flatnonzero(first)  # one host synchronisation
    group = mod.cumsum(first) - 1
    place = mod.arange(idx.size) - starts[group]
    for j in range(int(place.max()) + 1):
        chosen = mod.flatnonzero(place == j)
        dense[idx[chosen]] += val[chosen]
