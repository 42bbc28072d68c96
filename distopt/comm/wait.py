"""The one bounded wait every backend uses, and the one timeout rule.

A backend polls a completion test (``MPI.Request.Test``, a shared-memory counter, a CUDA event) with :func:`wait_until`,
never past the deadline (:class:`Backoff`): it spins only as long as recent waits took (:func:`spin_budget`), so a wait
that ends while spinning costs no system call and a peer late in its own compute costs no more spinning than the usual
wait; then it polls with ``os.sched_yield()`` between tests (the collective still progresses at every test, as MPI moves
data only inside MPI calls, but a rank or thread that needs this core gets it at once); then it sleeps, with exponential
backoff. The torch backend waits in ``Work.wait`` itself instead (gloo's threads move the data). :func:`resolve_timeout`
turns a ``timeout=`` argument or ``$DISTOPT_TIMEOUT`` into that deadline, validated the same way for every backend.
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "resolve_timeout", "wait_until", "spin_budget", "DEFAULT_TIMEOUT", "TIMEOUT_ENV",
           "default_timeout", "MIN_SPIN_S", "RECENT"]

#: Default deadline of one collective, in seconds.
DEFAULT_TIMEOUT = 300.0

#: The environment variable that sets the collective deadline, in seconds.
TIMEOUT_ENV = "DISTOPT_TIMEOUT"


def _positive(value: object, name: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds


def default_timeout() -> float:
    """Collective deadline in seconds: ``$DISTOPT_TIMEOUT`` if set, else 300.

    Raises:
        ValueError: the variable is set but is not a positive, finite number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT if raw is None else _positive(raw, TIMEOUT_ENV)


def resolve_timeout(timeout: float | None) -> float:
    """The deadline a backend uses: ``timeout`` if given, else :func:`default_timeout`.

    Args:
        timeout: seconds, or None for ``$DISTOPT_TIMEOUT`` / 300.

    Returns:
        The deadline in seconds (> 0).

    Raises:
        ValueError: ``timeout`` (or the variable) is not a positive, finite number; the message names which one.
    """
    return default_timeout() if timeout is None else _positive(timeout, "timeout")


#: SECONDS a wait spins at least (before yielding), however short recent waits were.
MIN_SPIN_S = 5e-5

#: Waits whose durations set the spin budget (the median: a wait stretched by a busy machine does not).
RECENT = 8

#: The last :data:`RECENT` wait durations in SECONDS, per backoff schedule (a backend's waits share one).
_recent: dict[Backoff, deque[float]] = {}


@dataclass(frozen=True)
class Backoff:
    """How :func:`wait_until` polls, in seconds since the wait began.

    Attributes:
        busy_s: spin (poll without giving up the core) at most this long: :func:`spin_budget`, adapted to recent waits.
        yield_s: then poll with ``os.sched_yield()`` until then (or until ``busy_s``, if later).
        min_sleep_s: then sleep, starting with this many seconds ...
        max_sleep_s: ... doubling up to this.
    """

    busy_s: float = 2e-4
    yield_s: float = 0.02
    min_sleep_s: float = 1e-5
    max_sleep_s: float = 2e-4


def spin_budget(backoff: Backoff) -> float:
    """SECONDS the next wait with ``backoff`` spins before it yields: twice the median of its last :data:`RECENT` waits,
    at least :data:`MIN_SPIN_S`, at most ``backoff.busy_s`` (all of it before any wait)."""
    recent = _recent.get(backoff)
    if not recent:
        return backoff.busy_s
    return min(backoff.busy_s, max(MIN_SPIN_S, 2 * sorted(recent)[len(recent) // 2]))


def wait_until(done: Callable[[], bool], deadline: float, on_timeout: Callable[[], BaseException], *,
               backoff: Backoff = Backoff(), check: Callable[[], None] | None = None,
               check_every_s: float = 0.5) -> None:
    """Poll ``done()`` until it is true, or raise ``on_timeout()`` after ``deadline``.

    Args:
        done: the completion test; called repeatedly, must not block.
        deadline: ``time.monotonic()`` value after which the wait fails.
        on_timeout: builds the exception raised at the deadline (a :class:`~distopt.errors.CollectiveTimeoutError`).
        backoff: the polling schedule (see the module docs); the wait's duration joins its recent ones.
        check: called every ``check_every_s`` seconds while waiting; it may raise to end the wait early (a peer exited).
        check_every_s: period of ``check`` in seconds.

    Raises:
        BaseException: what ``on_timeout()`` returns, at the deadline; what ``check`` raises, as soon as it does.
    """
    if done():
        return
    start = time.monotonic()
    spin = spin_budget(backoff)
    polite = max(backoff.busy_s, backoff.yield_s)
    check_at = start + check_every_s
    delay = backoff.min_sleep_s
    while not done():
        now = time.monotonic()
        if check is not None and now >= check_at:
            check()
            check_at = now + check_every_s
        if now >= deadline:
            raise on_timeout()
        elapsed = now - start
        if elapsed < spin:
            continue
        if elapsed < polite:
            os.sched_yield()
            continue
        time.sleep(delay)
        delay = min(2 * delay, backoff.max_sleep_s)
    _recent.setdefault(backoff, deque(maxlen=RECENT)).append(time.monotonic() - start)
