"""Plain averaging: every bucket is summed by an all-reduce in its own dtype.

SINGA's ``backward_and_update`` with the tensor fusion of Horovod and
ChainerMN's ``pure_nccl`` communicator: one all-reduce per bucket, then one
division by the number of contributing ranks, folded into the unpack.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ..core.buckets import VIEW_THRESHOLD
from .base import BucketContext, Done, GradientStrategy, Handle
from .registry import Example, register

__all__ = ["Dense"]


class Dense(GradientStrategy):
    """Sum each bucket across ranks, divide by the contributing ranks (the default strategy).

    What travels: every float gradient element once, in its own dtype
    (4 bytes per float32 element). Supports overlap and ``join``.
    """

    name: ClassVar[str] = "plain"
    supports_overlap: ClassVar[bool] = True
    supports_join: ClassVar[bool] = True
    default_threshold: ClassVar[int] = VIEW_THRESHOLD
    supports_sharding: ClassVar[bool] = True

    def start(self, ctx: BucketContext, flat: Any) -> Handle:
        return ctx.launch(flat, "sum")

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:
        started.wait()
        if ctx.viewed:  # the gradient itself: divide in place
            if divisor != 1:
                flat /= divisor
            return Done(int(flat.nbytes))
        return Done(int(flat.nbytes), divisor)  # a packed copy: divide while unpacking

    def start_shard(self, ctx: BucketContext, flat: Any) -> Handle:
        assert ctx.scatter is not None
        return ctx.scatter(flat, "sum")

    def finish_shard(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> tuple[Any, Done]:
        shard = started.wait()
        if divisor != 1:
            shard /= divisor
        return shard, Done(ctx.bucket.size * ctx.bucket.dtype.itemsize)


register(Example("dense", Dense))
