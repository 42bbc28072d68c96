"""The communicator protocol shared by every backend.

A communicator moves arrays between the ranks of one job; it knows nothing about models. All collectives are blocking
from the caller's point of view (NCCL: ordered on the communicator's CUDA stream, see ``nccl.py``), act in place where
stated, and must be called by every rank in the same order with the same element count and dtype.

The sharded collectives (:meth:`Communicator.reduce_scatter`, :meth:`Communicator.all_gather_into`,
:meth:`Communicator.all_to_all`) split a 1-D array into per-rank segments of ``counts`` ELEMENTS (default
:func:`split_counts`); :func:`check_counts` and :func:`check_rows` validate their arguments the same way on every
backend. The MPI, torch and NCCL backends also have ``reduce_scatter_async`` and ``all_gather_into_async`` (same
arguments; a handle whose ``test()`` never blocks and whose ``wait()``, callable more than once, returns what the
blocking form returns); shm and single do not (run their blocking forms on a worker thread instead). The torch backend
also has ``all_gather_pieces_async`` (CPU memory: pieces of arrays, in place; :mod:`~distopt.comm.torch_shards`).
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .wait import DEFAULT_TIMEOUT, TIMEOUT_ENV, default_timeout, resolve_timeout

__all__ = ["Communicator", "ShardingCommunicator", "REDUCE_OPS", "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "default_timeout",
           "resolve_timeout", "check_reduce_args", "split_counts", "check_counts", "check_rows", "counts_digest"]

#: Reduction operations every backend supports, by name (``"product"``: Horovod's ``Product``, ``ReduceOp.PRODUCT``).
REDUCE_OPS = ("sum", "avg", "max", "min", "product")


@runtime_checkable
class Communicator(Protocol):
    """What distopt needs from a backend.

    Attributes:
        rank: this process's rank in the communicator, ``0 <= rank < size``.
        size: the number of ranks (the world size).
        name: the backend's registry name (``"mpi"``, ``"nccl"``, ``"shm"``, ``"torch"``, ``"single"``).
    """

    rank: int
    size: int
    name: str

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """Reduce ``array`` across ranks in place and return it.

        Args:
            array: a C-contiguous array (NumPy for CPU backends, CuPy for NCCL) of any shape, including size 0. Every
                rank passes the same element count and dtype.
            op: ``"sum"``, ``"avg"`` (sum / size), ``"max"``, ``"min"`` or ``"product"``; integers take all but
                ``"avg"`` (TypeError), booleans reduce as logical OR for sum/max and logical AND for min/product.

        Raises:
            TypeError: unsupported dtype or op for that dtype.
            CollectiveMismatchError: ranks passed different counts/dtypes/ops.
            CollectiveTimeoutError: the collective missed its deadline.
        """
        ...

    def broadcast(self, array: Any, root: int = 0) -> Any:
        """Overwrite ``array`` on every rank with root's contents, in place."""
        ...

    def all_gather(self, array: Any) -> Any:
        """Gather equal-sized arrays: returns shape ``(size, *array.shape)``."""
        ...

    def all_gather_v(self, array: Any) -> list[Any]:
        """Gather 1-D arrays whose lengths differ per rank (may be 0).

        Returns a list of ``size`` arrays, entry ``r`` being rank r's input. Every rank must pass the same dtype.
        """
        ...

    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""
        ...

    def close(self) -> None:
        """Release the backend's resources; idempotent.

        Every later call raises :class:`~distopt.errors.CommunicatorClosedError` at once. distopt's backends also have
        ``wait_seconds`` (seconds spent in blocking calls) and ``closed``; see :mod:`distopt.comm.lifecycle`. Those that
        were never closed are closed at interpreter exit.
        """
        ...


