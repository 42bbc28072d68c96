"""Collectives on the user's own arrays, objects and parameters: what ``DistOpt.all_reduce`` and its
siblings delegate to."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .core.buckets import is_float, plan_buckets
from .comm.base import Communicator, check_reduce_args
from .errors import CollectiveMismatchError
from .step.agreement import digest
from .metrics import all_gather_object, broadcast_object, reduce_metrics
from .step.engine import DEFAULT_THRESHOLD, Engine
from .step.local import LocalOptimizer

__all__ = ["Collectives"]


class Collectives:
    """Raw collectives over one DistOpt's communicator, and its parameter broadcast and averaging.

    Args:
        comm: the communicator.
        engine: the step engine (checked broadcasts, bucketed averaging).
        local: the local optimizer (its parameters, and the shared order
            of an array model's parameters).
    """

    def __init__(self, comm: Communicator, engine: Engine, local: LocalOptimizer) -> None:
        self.comm, self.engine, self.local = comm, engine, local

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """In-place all-reduce of one array or contiguous torch tensor (sum by default), zero-copy.

        The ranks first agree on the call (one small all-gather of its
        shape, dtype, op and whether its arguments are valid here), so a bad
        argument or a shape that differs is raised on every rank at once.

        Returns:
            ``array`` itself, holding the result.

        Raises:
            TypeError / ValueError: on every rank, naming the rank whose
                argument is bad (an unsupported op or dtype, a
                non-contiguous or sparse tensor).
            CollectiveMismatchError: on every rank, the shape, dtype or op
                differs across ranks.
        """
        view = self._agreed("all_reduce", array, op=op)
        self.comm.all_reduce(view, op=op)
        return array

    def broadcast(self, array: Any, root: int = 0) -> Any:
        """In-place broadcast of one array or contiguous torch tensor from ``root``; returns ``array``.

        Raises:
            TypeError / ValueError / CollectiveMismatchError: as :meth:`all_reduce`, on every rank.
        """
        view = self._agreed("broadcast", array, root=root)
        self.comm.broadcast(view, root=root)
        return array

    def _agreed(self, call: str, array: Any, **args: Any) -> Any:
        """The array view of ``array``, once every rank has checked its arguments and they match."""
        view, problem = None, ""
        try:
            view = _view(array)
            if call == "all_reduce":
                check_reduce_args(view, args["op"])
            elif not 0 <= args["root"] < self.comm.size:
                raise ValueError(f"root must be in [0, {self.comm.size}), got {args['root']}")
        except (TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        mine = [problem, list(getattr(array, "shape", ())), str(getattr(array, "dtype", "")), args]
        header = np.array([int(bool(problem)), digest(mine[1:])], dtype=np.int64)
        everyone = self.comm.all_gather(header)
        if everyone[:, 0].any() or (everyone[:, 1] != everyone[0, 1]).any():
            _raise_everywhere(call, all_gather_object(self.comm, mine))
        return view

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
        return bool(vote[0] > 0) if rule == "any" else bool(vote[0] == self.comm.size)

    def sync_params(self, params: Sequence[Any]) -> None:
        """Check that all ranks hold the same parameters, then broadcast rank 0's values.

        Call it once before the first forward pass for array models (the
        PyTorch adapter does it in the constructor; a step whose parameter
        list changed does it again). Integer and boolean arrays (counters,
        masks) are broadcast too; a step never reduces or updates them.

        Args:
            params: arrays (NumPy or CuPy), modified in place on ranks != 0.

        Raises:
            CollectiveMismatchError: on every rank, naming the first
                parameter whose shape or dtype differs, or a count difference.
        """
        params = list(params)
        self.engine.broadcast_params(params, {"world_size": self.comm.size})
        self.local.remember(params)

    def average_params(self, params: Sequence[Any] | None = None) -> None:
        """Average all (float) parameters across ranks at once, in place.

        The seed's examples do this before evaluation after partial updates.
        ``params`` may be omitted with a PyTorch optimizer.
        """
        owned = self.local.arrays()
        floats = [p for p in (owned if params is None else params) if is_float(p)]
        for bucket in plan_buckets([(p.shape, p.dtype) for p in floats], DEFAULT_THRESHOLD, self.engine.buff_size):
            self.engine.average_arrays(bucket, floats, "parameter averaging")


def _view(array: Any) -> Any:
    """A NumPy/CuPy view of a torch tensor (zero-copy); other arrays as they are."""
    if type(array).__module__.startswith("torch"):
        from .torch.adapter import as_array

        return as_array(array)
    return array


def _raise_everywhere(call: str, everyone: list[list[Any]]) -> None:
    """Raise, on every rank alike, the first rank's argument error, else the first difference."""
    for rank, (problem, *_rest) in enumerate(everyone):
        if problem:
            kind, _, text = problem.partition(": ")
            raise (TypeError if kind == "TypeError" else ValueError)(f"{call} on rank {rank}: {text}")
    names = ("shape", "dtype", "arguments")
    for rank, other in enumerate(everyone[1:], start=1):
        for name, a, b in zip(names, everyone[0][1:], other[1:]):
            if a != b:
                raise CollectiveMismatchError(f"{call}: {name} differ{'' if name == 'arguments' else 's'} across "
                                              f"ranks: rank 0 has {a}, rank {rank} has {b}")
