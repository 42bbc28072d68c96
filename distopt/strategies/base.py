"""The strategy interface: how one bucket of gradients is averaged across ranks.

The step engine (:mod:`distopt.engine`) packs gradients into buckets that
every rank lays out identically, then drives a :class:`Strategy` per bucket:

1. :meth:`Strategy.start` is called in bucket order, as soon as a bucket's
   gradients are final (during backward when the strategy supports
   overlap, else after it). It may start an asynchronous collective
   through :meth:`BucketContext.launch` and returns whatever
   :meth:`Strategy.finish` needs.
2. After every bucket has started, the ranks agree on which gradients exist
   and whether to skip the step (one small all-reduce).
3. :meth:`Strategy.finish` waits for the bucket and writes the cross-rank
   average into the bucket's flat buffer (or leaves the division to the
   unpack, see :class:`Done`).
4. The local optimizer updates; then :meth:`Strategy.after_update` runs
   (partial synchronization averages parameters there).

A strategy owns its state (residuals, cursors) and exposes it through
``state_dict`` / ``load_state_dict``. Adding a strategy is one new module
with a subclass; neither the engine nor :class:`~distopt.DistOpt` changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, NamedTuple, Sequence

from ..buckets import DEFAULT_THRESHOLD, Bucket

if TYPE_CHECKING:
    from ..comm.base import Communicator
    from ..counters import Counters
    from ..local import LocalOptimizer

__all__ = ["Strategy", "BucketContext", "UpdateContext", "Done"]


class Done(NamedTuple):
    """What :meth:`Strategy.finish` reports.

    Attributes:
        wire_bytes: bytes this rank handed to the collectives for the bucket.
        divisor: the division still to apply while unpacking (1 when the
            flat buffer already holds the average). Folding the division
            into the unpack saves one pass over the bucket.
    """

    wire_bytes: int
    divisor: int = 1


@dataclass
class BucketContext:
    """Where one bucket is reduced.

    Attributes:
        index: position of the bucket in the layout, ``0 <= index < count``.
        count: number of buckets the step reduces.
        key: identifies the layout (parameter shapes, dtypes, threshold); a
            strategy keys per-bucket state by ``(key, index)``.
        bucket: the bucket's layout (dtype, slots, size in elements).
        viewed: True when the flat buffer is the gradient itself (a lone
            contiguous gradient), False when it is a packed copy.
        comm: the communicator (blocking collectives).
        launch: ``launch(array, op)`` starts an all-reduce and returns a
            handle with ``test()`` and ``wait()`` (which returns the reduced
            array); asynchronous where the backend allows it.
        counters: the step counters (``stats``) a strategy may add to.
    """

    index: int
    count: int
    key: int
    bucket: Bucket
    viewed: bool
    comm: Communicator
    launch: Callable[[Any, str], Any]
    counters: Counters


@dataclass
class UpdateContext:
    """What :meth:`Strategy.after_update` may use.

    Attributes:
        params: the float parameters of the step, in the shared order.
        threshold: the step's fusion threshold in elements.
        comm: the communicator.
        counters: the step counters.
        momenta: returns the local optimizer's momentum buffer per
            parameter (None where there is none yet); raises ValueError
            for an optimizer without momentum buffers.
        average: ``average(bucket, arrays, where)`` all-reduces the arrays
            of one bucket layout to their mean in place (collective, with
            the error context ``where``) and returns the bytes sent.
    """

    params: Sequence[Any]
    threshold: int
    comm: Communicator
    counters: Counters
    momenta: Callable[[Sequence[Any]], list[Any]]
    average: Callable[[Bucket, Sequence[Any], str], int]


class Strategy(ABC):
    """One way of averaging gradients (or parameters) across ranks.

    Class attributes:
        name: short snake_case name, part of the settings ranks agree on.
        supports_overlap: buckets may start during backward; the layout
            then walks parameters in reverse (the order backward produces
            gradients) with a small first bucket, as PyTorch DDP.
        supports_join: ranks that left a ``join()`` loop can shadow this
            strategy with zero gradients.
        reduces_gradients: False for strategies that average parameters
            after the local update instead (:class:`~distopt.strategies.Partial`).
        per_rank_state: the state differs per rank (error-feedback
            residuals): checkpoints store it once per rank.
        default_threshold: the fusion threshold in ELEMENTS of a step
            called without one (SINGA's 2097152; 65536 for strategies whose
            result does not depend on the bucket layout, so large
            gradients are reduced in place instead of copied).
    """

    name: ClassVar[str]
    supports_overlap: ClassVar[bool] = False
    supports_join: ClassVar[bool] = False
    reduces_gradients: ClassVar[bool] = True
    per_rank_state: ClassVar[bool] = False
    default_threshold: ClassVar[int] = DEFAULT_THRESHOLD

    def threshold(self, threshold: int | None) -> int:
        """The fusion threshold in ELEMENTS of a step: ``threshold``, or :attr:`default_threshold` for None."""
        return self.default_threshold if threshold is None else threshold

    def settings(self) -> dict[str, Any]:
        """The settings every rank must agree on (JSON-able; ``strategy`` is added by the engine)."""
        return {}

    def bind(self, world_size: int, local: LocalOptimizer) -> None:  # noqa: B027 (optional hook)
        """Validate the strategy for ``world_size`` ranks and the local optimizer; called before each
        step, before any communication.

        Raises:
            ValueError: a setting that does not fit the world or the optimizer.
        """

    def start(self, ctx: BucketContext, flat: Any) -> Any:
        """Start reducing bucket ``ctx.index`` held in ``flat`` (1-D, the bucket's dtype).

        Returns what :meth:`finish` needs (default: nothing started yet); if
        it has ``test()`` / ``wait()`` the pipeline progresses and bounds it.
        """
        return None

    @abstractmethod
    def finish(self, ctx: BucketContext, flat: Any, started: Any, divisor: int) -> Done:
        """Complete the bucket: ``flat`` must hold the sum over ranks divided by ``divisor``
        (the contributing ranks), possibly with the division left to the unpack (see :class:`Done`)."""

    def abandon(self, started: Any) -> None:
        """Complete a started reduction without using its result (a skipped step)."""
        wait = getattr(started, "wait", None)
        if wait is not None:
            wait()

    def after_update(self, ctx: UpdateContext) -> None:  # noqa: B027 (optional hook)
        """Runs after the local optimizer's update on every rank (collective if it communicates)."""

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
