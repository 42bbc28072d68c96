"""Uneven inputs and accumulation ends, as methods of :class:`~distopt.DistOpt`.

``join()`` lets ranks with fewer batches finish early (Horovod's
``hvd.join``, PyTorch's ``Join``): a rank that left its loop shadows the
others' steps with zero gradients. ``flush()`` applies a partial gradient
accumulation at an epoch end.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .strategies import Strategy

if TYPE_CHECKING:
    from .accumulate import GradientAccumulator
    from .autosync import AutoSync
    from .local import LocalOptimizer

__all__ = ["JoinMethods", "LastStep"]


@dataclass
class LastStep:
    """What the last step ran: ``join`` shadows it and ``flush`` repeats it."""

    strategy: Strategy
    params: list[Any]
    threshold: int | None


class JoinMethods:
    """Mixin of :class:`~distopt.DistOpt`: ``join``, ``flush`` and ``discard_accumulation``."""

    _accumulator: GradientAccumulator | None
    _last: LastStep | None
    _joining: bool
    _sync: AutoSync | None
    local: LocalOptimizer
    strategy: Strategy
    if TYPE_CHECKING:  # provided by DistOpt
        def _step(self, strategy: Strategy, params: list[Any], grads: list[Any], threshold: int | None,
                  pipeline: Any = None, active: bool = True) -> int: ...

    def flush(self) -> None:
        """Apply a partial gradient accumulation now, as its own averaged update.

        With ``backward_passes_per_step=k``, an epoch whose micro-batch count
        is not a multiple of k leaves some micro-batches accumulated; call
        ``flush()`` on every rank at the epoch end to apply them (averaged
        over the micro-batches held), or :meth:`discard_accumulation` to
        drop them. Either way the next epoch starts with a clean counter.
        Does nothing without a pending accumulation.
        """
        if self._accumulator is None or self._accumulator.count == 0 or self._last is None:
            return
        last = self._last
        self._step(last.strategy, last.params, self._accumulator.release(), last.threshold)

    def discard_accumulation(self) -> None:
        """Drop a partial gradient accumulation (see :meth:`flush`)."""
        if self._accumulator is not None:
            self._accumulator.discard()

    @contextmanager
    def join(self, params: Sequence[Any] | None = None) -> Iterator[None]:
        """Let ranks with fewer batches finish early without hanging the others.

        Use around the training loop on every rank (Horovod's ``hvd.join``,
        PyTorch's ``Join``)::

            with opt.join():
                for batch in my_batches:      # counts may differ per rank
                    opt.backward_and_update(loss_of(batch))

        A rank that leaves the loop keeps answering the others' steps with
        zero gradients and applies the same averaged update, so parameters
        stay identical; while some ranks have joined, the average is taken
        over the ranks that contributed (sum / number of active ranks).
        Works with strategies that support it (plain and half); with any
        other (sparse, partial) every rank raises ValueError, at the first
        step inside ``join`` or when a rank has joined. Gradient
        accumulation is not combined with join.

        Args:
            params: the parameters, for an array model that ran no step
                before joining (the PyTorch adapter knows them).

        Raises:
            ValueError: nothing to shadow (no step yet and no ``params``),
                a strategy without ``join`` support, or
                ``gradient_as_bucket_view=True`` (not combined with join).
        """
        if self._sync is not None and self._sync.bucket_view:
            raise ValueError("join() is not supported with DistOpt(..., gradient_as_bucket_view=True): a joined "
                             "rank's shadow steps do not write into the bucket views")
        self._joining = True
        try:
            yield
        except BaseException:
            self._joining = False
            raise
        try:
            if self._last is not None:
                strategy, known, threshold = self._last.strategy, self._last.params, self._last.threshold
            else:
                owned = self.local.arrays()
                if params is None and owned is None:
                    raise ValueError("join() needs params= for an array model that has run no step")
                strategy, known, threshold = self.strategy, list(owned if params is None else params), None
            while self._step(strategy, known, [None] * len(known), threshold, active=False):
                pass
        finally:
            self._joining = False
