"""The engine's policy for its stage: replicated (:class:`BucketSync`, ``zero=0``) or sharded (:class:`ShardedSync`,
``zero=1|2|3``, ZeRO).

The step engine holds one for its life, chosen by :func:`bucket_sync`: it plans a new layout's shards, says which
packing buffers a step may keep and whether the reduction may settle a step, and begins each step's
:class:`~distopt.sharding.sync.StepSync` (the per-step half).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..comm.base import Communicator, ShardingCommunicator
from ..core.buckets import Bucket
from ..core.counters import Counters
from ..core.spares import Spares
from ..strategies.base import Strategy
from .plan import ShardPlan, check_strategy, piece_views, plan_shards
from .sync import PieceUpdate, ShardedStep, StepSync

__all__ = ["BucketSync", "ShardedSync", "bucket_sync", "SPARE_BUFFERS"]

#: Stage 2 and 3: the packing buffers of dropped buckets kept for the next bucket or step (each as large as a bucket).
SPARE_BUFFERS = 2


class BucketSync:
    """The replicated stage (``zero=0``): the engine's policy for its layouts and steps."""

    stage = 0

    def reduction_settles(self, check_finite: bool, strategy: Strategy, params: Sequence[Any]) -> bool:
        """Whether the step header may leave which gradients exist to the reduced values (a pending step,
        :meth:`~distopt.sharding.sync.StepSync.settle_pending`): replicated, when the reduced values are bitwise equal on every rank (the
        strategy keeps replicas identical, NumPy arrays) and nothing must be checked first."""
        return not check_finite and strategy.identical_replicas and all(isinstance(p, np.ndarray) for p in params)

    def check(self, strategy: Strategy) -> None:
        """Refuse a strategy this stage cannot run (see :func:`~distopt.sharding.plan.check_strategy`)."""
        check_strategy(self.stage, strategy)

    def describe(self) -> dict[str, Any]:
        """The setting every rank must agree on (part of the step header's digest)."""
        return {"zero": self.stage}

    def plan(self, buckets: Sequence[Bucket], rank: int, size: int) -> ShardPlan | None:  # noqa: ARG002
        """The shard plan of a new layout (None: replicated)."""
        return None

    def buffers(self, layout_buffers: list[Any]) -> list[Any]:
        """The packing buffers a step may use (per bucket; None: none yet): the layout's, kept from step to step."""
        return layout_buffers

    def begin(self, launch: Any, plan: ShardPlan | None, buckets: Sequence[Bucket], buffers: list[Any],
              comm: Communicator, context: Callable[[str], Any], counters: Counters) -> StepSync:  # noqa: ARG002
        """The :class:`StepSync` of one step."""
        return StepSync(launch)


class ShardedSync(BucketSync):
    """A sharded stage (``zero=1|2|3``, ZeRO): update this rank's pieces, then all-gather.

    Args:
        stage: 1 (optimizer state: gradients all-reduced), 2 (and gradients: reduce-scattered, each bucket's buffer
            dropped once reduced) or 3 (reduced as 2; the model's hooks gather the parameters).
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.spares = Spares(SPARE_BUFFERS) if stage >= 2 else None
        self._pieces: tuple[Any, list[Any]] | None = None

    def reduction_settles(self, check_finite: bool, strategy: Strategy, params: Sequence[Any]) -> bool:
        """Stage 1 as the replicated stage; stage 2 and 3 always (their vote on the segments, taken at every
        step, carries the gradient flags)."""
        return self.stage >= 2 or super().reduction_settles(check_finite, strategy, params)

    def _views(self, plan: ShardPlan, params: list[Any]) -> list[Any]:
        key = (id(plan), tuple(id(p) for p in params))
        if self._pieces is None or self._pieces[0] != key:  # made once per layout and parameter list
            self._pieces = (key, piece_views(plan, params))
        return self._pieces[1]

    def plan(self, buckets: Sequence[Bucket], rank: int, size: int) -> ShardPlan:
        """Split every bucket over the ranks (:func:`~distopt.sharding.plan.plan_shards`)."""
        return plan_shards(buckets, rank, size)

    def buffers(self, layout_buffers: list[Any]) -> list[Any]:
        """Stage 2: a bucket's buffer lives only until its reduce-scatter completes (new ones per step)."""
        return [None] * len(layout_buffers) if self.stage >= 2 else layout_buffers

    def begin(self, launch: Any, plan: ShardPlan | None, buckets: Sequence[Bucket], buffers: list[Any],
              comm: Communicator, context: Callable[[str], Any], counters: Counters) -> PieceUpdate:
        assert plan is not None
        kind = ShardedStep if self.stage >= 2 else PieceUpdate
        step = kind(launch, plan, buckets, buffers, comm, context, counters, lambda params: self._views(plan, params))
        step.spares = self.spares
        return step


def bucket_sync(zero: int, comm: Communicator) -> BucketSync:
    """The bucket sync of stage ``zero`` (validated by :func:`~distopt.sharding.plan.check_stage`).

    Raises:
        ValueError: ``zero`` is 1 or 2 and ``comm`` lacks ``reduce_scatter``, ``all_gather_into`` or ``all_to_all``
            (:class:`~distopt.comm.base.ShardingCommunicator`).
    """
    if not zero:
        return BucketSync()
    if not isinstance(comm, ShardingCommunicator):
        raise ValueError(f"zero={zero} needs a communicator with reduce_scatter, all_gather_into and all_to_all "
                         f"(distopt.comm.base.ShardingCommunicator); {type(comm).__name__} lacks them")
    return ShardedSync(zero)
