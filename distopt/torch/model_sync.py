"""Model-aware synchronization: a module's parameters and buffers, by name, from one rank (:class:`ModelSync`)."""
from __future__ import annotations

from typing import Any, Callable, Container, Iterable, Sequence

import numpy as np

from ..core.buckets import is_float, pack, plan_buckets, unpack
from ..comm.base import Communicator
from ..comm.consensus import agree
from ..metrics import broadcast_object
from ..step.engine import DEFAULT_THRESHOLD, Engine
from ..errors import CollectiveMismatchError
from .adapter import TorchOptimizer, as_array

__all__ = ["ModelSync", "check_names", "broadcast_arrays", "average_arrays", "named_state", "parameter_names"]


def check_names(comm: Communicator, names: Sequence[str], what: str) -> None:
    """Compare ``names`` (in order) across ranks (collective: :func:`~distopt.comm.consensus.agree`).

    Raises:
        CollectiveMismatchError: on every rank, naming the first position where the ranks differ, every rank's name
            there, and the fix.
    """
    fields: dict[str, Any] = {f"{what} #{i}": name for i, name in enumerate(names)}
    agree(comm, fields, call="model check", error=CollectiveMismatchError, show=repr,
          hint="every rank must build the same model and give the optimizer its parameters in the same order")


def _fused(arrays: list[Any], collective: Callable[[Any], Any]) -> None:
    """Run ``collective`` in place on ``arrays`` packed into buckets per dtype, then unpack them."""
    for bucket in plan_buckets([(a.shape, a.dtype) for a in arrays], DEFAULT_THRESHOLD, DEFAULT_THRESHOLD):
        flat, viewed = pack(bucket, arrays)
        collective(flat)
        if not viewed:
            unpack(bucket, flat, arrays)


def broadcast_arrays(comm: Communicator, arrays: Sequence[Any], root: int = 0) -> None:
    """Overwrite ``arrays`` (NumPy/CuPy, any dtype) with ``root``'s values, fused per dtype (collective)."""
    _fused(list(arrays), lambda flat: comm.broadcast(flat, root=root))


def average_arrays(comm: Communicator, arrays: Sequence[Any]) -> None:
    """Average the float ``arrays`` across ranks in place; others get rank 0's values (collective)."""
    arrays = list(arrays)
    _fused([a for a in arrays if is_float(a)], lambda flat: comm.all_reduce(flat, op="avg"))
    broadcast_arrays(comm, [a for a in arrays if not is_float(a)], 0)


def named_state(model: Any, buffers: bool = True, skip: Container[int] = ()) -> tuple[list[str], list[Any]]:
    """``(names, arrays)``: every parameter of ``model`` (frozen ones too), then its buffers if asked, but those whose
    ``id`` is in ``skip``. Arrays are views: writing them changes the model. Tied parameters appear once."""
    named = list(model.named_parameters()) + (list(model.named_buffers()) if buffers else [])
    named = [(n, t) for n, t in named if id(t) not in skip]
    return [n for n, _ in named], [as_array(t) for _, t in named]


def _named(named_parameters: Iterable[tuple[str, Any]], params: Sequence[Any]) -> list[str]:
    """Horovod's ``named_parameters=``: the name of each optimizer parameter, in the optimizer's order.

    Raises:
        ValueError: a name given twice, or an optimizer parameter without a name.
    """
    pairs = list(named_parameters)
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"named_parameters must give each parameter one unique name; given more than once: {twice}")
    by_id = {id(p): n for n, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"named_parameters does not name the optimizer's parameter(s) #{unnamed} (of "
                         f"{len(params)}): pass model.named_parameters() of the model the optimizer trains")
    return [by_id[id(p)] for p in params]


