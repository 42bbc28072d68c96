"""How MPI communicators close without a rank ever waiting alone in a collective free.

``MPI_Win_free`` is collective: a rank that enters it while a peer never will waits forever. So every communicator over
the same ranks of ``MPI_COMM_WORLD`` (in the same order) shares one :class:`CloseChannel`, a close-only communicator,
and each ``close()`` runs one *round* on it:

1. *offer*: an all-gather of the identities (creation numbers within the group) of the communicators this rank has
   closed and not yet freed;
2. *confirm*: a MIN all-reduce of 1 from a rank that saw every offer in time, else 0.

When every rank confirmed, every rank frees, in creation order, the communicators that every rank offered; the rest stay
offered for the next round. Identities, not the order of the calls, match closes across ranks (A, B on one rank and B, A
on another are both freed by the second round). Each wait of a round is bounded by ``timeout`` seconds; a rank confirms
1 only when the offers arrived at least ``margin`` seconds (a tenth of ``timeout``, at most 0.5) before its own
deadline, so a peer waiting for the confirmation (its deadline set later) sees it in time: no rank frees while another
gives up. What no round freed (a communicator whose collectives failed is never offered) is freed at interpreter exit,
right before ``MPI_Finalize``, in creation order (:func:`free_at_exit`).
"""
from __future__ import annotations

import itertools
from collections import namedtuple
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from .lifecycle import last_at_exit
from .wait import Backoff, wait_until

__all__ = ["CloseChannel", "channel_for", "next_serial", "free_at_exit", "OFFER_SLOTS"]

_BACKOFF = Backoff(busy_s=0.02, yield_s=0.02, min_sleep_s=1e-5, max_sleep_s=2e-4)
#: The most closed communicators one rank offers in a round (the oldest first); others wait for a later round.
OFFER_SLOTS = 31
# this process's communicators in creation order (collective: the same order on every member)
_serials = itertools.count()
_unfreed: list[tuple[int, Any]] = []  # (serial, side channel) of the windows left for the exit
_channels: dict[tuple[int, ...], CloseChannel] = {}  # by group: the world ranks of its members, in rank order


class _Expired(Exception):
    pass


def _completed(request: Any, deadline: float) -> bool:
    """Poll ``request`` until it completes (True) or ``deadline`` (``time.monotonic()``) passes (False)."""
    try:
        wait_until(request.Test, deadline, _Expired, backoff=_BACKOFF)
    except _Expired:
        return False
    return True


# a closed communicator waiting for its collective free: its exit order, side channel and release
_Closed = namedtuple("_Closed", "serial where release")


class CloseChannel:
    """The close-only communicator of one group of ranks, and the communicators closed over it.

    Args:
        comm: an ``mpi4py.MPI.Comm`` over the group (collective: duplicated).
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm.Dup()
        self.size = self._comm.Get_size()
        self._ids = itertools.count()
        self._closed: dict[int, _Closed] = {}  # identity -> closed, not yet freed
        self._in_flight: list[tuple[Any, ...]] = []  # requests (and their buffers) of rounds a rank gave up on
        last_at_exit(_free_all)

    def new_id(self) -> int:
        """The identity of a new communicator over the group (collective: its creation number in the group)."""
        return next(self._ids)

    def close(self, ident: int, serial: int, where: Any, release: Callable[[], None] | None, timeout: float) -> bool:
        """Close communicator ``ident`` (``serial``: its exit order; ``where``: its side channel) and run one round.

        Args:
            release: frees the communicator (collective); None when its collectives failed (never offered: its window is
                freed at exit).
            timeout: SECONDS each wait of the round may take.

        Returns:
            True when ``ident`` was freed in this round; False when it waits for a later round (or the exit).
        """
        if release is None:
            free_at_exit(serial, where)
        else:
            self._closed[ident] = _Closed(serial, where, release)
        self._in_flight = [entry for entry in self._in_flight if not all(r.Test() for r in entry[::2])]
        margin = min(0.5, timeout / 10)
        start = time.monotonic()
        offered = sorted(self._closed)[:OFFER_SLOTS]
        offer = np.zeros(OFFER_SLOTS + 1, dtype=np.int64)
        offer[0], offer[1:1 + len(offered)] = len(offered), offered
        table = np.empty((self.size, OFFER_SLOTS + 1), dtype=np.int64)
        gathered = self._comm.Iallgather([offer, MPI.INT64_T], [table, MPI.INT64_T])
        on_time = _completed(gathered, start + timeout) and time.monotonic() <= start + timeout - margin
        seen = time.monotonic()
        confirm = np.array([int(on_time)], dtype=np.int32)
        confirmed = self._comm.Iallreduce(MPI.IN_PLACE, [confirm, MPI.INT32_T], MPI.MIN)
        if not on_time or not _completed(confirmed, seen + timeout) or not confirm[0]:
            self._in_flight.append((gathered, (offer, table), confirmed, confirm))
            return False
        agreed = set(offered)
        for row in table:
            agreed.intersection_update(row[1:1 + row[0]].tolist())
        for done in sorted(agreed):  # the same set, in the same order, on every rank
            self._closed.pop(done).release()
        return ident in agreed

    def leftovers(self) -> list[_Closed]:
        """The closed communicators no round freed (for the exit), and forget them."""
        left, self._closed = list(self._closed.values()), {}
        return left


def channel_for(comm: Any) -> tuple[CloseChannel, int]:
    """The close channel of ``comm``'s group (made by its first communicator: collective), and ``comm``'s identity."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        key = tuple(int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()
    channel = _channels.get(key)
    if channel is None:
        channel = _channels[key] = CloseChannel(comm)
    return channel, channel.new_id()


def next_serial() -> int:
    """The creation number of a new communicator in this process (orders :func:`free_at_exit`)."""
    return next(_serials)


def free_at_exit(serial: int, where: Any) -> None:
    """Free ``where``'s window (:class:`~distopt.comm.mpi_where.WhereChannel`) at interpreter exit.

    Every member hands over the same windows (no rank frees one in a close unless every rank does), freed in creation
    order, so no rank is ever alone in ``MPI_Win_free``; it waits for the last member to reach exit.
    """
    _unfreed.append((serial, where))
    last_at_exit(_free_all)


def _free_all() -> None:
    for channel in _channels.values():
        _unfreed.extend((closed.serial, closed.where) for closed in channel.leftovers())
    _unfreed.sort(key=lambda entry: entry[0])
    while _unfreed:
        _unfreed.pop(0)[1].free()
