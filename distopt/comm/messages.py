"""The texts of :class:`~distopt.errors.CollectiveTimeoutError` and :class:`~distopt.errors.CollectiveMismatchError`:
one form each, for every backend.

Every message starts with :func:`where` (backend, collective, its number on the communicator, the rank that raises:
``"mpi all_reduce #12 on rank 0"``), so errors from any backend read alike and name the call.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["STALLED", "UNUSABLE", "where", "timeout_message", "failure_message", "mismatch_message"]

#: Why a collective usually misses its deadline.
STALLED = "a rank that died, is stuck, or ran a different number of steps"
#: What a backend whose state is undefined after a failed collective says of itself.
UNUSABLE = "the communicator is unusable now"


def where(backend: str, call: str, rank: int) -> str:
    """``"<backend> <call> on rank <rank>"``, e.g. ``"shm barrier #2 on rank 0"``."""
    return f"{backend} {call} on rank {rank}"


def timeout_message(place: str, seconds: float, reason: str | None = None, who: str | None = None) -> str:
    """The text of a missed deadline.

    ``"<place> did not complete within <seconds> s (<reason>): timed out after <seconds> s; <who>"``, the parts in
    parentheses and after the colon only when given.

    Args:
        place: :func:`where` of the call.
        seconds: the deadline, in seconds.
        reason: the likely cause and what the backend did or is now (e.g. ``f"{STALLED}; {UNUSABLE}"``).
        who: which ranks did not arrive, when the backend can tell (``"rank 1 did not arrive"``, ``"ranks that did not
            arrive: 1 (at all_reduce #4)"``).
    """
    text = f"{place} did not complete within {seconds:g} s"
    if reason:
        text += f" ({reason})"
    if who:
        text += f": timed out after {seconds:g} s; {who}"
    return text


def failure_message(place: str, cause: str, consequence: str) -> str:
    """The text of a collective that cannot complete before its deadline: ``"<place> failed: <cause>; <consequence>"``,
    e.g. a peer that exited (``cause="rank 1 (pid 42) has exited"``)."""
    return f"{place} failed: {cause}; {consequence}"


def _runs(values: Mapping[int, str]) -> str:
    """``"rank 0: a, ranks 1-3: b"``: each rank's value, consecutive ranks with equal values joined."""
    parts: list[tuple[int, int, str]] = []  # (first rank, last rank, value)
    for r, value in sorted(values.items()):
        if parts and parts[-1][1] == r - 1 and parts[-1][2] == value:
            parts[-1] = (parts[-1][0], r, value)
        else:
            parts.append((r, r, value))
    return ", ".join(f"rank {a}: {v}" if a == b else f"ranks {a}-{b}: {v}" for a, b, v in parts)


def mismatch_message(place: str, field: str, values: Sequence[str] | Mapping[int, str], hint: str | None = None
                     ) -> str:
    """The text of ranks that called different collectives.

    ``"<place>: <field> differs across ranks (rank 0: <value>, ranks 1-3: <value>); <hint>"``.

    Args:
        place: :func:`where` of the call, or another name of it.
        field: what differs: ``"collective"``, ``"element count"``, ``"dtype"``, ``"op"``, ``"root"``, ...
        values: every rank's value in rank order, or ``{rank: value}`` for the ranks whose values are known.
        hint: the likely cause, or None.
    """
    known = values if isinstance(values, Mapping) else dict(enumerate(values))
    text = f"{place}: {field} differs across ranks ({_runs(known)})"
    return f"{text}; {hint}" if hint else text
