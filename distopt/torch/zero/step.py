"""A sharded optimizer over a ``torch.optim.Optimizer`` (``DistOpt(opt, zero=1|2|3)``).

The inner optimizer keeps its class, parameter groups and hyper-parameters (LR schedulers work unchanged) but,
from the end of each synchronizing backward until its ``step()`` returns, its groups hold this rank's *shard
tensors*: 1-D views into the parameters, one per piece of a parameter in this rank's segment of a bucket
(:mod:`distopt.sharding.plan`), whose ``.grad`` views the reduced segment. So ``step()`` updates only this rank's
pieces and the optimizer's state holds 1/W of the elements; ``GradScaler`` unscales and checks the shard
gradients; then the parameters are all-gathered. The update must be elementwise
(:func:`~distopt.torch.zero.placeholder.check_elementwise`).

After the reduction, ``.grad`` of a parameter holds:

* stage 1: the whole average, as with ``zero=0`` (the shard gradients view it), so ``clip_grad_norm_``,
  ``clip_grad_value_``, ``GradScaler`` and any in-place edit of ``.grad`` act on what the update reads;
* stage 2: a placeholder of the parameter's shape (:func:`~distopt.torch.zero.placeholder.sharded_grad`): the
  gradient lives only in this rank's segments, and any use of the placeholder raises an error naming
  ``opt.clip_grad_norm_`` (the global norm over every rank's shard). It is None again after ``step()`` and
  ``zero_grad()``. Another backward before ``step()`` accumulates: outside ``no_sync()`` its reduce-scatter adds
  to the held segments (FSDP's accumulation), inside it sums locally in ``.grad``. During a backward outside
  ``no_sync()``, ``.grad`` is None once packed in its bucket (:meth:`~distopt.torch.sink.GradientSink.packed`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from ...comm.consensus import gather_objects
from ...sharding.gather import ParamGather
from ...sharding.plan import ShardPlan, plan_shards
from ...sharding.sync import PieceUpdate, ShardedStep
from ...step.outcome import Outcome
from ...step.pipeline import BucketPipeline
from ..adapter import TorchOptimizer, as_array, as_tensor
from ..sink import GradientSink
from .clip import ShardedClip
from .flat_params import FlatParams
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
            next forward reaches its parameters (:func:`~distopt.torch.zero.state.wait_hooks`).

    Attributes:
        swapped: the inner optimizer's groups hold the shard tensors now.
        densify: True: a sparse gradient is reduced densely in its bucket.
        shards_optimizer: True: no parameter may be shared with another DistOpt.
    """

    densify = True
    shards_optimizer = True

    def __init__(self, comm: Any, local: TorchOptimizer, stage: int, overlap_param_gather: bool) -> None:
        self.comm, self.local, self.stage, self.overlap = comm, local, stage, overlap_param_gather
        self.swapped, self.whole_grad = False, stage == 1  # whole_grad: .grad holds the whole average (stage 1)
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
        self._clip, self._flat = ShardedClip(comm), FlatParams()
        self._planned: Any = None  # the follower's layout of the next step (bind)

    def bind(self, follower: Any) -> None:
        """Keep the follower's layout planner: a restore before the first step binds the layout now."""
        self._planned = follower.planned

    def bind_planned(self) -> None:
        """Bind the layout the next step will use, if none is bound yet (no communication)."""
        if self.plan is None and self._planned is not None:
            tensors, buckets = self._planned()
            self._bind(plan_shards(buckets, self.comm.rank, self.comm.size), tensors, buckets)

    # ------------------------------------------------------- shard tensors
    def _bind(self, plan: ShardPlan, tensors: Sequence[Any], buckets: Sequence[Any]) -> None:
        """Shard tensors for ``plan``'s pieces. A new layout (``requires_grad`` changed, a group added)
        re-shards the state: every rank's pieces are all-gathered (collective: every rank binds the new
        layout at the same step) and each rank takes its new pieces."""
        key = (plan, tuple(id(t) for t in tensors))
        if self._key is not None and key[1] == self._key[1] and (plan is self._key[0] or plan == self._key[0]):
            self._key = key  # the same layout (a plan bound before the first step, or the pipeline's own)
            return
        everyone = None
        if self.plan is not None:
            everyone = gather_objects(self.comm, self.pieces())
            for s in self.shards:  # the old shard tensors' state goes with them
                self.local.optimizer.state.pop(s, None)
        group_of = {id(p): g for g, group in enumerate(self.local.optimizer.param_groups) for p in group["params"]}
        self.shards = self.shard_tensors(plan, tensors, buckets)
        self._key, self.plan, self.tensors = key, plan, list(tensors)
        self._groups = [group_of[id(tensors[p.index])] for p in plan.pieces]
        if everyone is not None:
            taken: dict[Any, dict[str, Any]] = {}
            for pieces in everyone:
                self.take_pieces(pieces, None, taken)
            self.install(taken)
        if self.restore is not None:  # a state loaded before the first sharded step
            restore, self.restore = self.restore, None
            restore()

    def shard_tensors(self, plan: ShardPlan, tensors: Sequence[Any], buckets: Sequence[Any]) -> list[Any]:
        """One shard tensor per piece of ``plan``: a 1-D view into its parameter, laid in its bucket first
        (:class:`~distopt.torch.zero.flat_params.FlatParams`: the gather then writes the parameters in place)."""
        self._flat.lay(buckets, tensors)
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
        self._bind(plan, tensors, step.buckets)
        self._flat.check()
        present = list(outcome.present)
        held, self._unstepped = self._unstepped, None
        if isinstance(step, ShardedStep) and held is not None and outcome.applies and not skipped:
            before, had = held
            for run, held_run in zip(step.runs, before.runs):
                if run.segment is not None and held_run.segment is not None:
                    run.segment += held_run.segment
            present = [a or h for a, h in zip(present, had)]
        self._step = step
        if self.whole_grad:  # the whole average, as zero=0; the shard gradients view it
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
                s.grad = self.piece_grad(t, grads[p.index], p)
        if step.not_finite:  # stage 1: an overflow in some rank's pieces reaches every rank's GradScaler
            for s in self.shards:
                s.grad = None if s.grad is None else s.grad.new_full(s.grad.shape, float("nan"))
        self._swap_in()

    def piece_grad(self, tensor: Any, grad: Any, piece: Any) -> Any:  # noqa: ARG002
        """Stage 1: a piece's averaged gradient, a view into its parameter's ``.grad`` (``grad``: the reduced array)."""
        return tensor.grad.view(-1)[piece.start:piece.stop]

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
        for g, group in enumerate(groups):
            group["params"] = [s for s, k in zip(self.shards, self._groups) if k == g]
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
        self._drop_segments()

    def _drop_segments(self) -> None:
        """Stage 2 and 3: the held step's segments are dead (an update consumed them, or ``zero_grad``)."""
        held, self._unstepped = self._unstepped, None
        if held is not None:
            held[0].drop_segments()

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
        step, self._step = self._step, None
        for s in self.shards:
            s.grad = None
        self._drop_placeholders()
        self._drop_segments()
        if not applied or step is None:
            return
        self.wait()
        self._gather = step.gather([as_array(t) for t in self.tensors], self.overlap, self._flat.arrays())

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

    # ---------------------------------------------------------- clipping
    def clip_grad_norm_(self, params: Sequence[Any], max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip by the global ``norm_type`` norm; returns it (a 0-dim tensor of the gradients' dtype).

        Stage 1 (``.grad`` holds the whole average), and any stage outside a
        reduced step (a skipped one's NaN ``.grad``): ``torch.nn.utils.clip_grad_norm_``
        over ``params``. Stage 2: the shard gradients, by torch's formula over
        every rank's pieces (collective, :class:`~distopt.torch.zero.clip.ShardedClip`).
        Both equal ``zero=0``'s ``clip_grad_norm_`` over ``params`` bitwise on CPU.
        """
        if self.whole_grad or not self.swapped or self.plan is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        numels = [int(np.prod(self.shape(t))) for t in self.tensors]
        return self._clip(self.plan, self.tensors, numels, [s.grad for s in self.shards], params, max_norm, norm_type)

    # ---------------------------------------------------------- checkpoints
    def pieces(self) -> list[tuple[int, int, int, Any]]:
        """``(parameter number, start, stop, state)`` of every piece this rank owns, the parameter number
        counted over the inner optimizer's own groups, the state the optimizer's entry for the piece; every
        parameter outside the layout now (frozen) appears whole, with the state it had (or none)."""
        return self._laid_out() + self._outside()

    def _laid_out(self) -> list[tuple[int, int, int, Any]]:
        if self.plan is None:
            return []
        number = {id(p): i for i, p in enumerate(self.local.params())}
        state = self.local.optimizer.state
        return [(number[id(self.tensors[p.index])], p.start, p.stop, state.get(s, {}))
                for p, s in zip(self.plan.pieces, self.shards)]

    def _outside(self) -> list[tuple[int, int, int, Any]]:
        """Every parameter outside the layout, whole (the same on every rank), with the state it had."""
        laid = {id(t) for t in self.tensors}
        return [(n, 0, int(np.prod(self.shape(p))), self._parked.get(n, {}))
                for n, p in enumerate(self.local.params()) if id(p) not in laid]

    def piece_values(self) -> list[Any]:
        """A copy of this rank's elements of each parameter, one 1-D tensor per piece of :meth:`pieces`."""
        params = self.local.params()
        values = [] if self.plan is None else [s.detach().clone() for s in self.shards]
        return values + [params[n].detach().reshape(-1).clone() for n, *_ in self._outside()]

    def write_values(self, number: int, start: int, stop: int, values: Any) -> None:
        """Write elements ``start:stop`` of the flattened parameter ``number`` (as :meth:`pieces` counts):
        the parameter is whole on every rank at stages 1 and 2."""
        self.local.params()[number].detach().view(-1)[start:stop].copy_(values)

    def take_pieces(self, pieces: Sequence[tuple[int, int, int, Any]], values: Sequence[Any] | None,
                    into: dict[Any, dict[str, Any]]) -> None:
        """Take, from another rank's (or world's) :meth:`pieces` and :meth:`piece_values`, the elements that
        fall in this rank's pieces, into ``into`` (keyed by shard tensor, or ``("parked", number)`` for a
        parameter outside the layout); the parameters' values are written at once (:meth:`write_values`).
        Tensors of a piece's size are placed elementwise, other values (``step``) taken once."""
        import torch

        params = self.local.params()
        number = {id(p): i for i, p in enumerate(params)}
        mine: dict[int, list[tuple[int, int, Any]]] = {number[id(t)]: [] for t in self.tensors}
        if self.plan is not None:
            for p, s in zip(self.plan.pieces, self.shards):
                mine.setdefault(number[id(self.tensors[p.index])], []).append((p.start, p.stop, s))
        for k, (n, start, stop, state) in enumerate(pieces):
            if values is not None and values[k] is not None:
                self.write_values(n, start, stop, values[k])
            if not state:
                continue
            targets = mine.get(n, [(0, int(np.prod(self.shape(params[n]))), ("parked", n))])
            for lo, hi, key in targets:
                a, b = max(lo, start), min(hi, stop)
                if a >= b:
                    continue
                entry = into.setdefault(key, {})
                for name, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == stop - start:
                        if name not in entry:
                            entry[name] = v.new_zeros(hi - lo)
                        entry[name][a - lo:b - lo] = v[a - start:b - start]
                    elif name not in entry:
                        entry[name] = v.clone() if isinstance(v, torch.Tensor) else v

    def install(self, taken: dict[Any, dict[str, Any]]) -> None:
        """Make what :meth:`take_pieces` gathered the optimizer's state (replacing this rank's)."""
        state = self.local.optimizer.state
        for s in self.shards:
            state.pop(s, None)
        self._parked = {}
        for key, entry in taken.items():
            if isinstance(key, tuple):
                self._parked[key[1]] = entry
            else:
                state[key] = entry

    def load_full(self, full_state: dict[int, dict[str, Any]], params: Sequence[Any]) -> None:
        """Take this rank's pieces of a consolidated per-parameter state (numbered as :meth:`pieces`)."""
        import torch

        numels = [int(np.prod(self.shape(p))) for p in params]
        whole = [(n, 0, numels[n], {k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 and
                                     v.numel() == numels[n] else v for k, v in entry.items()})
                 for n, entry in full_state.items()]
        taken: dict[Any, dict[str, Any]] = {}
        self.take_pieces(whole, None, taken)
        self.install(taken)
