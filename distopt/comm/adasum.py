"""Adasum: the ranks' vectors combined by adaptive summation instead of summed.

Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021), as Horovod implements it
(``horovod/common/ops/adasum/adasum.h``, ``FusedAllreduce``). Two vectors combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where the squared norm is below ``sqrt(DBL_MIN)``, as in Horovod): the sum of orthogonal vectors,
the average of parallel ones. W ranks (a power of two) combine as a binary tree in rank order: at level ``L = 1, 2, 4,
...`` the result of ranks ``[k 2L, k 2L + L)`` combines with that of ``[k 2L + L, (k + 1) 2L)``, the lower ranks' as
``a``. So for W = 4: ``adasum(adasum(g0, g1), adasum(g2, g3))``.

The exchange is Horovod's vector halving, distance doubling: at level L, rank r and its neighbor ``r ^ L`` hold the
same segment of the vector; the one with bit L clear keeps the first half, the other the second half, and each sends
the neighbor its own copy of the half the neighbor keeps (one :func:`~distopt.comm.uneven.all_to_all_v`). Each rank
computes ``a.b``, ``|a|^2`` and ``|b|^2`` of its half in float64 per tensor (on the host for CuPy arrays: NumPy's
bits), the 2L ranks of its block add them (one float64 all-reduce over the communicator, each block in its own rows),
and it combines its half with the coefficients (in float64, rounded once to the dtype per level). After the last level
every rank holds a distinct segment of the result; one ``all_gather_v`` gives every rank all of it, the same bits on
every rank. What travels per rank: about the vector once in the halvings and once in the gather, plus
``3 x tensors`` float64 per block and level.

Non-power-of-two worlds are refused, as Horovod does (``NotImplementedError: Running Adasum with non-power of 2 ranks
is not supported yet``, ``horovod/torch/mpi_ops.py``): here a ValueError.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core._array import xp_of
from ..core.buckets import is_float
from .base import _check_contiguous
from .uneven import all_to_all_v

__all__ = ["ADASUM", "check_world", "check_adasum", "adasum_all_reduce", "coefficients"]

#: The name of the reduction (``all_reduce(array, op=ADASUM)``).
ADASUM = "adasum"

#: Below this squared norm a vector keeps the coefficient 1 (Horovod's ``sqrt(DBL_MIN)``).
_TINY = math.sqrt(sys.float_info.min)


def check_world(size: int, what: str = "op='adasum'") -> None:
    """Raise ValueError unless ``size`` (ranks) is a power of two; ``what`` starts the message."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"{what} needs a power-of-two number of ranks (Horovod's rule: 'Running Adasum with non-power "
                         f"of 2 ranks is not supported yet'), got {size}")


def check_adasum(array: Any, size: int) -> None:
    """Validate an Adasum all-reduce of ``array`` over ``size`` ranks (no communication).

    Raises:
        TypeError: ``array`` is not floating point (float16, bfloat16, float32, float64) or not C-contiguous.
        ValueError: ``size`` is not a power of two.
    """
    if not is_float(array):
        raise TypeError(f"op='adasum' combines floating-point arrays (float16, bfloat16, float32, float64), got dtype "
                        f"{array.dtype}")
    _check_contiguous(array)
    check_world(size)


def coefficients(dot: Any, anormsq: Any, bnormsq: Any) -> tuple[Any, Any]:
    """The float64 coefficients ``(1 - a.b / (2|a|^2), 1 - a.b / (2|b|^2))`` of one pair (arrays or scalars), each 1
    where its squared norm is below ``sqrt(DBL_MIN)``."""
    dot, anormsq, bnormsq = (np.asarray(x, dtype=np.float64) for x in (dot, anormsq, bnormsq))
    with np.errstate(divide="ignore", invalid="ignore"):
        acoeff = np.where(anormsq >= _TINY, 1.0 - dot / anormsq * 0.5, 1.0)
        bcoeff = np.where(bnormsq >= _TINY, 1.0 - dot / bnormsq * 0.5, 1.0)
    return acoeff, bcoeff


