"""The do-nothing halves of a step: no gradient reduction, no parameter averaging.

A step has two slots (:func:`distopt.step.strategy_set.slots`): a gradient strategy, run per bucket during or after
backward, and a parameter averager, run after the local update. A strategy fills the slot of its kind; the other slot
holds one of these, so the step path runs both slots without asking which kind it has.
"""
from __future__ import annotations

from typing import Any, ClassVar

from .base import Done, GradientStrategy, Handle, ParameterAverager, Strategy, UpdateContext

__all__ = ["LocalGradients", "NoAveraging"]


class LocalGradients(GradientStrategy):
    """The gradient slot of a parameter averager: every rank keeps its own gradient (nothing is reduced).

    The step header still compares the averager's settings and checks the parameters; the engine lays out no buckets for
    it (``reduces`` False).

    Args:
        averager: the strategy it stands in for (name, settings, join support).
    """

    reduces: ClassVar[bool] = False

    def __init__(self, averager: Strategy) -> None:
        self.averager = averager
        self.name = averager.name  # type: ignore[misc]
        self.supports_join = averager.supports_join  # type: ignore[misc]
        self.identical_replicas = averager.identical_replicas  # type: ignore[misc]

    def threshold(self, threshold: int | None) -> int:
        return self.averager.threshold(threshold)

    def settings(self) -> dict[str, Any]:
        return self.averager.settings()

    def finish(self, ctx: Any, flat: Any, started: Handle, divisor: int) -> Done:  # noqa: ARG002
        raise AssertionError("LocalGradients has no buckets to finish")


class NoAveraging(ParameterAverager):
    """The averager slot of a gradient strategy: nothing happens after the local update."""

    name: ClassVar[str] = "none"
    averages: ClassVar[bool] = False

    def after_update(self, ctx: UpdateContext) -> None:  # noqa: ARG002
        """Nothing: the gradients were averaged before the update."""
