"""Differentiable collectives: ``all_reduce``, ``all_gather``, ``broadcast``, ``reduce_scatter`` and ``all_to_all``
that take part in autograd, and the grouped forms of the first, second and fourth (``grouped_all_reduce``, ...: one
fused collective per dtype forward and backward, each tensor's gradient that of its ungrouped form).

The counterparts of ``torch.distributed.nn.functional``: each is a ``torch.autograd.Function`` that returns a NEW
tensor (out of place; the input is never written) and whose backward is itself a collective, so every rank must run
backward through the same calls in the same order. The gradients are those of the global function (the loss is the
sum of every rank's loss); ``all_reduce``'s and ``reduce_scatter``'s ``"max"``/``"min"`` are forward only (backward
raises RuntimeError on every rank alike, no collective issued). Backward builds on these Functions again, so higher
derivatives work. Float and complex tensors take gradients; integer tensors pass forward only.

``comm=`` is a :class:`~distopt.comm.base.Communicator`, a :class:`~distopt.launch.world.World` or a ``DistOpt``
(anything with ``.comm``), or a process group (:class:`~distopt.comm.groups.Group`, ValueError on a rank outside it);
None: the :class:`~distopt.launch.world.World` of :func:`distopt.init` (joined now when there is none). Each forward
runs the checked collective of ``DistOpt.all_reduce`` and its siblings (:mod:`distopt.array_collectives`), so a bad
argument or a shape/dtype that differs raises on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from . import array_collectives as checked
from . import grouped_collectives as grouped
from .comm.base import Communicator
from .comm.groups import Group, communicator_of
from .launch.world import current, init

__all__ = ["all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all", "grouped_all_reduce",
           "grouped_all_gather", "grouped_reduce_scatter", "resolve"]


def resolve(comm: Any, what: str = "collective") -> Communicator:
    """The communicator behind ``comm`` (see the module docs); ``what`` is named in errors.

    Raises:
        TypeError: ``comm`` is none of the accepted kinds. ValueError: a group this rank is not in.
    """
    if comm is None:
        world = current()
        return (world if world is not None else init()).comm
    if isinstance(comm, Group) or isinstance(comm, Communicator):
        return communicator_of(comm, what)
    inner = getattr(comm, "comm", None)
    if inner is not None:
        return communicator_of(inner, what)
    raise TypeError(f"{what}: comm must be a Communicator, a distopt.World, a DistOpt or a process group, "
                    f"got {type(comm).__name__}")


def all_reduce(tensor: torch.Tensor, op: str = "sum", comm: Any = None) -> torch.Tensor:
    """A new tensor: the reduction of ``tensor`` over ranks (``op`` in sum, avg, max, min), differentiable (the
    gradient is the all-reduce of the gradients: their sum, or their average for ``"avg"``).

    Args:
        tensor: any shape and dtype the backend reduces, the same on every rank (``"avg"``: floats).

    Raises:
        TypeError / ValueError / CollectiveMismatchError: on every rank, as ``DistOpt.all_reduce``.
        RuntimeError: backward through ``"max"`` or ``"min"``.
    """
    return _AllReduce.apply(tensor, op, resolve(comm, "all_reduce"))


def all_gather(tensor: torch.Tensor, comm: Any = None) -> torch.Tensor:
    """A new tensor of every rank's rows in rank order, shape ``(sum of the ranks' shape[0], *shape[1:])``.

    The first dimension may differ across ranks (0 allowed); ``shape[1:]`` and the dtype must not. Differentiable:
    the gradient is this rank's rows of the all-reduced (summed) gradient.

    Raises:
        ValueError: a 0-d tensor. CollectiveMismatchError: ``shape[1:]`` or the dtype differs (naming the
            ranks and shapes). Both on every rank.
    """
    return _AllGather.apply(tensor, resolve(comm, "all_gather"))


def broadcast(tensor: torch.Tensor, root: int = 0, comm: Any = None) -> torch.Tensor:
    """A new tensor holding ``root``'s ``tensor`` on every rank, differentiable (the gradient is the sum of every
    rank's gradient on ``root``, zeros on the other ranks).

    Raises:
        ValueError: ``root`` outside ``[0, size)``. CollectiveMismatchError: the shape or dtype differs.
            Both on every rank.
    """
    return _Broadcast.apply(tensor, root, resolve(comm, "broadcast"))


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", comm: Any = None) -> torch.Tensor:
    """A new tensor: this rank's chunk of the reduction (``shape[0]`` split into W equal chunks, chunk ``rank`` of the
    elementwise ``op`` over ranks, shape ``(shape[0] // W, *shape[1:])``), differentiable: the gradient is the
    all-gather of every rank's chunk gradient (divided by W for ``"avg"``). Horovod's ``reducescatter`` gradient is
    W times larger for its ``Sum`` (its backward scales by the process-set size).

    Raises:
        ValueError: ``shape[0]`` not divisible by W, a 0-d tensor, an unknown op. CollectiveMismatchError: the shape
            or dtype differs. Both on every rank, as ``DistOpt.reduce_scatter``.
        RuntimeError: backward through ``"max"`` or ``"min"``.
    """
    return _ReduceScatter.apply(tensor, op, resolve(comm, "reduce_scatter"))


def all_to_all(tensor: torch.Tensor, splits: Any = None, comm: Any = None) -> Any:
    """A new tensor of the rows every rank sent this one (Horovod's differentiable ``alltoall``): ``splits[j]`` rows
    of ``shape[0]`` go to rank j (None: W equal chunks); with ``splits`` the result is ``(tensor, received_splits)``,
    as ``DistOpt.all_to_all``. Differentiable: the gradient is the all-to-all of the output's gradient with the
    received splits (rows travel back to the rank they came from).

    Raises:
        ValueError / TypeError / CollectiveMismatchError: on every rank, as ``DistOpt.all_to_all``.
    """
    out, received = _AllToAll.apply(tensor, splits, resolve(comm, "all_to_all"))
    return out if splits is None else (out, received)


def grouped_all_reduce(arrays: Sequence[torch.Tensor], op: str = "sum", comm: Any = None) -> list[torch.Tensor]:
    """New tensors: :func:`all_reduce` of each tensor of ``arrays`` (any shapes; ``op`` in sum, avg, max, min,
    product), one fused all-reduce per dtype (:func:`distopt.grouped_collectives.grouped_all_reduce`; Horovod's
    differentiable ``grouped_allreduce``). Differentiable as :func:`all_reduce`: the gradients are one grouped
    all-reduce of the outputs' gradients (their sums, or averages for ``"avg"``); max, min and product forward only.

    Args:
        arrays: a list of torch tensors (integer ones pass forward only).

    Returns:
        A list, input order.

    Raises:
        TypeError / ValueError / CollectiveMismatchError: on every rank, as ``DistOpt.grouped_all_reduce`` (an
            ``arrays`` that is not a list of torch tensors, the number of tensors, a shape or dtype that differs).
        RuntimeError: backward through ``"max"``, ``"min"`` or ``"product"``.
    """
    comm = resolve(comm, "grouped_all_reduce")
    return _grouped(_GroupedAllReduce, grouped.grouped_all_reduce, comm, arrays, op)


def grouped_all_gather(arrays: Sequence[torch.Tensor], comm: Any = None) -> list[torch.Tensor]:
    """New tensors: :func:`all_gather` of each tensor of ``arrays`` (every rank's rows in rank order, shape ``(sum of
    the ranks' shape[0], *shape[1:])``; the first dimensions may differ across ranks), one fused all-gather per dtype
    (Horovod's differentiable ``grouped_allgather``). Differentiable as :func:`all_gather`: each gradient is this
    rank's rows of the summed gradient (one grouped all-reduce); Horovod's is the average, W times smaller.

    Raises:
        ValueError / TypeError / CollectiveMismatchError: on every rank, as ``DistOpt.grouped_all_gather``.
    """
    comm = resolve(comm, "grouped_all_gather")
    return _grouped(_GroupedAllGather, grouped.grouped_all_gather, comm, arrays)


def grouped_reduce_scatter(arrays: Sequence[torch.Tensor], op: str = "sum", comm: Any = None) -> list[torch.Tensor]:
    """New tensors: :func:`reduce_scatter` of each tensor of ``arrays`` (this rank's chunk of ``shape[0]`` split into
    W, shape ``(shape[0] // W, *shape[1:])``), one fused reduce-scatter per dtype (Horovod's differentiable
    ``grouped_reducescatter``). Differentiable as :func:`reduce_scatter`: the gradients are one grouped all-gather of
    the chunks' gradients (divided by W for ``"avg"``; Horovod's ``Sum`` gradient is W times larger).

    Raises:
        ValueError / TypeError / CollectiveMismatchError: on every rank, as ``DistOpt.grouped_reduce_scatter``.
        RuntimeError: backward through an op other than ``"sum"`` and ``"avg"``.
    """
    comm = resolve(comm, "grouped_reduce_scatter")
    return _grouped(_GroupedReduceScatter, grouped.grouped_reduce_scatter, comm, arrays, op)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
        ctx.op, ctx.comm = op, comm
        return checked.all_reduce(comm, _fresh(tensor), op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in ("sum", "avg"):
            raise RuntimeError(f"all_reduce(op={ctx.op!r}) has no gradient in distopt (only 'sum' and 'avg'); "
                               "detach its input or use op='sum'")
        return _AllReduce.apply(grad, ctx.op, ctx.comm), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        out, ctx.firsts = checked.all_gather_rows(comm, _fresh(tensor))
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = _AllReduce.apply(grad, "sum", ctx.comm)
        start = sum(ctx.firsts[:ctx.comm.rank])
        return total[start:start + ctx.firsts[ctx.comm.rank]], None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, comm: Communicator) -> torch.Tensor:
        ctx.root, ctx.comm = root, comm
        return checked.broadcast(comm, _fresh(tensor), root)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = _AllReduce.apply(grad, "sum", ctx.comm)
        return (total if ctx.comm.rank == ctx.root else torch.zeros_like(total)), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
        ctx.op, ctx.comm = op, comm
        return checked.reduce_scatter(comm, _plain(tensor), op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in ("sum", "avg"):
            raise RuntimeError(f"reduce_scatter(op={ctx.op!r}) has no gradient in distopt (only 'sum' and 'avg'); "
                               "detach its input or use op='sum'")
        total = _AllGather.apply(grad, ctx.comm)
        return (total if ctx.op == "sum" else total / ctx.comm.size), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, comm: Communicator) -> tuple[Any, Any]:
        ctx.comm, received = comm, None
        if splits is None:
            out, ctx.received = checked.all_to_all_rows(comm, _plain(tensor))
        else:
            out, received = checked.all_to_all(comm, _plain(tensor), splits)
            ctx.received = [int(n) for n in (received.tolist() if hasattr(received, "tolist") else received)]
        if isinstance(received, torch.Tensor):
            ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any = None) -> tuple[Any, ...]:
        return _AllToAll.apply(grad, ctx.received, ctx.comm)[0], None, None


class _GroupedAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, comm: Communicator, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.comm, ctx.floats = op, comm, _floats(tensors)
        return tuple(grouped.grouped_all_reduce(comm, _each(_fresh, tensors), op))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in ("sum", "avg"):
            raise RuntimeError(f"grouped_all_reduce(op={ctx.op!r}) has no gradient in distopt (only 'sum' and 'avg'); "
                               "detach its inputs or use op='sum'")
        return (None, None, *_spread(ctx.floats, _GroupedAllReduce.apply(ctx.op, ctx.comm, *_kept(ctx.floats, grads))))


class _GroupedAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Communicator, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, ctx.firsts = grouped.grouped_all_gather_rows(comm, _each(_fresh, tensors))
        ctx.comm, ctx.floats = comm, _floats(tensors)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        totals = _spread(ctx.floats, _GroupedAllReduce.apply("sum", ctx.comm, *_kept(ctx.floats, grads)))
        rank, firsts = ctx.comm.rank, ctx.firsts
        starts = firsts.cumsum(axis=0) - firsts  # [r, i]: rank r's first row in output i
        return (None, *[None if total is None else total[int(starts[rank, i]):int(starts[rank, i] + firsts[rank, i])]
                        for i, total in enumerate(totals)])


class _GroupedReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, comm: Communicator, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.comm, ctx.floats = op, comm, _floats(tensors)
        return tuple(grouped.grouped_reduce_scatter(comm, _each(_plain, tensors), op))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in ("sum", "avg"):
            raise RuntimeError(f"grouped_reduce_scatter(op={ctx.op!r}) has no gradient in distopt (only 'sum' and "
                               "'avg'); detach its inputs or use op='sum'")
        totals = _spread(ctx.floats, _GroupedAllGather.apply(ctx.comm, *_kept(ctx.floats, grads)))
        scale = ctx.comm.size if ctx.op == "avg" else 1
        return (None, None, *[t if t is None or scale == 1 else t / scale for t in totals])


def _grouped(function: Any, plain: Callable[..., list[Any]], comm: Communicator, arrays: Any,
             *args: Any) -> list[torch.Tensor]:
    """``function.apply(*args, comm, *arrays)`` as a list; an ``arrays`` that is no list (or an empty one) goes to the
    checked grouped call ``plain``, which raises on every rank as the others' forward does (or returns [])."""
    items = None
    if not isinstance(arrays, (str, bytes, torch.Tensor)) and hasattr(arrays, "__iter__"):
        items = list(arrays)
    if not items:
        return list(plain(comm, arrays if items is None else items, *args))
    items = [t if isinstance(t, torch.Tensor) else _not_a_tensor(t) for t in items]
    return list(function.apply(*args, comm, *items))


def _each(copy: Callable[[Any], Any], tensors: Sequence[Any]) -> list[Any]:
    """``copy`` (:func:`_fresh` or :func:`_plain`) of each tensor; the stand-ins of non-tensors as they are."""
    return [copy(t) if isinstance(t, torch.Tensor) else t for t in tensors]


def _floats(tensors: Sequence[Any]) -> list[bool]:
    """Which tensors take gradients (floating-point or complex): the same on every rank once the dtypes agreed."""
    return [isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in tensors]


def _kept(floats: list[bool], grads: Sequence[Any]) -> list[Any]:
    return [g for g, f in zip(grads, floats) if f]


def _spread(floats: list[bool], results: Sequence[Any]) -> list[Any]:
    """``results`` (one per float position) back at their positions, None elsewhere."""
    it = iter(results)
    return [next(it) if f else None for f in floats]


def _not_a_tensor(value: Any) -> Any:
    """Stands for a non-tensor item of a grouped call: the checked collective rejects it on every rank (TypeError),
    naming its type."""
    return type(f"{type(value).__name__} (the grouped autograd collectives take torch tensors)", (_NotATensor,), {})()


class _NotATensor:
    """Stands for a non-tensor argument: the checked collective rejects it on every rank (TypeError)."""


def _fresh(tensor: Any) -> Any:
    """A contiguous copy of ``tensor``'s data (the output, or the all-gather's send buffer)."""
    if not isinstance(tensor, torch.Tensor):
        return _NotATensor()
    if tensor.layout != torch.strided:  # sparse: rejected by the checked collective on every rank (TypeError)
        return tensor
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _plain(tensor: Any) -> Any:
    """``tensor``'s data, contiguous (a view when it is already), for collectives that do not write their input."""
    if not isinstance(tensor, torch.Tensor):
        return _NotATensor()
    return tensor if tensor.layout != torch.strided else tensor.detach().contiguous()
