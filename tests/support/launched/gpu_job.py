"""A small job on CuPy arrays (the stand-in's or a real GPU's), launched two ways: ``spawn`` (the
multiprocessing mode, two DistOpts from one ticket) and ``mpi`` (``mpiexec``, ``backend="nccl"``, the NCCL
id broadcast over MPI). Each rank prints ``rank R backend B result X`` per DistOpt; the step averages
``rank + 1`` over the ranks, so X is ``-(W + 1) / 2``."""
from __future__ import annotations

import sys
from typing import Any

import distopt


def say(line: str) -> None:
    """One write per line: two processes' lines never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def step(opt: Any, rank: int) -> float:
    import cupy

    p = cupy.zeros(4, dtype=cupy.float32)
    opt.step([p], [cupy.full(4, rank + 1.0, dtype=cupy.float32)])
    return float(p.get()[0])


def worker(holder: Any, gpu_num: int, gpu_per_node: int) -> None:
    import cupy

    cupy.cuda.Device(gpu_num % cupy.cuda.runtime.getDeviceCount()).use()
    for _ in range(2):  # one ticket, two communicators
        opt = distopt.DistOpt(distopt.SGD(lr=1.0), nccl_id=holder, gpu_num=gpu_num, gpu_per_node=gpu_per_node)
        say(f"rank {gpu_num} backend {opt.comm.name} result {step(opt, gpu_num)}")
        opt.close()


def main(mode: str) -> None:
    if mode == "spawn":
        distopt.launch.spawn(worker, 2)
        return
    opt = distopt.DistOpt(distopt.SGD(lr=1.0), backend="nccl")
    say(f"rank {opt.global_rank} backend {opt.comm.name} result {step(opt, opt.global_rank)}")
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1])
