"""The step sync: what one step does with each reduced bucket, replicated (``zero=0``) or sharded (1, 2).

Each step's pipeline holds the :class:`StepSync` that the engine's policy (:mod:`distopt.sharding.policy`) begins.
They are policies: the pipeline reads no flag of a stage, it asks its sync (which collective, where its result lands,
whether the reduction may settle the step, what the finiteness vote covers). What differs between the stages
(``zero=0``, 1, 2) in a step is here:

* a bucket's collective: an all-reduce in place (0, 1); a reduce-scatter to this rank's segment (2);
* the reduced bucket: unpacked into the gradients (0, 1); kept as the segment, the bucket's buffer dropped (2);
* the finiteness vote: only with ``check_finite`` (0); always (1, 2: each rank's update reads only its pieces, so
  ``GradScaler`` must see an overflow in any rank's pieces on every rank);
* the update: every parameter (0); this rank's pieces, then the parameters' all-gather (1, 2).

Stage 1 keeps the whole averaged gradient on every rank, so whatever reads or edits the gradients between backward
and the update (``clip_grad_norm_``, ``GradScaler``) sees what ``zero=0`` sees; the costs are in ``docs/sharding.md``.
The torch side of a sharded step (shard tensors, ``.grad``, checkpoints) is :mod:`distopt.torch.zero.step` and
:mod:`distopt.torch.zero.state`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..comm.base import Communicator
from ..comm.lifecycle import Completed
from ..core._array import all_zero, any_not_finite
from ..core.bucket_run import BucketRun
from ..core.buckets import Bucket, is_float, unpack
from ..core.counters import Counters
from ..core.spares import Spares
from .gather import ParamGather
from .plan import ShardPlan, piece_views, shard_grad_views

__all__ = ["StepSync", "PieceUpdate", "ShardedStep"]

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

    #: A bucket's result lands in the gradients (:meth:`land`): the caller keeps each gradient until the step's end.
    #: False (a sharded step): a gradient is never read again once packed in its bucket, and the caller may drop it
    #: then (the pipeline remembers that it had one, :meth:`~distopt.step.pipeline.BucketPipeline.own`).
    lands_in_gradients = True

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
                       reduced: Callable[[int], Any], active: bool, had: Sequence[bool] | None = None) -> Any:
        """The outcome of a step the header left pending, once its buckets are finished (the reduced values
        are bitwise equal on every rank): every float gradient present when none reduced to all zeros, else
        the gradient flags' all-reduce from this rank's own gradients.

        Args:
            agreement: the step's :class:`~distopt.step.outcome.Agreement`.
            params: the step's parameters.
            own: this rank's own gradients (None where it had none, or dropped one once packed).
            reduced: ``reduced(i)``: parameter ``i``'s reduced gradient.
            active: this rank steps (not a joined rank's shadow).
            had: per parameter, whether this rank had a gradient (None: where ``own`` is not None).
        """
        for i, p in enumerate(params):
            if is_float(p) and all_zero(reduced(i)):
                return agreement.on_gradients(params, own, active, None, had)
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

    #: Set by :meth:`settle`: some rank's pieces of this step's average are not finite, and the step is not skipped.
    not_finite = False

    def piece_grads(self, grads: Sequence[Any]) -> list[Any]:
        """This rank's pieces of the averaged gradients (1-D views; None where a gradient is None)."""
        return piece_views(self.plan, grads)

    def vote(self, grads: Sequence[Any], present: Sequence[bool], check_finite: bool, agree: Vote) -> bool:
        """Whether some rank's pieces of the average are not finite (collective, every step): each rank's update
        reads only its pieces, so an overflow in one rank's pieces must reach every rank's ``GradScaler``."""
        return self.settle(agree(self.bad_here(grads, present)), check_finite)

    def bad_here(self, grads: Sequence[Any], present: Sequence[bool]) -> bool:
        """This rank's vote: whether some element of its pieces of the average is not finite."""
        return any_not_finite(g for g, p in zip(self.piece_grads(grads), self.plan.pieces)
                              if g is not None and present[p.index] and is_float(g))

    def settle(self, bad_anywhere: bool, check_finite: bool) -> bool:
        """The vote's result: True skips the step (``check_finite``); else a bad vote sets :attr:`not_finite`, and
        the torch sink gives every piece a NaN gradient (as stage 2's vote makes every segment NaN)."""
        self.not_finite = bad_anywhere and not check_finite
        return bad_anywhere and check_finite

    def settle_pending(self, agreement: Any, params: Sequence[Any], own: Sequence[Any],
                       reduced: Callable[[int], Any], active: bool, had: Sequence[bool] | None = None) -> Any:
        """Each rank's update reads only its pieces: the outcome and the vote on them settle in one all-reduce
        (:meth:`~distopt.step.outcome.Agreement.on_reduced`)."""
        outcome, bad = agreement.on_reduced(params, own, active, self.pending_vote(reduced, len(params)), had)
        if self.settle(bad, agreement.check_finite) and not outcome.skipped:
            agreement.skip(outcome)
        return outcome

    def pending_vote(self, reduced: Callable[[int], Any], count: int) -> bool:
        """:meth:`bad_here` of a pending step, ``reduced(i)`` being parameter ``i``'s reduced gradient."""
        return self.bad_here([reduced(i) for i in range(count)], [True] * count)

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
    lands_in_gradients = False  # the segments hold the result

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

    def drop_segments(self) -> None:
        """Let go of the segments and the finished reductions' handles once the update consumed them (or
        ``zero_grad`` dropped them), as FSDP frees its sharded gradients at ``zero_grad``: the next forward runs
        without them."""
        for run in self.runs:
            run.segment = run.handle = None

    def out(self, run: BucketRun) -> Any:  # noqa: ARG002
        """None: a reduce-scatter's result is a new array, the segment."""
        return None

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

    def bad_here(self, grads: Sequence[Any], present: Sequence[bool]) -> bool:  # noqa: ARG002
        """This rank's vote: whether some element of its segments is not finite."""
        return any_not_finite(self._landed())

    def pending_vote(self, reduced: Callable[[int], Any], count: int) -> bool:  # noqa: ARG002
        """:meth:`bad_here`: the segments hold the reduced values."""
        return self.bad_here([], [])

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
