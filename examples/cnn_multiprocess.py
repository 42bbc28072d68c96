"""The CNN of ``cnn_mpi.py``, one process per device started by the script itself.

SINGA's ``doc_dist_multiprocess.py`` launch mode: the script creates the
job's ticket (:class:`distopt.NcclIdHolder`) and starts ``gpu_per_node``
processes with :func:`distopt.launch.spawn`; each calls
``train_mnist_cnn(nccl_id, gpu_num, gpu_per_node)`` and builds
``DistOpt(sgd, nccl_id=nccl_id, gpu_num=gpu_num, gpu_per_node=gpu_per_node)``.
On CPUs the processes all-reduce through shared memory; on GPUs with CuPy
and NCCL, through NCCL when there is a GPU per process, else through
shared memory with the GPUs shared. Run::

    python examples/cnn_multiprocess.py 2                 # 2 processes, 1 epoch
    python examples/cnn_multiprocess.py 2 --epochs 10

If one process fails, the others are stopped and the error names its rank.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from cnn_mpi import parse_args, train
from fashion_mnist import check_dir

import distopt
from distopt.launch import spawn


def train_mnist_cnn(nccl_id: Any, gpu_num: int, gpu_per_node: int, args: argparse.Namespace) -> None:
    """One worker: rank ``gpu_num`` of ``gpu_per_node`` on this node, on GPU ``gpu_num`` where PyTorch sees
    CUDA (with fewer GPUs than processes, the processes share them and DistOpt averages over shared memory
    instead of NCCL), else on the CPU."""
    import torch

    device = f"cuda:{gpu_num % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    train(args, make_opt=lambda sgd, **kw: distopt.DistOpt(sgd, nccl_id=nccl_id, gpu_num=gpu_num,
                                                           gpu_per_node=gpu_per_node, **kw), device=device)


def main(argv: list[str] | None = None) -> int:
    """``cnn_multiprocess.py NPROCS [cnn_mpi.py flags]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].isdigit():
        print("usage: python examples/cnn_multiprocess.py NPROCS [--epochs N ...]", file=sys.stderr)
        return 2
    nprocs, args = int(argv[0]), parse_args(argv[1:])
    check_dir(args.data_dir)
    spawn(train_mnist_cnn, nprocs, args=(args,))
    return 0


if __name__ == "__main__":
    sys.exit(main())
