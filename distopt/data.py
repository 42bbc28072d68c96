"""Splitting a dataset across the ranks of a data-parallel job.

Pure, deterministic functions of sample indices (numpy only, no communication), so the ranks agree without talking.
For training (:func:`partition_indices`, :func:`partition`, :class:`DistributedSampler`) every rank gets the **same
number** of samples, so no rank waits forever in an all-reduce the others never reach; for evaluation
(:func:`eval_partition_indices`) no sample is duplicated, so a metric summed over ranks (e.g. ``(correct, count)``)
equals the single-process metric exactly.

Sources: SINGA's ``DistOpt`` examples (``data_partition``: blocks of ``n // world_size`` samples, which silently
dropped the last ``n % world_size``, gave every rank nothing when ``n < world_size``, and split validation the same
way) and PyTorch's ``torch.utils.data.DistributedSampler`` (wrap-around padding, interleaved shards, ``set_epoch``
seeding). Related reports: PyTorch #25162 and #22584 (padding skews distributed validation accuracy; kept for
training because a rank with fewer iterations hangs the others' all-reduce); PyTorch #12474 (interleaved
``rank::world_size`` shards, so a ``drop_last`` loader drops padding rather than real samples); Chainer #8267
(exactly equal shard sizes by duplicating samples); Horovod #3980 (ranks with different numbers of batches deadlock).
"""
from __future__ import annotations

import logging
import numbers
from typing import Any, Dict, Iterator, Tuple

import numpy as np

__all__ = ["BatchSampler", "partition_indices", "partition", "eval_partition_indices", "DistributedSampler"]

