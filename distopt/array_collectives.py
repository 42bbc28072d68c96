"""The checked collectives on one array or tensor: argument agreement across ranks, then the backend call.

What both the blocking and the asynchronous forms of ``DistOpt.all_reduce`` and its siblings run (see
:class:`~distopt.collectives.Collectives`). Each call first agrees on its arguments
(:func:`~distopt.comm.consensus.agree`: one small all-gather of ``(argument error?, digest of the collective, shape,
dtype and arguments, first dimension)`` per rank). A bad argument on one rank (``"<call> on rank <r>: <error>"``), or
a collective, shape, dtype or argument that differs (``"<call>: <field> differs across ranks (rank 0: <value>,
...)"``), then raises the same exception on every rank, and no data moves. Arrays: NumPy, CuPy (the NCCL backend), or
torch tensors (viewed without a copy, results returned as tensors of the input's dtype and device); sizes in ELEMENTS.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .comm.base import Communicator, check_reduce_args
from .comm.consensus import agree
from .core._array import xp_of

__all__ = ["all_reduce", "broadcast", "all_gather", "all_gather_rows", "reduce_scatter", "all_to_all"]


def all_reduce(comm: Communicator, array: Any, op: str = "sum") -> Any:
    """In-place all-reduce of ``array`` (any shape; ``op`` in sum, avg, max, min); returns ``array``.

    Raises:
        TypeError: on every rank, naming the rank: ``op="avg"`` on an integer or bool array, a non-contiguous or
            sparse tensor, not an array.
        ValueError: on every rank, an unknown ``op``.
        CollectiveMismatchError: on every rank, the shape, dtype or op differs across ranks.
    """
    view, _ = _agreed(comm, "all_reduce", array, op=op)
    comm.all_reduce(view, op=op)
    return array


def broadcast(comm: Communicator, array: Any, root: int = 0) -> Any:
    """In-place broadcast of ``array`` from ``root``; returns ``array``.

    Raises:
        ValueError: on every rank, ``root`` outside ``[0, size)`` on some rank.
        TypeError / CollectiveMismatchError: as :func:`all_reduce`.
    """
    view, _ = _agreed(comm, "broadcast", array, root=root)
    comm.broadcast(view, root=root)
    return array


def all_gather(comm: Communicator, array: Any) -> Any:
    """Every rank's rows, in rank order: a new array of shape ``(sum of the ranks' shape[0], *shape[1:])``.

    The first dimension may differ across ranks (0 allowed); the other dimensions and the dtype must not. Equal first
    dimensions travel in the backend's ``all_gather``, different ones in ``all_gather_v`` (flattened).

    Raises:
        ValueError: on every rank, a 0-d array on some rank.
        TypeError: on every rank, a non-contiguous or sparse tensor, not an array.
        CollectiveMismatchError: on every rank, ``shape[1:]`` or the dtype differs; the message names the ranks and
            their full shapes.
    """
    return all_gather_rows(comm, array)[0]


def all_gather_rows(comm: Communicator, array: Any) -> tuple[Any, list[int]]:
    """:func:`all_gather`, and every rank's first dimension (rows), in rank order."""
    view, firsts = _agreed(comm, "all_gather", array)
    rest = tuple(view.shape[1:])
    if len(set(firsts)) == 1:
        out = comm.all_gather(view).reshape((firsts[0] * comm.size,) + rest)
    else:
        parts = comm.all_gather_v(view.reshape(-1))
        out = xp_of(parts[0]).concatenate(parts).reshape((sum(firsts),) + rest)
    return _like(array, out), firsts


