"""A sharded optimizer over a ``torch.optim.Optimizer`` (``DistOpt(opt, zero=1|2|3)``).

The inner optimizer keeps its class, parameter groups and
hyper-parameters (LR schedulers work unchanged) but, from the end of each
synchronizing backward until its ``step()`` returns, its groups hold this
rank's *shard tensors*: 1-D views into the parameters, one per piece of a
parameter that falls in this rank's segment of a bucket
(:mod:`distopt.sharding.plan`), whose ``.grad`` is a view into the reduced
segment. So ``step()`` updates only this rank's pieces and the optimizer's
state (momentum, Adam's moments) holds 1/W of the elements; ``GradScaler``
unscales and checks the shard gradients; then the parameters are
all-gathered. The update must be elementwise (see
:func:`~distopt.torch.zero.placeholder.check_elementwise`).

After the reduction, ``.grad`` of a parameter holds:

* stage 1: the whole average, as with ``zero=0`` (the gradients are
  all-reduced; the shard tensors' gradients are views into ``.grad``), so
  ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler``
  and any in-place edit of ``.grad`` act on what the update reads;
* stage 2: a placeholder of the parameter's shape (:func:`~distopt.torch.zero.placeholder.sharded_grad`):
  the gradient lives only in this rank's segments, and any use of the
  placeholder raises an error naming ``opt.clip_grad_norm_`` (the global
  norm over every rank's shard), never a silently per-rank result. It is
  None again after ``step()`` and ``zero_grad()``. Another backward before
  ``step()`` accumulates: outside ``no_sync()`` its reduce-scatter adds to
  the held segments (FSDP's accumulation), inside it sums locally in
  ``.grad`` until the next synchronizing backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from ...comm.consensus import gather_objects
from ...sharding.gather import ParamGather
from ...sharding.plan import ShardPlan
from ...sharding.shard_state import consolidate
from ...sharding.sync import PieceUpdate, ShardedStep
from ...step.outcome import Outcome
from ...step.pipeline import BucketPipeline
from ..adapter import TorchOptimizer, as_array, as_tensor
from ..sink import GradientSink
from .clip import ShardedClip
from .placeholder import is_sharded_grad, sharded_grad

__all__ = ["ShardedTorchStep"]

class ShardedTorchStep(GradientSink):
    """A sharded optimizer's gradient sink: shard tensors, the swap of the inner optimizer's groups, and
    the parameter all-gather.

    Args:
        comm: the communicator (re-sharding the state, the clipping norm).
        local: the torch local optimizer.
        stage: 1 or 2.
        overlap_param_gather: leave each bucket's gather in flight until the
            next forward reaches its parameters (see :meth:`hook_model`).

    Attributes:
        swapped: the inner optimizer's groups hold the shard tensors now.
        densify: True: a sparse gradient is reduced densely in its bucket.
        shards_optimizer: True: no parameter may be shared with another DistOpt.
    """

    densify = True
    shards_optimizer = True

    def __init__(self, comm: Any, local: TorchOptimizer, stage: int, overlap_param_gather: bool) -> None:
        self.comm, self.local, self.stage, self.overlap = comm, local, stage, overlap_param_gather
        self.swapped = False
        self._real: list[list[Any]] = []
        self._key: tuple[Any, ...] | None = None
        self.plan: ShardPlan | None = None
        self.tensors: list[Any] = []  # the parameters of the plan, in the step's order
        self.shards: list[Any] = []  # one shard tensor per piece of the plan
        self._groups: list[int] = []  # the parameter group of each piece
        self._step: ShardedStep | None = None
        self._gather: ParamGather | None = None
        self.restore: Any = None  # called once the first plan is bound (a checkpoint loaded before it)
        self._unstepped: tuple[ShardedStep, list[bool]] | None = None  # a reduced gradient not stepped yet
        self._cleared: set[int] = set()  # tensors whose placeholder a new backward replaces
        self._parked: dict[int, dict[str, Any]] = {}  # the state of parameters outside the layout (frozen now)
        self._clip = ShardedClip(comm)

    # ------------------------------------------------------- shard tensors
    def _bind(self, plan: ShardPlan, tensors: Sequence[Any]) -> None:
        """Shard tensors for ``plan``'s pieces. A new layout (``requires_grad`` changed, a group added)
        re-shards the state: every rank's pieces are consolidated (collective: every rank binds the new
        layout at the same step) and each rank takes its new pieces."""
        key = (id(plan), tuple(id(t) for t in tensors))
        if key == self._key:
            return
        state = self.local.optimizer.state
        full = None
        if self.plan is not None:
            shapes = [self.shape(p) for p in self.local.params()]
            full = consolidate(gather_objects(self.comm, self.pieces()), shapes)
            for s in self.shards:
                state.pop(s, None)
        group_of = {id(p): g for g, group in enumerate(self.local.optimizer.param_groups) for p in group["params"]}
        self.shards = self.shard_tensors(plan, tensors)
        self._key, self.plan, self.tensors = key, plan, list(tensors)
        self._groups = [group_of[id(tensors[p.index])] for p in plan.pieces]
        if full:
            self.load_full(full, self.local.params())
        if self.restore is not None:  # a state loaded before the first sharded step
            restore, self.restore = self.restore, None
            restore()

    def shard_tensors(self, plan: ShardPlan, tensors: Sequence[Any]) -> list[Any]:
        """One shard tensor per piece of ``plan``: a 1-D view into its parameter."""
        return [tensors[p.index].detach().view(-1)[p.start:p.stop] for p in plan.pieces]

    def shape(self, tensor: Any) -> tuple[int, ...]:
        """A parameter's shape (stage 3 knows it while the tensor is freed)."""
        return tuple(tensor.shape)

    def adopt(self, pipeline: BucketPipeline, tensors: Sequence[Any], grads: Sequence[Any],
              outcome: Outcome, skipped: bool, shadow: bool, views: Sequence[Any] | None) -> None:
        """After a sharded reduction: set ``.grad`` (see the module docs) and swap the shard tensors in.

        A second reduction before ``step()`` (several backward passes outside
        ``no_sync()``) adds to the first at stage 2 and 3: its segments
        receive the held ones (FSDP's accumulation into the sharded gradient);
        at stage 1 autograd already summed it into ``.grad``, whose whole
        average was reduced again, as at ``zero=0``.
        """
        step = pipeline.sync
        assert isinstance(step, PieceUpdate)
        plan = step.plan
        self.swap_out()
        self._bind(plan, tensors)
        present = list(outcome.present)
        held, self._unstepped = self._unstepped, None
        if isinstance(step, ShardedStep) and held is not None and outcome.applies and not skipped:
            before, had = held
            for run, held_run in zip(step.runs, before.runs):
                if run.segment is not None and held_run.segment is not None:
                    run.segment += held_run.segment
            present = [a or h for a, h in zip(present, had)]
        self._step = step
        if self.stage == 1:  # the whole average, as zero=0; the shard gradients view it
            super().adopt(pipeline, tensors, grads, outcome, skipped, shadow, views)
        else:
            for t, ok in zip(tensors, present):
                t.grad = sharded_grad(t.detach(), self.stage) if outcome.applies and ok and not skipped else None
            self._replace_on_backward(tensors)
        if skipped or not outcome.applies:
            return
        if isinstance(step, ShardedStep):
            self._unstepped = (step, present)
        for p, s in zip(plan.pieces, self.shards):
            t = tensors[p.index]
            if not present[p.index]:
                s.grad = None
            elif isinstance(step, ShardedStep):
                s.grad = as_tensor(step.segments[p.bucket])[p.offset:p.offset + p.size]
            else:
                s.grad = t.grad.view(-1)[p.start:p.stop]
        self._swap_in()

    def _replace_on_backward(self, tensors: Sequence[Any]) -> None:
        """A hook on each tensor (once) that runs before autograd accumulates a new gradient into ``.grad``:
        it drops the placeholder, so the new backward's gradient is this rank's own, which its reduction
        adds to the held segments (:meth:`adopt`) or ``no_sync()`` accumulates locally."""
        for t in tensors:
            if id(t) in self._cleared or not t.requires_grad:
                continue
            self._cleared.add(id(t))

            def replace(grad: Any, t: Any = t) -> None:
                if is_sharded_grad(t.grad):
                    t.grad = None

            self.local.handles.append(t.register_hook(replace))

    def _swap_in(self) -> None:
        groups = self.local.optimizer.param_groups
        self._real = [group["params"] for group in groups]
        mine: list[list[Any]] = [[] for _ in groups]
        for s, g in zip(self.shards, self._groups):
            mine[g].append(s)
        for group, shards in zip(groups, mine):
            group["params"] = shards
        self.swapped = True
        self.local.real_groups = self._real

    def swap_out(self) -> None:
        """Give the inner optimizer its own parameter lists back (a no-op when not swapped)."""
        if not self.swapped:
            return
        for group, params in zip(self.local.optimizer.param_groups, self._real):
            group["params"] = params
        self.swapped, self._real = False, []
        self.local.real_groups = None

    def end_of_backward(self) -> None:
        """At the end of every backward pass: a placeholder this backward did not replace (its tensor got
        no new gradient) is dropped, so a reduction now reads no gradient there; what the held step
        reduced for it stays in the held segments."""
        self._drop_placeholders()

    def before_zero_grad(self) -> None:
        """Give the inner optimizer its own groups back and drop stage 2's placeholders, so ``zero_grad``
        (``set_to_none`` or not) works as without sharding."""
        self.swap_out()
        self._drop_placeholders()
        self._unstepped = None

    def _drop_placeholders(self) -> None:
        for t in self.tensors:
            if is_sharded_grad(t.grad):
                t.grad = None

    @contextmanager
    def unswapped(self) -> Iterator[None]:
        """The inner optimizer with its own groups inside the block (a state dict between backward and
        ``step()``), swapped back after it if it was."""
        was = self.swapped
        self.swap_out()
        try:
            yield
        finally:
            if was:
                self._swap_in()

    # ---------------------------------------------------------- the gather
    def after_step(self, applied: bool) -> None:
        """After the inner ``step()``: swap back, drop the shard gradients, gather the parameters."""
        self.swap_out()
        step, self._step, self._unstepped = self._step, None, None
        for s in self.shards:
            s.grad = None
        self._drop_placeholders()
        if not applied or step is None:
            return
        self.wait()
        self._gather = step.gather([as_array(t) for t in self.tensors], asynchronous=self.overlap)

    def wait(self, tensors: Sequence[Any] | None = None) -> None:
        """Complete the parameter gathers still in flight: all of them, or those holding ``tensors``."""
        gather = self._gather
        if gather is None:
            return
        if tensors is None:
            gather.wait_all()
        else:
            index = {id(t): i for i, t in enumerate(self.tensors)}
            for b in gather.buckets_of({index[id(t)] for t in tensors if id(t) in index}):
                gather.wait(b)
        if not gather.pending:
            self._gather = None

    def hook_model(self, model: Any) -> list[Any]:
        """Forward pre-hooks on every module of ``model`` that owns parameters: each waits for the
        gathers of its own parameters (``overlap_param_gather``); ``model.state_dict()`` waits for all.
        Returns the hook handles."""
        handles = [model.register_state_dict_pre_hook(lambda *args, **kwargs: self.wait())]
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own:
                handles.append(module.register_forward_pre_hook(lambda m, args, own=own: self.wait(own)))
        return handles

    # ---------------------------------------------------------- clipping
    def clip_grad_norm_(self, params: Sequence[Any], max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip by the global ``norm_type`` norm; returns it (a 0-dim tensor of the gradients' dtype).

        Stage 1 (``.grad`` holds the whole average), and any stage outside a
        reduced step (a skipped one's NaN ``.grad``): ``torch.nn.utils.clip_grad_norm_``
        over ``params``. Stage 2: the shard gradients, by torch's formula over
        every rank's pieces (collective, :class:`~distopt.torch.zero.clip.ShardedClip`).
        Both equal ``zero=0``'s ``clip_grad_norm_`` over ``params`` bitwise on CPU.
        """
        if self.stage == 1 or not self.swapped or self.plan is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        numels = [int(np.prod(self.shape(t))) for t in self.tensors]
        return self._clip(self.plan, self.tensors, numels, [s.grad for s in self.shards], params, max_norm, norm_type)

    # ---------------------------------------------------------- checkpoints
    def pieces(self) -> list[tuple[int, int, int, Any]]:
        """``(parameter number, start, stop, state)`` of every piece this rank owns, the parameter number
        counted over the inner optimizer's own groups, the state the optimizer's entry for the piece; a
        parameter outside the layout now (frozen) appears whole, with the state it had."""
        parked = [(n, 0, int(np.prod(entry["_shape"])), {k: v for k, v in entry.items() if k != "_shape"})
                  for n, entry in self._parked.items()]
        if self.plan is None:
            return parked
        number = {id(p): i for i, p in enumerate(self.local.params())}
        state = self.local.optimizer.state
        return [(number[id(self.tensors[p.index])], p.start, p.stop, state.get(s, {}))
                for p, s in zip(self.plan.pieces, self.shards)] + parked

    def load_full(self, full_state: dict[int, dict[str, Any]], params: Sequence[Any]) -> int:
        """Take this rank's pieces of a consolidated per-parameter state (numbered as :meth:`pieces`);
        returns the pieces restored. Tensors of a parameter's size are sliced, the rest copied."""
        import torch

        if self.plan is None:
            return 0
        number = {id(p): i for i, p in enumerate(params)}
        covered = {number[id(t)] for t in self.tensors}  # in the layout (on some rank)
        numels = [int(np.prod(self.shape(p))) for p in params]
        self._parked = {n: {**{k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.numel() == numels[n]
                               and v.dim() > 0 else v for k, v in entry.items()}, "_shape": self.shape(params[n])}
                        for n, entry in full_state.items() if n not in covered and entry}
        state = self.local.optimizer.state
        done = 0
        for p, s in zip(self.plan.pieces, self.shards):
            entry = full_state.get(number[id(self.tensors[p.index])])
            if entry is None:
                continue
            numel = numels[number[id(self.tensors[p.index])]]
            state[s] = {k: (v.reshape(-1)[p.start:p.stop].clone() if isinstance(v, torch.Tensor) and v.numel() == numel
                            and v.dim() > 0 else v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in entry.items()}
            done += 1
        return done
