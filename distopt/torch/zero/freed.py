"""The class a freed stage-3 parameter takes (:mod:`~distopt.torch.zero.params`): a subclass of its own class whose
metadata works and whose use in a computation raises an error naming it, or, while the first forward learns which
module reads which parameter, reports the use (:mod:`~distopt.torch.zero.hooks`)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["freed_class"]

#: Tensor methods a freed parameter still answers (metadata, hooks, hashing); any other use raises.
_METADATA = frozenset({"numel", "size", "dim", "element_size", "nelement", "is_contiguous", "is_floating_point",
                       "is_complex", "stride", "data_ptr", "untyped_storage", "get_device", "detach", "__hash__",
                       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook"})
#: Functions that only allocate a tensor like a freed parameter (its shape, dtype and device, never its
#: values): they work, as torch.distributed.checkpoint's optimizer-state initialisation needs.
_ALLOCATING = frozenset({"zeros_like", "empty_like", "ones_like", "full_like", "new_zeros", "new_empty",
                         "new_ones", "new_full"})
#: Attributes whose value a freed parameter does not have (they read its elements): their use raises too.
_VALUES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_FREED: dict[type, type] = {}  # a parameter class -> its freed subclass


def _reads(func: Any) -> bool:
    """Whether ``func`` (as a tensor subclass's ``__torch_function__`` receives it) reads a tensor's elements."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in _VALUES
    return name not in _METADATA and name not in _ALLOCATING


def freed_class(kind: type) -> type:
    """The subclass of parameter class ``kind`` a freed parameter takes: its metadata (its whole shape: its data is
    one element expanded to it), ``.data`` and allocations like it work. A computation calls the parameters'
    ``_zero3_on_use`` (set while the first forward learns the units: it gathers them) or raises a RuntimeError naming
    the parameter (instead of reading the one element)."""
    if kind not in _FREED:
        def __torch_function__(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not _reads(func):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            freed = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(a, tuple(_FREED.values()))]
            users: dict[Any, list[Any]] = {}  # each model's hook, its parameters (two zero=3 models may meet)
            for a in freed:
                users.setdefault(getattr(a, "_zero3_on_use", None), []).append(a)
            if freed and None not in users:
                for on_use, tensors in users.items():
                    on_use(tensors)  # their own classes back
                return func(*args, **(kwargs or {}))
            freed = users.get(None, freed)
            name = getattr(func, "__name__", "") or str(func)
            name = getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name
            raise RuntimeError(f"zero=3: parameter {getattr(freed[0] if freed else None, '_zero3_name', '?')!r} is "
                               f"freed between the forward passes of the modules that hold it, and {name}() used it "
                               "outside them: use it inside a module's forward, or inside "
                               "`with opt.summon_full_params():`")

        _FREED[kind] = type(f"Freed{kind.__name__}", (kind,), {"__torch_function__": classmethod(__torch_function__)})
    return _FREED[kind]
