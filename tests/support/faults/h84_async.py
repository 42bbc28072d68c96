"""H84 under mpiexec or torchrun: faults around async handles.

Usage: <launcher> -n 2 python tests/support/faults/h84_async.py late|raise

``late`` runs two variants in one job. Each builds ``DistOpt(timeout=5)`` and does one warm-up
async all_reduce; ranks meet on a DistOpt of timeout 120 between them:

* ``late``: rank 1 sleeps 8 s, then starts the same async all_reduce; both wait (each wait must
  raise a timeout naming the other rank, printed as ``H84 <rank> late-raised <message>``), then
  ``opt.close()`` (printed as ``H84 <rank> late-closed <seconds>``);
* ``close``: both start an async all_reduce; rank 0 calls ``close()`` with its handle in flight
  (``H84 0 close-closed <seconds>``), rank 1 exits without waiting or closing.

``raise``: rank 1 raises ValueError (uncaught) while rank 0 waits for its async all_reduce.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teardown_progress import RANK, mark, report, say  # noqa: E402  (before distopt: its at-exit mark runs last)

import numpy as np  # noqa: E402

from distopt import SGD, DistOpt  # noqa: E402
from distopt.errors import CollectiveTimeoutError  # noqa: E402

mode = sys.argv[1]
mark("building")
sync = DistOpt(SGD(lr=1.0), timeout=120, abort_on_exception=False)


def build() -> DistOpt:
    opt = DistOpt(SGD(lr=1.0), timeout=5, abort_on_exception=False)
    opt.all_reduce(np.ones(4, np.float32), async_op=True).wait()  # the warm-up
    return opt


if mode == "raise":
    opt = DistOpt(SGD(lr=1.0), timeout=5)  # abort_on_exception as a script leaves it (the default)
    opt.all_reduce(np.ones(4, np.float32), async_op=True).wait()
    mark("raise")
    if RANK == 1:
        raise ValueError("boom")
    opt.all_reduce(np.ones(4, np.float32), async_op=True).wait()
    sys.exit("rank 0: the wait returned (unexpected)")

late, closing = build(), build()
mark("late")
if RANK == 1:
    time.sleep(8)
try:
    late.all_reduce(np.ones(4, np.float32), async_op=True).wait()
    say(f"H84 {RANK} late-returned -")
except CollectiveTimeoutError as exc:
    say(f"H84 {RANK} late-raised {str(exc).splitlines()[0]}")
start = time.monotonic()
late.close()
report("H84", "late-closed", time.monotonic() - start)

sync.all_reduce(np.zeros(1, np.float32))
mark("close")
handle = closing.all_reduce(np.ones(4, np.float32), async_op=True)
if RANK == 0:
    start = time.monotonic()
    closing.close()
    report("H84", "close-closed", time.monotonic() - start)
