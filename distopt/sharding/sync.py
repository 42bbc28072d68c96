"""The bucket sync: what a step does with each reduced bucket, replicated (``zero=0``) or sharded (1, 2).

The step engine holds one :class:`BucketSync` for its life, chosen by :func:`bucket_sync`; each step's pipeline holds
the :class:`StepSync` it begins. They are policies: the pipeline and the engine read no flag of a stage, they ask its
sync (which collective, where its result lands, whether the reduction may settle the step, what the finiteness vote
covers). Everything that differs between the stages (``zero=0``, 1, 2) is here:

* a bucket's collective: an all-reduce in place (0, 1); a reduce-scatter to this rank's segment (2);
* the reduced bucket: unpacked into the gradients (0, 1); kept as the segment, the bucket's buffer dropped (2);
* the finiteness vote: only with ``check_finite`` (0, 1); always, carrying the gradient flags (2: each rank sees its
  segments);
* the update: every parameter (0); this rank's pieces, then the parameters' all-gather (1, 2).

Stage 1 keeps the whole averaged gradient on every rank, so whatever reads or edits the gradients between backward
and the update (``clip_grad_norm_``, ``GradScaler``) sees what ``zero=0`` sees; the costs are in ``docs/sharding.md``.
The torch side of a sharded step (shard tensors, ``.grad``, checkpoints) is :mod:`distopt.torch.zero.step` and
:mod:`distopt.torch.zero.state`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..comm.base import Communicator, ShardingCommunicator
from ..comm.lifecycle import Completed
from ..core._array import all_zero, any_not_finite
from ..core.bucket_run import BucketRun
from ..core.buckets import Bucket, is_float, unpack
from ..core.counters import Counters
from ..core.spares import Spares
from ..strategies.base import Strategy
from .gather import ParamGather
from .plan import ShardPlan, check_strategy, piece_views, plan_shards, shard_grad_views

__all__ = ["BucketSync", "ShardedSync", "StepSync", "PieceUpdate", "ShardedStep", "bucket_sync"]

#: Stage 2 and 3: the packing buffers of dropped buckets kept for the next bucket or step (each as large as a bucket).
SPARE_BUFFERS = 2

#: ``agree(bad)``: the all-reduce (max) of one rank's flag; True when some rank's flag is set.
Vote = Callable[[bool], bool]


def _own(segment: Any) -> Any:
    """``segment`` in memory of its own: itself when it owns its memory, or when it is a NumPy view of the
    whole of a torch tensor's storage (the torch backend's segments, each a new tensor); otherwise a copy
    (it views a larger or shared buffer that is to be freed or reused)."""
    base = getattr(segment, "base", None)
    if base is None:
        return segment
    storage = getattr(base, "untyped_storage", None)
    if storage is not None and storage().nbytes() == segment.nbytes and base.data_ptr() == segment.ctypes.data:
        return segment
    return segment.copy()


class StepSync:
    """One replicated step: every bucket all-reduced and unpacked into the gradients.

    Args:
        launch: starts an all-reduce, ``launch(array, op)`` (the pipeline's launcher).
    """

    def __init__(self, launch: Any) -> None:
        self.launch = launch

    def bind(self, runs: Sequence[BucketRun]) -> None:  # noqa: ARG002 (a replicated step keeps nothing)
        """The step's buckets (:class:`~distopt.core.bucket_run.BucketRun`), once the pipeline made them."""

    def launcher(self, b: int) -> Callable[[Any, str], Any]:  # noqa: ARG002 (one launcher for every bucket)
        """Bucket ``b``'s collective: an all-reduce whose handle's ``wait()`` reduces in place."""
        return self.launch

    def out(self, run: BucketRun) -> Any:
        """Where a bucket's collective leaves its result (``BucketContext.out``): in place, its flat buffer."""
        return run.flat

    def new_buffer(self, size: int, dtype: Any, new: Callable[[int], Any]) -> Any:
        """A packing buffer of at least ``size`` ELEMENTS of ``dtype`` for a bucket (the layout keeps it): ``new(size)``."""
        return new(size)

    def release(self, buffer: Any) -> None:  # noqa: ARG002 (the layout keeps its buffers)
        """A dropped bucket's packing buffer (from :meth:`new_buffer`), no longer read or written by anyone."""

    def settle_pending(self, agreement: Any, params: Sequence[Any], own: Sequence[Any],
                       reduced: Callable[[int], Any], active: bool) -> Any:
        """The outcome of a step the header left pending, once its buckets are finished (the reduced values
        are bitwise equal on every rank): every float gradient present when none reduced to all zeros, else
        the gradient flags' all-reduce from this rank's own gradients.

        Args:
            agreement: the step's :class:`~distopt.step.outcome.Agreement`.
            params: the step's parameters.
            own: this rank's own gradients (None where it had none).
            reduced: ``reduced(i)``: parameter ``i``'s reduced gradient.
            active: this rank steps (not a joined rank's shadow).
        """
        for i, p in enumerate(params):
            if is_float(p) and all_zero(reduced(i)):
                return agreement.on_gradients(params, own, active)
        return agreement.all_present(params)

    def poll(self, run: BucketRun) -> Any:  # noqa: ARG002 (nothing to release)
        """A bucket's handle to keep in place of its started one once its buffer may be dropped; None: keep it."""
        return None

    def land(self, run: BucketRun, done: Any, grads: list[Any]) -> bool:
        """Put a bucket's result in ``grads`` (a viewed bucket: in its flat buffer, the gradients' memory),
        divided as ``done.divisor`` says; returns whether the pipeline may drop the bucket's buffer."""
        flat = run.flat
        if run.viewed:
            if done.result is not None:
                flat[...] = done.result
            if done.divisor != 1:
                flat /= done.divisor
        else:
            unpack(run.bucket, flat if done.result is None else done.result, grads, done.divisor)
        return False

    def vote(self, grads: Sequence[Any], present: Sequence[bool], check_finite: bool, agree: Vote) -> bool:
        """With ``check_finite``, whether the ranks agree that some REDUCED gradient is not finite (an overflowing
        half-precision sum of finite inputs): the step is then skipped (collective)."""
        if not check_finite:
            return False
        return self.settle(agree(self.bad_here(grads, present)), check_finite)

    def bad_here(self, grads: Sequence[Any], present: Sequence[bool]) -> bool:
        """This rank's vote: whether some reduced gradient it holds is not finite."""
        return any_not_finite(g for g, ok in zip(grads, present) if ok and g is not None and is_float(g))

    def settle(self, bad_anywhere: bool, check_finite: bool) -> bool:
        """The vote's result: True skips the step."""
        return bad_anywhere and check_finite

    def apply(self, local: Any, params: list[Any], grads: list[Any], present: list[bool]) -> None:
        """The local update of an array model: every parameter with a gradient on some rank."""
        local.apply(params, grads, present)

    @property
    def held_bytes(self) -> int:
        """BYTES of reduced gradient this step holds outside the layout's buffers."""
        return 0


class PieceUpdate(StepSync):
    """One stage-1 step: every bucket all-reduced into the gradients; this rank updates its pieces of
    the parameters with their pieces of the average, then the parameters are all-gathered.

    Args:
        launch: the pipeline's launcher.
        plan: the layout's :class:`~distopt.sharding.plan.ShardPlan`.
        buckets: the layout's float buckets.
        buffers: the layout's packing buffers (the gather packs into them).
        comm: the communicator (the parameters' all-gather).
        context: wraps collective errors with the step and the bucket.
        counters: the step counters (``gather_bytes``).
        pieces: ``pieces(params)``: the 1-D views of this rank's pieces, the same objects at every step of a layout
            (an array optimizer keys its state by them).
    """

    #: The buffers of a step are the layout's, kept from step to step (the gather may add to them).
    keeps_buffers = True
    runs: Sequence[BucketRun] = ()
    #: the engine's kept buffers (:class:`~distopt.core.spares.Spares`; stage 2 and 3), set by
    #: :meth:`ShardedSync.begin`
    spares: Spares | None = None

    def bind(self, runs: Sequence[BucketRun]) -> None:
        """The step's buckets (each landed one holds its segment; the parameters' gather runs over them)."""
        self.runs = runs

    def __init__(self, launch: Any, plan: ShardPlan, buckets: Sequence[Bucket], buffers: list[Any], comm: Communicator,
                 context: Callable[[str], Any], counters: Counters, pieces: Callable[[list[Any]], list[Any]]) -> None:
        super().__init__(launch)
        self.plan, self.buckets, self.buffers, self.pieces = plan, buckets, buffers, pieces
        self.comm, self.context, self.counters = comm, context, counters

    def piece_grads(self, grads: Sequence[Any]) -> list[Any]:
        """This rank's pieces of the averaged gradients (1-D views; None where a gradient is None)."""
        return piece_views(self.plan, grads)

    def apply(self, local: Any, params: list[Any], grads: list[Any], present: list[bool]) -> None:
        """Update this rank's pieces with their averaged gradients, then all-gather the parameters."""
        local.apply(self.pieces(params), self.piece_grads(grads), [present[p.index] for p in self.plan.pieces])
        self.gather(params, asynchronous=False)

    def gather(self, params: Sequence[Any], asynchronous: bool, flats: Sequence[Any] | None = None) -> ParamGather:
        """Start (or, not ``asynchronous``, complete) the all-gather of the parameters (collective); ``flats``: as
        :class:`~distopt.sharding.gather.ParamGather`'s."""
        gather = ParamGather(self.comm, self.runs, self.plan, params, self.buffers, self.context, asynchronous,
                             keep=self.keeps_buffers, spares=self.spares, flats=flats)
        gather.start()
        self.counters.gather_bytes += gather.gathered_bytes
        return gather


class ShardedStep(PieceUpdate):
    """One stage-2 step: every bucket reduce-scattered; this rank keeps and updates its segments, and drops each
    bucket's buffer once its reduce-scatter has completed. Args: as :class:`PieceUpdate`."""

    keeps_buffers = False  # a bucket's buffer lives for one reduction; the gather packs into one scratch

    def new_buffer(self, size: int, dtype: Any, new: Callable[[int], Any]) -> Any:
        """A kept buffer that fits (see :class:`~distopt.core.spares.Spares`), else ``new(size)``."""
        return new(size) if self.spares is None else self.spares.take(size, dtype, new)

    def release(self, buffer: Any) -> None:
        """Keep a dropped bucket's buffer for the next bucket or step."""
        if self.spares is not None:
            self.spares.give(buffer)

    @property
    def segments(self) -> list[Any]:
        """Per bucket, this rank's averaged segment (1-D, ``plan.counts[b][rank]`` ELEMENTS: the bucket's
        :attr:`~distopt.core.bucket_run.BucketRun.segment`), None until the bucket landed."""
        return [run.segment for run in self.runs]

    def _landed(self) -> list[Any]:
        return [run.segment for run in self.runs if run.segment is not None]

    def out(self, run: BucketRun) -> Any:  # noqa: ARG002
        """None: a reduce-scatter's result is a new array, the segment."""
        return None

    def settle_pending(self, agreement: Any, params: Sequence[Any], own: Sequence[Any],
                       reduced: Callable[[int], Any], active: bool) -> Any:  # noqa: ARG002
        """Each rank sees only its own segments: the outcome and the vote on them settle in one all-reduce
        (:meth:`~distopt.step.outcome.Agreement.on_reduced`)."""
        outcome, bad = agreement.on_reduced(params, own, active, self.bad_here([], [g is not None for g in own]))
        if self.settle(bad, agreement.check_finite) and not outcome.skipped:
            agreement.skip(outcome)
        return outcome

    def launcher(self, b: int) -> Callable[[Any, str], Any]:
        """Bucket ``b``'s collective: a reduce-scatter whose handle's ``wait()`` returns this rank's segment."""
        return self.launch.scatter(self.plan.counts[b])

    def poll(self, run: BucketRun) -> Any:
        """A completed reduce-scatter's segment, owned (the bucket's buffer may then be dropped)."""
        if run.handle.test():
            return Completed(_own(run.handle.wait()))
        return None

    def land(self, run: BucketRun, done: Any, grads: list[Any]) -> bool:  # noqa: ARG002
        """Keep the bucket's averaged segment; returns True (drop the buffer) while it still has one."""
        segment = done.result
        if done.divisor != 1:
            segment /= done.divisor
        if run.flat is not None:
            segment = _own(segment)
        run.segment = segment
        return run.flat is not None

    def vote(self, grads: Sequence[Any], present: Sequence[bool], check_finite: bool, agree: Vote) -> bool:
        """Whether every rank's segments are finite (collective, always); see :meth:`settle`."""
        return self.settle(agree(self.bad_here(grads, present)), check_finite)

    def bad_here(self, grads: Sequence[Any], present: Sequence[bool]) -> bool:  # noqa: ARG002
        """This rank's vote: whether some element of its segments is not finite."""
        return any_not_finite(self._landed())

    def settle(self, bad_anywhere: bool, check_finite: bool) -> bool:
        """The vote's result: True skips the step (``check_finite``); without ``check_finite`` a bad vote sets every
        rank's segments to NaN, as a dense average would be NaN on every rank (so ``GradScaler`` sees it everywhere)."""
        if bad_anywhere and not check_finite:
            for seg in self._landed():
                seg[...] = np.nan
        return bad_anywhere and check_finite

    def piece_grads(self, grads: Sequence[Any]) -> list[Any]:  # noqa: ARG002
        """This rank's pieces of the averaged gradients: views into its segments."""
        return shard_grad_views(self.plan, self.segments)

    @property
    def held_bytes(self) -> int:
        """BYTES of the segments (each in memory of its own, see :func:`_own`) and of the kept buffers."""
        return sum(int(s.nbytes) for s in self._landed()) + (0 if self.spares is None else self.spares.held_bytes)


class BucketSync:
    """The replicated stage (``zero=0``): the engine's policy for its layouts and steps."""

    stage = 0

    def reduction_settles(self, check_finite: bool, strategy: Strategy, params: Sequence[Any]) -> bool:
        """Whether the step header may leave which gradients exist to the reduced values (a pending step,
        :meth:`StepSync.settle_pending`): replicated, when the reduced values are bitwise equal on every rank (the
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
