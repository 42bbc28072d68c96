"""Local optimizers that update NumPy or CuPy arrays in place."""
from __future__ import annotations

import weakref
from typing import Any

from .core._array import xp_of

__all__ = ["SGD"]


class SGD:
    """Stochastic gradient descent with momentum, as ``torch.optim.SGD``.

    For each parameter ``p`` with gradient ``g`` (same shape and dtype)::

        g = g + weight_decay * p
        buf = g                                   (first update of p)
        buf = momentum * buf + (1 - dampening) * g (later updates)
        g = g + momentum * buf if nesterov else buf
        p -= lr * g

    Same formula as PyTorch's SGD (Sutskever et al. 2013 for momentum), so a NumPy model trained with it matches a
    PyTorch model step for step.

    Args:
        lr: learning rate, > 0.
        momentum: momentum factor, >= 0.
        dampening: dampening of the momentum, in [0, 1].
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        weight_decay: L2 penalty coefficient, >= 0.

    Raises:
        ValueError: an argument outside the range above.
    """

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not 0 <= dampening <= 1:
            raise ValueError(f"dampening must be in [0, 1], got {dampening}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening = 0")
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay
        # momentum buffers in order of each parameter's first update
        self._slots: dict[int, tuple[weakref.ref, int]] = {}
        self._buffers: list[Any] = []
        self._restored: list[Any] = []
        self._scratch: dict[tuple[type, Any], Any] = {}

    def _slot(self, param: Any) -> int:
        entry = self._slots.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        i = len(self._buffers)
        self._slots[id(param)] = (weakref.ref(param), i)
        self._buffers.append(self._restored[i] if i < len(self._restored) else None)
        return i

    def update(self, param: Any, grad: Any) -> None:
        """Update ``param`` in place with ``grad``; ``grad`` is not modified.

        Args:
            param: float array (NumPy or CuPy), updated in place.
            grad: array of the same shape as ``param``.

        Raises:
            ValueError: shapes differ.
        """
        if param.shape != grad.shape:
            raise ValueError(f"grad shape {grad.shape} does not match param shape {param.shape}")
        if self.nesterov:
            self._update_nesterov(param, grad)
            return
        # the class docstring's formula with one reused scratch array instead of a temporary per operation (the same
        # operations in the same order: bitwise the same result)
        tmp = self._scratch_like(param)
        g = grad
        if self.weight_decay:
            xp_of(param).multiply(param, self.weight_decay, out=tmp)
            tmp += grad
            g = tmp
        if self.momentum:
            i = self._slot(param)
            buf = self._buffers[i]
            if buf is None:
                self._buffers[i] = g.copy()
            else:
                buf *= self.momentum
                if self.dampening:
                    xp_of(param).multiply(g, 1 - self.dampening, out=tmp)
                    buf += tmp
                else:
                    buf += g
            g = self._buffers[i]
        xp_of(param).multiply(g, self.lr, out=tmp)
        param -= tmp

    def _scratch_like(self, param: Any) -> Any:
        """A scratch array shaped like ``param`` (a view of one flat buffer per array module and dtype)."""
        key = (type(param), param.dtype)
        flat = self._scratch.get(key)
        if flat is None or flat.size < param.size:
            flat = self._scratch[key] = xp_of(param).empty(param.size, dtype=param.dtype)
        return flat[:param.size].reshape(param.shape)

    def _update_nesterov(self, param: Any, grad: Any) -> None:
        g = grad
        if self.weight_decay:
            g = g + self.weight_decay * param
        i = self._slot(param)
        buf = self._buffers[i]
        if buf is None:
            buf = self._buffers[i] = g.copy()
        else:
            buf *= self.momentum
            buf += (1 - self.dampening) * g
        param -= self.lr * (g + self.momentum * buf)

    def momentum_buffer(self, param: Any) -> Any:
        """The momentum buffer of ``param`` (an array), or None before its first update."""
        entry = self._slots.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return self._buffers[entry[1]]

    def state_bytes(self) -> int:
        """BYTES held in momentum buffers."""
        return sum(int(b.nbytes) for b in self._buffers if b is not None)

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters and momentum buffers (copies), in order of first update."""
        return {
            "lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
            "nesterov": self.nesterov, "weight_decay": self.weight_decay,
            "momentum_buffers": [None if b is None else b.copy() for b in self._buffers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Momentum buffers are matched to parameters by order of first update, so
        the restored run must update its parameters in the same order."""
        for key in ("lr", "momentum", "dampening", "nesterov", "weight_decay"):
            setattr(self, key, state[key])
        self._slots, self._buffers = {}, []
        self._restored = [None if b is None else b.copy() for b in state["momentum_buffers"]]