_log = logging.getLogger("distopt")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """Returns ``value`` as an int in ``[low, high)``; ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        expected = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def _check_split(n: Any, rank: Any, world_size: Any) -> Tuple[int, int, int]:
    n = _check_int("n", n, 0)
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0, world_size)
    return n, rank, world_size


def partition_indices(n: int, rank: int, world_size: int, *, pad: bool = True) -> np.ndarray:
    """Training shard of one rank: a contiguous block, equal size everywhere (SINGA's ``data_partition`` fixed). Rank
    ``r`` takes positions ``[r * c, (r + 1) * c)`` of the (possibly padded) index sequence ``0, 1, ..., n - 1``, where
    ``c`` is the same on every rank.

    Args:
        n: number of samples in the dataset, ``n >= 0``.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks, ``world_size >= 1``.
        pad: if True, ``c = ceil(n / world_size)`` and the sequence is padded to ``c * world_size`` by wrapping
            around to the start of the dataset, so the shards cover all ``n`` samples and at most
            ``world_size - 1`` appear twice; with ``n < world_size`` every rank still gets one sample (``n=3,
            world_size=4``: rank 3 gets ``[0]``). If False, ``c = n // world_size``, shards are disjoint and the last
            ``n % world_size`` samples are dropped (logged at INFO on the ``"distopt"`` logger).

    Returns:
        int64 array of shape ``(c,)`` with indices in ``[0, n)``; empty for every rank when ``n == 0``.

    Raises:
        ValueError: ``n < 0``, ``world_size < 1`` or ``rank`` outside ``[0, world_size)``; the message names the
            parameter.
    """
    n, rank, world_size = _check_split(n, rank, world_size)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if pad:
        count = -(-n // world_size)
        return np.arange(rank * count, (rank + 1) * count, dtype=np.int64) % n
    count = n // world_size
    dropped = n - count * world_size
    if dropped:
        _log.info("partition_indices: pad=False drops %d of %d samples (n %% world_size, world_size=%d)",
                  dropped, n, world_size)
    return np.arange(rank * count, (rank + 1) * count, dtype=np.int64)


def _length(a: Any) -> int:
    shape = getattr(a, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(a)


def _take(a: Any, idx: np.ndarray) -> Any:
    if isinstance(a, range):
        return np.asarray(a, dtype=np.int64)[idx]
    if hasattr(a, "shape"):  # numpy arrays, torch tensors, ...
        return a[idx]
    return np.asarray(a)[idx]


def partition(x: Any, y: Any, rank: int, world_size: int, *, pad: bool = True) -> Tuple[Any, Any]:
    """Applies :func:`partition_indices` to a feature and a label array.

    Args:
        x: samples, shape ``(n, ...)`` (numpy array or anything indexable by an int64 index array, e.g. a torch
            tensor), or a ``range`` of sample ids.
        y: labels, shape ``(n, ...)``, same kinds as ``x``.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks, ``world_size >= 1``.
        pad: see :func:`partition_indices`.

    Returns:
        ``(x_part, y_part)``, each of shape ``(c, ...)`` with the dtype of the input; a ``range`` becomes the int64
        array of the selected ids.

    Raises:
        ValueError: ``x`` and ``y`` differ in their first dimension, or the arguments of :func:`partition_indices`
            are invalid.
    """
    n = _length(x)
    if _length(y) != n:
        raise ValueError(f"x and y must have the same first dimension, got {n} and {_length(y)}")
    idx = partition_indices(n, rank, world_size, pad=pad)
    return _take(x, idx), _take(y, idx)


def eval_partition_indices(n: int, rank: int, world_size: int) -> np.ndarray:
    """Evaluation shard of one rank: contiguous, never duplicated. The first ``n % world_size`` ranks get ``n //
    world_size + 1`` samples, the others ``n // world_size`` (``n=10, world_size=4``: 3, 3, 2, 2); the union over ranks
    is exactly ``0, ..., n - 1``, each once. Ranks may run different numbers of evaluation steps: use it only where no
    collective is called per step.

    Args:
        n: number of samples, ``n >= 0``.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks, ``world_size >= 1``.

    Returns:
        int64 array of shape ``(n // world_size + (rank < n % world_size),)``.

    Raises:
        ValueError: invalid ``n``, ``rank`` or ``world_size`` (named).
    """
    n, rank, world_size = _check_split(n, rank, world_size)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return np.arange(start, start + count, dtype=np.int64)


class DistributedSampler:
    """This rank's sample indices per epoch, with PyTorch's conventions, and equal batch counts.

    As ``torch.utils.data.DistributedSampler``: iterating yields this rank's sample indices (Python ints) and
    ``len()`` counts them, so ``DataLoader(dataset, batch_size=B, sampler=sampler)`` works; batches of index arrays
    come from :meth:`batches` (or :meth:`batch_sampler`, for ``DataLoader(batch_sampler=...)``), as many on every
    rank. Each epoch, the permutation from ``np.random.default_rng((seed, epoch))`` (the identity without ``shuffle``)
    is padded by wrap-around to ``num_samples * world_size`` (``num_samples = ceil(n / world_size)``) and rank ``r``
    takes the **interleaved** positions ``r::world_size``, so the padded positions fall in the last partial batch:
    ``drop_last=True`` drops it on every rank and never keeps a duplicate while dropping a real sample (PyTorch
    #12474, Chainer #8267).

    Args:
        n: dataset size ``n >= 0``, or a sized dataset (its ``len()``).
        batch_size: the default samples per batch of :meth:`batches`, ``batch_size >= 1``; None: :meth:`batches`
            needs one.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks, ``world_size >= 1``.
        shuffle: permute the samples each epoch.
        seed: base seed, ``seed >= 0``; must be the same on every rank.
        drop_last: :meth:`batches` drops the last partial batch.

    Raises:
        ValueError: an invalid argument; the message names it.
    """

    def __init__(self, n: Any, batch_size: int | None, rank: int, world_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        n = n if isinstance(n, numbers.Integral) or not hasattr(n, "__len__") else len(n)
        self.n, self.rank, self.world_size = _check_split(n, rank, world_size)
        self.batch_size = None if batch_size is None else _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle, self.drop_last, self.epoch = bool(shuffle), bool(drop_last), 0

    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard per epoch (before batching/dropping)."""
        return -(-self.n // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose permutation the next iteration uses (the same value on every rank, each epoch)."""
        self.epoch = _check_int("epoch", epoch, 0)

    def __len__(self) -> int:
        """Samples of this rank per epoch (:attr:`num_samples`), as PyTorch's sampler."""
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        """This rank's sample indices for the current epoch, as Python ints."""
        return iter(self.indices().tolist())

    def indices(self) -> np.ndarray:
        """This rank's shard for the current epoch, int64, shape ``(num_samples,)``."""
        if self.n == 0:
            return np.empty(0, dtype=np.int64)
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(self.n).astype(np.int64)
        else:
            order = np.arange(self.n, dtype=np.int64)
        return order[np.arange(self.num_samples * self.world_size) % self.n][self.rank::self.world_size]

    def _batch_size(self, batch_size: int | None) -> int:
        if batch_size is None:
            if self.batch_size is None:
                raise ValueError("batch_size must be given (here or to DistributedSampler), got None")
            return self.batch_size
        return _check_int("batch_size", batch_size, 1)

    def num_batches(self, batch_size: int | None = None) -> int:
        """Batches per rank per epoch (the same on every rank)."""
        full, rest = divmod(self.num_samples, self._batch_size(batch_size))
        return full + (1 if rest and not self.drop_last else 0)

    def batches(self, batch_size: int | None = None) -> Iterator[np.ndarray]:
        """Yields :meth:`num_batches` int64 index arrays of shape ``(<= batch_size,)``.

        Raises:
            ValueError: no ``batch_size`` here nor at construction.
        """
        size, shard = self._batch_size(batch_size), self.indices()
        for b in range(self.num_batches(size)):
            yield shard[b * size:(b + 1) * size]

    def batch_sampler(self, batch_size: int | None = None) -> BatchSampler:
        """A ``batch_sampler`` for ``torch.utils.data.DataLoader``: lists of indices, :meth:`num_batches` long."""
        return BatchSampler(self, self._batch_size(batch_size))

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch": ..., "seed": ...}`` for checkpointing."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restores the epoch and seed saved by :meth:`state_dict`."""
        for key in ("epoch", "seed"):
            if key not in state:
                raise ValueError(f"state must contain {key!r}, got keys {sorted(state)}")
        self.epoch = _check_int("epoch", state["epoch"], 0)
        self.seed = _check_int("seed", state["seed"], 0)


class BatchSampler:
    """This rank's batches as lists of ints (``DataLoader(batch_sampler=...)``); see
    :meth:`DistributedSampler.batch_sampler`. It follows the sampler's epoch."""

    def __init__(self, sampler: DistributedSampler, batch_size: int) -> None:
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return self.sampler.num_batches(self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler.batches(self.batch_size):
            yield batch.tolist()
