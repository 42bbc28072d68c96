"""Train, checkpoint with ``distopt.save``, resume in a NEW mpiexec job with ``distopt.load``.

Usage: mpiexec -n 2 python tests/support/faults/resume_job.py --case h18|mlp
       [--strategy dense|half|sparse] --phase full|first|second --ckpt PATH --out DIR
   or: mpiexec -n 2 python tests/support/faults/resume_job.py --many FILE

``--many FILE`` runs every argument list of the JSON list in FILE, one after
the other in this job (each with its own DistOpt, optimizer and files): the
tests run all their cases' ``full`` phases in one job, then all ``first``
phases, then all ``second`` phases in a third, so every resume still loads in a
job that did not save.

Phases: ``full`` trains every step in one job; ``first`` trains the first
part and saves to ``--ckpt``; ``second`` builds a fresh DistOpt and local
optimizer, loads ``--ckpt`` and trains the rest. Each rank writes
``DIR/rank<R>.npz`` (its final parameters ``p0, p1, ...``) and
``DIR/rank<R>.json`` (``stats``; the sampler ``epoch`` at the end and
``loaded_epoch`` right after ``load``; what ``save`` returned).

Cases:

* ``h18`` (shared case H18, W=2): H17's setup extended to 3 steps: n=3,
  top-K ``spars=1/n``, ``corr=True``, plain SGD lr=1 from zeros; step 1 rank 0
  g=[4,0,1], rank 1 g=[0,2,1]; steps 2 and 3 zero gradients. ``first`` runs
  step 1, ``second`` steps 2-3. Uninterrupted result: [-2,-1,-1]. ``--n 100``
  zero-pads it (k=1 of 100: the selection really travels sparsely; at n=3
  it moves densely, being no larger).
* ``mlp``: the tanh MLP of :mod:`tests.support.models` in float32, SGD lr=0.05,
  momentum 0.9, weight decay 1e-3, rank-dependent initial parameters
  (broadcast from rank 0), batches drawn by a shuffling
  ``DistributedSampler`` assigned to ``opt.sampler`` (16 samples, batch 4 per
  rank: 2 steps per epoch at W=2); sparse is top-K ``spars=0.1`` with error
  feedback (7 of 66 entries, moved sparsely); ``--epochs`` epochs in all, ``first``
  runs ``--split`` of them, sets the sampler to the next epoch and saves.
"""
import argparse
import json
import os
import sys

import numpy as np

import distopt
from distopt import SGD, DistOpt
from tests.support import models

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["h18", "mlp"], required=True)
parser.add_argument("--strategy", choices=["dense", "half", "sparse"], default="dense")
parser.add_argument("--phase", choices=["full", "first", "second"], required=True)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--split", type=int, default=2)
parser.add_argument("--n", type=int, default=3, help="h18: parameter length (zero-padded past 3)")
args = argparse.Namespace()
wrote = None
loaded_epoch = None  # the sampler epoch right after distopt.load


def h18() -> tuple[DistOpt, list[np.ndarray]]:
    global wrote
    opt = DistOpt(SGD(lr=1.0))
    if opt.world_size != 2:
        raise SystemExit("case h18 is stated for W=2")
    first_grad = np.zeros(args.n, np.float32)
    first_grad[:3] = [4, 0, 1] if opt.rank_in_global == 0 else [0, 2, 1]
    grads = [first_grad, np.zeros(args.n, np.float32), np.zeros(args.n, np.float32)]
    if args.phase == "second":
        params = distopt.load(args.ckpt, opt)
        steps = [1, 2]
    else:
        params = [np.zeros(args.n, np.float32)]
        steps = [0] if args.phase == "first" else [0, 1, 2]
    for t in steps:
        opt.step_sparse(params, [grads[t].copy()], spars=1 / args.n, topK=True, corr=True)
    if args.phase == "first":
        wrote = distopt.save(args.ckpt, params, opt)
    return opt, params


def mlp() -> tuple[DistOpt, list[np.ndarray]]:
    global wrote, loaded_epoch
    opt = DistOpt(SGD(lr=0.05, momentum=0.9, weight_decay=1e-3))
    rank, size = opt.rank_in_global, opt.world_size
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = rng.normal(size=(16, 3)).astype(np.float32)
    opt.sampler = distopt.DistributedSampler(16, 4, rank, size, shuffle=True, seed=11)
    if args.phase == "second":
        params = distopt.load(args.ckpt, opt)
        loaded_epoch = opt.sampler.epoch
        first, last = loaded_epoch, args.epochs
    else:
        params = [p.astype(np.float32) for p in models.mlp_params(seed=rank)]
        opt.sync_params(params)
        first, last = 0, args.split if args.phase == "first" else args.epochs
    for epoch in range(first, last):
        opt.sampler.set_epoch(epoch)
        for idx in opt.sampler.batches():
            grads = [g.astype(np.float32) for g in models.mlp_grads(params, x[idx], y[idx])]
            if args.strategy == "dense":
                opt.step(params, grads)
            elif args.strategy == "half":
                opt.step_half(params, grads)
            else:
                opt.step_sparse(params, grads, spars=0.1, topK=True, corr=True)
    if args.phase == "first":
        opt.sampler.set_epoch(last)  # the epoch to run next
        wrote = distopt.save(args.ckpt, params, opt)
    return opt, params


def run(argv: list[str]) -> None:
    """One case and phase; writes ``--out``'s files."""
    global args, wrote, loaded_epoch
    args, wrote, loaded_epoch = parser.parse_args(argv), None, None
    opt, params = h18() if args.case == "h18" else mlp()
    rank = opt.rank_in_global
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), *params)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        stats = {k: v for k, v in opt.stats.items() if k != "wait_seconds"}  # seconds waited differ run to run
        json.dump({"stats": stats, "wrote": wrote, "loaded_epoch": loaded_epoch,
                   "epoch": None if opt.sampler is None else opt.sampler.epoch}, f)
    opt.close()


if sys.argv[1:2] == ["--many"]:
    with open(sys.argv[2]) as f:
        for case_argv in json.load(f):
            run(case_argv)
else:
    run(sys.argv[1:])
