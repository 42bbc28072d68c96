"""DistOpt as a PyTorch optimizer, and its model-aware methods, as a mixin of :class:`~distopt.DistOpt`.

With a ``torch.optim.Optimizer`` inside, DistOpt answers what PyTorch code
asks of an optimizer: ``step(closure)``, ``zero_grad``, ``param_groups``,
``state``, ``add_param_group`` (so ``torch.amp.GradScaler`` takes it), plus
DDP's ``no_sync()`` and Horovod's ``broadcast_optimizer_state``
(:meth:`SurfaceMethods.broadcast_state`). LR schedulers check
``isinstance(optimizer, torch.optim.Optimizer)``: give them the inner
optimizer (``opt.opt``), whose own ``step()`` is just as correct.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .local import checked_pairs
from .metrics import broadcast_object
from .model_sync import average_arrays, broadcast_arrays, named_state
from .torch import TorchOptimizer, as_array

if TYPE_CHECKING:
    from .autosync import AutoSync
    from .comm.base import Communicator
    from .engine import Engine
    from .local import LocalOptimizer

__all__ = ["SurfaceMethods"]


class SurfaceMethods:
    """Mixin of :class:`~distopt.DistOpt`: the PyTorch optimizer surface and the model-aware methods."""

    comm: Communicator
    engine: Engine
    local: LocalOptimizer
    model: Any
    _sync: AutoSync | None

    def _torch(self, what: str) -> TorchOptimizer:
        if not isinstance(self.local, TorchOptimizer):
            raise TypeError(f"{what} needs a torch.optim.Optimizer inside DistOpt; this one wraps "
                            f"{type(self.local).__name__} (use step(params, grads) for array models)")
        return self.local

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)``: the gradients are averaged already (or now, if accumulated)."""
        import torch

        local = self._torch("step() without params")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (PyTorch's default: gradients set to None)."""
        local = self._torch("zero_grad()")
        if self._sync is not None:
            self._sync.drain(outside_backward=True)
        local.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (the same list: changing ``lr`` here changes it there)."""
        return self._torch("param_groups").optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state (``momentum_buffer``, Adam's moments)."""
        return self._torch("state").optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's default hyper-parameters."""
        return self._torch("defaults").optimizer.defaults

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer and take rank 0's values for it (collective).

        Every rank must call it with the same shapes. (A group added to the
        inner optimizer directly is also broadcast, at its first step.)

        Raises:
            CollectiveMismatchError: the new parameters differ across ranks.
        """
        local = self._torch("add_param_group()")
        local.optimizer.add_param_group(group)
        added = local.optimizer.param_groups[-1]["params"]
        self.engine.broadcast_params([as_array(p) for p in added], {"add_param_group": len(added)})
        local.hook(added)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's accumulation idiom: backward passes inside accumulate in ``.grad`` without communicating.

        The first backward after the block averages the accumulated sum
        (or ``step()`` does, if no backward follows)::

            opt.zero_grad()
            with opt.no_sync():
                (loss_of(batch_1) / 2).backward()
            (loss_of(batch_2) / 2).backward()   # averaged here
            opt.step()
        """
        self._torch("no_sync()")
        assert self._sync is not None
        self._sync.no_sync_depth += 1
        try:
            yield
        finally:
            self._sync.no_sync_depth -= 1

    def sync_buffers(self, mode: str = "broadcast", root: int = 0) -> None:
        """Synchronize the model's buffers (BatchNorm running statistics) now, e.g. before evaluation.

        Args:
            mode: ``"broadcast"`` (``root``'s values) or ``"average"``
                (float buffers averaged; integer ones, such as
                ``num_batches_tracked``, from rank 0).
            root: the rank whose buffers are broadcast.

        Raises:
            ValueError: no ``model=`` was given, or an unknown ``mode``.
        """
        if self.model is None:
            raise ValueError("sync_buffers() needs DistOpt(..., model=model)")
        if mode not in ("broadcast", "average"):
            raise ValueError(f"mode must be 'broadcast' or 'average', got {mode!r}")
        buffers = [as_array(b) for _, b in self.model.named_buffers()]
        if mode == "broadcast":
            broadcast_arrays(self.comm, buffers, root)
        else:
            average_arrays(self.comm, buffers)

    def broadcast_state(self, root: int = 0) -> None:
        """Give every rank ``root``'s parameters, buffers (with ``model=``) and inner optimizer state.

        Horovod's ``broadcast_parameters`` plus ``broadcast_optimizer_state``:
        restore a checkpoint on ``root`` only, then call this on every rank.
        The optimizer state includes the hyper-parameters of every group
        (learning rates, momentum) and per-parameter state (momentum
        buffers), which may be empty.
        """
        local = self._torch("broadcast_state()")
        arrays = local.arrays()
        if self.model is not None:
            arrays += named_state(self.model)[1]
        broadcast_arrays(self.comm, arrays, root)
        state = broadcast_object(self.comm, local.optimizer.state_dict() if self.comm.rank == root else None, root)
        if self.comm.rank != root:
            local.optimizer.load_state_dict(state)

    def average(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None) -> list[Any]:
        """Average ``grads`` across ranks in place with :attr:`strategy`, without updating (array models).

        Lets a user clip or inspect the average before their own update.

        Returns:
            The averaged gradients (the given arrays; a new array where a
            gradient was None and another rank had one). With
            ``check_finite``, all None when the step is to be skipped.

        Raises:
            ValueError: the strategy does not average gradients (partial),
                or ``params`` and ``grads`` do not match.
        """
        strategy = self.strategy  # type: ignore[attr-defined]
        if not strategy.reduces_gradients:
            raise ValueError(f"average() needs a strategy that averages gradients, not {strategy.name!r}")
        params, grads = checked_pairs(params, grads)
        pipeline = self._begin(strategy, params, threshold, grads=grads)  # type: ignore[attr-defined]
        outcome = self.engine.complete(pipeline, grads)
        if not outcome.applies:
            return [None] * len(grads)
        return [g if ok else None for g, ok in zip(grads, outcome.present)]
