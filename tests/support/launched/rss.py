"""The resident set of this process and its peak growth while a function runs, for the launched memory scripts."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """BYTES resident now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_growth(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The resident set's peak during ``fn()`` (sampled every millisecond by a thread) minus its size before, in
    BYTES, and what ``fn`` returned."""
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    kept = fn()
    peak[0] = max(peak[0], rss())
    done.set()
    t.join()
    return peak[0] - base, kept
