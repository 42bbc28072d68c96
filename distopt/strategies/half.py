"""Half-precision gradient all-reduce (SINGA's ``backward_and_update_half``)."""
from __future__ import annotations

from typing import Any

from ..comm.base import Communicator
from ..compress import from_wire, half_scales, to_wire

__all__ = ["average_half"]


def average_half(comm: Communicator, flat: Any, *, wire: str = "float16", predivide: float | None = None,
                 clip_value: float | None = None, divisor: int | None = None) -> int:
    """Average ``flat`` across ranks in place, sending 16-bit floats.

    Steps: optional element clipping to ``[-clip_value, clip_value]`` (as
    the seed's ``clipping``), scale by ``1/predivide``, cast to ``wire``,
    sum-all-reduce in the wire dtype, cast back to ``flat.dtype``, scale by
    ``predivide/world_size``. With the default ``predivide = world_size``
    the sum cannot exceed the largest rank's value, so 4 ranks each sending
    40000 average to 40000, not inf (Horovod #1699, PyTorch #57410; shared
    case H06); ``predivide=1`` keeps small gradients from flushing to zero
    (H07) at the risk of overflow (fairscale PR 565 splits the factor).

    What travels: 2 bytes per element. On the MPI backend float16/bfloat16
    move as 16-bit words reduced by a user-defined op that adds in float32
    and rounds once per combination; NCCL reduces float16 natively.

    Args:
        comm: the communicator.
        flat: 1-D float array (float32/float64), overwritten with the average.
        wire: ``"float16"`` or ``"bfloat16"``.
        predivide: factor divided out before the sum (default world size).
        clip_value: clip elements to this magnitude first (None: no clip).
        divisor: ranks to average over (default the world size; fewer while
            some ranks have joined and contribute zeros).

    Returns:
        Bytes this rank handed to the all-reduce (``2 * flat.size``).
    """
    divisor = comm.size if divisor is None else divisor
    pre, post = half_scales(divisor, comm.size if predivide is None else predivide)
    src = flat
    if clip_value is not None:
        src = src.clip(-clip_value, clip_value)
    w = to_wire(src, wire, pre)
    comm.all_reduce(w, op="sum")
    flat[...] = from_wire(w, flat.dtype, post)
    return int(w.nbytes)
