"""The gradients of a step ``check_finite`` skipped: NaN, as DDP's non-finite average would be, until ``step()``.

So ``torch.amp.GradScaler`` (whose ``unscale_`` looks for the inf in ``.grad``, and which asserts "No inf checks were
recorded for this optimizer" when no parameter has a gradient) skips and halves its scale alike on every rank, as with
DDP (``docs/design.md``, "The PyTorch follower's rules"). A backward before the next ``step()`` or ``zero_grad()``
(which set them to None) accumulates onto them, so the next step is skipped too.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["NotFiniteGrads"]


class NotFiniteGrads:
    """The NaN ``.grad`` tensors of the last skipped step (see the module docs)."""

    def __init__(self) -> None:
        self.held: list[tuple[Any, Any]] = []  # (tensor, the NaN gradient given to it)

    def mark(self, tensors: Sequence[Any], present: Sequence[bool], sparse: Sequence[Any]) -> None:
        """Give ``.grad`` = NaN to each of ``tensors`` (the dense layout) some rank had a gradient for (``present``),
        and to each of ``sparse`` (the tensors averaged as sparse: some rank had one)."""
        import torch

        marked = [t for t, ok in zip(tensors, present) if ok]
        seen = {id(t) for t in marked}
        marked += [t for t in sparse if id(t) not in seen]
        for t in marked:
            t.grad = torch.full_like(t.detach(), float("nan"))
        self.held = [(t, t.grad) for t in marked]

    def drop(self) -> None:
        """Set the NaN gradients still held by their tensors to None."""
        for t, g in self.held:
            if t.grad is g:
                t.grad = None
        self.held = []
