"""Children that die with their parent (Linux ``PR_SET_PDEATHSIG``), for the launchers.

When the launching process ends by any means, SIGKILL included, the kernel sends each child SIGTERM (the fix of
PyTorch #14394, PR 14491). Elsewhere the children poll their parent's pid instead.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent(parent: int) -> None:
    """Have this process get SIGTERM when process ``parent`` (its parent) ends (without ``prctl``: polled every 1 s).

    Call it first thing in the child. If the parent is already gone, the signal is sent at once.

    Args:
        parent: the pid of the parent, read before the child started.
    """
    if not _prctl_pdeathsig(signal.SIGTERM):
        threading.Thread(target=_poll_parent, args=(parent,), name="distopt-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
