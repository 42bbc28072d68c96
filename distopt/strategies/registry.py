"""The registry of strategies: every strategy with one or more example configurations.

Each strategy module registers its examples with :func:`register` when it is imported (``distopt.strategies`` imports
them all). The conformance suite (``tests/strategies/test_strategy_conformance.py``) runs every registered example
through the generic invariants (replicas, state round trip, layout change, join, skipped step, control collectives,
settings mismatch), and the tests that iterate "every strategy" read :data:`REGISTRY`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .base import Strategy

__all__ = ["Example", "REGISTRY", "register", "strategy_error"]


@dataclass(frozen=True)
class Example:
    """One example configuration of a strategy.

    Attributes:
        id: unique short name, e.g. ``"sparse-topk"`` (a test id).
        cls: the strategy class.
        kwargs: its constructor arguments.
        mismatch: other constructor arguments (different :meth:`Strategy.settings`), for checks that ranks disagreeing
            on a setting raise; None for a strategy without settings.
        local_momentum: the momentum factor the example's local optimizer may use (0 for a strategy that keeps the
            momentum itself, DGC).
        requires: modules the example needs (e.g. ``("ml_dtypes",)`` for bfloat16 on NumPy arrays).
        worlds: the world sizes the strategy runs at (None: any); tests at other sizes skip it.
    """

    id: str
    cls: type[Strategy]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    mismatch: Mapping[str, Any] | None = None
    local_momentum: float = 0.9
    requires: tuple[str, ...] = ()
    worlds: tuple[int, ...] | None = None

    def build(self) -> Strategy:
        """A new strategy object of this configuration: ``cls(**kwargs)``."""
        return self.cls(**self.kwargs)

    def build_mismatch(self) -> Strategy:
        """A new strategy object with the :attr:`mismatch` arguments.

        Raises:
            ValueError: the example has no ``mismatch`` (a strategy without settings).
        """
        if self.mismatch is None:
            raise ValueError(f"example {self.id!r}: {self.cls.__name__} has no setting to disagree on")
        return self.cls(**self.mismatch)


REGISTRY: dict[str, Example] = {}
"""Every registered example by :attr:`Example.id`, in registration order."""


def register(*examples: Example) -> None:
    """Add ``examples`` to :data:`REGISTRY`.

    Raises:
        ValueError: an id is registered already.
    """
    for example in examples:
        if example.id in REGISTRY:
            raise ValueError(f"strategy example {example.id!r} is registered already")
        REGISTRY[example.id] = example


_BY_NAME = {"dense": "Dense()", "allreduce": "Dense()", "half": 'Half(wire="float16")', "fp16": 'Half(wire="float16")',
            "float16": 'Half(wire="float16")', "bf16": 'Half(wire="bfloat16")', "bfloat16": 'Half(wire="bfloat16")',
            "topk": 'Sparse(select="topk", density=0.01)', "sparse": 'Sparse(select="topk", density=0.01)',
            "threshold": 'Sparse(select="threshold", density=...)', "partial": "Partial()", "dgc": "DGC()",
            "powersgd": "PowerSGD()", "adasum": "Adasum()"}


def strategy_error(value: Any) -> TypeError:
    """The error for a ``strategy=`` that is not a :class:`~distopt.strategies.base.Strategy`: a name (``"topk"``) is
    answered with the object to pass."""
    if isinstance(value, str):
        hint = _BY_NAME.get(value.lower().replace("-", "").replace("_", ""))
        fix = f"pass distopt.strategies.{hint}" if hint else "pass a strategy object, e.g. distopt.strategies.Dense()"
        return TypeError(f"strategy must be a distopt.strategies.Strategy object, got the string {value!r}: {fix}")
    return TypeError(f"strategy must be a distopt.strategies.Strategy, got {type(value).__name__}")