@runtime_checkable
class ShardingCommunicator(Communicator, Protocol):
    """A :class:`Communicator` with the collectives of a sharded optimizer (``DistOpt(zero=1|2|3)``) and of
    ``all_to_all`` exchanges. Every distopt backend is one; a communicator of your own needs these only for ``zero``."""

    def reduce_scatter(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Any:
        """Reduce ``array`` across ranks, keeping only this rank's segment.

        Args:
            array: 1-D, C-contiguous, ``sum(counts)`` elements; the same dtype, ``counts`` and ``op`` on every rank.
            counts: ELEMENTS of each rank's segment, ``len(counts) == size``, ints >= 0 (0 allowed); segment r starts at
                element ``sum(counts[:r])``. None: ``split_counts(array.size, size)``.
            op: as for :meth:`all_reduce` (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``; the same dtype
                rules).

        Returns:
            A 1-D array of ``counts[rank]`` elements of ``array``'s dtype (the backend's array type): the reduction of
            segment ``rank`` of every rank's ``array``, equal to that segment of :meth:`all_reduce` on the same data.
            Whether it is new or a view into ``array``, and what ``array`` holds afterwards, is the backend's (each
            documents it); treat ``array`` as overwritten.

        Raises:
            ValueError: bad ``counts`` (length, negative, sum != array size) or ``array`` not 1-D.
            TypeError: ``array`` not C-contiguous, unsupported dtype or op.
            CollectiveMismatchError: ranks passed different counts/dtypes/ops (where :meth:`all_reduce` checks).
            CollectiveTimeoutError: the collective missed its deadline.
        """
        ...

    def all_gather_into(self, array: Any, counts: Sequence[int] | None = None) -> Any:
        """Gather every rank's segment of ``array`` into every rank's ``array``, in place.

        Args:
            array: 1-D, C-contiguous, ``sum(counts)`` elements, the same element count, dtype and ``counts`` on every
                rank. On entry segment ``rank`` holds this rank's part; the other segments are overwritten.
            counts: ELEMENTS per rank, as for :meth:`reduce_scatter`.

        Returns:
            ``array``, every segment r holding rank r's part.

        Raises:
            ValueError: bad ``counts`` or ``array`` not 1-D.
            TypeError: ``array`` not C-contiguous, or an unsupported dtype.
            CollectiveMismatchError: as for :meth:`reduce_scatter`.
            CollectiveTimeoutError: the collective missed its deadline.
        """
        ...

    def all_to_all(self, array: Any) -> Any:
        """Send row j of ``array`` to rank j.

        Args:
            array: shape ``(size, *rest)``, C-contiguous, the same shape and dtype on every rank.

        Returns:
            A new array of ``array``'s shape and dtype whose row i is rank i's row ``rank``.

        Raises:
            ValueError: ``array.shape[0] != size`` (or a 0-d array).
            TypeError: not C-contiguous, unsupported dtype.
            CollectiveMismatchError, CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        ...


def _dtype_kind(dtype: Any) -> str:
    """NumPy's kind letter of a NumPy/CuPy dtype or a ``torch.dtype`` (``"f"``, ``"i"``, ``"b"``, ...)."""
    if hasattr(dtype, "is_floating_point"):  # a torch.dtype (torch is never imported here)
        if str(dtype) == "torch.bool":
            return "b"
        return "f" if dtype.is_floating_point else "c" if dtype.is_complex else "i"
    return np.dtype(dtype).kind


def check_reduce_args(array: Any, op: str) -> None:
    """Validate ``op`` for ``array``'s dtype; shared by all backends.

    Args:
        array: a NumPy or CuPy array, or a torch tensor.
        op: the reduction's name.

    Raises:
        ValueError: ``op`` is not one of :data:`REDUCE_OPS`.
        TypeError: ``op="avg"`` on an integer or boolean array, or an array that is not C-contiguous.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "avg" and _dtype_kind(array.dtype) in "iub":
        raise TypeError(f"op='avg' is not supported for dtype {array.dtype} (integer averaging would truncate); "
                        "use op='sum' and divide in floating point")
    _check_contiguous(array)


def _check_contiguous(array: Any) -> None:
    contiguous = array.is_contiguous() if hasattr(array, "is_contiguous") else array.flags.c_contiguous
    if not contiguous:
        raise TypeError("array must be C-contiguous; pass np.ascontiguousarray(array)")


def split_counts(n: int, size: int) -> list[int]:
    """Balanced per-rank ELEMENT counts of ``n`` elements over ``size`` ranks.

    Returns:
        ``size`` ints summing to ``n``; the first ``n % size`` ranks get one element more
        (``split_counts(10, 4) == [3, 3, 2, 2]``).

    Raises:
        ValueError: ``n < 0`` or ``size < 1`` (or not ints).
    """
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be an int >= 0 (ELEMENTS), got {n!r}")
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be an int >= 1 (ranks), got {size!r}")
    base, extra = divmod(int(n), int(size))
    return [base + (r < extra) for r in range(int(size))]


def check_counts(array: Any, counts: Sequence[int] | None, size: int) -> list[int]:
    """Validate the 1-D ``array`` and ``counts`` of a sharded collective; shared by all backends.

    Args:
        array: a NumPy or CuPy array or a torch tensor.
        counts: ELEMENTS per rank, or None for :func:`split_counts`.
        size: the world size.

    Returns:
        The counts as a list of ``size`` Python ints summing to the array's element count.

    Raises:
        ValueError: ``array`` is not 1-D; ``counts`` has not ``size`` entries, holds a non-int or a negative count, or
            does not sum to the array's element count.
        TypeError: ``array`` is not C-contiguous.
    """
    if array.ndim != 1:
        raise ValueError(f"array must be 1-D, got shape {tuple(array.shape)}")
    _check_contiguous(array)
    n = int(array.shape[0])
    if counts is None:
        return split_counts(n, size)
    try:
        got = list(counts)
    except TypeError:
        raise ValueError(f"counts must be a sequence of {size} ints (ELEMENTS per rank), got {counts!r}") from None
    if len(got) != size or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in got):
        raise ValueError(f"counts must be {size} ints (ELEMENTS per rank, one per rank), got {got}")
    got = [int(c) for c in got]
    if min(got) < 0:
        raise ValueError(f"counts must be >= 0, got {got}")
    if sum(got) != n:
        raise ValueError(f"counts must sum to the array's {n} elements, got {got} (sum {sum(got)})")
    return got


def _starts(counts: Sequence[int]) -> list[int]:
    """Element offset of each rank's segment of ``counts`` ELEMENTS."""
    return [sum(counts[:r]) for r in range(len(counts))]


def check_rows(array: Any, size: int) -> None:
    """Validate the ``(size, *rest)`` C-contiguous ``array`` of :meth:`Communicator.all_to_all`.

    Raises:
        ValueError: ``array`` is 0-d or its first dimension is not ``size``.
        TypeError: ``array`` is not C-contiguous.
    """
    if array.ndim < 1 or int(array.shape[0]) != size:
        raise ValueError(f"array must have shape (size={size}, ...) for all_to_all, got {tuple(array.shape)}")
    _check_contiguous(array)


def counts_digest(counts: Sequence[int]) -> int:
    """A CRC-32 of ``counts`` (an int in ``[0, 2**32)``), for comparing them across ranks in one integer."""
    return zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes())

