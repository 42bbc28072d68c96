"""Half precision on the wire: buckets travel as float16 or bfloat16.

SINGA's ``backward_and_update_half``. Per bucket: optional element clipping to ``[-clip, clip]`` (the seed's
``clipping``), scale by ``1/predivide``, cast to the wire dtype, sum-all-reduce in the wire dtype, cast back, scale by
``predivide / divisor``. The choice of ``predivide`` (overflow against underflow) is explained at
:func:`distopt.compress.half_scales`.

On the MPI backend float16/bfloat16 move as 16-bit words: a reduce-scatter, a float32 sum of each chunk rounded once,
and an all-gather (:mod:`distopt.comm.mpi_half`); NCCL and gloo reduce them natively.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ..compress import WIRE_DTYPES, from_wire, half_scales, to_wire
from ..core.buckets import VIEW_THRESHOLD
from .base import BucketContext, Done, GradientStrategy, Handle, LocalInfo
from .registry import Example, register

__all__ = ["Half"]


class Half(GradientStrategy):
    """Average gradients sent as 16-bit floats (2 bytes per element on the wire).

    Args:
        wire: ``"float16"`` or ``"bfloat16"`` (NumPy arrays need ml_dtypes for bfloat16).
        predivide: the factor gradients are divided by before the cast; None means the world size (no overflow).
            Finite and > 0.
        clip: clip gradient elements to ``[-clip, clip]`` before the cast; None for no clipping.

    Raises:
        ValueError: ``wire`` not in ``("float16", "bfloat16")``, ``clip <= 0``, or (at the first step) a ``predivide``
            out of range.
    """

    name: ClassVar[str] = "half"
    supports_overlap: ClassVar[bool] = True
    supports_join: ClassVar[bool] = True
    default_threshold: ClassVar[int] = VIEW_THRESHOLD
    supports_sharding: ClassVar[bool] = True

    def __init__(self, wire: str = "float16", predivide: float | None = None, clip: float | None = None) -> None:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire must be one of {WIRE_DTYPES}, got {wire!r}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be > 0 (or None for no clipping), got {clip}")
        self.wire = wire
        self.predivide = None if predivide is None else float(predivide)
        self.clip = None if clip is None else float(clip)
        self._factor = 1.0

    def settings(self) -> dict[str, Any]:
        return {"wire": self.wire, "predivide": self.predivide, "clip": self.clip}

    def bind(self, world_size: int, local: LocalInfo) -> None:  # noqa: ARG002
        self._factor = float(world_size if self.predivide is None else self.predivide)
        half_scales(world_size, self._factor)  # validates predivide

    def start(self, ctx: BucketContext, flat: Any) -> Handle:
        src = flat if self.clip is None else flat.clip(-self.clip, self.clip)
        return ctx.launch(to_wire(src, self.wire, 1.0 / self._factor), "sum")

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:
        wire = started.wait()  # the wire sum: the whole bucket, or this rank's segment
        result = from_wire(wire, ctx.bucket.dtype, self._factor / divisor, out=ctx.out)
        return Done(2 * ctx.bucket.size, 1, None if ctx.out is not None else result)


register(Example("half-fp16", Half, {"wire": "float16"}, mismatch={"wire": "float16", "predivide": 1.0}),
         Example("half-bf16", Half, {"wire": "bfloat16", "clip": 2.0}, mismatch={"wire": "bfloat16"},
                 requires=("ml_dtypes",)))
