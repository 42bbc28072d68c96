"""The step runner: the one path every step takes, whichever route calls it.

SINGA's methods and ``DistOpt.step(params, grads)`` on array models call :meth:`StepRunner.run` (an array loss whose
``backward()`` yields ``(param, grad)`` pairs: :meth:`StepRunner.backward_run`); PyTorch's post-accumulate-grad hooks
hand each final gradient to the follower (:mod:`distopt.torch.follower`), which calls :meth:`StepRunner.begin` and
:meth:`StepRunner.complete`, and its step post-hook :meth:`StepRunner.finish_step`, the one place steps are counted."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..core.buckets import is_float
from ..core.counters import Counters
from ..strategies.base import Strategy, UpdateContext
from .accumulate import GradientAccumulator
from .agreement import GroupSettings, group_settings
from .engine import Engine
from .outcome import Outcome
from .local import ArrayOptimizer, LocalOptimizer, checked_pairs
from .pipeline import BucketPipeline
from .strategy_set import StrategySet, slots

__all__ = ["StepRunner", "LastStep", "JoinResult"]


@dataclass
class JoinResult:
    """What ``with opt.join() as result:`` reports once the block has ended, on every rank.

    Attributes:
        last_joined: the rank that joined last (the highest such rank when several joined at the same step), as
            Horovod's ``join()`` returns.
    """

    last_joined: int = -1


@dataclass
class LastStep:
    """What the last array step ran: ``join`` shadows it and ``flush`` repeats it."""

    strategy: Strategy
    params: list[Any]
    threshold: int | None


class StepRunner:
    """Runs every step: agreement, the strategy's reduction, the local update, counting.

    Args:
        engine: the :class:`~distopt.step.engine.Engine` (layout, agreement, pipeline).
        local: the local optimizer.
        strategies: the held strategy and SINGA's per-call ones.
        counters: ``DistOpt.stats``.
        overlap: start buckets during an array loss's backward (strategies that support it).
        accumulator: micro-batch accumulation of array models (``backward_passes_per_step > 1``), or None.

    Attributes:
        active_strategy: the strategy the last step used.
        last: the last array step (:class:`LastStep`), or None.
        joining: this rank is inside ``join()``.
    """

    def __init__(self, engine: Engine, local: LocalOptimizer, strategies: StrategySet, counters: Counters,
                 overlap: bool, accumulator: GradientAccumulator | None) -> None:
        self.engine, self.local, self.strategies, self.counters = engine, local, strategies, counters
        self.overlap, self.accumulator = overlap, accumulator
        self.active_strategy: Strategy = strategies.held
        self.last: LastStep | None = None
        self.joining = False
        self._groups: GroupSettings | None = None
        self._held: Callable[[], int] = lambda: 0  # BYTES the last step's sync holds outside the layout

    @property
    def strategy(self) -> Strategy:
        """The held strategy (``step()``, ``backward_and_update``, ``loss.backward()``)."""
        return self.strategies.held

    def _prepare(self, strategy: Strategy) -> None:
        """Make ``strategy`` the active one with its restored state; validate it (no communication)."""
        self.engine.sync.check(strategy)
        self.active_strategy = strategy
        self.counters.declare(strategy.counter_names)
        self.strategies.restore(strategy)
        strategy.bind(self.engine.comm.size, self.local)
        self._groups = group_settings(self.local.hyper_parameters(), self._groups)

    def begin(self, strategy: Strategy, params: Sequence[Any], threshold: int | None, *,
              views: bool = True, grads: Sequence[Any] | None = None, bucket_view: bool = False,
              shadow: bool = False, names: Sequence[str] | None = None) -> BucketPipeline:
        """Agree on the step with the other ranks and return the bucket pipeline of ``strategy``'s gradient slot
        (collective; a parameter averager's has no buckets); arguments as :meth:`~distopt.step.engine.Engine.begin`."""
        self._prepare(strategy)
        return self.engine.begin(slots(strategy).gradients, params, threshold, self.joining, views, grads,
                                 bucket_view, self._groups, shadow, names)

    def complete(self, pipeline: BucketPipeline, grads: list[Any], active: bool = True) -> Outcome:
        """Finish every bucket of ``pipeline``, averaging ``grads`` in place (collective); counts the buckets started
        before this call (during backward) in ``buckets_started_in_backward``."""
        self.counters.buckets_started_in_backward += pipeline.next
        sync = pipeline.sync
        self._held = lambda: sync.held_bytes
        return pipeline.complete(grads, active)

    def finish_step(self, strategy: Strategy, params: Sequence[Any], threshold: int | None, applied: bool) -> None:
        """After the local update: count an applied step and run a parameter averager's after-update."""
        if not applied:
            return
        self.counters.steps += 1
        self._memory()
        averager = slots(strategy).averager
        if averager.averages:
            if strategy is not self.active_strategy:  # the PyTorch route: no step header prepared it
                self._prepare(strategy)
            floats = [p for p in params if is_float(p)]
            averager.after_update(UpdateContext(floats, averager.threshold(threshold), self.engine.comm,
                                                self.counters, self.local.momentum_arrays,
                                                self.engine.average_arrays))
            self.counters.dense_bytes += sum(int(p.nbytes) for p in floats)
        self.counters.step_done()

    def _memory(self) -> None:
        """``optimizer_state_bytes``, ``parameter_bytes`` and ``gradient_bytes`` as of now."""
        self.counters.optimizer_state_bytes = self.local.state_bytes()
        self.counters.parameter_bytes = self.local.param_bytes()
        layout = self.engine.layout
        held = 0 if layout is None else sum(int(b.nbytes) for b in layout.buffers if b is not None)
        grads = getattr(self.local, "grad_bytes", None)
        self.counters.gradient_bytes = held + self._held() + (grads() if callable(grads) else 0)

    def _arrays(self) -> ArrayOptimizer:
        if not isinstance(self.local, ArrayOptimizer):
            raise TypeError("step(params, grads) is for array optimizers; a torch.optim.Optimizer's gradients are "
                            "averaged by loss.backward(): call step() (or step(closure))")
        return self.local

    def run(self, strategy: Strategy, params: Sequence[Any], grads: Sequence[Any], threshold: int | None) -> None:
        """Check ``params``/``grads``, accumulate micro-batches if asked, then :meth:`step`.

        Raises:
            TypeError: the local optimizer is a PyTorch one.
            ValueError: ``params`` and ``grads`` differ in length or shape.
        """
        local = self._arrays()
        params, grads = checked_pairs(params, grads)
        local.remember(params)  # the shared order of an array model's later overlapped backward
        self.last = LastStep(strategy, params, threshold)
        if self.accumulator is not None:
            grads = self.accumulator.add(grads)
            if grads is None:
                return
        self.step(strategy, params, grads, threshold)

    def backward_run(self, strategy: Strategy, loss: Any, threshold: int | None) -> None:
        """An array loss: backward (buckets start during it with overlap), reduce, update."""
        local = self._arrays()
        if self.overlap and slots(strategy).gradients.supports_overlap and self.accumulator is None:
            run = local.overlapped_backward(loss, lambda params: self.begin(strategy, params, threshold))
            if run is not None:
                params, grads, pipeline = run
                self.last = LastStep(strategy, params, threshold)
                self.step(strategy, params, grads, threshold, pipeline)
                return
        self.run(strategy, *local.backward(loss), threshold)

    def step(self, strategy: Strategy, params: list[Any], grads: list[Any], threshold: int | None,
             pipeline: BucketPipeline | None = None, active: bool = True) -> int:
        """Reduce, update, finish the step; returns the number of active ranks (0: all joined)."""
        local = self._arrays()
        if pipeline is None:
            pipeline = self.begin(strategy, params, threshold, grads=grads)
        outcome = self.complete(pipeline, grads, active)
        if outcome.applies and any(outcome.present):
            reduced = slots(strategy).gradients.reduces  # else each rank updates with its own gradients
            present = outcome.present if reduced else [g is not None and is_float(p) for p, g in zip(params, grads)]
            pipeline.sync.apply(local, params, grads, present)
        self.finish_step(strategy, params, threshold, outcome.applies)
        return outcome.active

    def average(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None) -> list[Any]:
        """Average ``grads`` in place with the held strategy, without updating (see ``DistOpt.average``).

        Raises:
            ValueError: the held strategy averages parameters, not gradients; ``params`` and ``grads`` do not match.
        """
        strategy = self.strategy
        if not slots(strategy).gradients.reduces:
            raise ValueError(f"average() needs a strategy that averages gradients, not {strategy.name!r}")
        params, grads = checked_pairs(params, grads)
        outcome = self.complete(self.begin(strategy, params, threshold, grads=grads), grads)
        if not outcome.applies:
            return [None] * len(grads)
        return [g if ok else None for g, ok in zip(grads, outcome.present)]

    def flush(self) -> None:
        """Apply a partial accumulation of array micro-batches now (see ``DistOpt.flush``)."""
        if self.accumulator is None or self.accumulator.count == 0 or self.last is None:
            return
        self.step(self.last.strategy, self.last.params, self.accumulator.release(), self.last.threshold)

    def discard_accumulation(self) -> None:
        """Drop a partial accumulation of array micro-batches."""
        if self.accumulator is not None:
            self.accumulator.discard()

    @contextmanager
    def join(self, shadow: Callable[[], int] | None, params: Sequence[Any] | None,
             shadow_forward: Callable[[], int] | None = None,
             after: Callable[[int], None] | None = None) -> Iterator[JoinResult]:
        """The body of ``DistOpt.join``: mark this rank joined; after the loop, shadow until all joined.

        Args:
            shadow: one shadow step of the PyTorch follower (returns the active ranks), or None for array models (the
                last step is repeated with zero gradients).
            params: an array model's parameters when it ran no step yet.
            shadow_forward: shadows what the active ranks do before each step (the model's buffer broadcast; returns
                the active ranks, 0 when all joined), or None.
            after: called on every rank with the last rank to join (the model's final buffer sync), or None.

        Yields:
            A :class:`JoinResult`, filled when the block ends.

        Raises:
            ValueError: an array model with no step yet and no ``params``.
        """
        result = JoinResult()
        self.joining = True
        try:
            yield result
            if shadow is None:
                shadow = self._array_shadow(params)
            first, last = True, False
            while True:
                active = shadow_forward() if shadow_forward is not None else None
                if active != 0:
                    active = shadow()
                if first:
                    first, last = False, active == 0  # nobody stepped after this rank joined
                if not active:
                    break
            flag = np.array([self.engine.comm.rank if last else -1], dtype=np.int64)
            self.engine.comm.all_reduce(flag, op="max")  # DDP's and Horovod's "last joined rank"
            result.last_joined = int(flag[0])
            if after is not None:
                after(result.last_joined)
        finally:
            self.joining = False

    def _array_shadow(self, params: Sequence[Any] | None) -> Callable[[], int]:
        if self.last is not None:
            strategy, known, threshold = self.last.strategy, self.last.params, self.last.threshold
        else:
            owned = self.local.arrays()
            if params is None and owned is None:
                raise ValueError("join() needs params= for an array model that has run no step")
            strategy, known, threshold = self.strategy, list(owned if params is None else params), None
        return lambda: self.step(strategy, known, [None] * len(known), threshold, active=False)
