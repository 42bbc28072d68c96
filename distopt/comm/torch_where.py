"""Who is where: the torch backend's record, in the process group's c10d store, of where its ranks wait.

A CPU wait still incomplete after :func:`post_after` seconds writes ``"<wait number> waiting <call>"`` under this rank's
key in the group's store (``distopt/where/<rank>``), and a wait that times out or fails writes ``failed``; a wait that
completes sooner writes nothing, so a collective that does not stall costs no store traffic. When a wait misses its
deadline or fails, the rank reads every peer's key: a peer whose last recorded wait is older than this one (or that
recorded none), even one that arrived less than :func:`post_after` seconds before the deadline, is named as not arrived;
one that recorded ``failed`` for it gave up. Every rank makes the same waits in the same order, so the wait numbers
match.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["StoreWhere", "post_after"]

_PREFIX = "distopt/where/"


def post_after(timeout: float) -> float:
    """SECONDS a CPU wait runs before it records itself in the store: a tenth of ``timeout``, at most 0.25."""
    return min(0.25, timeout / 10)


class StoreWhere:
    """The record of one communicator's waits, in its process group's store.

    Args:
        group: the process group (None: the default group).
        rank: this rank in ``group``.
        size: the size of ``group``.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        # the group's own store (torch keeps one per group: a prefix store over the job's store, so
        # keys of different groups never collide); torch has no public accessor for it
        self._store = c10d._get_process_group_store(group if group is not None else c10d._get_default_group())
        self._error: str | None = None

    def post(self, number: int, what: str, state: str = "waiting") -> None:
        """Record that this rank is in its wait number ``number``, of the call ``what``: ``state`` ``"waiting"``, or
        ``"failed"`` once the wait timed out or failed here.

        A store that cannot be written (its host exited) is remembered for :meth:`missing`'s answer.
        """
        try:
            self._store.set(f"{_PREFIX}{self.rank}", f"{number} {state} {what}")
        except (RuntimeError, dist.DistStoreError) as exc:
            self._error = str(exc).splitlines()[0]

    def missing(self, number: int) -> str:
        """Which peers have not reached this rank's wait number ``number`` or, when every peer did, which gave up on it.

        Returns:
            ``"ranks that did not arrive: 1 (last seen waiting in barrier #3), 2"``;
            ``"rank 0 gave up (all_reduce #4 failed there)"`` (several joined by ``"; "``); ``"every rank reached it;
            the collective itself stalled"``; or, when the store cannot be read, why.
        """
        behind, gone = [], []
        try:
            for r in range(self.size):
                if r == self.rank:
                    continue
                key = f"{_PREFIX}{r}"
                if not self._store.check([key]):
                    behind.append(str(r))
                    continue
                seen, state, call = self._store.get(key).decode().split(" ", 2)
                if int(seen) < number:
                    behind.append(f"{r} (last seen waiting in {call})")
                elif state == "failed":
                    gone.append(f"rank {r} gave up ({call} failed there)")
        except (RuntimeError, dist.DistStoreError) as exc:
            return f"the process group's store could not tell which ranks arrived ({str(exc).splitlines()[0]})"
        parts = ["ranks that did not arrive: " + ", ".join(behind)] if behind else gone
        if self._error is not None and not parts:
            return f"this rank could not record its wait in the process group's store ({self._error})"
        return "; ".join(parts) or "every rank reached it; the collective itself stalled"
