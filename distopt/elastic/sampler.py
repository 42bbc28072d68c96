"""A batch sampler whose position survives a change of world size: every sample of an epoch once, in any world.

The epoch's order is one global permutation that every rank computes alike
(``numpy.random.default_rng((seed, epoch))``). A step consumes the next
*window* of ``world_size * batch_size`` positions of that order; rank ``r``
takes ``window[r::world_size]``. The sampler's state is the global number of
samples consumed (``processed``), the same on every rank, so after a restart
at another world size the remaining positions are split among the new ranks
and no sample is repeated or skipped (Horovod Elastic's ``ElasticSampler``
keeps a set of processed indices instead; a position is enough here because
the order does not depend on the world).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ElasticSampler"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"ElasticSampler: {name} must be a positive int, got {value!r}")
    return int(value)


class ElasticSampler:
    """Per-rank batches of sample indices for a job whose world size may change between commits.

    Use it as a ``batch_sampler`` (``torch.utils.data.DataLoader(ds, batch_sampler=sampler)``) or iterate it
    directly; call :meth:`record_batch` once per optimizer step, after the step, so that a commit taken then
    counts the step's samples as consumed. :func:`distopt.elastic.run` calls :meth:`reset` with the new
    world's rank and size after every (re)start.

    Args:
        num_samples: the dataset's length (samples, not batches), or a sized dataset.
        batch_size: samples per rank per step. The last window of an epoch holds what is left: its
            ``remaining[rank::world_size]`` share may be smaller than ``batch_size``, or empty when fewer than
            ``world_size`` samples are left (the step should still be taken so that the ranks stay together).
        shuffle: a fresh permutation per epoch (``default_rng((seed, epoch))``); ``False`` keeps ``0..n-1``.
        seed: the permutation's seed, the same on every rank.
        rank: this process's rank in the current world; :meth:`reset` changes it.
        world_size: the number of processes in the current world; :meth:`reset` changes it.

    Raises:
        ValueError: a size, rank or seed that is not a valid int, a rank outside ``[0, world_size)``.
    """

    def __init__(self, num_samples: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        n = len(num_samples) if hasattr(num_samples, "__len__") else num_samples
        self.num_samples = _positive_int("num_samples", n)
        self.batch_size = _positive_int("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"ElasticSampler: seed must be an int >= 0, got {seed!r}")
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch, self.processed = 0, 0
        self._started = True  # set_epoch was called for the epoch in hand (or it has batches left)
        self.rank, self.world_size = 0, 1
        self.reset(rank, world_size)

    def reset(self, rank: int, world_size: int) -> None:
        """Split the rest of the epoch among a new world (``processed`` is kept).

        Raises:
            ValueError: ``world_size`` < 1 or ``rank`` outside ``[0, world_size)``.
        """
        world_size = _positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ValueError(f"ElasticSampler: rank must be an int in [0, {world_size}), got {rank!r}")
        self.rank, self.world_size = int(rank), world_size

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a new permutation, ``processed = 0``); a no-op for the current epoch when
        it is already under way, so that a restored sampler keeps its position.

        Raises:
            ValueError: ``epoch`` is not an int >= 0.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"ElasticSampler.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.epoch, self.processed = int(epoch), 0
        self._started = True

    def order(self) -> np.ndarray:
        """The epoch's global order: int64 indices, shape ``(num_samples,)``."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng((self.seed, self.epoch)).permutation(self.num_samples).astype(np.int64)

    @property
    def window(self) -> int:
        """Samples one step consumes across the world: ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    def __len__(self) -> int:
        """Steps left in this epoch (the same on every rank)."""
        return -(-(self.num_samples - self.processed) // self.window)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches for the rest of the epoch, from ``processed`` on (a list of ints per step).

        The iterator does not advance ``processed``: :meth:`record_batch` does, after the step.

        Raises:
            RuntimeError: the epoch is used up and :meth:`set_epoch` was not called since (a loop that
                reads a batch before ``set_epoch``): iterating it would end at once.
        """
        if self.processed >= self.num_samples and not self._started:
            raise RuntimeError(f"ElasticSampler: epoch {self.epoch} is used up ({self.num_samples} samples "
                               f"processed) and set_epoch was not called since: call "
                               f"sampler.set_epoch({self.epoch + 1}) before reading the next epoch's batches")
        order = self.order()
        for start in range(self.processed, self.num_samples, self.window):
            yield order[start:start + self.window][self.rank::self.world_size].tolist()

    def record_batch(self) -> None:
        """Count one step's window as consumed (call it once per step, on every rank)."""
        self.processed = min(self.num_samples, self.processed + self.window)
        self._started = self.processed < self.num_samples

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "processed", "num_samples", "seed"}``: the same on every rank."""
        return {"epoch": self.epoch, "processed": self.processed, "num_samples": self.num_samples,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` output (the world's rank and size are not part of it).

        Raises:
            ValueError: the state is of a dataset of another length or another seed.
        """
        if state.get("num_samples") != self.num_samples or state.get("seed") != self.seed:
            raise ValueError(f"ElasticSampler.load_state_dict: the state is of num_samples="
                             f"{state.get('num_samples')!r}, seed={state.get('seed')!r}; this sampler has "
                             f"num_samples={self.num_samples}, seed={self.seed}")
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
        self._started = self.processed < self.num_samples
