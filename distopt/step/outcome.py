"""The ranks' agreement on a step: its outcome, and the small collectives that settle it when the step header
(:class:`~distopt.step.engine.Engine`) could not."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..comm.base import Communicator
from ..core._array import any_not_finite
from ..core.buckets import is_float
from ..core.counters import Counters
from ..errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["Outcome", "Pending", "Agreement", "not_finite"]


@dataclass
class Outcome:
    """The ranks' agreement on one step.

    Attributes:
        present: per parameter, True when some rank had a (float) gradient.
        active: ranks that contributed (fewer than the world size while some have joined; 0 when every rank has).
        skipped: ``check_finite`` found a NaN or inf on some rank: every rank skips the update.
    """

    present: list[bool]
    active: int
    skipped: bool

    @property
    def applies(self) -> bool:
        """True when the step updates parameters."""
        return self.active > 0 and not self.skipped


class Pending(Outcome):
    """The header's outcome of a step whose reduction settles which gradients exist (nobody joined; host arrays and no
    ``check_finite``, or a sync that votes at every step: see :mod:`distopt.step.engine`)."""


def not_finite(grads: Sequence[Any]) -> bool:
    """Whether some float gradient of ``grads`` (None entries skipped) holds a NaN or an inf."""
    return any_not_finite(g for g in grads if g is not None and is_float(g))


class Agreement:
    """The small collectives that settle a step, and the error context of every collective in it.

    Args:
        comm: the communicator.
        counters: the step counters (``control_collectives``, ``skipped_steps``, ``steps``).
        check_finite: a NaN or inf on any rank skips the step on every rank.
        divide_by_initial_world_size: while some ranks have joined, divide by the world size (DDP's default); False
            divides by the active ranks.
    """

    def __init__(self, comm: Communicator, counters: Counters, check_finite: bool,
                 divide_by_initial_world_size: bool) -> None:
        self.comm, self.counters, self.check_finite = comm, counters, check_finite
        self.divide_by_initial_world_size = divide_by_initial_world_size

    @contextmanager
    def context(self, where: str | Callable[[], str]) -> Iterator[None]:
        """Prefix a collective error with the step number and ``where`` it happened (a string, or a function building
        it, called only on an error)."""
        try:
            yield
        except (CollectiveTimeoutError, CollectiveMismatchError) as exc:
            if str(exc).startswith("step "):
                raise
            place = where if isinstance(where, str) else where()
            raise type(exc)(f"step {self.counters.steps + 1}, {place}: {exc}") from exc

    def divisor(self, outcome: Outcome) -> int:
        """The number the summed gradients are divided by (>= 1 for an applied step)."""
        return self.comm.size if self.divide_by_initial_world_size else outcome.active

    def on_gradients(self, params: Sequence[Any], grads: Sequence[Any], active: bool,
                     settled: Outcome | None = None, had: Sequence[bool] | None = None) -> Outcome:
        """Per parameter, whether some rank has a gradient; how many ranks are active (not joined); whether any rank saw
        a non-finite gradient (only with ``check_finite``). ``settled``: the outcome the step header already agreed on
        (no collective then); None runs one small all-reduce (``len(params) + 2`` int32 flags). ``had``: per parameter,
        whether this rank has a gradient (None: where ``grads`` is not None; a gradient dropped once packed in its
        bucket is None in ``grads``, and its finiteness is then the sharded step's vote on the reduced segments')."""
        if settled is None:
            return self._flags(params, grads, active, None, had)[0]
        if settled.skipped:
            self.counters.skipped_steps += 1
        return Outcome(list(settled.present), settled.active, settled.skipped)

    def on_reduced(self, params: Sequence[Any], grads: Sequence[Any], active: bool, bad: bool,
                   had: Sequence[bool] | None = None) -> tuple[Outcome, bool]:
        """:meth:`on_gradients` and :meth:`vote` in one all-reduce, after the reduction (``grads``: this rank's own
        gradients, None where it had none; ``bad``: this rank's vote on its reduced values; ``had``: as in
        :meth:`on_gradients`). Returns the outcome and whether some rank's ``bad`` was set (``len(params) + 3`` int32
        flags)."""
        return self._flags(params, grads, active, bad, had)

    def _flags(self, params: Sequence[Any], grads: Sequence[Any], active: bool,
               bad: bool | None, had: Sequence[bool] | None) -> tuple[Outcome, bool]:
        """The flags' all-reduce (sum): gradient present per parameter, active, not finite (with ``check_finite``),
        and, when ``bad`` is given, the vote on the reduced values; counts a skipped step."""
        extra = bad is not None
        flags = np.zeros(len(params) + 2 + extra, dtype=np.int32)
        if had is None:
            had = [g is not None for g in grads]
        for i, (p, h) in enumerate(zip(params, had)):
            flags[i] = h and is_float(p)
        n = len(params)
        flags[n] = int(active)
        if self.check_finite and active:
            flags[n + 1] = not_finite(grads)
        if extra:
            flags[n + 2] = int(bool(bad))
        with self.context("agreement on gradients present" + (" and the reduced gradient finite" if extra else "")):
            self.comm.all_reduce(flags, op="sum")
        self.counters.control_collectives += 1
        self.counters.skipped_steps += bool(flags[n + 1])
        return Outcome([bool(c) for c in flags[:n]], int(flags[n]), bool(flags[n + 1])), bool(extra and flags[n + 2])

    def vote(self, bad: bool) -> bool:
        """Whether some rank's ``bad`` is set: one one-element int32 all-reduce (max), on the reduced gradient."""
        flag = np.array([int(bad)], dtype=np.int32)
        with self.context("agreement on the reduced gradient being finite"):
            self.comm.all_reduce(flag, op="max")
        self.counters.control_collectives += 1
        return bool(flag[0])

    def all_present(self, params: Sequence[Any]) -> Outcome:
        """Every float parameter has a gradient on every rank (no rank joined): the outcome of a step the reduced
        values settled without another collective."""
        return Outcome([is_float(p) for p in params], self.comm.size, False)

    def skip(self, outcome: Outcome) -> None:
        """Mark ``outcome`` skipped after the reduction (counted once)."""
        outcome.skipped = True
        self.counters.skipped_steps += 1
