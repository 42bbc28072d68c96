"""The world of one process: every collective is the identity, checked like the others.

What a plain ``python train.py`` (no launcher) gets: world size 1, no MPI, no shared memory, no network. Arguments are
validated as by the other backends, so a script that is wrong at world size N is wrong here too. Works on any array type
(NumPy, CuPy, torch tensors): nothing moves.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..launch.ranks import RankInfo, describe
from .base import check_counts, check_reduce_args, check_rows
from .lifecycle import CommunicatorState, Completed, collective

if TYPE_CHECKING:
    from ..launch.info import Launch

__all__ = ["SingleCommunicator"]


def _copy(array: Any) -> Any:
    return array.clone() if hasattr(array, "clone") else array.copy()


class SingleCommunicator(CommunicatorState):
    """Rank 0 of 1.

    Args:
        timeout: accepted for symmetry with the other backends (nothing waits).
    """

    name = "single"

    def __init__(self, timeout: float | None = None) -> None:  # noqa: ARG002 (nothing waits)
        self.rank, self.size = 0, 1

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[SingleCommunicator, RankInfo]:
        """Build it for a plain ``python train.py`` (or a forced ``backend="single"``).

        Raises:
            ValueError: the launch says the world has more than one process, unless ``$DISTOPT_INDEPENDENT_PROCESSES=1``
                asks for each process on its own (then rank 0 of 1).
        """
        info = launch.rank_info()
        if info.world_size != 1:
            if launch.env.get("DISTOPT_INDEPENDENT_PROCESSES") == "1":
                return cls(), RankInfo(0, 1, 0, 1, None, None, "single")
            raise ValueError(f"backend='single' is a world of one process, but {describe(info, launch.env)} "
                             f"say {info.world_size}; leave backend unset")
        return cls(), info

    @collective
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """Return ``array`` unchanged (the reduction of one rank), after checking ``op`` for its dtype."""
        check_reduce_args(array, op)
        return array

    @collective
    def all_reduce_async(self, array: Any, op: str = "sum") -> Any:
        """Return a completed handle: ``test()`` is True, ``wait()`` returns ``array``."""
        check_reduce_args(array, op)
        return Completed(array)

    @collective
    def broadcast(self, array: Any, root: int = 0) -> Any:
        """Return ``array`` unchanged.

        Raises:
            ValueError: ``root`` is not 0.
        """
        if root != 0:
            raise ValueError(f"root must be in [0, 1), got {root}")
        return array

    @collective
    def all_gather(self, array: Any) -> Any:
        """A copy of ``array`` with a leading axis of length 1."""
        return _copy(array)[None]

    @collective
    def all_gather_v(self, array: Any) -> list[Any]:
        """``[copy of array]``.

        Raises:
            ValueError: ``array`` is not 1-D.
        """
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes a 1-D array, got shape {tuple(array.shape)}")
        return [_copy(array)]

    @collective
    def reduce_scatter(self, array: Any, counts: Sequence[int] | None = None, op: str = "sum") -> Any:
        """A copy of ``array`` (the one segment, reduced over one rank); ``array`` is left unchanged.

        Raises:
            ValueError: ``array`` is not 1-D, or ``counts`` is not ``[array.size]``.
            TypeError: ``op`` not valid for the dtype, or a non-contiguous array.
        """
        check_reduce_args(array, op)
        check_counts(array, counts, 1)
        return _copy(array)

    @collective
    def all_gather_into(self, array: Any, counts: Sequence[int] | None = None) -> Any:
        """Return ``array`` unchanged (it holds the only segment).

        Raises:
            ValueError: ``array`` is not 1-D, or ``counts`` is not ``[array.size]``.
            TypeError: a non-contiguous array.
        """
        check_counts(array, counts, 1)
        return array

    @collective
    def all_to_all(self, array: Any) -> Any:
        """A copy of ``array`` (its one row goes to rank 0).

        Raises:
            ValueError: ``array.shape[0] != 1``.
            TypeError: a non-contiguous array.
        """
        check_rows(array, 1)
        return _copy(array)

    @collective
    def split(self, ranks: Sequence[int]) -> SingleCommunicator:
        """A new world of one process (``ranks`` is ``(0,)``, checked by :func:`distopt.comm.groups.split`)."""
        return SingleCommunicator()

    @collective
    def barrier(self) -> None:
        """Return at once."""

    def close(self) -> None:
        """Mark the communicator closed (idempotent); later calls raise CommunicatorClosedError."""
        self.closed = True

    def __repr__(self) -> str:
        return "SingleCommunicator()"

