"""Grouped collectives: many arrays in one fused collective per dtype (Horovod's ``grouped_allreduce``,
``grouped_allgather``, ``grouped_reducescatter``); what ``DistOpt.grouped_all_reduce`` and its siblings run.

The arrays are packed as the step packs gradients (:func:`distopt.core.buckets.plan_buckets` with no size limit: one
flat buffer per dtype, the dtypes in the order of their first array; a dtype's lone C-contiguous array is reduced in
place, with no copy), one collective runs per buffer, and the results come back per array, in input order. First the
ranks agree on the call (:func:`~distopt.comm.consensus.agree`, one small all-gather): the number of arrays, each one's
shape (``grouped_all_gather``: beyond the first dimension) and dtype, the op and the factors. A bad array on one rank
(``"<call> on rank <r>: arrays[<i>]: <error>"``) or lists that differ (``"<call>: shape of each array differs across
ranks (rank 0: [...], ...)"``) raise the same exception on every rank, and no data moves. Arrays: NumPy, CuPy or torch
tensors (as :mod:`distopt.array_collectives`; all on the host, or all on one GPU); counts in ELEMENTS. Factors:
``postscale_factor * reduce(prescale_factor * x)`` (:mod:`distopt.comm.scaled`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .array_collectives import _like, _view
from .comm.base import REDUCE_OPS, Communicator, check_reduce_args
from .comm.consensus import agree
from .comm.scaled import all_reduce_scaled, check_scale, reduce_scatter_scaled
from .core._array import xp_of
from .core.buckets import Bucket, pack, plan_buckets, unpack

__all__ = ["grouped_all_reduce", "grouped_all_gather", "grouped_all_gather_rows", "grouped_reduce_scatter"]

_NO_LIMIT = 1 << 62  # plan_buckets' threshold and capacity: one bucket per dtype


def grouped_all_reduce(comm: Communicator, arrays: Sequence[Any], op: str = "sum", prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[Any]:
    """In-place all-reduce of every array of ``arrays`` (any shapes; ``op`` in sum, avg, max, min, product), one
    fused all-reduce per dtype.

    Returns:
        The arrays themselves (a new list, input order), holding the results.

    Raises:
        TypeError: on every rank, naming the rank and the array: ``op="avg"`` on an integer or bool array, a
            non-contiguous or sparse tensor, not an array, arrays on different devices, a factor that is not a real
            number or is not 1 on a bool array.
        ValueError: on every rank, an unknown ``op``, a factor that is not finite.
        CollectiveMismatchError: on every rank, the number of arrays, a shape or dtype, the op or a factor differs.
    """
    items, views, _ = _agreed(comm, "grouped_all_reduce", arrays, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor)
    for bucket in _buckets(views):
        flat, viewed = pack(bucket, views)
        all_reduce_scaled(comm, flat, op, float(prescale_factor), float(postscale_factor))
        if not viewed:
            unpack(bucket, flat, views)
    return items


def grouped_all_gather(comm: Communicator, arrays: Sequence[Any]) -> list[Any]:
    """Every rank's rows of each array, in rank order (:func:`~distopt.array_collectives.all_gather` per array), one
    fused all-gather per dtype (``all_gather_v`` where the ranks' buffers differ in size).

    Returns:
        New arrays/tensors, input order: array ``i`` of shape ``(sum of the ranks' shape[0], *shape[1:])``.

    Raises:
        ValueError: on every rank, a 0-d array on some rank.
        TypeError: on every rank, as :func:`grouped_all_reduce`.
        CollectiveMismatchError: on every rank, the number of arrays, a shape beyond the first dimension or a dtype
            differs.
    """
    return grouped_all_gather_rows(comm, arrays)[0]


def grouped_all_gather_rows(comm: Communicator, arrays: Sequence[Any]) -> tuple[list[Any], np.ndarray]:
    """:func:`grouped_all_gather`, and every rank's first dimension of each array (int64, shape ``(size, len)``:
    rank r's rows of array i at ``[r, i]``; what the differentiable form slices its gradient with)."""
    items, views, firsts = _agreed(comm, "grouped_all_gather", arrays)
    out: list[Any] = [None] * len(views)
    for bucket in _buckets(views):
        row = [int(np.prod(s.shape[1:], dtype=np.int64)) for s in bucket.slots]  # ELEMENTS per row
        sizes = [[int(firsts[r, s.index]) * n for s, n in zip(bucket.slots, row)] for r in range(comm.size)]
        flat, _ = pack(bucket, views)
        if len({sum(per) for per in sizes}) == 1:
            parts = list(comm.all_gather(flat))
        else:
            parts = comm.all_gather_v(flat)
        starts = [np.cumsum([0] + per).tolist() for per in sizes]
        xp = xp_of(parts[0])
        for j, s in enumerate(bucket.slots):
            pieces = [parts[r][starts[r][j]:starts[r][j + 1]] for r in range(comm.size)]
            shape = (int(firsts[:, s.index].sum()),) + tuple(views[s.index].shape[1:])
            out[s.index] = _like(items[s.index], xp.concatenate(pieces).reshape(shape))
    return out, firsts


def grouped_reduce_scatter(comm: Communicator, arrays: Sequence[Any], op: str = "sum", prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> list[Any]:
    """This rank's chunk of each array's reduction (:func:`~distopt.array_collectives.reduce_scatter` per array:
    ``shape[0]`` split into ``size`` equal chunks), one fused reduce-scatter per dtype: rank r's segment of the buffer
    holds chunk r of every array of that dtype. The arrays are not changed.

    Returns:
        New arrays/tensors, input order: array ``i`` of shape ``(shape[0] // size, *shape[1:])``.

    Raises:
        ValueError: on every rank, ``shape[0]`` not divisible by the world size (or a 0-d array), an unknown op.
        TypeError / CollectiveMismatchError: as :func:`grouped_all_reduce`.
    """
    items, views, _ = _agreed(comm, "grouped_reduce_scatter", arrays, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor)
    size, out = comm.size, [None] * len(views)
    for bucket in _buckets(views):
        per = [s.size // size for s in bucket.slots]  # ELEMENTS of one chunk of each array
        segment = sum(per)
        work = xp_of(views[bucket.slots[0].index]).empty(bucket.size, dtype=bucket.dtype)
        grid, col = work.reshape(size, segment), 0
        for s, p in zip(bucket.slots, per):
            grid[:, col:col + p] = views[s.index].reshape(size, p)
            col += p
        mine = reduce_scatter_scaled(comm, work, [segment] * size, op, float(prescale_factor),
                                     float(postscale_factor))
        col = 0
        for s, p in zip(bucket.slots, per):
            shape = (s.shape[0] // size,) + tuple(s.shape[1:])
            out[s.index] = _like(items[s.index], mine[col:col + p].reshape(shape))
            col += p
    return out


def _buckets(views: list[Any]) -> list[Bucket]:
    """One bucket per dtype, in the order of each dtype's first array."""
    return plan_buckets([(tuple(v.shape), v.dtype) for v in views], _NO_LIMIT, _NO_LIMIT)


def _place(view: Any) -> str:
    """Where an array lives: ``"host"`` or ``"cuda:<device>"``."""
    return "host" if isinstance(view, np.ndarray) else f"cuda:{getattr(getattr(view, 'device', None), 'id', '?')}"


def _check(comm: Communicator, call: str, views: list[Any], args: dict[str, Any]) -> None:
    """This rank's own validation of the call (TypeError / ValueError)."""
    op = args.get("op", "sum")
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    places = sorted({_place(v) for v in views})
    if len(places) > 1:
        raise TypeError(f"the arrays of one grouped call must all be on the host or all on one GPU, got {places}")
    for i, view in enumerate(views):
        try:
            check_reduce_args(view, op)  # contiguity, and the op for the dtype
            if call != "grouped_all_reduce" and view.ndim < 1:
                raise ValueError(f"{call} needs arrays of at least 1 dimension, got a 0-d one")
            if call == "grouped_reduce_scatter" and view.shape[0] % comm.size:
                raise ValueError(f"{call} splits the first dimension into {comm.size} equal chunks (the world size), "
                                 f"got shape {tuple(view.shape)}")
            for name in ("prescale_factor", "postscale_factor"):
                if name in args:
                    check_scale(name, args[name], view.dtype)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"arrays[{i}]: {exc}") from exc
    for name in ("prescale_factor", "postscale_factor"):
        if name in args:
            check_scale(name, args[name], np.float64)  # a bad factor with no array to check it on


def _agreed(comm: Communicator, call: str, arrays: Sequence[Any], **args: Any
            ) -> tuple[list[Any], list[Any], np.ndarray]:
    """``arrays`` as a list, their array views, and every rank's first dimension of each (int64, shape
    ``(size, len)``; ``grouped_all_gather`` only, else empty), once every rank has checked its arguments and they match
    (module docs)."""
    items: list[Any] = []
    views: list[Any] = []
    problem = None
    try:
        if isinstance(arrays, (str, bytes)) or hasattr(arrays, "shape") or not hasattr(arrays, "__iter__"):
            raise TypeError(f"arrays must be a list of arrays or tensors, got {type(arrays).__name__} (one array: "
                            "the collective without grouped_)")
        items = list(arrays)
        for i, array in enumerate(items):
            try:
                views.append(_view(array))
            except TypeError as exc:
                raise TypeError(f"arrays[{i}]: {exc}") from exc
        _check(comm, call, views, args)
    except (TypeError, ValueError) as exc:
        problem = exc
    shapes = [tuple(int(n) for n in getattr(a, "shape", ())) for a in items]
    plain = {k: int(v) if isinstance(v, np.integer) else float(v) if isinstance(v, np.floating) else v
             for k, v in args.items()}
    gather = call == "grouped_all_gather"
    shape_field = "shape beyond the first dimension of each array" if gather else "shape of each array"
    fields = {"collective": call, "number of arrays": len(items),
              shape_field: [s[1:] for s in shapes] if gather else shapes,
              "dtype of each array": [str(getattr(a, "dtype", "")) for a in items], "arguments": plain}
    agree(comm, fields, call=call, problem=problem, kinds=(ValueError, TypeError), shown={shape_field: shapes},
          hint={"collective": "the ranks must call the same collectives in the same order"})
    if not (gather and views):
        return items, views, np.zeros((comm.size, 0), np.int64)
    mine = np.array([int(v.shape[0]) for v in views], dtype=np.int64)
    return items, views, np.asarray(comm.all_gather(mine)).reshape(comm.size, len(views))