def reduce_scatter(comm: Communicator, array: Any, op: str = "sum") -> Any:
    """This rank's chunk of the reduction: ``array``'s first dimension is split into ``size`` equal chunks (as
    ``torch.distributed.reduce_scatter_tensor``) and chunk ``rank`` of the elementwise reduction over ranks is
    returned, a new array of shape ``(shape[0] // size, *shape[1:])``. ``array`` is not changed (the backend works on
    a copy: one array's worth of extra memory).

    Raises:
        ValueError: on every rank, ``shape[0]`` not divisible by the world size (or a 0-d array), an unknown op.
        TypeError / CollectiveMismatchError: as :func:`all_reduce` (the shapes must be equal).
    """
    view, _ = _agreed(comm, "reduce_scatter", array, op=op)
    rows = view.shape[0] // comm.size
    work = view.reshape(-1).copy()  # the backends treat their input as overwritten
    mine = comm.reduce_scatter(work, [work.size // comm.size] * comm.size, op)
    if getattr(mine, "base", None) is not None:
        mine = mine.copy()  # not a view that keeps the whole work buffer alive
    return _like(array, mine.reshape((rows,) + tuple(view.shape[1:])))


def all_to_all(comm: Communicator, array: Any) -> Any:
    """``array``'s first dimension split into ``size`` equal chunks; chunk ``j`` goes to rank ``j`` (as
    ``torch.distributed.all_to_all_single`` without split sizes). Returns a new array of ``array``'s shape and dtype
    whose chunk ``i`` is rank ``i``'s chunk ``rank``.

    Raises:
        ValueError / TypeError / CollectiveMismatchError: as :func:`reduce_scatter`.
    """
    view, _ = _agreed(comm, "all_to_all", array)
    out = comm.all_to_all(view.reshape(comm.size, -1))
    return _like(array, out.reshape(view.shape))


def _view(array: Any) -> Any:
    """A NumPy/CuPy view of a torch tensor (zero-copy); arrays as they are; TypeError for anything else."""
    if type(array).__module__.startswith("torch"):
        from .torch.adapter import as_array

        return as_array(array)
    if not (hasattr(array, "shape") and hasattr(array, "dtype") and hasattr(array, "reshape")):
        raise TypeError(f"expected a NumPy/CuPy array or a torch tensor, got {type(array).__name__}")
    return array


def _like(array: Any, out: Any) -> Any:
    """``out`` as a torch tensor when the caller passed one (sharing ``out``'s memory), else as it is."""
    if type(array).__module__.startswith("torch"):
        from .torch.adapter import as_tensor

        return as_tensor(out)
    return out


def _check(comm: Communicator, call: str, view: Any, args: dict[str, Any]) -> None:
    """This rank's own validation of the call (TypeError / ValueError)."""
    if call in ("all_reduce", "reduce_scatter"):
        check_reduce_args(view, args["op"])
    if call == "broadcast":
        root = args["root"]
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
            raise ValueError(f"root must be in [0, {comm.size}), got {root!r}")
        check_reduce_args(view, "sum")  # contiguity
    if call in ("all_gather", "reduce_scatter", "all_to_all"):
        if view.ndim < 1:
            raise ValueError(f"{call} needs an array of at least 1 dimension, got a 0-d one")
        check_reduce_args(view, args.get("op", "sum"))  # contiguity
    if call in ("reduce_scatter", "all_to_all") and view.shape[0] % comm.size:
        raise ValueError(f"{call} splits the first dimension into {comm.size} equal chunks (the world size), "
                         f"got shape {tuple(view.shape)}")


def _agreed(comm: Communicator, call: str, array: Any, **args: Any) -> tuple[Any, list[int]]:
    """The array view of ``array`` and every rank's first dimension, once every rank has checked its arguments and
    they match (all_gather: beyond the first dimension); see the module docs."""
    view, problem = None, None
    try:
        view = _view(array)
        _check(comm, call, view, args)
    except (TypeError, ValueError) as exc:
        problem = exc
    shape = tuple(int(n) for n in getattr(array, "shape", ()))
    plain = {k: int(v) if isinstance(v, np.integer) else v for k, v in args.items()}
    gather = call == "all_gather"
    shape_field = "shape beyond the first dimension" if gather else "shape"
    fields = {"collective": call, shape_field: shape[1:] if gather else shape,
              "dtype": str(getattr(array, "dtype", "")), "arguments": plain}
    firsts = agree(comm, fields, call=call, problem=problem, kinds=(ValueError, TypeError),
                   shown={shape_field: shape}, extra=[shape[0] if shape else 0],
                   hint={"collective": "the ranks must call the same collectives in the same order"})
    return view, [int(n) for n in firsts[:, 0]]
