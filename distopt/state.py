"""Checkpoint state, as methods of :class:`~distopt.DistOpt`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .portable import from_portable, to_portable

if TYPE_CHECKING:
    from .counters import Counters
    from .local import LocalOptimizer
    from .strategy_set import StrategySet

__all__ = ["StateMethods", "STATE_FORMAT"]

#: Version of :meth:`DistOpt.state_dict`'s layout (2: strategies own their state).
STATE_FORMAT = 2


class StateMethods:
    """Mixin of :class:`~distopt.DistOpt`: ``state_dict`` and ``load_state_dict``."""

    local: LocalOptimizer
    stats: Counters
    _strategies: StrategySet
    sampler: Any

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: the local optimizer's, the strategies' and the counters' state.

        Strategies whose state is per rank (error-feedback residuals) are
        under ``"rank_local"``; the rest is identical on every rank. It holds
        only tensors, numbers, strings and plain containers (arrays as
        tensors, see :mod:`distopt.portable`) when PyTorch is installed, so
        ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it.
        """
        state = {"format": STATE_FORMAT, "local": self.local.state_dict(), "stats": self.stats.state_dict(),
                 **self._strategies.state_dict()}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return to_portable(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
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
        self.stats.load_state_dict(state["stats"])
        self._strategies.load_state_dict(state)
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
