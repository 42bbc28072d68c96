"""What the H84/H85 scripts share: this process's rank from any launcher, and a progress file per rank.

Each rank writes its current phase to ``$DISTOPT_TEST_PROGRESS/rank<r>`` (the folder
:func:`tests.support.harness.run_job` and :func:`tests.launch.test_teardown.guarded` read when a job
overruns its guard, to name the stalled rank), and ``done`` at interpreter exit, after distopt's own
at-exit close (the handler is registered before distopt is imported, so it runs after distopt's).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

RANK = int(next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK") if v in os.environ), "0"))
START = time.monotonic()


def mark(state: str) -> None:
    """Record that this rank is now in ``state``, with the seconds since start."""
    folder = os.environ.get("DISTOPT_TEST_PROGRESS")
    if folder:
        Path(folder, f"rank{RANK}").write_text(f"{state} (at {time.monotonic() - START:.1f} s)"
                                               if state != "done" else "done")


def say(line: str) -> None:
    """Write ``line`` and its newline in one ``write`` (atomic on a pipe: ranks sharing a stream never split it)."""
    sys.stdout.flush()
    os.write(1, f"{line}\n".encode())


def report(case: str, variant: str, seconds: float) -> None:
    """Say ``<case> <rank> <variant> <seconds>``, the line the tests look for."""
    say(f"{case} {RANK} {variant} {seconds:.1f}")


atexit.register(mark, "done")
mark("start")
