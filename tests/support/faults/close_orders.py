"""Three DistOpts closed in a different order on every rank, under mpiexec (any number of ranks).

Usage: mpiexec -n N python tests/support/faults/close_orders.py --timeout S

Rank r closes the three DistOpts (``timeout=S``, one step each) rotated by r, in reverse on odd
ranks (with three ranks: A B C, C B A, C A B), right after the ranks meet on a fourth DistOpt of
timeout 120. Prints ``ORDERS <rank> <seconds the three closes took>``, then ends without closing
the fourth (its close runs at exit).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teardown_progress import RANK, mark, report  # noqa: E402  (before distopt: its at-exit mark runs last)

import numpy as np  # noqa: E402

from distopt import SGD, DistOpt  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
timeout = parser.parse_args().timeout

mark("building")
sync = DistOpt(SGD(lr=1.0), timeout=120, abort_on_exception=False)


def build() -> DistOpt:
    opt = DistOpt(SGD(lr=1.0), timeout=timeout, abort_on_exception=False)
    w = np.zeros(4, np.float32)
    opt.step([w], [np.ones(4, np.float32)])
    return opt


opts = [build() for _ in range(3)]
order = [opts[(i + RANK) % 3] for i in range(3)]
if RANK % 2:
    order.reverse()
sync.all_reduce(np.zeros(1, np.float32))
mark("closing")
start = time.monotonic()
for opt in order:
    opt.close()
report("ORDERS", "closed", time.monotonic() - start)
