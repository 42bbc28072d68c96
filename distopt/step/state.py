"""Checkpoint state of one DistOpt: the local optimizer's, the strategies' and the counters'."""
from __future__ import annotations

from typing import Any, Mapping

from ..core.counters import Counters
from ..portable import from_portable, to_portable
from .local import LocalOptimizer
from .strategy_set import StrategySet

__all__ = ["StepState", "STATE_FORMAT"]

#: Version of :meth:`StepState.state_dict`'s layout (2: strategies own their state).
STATE_FORMAT = 2


class StepState:
    """Saves and restores what a DistOpt needs to continue.

    Args:
        local: the local optimizer.
        counters: ``DistOpt.stats``.
        strategies: the held and per-call strategies.
    """

    def __init__(self, local: LocalOptimizer, counters: Counters, strategies: StrategySet) -> None:
        self.local, self.counters, self.strategies = local, counters, strategies

    def state_dict(self, sampler: Any = None) -> dict[str, Any]:
        """The local optimizer's, the strategies', the counters' and ``sampler``'s state.

        Strategies whose state is per rank (error-feedback residuals) are
        under ``"rank_local"``; the rest is identical on every rank. It holds
        only tensors, numbers, strings and plain containers (arrays as
        tensors, see :mod:`distopt.portable`) when PyTorch is installed, so
        ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it.
        """
        state = {"format": STATE_FORMAT, "local": self.local.state_dict(), "stats": self.counters.state_dict(),
                 **self.strategies.state_dict()}
        if sampler is not None:
            state["sampler"] = sampler.state_dict()
        return to_portable(state)

    def load_state_dict(self, state: Mapping[str, Any], sampler: Any = None) -> None:
        """Restore :meth:`state_dict` output (a SINGA method's strategy receives its state at its next call).

        Raises:
            ValueError: ``state`` was written in another format (an older distopt).
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"state has format {state.get('format', 1)!r}; this distopt reads format "
                             f"{STATE_FORMAT} (strategies own their state, residuals keyed by the new bucket "
                             "layout): re-create the checkpoint with this version")
        state = from_portable(state)
        self.local.load_state_dict(state["local"])
        self.counters.load_state_dict(state["stats"])
        self.strategies.load_state_dict(state)
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
