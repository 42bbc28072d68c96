"""One step's bucket reductions, started in bucket order as gradients become ready.

:class:`BucketPipeline` receives gradients one by one (:meth:`ready`, from PyTorch's post-accumulate-grad hooks or
from a generator of ``(param, grad)`` pairs) and starts a bucket's reduction as soon as the bucket is complete AND
every earlier bucket has been started, so all ranks start the same reductions in the same order whatever order their
gradients arrive in (no deadlock). A step without overlap runs the same pipeline with every bucket started after
backward: identical collectives, bitwise identical results. Asynchrony per backend: MPI ``Iallreduce`` (progressed by
``test()`` from the hooks), NCCL enqueued on its stream, shared memory on one worker thread.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..core._array import xp_of
from ..core.buckets import Bucket, put
from ..comm.base import Communicator
from ..comm.launcher import Launcher
from ..comm.lifecycle import profile_range
from ..core.counters import Counters
from ..sharding.sync import StepSync
from ..strategies.base import BucketContext, Strategy
from ..core.bucket_run import BucketRun, RunState
from .outcome import Agreement, Outcome, Pending

__all__ = ["BucketPipeline", "IN_FLIGHT"]

#: Reductions started after backward that may be in flight at once.
IN_FLIGHT = 1


class BucketPipeline:
    """One step's reductions over a fixed bucket layout.

    Args:
        strategy: how each bucket is reduced.
        buckets: the float buckets of the layout (identical on every rank).
        buffers: the layout's reusable packing buffers, one per bucket index (filled here; this layout's only).
        key: the layout's key (for per-bucket strategy state).
        params: the parameters (dtype and device of new buffers).
        launch: the :class:`Launcher`.
        comm: the communicator.
        counters: the step counters.
        agreement: the step's :class:`~distopt.step.outcome.Agreement` (its small collectives, and
            ``context(where)``, which wraps collective errors with the step and the bucket).
        views: reduce a lone contiguous gradient in place (no copy). False packs every bucket into a buffer the
            pipeline owns, so that a reduction abandoned by an exception in backward never writes into gradient
            memory the user has since reused.
        bucket_view: the gradients already live in ``buffers``, allocated by the caller (PyTorch's
            ``gradient_as_bucket_view``: each ``.grad`` is a view into its bucket). Every bucket is reduced in place
            in its buffer; nothing is packed or unpacked, except that the slot of a missing (None) gradient is zeroed.
        settled: the engine's ``Outcome`` when the step header already settled the step, else None.
        sync: the step's :class:`~distopt.sharding.sync.StepSync`: each bucket's collective, and where its result
            lands (the gradients, or this rank's segment of a sharded step).
    """

    def __init__(self, strategy: Strategy, buckets: Sequence[Bucket], buffers: list[Any], key: int,
                 params: Sequence[Any], launch: Launcher, comm: Communicator, counters: Counters,
                 agreement: Agreement, views: bool = True, bucket_view: bool = False,
                 settled: Any = None, sync: StepSync | None = None) -> None:
        self.strategy, self.buckets, self.buffers, self.key = strategy, buckets, buffers, key
        self.views, self.bucket_view = views, bucket_view
        self.params, self.launch, self.comm, self.counters = params, launch, comm, counters
        self.agreement, self.context = agreement, agreement.context
        self.runs = [BucketRun(b, bucket, len(bucket.slots)) for b, bucket in enumerate(buckets)]
        self.where = {s.index: (self.runs[b], s) for b, bucket in enumerate(buckets) for s in bucket.slots}
        self.marked: set[int] = set()
        self.had: set[int] = set()  # packed gradients that were not None (the caller may have dropped them since)
        self.next = 0
        self.settled = settled
        self.sync = StepSync(launch) if sync is None else sync
        self.sync.bind(self.runs)

    def _ctx(self, run: BucketRun) -> BucketContext:
        """A bucket's context, its collective the one the step's sync chose."""
        return BucketContext(run.index, len(self.runs), self.key, run.bucket, run.viewed, self.comm,
                             self.sync.launcher(run.index), self.counters, self.sync.out(run))

    def _flat(self, run: BucketRun, grad: Any) -> None:
        """Give ``run`` its flat buffer: a lone contiguous gradient itself, else the layout's buffer (with
        ``bucket_view`` it holds the gradients: ``viewed``)."""
        if run.flat is not None:
            return
        bucket, b = run.bucket, run.index
        if self.bucket_view:
            run.flat, run.viewed = self.buffers[b], True
        elif self.views and bucket.alone and grad is not None and grad.flags.c_contiguous:
            run.flat, run.viewed = grad.reshape(-1), True
        else:
            buf = self.buffers[b]
            if buf is None:
                xp = xp_of(self.params[bucket.slots[0].index])
                buf = self.buffers[b] = self.sync.new_buffer(bucket.size, bucket.dtype,
                                                             lambda n: xp.empty(n, dtype=bucket.dtype))
            run.flat, run.viewed = buf[:bucket.size], False  # a kept buffer may be larger

    def _drop(self, run: BucketRun) -> None:
        """Let go of a bucket's flat buffer; a packing buffer goes back to the step's sync (it may keep it)."""
        if not run.viewed and self.buffers[run.index] is not None:
            self.sync.release(self.buffers[run.index])
        run.drop(self.buffers)

    def _put(self, index: int, grad: Any) -> None:
        run, s = self.where[index]
        self._flat(run, grad)
        if not run.viewed or (self.bucket_view and grad is None):
            put(run.flat, s, grad)
        self.marked.add(index)
        if grad is not None:
            self.had.add(index)
        run.missing -= 1

    def ready(self, index: int, grad: Any) -> bool:
        """Gradient of parameter ``index`` is final: pack it, start complete buckets in order. Returns whether it was
        packed now (False: packed before, or in no float bucket)."""
        if index in self.marked or index not in self.where:
            return False
        self._put(index, grad)
        while self.next < len(self.runs) and self.runs[self.next].missing == 0:
            self._start(self.runs[self.next])
        for run in self.runs[:self.next]:
            test = getattr(run.handle, "test", None)
            if test is not None:  # MPI needs test() calls to progress a reduction while backward runs
                test()
            self._poll(run)
        return True

    def _poll(self, run: BucketRun) -> None:
        """When the step's sync holds a started bucket's result (:meth:`~distopt.sharding.sync.StepSync.poll`), let
        the bucket's buffer go."""
        kept = self.sync.poll(run) if run.state is RunState.STARTED else None
        if kept is not None:
            run.handle, run.state = kept, RunState.HELD
            self._drop(run)

    def _range(self, run: BucketRun, phase: str) -> Any:
        """A ``torch.profiler`` range for a bucket (a no-op unless a profiler records)."""
        return profile_range(f"distopt.{self.strategy.name} {phase} bucket {run.index + 1}/{len(self.runs)}")

    def _start(self, run: BucketRun) -> None:
        with self.context(lambda: run.describe(len(self.runs))), self._range(run, "start"):
            run.handle = self.strategy.start(self._ctx(run), run.flat)
        run.state = RunState.STARTED
        self.next = run.index + 1

    def complete(self, grads: list[Any], active: bool = True) -> Outcome:
        """Start the buckets not started yet, agree on the step, then average ``grads`` in place (collective). A missing
        gradient counts as zero; a parameter with no gradient on any rank is reported absent; integer and boolean
        parameters are never reduced. A step skipped before the reduction (a rank's own gradient is not finite) writes
        nothing. With ``check_finite`` the decision is also taken on the REDUCED gradient (an overflowing half-precision
        sum of finite inputs), with one more one-element all-reduce so every rank decides the same; the averaged
        (non-finite) values are then left in ``grads``. A step the header left pending
        (:class:`~distopt.step.outcome.Pending`) completes the buckets first, then settles which gradients exist from
        the reduced ones."""
        agreement, settled = self.agreement, self.settled
        if settled is not None and not settled.applies:  # skipped before any reduction
            return agreement.on_gradients(self.params, grads, active, settled)
        had = self.own(grads)
        self.launch_rest(grads)
        if isinstance(settled, Pending):
            return self._settle_from_reduced(grads, active, had)
        outcome = agreement.on_gradients(self.params, grads, active, settled, had)
        if not outcome.applies:
            self.abandon()
            return outcome
        self.finish(grads, agreement.divisor(outcome))
        if self.runs and self.sync.vote(grads, outcome.present, agreement.check_finite, agreement.vote):
            agreement.skip(outcome)
        return outcome

    def own(self, grads: Sequence[Any]) -> list[bool]:
        """Per parameter, whether this rank has its gradient: in ``grads``, or packed already (a sharded step's caller
        drops a gradient once packed, :attr:`~distopt.sharding.sync.StepSync.lands_in_gradients`)."""
        return [g is not None or i in self.had for i, g in enumerate(grads)]

    def _settle_from_reduced(self, grads: list[Any], active: bool, had: list[bool]) -> Outcome:
        """Finish a pending step's buckets (nobody joined: divided by the world size), then let the step's sync settle
        its outcome from the reduced values (:meth:`~distopt.sharding.sync.StepSync.settle_pending`)."""
        own = list(grads)  # this rank's own gradients (None where it had none or dropped one packed: ``had``)
        self.finish(grads, self.comm.size)
        return self.sync.settle_pending(self.agreement, self.params, own, lambda i: self._reduced(i, grads), active,
                                        had)

    def _reduced(self, i: int, grads: list[Any]) -> Any:
        """Parameter ``i``'s reduced gradient: ``grads[i]``, or a bucket view's slot (never unpacked)."""
        if grads[i] is not None:
            return grads[i]
        run, s = self.where[i]
        return run.flat[s.offset:s.offset + s.size]

    def launch_rest(self, grads: Sequence[Any]) -> None:
        """Start every bucket not started yet, in order; missing gradients pack as zeros. At most :data:`IN_FLIGHT`
        reductions run at once from here on: MPI moves many concurrent large all-reduces slower than a short queue. On a
        thread-backed communicator every started reduction has ended when this returns (one thread at a time may use the
        communicator)."""
        while self.next < len(self.runs):
            if self.next >= IN_FLIGHT:
                self._wait(self.runs[self.next - IN_FLIGHT])
                self._poll(self.runs[self.next - IN_FLIGHT])  # its buffer may serve the next bucket
            run = self.runs[self.next]
            for s in run.bucket.slots:  # packed now, not all at once: a sharded step reuses the buffers it drops
                if s.index not in self.marked:
                    self._put(s.index, grads[s.index])
            self._start(run)
        if self.launch.threaded:
            for run in self.runs[:self.next]:
                self._wait(run)

    def _wait(self, run: BucketRun) -> None:
        wait = getattr(run.handle, "wait", None)
        if wait is not None:
            with self.context(lambda: run.describe(len(self.runs))):
                wait()

    def finish(self, grads: list[Any], divisor: int) -> None:
        """Complete every bucket and average over ``divisor`` ranks.

        Each bucket's result lands where the step's sync puts it (:meth:`~distopt.sharding.sync.StepSync.land`:
        unpacked into ``grads``, a None entry receiving a new array, or kept as this rank's segment). Adds the bytes
        sent to ``counters.wire_bytes`` and the dense equivalent to ``dense_bytes``, then signals the strategy's
        :meth:`~distopt.strategies.GradientStrategy.end_of_step`.
        """
        for run in self.runs:
            with self.context(lambda: run.describe(len(self.runs))), self._range(run, "finish"):
                done = self.strategy.finish(self._ctx(run), run.flat, run.handle, divisor)
            self.counters.wire_bytes += done.wire_bytes
            self.counters.dense_bytes += run.bucket.size * run.bucket.dtype.itemsize
            if self.sync.land(run, done, grads) and run.flat is not None:
                self._drop(run)
            run.state = RunState.LANDED
        self.strategy.end_of_step()

    def abandon(self) -> None:
        """Complete started reductions without using them (a skipped step)."""
        for run in self.runs[:self.next]:
            with self.context(lambda: run.describe(len(self.runs))):
                self.strategy.abandon(run.handle)

