"""Plain averaging: every bucket is summed by an all-reduce in its own dtype.

SINGA's ``backward_and_update`` with the tensor fusion of Horovod and ChainerMN's ``pure_nccl`` communicator: one
all-reduce per bucket, then one division by the number of contributing ranks, folded into the unpack. With
``predivide`` (Horovod's ``gradient_predivide_factor``, ``horovod/torch/optimizer.py``): each bucket is multiplied by
``1 / predivide`` before the sum and by ``predivide / ranks`` after it, in Horovod's precision
(:mod:`distopt.comm.scaled`).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

from ..comm.scaled import scale_in_place
from ..core.buckets import VIEW_THRESHOLD
from .base import BucketContext, Done, GradientStrategy, Handle
from .registry import Example, register

__all__ = ["Dense"]


class Dense(GradientStrategy):
    """Sum each bucket across ranks, divide by the contributing ranks (the default strategy).

    What travels: every float gradient element once, in its own dtype (4 bytes per float32 element). Supports overlap
    and ``join``.

    Args:
        predivide: Horovod's ``gradient_predivide_factor`` (finite, > 0): gradients are scaled by ``1 / predivide``
            before the sum and by ``predivide / ranks`` after it (the same mean, other rounding: a large factor keeps
            float16 sums from overflowing); None (the default) sums and divides once. A lone gradient reduced in
            place is copied first, so a skipped step leaves it as it was.

    Raises:
        ValueError: ``predivide`` not finite and > 0.
    """

    name: ClassVar[str] = "plain"
    supports_overlap: ClassVar[bool] = True
    supports_join: ClassVar[bool] = True
    default_threshold: ClassVar[int] = VIEW_THRESHOLD
    supports_sharding: ClassVar[bool] = True

    def __init__(self, predivide: float | None = None) -> None:
        if predivide is not None and not (math.isfinite(predivide) and predivide > 0):
            raise ValueError(f"predivide must be finite and > 0 (or None), got {predivide!r}")
        self.predivide = None if predivide is None else float(predivide)

    def settings(self) -> dict[str, Any]:
        return {} if self.predivide is None else {"predivide": self.predivide}

    def start(self, ctx: BucketContext, flat: Any) -> Handle:
        if self.predivide is None:
            return ctx.launch(flat, "sum")
        work = flat.copy() if ctx.viewed else flat  # the gradient itself is only written by finish
        return ctx.launch(scale_in_place(work, 1.0 / self.predivide), "sum")

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:
        reduced = started.wait()  # flat (or its copy) all-reduced in place, or this rank's segment
        wire = ctx.bucket.size * ctx.bucket.dtype.itemsize
        if self.predivide is None:
            return Done(wire, divisor, None if reduced is flat else reduced)
        scale_in_place(reduced, self.predivide / divisor)
        if ctx.out is not None and reduced is not ctx.out:
            ctx.out[...] = reduced
        return Done(wire, 1, None if ctx.out is not None else reduced)


register(Example("dense", Dense), Example("dense-predivide", Dense, {"predivide": 3.0}, mismatch={"predivide": 2.0}))
