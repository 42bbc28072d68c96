"""One rank SIGKILLs itself mid-training under mpiexec.

Usage: mpiexec -n N python tests/support/faults/sigkill_rank.py [--steps 20] [--kill-at 5]
       [--kill-rank 1] [--timeout S] [--tag T]

Every rank runs ``--steps`` dense ``DistOpt.step`` calls on a small model;
rank ``--kill-rank`` sends itself SIGKILL at the start of step ``--kill-at``
(1-based), so it can neither print a traceback nor call MPI_Abort. The
survivors block in that step's all-reduce until MPICH's launcher kills them
or their collective deadline (``--timeout``) ends them with a
CollectiveTimeoutError; either way the job must end.
"""
import argparse
import os
import signal

import numpy as np

from distopt import SGD, DistOpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--kill-at", type=int, default=5)
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--timeout", type=float, default=3.0)
parser.add_argument("--tag", default="")
args = parser.parse_args()

opt = DistOpt(SGD(lr=0.1), timeout=args.timeout)
rank = opt.rank_in_global
params = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]
for step in range(1, args.steps + 1):
    if rank == args.kill_rank and step == args.kill_at:
        print(f"rank {rank}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    opt.step(params, [np.full(p.shape, rank + 1.0, np.float32) for p in params])
print(f"rank {rank}: finished {args.steps} steps (unexpected)", flush=True)
