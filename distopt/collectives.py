"""Collectives on the user's own arrays, objects and parameters: what ``DistOpt.all_reduce`` and its siblings delegate
to.

The array collectives run the checked code of :mod:`distopt.array_collectives` (arguments agreed across ranks first);
with ``async_op=True`` on a dedicated communicator and worker thread (:mod:`distopt.async_collectives`). Integer
averaging: ``op="avg"`` on an integer or bool array is a TypeError on every rank (naming the rank), never a silent
truncation (Horovod's PyTorch binding floor-divides the sum instead): use ``op="sum"`` and divide."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import array_collectives as checked
from . import grouped_collectives as grouped
from . import sparse_collectives as sparse
from .async_collectives import AsyncCollectives, CollectiveHandle
from .comm.base import Communicator
from .comm.groups import Group, communicator_of
from .core.buckets import is_float, plan_buckets
from .metrics import all_gather_object, broadcast_object, reduce_metrics
from .step.engine import DEFAULT_THRESHOLD, Engine
from .step.local import LocalOptimizer

__all__ = ["Collectives", "CollectiveHandle", "CollectiveMethods"]


class Collectives:
    """Raw collectives over one DistOpt's communicator (or a process group), and its parameter broadcast and
    averaging.

    Every array collective takes ``group=`` (a :class:`~distopt.comm.groups.Group`: it runs on the group's
    communicator, ValueError on a rank outside it; the argument agreement runs over the group) and ``async_op=``
    (True: returns a :class:`~distopt.async_collectives.CollectiveHandle` whose ``wait()`` gives the result and raises
    the errors listed, on every rank). Arrays: NumPy, CuPy or torch tensors (results of the input's kind, dtype and
    device); counts in ELEMENTS.

    Args:
        comm: the communicator.
        engine: the step engine (checked broadcasts, bucketed averaging).
        local: the local optimizer (its parameters, and the shared order of an array model's parameters).
    """

    def __init__(self, comm: Communicator, engine: Engine, local: LocalOptimizer) -> None:
        self.comm, self.engine, self.local = comm, engine, local
        self._async = AsyncCollectives()

    def _run(self, call: str, fn: Callable[..., Any], group: Group | None, async_op: bool, *args: Any) -> Any:
        comm = self._comm(group, call)
        if async_op:
            return self._async.submit(comm, call, fn, *args)
        return fn(comm, *args)

    def all_reduce(self, array: Any, op: str = "sum", *, group: Group | None = None, async_op: bool = False,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
        """In-place all-reduce of one array or contiguous torch tensor (any shape), zero-copy.

        Args:
            op: ``"sum"``, ``"avg"`` (floats only), ``"max"``, ``"min"``, ``"product"``, ``"adasum"`` (Horovod's
                Adasum: floats, a power-of-two world; :mod:`distopt.comm.adasum`).
            prescale_factor: Horovod's: the result is ``postscale_factor * reduce(prescale_factor * array)``,
                integers scaled in float64 and cast back (:mod:`distopt.comm.scaled`).
            postscale_factor: see ``prescale_factor``.

        Returns:
            ``array`` itself, holding the result (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError / ValueError: on every rank, naming the rank whose argument is bad (an unsupported op or dtype,
                ``"avg"`` on integers, a non-contiguous or sparse tensor, a factor not 1 on a bool array).
            CollectiveMismatchError: on every rank, the shape, dtype, op or a factor differs across ranks.
        """
        return self._run("all_reduce", checked.all_reduce, group, async_op, array, op, prescale_factor,
                         postscale_factor)

    def broadcast(self, array: Any, root: int = 0, *, group: Group | None = None, async_op: bool = False) -> Any:
        """In-place broadcast of one array or contiguous torch tensor from ``root`` (a rank of ``group`` when given);
        returns ``array``.

        Raises:
            TypeError / ValueError / CollectiveMismatchError: as :meth:`all_reduce`, on every rank.
        """
        return self._run("broadcast", checked.broadcast, group, async_op, array, root)

    def all_gather(self, array: Any, *, group: Group | None = None, async_op: bool = False) -> Any:
        """Every rank's rows in rank order: a new array/tensor of shape ``(sum of the ranks' shape[0], *shape[1:])``;
        the first dimension may differ across ranks (Horovod's ``allgather``).

        Raises:
            ValueError: on every rank, a 0-d array on some rank.
            TypeError: on every rank, as :meth:`all_reduce`.
            CollectiveMismatchError: on every rank, ``shape[1:]`` or the dtype differs (naming the ranks and
                shapes).
        """
        return self._run("all_gather", checked.all_gather, group, async_op, array)

    def reduce_scatter(self, array: Any, op: str = "sum", *, group: Group | None = None, async_op: bool = False,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
        """This rank's chunk of the reduction (``torch.distributed.reduce_scatter_tensor``): ``shape[0]`` split into W
        equal chunks; returns a new array of shape ``(shape[0] // W, *shape[1:])``, chunk ``rank`` of the elementwise
        reduction; ``array`` is unchanged. ``op`` and the factors as :meth:`all_reduce`.

        Raises:
            ValueError: ``shape[0]`` not divisible by W, a 0-d array, an unknown op.
            TypeError / CollectiveMismatchError: as :meth:`all_reduce` (equal shapes). All on every rank.
        """
        return self._run("reduce_scatter", checked.reduce_scatter, group, async_op, array, op, prescale_factor,
                         postscale_factor)

    def grouped_all_reduce(self, arrays: Sequence[Any], op: str = "sum", *, group: Group | None = None,
                           async_op: bool = False, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> list[Any]:
        """:meth:`all_reduce` of every array of ``arrays`` in place, one fused all-reduce per dtype (Horovod's
        ``grouped_allreduce_``); returns the arrays (a list, input order), or one handle for the whole group.

        Raises:
            TypeError / ValueError: as :meth:`all_reduce`, naming the rank and the array (``arrays[i]``).
            CollectiveMismatchError: on every rank, the number of arrays, a shape or dtype, the op or a factor
                differs across ranks (:mod:`distopt.grouped_collectives`).
        """
        return self._run("grouped_all_reduce", grouped.grouped_all_reduce, group, async_op, arrays, op,
                         prescale_factor, postscale_factor)

    def grouped_all_gather(self, arrays: Sequence[Any], *, group: Group | None = None,
                           async_op: bool = False) -> list[Any]:
        """:meth:`all_gather` of every array of ``arrays``, one fused all-gather per dtype (Horovod's
        ``grouped_allgather``); new arrays, input order (or one handle).

        Raises:
            ValueError / TypeError / CollectiveMismatchError: as :meth:`grouped_all_reduce` (0-d arrays; shapes
                compared beyond the first dimension).
        """
        return self._run("grouped_all_gather", grouped.grouped_all_gather, group, async_op, arrays)

    def grouped_reduce_scatter(self, arrays: Sequence[Any], op: str = "sum", *, group: Group | None = None,
                               async_op: bool = False, prescale_factor: float = 1.0,
                               postscale_factor: float = 1.0) -> list[Any]:
        """:meth:`reduce_scatter` of every array of ``arrays``, one fused reduce-scatter per dtype (Horovod's
        ``grouped_reducescatter``); new arrays, input order (or one handle).

        Raises:
            ValueError / TypeError / CollectiveMismatchError: as :meth:`reduce_scatter` and
                :meth:`grouped_all_reduce`.
        """
        return self._run("grouped_reduce_scatter", grouped.grouped_reduce_scatter, group, async_op, arrays, op,
                         prescale_factor, postscale_factor)

    def all_to_all(self, array: Any, splits: Any = None, *, group: Group | None = None,
                   async_op: bool = False) -> Any:
        """Rows of ``shape[0]`` sent to each rank (Horovod's ``alltoall``, ``torch.distributed.all_to_all_single``).

        Args:
            splits: W ints >= 0 summing to ``shape[0]``: the ROWS sent to each rank, uneven allowed (the MoE pattern;
                a list, a NumPy or torch integer array); None: W equal chunks. ``shape[0]`` may differ across ranks,
                ``shape[1:]`` and the dtype must not.

        Returns:
            A new array of shape ``(rows received, *shape[1:])``, rank i's rows after rank i-1's; with ``splits``,
            ``(array, received_splits)``, the rows received from each rank of ``splits``'s kind (a torch tensor of its
            dtype and device, a NumPy array, else a list) (or a handle whose ``wait()`` returns it).

        Raises:
            ValueError: on every rank, naming the rank: bad ``splits`` (length, a negative or non-integer entry, a sum
                other than ``shape[0]``), without ``splits`` ``shape[0]`` not divisible by W, a 0-d array.
            TypeError / CollectiveMismatchError: as :meth:`all_gather` (``shape[1:]`` and dtype; ``splits`` given on
                some ranks only), on every rank.
        """
        return self._run("all_to_all", checked.all_to_all, group, async_op, array, splits)

    def sparse_all_reduce(self, tensor: Any, op: str = "sum", *, group: Group | None = None,
                          async_op: bool = False) -> Any:
        """Every rank's entries of the torch sparse COO ``tensor`` (Horovod's ``sparse_allreduce_async``): all-gathered
        and concatenated in rank order into a new, uncoalesced sparse tensor of ``tensor``'s size, its values divided
        by W for ``"avg"`` (:func:`distopt.sparse_collectives.sparse_all_reduce`); ``tensor`` is unchanged. The number
        of entries may differ across ranks; ``.coalesce()`` of the result sums each index's entries.

        Raises:
            TypeError / ValueError / CollectiveMismatchError: on every rank: not a sparse COO tensor, an op other than
                ``"sum"`` and ``"avg"``, ``"avg"`` on integers; the size, ``sparse_dim`` or dtype differs.
        """
        return self._run("sparse_all_reduce", sparse.sparse_all_reduce, group, async_op, tensor, op)

    def _comm(self, group: Group | None, call: str) -> Communicator:
        return self.comm if group is None else communicator_of(group, call)

    def all_reduce_metrics(self, metrics: Mapping[str, Any], mean: tuple[str, ...] = (), *,
                           group: Group | None = None) -> dict[str, Any]:
        """Sum metrics (scalars or vectors) over ranks (means for names in ``mean``; see
        :func:`distopt.metrics.reduce_metrics`)."""
        return reduce_metrics(self._comm(group, "all_reduce_metrics"), metrics, mean)

    def all_gather_object(self, obj: Any, *, group: Group | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank (:func:`distopt.metrics.all_gather_object`)."""
        return all_gather_object(self._comm(group, "all_gather_object"), obj)

    def broadcast_object(self, obj: Any, root: int = 0, *, group: Group | None = None) -> Any:
        """Send a picklable object from ``root`` to every rank; see :func:`distopt.metrics.broadcast_object`."""
        return broadcast_object(self._comm(group, "broadcast_object"), obj, root)

    def agree(self, flag: bool, rule: str = "any", *, group: Group | None = None) -> bool:
        """A decision every rank takes together (early stopping).

        Args:
            flag: this rank's vote.
            rule: ``"any"`` (true if some rank votes true), ``"all"``, or ``"root"`` (rank 0's vote).

        Returns:
            The same bool on every rank.

        Raises:
            ValueError: an unknown ``rule``.
        """
        if rule not in ("any", "all", "root"):
            raise ValueError(f"rule must be 'any', 'all' or 'root', got {rule!r}")
        comm = self._comm(group, "agree")
        vote = np.array([bool(flag)], dtype=np.int32)
        if rule == "root":
            comm.broadcast(vote, root=0)
            return bool(vote[0])
        comm.all_reduce(vote, op="sum")
        return bool(vote[0] > 0) if rule == "any" else bool(vote[0] == comm.size)

    def sync_params(self, params: Sequence[Any]) -> None:
        """Check that all ranks hold the same parameters, then broadcast rank 0's values.

        Call it once before the first forward pass for array models (the PyTorch adapter does it in the constructor;
        a step whose parameter list changed does it again). Integer and boolean arrays (counters, masks) are broadcast
        too; a step never reduces or updates them.

        Args:
            params: arrays (NumPy or CuPy), modified in place on ranks != 0.

        Raises:
            CollectiveMismatchError: on every rank, naming the first parameter whose shape or dtype differs, or a
                count difference.
        """
        params = list(params)
        self.engine.broadcast_params(params, {"world_size": self.comm.size})
        self.local.remember(params)

    def average_params(self, params: Sequence[Any] | None = None) -> None:
        """Average all (float) parameters across ranks at once, in place (before evaluation after partial updates);
        ``params`` may be omitted with a PyTorch optimizer."""
        owned = self.local.arrays()
        floats = [p for p in (owned if params is None else params) if is_float(p)]
        for bucket in plan_buckets([(p.shape, p.dtype) for p in floats], DEFAULT_THRESHOLD, self.engine.buff_size):
            self.engine.average_arrays(bucket, floats, "parameter averaging")

    def close(self) -> None:
        """Wait for the asynchronous collectives in flight, stop their worker, close their communicators."""
        self._async.close()


class CollectiveMethods:
    """The raw collectives of :class:`~distopt.DistOpt`, each a delegation to its :class:`Collectives`."""

    _collectives: Collectives

    def all_reduce(self, array: Any, op: str = "sum", *, group: Group | None = None, async_op: bool = False,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
        """In-place all-reduce of one array or contiguous tensor; returns it, or with ``async_op=True`` a handle whose
        ``wait()`` does; ``group``: a process group (all collectives: :class:`~distopt.collectives.Collectives`);
        ``postscale_factor * reduce(prescale_factor * array)``."""
        return self._collectives.all_reduce(array, op, group=group, async_op=async_op,
                                            prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    def broadcast(self, array: Any, root: int = 0, *, group: Group | None = None, async_op: bool = False) -> Any:
        """In-place broadcast of one array or contiguous tensor from ``root``; returns it."""
        return self._collectives.broadcast(array, root, group=group, async_op=async_op)

    def all_gather(self, array: Any, *, group: Group | None = None, async_op: bool = False) -> Any:
        """Every rank's rows in rank order: a new ``(sum of shape[0], *shape[1:])`` array; ``shape[0]`` may differ."""
        return self._collectives.all_gather(array, group=group, async_op=async_op)

    def reduce_scatter(self, array: Any, op: str = "sum", *, group: Group | None = None, async_op: bool = False,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
        """This rank's chunk (``shape[0] // W`` rows, a new array) of the reduction, as ``reduce_scatter_tensor``."""
        return self._collectives.reduce_scatter(array, op, group=group, async_op=async_op,
                                                prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    def grouped_all_reduce(self, arrays: Sequence[Any], op: str = "sum", *, group: Group | None = None,
                           async_op: bool = False, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> list[Any]:
        """:meth:`all_reduce` of many arrays in place, one fused all-reduce per dtype; returns them (input order)."""
        return self._collectives.grouped_all_reduce(arrays, op, group=group, async_op=async_op,
                                                    prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    def grouped_all_gather(self, arrays: Sequence[Any], *, group: Group | None = None,
                           async_op: bool = False) -> list[Any]:
        """:meth:`all_gather` of many arrays, one fused all-gather per dtype; new arrays, input order."""
        return self._collectives.grouped_all_gather(arrays, group=group, async_op=async_op)

    def grouped_reduce_scatter(self, arrays: Sequence[Any], op: str = "sum", *, group: Group | None = None,
                               async_op: bool = False, prescale_factor: float = 1.0,
                               postscale_factor: float = 1.0) -> list[Any]:
        """:meth:`reduce_scatter` of many arrays, one fused reduce-scatter per dtype; new arrays, input order."""
        return self._collectives.grouped_reduce_scatter(arrays, op, group=group, async_op=async_op,
                                                        prescale_factor=prescale_factor,
                                                        postscale_factor=postscale_factor)

    def all_to_all(self, array: Any, splits: Any = None, *, group: Group | None = None,
                   async_op: bool = False) -> Any:
        """``splits[j]`` rows of ``shape[0]`` (None: W equal chunks) sent to rank ``j``; a new array, with ``splits``
        ``(array, received_splits)`` (Horovod's ``alltoall``; :meth:`~distopt.collectives.Collectives.all_to_all`)."""
        return self._collectives.all_to_all(array, splits, group=group, async_op=async_op)

    def sparse_all_reduce(self, tensor: Any, op: str = "sum", *, group: Group | None = None,
                          async_op: bool = False) -> Any:
        """Every rank's entries of a torch sparse COO tensor, concatenated in rank order (not coalesced; values / W
        for ``"avg"``): Horovod's ``sparse_allreduce_async`` (:meth:`Collectives.sparse_all_reduce`)."""
        return self._collectives.sparse_all_reduce(tensor, op, group=group, async_op=async_op)

    def all_reduce_metrics(self, metrics: Mapping[str, Any], mean: tuple[str, ...] = (), *,
                           group: Group | None = None) -> dict[str, Any]:
        """Sum metrics over ranks (means for names in ``mean``); see :func:`distopt.metrics.reduce_metrics`."""
        return self._collectives.all_reduce_metrics(metrics, mean, group=group)

    def all_gather_object(self, obj: Any, *, group: Group | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank."""
        return self._collectives.all_gather_object(obj, group=group)

    def broadcast_object(self, obj: Any, root: int = 0, *, group: Group | None = None) -> Any:
        """``root``'s picklable object, on every rank."""
        return self._collectives.broadcast_object(obj, root, group=group)

    def agree(self, flag: bool, rule: str = "any", *, group: Group | None = None) -> bool:
        """A decision every rank takes together: ``rule`` ``"any"``, ``"all"`` or ``"root"`` (rank 0's vote)."""
        return self._collectives.agree(flag, rule, group=group)
