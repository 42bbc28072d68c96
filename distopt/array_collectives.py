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
from .comm.adasum import ADASUM, adasum_all_reduce, check_adasum
from .comm.consensus import agree
from .comm.scaled import all_reduce_scaled, check_scale, reduce_scatter_scaled, scale_in_place
from .comm.uneven import all_to_all_v
from .core._array import xp_of

__all__ = ["all_reduce", "broadcast", "all_gather", "all_gather_rows", "reduce_scatter", "all_to_all",
           "all_to_all_rows"]


def all_reduce(comm: Communicator, array: Any, op: str = "sum", prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> Any:
    """In-place all-reduce of ``array`` (any shape; ``op`` in sum, avg, max, min, product); returns ``array``.

    With factors (Horovod's): ``postscale_factor * reduce(prescale_factor * array)``, integers scaled in float64 and
    cast back (:mod:`distopt.comm.scaled`).

    Raises:
        TypeError: on every rank, naming the rank: ``op="avg"`` on an integer or bool array, a non-contiguous or
            sparse tensor, not an array, a factor that is not a real number or is not 1 on a bool array.
        ValueError: on every rank, an unknown ``op``, a factor that is not finite.
        CollectiveMismatchError: on every rank, the shape, dtype, op or factors differ across ranks.
    """
    view, _ = _agreed(comm, "all_reduce", array, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor)
    if op == ADASUM:  # scale-equivariant: postscale * adasum(prescale * x)
        flat = scale_in_place(view.reshape(-1), float(prescale_factor))
        scale_in_place(adasum_all_reduce(comm, flat), float(postscale_factor))
    else:
        all_reduce_scaled(comm, view, op, float(prescale_factor), float(postscale_factor))
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


def reduce_scatter(comm: Communicator, array: Any, op: str = "sum", prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0) -> Any:
    """This rank's chunk of the reduction: ``array``'s first dimension is split into ``size`` equal chunks (as
    ``torch.distributed.reduce_scatter_tensor``) and chunk ``rank`` of the elementwise reduction over ranks is
    returned, a new array of shape ``(shape[0] // size, *shape[1:])``. ``array`` is not changed (the backend works on
    a copy: one array's worth of extra memory). Factors as :func:`all_reduce`.

    Raises:
        ValueError: on every rank, ``shape[0]`` not divisible by the world size (or a 0-d array), an unknown op.
        TypeError / CollectiveMismatchError: as :func:`all_reduce` (the shapes must be equal).
    """
    view, _ = _agreed(comm, "reduce_scatter", array, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor)
    rows = view.shape[0] // comm.size
    work = view.reshape(-1).copy()  # the backends treat their input as overwritten
    mine = reduce_scatter_scaled(comm, work, [work.size // comm.size] * comm.size, op, float(prescale_factor),
                                 float(postscale_factor))
    return _like(array, mine.reshape((rows,) + tuple(view.shape[1:])))


def all_to_all(comm: Communicator, array: Any, splits: Any = None) -> Any:
    """Rows of ``array``'s first dimension sent to each rank (Horovod's ``alltoall``, ``all_to_all_single``).

    ``splits``: ``size`` ints >= 0 summing to ``shape[0]``, the ROWS sent to each rank in rank order (a list, a NumPy
    or torch integer array; uneven allowed); None: ``shape[0]`` split into ``size`` equal chunks. ``shape[0]`` may
    differ across ranks, ``shape[1:]`` and the dtype must not. Equal chunks everywhere travel in the backend's
    ``all_to_all``, others in its ``all_to_all_v`` (:mod:`distopt.comm.uneven`).

    Returns:
        A new array of shape ``(rows received, *shape[1:])``, rank i's rows after rank i-1's; with ``splits``,
        ``(array, received_splits)``: the rows received from each rank, of ``splits``'s kind (a torch tensor of its
        dtype and device, a NumPy array of its dtype, else a list of ints).

    Raises:
        ValueError: on every rank, naming the rank: ``splits`` not ``size`` ints >= 0 summing to ``shape[0]``; without
            ``splits``, ``shape[0]`` not divisible by ``size``; a 0-d array.
        TypeError: on every rank, as :func:`all_reduce`.
        CollectiveMismatchError: on every rank, ``shape[1:]`` or the dtype differs, or some ranks pass ``splits`` and
            others not.
    """
    out, gets = all_to_all_rows(comm, array, splits)
    return out if splits is None else (out, _splits_like(splits, gets))


def all_to_all_rows(comm: Communicator, array: Any, splits: Any = None) -> tuple[Any, list[int]]:
    """:func:`all_to_all`'s array, and the rows received from each rank (a list of ints, with or without
    ``splits``)."""
    view, table = _agreed_table(comm, "all_to_all", array, splits, splits=splits is not None)
    size, rest = comm.size, tuple(view.shape[1:])
    rows = [[int(n) for n in table[i, 1:]] if splits is not None else [int(table[i, 0]) // size] * size
            for i in range(size)]
    gets = [rows[i][comm.rank] for i in range(size)]
    if len({n for row in rows for n in row}) == 1:
        out = comm.all_to_all(view.reshape(size, -1)).reshape((sum(gets),) + rest)
    else:
        per_row = int(np.prod(rest, dtype=np.int64))
        out = all_to_all_v(comm, view.reshape(-1), [[n * per_row for n in row] for row in rows])
        out = out.reshape((sum(gets),) + rest)
    return _like(array, out), gets


def _split_rows(splits: Any, size: int, rows: int) -> list[int]:
    """``splits`` as ``size`` Python ints; ValueError unless they are ints >= 0 summing to ``rows``."""
    dtype = getattr(splits, "dtype", None)
    if dtype is not None and str(dtype).replace("torch.", "").rstrip("0123456789") not in ("int", "uint"):
        raise ValueError(f"splits must hold integers (ROWS sent to each rank), got dtype {dtype}")
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    try:
        got = list(values)
    except TypeError:
        raise ValueError(f"splits must be a sequence of {size} ints (ROWS sent to each rank), got {splits!r}") from None
    if len(got) != size or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in got):
        raise ValueError(f"splits must be {size} ints (ROWS sent to each rank, one per rank), got {got}")
    if min(got) < 0 or sum(got) != rows:
        raise ValueError(f"splits must be ints >= 0 summing to the first dimension ({rows} rows), got {got} "
                         f"(sum {sum(got)})")
    return [int(n) for n in got]


def _splits_like(splits: Any, values: list[int]) -> Any:
    """``values`` of ``splits``'s kind: a torch tensor (its dtype and device), a NumPy array (its dtype), or a list."""
    if type(splits).__module__.startswith("torch"):
        import torch

        return torch.tensor(values, dtype=splits.dtype, device=splits.device)
    if isinstance(splits, np.ndarray):
        return np.asarray(values, dtype=splits.dtype)
    return list(values)


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
        _check_op(comm, call, view, args["op"])
        for name in ("prescale_factor", "postscale_factor"):
            check_scale(name, args.get(name, 1.0), view.dtype)
    if call == "broadcast":
        root = args["root"]
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
            raise ValueError(f"root must be in [0, {comm.size}), got {root!r}")
        check_reduce_args(view, "sum")  # contiguity
    if call in ("all_gather", "reduce_scatter", "all_to_all"):
        if view.ndim < 1:
            raise ValueError(f"{call} needs an array of at least 1 dimension, got a 0-d one")
        check_reduce_args(view, args.get("op", "sum"))  # contiguity
    if (call == "reduce_scatter" or call == "all_to_all" and not args.get("splits")) and view.shape[0] % comm.size:
        raise ValueError(f"{call} splits the first dimension into {comm.size} equal chunks (the world size), "
                         f"got shape {tuple(view.shape)}")


def _check_op(comm: Communicator, call: str, view: Any, op: str) -> None:
    """Validate ``op`` for ``call`` on ``view``: ``"adasum"`` on all_reduce only
    (:func:`~distopt.comm.adasum.check_adasum`), the others by :func:`~distopt.comm.base.check_reduce_args`."""
    if op != ADASUM:
        check_reduce_args(view, op)
    elif call != "all_reduce":
        raise ValueError(f"op='adasum' is an all_reduce reduction only (Horovod's Adasum has no {call} either)")
    else:
        check_adasum(view, comm.size)


def _agreed(comm: Communicator, call: str, array: Any, **args: Any) -> tuple[Any, list[int]]:
    """The array view of ``array`` and every rank's first dimension, once every rank has checked its arguments and
    they match (all_gather, all_to_all: beyond the first dimension); see the module docs."""
    view, table = _agreed_table(comm, call, array, None, **args)
    return view, [int(n) for n in table[:, 0]]


def _agreed_table(comm: Communicator, call: str, array: Any, given: Any, **args: Any) -> tuple[Any, np.ndarray]:
    """:func:`_agreed`, returning every rank's ``(first dimension, *splits)`` (int64, one row per rank): ``given`` is
    all_to_all's ``splits``, validated here and gathered, not agreed on (zeros without them; none for other calls)."""
    view, problem = None, None
    sent = [0] * comm.size if call == "all_to_all" else []
    try:
        view = _view(array)
        _check(comm, call, view, args)
        if given is not None:
            sent = _split_rows(given, comm.size, int(view.shape[0]))
    except (TypeError, ValueError) as exc:
        problem = exc
    shape = tuple(int(n) for n in getattr(array, "shape", ()))
    plain = {k: int(v) if isinstance(v, np.integer) else float(v) if isinstance(v, np.floating) else v
             for k, v in args.items()}
    gather = call in ("all_gather", "all_to_all")
    shape_field = "shape beyond the first dimension" if gather else "shape"
    fields = {"collective": call, shape_field: shape[1:] if gather else shape,
              "dtype": str(getattr(array, "dtype", "")), "arguments": plain}
    firsts = agree(comm, fields, call=call, problem=problem, kinds=(ValueError, TypeError),
                   shown={shape_field: shape}, extra=[shape[0] if shape else 0, *sent],
                   hint={"collective": "the ranks must call the same collectives in the same order"})
    return view, firsts
