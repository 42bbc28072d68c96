"""Mixed precision at ``zero=1|2`` (``DistOpt(opt, zero=1|2, model=m, param_dtype=, reduce_dtype=)``).

Stage 1's and 2's step (:class:`~distopt.torch.zero.step.ShardedTorchStep`) with the policy of
:mod:`distopt.torch.zero.precision`, what :mod:`distopt.torch.mixed` shares with ``zero=0`` kept:

* the masters are this rank's pieces only: the shard tensors are float32 copies of its pieces taken at
  construction (not views into the parameters, which hold ``param_dtype`` copies from then on), so the optimizer's
  state and update stay sharded as without mixed precision; parameters outside the layout (frozen) keep a whole
  master;
* the buckets are laid out in ``reduce_dtype``; stage 2 reduce-scatters them and casts each segment to the masters'
  dtype; stage 1 all-reduces them into ``reduce_dtype`` copies of the gradients, and each shard gradient is its
  piece, cast. At both stages ``.grad`` of a parameter is then stage 2's placeholder, and ``opt.clip_grad_norm_``
  clips the shard gradients (the global norm, collective);
* after the update this rank's pieces are cast into the parameters' copies and the copies all-gathered in
  ``param_dtype`` (:class:`~distopt.sharding.gather.ParamGather` moves the parameters' dtype: half float32's bytes
  for bfloat16);
* ``model.state_dict()``, ``model.load_state_dict()`` and ``summon_full_params()`` all-gather the float32 masters
  (collective) and write back this rank's pieces; the optimizer's state dicts see float32 parameters (no gather).

The layout is the one of construction: a step whose layout differs raises.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ...core.bucket_run import BucketRun
from ...sharding.gather import ParamGather
from ...sharding.plan import ShardPlan
from ...sharding.sync import ShardedStep
from ..adapter import TorchOptimizer, as_array, as_tensor
from ..mixed import LowCopies, MixedSpans, cast_segments, hook_model, reduce_copies, stand_ins
from .step import ShardedTorchStep

__all__ = ["MixedShardedStep"]


def _changed() -> RuntimeError:
    return RuntimeError("mixed precision at zero=1|2 keeps this rank's float32 pieces of the layout of DistOpt's "
                        "construction (the optimizer's trainable parameters in the held strategy's buckets); this "
                        "step's differs (requires_grad changed, a parameter group added, or another strategy or "
                        "threshold): keep them fixed, or use zero=0")


class MixedShardedStep(MixedSpans, ShardedTorchStep):
    """Stage 1's or 2's sink with mixed precision (see the module docs).

    Args:
        comm: the communicator.
        local: the torch local optimizer.
        stage: 1 or 2.
        overlap_param_gather: as :class:`~distopt.torch.zero.step.ShardedTorchStep`.
        model: the ``torch.nn.Module`` given as ``model=``.
        precision: the :class:`~distopt.torch.zero.precision.MixedPrecision` policy.
    """

    def __init__(self, comm: Any, local: TorchOptimizer, stage: int, overlap_param_gather: bool, model: Any,
                 precision: Any) -> None:
        super().__init__(comm, local, stage, overlap_param_gather)
        self.whole_grad = False  # .grad cannot hold the float32 average: the shard gradients do
        self.model, self.precision = model, precision
        self.copies = LowCopies(local.params(), precision)
        self.whole: dict[int, Any] = {}  # id(parameter outside the layout) -> its whole master
        self.buckets: list[Any] = []
        self._context: Any = None
        self._sharded = False

    def bind(self, follower: Any) -> None:
        """Take this rank's pieces of the parameters (rank 0's by now) as the masters, give the parameters their
        copies, and hook the model."""
        super().bind(follower)
        tensors, self.buckets = follower.planned()
        self._context = follower.runner.engine.context
        self.bind_planned()  # the shard tensors: this rank's masters (shard_tensors)
        laid = {id(t) for t in tensors}
        self.whole = {id(t): t.detach().clone() for t in self.copies.tensors if id(t) not in laid}
        self.copies.cast()
        follower.runner.engine.known(self.arrays(tensors))
        self.local.held_param_bytes = lambda: (sum(int(s.nbytes) for s in self.shards if self.copies.tensors)
                                               + sum(int(w.nbytes) for w in self.whole.values()))
        hook_model(self.model, self.precision, self, self.local.handles)

    def shard_tensors(self, plan: ShardPlan, tensors: Sequence[Any], buckets: Sequence[Any]) -> list[Any]:
        """Float32 copies of this rank's pieces (the masters), once; without ``param_dtype`` copies, views as at
        stage 1 and 2.

        Raises:
            RuntimeError: a second layout (the masters are this rank's pieces of the first).
        """
        if self._sharded:
            raise _changed()
        self._sharded = True
        if not self.copies.tensors:
            return super().shard_tensors(plan, tensors, buckets)
        return [tensors[p.index].detach().reshape(-1)[p.start:p.stop].clone() for p in plan.pieces]

    def arrays(self, tensors: Sequence[Any]) -> list[Any]:
        """Stand-ins of the parameters' shapes in their reduction dtype.

        Raises:
            RuntimeError: ``tensors`` are not the layout of construction.
        """
        if self._sharded and [id(t) for t in tensors] != [id(t) for t in self.tensors]:
            raise _changed()
        return stand_ins(self.precision, tensors)

    def reduced_into(self, grads: list[Any]) -> list[Any]:
        """Stage 1: copies of the gradients in ``reduce_dtype`` (the all-reduce averages into them); stage 2: the
        gradients (the reduce-scatter's segments hold the average)."""
        if self.stage != 1 or not self.tensors:
            return grads
        return reduce_copies(self.precision, self.tensors[0], grads)

    def adopt(self, pipeline: Any, tensors: Sequence[Any], grads: Sequence[Any], outcome: Any, skipped: bool,
              shadow: bool, views: Sequence[Any] | None) -> None:
        """Stage 2: each reduced segment cast to the masters' dtype; then the sharded adoption (placeholders, shard
        gradients)."""
        if isinstance(pipeline.sync, ShardedStep) and self.copies.master_dtype is not None:
            import torch

            cast_segments(pipeline.sync, as_array(torch.empty(0, dtype=self.copies.master_dtype)).dtype)
        super().adopt(pipeline, tensors, grads, outcome, skipped, shadow, views)

    def piece_grad(self, tensor: Any, grad: Any, piece: Any) -> Any:
        """Stage 1: a piece of the averaged ``reduce_dtype`` copy, cast to the masters' dtype."""
        return as_tensor(grad).reshape(-1)[piece.start:piece.stop].to(self.copies.master_dtype or tensor.dtype)

    def after_step(self, applied: bool) -> None:
        """Cast this rank's updated pieces into the parameters' copies, then stage 1's and 2's all-gather (of the
        copies, in ``param_dtype``)."""
        if applied and self.plan is not None and self.copies.tensors:
            import torch

            self.wait()
            with torch.no_grad():
                for p, s in zip(self.plan.pieces, self.shards):
                    self.tensors[p.index].detach().view(-1)[p.start:p.stop].copy_(s)
        super().after_step(applied)

    @contextmanager
    def unswapped(self) -> Iterator[None]:
        """Stage 1's and 2's, the parameters in the masters' dtype inside (torch's ``Optimizer.load_state_dict``
        casts the state to the parameters' dtype); no gather: their values inside are not the masters'."""
        with super().unswapped():
            self.enter(False)
            try:
                yield
            finally:
                self.leave(False)

    def fulls(self, values: bool) -> list[Any]:
        """The whole masters: every rank's pieces all-gathered (collective) with ``values``, else placeholders of
        their shapes (one element each, expanded)."""
        import torch

        dtype = self.copies.master_dtype
        if not values:
            return [self.whole.get(id(t), torch.zeros((), dtype=dtype, device=t.device).expand(t.shape))
                    for t in self.copies.tensors]
        self.wait()
        made = {id(t): self.whole.get(id(t), torch.empty(t.shape, dtype=dtype, device=t.device))
                for t in self.copies.tensors}
        if self.plan is not None:
            arrays = [as_array(made[id(t)]) for t in self.tensors]
            for p, s in zip(self.plan.pieces, self.shards):
                arrays[p.index].reshape(-1)[p.start:p.stop] = as_array(s)
            runs = [BucketRun(b, bucket, 0) for b, bucket in enumerate(self.buckets)]
            gather = ParamGather(self.comm, runs, self.plan, arrays, [None] * len(runs), self._context, False,
                                 keep=False)
            gather.start()
        return [made[id(t)] for t in self.copies.tensors]

    def written(self, fulls: Sequence[Any]) -> None:
        """Take this rank's pieces of the masters a span wrote."""
        import torch

        made = {id(t): f for t, f in zip(self.copies.tensors, fulls)}
        with torch.no_grad():
            for p, s in zip(self.plan.pieces if self.plan is not None else (), self.shards):
                s.copy_(made[id(self.tensors[p.index])].reshape(-1)[p.start:p.stop])

    def write_values(self, number: int, start: int, stop: int, values: Any) -> None:
        """Write elements ``start:stop`` of parameter ``number``: into its copy (cast), its whole master, and the
        pieces of this rank's masters they overlap."""
        if not self.copies.tensors:
            return super().write_values(number, start, stop, values)
        tensor = self.local.params()[number]
        index = next((i for i, t in enumerate(self.copies.tensors) if t is tensor), None)
        if index is None:
            return super().write_values(number, start, stop, values)
        self.copies.low[index].view(-1)[start:stop].copy_(values)
        if id(tensor) in self.whole:
            self.whole[id(tensor)].view(-1)[start:stop].copy_(values)
        for p, s in zip(self.plan.pieces if self.plan is not None else (), self.shards):
            a, b = max(p.start, start), min(p.stop, stop)
            if self.tensors[p.index] is tensor and a < b:
                s.detach()[a - p.start:b - p.start].copy_(values[a - start:b - start])
        return None

