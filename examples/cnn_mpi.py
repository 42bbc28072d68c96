"""Data-parallel CNN on Fashion-MNIST with PyTorch and distopt, launched by MPI.

SINGA's ``examples/cnn`` DistOpt example on PyTorch: every process builds the
same CNN, wraps its ``torch.optim.SGD`` in :class:`distopt.DistOpt` (which
broadcasts rank 0's initial weights), trains on its own shard of the training
set and averages gradients every step. Run::

    mpiexec -n 2 python examples/cnn_mpi.py                  # 1 epoch
    mpiexec -n 2 python examples/cnn_mpi.py --epochs 10      # SINGA's run
    mpiexec -f hosts -n 4 python examples/cnn_mpi.py         # MPICH hostfile
    mpirun --hostfile hosts -n 4 python examples/cnn_mpi.py  # Open MPI

Only rank 0 prints (see :mod:`common` for the lines), and shows a tqdm bar
when its stderr is a terminal (a plain ``python examples/cnn_mpi.py`` run;
``mpiexec`` pipes it, so no bar). The batch size is per process, so the
global batch is ``world_size * --batch-size``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from common import add_common_args, epoch_summary, print_epoch, say, shards
from fashion_mnist import check_dir, load
from torch import nn
from tqdm import tqdm

import distopt
from distopt.strategies import DGC, PowerSGD, Strategy

EVAL_BATCH = 500
MOMENTUM = 0.9  # SGD's momentum; DGC keeps it in its velocity and the local SGD runs with momentum 0

STRATEGIES: dict[str, Callable[[argparse.Namespace], Strategy]] = {
    "dgc": lambda args: DGC(sparsity=args.dgc_sparsity, momentum=MOMENTUM, clip_norm=args.dgc_clip_norm,
                            warmup_steps=args.dgc_warmup_steps),
    "powerSGD": lambda args: PowerSGD(matrix_rank=args.powersgd_rank, start_step=args.powersgd_start_step,
                                      min_compression_rate=args.powersgd_min_compression_rate),
}
"""Strategy objects DistOpt is built with (``--dist-option`` dgc / powerSGD); their step is ``plain``'s."""

# How one training step synchronises: name -> fn(opt, loss, args). A new
# SINGA-style method (half, partialUpdate, sparseTopK, sparseThreshold, the
# latter two with a --spars flag) is one more entry here; a new strategy
# object (dgc, powerSGD, with their --dgc-* / --powersgd-* flags) one more
# entry in STRATEGIES.
UPDATES: dict[str, Callable[[distopt.DistOpt, torch.Tensor, argparse.Namespace], None]] = {
    "plain": lambda opt, loss, args: opt.backward_and_update(loss, args.threshold),
    "half": lambda opt, loss, args: opt.backward_and_update_half(loss, args.threshold),
    "partialUpdate": lambda opt, loss, args: opt.backward_and_partial_update(loss, args.threshold),
    "sparseTopK": lambda opt, loss, args: opt.backward_and_sparse_update(loss, args.threshold, args.spars, topK=True),
    "sparseThreshold": lambda opt, loss, args: opt.backward_and_sparse_update(loss, args.threshold, args.spars,
                                                                              topK=False),
    **{name: lambda opt, loss, args: opt.backward_and_update(loss, args.threshold) for name in STRATEGIES},
}


