"""Data-parallel MLP on Fashion-MNIST with NumPy only (no deep-learning framework).

A one-hidden-layer perceptron (784 -> 128 ReLU -> 10, softmax cross-entropy)
with hand-written float32 gradients, trained by :class:`distopt.SGD` through
:class:`distopt.DistOpt`: ``opt.sync_params(params)`` once (rank 0's weights
everywhere), then ``opt.step(params, grads)`` each batch (gradients averaged
across ranks, then the local SGD update). Run::

    mpiexec -n 2 python examples/mlp_numpy.py
    mpiexec -n 2 python examples/mlp_numpy.py --epochs 5

Same flags (minus ``--threads``), data split and printed lines as
``cnn_mpi.py``; only rank 0 prints. NumPy's BLAS runs one thread per process
unless ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS``
is set: the matrices are small, and one BLAS thread pool per process on
shared cores is many times slower (oversubscription).
"""
from __future__ import annotations

import os

if __name__ == "__main__" and not any(
        v in os.environ for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
    os.environ["OMP_NUM_THREADS"] = "1"  # before NumPy is imported: BLAS reads it at load time

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402
from common import add_common_args, epoch_summary, print_epoch, say, shards  # noqa: E402
from fashion_mnist import check_dir, load  # noqa: E402
from tqdm import tqdm  # noqa: E402

import distopt  # noqa: E402

HIDDEN = 128
EVAL_BATCH = 1000

# How one training step synchronises: name -> fn(opt, params, grads, args);
# a new DistOpt strategy is one more entry here.
UPDATES: dict[str, Callable[[distopt.DistOpt, list[np.ndarray], list[np.ndarray], argparse.Namespace], None]] = {
    "plain": lambda opt, params, grads, args: opt.step(params, grads),
}


def init_params(rng: np.random.Generator, n_in: int = 784, hidden: int = HIDDEN,
                n_out: int = 10) -> list[np.ndarray]:
    """``[W1, b1, W2, b2]`` float32: He-normal weights, zero biases."""
    w1 = rng.standard_normal((n_in, hidden)) * np.sqrt(2.0 / n_in)
    w2 = rng.standard_normal((hidden, n_out)) * np.sqrt(2.0 / hidden)
    return [a.astype(np.float32) for a in (w1, np.zeros(hidden), w2, np.zeros(n_out))]


def forward(params: Sequence[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(logits, hidden pre-activation, hidden activation)`` for ``x`` of shape ``(N, 784)``."""
    w1, b1, w2, b2 = params
    z1 = x @ w1 + b1
    h = np.maximum(z1, 0)
    return h @ w2 + b2, z1, h


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample losses and softmax probabilities (max-shifted, stable)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(y)), y], np.exp(log_p)


def loss_and_grads(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
                   ) -> tuple[float, np.ndarray, list[np.ndarray]]:
    """Mean cross-entropy over the batch, the logits, and the gradients of ``[W1, b1, W2, b2]``."""
    w1, b1, w2, b2 = params
    logits, z1, h = forward(params, x)
    losses, p = cross_entropy(logits, y)
    d_logits = p
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= len(y)
    d_h = (d_logits @ w2.T) * (z1 > 0)
    grads = [x.T @ d_h, d_h.sum(axis=0), h.T @ d_logits, d_logits.sum(axis=0)]
    return float(losses.mean()), logits, [g.astype(np.float32, copy=False) for g in grads]


def evaluate(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> dict[str, float]:
    """Summed loss, correct count and sample count on samples ``idx`` (this rank's share)."""
    totals = {"loss": 0.0, "correct": 0.0, "count": float(len(idx))}
    for start in range(0, len(idx), EVAL_BATCH):
        b = idx[start:start + EVAL_BATCH]
        logits = forward(params, x[b])[0]
        totals["loss"] += float(cross_entropy(logits, y[b])[0].sum())
        totals["correct"] += float((logits.argmax(1) == y[b]).sum())
    return totals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, lr=0.05)
    p.add_argument("--dist-option", default="plain", choices=sorted(UPDATES),
                   help="gradient synchronisation strategy (default plain: dense all-reduce)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, opt: distopt.DistOpt | None = None) -> list[dict[str, float]]:
    """Train the MLP data-parallel and evaluate it after every epoch.

    Args:
        args: the flags of :func:`parse_args`.
        opt: a DistOpt around :class:`distopt.SGD`; by default
            ``DistOpt(SGD(args.lr, momentum=0.9, weight_decay=1e-5))``, closed
            at the end (a given one is left open).

    Returns:
        One record per epoch, identical on every rank (see ``cnn_mpi.train``).
    """
    train_x, train_y, test_x, test_y = load(args.data_dir)
    train_x, test_x = train_x.reshape(len(train_x), -1), test_x.reshape(len(test_x), -1)
    params = init_params(np.random.default_rng(args.seed))
    own_opt = opt is None
    if opt is None:
        opt = distopt.DistOpt(distopt.SGD(args.lr, momentum=0.9, weight_decay=1e-5))
    opt.sync_params(params)  # rank 0's initial weights everywhere
    rank, world = opt.global_rank, opt.world_size
    update = UPDATES[args.dist_option]

    sampler, steps, eval_idx = shards(args, len(train_x), len(test_x), rank, world)

    history = []
    for epoch in range(args.epochs):
        say(rank, f"Starting Epoch {epoch}:")
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
        batches = tqdm(sampler.batches(), total=steps, desc=f"epoch {epoch}", leave=False,
                       disable=True if rank else None)  # None: only on a terminal
        for step, idx in enumerate(batches):
            if step >= steps:
                break
            loss, logits, grads = loss_and_grads(params, train_x[idx], train_y[idx])
            update(opt, params, grads, args)
            totals["loss"] += loss * len(idx)
            totals["correct"] += float((logits.argmax(1) == train_y[idx]).sum())
            totals["count"] += len(idx)
        batches.close()
        record: dict[str, float] = {"epoch": epoch, **epoch_summary(opt.all_reduce_metrics(totals), "train")}
        record["train_time"] = time.perf_counter() - start
        record.update(epoch_summary(opt.all_reduce_metrics(evaluate(params, test_x, test_y, eval_idx)), "eval"))
        record["time"] = time.perf_counter() - start
        record["eval_time"] = record["time"] - record["train_time"]
        print_epoch(rank, record)
        history.append(record)
    if own_opt:
        opt.close()
    return history


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, check the data and train; returns the exit status."""
    args = parse_args(argv)
    check_dir(args.data_dir)  # a clear SystemExit before any MPI start-up
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
