"""The one bounded wait every backend uses, and the one timeout rule.

A backend polls a completion test (``MPI.Request.Test``, ``Work.is_completed``,
a shared-memory counter, a CUDA event) with :func:`wait_until`: first without
sleeping (a collective progresses only while the host polls, for MPI), then
yielding the core, then sleeping with exponential backoff, never past the
deadline. :func:`resolve_timeout` turns a ``timeout=`` argument or
``$DISTOPT_TIMEOUT`` into that deadline, validated the same way for every
backend.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "resolve_timeout", "wait_until", "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "default_timeout"]

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
        ValueError: ``timeout`` (or the variable) is not a positive, finite
            number; the message names which one.
    """
    return default_timeout() if timeout is None else _positive(timeout, "timeout")


@dataclass(frozen=True)
class Backoff:
    """How :func:`wait_until` polls, in seconds since the wait began.

    Attributes:
        busy_s: poll without giving up the core until then.
        yield_s: then poll with ``os.sched_yield()`` until then.
        min_sleep_s: then sleep, starting with this many seconds ...
        max_sleep_s: ... doubling up to this.
    """

    busy_s: float = 0.02
    yield_s: float = 0.02
    min_sleep_s: float = 1e-5
    max_sleep_s: float = 2e-4


def wait_until(done: Callable[[], bool], deadline: float, on_timeout: Callable[[], BaseException], *,
               backoff: Backoff = Backoff(), check: Callable[[], None] | None = None,
               check_every_s: float = 0.5) -> None:
    """Poll ``done()`` until it is true, or raise ``on_timeout()`` after ``deadline``.

    Args:
        done: the completion test; called repeatedly, must not block.
        deadline: ``time.monotonic()`` value after which the wait fails.
        on_timeout: builds the exception raised at the deadline (e.g. a
            :class:`~distopt.errors.CollectiveTimeoutError` naming the ranks
            that did not arrive).
        backoff: the polling schedule.
        check: called every ``check_every_s`` seconds while waiting; it may
            raise to end the wait early (e.g. a peer process has exited).
        check_every_s: period of ``check`` in seconds.

    Raises:
        BaseException: what ``on_timeout()`` returns, at the deadline; what
            ``check`` raises, as soon as it does.
    """
    if done():
        return
    start = time.monotonic()
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
        if elapsed < backoff.busy_s:
            continue
        if elapsed < backoff.yield_s:
            os.sched_yield()
            continue
        time.sleep(delay)
        delay = min(2 * delay, backoff.max_sleep_s)