class CNN(nn.Module):
    """SINGA's example CNN: two 5x5 conv + max-pool blocks, then 800 -> 500 -> 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(N, num_classes)`` for images of shape ``(N, 1, 28, 28)``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def default_threads(opt: distopt.DistOpt) -> int:
    """CPU cores this process may use divided by the processes on its node (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_node = getattr(opt, "local_size", None) or opt.world_size
    return max(1, cpus // per_node)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, lr=0.005)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: CPU cores // processes on the node)")
    p.add_argument("--dist-option", default="plain", choices=sorted(UPDATES),
                   help="gradient synchronisation strategy (default plain: dense all-reduce)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (MPI backend) or cuda (one GPU per process by local rank, NCCL backend)")
    p.add_argument("--spars", type=float, default=None,
                   help="sparseTopK: fraction of elements sent (default 0.01); "
                        "sparseThreshold: magnitude threshold (default 0.01)")
    p.add_argument("--threshold", type=int, default=None,
                   help="elements: larger parameters are reduced alone (default: the strategy's, 65536 for "
                        "plain/half, 2097152 for sparse); for partialUpdate "
                        "the chunk size (default 10000: this CNN's 431080 parameters make 3 chunks)")
    p.add_argument("--dgc-sparsity", type=float, default=0.999,
                   help="dgc: fraction of the gradient not sent after warm-up (default 0.999)")
    p.add_argument("--dgc-warmup-steps", type=int, default=100,
                   help="dgc: steps per warm-up stage (sparsity 75%%, 93.75%%, 98.4%%, 99.6%%; default 100)")
    p.add_argument("--dgc-clip-norm", type=float, default=None,
                   help="dgc: global gradient-norm bound, clipped locally at bound/sqrt(W) (default: no clipping)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2],
                   help="shard the optimizer (ZeRO stage 1 or 2; plain and half only; default 0: no sharding)")
    p.add_argument("--powersgd-rank", type=int, default=2, help="powerSGD: approximation rank r (default 2)")
    p.add_argument("--powersgd-start-step", type=int, default=100,
                   help="powerSGD: dense steps before compression starts (default 100)")
    p.add_argument("--powersgd-min-compression-rate", type=float, default=2.0,
                   help="powerSGD: compress a tensor only when its factors are this many times smaller (default 2)")
    args = p.parse_args(argv)
    if args.threshold is None:
        args.threshold = 10000 if args.dist_option == "partialUpdate" else None
    if args.spars is None:
        args.spars = 0.01
    return args


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: np.ndarray) -> dict[str, float]:
    """Summed loss, correct count and sample count of ``model`` on samples ``idx`` (this rank's share)."""
    model.eval()
    totals = {"loss": 0.0, "correct": 0.0, "count": float(len(idx))}
    with torch.no_grad():
        for start in range(0, len(idx), EVAL_BATCH):
            b = torch.from_numpy(idx[start:start + EVAL_BATCH])
            out = model(x[b])
            totals["loss"] += F.cross_entropy(out, y[b], reduction="sum").item()
            totals["correct"] += (out.argmax(1) == y[b]).sum().item()
    return totals


def train(args: argparse.Namespace, make_opt: Callable[[torch.optim.Optimizer], Any] = distopt.DistOpt,
          device: str | torch.device = "cpu") -> list[dict[str, float]]:
    """Train the CNN data-parallel and evaluate it after every epoch.

    Args:
        args: the flags of :func:`parse_args`.
        make_opt: builds the DistOpt from the local ``torch.optim.SGD``
            (and ``strategy=`` for ``--dist-option`` dgc / powerSGD);
            ``DistOpt`` itself under ``mpiexec``, e.g.
            ``lambda sgd, **kw: DistOpt(sgd, nccl_id, rank, world_size, **kw)``
            for one process per device started by multiprocessing.
        device: where the model and data live.

    Returns:
        One record per epoch, identical on every rank: ``epoch``,
        ``train_loss``, ``train_acc``, ``eval_loss``, ``eval_acc``, ``time``,
        ``train_time``, ``eval_time`` (seconds), ``wire_bytes_per_step`` and
        ``wire_ratio`` (wire / dense bytes, since the start), and
        ``epoch_wire_ratio`` (wire / dense bytes of this epoch alone).
    """
    train_x, train_y, test_x, test_y = load(args.data_dir)
    torch.manual_seed(args.seed)
    model = CNN().to(device)
    own_momentum = args.dist_option == "dgc"  # DGC's velocity replaces SGD's momentum buffer
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if own_momentum else MOMENTUM,
                          weight_decay=1e-5)
    strategy = STRATEGIES.get(args.dist_option)
    # broadcasts rank 0's parameters
    sharding = {"zero": args.zero} if args.zero else {}
    opt = make_opt(sgd, **sharding) if strategy is None else make_opt(sgd, strategy=strategy(args), **sharding)
    rank, world = opt.global_rank, opt.world_size
    torch.set_num_threads(args.threads or default_threads(opt))
    update = UPDATES[args.dist_option]

    train_x, train_y = torch.from_numpy(train_x).to(device), torch.from_numpy(train_y).to(device)
    test_x, test_y = torch.from_numpy(test_x).to(device), torch.from_numpy(test_y).to(device)
    sampler, steps, eval_idx = shards(args, len(train_x), len(test_x), rank, world)

    history = []
    for epoch in range(args.epochs):
        say(rank, f"Starting Epoch {epoch}:")
        start = time.perf_counter()
        wire_before, dense_before = opt.stats["wire_bytes"], opt.stats["dense_bytes"]
        sampler.set_epoch(epoch)
        model.train()
        totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no host
        correct = torch.zeros((), dtype=torch.int64, device=device)     # synchronisation per step on a GPU
        batches = tqdm(sampler.batches(), total=steps, desc=f"epoch {epoch}", leave=False,
                       disable=True if rank else None)  # None: only on a terminal
        for step, idx in enumerate(batches):
            if step >= steps:
                break
            b = torch.from_numpy(idx).to(device)
            out = model(train_x[b])
            loss = F.cross_entropy(out, train_y[b])
            sgd.zero_grad()
            update(opt, loss, args)
            loss_sum += loss.detach().double() * len(idx)
            correct += (out.argmax(1) == train_y[b]).sum()
            totals["count"] += len(idx)
        batches.close()
        totals.update(loss=float(loss_sum), correct=float(correct))
        if args.dist_option == "partialUpdate":
            opt.average_params()  # replicas drift between chunk averages; evaluate their mean (as SINGA)
        record: dict[str, float] = {"epoch": epoch, **epoch_summary(opt.all_reduce_metrics(totals), "train")}
        record["train_time"] = time.perf_counter() - start
        record.update(epoch_summary(opt.all_reduce_metrics(evaluate(model, test_x, test_y, eval_idx)), "eval"))
        record["time"] = time.perf_counter() - start
        record["eval_time"] = record["time"] - record["train_time"]
        record["wire_bytes_per_step"] = opt.stats["wire_bytes"] / max(opt.stats["steps"], 1)
        record["wire_ratio"] = opt.stats["wire_bytes"] / max(opt.stats["dense_bytes"], 1)
        record["epoch_wire_ratio"] = ((opt.stats["wire_bytes"] - wire_before)
                                      / max(opt.stats["dense_bytes"] - dense_before, 1))
        print_epoch(rank, record)
        history.append(record)
    opt.close()
    return history


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, check the data and train; returns the exit status."""
    args = parse_args(argv)
    check_dir(args.data_dir)  # a clear SystemExit before any MPI start-up
    if args.device == "cuda":  # one GPU per process, gradients over NCCL
        info = distopt.launch.ranks.resolve()
        index = distopt.launch.ranks.device_index(info.local_rank, os.environ, local_size=info.local_size)
        train(args, make_opt=lambda sgd, **kw: distopt.DistOpt(sgd, backend="nccl", **kw), device=f"cuda:{index}")
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
