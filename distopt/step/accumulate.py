"""Local gradient accumulation over micro-batches (Horovod's ``backward_passes_per_step``)."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["GradientAccumulator"]


class GradientAccumulator:
    """Sums gradients of ``k`` micro-batches locally; releases their MEAN on the k-th. The mean (not the sum), so that
    the effective learning rate does not grow with ``k`` (DeepSpeed #7773). Nothing is communicated while accumulating:
    one all-reduce per ``k`` micro-batches.

    Args:
        k: micro-batches per update, >= 1.

    Raises:
        ValueError: ``k < 1``.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {k}")
        self.k = k
        self.count = 0
        self._sums: list[Any] | None = None

    def add(self, grads: Sequence[Any]) -> list[Any] | None:
        """Add one micro-batch's gradients; return the mean on the k-th call, else None.

        Args:
            grads: one array (or None) per parameter, the same list length every call. Given arrays receive the mean
                in place when it is released, so views of ``param.grad`` stay valid.
        """
        if self._sums is None:
            self._sums = [None if g is None else g.copy() for g in grads]
        else:
            if len(grads) != len(self._sums):
                raise ValueError(f"got {len(grads)} gradients, the accumulation holds {len(self._sums)}")
            for i, g in enumerate(grads):
                if g is not None:
                    self._sums[i] = g.copy() if self._sums[i] is None else self._sums[i].__iadd__(g)
        self.count += 1
        return self.release(grads) if self.count == self.k else None

    def release(self, grads: Sequence[Any] | None = None) -> list[Any] | None:
        """The mean of what was accumulated (None if nothing), and a clean counter: for the k-th micro-batch, and for
        ``DistOpt.flush()``'s partial accumulation at an epoch end (averaged over the micro-batches it holds)."""
        if self._sums is None:
            return None
        out: list[Any] = []
        for i, s in enumerate(self._sums):
            target = None if grads is None else grads[i]
            if s is None:
                out.append(None)
            elif target is not None:
                target[...] = s / self.count
                out.append(target)
            else:
                out.append(s / self.count)
        self.discard()
        return out

    def discard(self) -> None:
        """Drop a partial accumulation; the next micro-batch starts a new one."""
        self._sums = None
        self.count = 0
