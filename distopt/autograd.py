"""Differentiable collectives: ``all_reduce``, ``all_gather`` and ``broadcast`` that take part in autograd.

The counterparts of ``torch.distributed.nn.functional``: each is a ``torch.autograd.Function`` that returns a NEW
tensor (out of place; the input is never written) and whose backward is itself a collective, so every rank must run
backward through the same calls in the same order. The gradients are those of the global function (the loss is the
sum of every rank's loss); ``all_reduce``'s ``"max"``/``"min"`` are forward only (backward raises RuntimeError on
every rank alike, no collective issued). Backward builds on these Functions again, so higher derivatives work. Float
and complex tensors take gradients; integer tensors pass forward only.

``comm=`` is a :class:`~distopt.comm.base.Communicator`, a :class:`~distopt.launch.world.World` or a ``DistOpt``
(anything with ``.comm``), or a process group (:class:`~distopt.comm.groups.Group`, ValueError on a rank outside it);
None: the :class:`~distopt.launch.world.World` of :func:`distopt.init` (joined now when there is none). Each forward
runs the checked collective of ``DistOpt.all_reduce`` and its siblings (:mod:`distopt.array_collectives`), so a bad
argument or a shape/dtype that differs raises on every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from . import array_collectives as checked
from .comm.base import Communicator
from .comm.groups import Group, communicator_of
from .launch.world import current, init

__all__ = ["all_reduce", "all_gather", "broadcast", "resolve"]


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


class _NotATensor:
    """Stands for a non-tensor argument: the checked collective rejects it on every rank (TypeError)."""


def _fresh(tensor: Any) -> Any:
    """A contiguous copy of ``tensor``'s data (the output, or the all-gather's send buffer)."""
    if not isinstance(tensor, torch.Tensor):
        return _NotATensor()
    return tensor.detach().clone(memory_format=torch.contiguous_format)
