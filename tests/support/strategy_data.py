"""Shapes, parameters and per-rank gradients shared by the DGC, PowerSGD and error-feedback tests."""
from __future__ import annotations

import numpy as np

SHAPES = [(6, 2, 3, 3), (6,), (20, 30), (30,), (4, 5)]  # a conv weight and its bias, two matrices, a bias


def grads_for(step: int, rank: int, shapes, dtype=np.float64) -> list[np.ndarray]:
    """Rank ``rank``'s gradients at ``step``: N(0, 1), a different draw per step and rank."""
    rng = np.random.default_rng(1000 * step + 17 * rank)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def params_for(shapes, dtype=np.float64) -> list[np.ndarray]:
    """The same N(0, 1) parameters on every rank."""
    rng = np.random.default_rng(5)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]
