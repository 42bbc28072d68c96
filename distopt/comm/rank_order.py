"""The one rank-order reduction: every rank combines every rank's contribution in the same order.

Floating-point addition is not associative, so a sum is the same on every rank only when every rank adds the same
numbers in the same order. The host reductions (shared memory, the small all-reduces MPI and torch.distributed carry in
their control block, the tests' simulated world) all go through :func:`reduce_in_rank_order`.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["reduce_in_rank_order", "accumulator_dtype"]

_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply}
_BOOL_UFUNCS = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and, "product": np.logical_and}


@functools.lru_cache(maxsize=64)
def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a reduction of ``dtype`` accumulates in: float32 for float16 and bfloat16, else ``dtype``."""
    if dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16"):
        return np.dtype(np.float32)
    return dtype


def reduce_in_rank_order(rows: Sequence[np.ndarray], op: str, acc: np.ndarray) -> np.ndarray:
    """``acc[...] = ((rows[0] . rows[1]) . rows[2]) . ...``: every rank's contribution, in rank order.

    Every step is computed in ``acc.dtype`` (16-bit float rows widen exactly to a float32 ``acc``), so every rank that
    passes the same rows gets bitwise the same ``acc``.

    Args:
        rows: at least one array per rank, in rank order, each of ``acc``'s shape (elements), of ``acc.dtype`` or one
            that widens exactly to it (float16/bfloat16 to float32); ``acc`` may be ``rows[0]`` or ``rows[1]``.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"``; booleans combine as OR (sum, max) and AND
            (min, product). ``"avg"``
            combines as ``"sum"``: the division by the number of ranks is the caller's, since backends differ in whether
            they divide before or after rounding a float32 accumulator to 16 bits (each as its large path does).
        acc: the result, written in place; see :func:`accumulator_dtype` for the dtype to accumulate in.

    Returns:
        ``acc``.

    Raises:
        KeyError: ``op`` is not one of the five (callers validate it first with
            :func:`~distopt.comm.base.check_reduce_args`).
    """
    dtype = acc.dtype
    if len(rows) == 1:
        acc[...] = rows[0]
        return acc
    ufunc = _BOOL_UFUNCS[op] if dtype.kind == "b" else _UFUNCS[op]
    ufunc(rows[0], rows[1], out=acc, dtype=dtype)
    for row in rows[2:]:
        ufunc(acc, row, out=acc, dtype=dtype)
    return acc
