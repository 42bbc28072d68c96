"""The gradients of a step ``check_finite`` skipped: NaN, as DDP's non-finite average would be, until ``step()``.

With ``check_finite=True`` a NaN or inf in any rank's gradient skips the
update on every rank. PyTorch DDP has no such vote, and what DDP scripts
pair with a non-finite step is ``torch.amp.GradScaler``: its ``unscale_``
looks for the inf in ``.grad`` (``found_inf`` per device), ``step()``
skips the update, ``update()`` halves the scale. It asserts "No inf checks
were recorded for this optimizer" when no parameter has a gradient. So a
skipped step leaves every ``.grad`` (of a tensor some rank had a gradient
for) filled with NaN, on every rank and at every ``zero`` stage: the
scaler finds the inf, skips and halves alike everywhere, and
``torch.nn.utils.clip_grad_norm_`` returns a non-finite norm, as with DDP.

Those gradients are set to None again before the update runs (the inner
optimizer's step pre-hook: a ``step()`` changes nothing) and by
``opt.zero_grad()``; a backward before either accumulates onto them (as
onto DDP's non-finite average), so the next step is skipped too.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["NotFiniteGrads"]


class NotFiniteGrads:
    """The NaN ``.grad`` tensors of the last skipped step (see the module docs)."""

    def __init__(self) -> None:
        self.held: list[tuple[Any, Any]] = []  # (tensor, the NaN gradient given to it)

    def mark(self, tensors: Sequence[Any], present: Sequence[bool], sparse: Sequence[Any]) -> None:
        """Give ``.grad`` = NaN to each of ``tensors`` (the dense layout) some rank had a gradient for
        (``present``), and to each of ``sparse`` (the tensors averaged as sparse: some rank had one)."""
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
