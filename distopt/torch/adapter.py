"""PyTorch adapter: DistOpt drives a ``torch.optim.Optimizer``.

Parameters and gradients are viewed, not copied: CPU tensors through ``Tensor.numpy()`` (shared memory), CUDA tensors
through DLPack (``cupy.from_dlpack``). Only packing small gradients into a fusion buffer copies. The averaged gradient
is written back into ``param.grad`` and ``optimizer.step()`` runs unchanged, so any PyTorch optimizer works.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import numpy as np

from ..core._array import cupy_major
from ..step.local import ArrayOptimizer, LocalOptimizer

__all__ = ["is_torch_optimizer", "local_optimizer", "TorchOptimizer", "as_array", "as_tensor", "tensor_bytes",
           "torch_stream", "on_torch_stream", "as_tensor_like"]

F = TypeVar("F", bound=Callable[..., Any])


def is_torch_optimizer(opt: Any) -> bool:
    """True if ``opt`` is a ``torch.optim.Optimizer`` (never imports torch itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(opt, torch.optim.Optimizer)


def local_optimizer(opt: Any) -> LocalOptimizer:
    """The :class:`~distopt.step.local.LocalOptimizer` for ``opt``: :class:`TorchOptimizer` for a
    ``torch.optim.Optimizer``, :class:`~distopt.step.local.ArrayOptimizer` for anything with ``update(param, grad)``.

    Raises:
        TypeError: ``opt`` is neither.
    """
    if is_torch_optimizer(opt):
        return TorchOptimizer(opt)
    if callable(getattr(opt, "update", None)):
        return ArrayOptimizer(opt)
    raise TypeError(f"opt must be distopt.SGD, an object with update(param, grad), or a torch.optim.Optimizer; "
                    f"got {type(opt).__name__}")


def as_array(tensor: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array sharing memory with ``tensor``; a complex tensor's real view
    (``torch.view_as_real``: shape ``(*shape, 2)``, float), as DDP reduces it.

    Raises:
        TypeError: the tensor is sparse (array views and collectives take dense tensors; a PyTorch optimizer's sparse
            ``.grad`` is averaged by ``loss.backward()``, :mod:`distopt.torch.sparse`) or not contiguous.
    """
    if tensor.is_sparse:
        raise TypeError(f"tensor of shape {tuple(tensor.shape)} is sparse; array views and collectives take dense "
                        "tensors: pass tensor.to_dense(), or use sparse_all_reduce (a torch.optim.Optimizer's sparse "
                        "gradients, e.g. from nn.Embedding(sparse=True), are averaged by loss.backward() without this)")
    if not tensor.is_contiguous():
        raise TypeError(f"tensor of shape {tuple(tensor.shape)} is not contiguous; distopt needs "
                        "contiguous parameters and gradients")
    import torch

    tensor = tensor.detach()
    if str(tensor.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: view the bits as ml_dtypes' type
        if tensor.is_cuda:
            import cupy

            if cupy_major(cupy) < 14:
                raise TypeError(f"bfloat16 CUDA tensors are viewed as CuPy arrays from CuPy 14 on (this is CuPy "
                                f"{cupy.__version__}): upgrade CuPy, keep CUDA parameters in float32 or float16, "
                                "or use torch.autocast(dtype=torch.bfloat16)")
            return cupy.from_dlpack(tensor.view(torch.int16)).view(_bfloat16())
        return tensor.view(torch.int16).numpy().view(_bfloat16())
    if tensor.is_complex():  # averaged as DDP averages it: the real view of twice the length
        return as_array(torch.view_as_real(tensor))
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor)
    return tensor.numpy()


def as_tensor_like(array: Any, like: Any) -> Any:
    """:func:`as_tensor` of ``array`` as the tensor ``like`` sees it: complex again for a complex ``like``
    (whose :func:`as_array` is the real view)."""
    import torch

    tensor = as_tensor(array)
    return torch.view_as_complex(tensor.reshape(*like.shape, 2)) if like.is_complex() else tensor


def torch_stream(tensor: Any) -> ContextManager[Any]:
    """Inside, CuPy's current stream is torch's current stream of ``tensor``'s CUDA device.

    CuPy queues its kernels (bucket copies, casts, compression) and orders NCCL against its OWN current stream, the
    legacy default stream unless set; under ``with torch.cuda.stream(s):`` (a non-blocking stream) the update could
    then read gradients before their all-reduce is done. Sharing the stream (``cupy.cuda.ExternalStream``, as CuPy's
    interoperability guide advises) orders distopt's work with the training script's. A no-op for CPU tensors and None.
    """
    if tensor is None or not getattr(tensor, "is_cuda", False):
        return contextlib.nullcontext()
    import cupy
    import torch

    return cupy.cuda.ExternalStream(torch.cuda.current_stream(tensor.device).cuda_stream, tensor.device.index)


def on_torch_stream(method: F) -> F:
    """Run a method of an object holding ``local`` inside :func:`torch_stream` of its first parameter."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch_stream(next(iter(self.local.params()), None)):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def as_tensor(array: Any) -> Any:
    """The torch tensor sharing ``array``'s memory (NumPy, ml_dtypes' bfloat16 included, or CuPy)."""
    import torch

    if not hasattr(array, "__array_interface__"):
        return torch.from_dlpack(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise TypeError("bfloat16 parameters on the CPU need ml_dtypes (NumPy's bfloat16): "
                        "pip install 'distopt[bf16]'") from exc
    return ml_dtypes.bfloat16


def tensor_bytes(t: Any) -> int:
    """BYTES a tensor holds: a dense one's ``nbytes`` (at most its storage's); a sparse COO one's indices and values
    (SGD's momentum buffer of a sparse gradient is sparse, and ``nbytes`` raises for it); a compressed one's index and
    value tensors."""
    import torch

    if t.layout == torch.strided:  # a view holds at most its storage (zero=3's freed parameter: one element)
        return min(int(t.nbytes), int(t.untyped_storage().nbytes()))
    if t.is_sparse:
        return int(t._indices().nbytes + t._values().nbytes)
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return int(t.crow_indices().nbytes + t.col_indices().nbytes + t.values().nbytes)
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return int(t.ccol_indices().nbytes + t.row_indices().nbytes + t.values().nbytes)
    return int(t.numel() * t.element_size())


class TorchOptimizer(LocalOptimizer):
    """The local-optimizer side of DistOpt for a ``torch.optim.Optimizer``.

    It owns the optimizer's tensors and the hooks DistOpt registers on them (removed by :meth:`detach`); the follower
    (:mod:`distopt.torch.follower`) receives the hooks' calls and drives the step.

    Attributes:
        optimizer: the wrapped ``torch.optim.Optimizer``.
        handles: every hook handle registered for this DistOpt (tensors, optimizer step hooks, model forward hooks).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._hooked: set[int] = set()
        self.handles: list[Any] = []
        self.real_groups: list[list[Any]] | None = None  # the groups' own lists while a sharded step swapped them
        self.held_param_bytes: Callable[[], int] = lambda: 0  # parameter memory held elsewhere (stage 3)
        self.deferred: set[int] = set()  # ids of a meta-built model's tensors that stage 3 materializes at bind

    def params(self) -> list[Any]:
        """The optimizer's parameters, group by group, in a fixed order (its own, also while a sharded optimizer's
        shard tensors are swapped into its groups)."""
        if self.real_groups is not None:
            return [p for params in self.real_groups for p in params]
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def trainable(self) -> list[Any]:
        """The parameters that require a gradient now, in :meth:`params` order."""
        return [p for p in self.params() if p.requires_grad]

    def hook(self, tensors: Sequence[Any], on_grad: Callable[[Any], None]) -> None:
        """Register ``on_grad`` as the post-accumulate-grad hook of each tensor that requires a gradient (once per
        tensor)."""
        for t in tensors:
            if t.requires_grad and id(t) not in self._hooked:
                self.handles.append(t.register_post_accumulate_grad_hook(on_grad))
                self._hooked.add(id(t))

    def detach(self) -> None:
        """Remove every hook registered for this DistOpt."""
        for handle in self.handles:
            handle.remove()
        self.handles, self._hooked = [], set()

    def arrays(self) -> list[Any]:
        """Array views of the parameters (writing them changes the model)."""
        return [as_array(p) for p in self.params()]

    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:  # noqa: ARG002
        """Views of each parameter's ``momentum_buffer`` state (None where absent)."""
        buffers = [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in self.params()]
        return [None if buf is None else as_array(buf) for buf in buffers]

    def hyper_parameters(self) -> list[dict[str, Any]]:
        """The parameter groups (``params`` is left out by the comparison)."""
        return self.optimizer.param_groups

    def momentum_factors(self) -> list[tuple[str, float]]:
        kind = type(self.optimizer)
        name = ("torch.optim." if kind.__module__.startswith("torch.optim") else "") + kind.__name__
        return [(f"{name}.param_groups[{i}]['momentum']", float(group["momentum"]))
                for i, group in enumerate(self.optimizer.param_groups) if "momentum" in group]

    def state_bytes(self) -> int:
        """BYTES of the tensors in the optimizer's ``state``."""
        import torch

        return sum(tensor_bytes(v) for entry in self.optimizer.state.values() for v in entry.values()
                   if isinstance(v, torch.Tensor))

    def param_bytes(self) -> int:
        """BYTES the parameters hold (a parameter freed by ``zero=3`` holds none), plus what :attr:`held_param_bytes`
        reports (stage 3's segments)."""
        return sum(tensor_bytes(p) for p in self.params()) + self.held_param_bytes()

    def grad_bytes(self) -> int:
        """BYTES of the parameters' ``.grad`` tensors (a sparse one's indices and values)."""
        return sum(tensor_bytes(g) for g in (p.grad for p in self.params()) if g is not None)

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """The inner optimizer's ``load_state_dict``; a list of every rank's sharded states
        (``DistOpt(zero=1|2|3).state_dict(sharded=True)``, any world size) is merged first."""
        if isinstance(state, (list, tuple)):
            from ..sharding.shard_state import merge_shards

            state = merge_shards(state, [tuple(p.shape) for p in self.params()])
        self.optimizer.load_state_dict(state)
