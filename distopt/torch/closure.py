"""``optimizer.step(closure)`` across ranks: torch's closure contract for every optimizer (L-BFGS included).

The gradients of every closure evaluation are averaged by its backward (the follower's hooks); the loss the closure
returns is averaged over the ranks too (one small all-reduce of one float64 per evaluation), so an optimizer that
decides on the loss (L-BFGS's line search) evaluates the closure the same number of times on every rank.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..comm.base import Communicator

__all__ = ["averaged_closure"]


def averaged_closure(closure: Callable[[], Any], comm: Communicator) -> Callable[[], Any]:
    """``closure`` run with gradients enabled, its loss replaced by the mean over the ranks (collective): a detached
    0-dim tensor of the closure loss's dtype, or a float when the closure returns a number."""
    def averaged() -> Any:
        import torch

        with torch.enable_grad():
            loss = closure()
        value = np.array([float(loss.detach() if isinstance(loss, torch.Tensor) else loss)], dtype=np.float64)
        comm.all_reduce(value, op="sum")
        mean = value[0] / comm.size
        return torch.tensor(mean, dtype=loss.dtype) if isinstance(loss, torch.Tensor) else mean

    return averaged
