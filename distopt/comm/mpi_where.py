"""Who is where: the MPI backend's side channel that names the ranks a stalled collective waits for.

Every rank exposes ``(collective sequence number, kind code)`` (two int64) in a small RMA window, updated before each
control-block exchange. When a collective misses its deadline, the rank reads every peer's pair with a passive one-sided
``Rget`` (itself bounded) and names those that have not reached the collective, and where each one is.
"""
from __future__ import annotations

import struct
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .control import kind_name

__all__ = ["WhereChannel"]

_WHERE = struct.Struct("<2q")  # (collective sequence number, kind), as a rank posts them


class WhereChannel:
    """The side channel of one communicator.

    Args:
        comm: the ``mpi4py.MPI.Comm`` (collective: every rank builds one).
    """

    def __init__(self, comm: Any) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._win = MPI.Win.Allocate(16, disp_unit=8, comm=comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._where = self._win.tomemory()
        _WHERE.pack_into(self._where, 0, 0, -1)

    def post(self, seq: int, kind: int) -> None:
        """Publish that this rank is now in collective number ``seq`` of kind code ``kind``."""
        _WHERE.pack_into(self._where, 0, seq, kind)
        self._win.Sync()

    def missing(self, seq: int, per_rank_s: float = 1.0) -> str:
        """Which peers have not reached collective ``seq`` and where they are (at most ``per_rank_s`` seconds a
        peer)."""
        behind = []
        for r in range(self.size):
            if r == self.rank:
                continue
            got = np.zeros(2, dtype=np.int64)
            request = self._win.Rget([got, MPI.INT64_T], r)
            start = time.monotonic()
            while not request.Test():
                if time.monotonic() - start > per_rank_s:
                    behind.append(f"{r} (unresponsive)")
                    break
            else:
                if got[0] < seq:
                    at = f"{kind_name(got[1])} #{got[0]}" if got[1] >= 0 else "no collective yet"
                    behind.append(f"{r} (at {at})")
        if not behind:
            return "every rank reached it; the collective itself stalled"
        return "ranks that did not arrive: " + ", ".join(behind)

    def free(self) -> None:
        """Free the window (collective)."""
        self._win.Unlock_all()
        self._win.Free()
