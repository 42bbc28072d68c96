"""H85 under any launcher: tear-down with ranks arriving at different times, every variant in one job.

Usage: <launcher> -n 2 python tests/support/faults/h85_teardown.py

Five ``DistOpt(timeout=5)`` are built (one step each; the fourth also does one async all_reduce),
then, between variants, the ranks meet on a sixth DistOpt of timeout 120 (so the delays of one
variant do not spill into the next):

* ``slowclose``: rank 0 sleeps 8 s, then ``close()``; rank 1 closes at once;
* ``asyncclose``: the same after one async all_reduce;
* ``order``: two DistOpts closed A, B on rank 0 and B, A on rank 1, no delay;
* ``slowexit``: rank 0 sleeps 8 s, then the script ends without any ``close()`` (the at-exit close).

Prints ``H85 <rank> <variant> <seconds the close took>`` after each variant (``slowexit``: before the
exit), and records its phase for the guard (:mod:`tests.support.faults.teardown_progress`).
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teardown_progress import RANK, mark, report  # noqa: E402  (before distopt: its at-exit mark runs last)

import numpy as np  # noqa: E402

from distopt import SGD, DistOpt  # noqa: E402

mark("building")
sync = DistOpt(SGD(lr=1.0), timeout=120, abort_on_exception=False)  # built first: on torch it owns the default group


def build() -> DistOpt:
    opt = DistOpt(SGD(lr=1.0), timeout=5, abort_on_exception=False)
    w = np.zeros(4, np.float32)
    opt.step([w], [np.ones(4, np.float32)])
    return opt


slow, asyn, first, second, left = (build() for _ in range(5))
asyn.all_reduce(np.ones(8, np.float32), async_op=True).wait()


def together() -> None:
    sync.all_reduce(np.zeros(1, np.float32))


for variant, closing in (("slowclose", [slow]), ("asyncclose", [asyn]),
                         ("order", [first, second] if RANK == 0 else [second, first])):
    together()
    mark(variant)
    if RANK == 0 and variant != "order":
        time.sleep(8)
    start = time.monotonic()
    for opt in closing:
        opt.close()
    report("H85", variant, time.monotonic() - start)

together()
mark("slowexit")
if RANK == 0:
    time.sleep(8)
report("H85", "slowexit", 0.0)
