"""Stage 3's gradient sink over a ``torch.optim.Optimizer`` (``DistOpt(opt, zero=3, model=m)``).

Stage 2's step (:class:`~distopt.torch.zero.step.ShardedTorchStep`), but the shard tensors are views into the segments
that :class:`~distopt.torch.zero.params.ParamShards` keeps, and nothing is all-gathered after the step: the next
forward gathers what it uses. The layout is fixed at construction; a step whose layout differs (``requires_grad``
changed, a parameter group added, another strategy's threshold) raises.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ...sharding.plan import ShardPlan, plan_shards
from ...sharding.sync import ShardedStep
from ...step.outcome import Outcome
from ...step.pipeline import BucketPipeline
from ..adapter import TorchOptimizer, as_array
from ..mixed import cast_segments
from .hooks import ModuleHooks
from .materialize import MetaBuild
from .params import ParamShards
from .precision import MixedPrecision
from .step import ShardedTorchStep

__all__ = ["FullyShardedTorchStep"]


def _changed() -> RuntimeError:
    return RuntimeError("zero=3 shards the parameters in the layout of DistOpt's construction (the optimizer's "
                        "trainable parameters in the held strategy's buckets); this step's differs (requires_grad "
                        "changed, a parameter group added, or another strategy or threshold): keep them fixed, or "
                        "use zero=2")


class FullyShardedTorchStep(ShardedTorchStep):
    """Stage 3's sink: stage 2's reduction and shard update over :class:`ParamShards`' segments.

    Args:
        comm: the communicator.
        local: the torch local optimizer.
        model: the ``torch.nn.Module`` whose forward and backward gather the parameters.
        counters: the step counters.
        reshard_after_forward: free each bucket after the forward that used it (see
            :class:`~distopt.torch.zero.hooks.ModuleHooks`).
        init: for a model built on the meta device, ``init(module)`` instead of ``module.reset_parameters()``
            (:mod:`~distopt.torch.zero.materialize`).
        precision: the mixed-precision policy (:mod:`~distopt.torch.zero.precision`), or None.
    """

    def __init__(self, comm: Any, local: TorchOptimizer, model: Any, counters: Any,
                 reshard_after_forward: bool = True, init: Callable[[Any], Any] | None = None,
                 precision: MixedPrecision | None = None) -> None:
        super().__init__(comm, local, 3, overlap_param_gather=False)
        self.model, self.reshard, self.precision = model, reshard_after_forward, precision
        self.store = ParamShards(comm, counters, precision)
        self.meta = MetaBuild.find(model, local, init)  # before any hook holds the parameters
        self.hooks: ModuleHooks | None = None
        self._checked: int | None = None

    def bind(self, follower: Any) -> None:
        """Shard the parameters in the layout the follower's steps will use (materializing a meta-built model module
        by module), and hook the model."""
        super().bind(follower)
        tensors, buckets = follower.planned()
        engine = follower.runner.engine
        plan = plan_shards(buckets, self.comm.rank, self.comm.size)
        meta, self.meta = self.meta, None
        segments = None if meta is None else meta.materialize(tensors, buckets, plan, self.comm)
        self.store.shard(tensors, buckets, plan, engine.context, engine.launch, segments)
        engine.known(self.arrays(tensors))
        engine.frame_names = self.store.module_names  # the step header meets the gathers' checks
        self.hooks = ModuleHooks(self.store, self.reshard)
        self.local.handles.extend(self.hooks.hook(self.model))
        if self.precision is not None and self.precision.param_dtype is not None:
            self.local.handles.append(self.model.register_forward_pre_hook(self.precision.cast_inputs,
                                                                           with_kwargs=True))
        self.local.held_param_bytes = self.store.held_bytes

    def arrays(self, tensors: Sequence[Any]) -> list[Any]:
        """Stand-ins of the parameters' full shapes and dtypes (the parameters are freed at rest).

        Raises:
            RuntimeError: ``tensors`` are not the parameters sharded at construction.
        """
        if self.store.plan is not None and [id(t) for t in tensors] != [id(t) for t in self.store.tensors]:
            raise _changed()
        return [self.store.stand_in(t) for t in tensors]

    def shape(self, tensor: Any) -> tuple[int, ...]:
        """A parameter's full shape, also while it is freed."""
        return self.store.shapes.get(id(tensor), tuple(tensor.shape))

    def write_values(self, number: int, start: int, stop: int, values: Any) -> None:
        """Write the elements of ``start:stop`` of parameter ``number`` that fall in this rank's segments
        (the parameters are freed at rest; a bucket gathered now is freed first); a parameter outside the
        layout is whole."""
        tensor = self.local.params()[number]
        if not any(t is tensor for t in self.tensors):  # outside the layout: whole on every rank
            return super().write_values(number, start, stop, values)
        self.store.free_all()
        for p, s in zip(self.plan.pieces if self.plan is not None else (), self.shards):
            a, b = max(p.start, start), min(p.stop, stop)
            if self.tensors[p.index] is tensor and a < b:
                s.detach()[a - p.start:b - p.start].copy_(values[a - start:b - start])

    def shard_tensors(self, plan: ShardPlan, tensors: Sequence[Any], buckets: Sequence[Any]) -> list[Any]:
        """One shard tensor per piece of ``plan``: a 1-D view into this rank's segment of its bucket."""
        return [self.store.segments[p.bucket][p.offset:p.offset + p.size] for p in plan.pieces]

    def adopt(self, pipeline: BucketPipeline, tensors: Sequence[Any], grads: Sequence[Any],
              outcome: Outcome, skipped: bool, shadow: bool, views: Sequence[Any] | None) -> None:
        """Free what backward left gathered, then stage 2's adoption (placeholders, shard gradients).

        Raises:
            RuntimeError: the step's layout is not the one the parameters were sharded in.
        """
        plan = pipeline.sync.plan
        if self._checked != id(plan):
            if plan != self.store.plan:
                raise _changed()
            self._checked = id(plan)
        self.store.free_all()
        if self.precision is not None and isinstance(pipeline.sync, ShardedStep) and self.store.segments:
            cast_segments(pipeline.sync, as_array(self.store.segments[0][:0]).dtype)  # one dtype: the masters
        super().adopt(pipeline, tensors, grads, outcome, skipped, shadow, views)

    def after_step(self, applied: bool) -> None:  # noqa: ARG002 (the next forward gathers the new values)
        """After the inner ``step()``: swap back and drop the shard gradients; nothing is gathered."""
        super().after_step(False)  # stage 2's, less its parameter gather: the next forward gathers the new values
        self.store.step_done()

    def end_of_backward(self) -> None:
        """Free the buckets a backward left gathered; drop the placeholders it did not replace."""
        super().end_of_backward()
        if self.hooks is not None:
            self.hooks.end_of_backward()

    @contextmanager
    def unswapped(self) -> Iterator[None]:
        """Stage 2's :meth:`~distopt.torch.zero.step.ShardedTorchStep.unswapped`; with mixed precision the parameters
        also have the segments' dtype inside (torch's ``Optimizer.load_state_dict`` casts the state to it)."""
        with super().unswapped():
            self.store.use_masters(True)
            try:
                yield
            finally:
                self.store.use_masters(False)

    @contextmanager
    def full_parameters(self, writeback: bool, modifier_rank: int | None, comm: Any,  # noqa: ARG002
                        params: Sequence[Any]) -> Iterator[None]:
        """Every parameter whole inside the block (:meth:`ModuleHooks.full`)."""
        assert self.hooks is not None
        with self.hooks.full(writeback, modifier_rank):
            yield
