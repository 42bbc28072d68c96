"""How an MPI communicator closes without a rank ever waiting alone in a collective free.

``MPI_Win_free`` is collective: a rank that enters it while a peer never will (the peer gave up
waiting, or closes another communicator first) waits forever. :func:`vote` is one bounded round of
the agreement that comes first (see :meth:`distopt.comm.mpi.MPICommunicator.close`); a window a
failed vote did not free is handed to :func:`free_at_exit`, which frees every such window at
interpreter exit, after every communicator's close and right before ``MPI_Finalize`` (MPICH's
waits for every rank anyway), in creation order.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .lifecycle import last_at_exit
from .wait import Backoff, wait_until

__all__ = ["vote", "next_serial", "free_at_exit"]

_BACKOFF = Backoff(busy_s=0.02, yield_s=0.02, min_sleep_s=1e-5, max_sleep_s=2e-4)
_serials = itertools.count()  # this process's communicators in creation order (collective: the same order on every member)
_unfreed: list[tuple[int, Any]] = []  # (serial, side channel) of the windows failed votes left


class _Expired(Exception):
    pass


def vote(control: Any, mine: int, timeout: float) -> bool:
    """One round: the MIN of every rank's ``mine`` (0 or 1) over ``control``, the close-only communicator.

    Returns:
        True when the round completed within ``timeout`` seconds and every rank voted 1; False
        otherwise (the request is left in flight: the caller then takes part in no later round).
    """
    ballot = np.array([mine], dtype=np.int32)
    request = control.Iallreduce(MPI.IN_PLACE, [ballot, MPI.INT32_T], MPI.MIN)
    try:
        wait_until(request.Test, time.monotonic() + timeout, _Expired, backoff=_BACKOFF)
    except _Expired:
        return False
    return bool(ballot[0])


def next_serial() -> int:
    """The creation number of a new communicator in this process (orders :func:`free_at_exit`)."""
    return next(_serials)


def free_at_exit(serial: int, channel: Any) -> None:
    """Free ``channel``'s window (:class:`~distopt.comm.mpi_where.WhereChannel`) at interpreter exit.

    Every member hands over the same windows (no rank frees unless every rank's vote completed),
    and they are freed in creation order, so no rank is ever alone in ``MPI_Win_free``; it waits
    for the last member to reach exit, as ``MPI_Finalize`` would.
    """
    _unfreed.append((serial, channel))
    last_at_exit(_free_all)


def _free_all() -> None:
    _unfreed.sort(key=lambda entry: entry[0])
    while _unfreed:
        _unfreed.pop(0)[1].free()
