"""The strategy interface: how gradients (or parameters) are averaged across ranks.

The step engine (:mod:`distopt.step.engine`) packs gradients into buckets that every rank lays out identically, then
drives a :class:`GradientStrategy` per bucket:

1. :meth:`GradientStrategy.start` is called in bucket order, as soon as a bucket's gradients are final (during backward
   when the strategy supports overlap, else after it). It may start an asynchronous collective through
   :meth:`BucketContext.launch` and returns a :class:`Handle` (:data:`NOT_STARTED` when the work waits for
   :meth:`GradientStrategy.finish`).
2. After every bucket has started, the ranks agree on which gradients exist and whether to skip the step.
3. :meth:`GradientStrategy.finish` waits for the handle and writes the cross-rank average into the bucket's flat buffer
   (or leaves the division to the unpack, see :class:`Done`); a skipped step calls :meth:`GradientStrategy.abandon`.
4. :meth:`GradientStrategy.end_of_step` runs once, after the last bucket.

A :class:`ParameterAverager` reduces no gradient: every rank updates with its own, then
:meth:`ParameterAverager.after_update` averages parameters.

A strategy owns its state (``state_dict`` / ``load_state_dict``) and reports its own counters through
:meth:`distopt.core.counters.Counters.add` (names in :attr:`Strategy.counter_names`). Adding a strategy is one new
module with a subclass and one entry in :mod:`distopt.strategies.registry`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence

from ..core.buckets import DEFAULT_THRESHOLD, Bucket
from ..comm.launcher import Handle

if TYPE_CHECKING:
    from ..comm.base import Communicator
    from ..core.counters import Counters

__all__ = ["Strategy", "GradientStrategy", "ParameterAverager", "LocalInfo", "BucketContext", "UpdateContext",
           "Done", "Handle", "NotStarted", "NOT_STARTED"]


class LocalInfo(Protocol):
    """What a strategy may ask of the local optimizer (:meth:`Strategy.bind`, :class:`UpdateContext`)."""

    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:
        """The momentum buffer of each parameter (None where there is none yet); ValueError if the optimizer has no
        momentum buffers at all."""

    def momentum_factors(self) -> list[tuple[str, float]]:
        """``(where, value)`` of every momentum setting of the optimizer, e.g.
        ``("torch.optim.SGD.param_groups[0]['momentum']", 0.9)``; empty without one."""


class NotStarted(NamedTuple):
    """The :class:`Handle` of a bucket whose whole reduction runs in :meth:`GradientStrategy.finish` (after the ranks
    agreed on the step, so a skipped step changes no state)."""

    def test(self) -> bool:
        """Always True: nothing is in flight."""
        return True

    def wait(self) -> None:
        """Returns at once: nothing is in flight."""


NOT_STARTED = NotStarted()
"""The one :class:`NotStarted` handle."""


class Done(NamedTuple):
    """What :meth:`GradientStrategy.finish` reports.

    Attributes:
        wire_bytes: bytes this rank handed to the collectives for the bucket.
        divisor: the division the bucket sync still applies (1 when :attr:`result` already holds the average); it is
            folded into the unpack where there is one, saving a pass.
        result: where the bucket's result lies when it is not the flat buffer: what a reduce-scatter's ``wait()``
            returned (this rank's segment, see :attr:`BucketContext.launch`); None: the flat buffer.
    """

    wire_bytes: int
    divisor: int = 1
    result: Any = None


@dataclass
class BucketContext:
    """Where one bucket is reduced.

    Attributes:
        index: position of the bucket in the layout, ``0 <= index < count``.
        count: number of buckets the step reduces.
        key: identifies the layout (parameter shapes, dtypes, threshold); a strategy keys per-bucket state by
            ``(key, index)``.
        bucket: the bucket's layout (dtype, slots, size in elements).
        viewed: True when the flat buffer is the gradient itself (a lone contiguous gradient), False for a packed copy.
        comm: the communicator (blocking collectives).
        launch: ``launch(array, op)`` starts the bucket's reduction of ``array`` (``bucket.size`` elements, ``op`` as
            :meth:`Communicator.all_reduce`) and returns its :class:`Handle`; asynchronous where the backend allows
            it. The bucket sync chooses the collective: an all-reduce, whose ``wait()`` returns ``array`` itself,
            reduced in place; or, under a sharded optimizer, a reduce-scatter, whose ``wait()`` returns this rank's
            reduced segment (a new 1-D array).
        counters: the step counters (``stats``); a strategy reports its own counts with ``counters.add(name, n)``.
        out: the buffer a strategy that converts the reduced array writes its result into: the flat buffer when the
            bucket is all-reduced, None when the result is a new array (a reduce-scatter's segment).
    """

    index: int
    count: int
    key: int
    bucket: Bucket
    viewed: bool
    comm: Communicator
    launch: Callable[[Any, str], Handle]
    counters: Counters
    out: Any = None


@dataclass
class UpdateContext:
    """What :meth:`ParameterAverager.after_update` may use.

    Attributes:
        params: the float parameters of the step, in the shared order.
        threshold: the step's fusion threshold in elements.
        comm: the communicator.
        counters: the step counters.
        momenta: returns the local optimizer's momentum buffer per parameter (None where there is none yet); raises
            ValueError for an optimizer without momentum buffers.
        average: ``average(bucket, arrays, where)`` all-reduces the arrays of one bucket layout to their mean in place
            (collective, with the error context ``where``) and returns the bytes sent.
    """

    params: Sequence[Any]
    threshold: int
    comm: Communicator
    counters: Counters
    momenta: Callable[[Sequence[Any]], list[Any]]
    average: Callable[[Bucket, Sequence[Any], str], int]


class Strategy(ABC):
    """What every strategy has: a name, the settings ranks agree on, state, and what it supports.

    A strategy subclasses exactly one of the two kinds: :class:`GradientStrategy` (per bucket, during or after
    backward) or :class:`ParameterAverager` (after the local update).

    Class attributes:
        name: short snake_case name, part of the settings ranks agree on.
        supports_overlap: buckets may start during backward; the layout then walks parameters in reverse (the order
            backward produces gradients) with a small first bucket, as PyTorch DDP.
        supports_join: ranks that left a ``join()`` loop can shadow this strategy with zero gradients.
        per_rank_state: the state differs per rank (error-feedback residuals): checkpoints store it once per rank.
        default_threshold: the fusion threshold in ELEMENTS of a step called without one (SINGA's 2097152; 65536 for
            strategies whose result does not depend on the bucket layout, so large gradients are reduced in place
            instead of copied).
        identical_replicas: every rank holds bitwise the same parameters after each step (False for a strategy that
            lets replicas drift between averages: call ``DistOpt.average_params`` before evaluating or saving).
        counter_names: the counters this strategy reports through ``counters.add`` (read in ``DistOpt.stats``), e.g.
            ``("sparse_entries", "sparse_dense_fallbacks")``.
        supports_sharding: the strategy's one collective per bucket is :attr:`BucketContext.launch`, whose result it
            reports in :attr:`Done.result`, so the bucket sync may make it a reduce-scatter: it runs under a sharded
            optimizer (``DistOpt(zero=1|2|3)``).
    """

    name: ClassVar[str]
    supports_overlap: ClassVar[bool] = False
    supports_join: ClassVar[bool] = False
    per_rank_state: ClassVar[bool] = False
    default_threshold: ClassVar[int] = DEFAULT_THRESHOLD
    identical_replicas: ClassVar[bool] = True
    counter_names: ClassVar[tuple[str, ...]] = ()
    supports_sharding: ClassVar[bool] = False

    def threshold(self, threshold: int | None) -> int:
        """The fusion threshold in ELEMENTS of a step: ``threshold``, or :attr:`default_threshold` for None."""
        return self.default_threshold if threshold is None else threshold

    def settings(self) -> dict[str, Any]:
        """The settings every rank must agree on (JSON-able; ``strategy`` is added by the engine)."""
        return {}

    def bind(self, world_size: int, local: LocalInfo) -> None:  # noqa: B027 (optional hook)
        """Validate the strategy for ``world_size`` ranks and the local optimizer; called before each step, before any
        communication.

        Raises:
            ValueError: a setting that does not fit the world or the optimizer.
        """

    def state_dict(self) -> dict[str, Any]:
        """This strategy's state (plain containers and arrays)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore :meth:`state_dict` output."""

    def describe(self) -> dict[str, Any]:
        """``{"strategy": name, **settings}``: what the engine's agreement compares."""
        return {"strategy": self.name, **self.settings()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.settings() == self.settings()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.settings().items()))))


