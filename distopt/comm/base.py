"""The communicator protocol shared by every backend.

A communicator moves arrays between the ranks of one job; it knows nothing
about models. All collectives are blocking from the caller's point of view
(NCCL: ordered on the communicator's CUDA stream, see ``nccl.py``), act in
place where stated, and must be called by every rank in the same order with
the same element count and dtype.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from .wait import DEFAULT_TIMEOUT, TIMEOUT_ENV, default_timeout, resolve_timeout

__all__ = ["Communicator", "REDUCE_OPS", "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "default_timeout", "resolve_timeout",
           "check_reduce_args"]

#: Reduction operations every backend supports, by name.
REDUCE_OPS = ("sum", "avg", "max", "min")


@runtime_checkable
class Communicator(Protocol):
    """What distopt needs from a backend.

    Attributes:
        rank: this process's rank in the communicator, ``0 <= rank < size``.
        size: the number of ranks (the world size).
        name: the backend's registry name (``"mpi"``, ``"nccl"``, ``"shm"``,
            ``"torch"``, ``"single"``).
    """

    rank: int
    size: int
    name: str

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """Reduce ``array`` across ranks in place and return it.

        Args:
            array: a C-contiguous array (NumPy for CPU backends, CuPy for
                NCCL) of any shape, including size 0. Every rank passes the
                same element count and dtype.
            op: one of ``"sum"``, ``"avg"`` (sum / size), ``"max"``,
                ``"min"``. Integer arrays support sum/max/min; ``"avg"`` on
                integers raises TypeError. Boolean arrays reduce as logical
                OR for sum/max and logical AND for min.

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

        Returns a list of ``size`` arrays, entry ``r`` being rank r's input.
        Every rank must pass the same dtype.
        """
        ...

    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""
        ...

    def close(self) -> None:
        """Release the backend's resources; idempotent.

        Every later call raises
        :class:`~distopt.errors.CommunicatorClosedError` at once. distopt's
        backends also have ``wait_seconds`` (seconds spent in blocking
        calls) and ``closed``; see :mod:`distopt.comm.lifecycle`. Those
        that were never closed are closed at interpreter exit.
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
        TypeError: ``op="avg"`` on an integer or boolean array, or an array
            that is not C-contiguous.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "avg" and _dtype_kind(array.dtype) in "iub":
        raise TypeError(
            f"op='avg' is not supported for dtype {array.dtype} (integer averaging "
            "would truncate); use op='sum' and divide in floating point"
        )
    contiguous = array.is_contiguous() if hasattr(array, "is_contiguous") else array.flags.c_contiguous
    if not contiguous:
        raise TypeError("array must be C-contiguous; pass np.ascontiguousarray(array)")
