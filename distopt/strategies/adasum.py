"""Adasum: every gradient tensor combined across ranks by adaptive summation instead of averaged.

Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021); Horovod's ``op=hvd.Adasum``.
Per bucket, one :func:`~distopt.comm.adasum.adasum_all_reduce` with the bucket's parameters as the tensors, so each
gradient gets its own coefficients (Horovod's fused buffers do the same): ``adasum(a, b) = (1 - a.b / (2|a|^2)) a +
(1 - a.b / (2|b|^2)) b`` over a binary tree of the ranks in rank order; orthogonal gradients add, parallel ones
average. A power-of-two world only (Horovod's rule).

Horovod's ``DistributedOptimizer(op=Adasum)`` combines the local optimizer's parameter *updates* (its "delta
optimizer": each rank steps with its own gradient, the deltas are combined); this strategy combines the gradients
before the (then identical) local update. The two agree for plain SGD (the update ``-lr * g`` is linear and Adasum is
scale-equivariant: ``adasum(c a, c b) = c adasum(a, b)``); with momentum or adaptive optimizers they differ.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ..comm.adasum import adasum_all_reduce, check_world
from .base import BucketContext, Done, GradientStrategy, Handle, LocalInfo
from .registry import Example, register

__all__ = ["Adasum"]


class Adasum(GradientStrategy):
    """Combine each gradient across ranks by Adasum (Horovod's ``op=hvd.Adasum``); see the module docs.

    What travels: about twice each float gradient in its own dtype (the vector halving, then the gather of the
    segments; reported as ``2 x`` the bucket's bytes), plus 24 bytes per parameter, block and level (the float64 dot
    products and norms). Runs after backward (no overlap), without ``join`` or ``zero``.

    Raises:
        ValueError: at a step, a world size that is not a power of two (before any communication).
    """

    name: ClassVar[str] = "adasum"

    def bind(self, world_size: int, local: LocalInfo) -> None:  # noqa: ARG002
        check_world(world_size, "the Adasum strategy")

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:  # noqa: ARG002
        adasum_all_reduce(ctx.comm, flat, [slot.size for slot in ctx.bucket.slots])  # slots lie back to back
        return Done(2 * ctx.bucket.size * ctx.bucket.dtype.itemsize, 1)


register(Example("adasum", Adasum, worlds=(1, 2, 4, 8)))
