"""PyTorch adapter: DistOpt drives a ``torch.optim.Optimizer``.

Parameters and gradients are viewed, not copied: CPU tensors through
``Tensor.numpy()`` (shared memory), CUDA tensors through DLPack
(``cupy.from_dlpack``). Only packing small gradients into a fusion buffer
copies. The averaged gradient is written back into ``param.grad`` and
``optimizer.step()`` runs unchanged, so any PyTorch optimizer works.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from .local import LocalOptimizer

__all__ = ["is_torch_optimizer", "TorchOptimizer", "as_array"]


def is_torch_optimizer(opt: Any) -> bool:
    """True if ``opt`` is a ``torch.optim.Optimizer`` (never imports torch itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(opt, torch.optim.Optimizer)


def as_array(tensor: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array sharing memory with ``tensor``.

    Raises:
        TypeError: the tensor is sparse (``nn.Embedding(sparse=True)``) or
            not contiguous (a view could not alias it).
    """
    if tensor.is_sparse:
        raise TypeError(f"tensor of shape {tuple(tensor.shape)} is a sparse gradient (e.g. nn.Embedding(sparse="
                        "True)); distopt averages dense gradients only: use a dense embedding, or "
                        "DistOpt(..., sparse_as_dense=True) with a PyTorch optimizer and loss.backward()")
    if not tensor.is_contiguous():
        raise TypeError(f"tensor of shape {tuple(tensor.shape)} is not contiguous; distopt needs "
                        "contiguous parameters and gradients")
    tensor = tensor.detach()
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor)
    return tensor.numpy()


class TorchOptimizer(LocalOptimizer):
    """The local-optimizer side of DistOpt for a ``torch.optim.Optimizer``.

    A post-accumulate-grad hook on every parameter that requires a
    gradient hands the final ``.grad`` either to the bucket pipeline of
    DistOpt's own backward (``backward_and_update`` with overlap) or to the
    :class:`~distopt.autosync.AutoSync` follower (a plain ``loss.backward()``).

    Attributes:
        follower: the :class:`~distopt.autosync.AutoSync` (None: none).
        engine_path: True while DistOpt's own backward or update runs (the
            follower and the step hooks stand aside).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._hooked: set[int] = set()
        self.handles: list[Any] = []  # every hook this DistOpt registered (removed by detach())
        self._armed: tuple[Any, dict[int, int]] | None = None
        self.follower: Any = None
        self.engine_path = False

    def params(self) -> list[Any]:
        """The optimizer's parameters, group by group, in a fixed order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def trainable(self) -> list[Any]:
        """The parameters that require a gradient now, in :meth:`params` order."""
        return [p for p in self.params() if p.requires_grad]

    def hook(self, tensors: Sequence[Any]) -> None:
        """Register the post-accumulate-grad hook on each tensor that requires a gradient (once)."""
        for t in tensors:
            if t.requires_grad and id(t) not in self._hooked and hasattr(t, "register_post_accumulate_grad_hook"):
                self.handles.append(t.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(id(t))

    def detach(self) -> None:
        """Remove every hook this adapter (and DistOpt's model and step hooks) registered."""
        for handle in self.handles:
            handle.remove()
        self.handles, self._hooked = [], set()

    def arrays(self) -> list[Any]:
        """Array views of the parameters (writing them changes the model)."""
        return [as_array(p) for p in self.params()]

    def grads(self) -> list[Any]:
        """Array views of ``param.grad`` (None where a parameter has no gradient)."""
        return [None if p.grad is None else as_array(p.grad) for p in self.params()]

    def backward(self, loss: Any) -> tuple[list[Any], list[Any]]:
        self.engine_path = True
        try:
            loss.backward()
        finally:
            self.engine_path = False
        return self.arrays(), self.grads()

    def _on_grad(self, param: Any) -> None:
        """Post-accumulate-grad hook: hand a final gradient to the armed pipeline or the follower."""
        if self._armed is not None:
            pipeline, index_of = self._armed
            index = index_of.get(id(param))
            if index is not None:
                pipeline.ready(index, as_array(param.grad))
        elif self.follower is not None and not self.engine_path:
            self.follower.on_grad(param)

    def overlapped_backward(self, loss: Any, begin: Callable[[list[Any]], Any]
                            ) -> tuple[list[Any], list[Any], Any] | None:
        tensors = self.params()
        if not all(hasattr(t, "register_post_accumulate_grad_hook") for t in tensors):
            return None  # PyTorch older than 2.1
        self.hook(tensors)
        pipeline = begin(self.arrays())
        self._armed = (pipeline, {id(t): i for i, t in enumerate(tensors)})
        try:
            loss.backward()
        except BaseException:
            pipeline.abandon()  # started reductions complete now, before the caller frees any gradient
            raise
        finally:
            self._armed = None
        return self.arrays(), self.grads(), pipeline

    def apply(self, params: Sequence[Any], grads: Sequence[Any], present: Sequence[bool]) -> None:  # noqa: ARG002
        """Install the averaged gradients and run ``optimizer.step()``.

        Args:
            params: ignored (the optimizer knows its tensors).
            grads: averaged gradient arrays (those that were views of
                ``.grad`` already hold the average; others, e.g. the new
                arrays of a rank shadowing inside ``join()``, are installed:
                into an existing ``.grad`` in place, else as the ``.grad``).
            present: False where no rank had a gradient: ``.grad`` is set to
                None so the optimizer skips that parameter.
        """
        import torch

        for p, g, ok in zip(self.params(), grads, present):
            if not ok:
                p.grad = None
                continue
            tensor = torch.from_dlpack(g) if not hasattr(g, "__array_interface__") else torch.from_numpy(g)
            if p.grad is None:
                p.grad = tensor
            elif p.grad.data_ptr() != tensor.data_ptr():
                p.grad.copy_(tensor.reshape(p.grad.shape))
        self.engine_path = True
        try:
            self.optimizer.step()
        finally:
            self.engine_path = False

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
