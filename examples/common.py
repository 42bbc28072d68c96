"""Pieces shared by the training examples: flags and the per-epoch report.

Every example prints, on rank 0 only, the lines of SINGA's DistOpt examples::

    Starting Epoch 0:
    Training loss = 0.612345, training accuracy = 0.776543
    Evaluation accuracy = 0.823400
    Epoch time = 21.4 s (training 20.1 s, evaluation 1.3 s)

Training loss is the mean cross-entropy per sample; accuracies are summed
``correct / count`` over all ranks (never a mean of per-rank ratios).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping

from fashion_mnist import add_data_args

__all__ = ["add_common_args", "shards", "epoch_summary", "say", "print_epoch"]


def add_common_args(parser: argparse.ArgumentParser, *, lr: float) -> None:
    """Add the flags every example takes: epochs, batch size, lr, caps, seed, data dir."""
    parser.add_argument("--epochs", type=int, default=1,
                        help="training epochs (default 1; SINGA's examples ran 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step per process (default 64)")
    parser.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="cap on training steps per epoch, for smoke runs (default: the whole shard)")
    parser.add_argument("--eval-limit", type=int, default=None,
                        help="evaluate on the first N test samples only, for smoke runs (default: all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and of the shuffling (same on every rank)")
    add_data_args(parser)


def shards(args: argparse.Namespace, n_train: int, n_test: int, rank: int, world: int) -> tuple[Any, int, Any]:
    """This rank's per-epoch training sampler, its step count (capped by ``--max-steps``) and its
    evaluation indices (the first ``--eval-limit`` test samples, split without duplicates)."""
    import distopt

    sampler = distopt.DistributedSampler(n_train, args.batch_size, rank, world, seed=args.seed)
    steps = sampler.num_batches() if args.max_steps is None else min(sampler.num_batches(), args.max_steps)
    n_eval = n_test if args.eval_limit is None else min(n_test, args.eval_limit)
    return sampler, steps, distopt.eval_partition_indices(n_eval, rank, world)


def epoch_summary(totals: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``{"<prefix>_loss": mean loss, "<prefix>_acc": accuracy}`` from summed ``loss``, ``correct``, ``count``."""
    count = max(totals["count"], 1.0)
    return {f"{prefix}_loss": totals["loss"] / count, f"{prefix}_acc": totals["correct"] / count}


def say(rank: int, line: str) -> None:
    """Print ``line`` on rank 0 only, flushed.

    One ``write`` per line: with unbuffered output (``PYTHONUNBUFFERED``),
    ``print`` writes the text and the newline separately, and MPICH's
    ``mpiexec -l`` then labels the bare newline too (``[0] text[0] ``).
    """
    if rank == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def print_epoch(rank: int, record: Mapping[str, Any]) -> None:
    """Print one epoch's report lines (rank 0 only); see the module docstring."""
    say(rank, f"Training loss = {record['train_loss']:f}, training accuracy = {record['train_acc']:f}")
    say(rank, f"Evaluation accuracy = {record['eval_acc']:f}")
    say(rank, f"Epoch time = {record['time']:.1f} s (training {record['train_time']:.1f} s, "
              f"evaluation {record['eval_time']:.1f} s)")
    if "wire_ratio" in record:
        say(rank, f"Wire bytes per step = {record['wire_bytes_per_step']:.0f} "
                  f"({record['wire_ratio']:.4f} of dense)")
