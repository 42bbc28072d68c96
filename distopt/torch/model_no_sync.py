"""DDP's ``model.no_sync()`` on the model given as ``DistOpt(..., model=model)``.

Code written for DDP (timm's ``train.py``) accumulates with ``with model.no_sync():`` when ``hasattr(model,
"no_sync")``, else all-reduces every micro-batch. So, with ``model=``, the model gets an instance attribute
``no_sync`` that is ``opt.no_sync``, unless it has a ``no_sync`` of its own (left alone); ``opt.close()`` removes it.
It travels with ``copy.deepcopy`` (an EMA copy shares it) and with pickling (``torch.save(model)``: a stand-in that
does not communicate, replaced by the next DistOpt built over the model).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager
import weakref

__all__ = ["ModelNoSync", "attach_no_sync"]


class ModelNoSync:
    """``model.no_sync``: calls the follower's ``no_sync()`` (a weak reference: the model does not keep the DistOpt
    alive); a context that does nothing once the follower is gone or after unpickling."""

    def __init__(self, follower: Any = None) -> None:
        self._follower = None if follower is None else weakref.ref(follower)

    def __call__(self) -> ContextManager[None]:
        follower = None if self._follower is None else self._follower()
        return nullcontext() if follower is None else follower.no_sync()

    def __deepcopy__(self, memo: dict) -> "ModelNoSync":
        return self

    def __reduce__(self) -> Any:
        return (ModelNoSync, ())

    def __repr__(self) -> str:
        return "<DistOpt.no_sync of the model's DistOpt>"


class _Detach:
    """A hook-like handle (``remove()``) that takes ``model.no_sync`` away again, if it is still ours."""

    def __init__(self, model: Any, attached: ModelNoSync) -> None:
        self.model, self.attached = model, attached

    def remove(self) -> None:
        if self.model.__dict__.get("no_sync") is self.attached:
            del self.model.__dict__["no_sync"]


def attach_no_sync(model: Any, follower: Any, handles: list[Any]) -> None:
    """Give ``model`` (None: nothing) a ``no_sync`` calling ``follower.no_sync()`` unless it has one of its own (an
    earlier DistOpt's :class:`ModelNoSync` is replaced); append its remover to ``handles``."""
    if model is None:
        return
    own = getattr(model, "no_sync", None)
    if own is not None and not isinstance(own, ModelNoSync):
        return
    attached = ModelNoSync(follower)
    object.__setattr__(model, "no_sync", attached)
    handles.append(_Detach(model, attached))
