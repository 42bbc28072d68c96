"""PyTorch adapter: DistOpt drives a ``torch.optim.Optimizer``.

Parameters and gradients are viewed, not copied: CPU tensors through
``Tensor.numpy()`` (shared memory), CUDA tensors through DLPack
(``cupy.from_dlpack``). Only packing small gradients into a fusion buffer
copies. The averaged gradient is written back into ``param.grad`` and
``optimizer.step()`` runs unchanged, so any PyTorch optimizer works.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["is_torch_optimizer", "TorchOptimizer", "as_array"]


def is_torch_optimizer(opt: Any) -> bool:
    """True if ``opt`` is a ``torch.optim.Optimizer`` (never imports torch itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(opt, torch.optim.Optimizer)


def as_array(tensor: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array sharing memory with ``tensor``.

    Raises:
        TypeError: the tensor is not contiguous (a view could not alias it).
    """
    if not tensor.is_contiguous():
        raise TypeError(f"tensor of shape {tuple(tensor.shape)} is not contiguous; distopt needs "
                        "contiguous parameters and gradients")
    tensor = tensor.detach()
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor)
    return tensor.numpy()


class TorchOptimizer:
    """The local-optimizer side of DistOpt for a ``torch.optim.Optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def params(self) -> list[Any]:
        """The optimizer's parameters, group by group, in a fixed order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def arrays(self) -> list[Any]:
        """Array views of the parameters (writing them changes the model)."""
        return [as_array(p) for p in self.params()]

    def grads(self) -> list[Any]:
        """Array views of ``param.grad`` (None where a parameter has no gradient)."""
        return [None if p.grad is None else as_array(p.grad) for p in self.params()]

    def apply(self, params: Sequence[Any], grads: Sequence[Any], present: Sequence[bool]) -> None:  # noqa: ARG002
        """Install the averaged gradients and run ``optimizer.step()``.

        Args:
            params: ignored (the optimizer knows its tensors); kept for the
                common local-optimizer interface.
            grads: averaged gradient arrays (those that were views of
                ``.grad`` already hold the average; new ones are installed).
            present: False where no rank had a gradient: ``.grad`` is set to
                None so the optimizer skips that parameter.
        """
        import torch

        for p, g, ok in zip(self.params(), grads, present):
            if not ok:
                p.grad = None
            elif p.grad is None:
                p.grad = torch.from_dlpack(g) if not hasattr(g, "__array_interface__") else torch.from_numpy(g)
        self.optimizer.step()

    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:  # noqa: ARG002
        """Views of each parameter's ``momentum_buffer`` state (None where absent)."""
        out = []
        for p in self.params():
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            out.append(None if buf is None else as_array(buf))
        return out

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.optimizer.load_state_dict(state)
