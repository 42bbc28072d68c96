"""DistOpt IS a ``torch.optim.Optimizer`` when it wraps one.

``DistOpt(torch_opt)`` builds an instance of a subclass of both :class:`~distopt.DistOpt` and
``torch.optim.Optimizer``, made here once per process (the same idea as Horovod's dynamic subclass, without its
pitfall: ``torch.optim.Optimizer.__init__`` never runs, so no second copy of the parameter groups exists). The instance
shares the inner optimizer's ``param_groups``, ``state`` and ``defaults`` (the same objects), so LR schedulers
(``StepLR``, ``OneCycleLR``, ``LambdaLR``, ``SequentialLR``, ``ReduceLROnPlateau``), ``GradScaler`` and anything that
checks ``isinstance(optimizer, torch.optim.Optimizer)`` take it. Step and state-dict hooks registered on it are
registered on the inner optimizer, whose ``step()`` is the one that runs. ``DistOpt(array_opt)`` stays a plain
:class:`~distopt.DistOpt`; torch is never imported for it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .adapter import TorchOptimizer
from .follower import Follower
from .model_sync import ModelSync

__all__ = ["optimizer_class", "TorchSurface"]

_CLASSES: dict[type, type] = {}


class TorchSurface:
    """What a ``torch.optim.Optimizer`` has, for a DistOpt over one (a base of the class :func:`optimizer_class`
    makes; it only calls the DistOpt's public collaborators ``follower``, ``model_sync`` and ``local``)."""

    follower: Follower
    model_sync: ModelSync
    local: TorchOptimizer
    world_size: int

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (the same list: a scheduler changing ``lr`` here changes it there)."""
        return self.local.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state (``momentum_buffer``, Adam's moments)."""
        return self.local.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's default hyper-parameters."""
        return self.local.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (PyTorch's default: gradients set to None), after completing the
        reductions of a backward that raised."""
        self.follower.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer and take rank 0's values for it (collective; every rank adds
        the same shapes). CollectiveMismatchError on every rank if they differ; ValueError with mixed precision
        (``param_dtype``/``reduce_dtype``: the masters are taken at construction)."""
        if getattr(self.follower.sink, "precision", None) is not None:
            raise ValueError("add_param_group() with param_dtype=/reduce_dtype= (mixed precision): the float32 "
                             "masters are taken from the optimizer's groups at construction; pass every group to "
                             "the optimizer before wrapping it in DistOpt")
        self.model_sync.add_param_group(param_group, self.follower.on_grad)

    def no_sync(self) -> Any:
        """DDP's accumulation idiom: backward passes inside accumulate in ``.grad`` without communicating; the first
        backward after the block (or ``step()``) averages the accumulated sum."""
        return self.follower.no_sync()

    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: a no-op when ``.grad`` is averaged already (it is after each synchronizing
        backward); averages an accumulation still pending (``no_sync``) now. With ``overlap_param_gather`` it also
        completes the parameter all-gathers still in flight."""
        self.follower.synchronize()
        self.follower.sink.wait()

    def summon_full_params(self, writeback: bool = True, modifier_rank: int | None = None) -> Any:
        """FSDP's context manager: every parameter of the model whole inside the block (collective on entry and exit).
        With ``zero=3`` the parameters are gathered (``model.parameters()`` hold one element at rest) and freed after
        it, keeping what the block wrote with ``writeback``; at other stages they are always whole.
        ``modifier_rank=r`` (DeepSpeed's ``GatheredParameters``): rank r's writes become every rank's. Without it,
        writes made on some ranks only raise RuntimeError on every rank (at ``zero=3`` they are discarded).
        ValueError for a ``modifier_rank`` outside the world; RuntimeError inside a forward pass."""
        return self.follower.sink.full_parameters(writeback, modifier_rank, self.follower.runner.engine.comm,
                                                  self.follower.local.params())

    def skip_synchronize(self) -> Any:
        """Horovod's ``with opt.skip_synchronize(): opt.step()``: the step averages nothing more."""
        return self.follower.skip_synchronize()

    def sync_buffers(self, mode: str = "broadcast", root: int = 0) -> None:
        """Synchronize the model's buffers now: ``"broadcast"`` ``root``'s, or ``"average"`` the float ones (integer
        ones from rank 0). ValueError without ``model=`` or for another ``mode``."""
        self.model_sync.sync_buffers(mode, root)

    def broadcast_state(self, root: int = 0, schedulers: Sequence[Any] = ()) -> None:
        """Give every rank ``root``'s parameters, buffers (with ``model=``), inner optimizer state and the state of
        ``schedulers`` (LR schedulers, in the same order on every rank): Horovod's ``broadcast_parameters`` plus
        ``broadcast_optimizer_state``, for a checkpoint restored on ``root``."""
        self.model_sync.broadcast_state(root, schedulers)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip the averaged gradients by their global norm, after backward: ``torch.nn.utils.clip_grad_norm_`` over
        the inner optimizer's parameters; with ``zero=2`` the same formula over every rank's pieces (collective,
        :class:`~distopt.torch.zero.clip.ShardedClip`; bitwise the unsharded result on CPU). Returns the norm (a 0-dim
        tensor of the gradients' dtype)."""
        return self.follower.sink.clip_grad_norm_(self.local.params(), max_norm, norm_type)

    def __repr__(self) -> str:
        return f"DistOpt({self.local.optimizer!r}, world_size={self.world_size})"


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.local.optimizer, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` of the inner optimizer (whose ``step()`` and ``state_dict()`` run)."
    return method


def optimizer_class(face: type) -> type:
    """The subclass of ``face`` and ``torch.optim.Optimizer`` that ``face(torch_opt)`` instantiates.

    Args:
        face: :class:`~distopt.DistOpt` (or a user's subclass of it).

    Returns:
        A class named like ``face``; ``face``'s methods come first in its MRO.
    """
    import torch

    if issubclass(face, torch.optim.Optimizer):
        return face
    cls = _CLASSES.get(face)
    if cls is None:
        hooks = ("register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
                 "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
                 "register_load_state_dict_post_hook")
        body: dict[str, Any] = {name: _delegate(name) for name in hooks}
        body.update(__module__=face.__module__, __doc__=face.__doc__, __qualname__=face.__qualname__)
        cls = _CLASSES[face] = type(face.__name__, (face, TorchSurface, torch.optim.Optimizer), body)
    return cls