def parameter_names(model: Any, params: Sequence[Any]) -> list[str]:
    """The model's name of each tensor in ``params`` (``"(outside the model) #i"`` where it has none)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), f"(outside the model) #{i}") for i, p in enumerate(params)]


def _guard_hooks_under_compile() -> None:
    """Make ``torch.compile`` run the buffer broadcast's forward hooks, whatever else it compiled: by default
    (``skip_nnmodule_hook_guards``) it reuses code compiled for another module of the same structure without checking
    the hooks. This turns those guards on and, when code was compiled before (``torch._dynamo`` loaded), drops it
    (``torch._dynamo.reset()``)."""
    import sys

    loaded = "torch._dynamo" in sys.modules
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        if loaded:
            torch._dynamo.reset()


class ModelSync:
    """A PyTorch optimizer's (and model's) tensors, synchronized across ranks from one rank.

    ``DistOpt(torch_opt, model=model)`` builds one: it checks the names and broadcasts rank 0's parameters (frozen ones
    and ones outside the optimizer included) and buffers at construction, and with ``broadcast_buffers=True`` before a
    training-mode forward that follows a synchronizing forward (DDP's ``require_forward_param_sync``, also under
    ``torch.compile``): with accumulation the buffers are broadcast at the first micro-batch of each step.

    Args:
        comm: the communicator.
        engine: the step engine (its checked parameter broadcast).
        local: the torch local optimizer.
        model: the ``torch.nn.Module``, or None (then only the optimizer's parameters are broadcast).
        broadcast_buffers: with ``model``, broadcast rank 0's buffers before each training-mode forward (DDP's default).
        named_parameters: Horovod's: ``(name, tensor)`` pairs naming every optimizer parameter, compared across ranks.
        join_phase: ``join_phase()`` is ``"no"`` outside ``join()``; inside, ``"first"`` at a step's first
            training-mode forward, when the lowest rank still training broadcasts the buffers and joined ranks shadow
            it (:meth:`shadow_forward`, as DDP's join hook), else ``"later"``.
        forward_syncs: whether a backward started now would average (DDP's ``require_backward_grad_sync``).

    Raises:
        CollectiveMismatchError: on every rank, naming the first name (or shape or dtype) that differs across ranks.
        ValueError: ``named_parameters`` names a parameter twice or misses one.
    """

    def __init__(self, comm: Communicator, engine: Engine, local: TorchOptimizer, model: Any,
                 broadcast_buffers: bool, join_phase: Callable[[], str] = lambda: "no",
                 named_parameters: Iterable[tuple[str, Any]] | None = None,
                 forward_syncs: Callable[[], bool] = lambda: True) -> None:
        self.comm, self.engine, self.local, self.model = comm, engine, local, model
        self.join_phase = join_phase
        self.sync_next = True  # the next training forward broadcasts the buffers (DDP's require_forward_param_sync)
        self.hooked = False  # buffers are broadcast before each training-mode forward
        settings = {"world_size": comm.size}
        if named_parameters is not None:
            check_names(comm, _named(named_parameters, local.params()), "optimizer parameter")
        if model is None:
            engine.broadcast_params(local.arrays(), settings)
            return
        names, arrays = named_state(model, skip=local.deferred)  # meta-built: checked and broadcast by zero=3
        check_names(comm, names, "model parameter or buffer")
        check_names(comm, parameter_names(model, local.params()), "optimizer parameter")
        engine.broadcast_params(arrays, settings, names)
        in_model = {id(p) for p in model.parameters()}
        outside = [as_array(p) for p in local.params() if id(p) not in in_model]
        if outside:
            engine.broadcast_params(outside, settings)
        if broadcast_buffers and any(True for _ in model.buffers()):
            def before_forward(module: Any, inputs: Any) -> None:  # noqa: ARG001
                where = self.join_phase()
                if module.training and where == "no" and self.sync_next:
                    self.sync_buffers("broadcast", 0)
                elif module.training and where == "first":
                    self.sync_buffers("broadcast", min(self._active(True)))

            def after_forward(module: Any, inputs: Any, output: Any) -> None:  # noqa: ARG001
                self.sync_next = torch.is_grad_enabled() and forward_syncs()

            import torch

            _guard_hooks_under_compile()
            local.handles.append(model.register_forward_pre_hook(torch.compiler.disable(before_forward)))
            local.handles.append(model.register_forward_hook(torch.compiler.disable(after_forward)))
            self.hooked = True

    def _active(self, active: bool) -> list[int]:
        """The ranks still training, from every rank's vote (one all-reduce of ``world_size`` int32)."""
        votes = np.zeros(self.comm.size, dtype=np.int32)
        votes[self.comm.rank] = int(active)
        self.comm.all_reduce(votes, op="sum")
        return np.flatnonzero(votes).tolist()

    def shadow_forward(self) -> int:
        """A joined rank's part of the active ranks' buffer broadcast; returns how many ranks still train."""
        active = self._active(False)
        if active:
            self.sync_buffers("broadcast", min(active))
        return len(active)

    def after_join(self, last: int) -> None:
        """Every rank takes the buffers of the last rank to join (its forward updated them last)."""
        self.sync_buffers("broadcast", last)

    def join_hooks(self) -> tuple[Callable[[], int] | None, Callable[[int], None] | None]:
        """``(shadow_forward, after_join)`` for the runner's join loop, or ``(None, None)`` when no buffer is broadcast
        before the forward."""
        return (self.shadow_forward, self.after_join) if self.hooked else (None, None)

    def sync_buffers(self, mode: str = "broadcast", root: int = 0) -> None:
        """Synchronize the model's buffers (BatchNorm running statistics) now (see ``DistOpt.sync_buffers``).

        Raises:
            ValueError: no model was given, or an unknown ``mode``.
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

    def broadcast_state(self, root: int = 0, schedulers: Sequence[Any] = ()) -> None:
        """Give every rank ``root``'s parameters, buffers, inner optimizer state and ``schedulers``' state (see
        ``DistOpt.broadcast_state``; collective)."""
        arrays = self.local.arrays()
        if self.model is not None:
            arrays += named_state(self.model)[1]
        broadcast_arrays(self.comm, arrays, root)
        optimizer = self.local.optimizer
        mine = (optimizer.state_dict(), [s.state_dict() for s in schedulers]) if self.comm.rank == root else None
        state, scheduler_states = broadcast_object(self.comm, mine, root)
        counts = np.zeros(self.comm.size, dtype=np.int64)
        counts[self.comm.rank] = len(schedulers)
        self.comm.all_reduce(counts, op="sum")  # every rank learns every count: all raise together
        if (counts != len(scheduler_states)).any():
            raise ValueError(f"broadcast_state(schedulers=...): every rank must pass the same number of schedulers; "
                             f"per rank: {counts.tolist()}")
        if self.comm.rank != root:
            optimizer.load_state_dict(state)
            for scheduler, saved in zip(schedulers, scheduler_states):
                scheduler.load_state_dict(saved)

    def add_param_group(self, group: dict[str, Any], on_grad: Any) -> None:
        """Add ``group`` to the inner optimizer, take rank 0's values for it, hook it (collective).

        Raises:
            CollectiveMismatchError: the new parameters differ across ranks.
        """
        optimizer = self.local.optimizer
        optimizer.add_param_group(group)
        added = optimizer.param_groups[-1]["params"]
        self.engine.broadcast_params([as_array(p) for p in added], {"add_param_group": len(added)})
        self.local.hook(added, on_grad)
