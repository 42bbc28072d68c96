"""The sharded-optimizer rows of ``step.py``: an elementwise NumPy Adam, and torch's ZeroRedundancyOptimizer."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


class NumpyAdam:
    """Adam (Kingma & Ba, 2015) on NumPy arrays, in place: an elementwise ``update(param, grad)``.

    State: two float32 moments per element (8 bytes per parameter element).
    """

    elementwise = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.lr, self.betas, self.eps = lr, betas, eps
        self._state: dict[int, tuple[Any, np.ndarray, np.ndarray, list[int]]] = {}

    def update(self, param: np.ndarray, grad: np.ndarray) -> None:
        entry = self._state.get(id(param))
        if entry is None or entry[0] is not param:
            entry = self._state[id(param)] = (param, np.zeros_like(param), np.zeros_like(param), [0])
        _, m, v, step = entry
        step[0] += 1
        b1, b2 = self.betas
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        scale = self.lr * np.sqrt(1 - b2 ** step[0]) / (1 - b1 ** step[0])
        param -= scale * m / (np.sqrt(v) + self.eps)

    def state_bytes(self) -> int:
        """BYTES of the moments."""
        return sum(int(m.nbytes + v.nbytes) for _, m, v, _ in self._state.values())


def zero_torch(torch: Any, dist: Any, params: list[np.ndarray], grads: list[np.ndarray], lr: float,
               bucket_mib: float, world_size: int, ddp_bucketed: Callable[..., Callable[[], None]]
               ) -> tuple[Callable[[], None], Callable[[], int]]:
    """torch's ``ZeroRedundancyOptimizer`` over gloo with SGD (momentum 0.9, weight decay 1e-4), the way its
    docs pair it with DDP: a DDP-style bucketed all-reduce of the gradients, then ``step()`` (which updates
    this rank's partition and broadcasts each partition from its owner). Returns the step and the bytes of
    this rank's optimizer state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    tensors = [torch.nn.Parameter(torch.from_numpy(p)) for p in params]
    for t, g in zip(tensors, grads):
        t.grad = torch.from_numpy(g)
    opt = ZeroRedundancyOptimizer(tensors, optimizer_class=torch.optim.SGD, lr=lr, momentum=0.9, weight_decay=1e-4)
    reduce = ddp_bucketed(torch, dist, grads, bucket_mib, world_size)

    def step() -> None:
        reduce()
        opt.step()

    def state_bytes() -> int:
        return sum(v.nbytes for s in opt.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))

    return step, state_bytes
