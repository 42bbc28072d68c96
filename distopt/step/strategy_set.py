"""The strategies one DistOpt holds (the held one and SINGA's per-call ones, :mod:`distopt.singa`), and their saved
state."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..strategies import GradientStrategy, ParameterAverager, Strategy
from ..strategies.stand_ins import LocalGradients, NoAveraging

__all__ = ["StrategySet", "SECTIONS", "Slots", "slots"]

#: ``state_dict`` sections: state identical on every rank, and state that differs per rank.
SECTIONS = ("strategies", "rank_local")


class Slots(NamedTuple):
    """A step's two slots: the gradient strategy (per bucket) and the parameter averager (after the update); the
    strategy fills the slot of its kind, the other holds a do-nothing stand-in (:mod:`distopt.strategies.stand_ins`)."""

    gradients: GradientStrategy
    averager: ParameterAverager


_NO_AVERAGING = NoAveraging()


def slots(strategy: Strategy) -> Slots:
    """``strategy`` in its slot, a stand-in in the other (stand-ins hold no state).

    Raises:
        TypeError: ``strategy`` is neither a gradient strategy nor a parameter averager.
    """
    if isinstance(strategy, GradientStrategy):
        return Slots(strategy, _NO_AVERAGING)
    if isinstance(strategy, ParameterAverager):
        return Slots(LocalGradients(strategy), strategy)
    raise TypeError(f"a strategy subclasses GradientStrategy or ParameterAverager; {type(strategy).__name__} "
                    "subclasses neither")


class StrategySet:
    """The held strategy, the per-call (SINGA) strategies by kind, reused from call to call, and state restored before
    a strategy exists (a SINGA method not called yet since the restore), waiting until it does.

    Args:
        held: the strategy of ``step`` / ``backward_and_update``.
    """

    def __init__(self, held: Strategy) -> None:
        self.held = held
        self._per_call: dict[type, Strategy] = {}
        self._pending: dict[str, tuple[str, Any]] = {}  # key -> (section, state)

    def _key(self, strategy: Strategy) -> str:
        return "strategy" if strategy is self.held else f"singa.{strategy.name}"

    def per_call(self, strategy: Strategy) -> Strategy:
        """The strategy a per-call method uses: the previous one of its kind if the settings match, else ``strategy``
        carrying the previous one's state (or state restored for it)."""
        previous = self._per_call.get(type(strategy))
        if previous == strategy:
            return previous
        if previous is not None:
            strategy.load_state_dict(previous.state_dict())
        self._per_call[type(strategy)] = strategy
        self.restore(strategy)
        return strategy

    def restore(self, strategy: Strategy) -> None:
        """Hand ``strategy`` the state restored for it, if any is waiting."""
        waiting = self._pending.pop(self._key(strategy), None)
        if waiting is not None:
            strategy.load_state_dict(waiting[1])

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{"strategies": {key: state}, "rank_local": {key: state}}`` for every strategy (and waiting state)."""
        out: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for key, (section, value) in self._pending.items():
            out[section][key] = value
        for s in (self.held, *self._per_call.values()):
            out[SECTIONS[1] if s.per_rank_state else SECTIONS[0]][self._key(s)] = s.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict` output; strategies that do not exist yet get theirs when they do."""
        self._pending = {key: (section, value) for section in SECTIONS for key, value in state[section].items()}
        for s in (self.held, *self._per_call.values()):
            self.restore(s)
