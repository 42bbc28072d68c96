"""``DistOpt.backward_passes_per_step`` and Horovod's ``set_backward_passes_per_step``: changing the number of
micro-batches accumulated per update after construction.

Array models accumulate in a :class:`~distopt.step.accumulate.GradientAccumulator` of the step runner (none for 1);
PyTorch models count backward passes in their :class:`~distopt.torch.follower.Follower`. The setter is collective: the
ranks agree on the new value first (:func:`~distopt.comm.consensus.agree`, one small all-gather), so a bad value or a
held accumulation on one rank, or values that differ, raise the same exception on every rank and change nothing.
"""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from .comm.consensus import agree
from .step.accumulate import GradientAccumulator

if TYPE_CHECKING:
    from .comm.base import Communicator
    from .step.runner import StepRunner
    from .torch.follower import Follower

__all__ = ["AccumulationMethods"]


class AccumulationMethods:
    """The accumulation setting of :class:`~distopt.DistOpt` (a mixin over its step runner and follower)."""

    comm: Communicator
    follower: Follower | None
    _runner: StepRunner

    @property
    def backward_passes_per_step(self) -> int:
        """Micro-batches (backward passes) accumulated locally per averaged update (Horovod's name); 1: none."""
        if self.follower is not None:
            return int(self.follower.k)
        accumulator = self._runner.accumulator
        return 1 if accumulator is None else int(accumulator.k)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per update from now on (Horovod's ``DistributedOptimizer`` method; the
        constructor's ``backward_passes_per_step``). Collective: call it on every rank with the same value, between
        updates (no partial accumulation held).

        Args:
            passes: an int >= 1 (1: every backward pass averages).

        Raises:
            TypeError: on every rank, naming the rank, ``passes`` is not an int (bool included).
            ValueError: on every rank, naming the rank, ``passes < 1``.
            RuntimeError: on every rank, naming the rank, it holds a partial accumulation (array models: call
                ``flush()`` or ``discard_accumulation()`` first; PyTorch: finish the update, ``synchronize()`` and
                ``step()``).
            CollectiveMismatchError: on every rank, the ranks asked for different values.
        """
        problem = None
        try:
            _check(passes, self._held())
        except (TypeError, ValueError, RuntimeError) as exc:
            problem = exc
        value = int(passes) if problem is None else None
        agree(self.comm, {"call": "set_backward_passes_per_step", "passes": value},
              call="set_backward_passes_per_step", problem=problem, kinds=(ValueError, TypeError, RuntimeError),
              shown={"passes": repr(passes)})
        if self.follower is not None:
            self.follower.k = value
        else:
            self._runner.accumulator = None if value == 1 else GradientAccumulator(int(value))

    def _held(self) -> int:
        """Backward passes accumulated and not averaged yet."""
        if self.follower is not None:
            return int(self.follower.passes)
        accumulator = self._runner.accumulator
        return 0 if accumulator is None else int(accumulator.count)


def _check(passes: Any, held: int) -> None:
    """This rank's own validation (TypeError / ValueError / RuntimeError)."""
    if isinstance(passes, bool) or not isinstance(passes, numbers.Integral):
        raise TypeError(f"passes must be an int >= 1 (backward passes per update), got {type(passes).__name__} "
                        f"{passes!r}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1 (backward passes per update), got {passes}")
    if held:
        raise RuntimeError(f"{held} backward pass(es) are accumulated and not averaged yet: change passes between "
                           "updates (array models: flush() or discard_accumulation() first; PyTorch: "
                           "synchronize() and step() first)")
