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

import os

__all__ = ["Communicator", "REDUCE_OPS", "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "default_timeout", "check_reduce_args"]

#: Reduction operations every backend supports, by name.
REDUCE_OPS = ("sum", "avg", "max", "min")

#: Default deadline of one collective, in seconds.
DEFAULT_TIMEOUT = 300.0

#: The one environment variable distopt reads: a collective deadline in seconds.
TIMEOUT_ENV = "DISTOPT_TIMEOUT"


def default_timeout() -> float:
    """Collective deadline in seconds: ``$DISTOPT_TIMEOUT`` if set, else 300.

    Raises:
        ValueError: the variable is set but is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


@runtime_checkable
class Communicator(Protocol):
    """What distopt needs from a backend.

    Attributes:
        rank: this process's rank in the communicator, ``0 <= rank < size``.
        size: the number of ranks (the world size).
        name: the backend's registry name (``"mpi"``, ``"nccl"``, ``"shm"``).
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
        """Release the backend's resources; the communicator is unusable after."""
        ...


def check_reduce_args(array: Any, op: str) -> None:
    """Validate ``op`` for ``array``'s dtype; shared by all backends.

    Raises:
        ValueError: ``op`` is not one of :data:`REDUCE_OPS`.
        TypeError: ``op="avg"`` on an integer or boolean array, or an array
            that is not C-contiguous.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    kind = np.dtype(array.dtype).kind
    if op == "avg" and kind in "iub":
        raise TypeError(
            f"op='avg' is not supported for dtype {array.dtype} (integer averaging "
            "would truncate); use op='sum' and divide in floating point"
        )
    if not array.flags.c_contiguous:
        raise TypeError("array must be C-contiguous; pass np.ascontiguousarray(array)")
