"""Small reference models with hand-written float64 gradients, for equivalence tests."""
from __future__ import annotations

import numpy as np


def mlp_params(seed: int, d: int = 5, h: int = 7, c: int = 3) -> list[np.ndarray]:
    """Parameters [W1 (d,h), b1 (h,), W2 (h,c), b2 (c,)] drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(d, h)), rng.normal(size=h) * 0.1, rng.normal(size=(h, c)), rng.normal(size=c) * 0.1]


def mlp_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of the mean squared error of a tanh MLP over the batch (x, y)."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    out = hidden @ w2 + b2
    d_out = 2.0 * (out - y) / (x.shape[0] * y.shape[1])
    d_hidden = (d_out @ w2.T) * (1 - hidden**2)
    return [x.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_out, d_out.sum(0)]


def batch(step: int, n: int, d: int = 5, c: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic global batch of n samples for ``step``."""
    rng = np.random.default_rng(1000 + step)
    return rng.normal(size=(n, d)), rng.normal(size=(n, c))
