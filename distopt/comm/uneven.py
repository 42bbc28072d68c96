"""Uneven all-to-all: every rank sends a different number of elements to each rank (MPI's ``Alltoallv``).

The exchange is described by one ``size x size`` matrix of ELEMENT counts, the same on every rank: ``matrix[i][j]``
elements go from rank i to rank j. Rank ``rank`` passes a 1-D array of ``sum(matrix[rank])`` elements (its segment
for rank j starting at element ``sum(matrix[rank][:j])``) and receives a new 1-D array of ``sum(matrix[i][rank] for
i)`` elements, rank i's segment at element ``sum(matrix[k][rank] for k < i)``.

The MPI (``Ialltoallv``), torch (``all_to_all_single`` with split sizes, moved as bytes) and shm backends have it as
``Communicator.all_to_all_v(array, matrix)``; they agree on a CRC-32 of the matrix and the dtype first, so ranks that
pass different matrices raise :class:`~distopt.errors.CollectiveMismatchError` on every rank. On a communicator without
the method (NCCL, the single-process world, a communicator of your own) :func:`all_to_all_v` pads every segment to the
largest count and runs the backend's equal ``all_to_all``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core._array import xp_of
from .base import _check_contiguous

__all__ = ["check_matrix", "received", "all_to_all_v"]


def check_matrix(array: Any, matrix: Sequence[Sequence[int]], rank: int, size: int) -> list[list[int]]:
    """Validate the 1-D ``array`` and the count ``matrix`` of an uneven all-to-all; shared by the backends.

    Returns:
        The matrix as ``size`` lists of ``size`` Python ints.

    Raises:
        ValueError: ``array`` is not 1-D; ``matrix`` is not ``size x size`` ints >= 0, or its row ``rank`` does not sum
            to the array's element count.
        TypeError: ``array`` is not C-contiguous.
    """
    if array.ndim != 1:
        raise ValueError(f"array must be 1-D, got shape {tuple(array.shape)}")
    _check_contiguous(array)
    try:
        rows = [list(row) for row in matrix]
    except TypeError:
        raise ValueError(f"matrix must be {size} x {size} ints (ELEMENTS from rank i to rank j)") from None
    fine = len(rows) == size and all(len(row) == size for row in rows)
    if not fine or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0
                           for row in rows for c in row):
        raise ValueError(f"matrix must be {size} x {size} ints >= 0 (ELEMENTS from rank i to rank j), got {rows}")
    rows = [[int(c) for c in row] for row in rows]
    if sum(rows[rank]) != int(array.shape[0]):
        raise ValueError(f"row {rank} of the matrix (this rank's sends) must sum to the array's {array.shape[0]} "
                         f"elements, got {rows[rank]} (sum {sum(rows[rank])})")
    return rows


def received(matrix: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The ELEMENTS ``rank`` receives from each rank: column ``rank`` of ``matrix``."""
    return [int(row[rank]) for row in matrix]


def all_to_all_v(comm: Any, array: Any, matrix: Sequence[Sequence[int]]) -> Any:
    """Uneven all-to-all of the 1-D ``array`` (NumPy or CuPy) as the module docs describe; a new 1-D array.

    Runs ``comm.all_to_all_v`` where the backend has it, else the padded equal ``all_to_all`` (every segment padded
    to ``max(matrix)`` elements: ``size * max(matrix)`` elements sent per rank).

    Raises:
        ValueError / TypeError: as :func:`check_matrix`.
        CollectiveMismatchError: ranks passed different matrices or dtypes (the backends' own form), or element counts
            that differ (the padded form).
        CollectiveTimeoutError: the collective missed its deadline.
    """
    own = getattr(comm, "all_to_all_v", None)
    if callable(own):
        return own(array, matrix)
    rows = check_matrix(array, matrix, comm.rank, comm.size)
    xp, size = xp_of(array), comm.size
    width = max(max(row) for row in rows)
    sends = rows[comm.rank]
    padded = xp.zeros((size, width), dtype=array.dtype)
    start = 0
    for j, count in enumerate(sends):
        padded[j, :count] = array[start:start + count]
        start += count
    got = comm.all_to_all(padded) if width else padded
    parts = [got[i, :count] for i, count in enumerate(received(rows, comm.rank))]
    return xp.concatenate(parts) if parts else xp.zeros(0, dtype=array.dtype)
