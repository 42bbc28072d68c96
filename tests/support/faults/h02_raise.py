"""H02 under mpiexec: rank 1 raises ValueError("boom") at top level; the others step.

Usage: mpiexec -n 3 python tests/support/faults/h02_raise.py [--no-abort] [--timeout S] [--tag T]

All ranks build ``DistOpt(SGD(lr=1))``; rank 1 then raises, uncaught; the
other ranks call ``opt.step`` (a gradient all-reduce, preceded by the
parameter check). With the default ``abort_on_exception=True`` rank 1's
traceback is printed and the whole job is aborted. With ``--no-abort`` the
survivors wait until their collective deadline (``--timeout``) and end with
an uncaught CollectiveTimeoutError. ``--tag`` is ignored: it makes the
command line unique so the test can look for leftover processes.
"""
import argparse

import numpy as np

from distopt import SGD, DistOpt

parser = argparse.ArgumentParser()
parser.add_argument("--no-abort", action="store_true", help="DistOpt(abort_on_exception=False)")
parser.add_argument("--timeout", type=float, default=3.0, help="collective deadline (s)")
parser.add_argument("--tag", default="")
args = parser.parse_args()

opt = DistOpt(SGD(lr=1.0), timeout=args.timeout, abort_on_exception=not args.no_abort)
rank = opt.rank_in_global
print(f"rank {rank}: DistOpt ready", flush=True)
if rank == 1:
    raise ValueError("boom")
p = np.zeros(4, np.float32)
opt.step([p], [np.ones(4, np.float32)])
print(f"rank {rank}: step returned (unexpected)", flush=True)
