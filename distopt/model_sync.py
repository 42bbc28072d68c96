"""Model-aware synchronization: a module's parameters and buffers, by name, from one rank.

``DistOpt(opt, model=model)`` uses these at construction (rank 0's
parameters, frozen ones and ones outside the optimizer included, and its
buffers), before each training-mode forward (``broadcast_buffers=True``),
in ``opt.sync_buffers()`` and in ``opt.broadcast_state()``.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from .buckets import is_float, pack, plan_buckets, unpack
from .comm.base import Communicator
from .engine import DEFAULT_THRESHOLD
from .errors import CollectiveMismatchError
from .torch import as_array

__all__ = ["check_names", "broadcast_arrays", "average_arrays", "named_state", "parameter_names"]


def check_names(comm: Communicator, names: Sequence[str], what: str) -> None:
    """Compare ``names`` (in order) across ranks (one variable-length all-gather).

    Raises:
        CollectiveMismatchError: on every rank, naming the first position
            where rank 0 and another rank differ, and the fix.
    """
    blob = np.frombuffer(json.dumps(list(names)).encode(), dtype=np.uint8).copy()
    everyone = [json.loads(b.tobytes()) for b in comm.all_gather_v(blob)]
    ref = everyone[0]
    for r, other in enumerate(everyone[1:], start=1):
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "(none)"
            b = other[i] if i < len(other) else "(none)"
            if a != b:
                raise CollectiveMismatchError(
                    f"{what} #{i} differs across ranks: rank 0 has {a!r}, rank {r} has {b!r}; every rank must "
                    "build the same model and give the optimizer its parameters in the same order")


def broadcast_arrays(comm: Communicator, arrays: Sequence[Any], root: int = 0) -> None:
    """Overwrite ``arrays`` (NumPy/CuPy, any dtype) with ``root``'s values, fused per dtype (collective)."""
    arrays = list(arrays)
    for bucket in plan_buckets([(a.shape, a.dtype) for a in arrays], DEFAULT_THRESHOLD, DEFAULT_THRESHOLD):
        flat, viewed = pack(bucket, arrays)
        comm.broadcast(flat, root=root)
        if not viewed:
            unpack(bucket, flat, arrays)


def average_arrays(comm: Communicator, arrays: Sequence[Any]) -> None:
    """Average the float ``arrays`` across ranks in place; others get rank 0's values (collective)."""
    arrays = list(arrays)
    floats = [a for a in arrays if is_float(a)]
    for bucket in plan_buckets([(a.shape, a.dtype) for a in floats], DEFAULT_THRESHOLD, DEFAULT_THRESHOLD):
        flat, viewed = pack(bucket, floats)
        comm.all_reduce(flat, op="avg")
        if not viewed:
            unpack(bucket, flat, floats)
    broadcast_arrays(comm, [a for a in arrays if not is_float(a)], 0)


def named_state(model: Any, buffers: bool = True) -> tuple[list[str], list[Any]]:
    """``(names, arrays)``: every parameter of ``model`` (frozen ones too), then its buffers if asked.

    Arrays are views: writing them changes the model. Tied parameters
    appear once.
    """
    names: list[str] = [n for n, _ in model.named_parameters()]
    tensors: list[Any] = [p for _, p in model.named_parameters()]
    if buffers:
        for n, b in model.named_buffers():
            names.append(n)
            tensors.append(b)
    return names, [as_array(t) for t in tensors]


def parameter_names(model: Any, params: Sequence[Any]) -> list[str]:
    """The model's name of each tensor in ``params`` (``"(outside the model) #i"`` where it has none)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), f"(outside the model) #{i}") for i, p in enumerate(params)]


def attach_model(face: Any, model: Any, broadcast_buffers: bool) -> None:
    """``DistOpt(opt, model=model)``: check names, broadcast rank 0's parameters and buffers, hook forwards.

    The names of the model's parameters and buffers, and of the optimizer's
    parameters in the optimizer's order, are compared across ranks first.

    Raises:
        CollectiveMismatchError: on every rank, naming the first differing name.
    """
    names, arrays = named_state(model)
    check_names(face.comm, names, "model parameter or buffer")
    check_names(face.comm, parameter_names(model, face.local.params()), "optimizer parameter")
    face.engine.broadcast_params(arrays, {"world_size": face.world_size})
    in_model = {id(p) for p in model.parameters()}
    outside = [as_array(p) for p in face.local.params() if id(p) not in in_model]
    if outside:
        face.sync_params(outside)
    if broadcast_buffers and any(True for _ in model.buffers()):
        def before_forward(module: Any, inputs: Any) -> None:  # noqa: ARG001
            if module.training:
                face.sync_buffers("broadcast")

        face.local.handles.append(model.register_forward_pre_hook(before_forward))
