"""End the whole MPI job when one rank raises (instead of leaving the others blocked).

When an uncaught exception reaches the top of a rank, the traceback is printed as usual and then ``MPI_Abort`` ends
every process of the job (ChainerMN #236 / PR 250, mpi4py #290). ``python -m mpi4py script.py`` does the same for any
script.

The abort waits ``DRAIN_SECONDS`` after flushing: the launcher forwards each rank's output through its own proxy, and
an abort that arrives first kills the proxy with the end of the traceback still unread (seen under load with MPICH's
Hydra: the ``raise`` line and the message were lost).
"""
from __future__ import annotations

import sys
import time
from types import TracebackType

__all__ = ["install_abort_on_exception"]

_installed = False
DRAIN_SECONDS = 0.5  # time given to the launcher to forward the traceback


def install_abort_on_exception() -> None:
    """Make an uncaught exception abort the MPI job (idempotent)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        sys.stderr.write(f"distopt: uncaught {kind.__name__}; aborting the MPI job (all ranks)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(DRAIN_SECONDS)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _installed = True
