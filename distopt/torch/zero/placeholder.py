"""What a sharded torch optimizer refuses: an update that is not elementwise, and any use of ``.grad`` at
``zero=2|3`` (a placeholder of the parameter's shape whose any operation raises, naming the stage: the gradient lives
in every rank's segments, so a norm or an edit of one rank's ``.grad`` could only be a per-rank answer).
"""
from __future__ import annotations

from typing import Any

__all__ = ["check_elementwise", "sharded_grad", "is_sharded_grad", "ELEMENTWISE"]

#: torch.optim classes whose update is elementwise (each element's new value depends on that element only).
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")


def check_elementwise(optimizer: Any, zero: int) -> None:
    """Refuse an optimizer whose update needs whole tensors: a class counts as elementwise when it is one of
    :data:`ELEMENTWISE` in ``torch.optim``, or declares ``elementwise = True``.

    Raises:
        ValueError: the optimizer is not known to update elementwise (L-BFGS, LARS/LAMB trust ratios, Adafactor's
            factored moments, any per-tensor norm), or a parameter group has ``differentiable=True``.
    """
    kind = type(optimizer)
    known = kind.__module__.startswith("torch.optim") and kind.__name__ in ELEMENTWISE
    if not (known or getattr(kind, "elementwise", False) is True):
        raise ValueError(f"zero={zero} hands the optimizer 1-D pieces of each tensor, so its update must be "
                         f"elementwise; {kind.__module__}.{kind.__name__} is not known to be (L-BFGS, LARS/LAMB "
                         "trust ratios and other per-tensor norms are not). Elementwise: torch.optim."
                         f"{', '.join(ELEMENTWISE)}; set `elementwise = True` on your own optimizer class to "
                         "declare it, or use zero=0")


def _refuse(func: Any, zero: int) -> RuntimeError:
    return RuntimeError(f"DistOpt(zero={zero}) keeps each gradient sharded over the ranks, so .grad of a parameter "
                        f"is a placeholder between backward and step() ({func} needs its values): clip with "
                        "opt.clip_grad_norm_(max_norm) (the global norm over every rank's shard), and edit "
                        "gradients with zero=1 or zero=0 (several backward() calls before one step() accumulate "
                        "at every stage)")


def _placeholder_class() -> type:
    import torch

    class ShardedGradTensor(torch.Tensor):
        """Stage 2's ``.grad`` of a parameter: its shape, dtype and device, and an error for any use."""

        @staticmethod
        def __new__(cls, like: Any, zero: int) -> Any:
            made = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
            made._zero = zero  # the stage in force, for the error
            return made

        def __repr__(self) -> str:  # type: ignore[override]
            return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype})"

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            zero = next((a._zero for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)), 2)
            raise _refuse(func, zero)

    return ShardedGradTensor


_PLACEHOLDER: list[type] = []  # the class, built at first use (torch is imported lazily)


def sharded_grad(like: Any, zero: int) -> Any:
    """Stage 2's and 3's ``.grad`` placeholder for the tensor ``like``: same shape, dtype and device; any operation on
    it (``clip_grad_norm_``, ``mul_``) raises a RuntimeError naming ``zero`` (the stage in force) and
    ``opt.clip_grad_norm_``. A second backward replaces it before accumulating (:meth:`ShardedTorchStep.adopt`)."""
    if not _PLACEHOLDER:
        _PLACEHOLDER.append(_placeholder_class())
    return _PLACEHOLDER[0](like, zero)


def is_sharded_grad(grad: Any) -> bool:
    """Whether ``grad`` is a placeholder made by :func:`sharded_grad`."""
    return bool(_PLACEHOLDER) and isinstance(grad, _PLACEHOLDER[0])
