"""What a PyTorch follower knows about the current step and backward pass, grouped by lifetime (after torch's
``_OverlapInfo``/``_OverlapStatus``; ``docs/design.md``, "A PyTorch step's record").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Phase", "StepRecord", "BackwardRecord"]


class Phase(Enum):
    """Where the step's gradients stand."""

    IDLE = "idle"
    """Nothing reduced since the last step (gradients may be the user's own)."""
    ACCUMULATED = "accumulated"
    """A backward accumulated into ``.grad`` without averaging (``no_sync``, ``backward_passes_per_step``):
    the next synchronizing backward, ``synchronize()`` or ``step()`` averages the sum."""
    REDUCED = "reduced"
    """``.grad`` holds this step's average (or, with a closure, the closure makes the gradients)."""
    SKIPPED = "skipped"
    """The ranks agreed to skip this step (``check_finite``): ``.grad`` is NaN (see :mod:`distopt.torch.not_finite`),
    None after ``step()``."""


@dataclass
class StepRecord:
    """One optimizer step of a follower, from its first backward to the end of ``step()``.

    Attributes:
        phase: where the gradients stand.
        strategy: the strategy of this step's backward (None: the held one).
        threshold: its fusion threshold in ELEMENTS (None: the strategy's default).
        pipeline: the bucket pipeline of the backward in flight (overlap), or None.
    """

    phase: Phase = Phase.IDLE
    strategy: Any = None
    threshold: int | None = None
    pipeline: Any = None

    def clear(self) -> None:
        """After ``step()``: a new step begins; an accumulation not yet averaged (``skip_synchronize``) stays."""
        self.phase = Phase.ACCUMULATED if self.phase is Phase.ACCUMULATED else Phase.IDLE
        self.strategy = self.threshold = None


@dataclass
class BackwardRecord:
    """The backward pass being followed.

    Attributes:
        task: its autograd graph task (None between passes, or while its enclosing task is not known yet).
        nested: graph tasks run from inside it (reentrant activation checkpointing).
        await_outer: it began inside a nested task; the enclosing one has not shown a hook yet.
        syncing: it averages the gradients at its end (else it accumulates).
    """

    task: int | None = None
    nested: set[int] = field(default_factory=set)
    await_outer: bool = False
    syncing: bool = False
