"""What tests do to the stand-in that CuPy has no API for: queue a slow "kernel", read the counters."""
from __future__ import annotations

import time
from typing import Any, Callable

from ._state import config, counters
from .cuda import streams

__all__ = ["launch", "config", "counters"]


def launch(fn: Callable[[], None] | None = None, stream: Any = None, seconds: float = 0.0) -> None:
    """Queue ``fn`` on ``stream`` (the current one by default) as a kernel that has not run yet: it runs
    when the stream's work is ordered (see :mod:`cupy.cuda.streams`), and is not done for ``seconds``."""
    stream = streams.get_current_stream() if stream is None else stream
    stream._q.put(streams._Kernel(fn, time.monotonic() + seconds if seconds else 0.0))