class GradientStrategy(Strategy):
    """A strategy that averages gradients bucket by bucket (dense, half, sparse, DGC, PowerSGD).

    The step engine drives it as the module docs describe.

    Class attributes:
        reduces: the strategy reduces buckets (False only for
            :class:`~distopt.strategies.stand_ins.LocalGradients`, the gradient slot of a parameter averager).
    """

    reduces: ClassVar[bool] = True

    def start(self, ctx: BucketContext, flat: Any) -> Handle:
        """Start reducing bucket ``ctx.index`` held in ``flat`` (1-D, the bucket's dtype, ``ctx.bucket.size`` elements).

        Returns:
            The reduction's :class:`Handle` (default :data:`NOT_STARTED`: the whole reduction runs in :meth:`finish`).
        """
        return NOT_STARTED

    @abstractmethod
    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:
        """Complete the bucket: its result (``flat``, or :attr:`Done.result`) must hold the sum over ranks divided by
        ``divisor`` (the contributing ranks), possibly with the division left to the bucket sync (see :class:`Done`).

        Args:
            ctx: where the bucket is reduced.
            flat: the bucket's flat buffer (1-D), this rank's gradients on entry.
            started: what :meth:`start` returned for this bucket.
            divisor: the number of ranks that contributed a gradient, >= 1.
        """

    def abandon(self, started: Handle) -> None:
        """Complete a started reduction without using its result (a skipped step)."""
        started.wait()

    def end_of_step(self) -> None:  # noqa: B027 (optional hook)
        """Called once per applied step, after every bucket finished (per-step counters, warm-up)."""


class ParameterAverager(Strategy):
    """A strategy that lets every rank update with its own gradient, then averages parameters
    (:class:`~distopt.strategies.Partial`; periodic model averaging).

    Class attributes:
        averages: the strategy communicates after the update (False only for
            :class:`~distopt.strategies.stand_ins.NoAveraging`, the averager slot of a gradient strategy).
    """

    averages: ClassVar[bool] = True

    @abstractmethod
    def after_update(self, ctx: UpdateContext) -> None:
        """Runs after the local optimizer's update on every rank (collective if it communicates)."""