def _halve(segments: list[tuple[int, int]], level: int) -> list[tuple[int, int]]:
    """Every rank's segment after level ``level``: bit ``level`` clear keeps the first half (``count >> 1``
    elements), set the second."""
    out = []
    for q, (lo, hi) in enumerate(segments):
        mid = lo + ((hi - lo) >> 1)
        out.append((mid, hi) if q & level else (lo, mid))
    return out


def _pieces(bounds: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(tensor, start, end)`` of every non-empty part of a tensor inside ``[lo, hi)``, offsets from ``lo``."""
    out = []
    for t, (start, end) in enumerate(bounds):
        s, e = max(start, lo), min(end, hi)
        if s < e:
            out.append((t, s - lo, e - lo))
    return out


def adasum_all_reduce(comm: Any, flat: Any, counts: Sequence[int] | None = None) -> Any:
    """Combine every rank's ``flat`` by Adasum (see the module docs), in place; collective.

    Args:
        comm: the communicator (every rank of it calls this with the same element count, dtype and ``counts``).
        flat: a 1-D C-contiguous float array (NumPy or CuPy).
        counts: ELEMENTS of each tensor packed back to back in ``flat`` (each combined with its own coefficients, as
            Horovod's fused buffers); None: one tensor.

    Returns:
        ``flat``, holding the combination (the same bits on every rank).

    Raises:
        TypeError / ValueError: as :func:`check_adasum`; ValueError: ``counts`` do not sum to ``flat.size``.
        CollectiveMismatchError / CollectiveTimeoutError: from the backend's collectives.
    """
    size, rank, n = comm.size, comm.rank, int(flat.size)
    check_adasum(flat, size)
    counts = [n] if counts is None else [int(c) for c in counts]
    if sum(counts) != n or min(counts, default=0) < 0:
        raise ValueError(f"counts must be >= 0 and sum to the array's {n} elements, got {counts}")
    if size == 1 or n == 0:
        return flat
    xp = xp_of(flat)
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    bounds = list(zip(starts[:-1], starts[1:]))
    segments = [(0, n)] * size
    level = 1
    while level < size:
        halves = _halve(segments, level)
        matrix = [[0] * size for _ in range(size)]
        for q in range(size):
            lo, hi = halves[q ^ level]  # q sends its copy of the half its neighbor keeps
            matrix[q][q ^ level] = hi - lo
        (lo, hi), (nlo, nhi) = halves[rank], halves[rank ^ level]
        theirs = all_to_all_v(comm, flat[nlo:nhi], matrix).astype(np.float64)
        mine = flat[lo:hi].astype(np.float64)
        a, b = (theirs, mine) if rank & level else (mine, theirs)
        pieces = _pieces(bounds, lo, hi)
        ha, hb = (a, b) if xp is np else (xp.asnumpy(a), xp.asnumpy(b))  # dot products on the host: NumPy's bits
        table = np.zeros((size // (2 * level), len(counts), 3), dtype=np.float64)  # rows of each block of 2L ranks
        row = table[rank // (2 * level)]
        for t, s, e in pieces:
            row[t] = np.dot(ha[s:e], hb[s:e]), np.dot(ha[s:e], ha[s:e]), np.dot(hb[s:e], hb[s:e])
        comm.all_reduce(table, "sum")
        acoeff, bcoeff = coefficients(row[:, 0], row[:, 1], row[:, 2])
        out = flat[lo:hi]
        for t, s, e in pieces:
            out[s:e] = (float(acoeff[t]) * a[s:e] + float(bcoeff[t]) * b[s:e]).astype(flat.dtype)
        segments, level = halves, level * 2
    lo, hi = segments[rank]
    parts = comm.all_gather_v(xp.ascontiguousarray(flat[lo:hi]))
    for q, part in enumerate(parts):
        qlo, qhi = segments[q]
        if q != rank and qhi > qlo:
            flat[qlo:qhi] = part
    return flat
