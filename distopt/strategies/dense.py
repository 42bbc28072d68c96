"""Plain averaging: every bucket is summed by an all-reduce in its own dtype.

SINGA's ``backward_and_update`` with the tensor fusion of Horovod and ChainerMN's ``pure_nccl`` communicator: one
all-reduce per bucket, then one division by the number of contributing ranks, folded into the unpack.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ..core.buckets import VIEW_THRESHOLD
from .base import BucketContext, Done, GradientStrategy, Handle
from .registry import Example, register

__all__ = ["Dense"]


class Dense(GradientStrategy):
    """Sum each bucket across ranks, divide by the contributing ranks (the default strategy).

    What travels: every float gradient element once, in its own dtype (4 bytes per float32 element). Supports overlap
    and ``join``.
    """

    name: ClassVar[str] = "plain"
    supports_overlap: ClassVar[bool] = True
    supports_join: ClassVar[bool] = True
    default_threshold: ClassVar[int] = VIEW_THRESHOLD
    supports_sharding: ClassVar[bool] = True

    def start(self, ctx: BucketContext, flat: Any) -> Handle:
        return ctx.launch(flat, "sum")

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:
        reduced = started.wait()  # flat itself (all-reduced in place), or this rank's segment
        return Done(ctx.bucket.size * ctx.bucket.dtype.itemsize, divisor, None if reduced is flat else reduced)


register(Example("dense", Dense))
