"""One rank skips a collective under mpiexec: rank 1 runs one step fewer than the others.

Usage: mpiexec -n N python tests/support/faults/skip_collective.py --then agree|idle
       [--steps 5] [--timeout S]

Every rank but 1 runs ``--steps`` dense steps, rank 1 runs ``--steps - 1``.
Then

* ``agree``: every rank calls ``opt.agree(True)``. Rank 1's vote (a 1-element
  all-reduce) meets the others' last step (its gradient-flag all-reduce), so
  the ranks disagree on the element count: CollectiveMismatchError on every
  rank.
* ``idle``: rank 1 calls nothing more from distopt (it sleeps one second past the
  collective deadline): the others time out in their last step.

Each rank prints one line ``RESULT rank R: <ExceptionName>: <message>`` (or
``RESULT rank R: ok``) and exits 3 after an error, 0 otherwise.
"""
import argparse
import sys
import time

import numpy as np

from distopt import SGD, DistOpt, DistOptError

parser = argparse.ArgumentParser()
parser.add_argument("--then", choices=["agree", "idle"], required=True)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--timeout", type=float, default=3.0)
args = parser.parse_args()

opt = DistOpt(SGD(lr=0.1), timeout=args.timeout)
rank = opt.rank_in_global
my_steps = args.steps - 1 if rank == 1 else args.steps
p = np.zeros(6, np.float32)
error = None
try:
    for _ in range(my_steps):
        opt.step([p], [np.ones(6, np.float32)])
    if args.then == "agree" or rank != 1:
        opt.agree(True)
    else:
        time.sleep(args.timeout + 1)
except DistOptError as exc:
    error = exc
line = "ok" if error is None else f"{type(error).__name__}: {error}"
print(f"RESULT rank {rank}: {line}", flush=True)
sys.exit(0 if error is None else 3)
