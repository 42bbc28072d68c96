"""How the launchers end: SIGTERM and SIGINT in the launching process, and the words for a child's exit.

Both launchers install :func:`end_on_signals` while their workers run (why: :mod:`~distopt.launch.launcher`) and
report a child's exit status with :func:`describe_exit`.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Any

__all__ = ["describe_exit", "end_on_signals"]


def describe_exit(code: int | None) -> str:
    """``"exited with code 3"``, ``"was killed by signal SIGKILL"``, or ``"is still running"`` (None)."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_143(*_: Any) -> None:
    sys.exit(128 + signal.SIGTERM)


def end_on_signals() -> dict[int, Any]:
    """In the main thread, make SIGTERM a ``SystemExit(143)`` and SIGINT a KeyboardInterrupt (so cleanup runs),
    whatever the inherited disposition (a background shell job starts with SIGINT ignored).

    Returns:
        The previous handlers Python can put back; empty outside the main thread (no handler is set there).
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _exit_143),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    return {sig: handler for sig, handler in previous.items() if handler is not None}
