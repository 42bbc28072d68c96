"""``zero=3``'s check frame: one all-gather shape for the step header and the parameter gathers' checks.

At ``zero=3`` a rank may reach a parameter gather (a module's forward or backward, ``summon_full_params``) while
another reaches the step header (its backward ended, or ``step()``), having run a module the other did not. Both
exchange the same frame (every rank's :data:`WORDS` int64 words, the first saying which of the two it is), so the two
collectives pair on every backend and each rank raises :class:`~distopt.errors.CollectiveMismatchError` at once,
naming every rank's module and phase.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import CollectiveMismatchError

__all__ = ["WORDS", "STARTING", "ANNOUNCING", "HEADER", "PHASES", "exchange", "rows", "describe", "mismatch"]

#: int64 words of one rank's frame: its kind, then 8 words of payload.
WORDS = 9
#: Kind (the first word) of a gather about to start.
STARTING = 0
#: Kind of a gather announced for the next call (started there).
ANNOUNCING = 1
#: Kind of the step header.
HEADER = 2
#: A gather's phase (its payload's first word).
PHASES = ("forward", "backward", "summon_full_params/state_dict")
_KINDS = ("starting", "announcing")


def exchange(launch: Any, size: int, rank: int, kind: int, payload: Sequence[int]) -> Any:
    """Start gathering this rank's frame (``kind`` and up to 8 ``payload`` words) from every rank; the handle's
    ``wait()`` completes it, leaving the ``(size * WORDS,)`` int64 array in rank order.

    Args:
        launch: the step's :class:`~distopt.comm.launcher.Launcher` (its in-place all-gather).
        size: the world size.
        rank: this rank.
        kind: :data:`STARTING`, :data:`ANNOUNCING` or :data:`HEADER`.
        payload: at most ``WORDS - 1`` integers.
    """
    words = np.zeros(size * WORDS, dtype=np.int64)
    words[rank * WORDS:rank * WORDS + 1 + len(payload)] = (kind, *payload)
    return launch.gather(words, [WORDS] * size)


def rows(gathered: Any, size: int) -> Any:
    """The completed frame as a ``(size, WORDS)`` int64 array."""
    return np.asarray(gathered).reshape(size, WORDS)


def describe(row: Sequence[int], names: Mapping[int, str]) -> str:
    """What one rank's frame says it was doing: the step header, or a gather's phase, module (``names``: module
    position -> name), kind and buckets."""
    if int(row[0]) == HEADER:
        return "the step's parameter check (its backward ended, or step())"
    return (f"{PHASES[int(row[1])]} of module {names.get(int(row[2]), 'none')!r}, {_KINDS[int(row[0])]} "
            f"{int(row[3])} bucket(s) from {int(row[4])}")


def mismatch(everyone: Any, names: Callable[[], Mapping[int, str]]) -> CollectiveMismatchError:
    """The error for frames that differ: every rank's :func:`describe` (``names()``: module position -> name, asked
    only when the frames differ)."""
    named = names()
    seen = "; ".join(f"rank {r}: {describe(row, named)}" for r, row in enumerate(everyone))
    return CollectiveMismatchError(f"zero=3: the ranks gather different parameters ({seen}): a module's forward "
                                   "or backward ran on some ranks only; every rank must run the same modules in "
                                   "the same order")
