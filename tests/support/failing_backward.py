"""An autograd function whose backward raises on demand: a backward pass that fails mid-way (tests only)."""
from __future__ import annotations

from typing import Any

import torch


class FailingBackward(torch.autograd.Function):
    """Identity forward; backward raises for the keys in :attr:`armed` (a simulated out-of-memory).

    Use ``FailingBackward.apply(x, key)`` and add ``key`` to ``armed`` for the
    backward passes that must fail; ``armed`` is shared by every test, so keys
    start with a name of their own test.
    """

    armed: set[Any] = set()

    @staticmethod
    def forward(ctx: Any, x: Any, key: Any) -> Any:
        ctx.key = key
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple[Any, None]:
        if ctx.key in FailingBackward.armed:
            raise RuntimeError("simulated out-of-memory in backward")
        return g, None
