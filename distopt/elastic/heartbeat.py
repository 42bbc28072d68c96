"""A heartbeat between the workers of a torchrun elastic job: a peer that goes silent is seen in seconds.

A worker that dies is seen by its peers at once (gloo reports the closed
connection), but a peer that vanishes without closing its connections (a cut
cable, a frozen machine) would be seen only at DistOpt's collective timeout, and
torch's agent does not watch its peers once a round is closed. So, while
:func:`distopt.elastic.run` runs, a daemon thread of every worker adds 1 to its
rank's counter in the job's ``TCPStore`` (``MASTER_ADDR:MASTER_PORT``, hosted by
rank 0) every second and reads the peers' counters.

**The rule** (:class:`PeerWatch`): a peer whose counter has not moved for
``lost_after`` seconds, measured between this worker's own successful reads of
the store, is lost; so is the store itself when no read succeeded for
``lost_after`` seconds (the lost node is the one hosting it). Time during which
this worker itself did not run (its checker woke up more than ``lost_after / 2``
late) does not count. A peer is judged from its first beat, or, if it has not
beaten yet, from :meth:`Heartbeat.arm` (``run`` arms it after the restore's first
collective, which every rank reaches after starting its heartbeat). A rank that
is merely slow keeps beating: the counter is posted by a thread of its own,
which runs while the training thread computes in torch ops or waits in a
collective (both release the GIL), and while it runs Python code (the
interpreter switches threads every 5 ms). Its limit: one call that holds the
GIL for ``lost_after`` seconds without releasing it (a long C function that
does not release it) starves the heartbeat thread, and that rank is declared
lost.

On a loss the worker calls ``on_lost`` (by default: one line to stderr, then
``os._exit(1)``: its main thread may be blocked in a collective that would
never return), so that torchrun's agent re-forms the world from the nodes
alive. The heartbeat is torchrun's only: under ``python -m distopt.launch
--min-np/--max-np`` the shared-memory world has no store; there the launcher
sees a dead copy at once, and a copy that stops without exiting is not watched.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

from ..errors import DistOptError

__all__ = ["BEAT_S", "DEFAULT_LOST_AFTER_S", "Heartbeat", "PeerLostError", "PeerWatch", "check_lost_after"]

BEAT_S = 1.0
"""Seconds between two beats (and two reads of the peers' counters)."""
DEFAULT_LOST_AFTER_S = 6.0
"""Seconds of silence after which a peer is lost (``run(lost_after=...)``)."""
_KEY = "distopt-heartbeat/"


class PeerLostError(DistOptError):
    """A peer (or the store that carries the heartbeat) was silent for ``lost_after`` seconds; never raised
    across threads, it names the loss in the line :func:`distopt.elastic.run` writes before the worker exits."""


class Store(Protocol):
    """What the heartbeat needs of a ``torch.distributed.Store``: ``add`` (``add(key, 0)`` reads)."""

    def add(self, key: str, value: int) -> int: ...


def check_lost_after(lost_after: float | None) -> float | None:
    """``lost_after`` validated: None (no heartbeat) or a finite number of seconds of at least ``2 * BEAT_S``.

    Raises:
        ValueError: anything else (too short a bound would declare a peer lost between two of its beats).
    """
    if lost_after is None:
        return None
    if isinstance(lost_after, bool) or not isinstance(lost_after, (int, float)) \
            or not 2 * BEAT_S <= float(lost_after) < float("inf"):
        raise ValueError(f"distopt.elastic.run: lost_after must be None (no heartbeat) or a finite number of "
                         f"seconds >= {2 * BEAT_S:g} (two beats), got {lost_after!r}")
    return float(lost_after)


class PeerWatch:
    """The detection rule, without threads or store (a unit test drives it with its own clock).

    Args:
        peers: the ranks watched (every rank but this one).
        lost_after: seconds without a move of a peer's counter (or without a successful read of the store)
            after which it is lost.
        now: the clock's time at the start (seconds).
        armed: judge from ``now`` the peers not seen yet; False: judge a peer only from its first beat until
            :meth:`arm` (a peer may still be starting: the heartbeat is armed once every rank is known to
            beat).
    """

    def __init__(self, peers: list[int], lost_after: float, now: float, armed: bool = True) -> None:
        self.lost_after = lost_after
        self._peers = list(peers)
        self._seen: dict[int, int | None] = {p: None for p in peers}
        self._moved: dict[int, float] = {p: now for p in peers} if armed else {}  # when a counter last moved
        self._read = now  # the last successful read of the store
        self._tick = now  # the checker's last look
        self._resumed = now  # the end of this worker's last stall

    def arm(self, now: float) -> None:
        """From ``now`` on, a peer not seen yet is judged as one that beat at ``now``."""
        for peer in self._peers:
            self._moved.setdefault(peer, now)

    def observe(self, counters: Mapping[int, int], now: float) -> None:
        """A successful read at ``now`` of the peers' counters (rank -> value; 0: a counter never posted)."""
        for peer, value in counters.items():
            if value and value != self._seen.get(peer):
                self._seen[peer] = value
                self._moved[peer] = now
        self._read = now

    def lost(self, now: float) -> tuple[dict[int, float], float | None]:
        """The verdict at ``now``: the peers silent for ``lost_after`` s or more (rank -> seconds, measured
        up to the last successful read), and the seconds since the last read of the store when that is
        ``lost_after`` or more (else None). A look more than ``lost_after / 2`` after the previous one means
        this worker itself was not running: the store's clock restarts there, and nothing is lost on it."""
        stalled = now - self._tick > self.lost_after / 2
        self._tick = now
        if stalled:
            self._resumed = now
            return {}, None
        silent = {p: self._read - t for p, t in self._moved.items() if self._read - t >= self.lost_after}
        unread = now - max(self._read, self._resumed)
        return silent, (unread if unread >= self.lost_after else None)


def _default_on_lost(reason: str) -> None:
    sys.stderr.write(f"distopt.elastic: {reason}; exiting\n")
    sys.stderr.flush()
    os._exit(1)


class Heartbeat:
    """The heartbeat of one worker: :meth:`start` it before the training function, :meth:`stop` it after.

    Args:
        rank: this worker's rank.
        world_size: the world's size.
        lost_after: see :class:`PeerWatch` (seconds).
        connect: returns the store (called in the heartbeat's own thread, so that a store that does not
            answer never blocks the caller).
        on_lost: called once, in the checker thread, with a sentence naming the loss (the silent ranks and
            for how long, or the store); it must end the process (the default writes the sentence to stderr
            and calls ``os._exit(1)``).
        clock: the clock (seconds; ``time.monotonic``).
    """

    def __init__(self, rank: int, world_size: int, lost_after: float, connect: Callable[[], Store],
                 on_lost: Callable[[str], None] = _default_on_lost,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.world_size, self.lost_after = rank, world_size, lost_after
        self._connect, self._on_lost, self._clock = connect, on_lost, clock
        self._peers = [r for r in range(world_size) if r != rank]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.watch = PeerWatch(self._peers, lost_after, clock(), armed=False)

    def start(self) -> "Heartbeat":
        """Start the beating thread and the checking thread (daemons: they never keep the process alive).
        A peer is judged from its first beat on, or from :meth:`arm` if it has not beaten by then."""
        for target, name in ((self._beat, "distopt-heartbeat"), (self._check, "distopt-heartbeat-check")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def arm(self) -> None:
        """Every peer has started its heartbeat (call it after a collective that follows every rank's
        :meth:`start`): from now on a peer never seen is lost after ``lost_after`` seconds too."""
        self.watch.arm(self._clock())

    def stop(self) -> None:
        """Stop checking at once (a beating thread stuck in a store call is left to die with the process)."""
        self._stop.set()
        if self._threads:
            self._threads[1].join(timeout=2 * BEAT_S)  # the checker (the beater may be stuck in the store)

    def _beat(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                store.add(f"{_KEY}{self.rank}", 1)
                counters = {p: store.add(f"{_KEY}{p}", 0) for p in self._peers}
                if not self._stop.is_set():
                    self.watch.observe(counters, self._clock())
            except Exception:  # the store is gone or does not answer: PeerWatch counts the time
                store = None
            self._stop.wait(BEAT_S)

    def _check(self) -> None:
        while not self._stop.wait(BEAT_S / 4):
            silent, unread = self.watch.lost(self._clock())
            if self._stop.is_set() or not (silent or unread is not None):
                continue
            if silent:
                ranks = ", ".join(str(p) for p in sorted(silent))
                reason = (f"no heartbeat from rank{'s' if len(silent) > 1 else ''} {ranks} for "
                          f"{max(silent.values()):.1f} s (lost_after={self.lost_after:g} s)")
            else:
                reason = (f"the heartbeat store (rank 0's TCPStore) did not answer for {unread:.1f} s "
                          f"(lost_after={self.lost_after:g} s)")
            self._on_lost(reason)
            return


def torchrun_heartbeat(rank: int, world_size: int, lost_after: float | None, env: Mapping[str, str],
                       on_lost: Callable[[str], None]) -> Heartbeat | None:
    """The heartbeat of a torchrun worker, on its own client of the job's ``TCPStore``
    (``MASTER_ADDR:MASTER_PORT``); None when there is nothing to watch (``lost_after`` None, a world of one)
    or no such store (not torchrun: ``python -m distopt.launch``'s shared-memory world has none)."""
    if lost_after is None or world_size < 2 or "TORCHELASTIC_RUN_ID" not in env \
            or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])

    def connect() -> Any:
        from torch.distributed import TCPStore

        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=lost_after),
                        wait_for_workers=False)

    return Heartbeat(rank, world_size, lost_after, connect, on_lost)
