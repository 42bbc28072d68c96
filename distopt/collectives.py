"""Collectives on the user's own arrays and objects, as methods of :class:`~distopt.DistOpt`."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .comm.base import Communicator
from .metrics import all_gather_object, broadcast_object, reduce_metrics

__all__ = ["CollectiveMethods"]


class CollectiveMethods:
    """Mixin of :class:`~distopt.DistOpt`: raw collectives over its communicator."""

    comm: Communicator
    world_size: int

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """In-place all-reduce of one array or contiguous torch tensor (sum by default), zero-copy.

        Returns:
            ``array`` itself, holding the result.

        Raises:
            TypeError: a non-contiguous or sparse tensor.
        """
        self.comm.all_reduce(_view(array), op=op)
        return array

    def broadcast(self, array: Any, root: int = 0) -> Any:
        """In-place broadcast of one array or contiguous torch tensor from ``root``; returns ``array``."""
        self.comm.broadcast(_view(array), root=root)
        return array

    def all_reduce_metrics(self, metrics: Mapping[str, Any], mean: tuple[str, ...] = ()) -> dict[str, Any]:
        """Sum metrics (scalars or vectors) over ranks (means for names in ``mean``); see
        :func:`distopt.metrics.reduce_metrics`."""
        return reduce_metrics(self.comm, metrics, mean)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank; see :func:`distopt.metrics.all_gather_object`."""
        return all_gather_object(self.comm, obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Send a picklable object from ``root`` to every rank; see :func:`distopt.metrics.broadcast_object`."""
        return broadcast_object(self.comm, obj, root)

    def agree(self, flag: bool, rule: str = "any") -> bool:
        """A decision every rank takes together (early stopping).

        Args:
            flag: this rank's vote.
            rule: ``"any"`` (true if some rank votes true), ``"all"``, or
                ``"root"`` (rank 0's vote).

        Returns:
            The same bool on every rank.

        Raises:
            ValueError: an unknown ``rule``.
        """
        if rule not in ("any", "all", "root"):
            raise ValueError(f"rule must be 'any', 'all' or 'root', got {rule!r}")
        vote = np.array([bool(flag)], dtype=np.int32)
        if rule == "root":
            self.comm.broadcast(vote, root=0)
            return bool(vote[0])
        self.comm.all_reduce(vote, op="sum")
        return bool(vote[0] > 0) if rule == "any" else bool(vote[0] == self.world_size)


def _view(array: Any) -> Any:
    """A NumPy/CuPy view of a torch tensor (zero-copy); other arrays as they are."""
    if type(array).__module__.startswith("torch"):
        from .torch import as_array

        return as_array(array)
    return array
