"""A sharded torch optimizer's checkpoints (:class:`ShardedState`) and its wiring (:func:`torch_sharding`)."""
from __future__ import annotations

from typing import Any, Callable

from ...comm.consensus import agree, gather_objects
from ...errors import CollectiveMismatchError, CollectiveTimeoutError
from ...sharding.shard_state import ShardStream, check_shards, consolidate
from ..adapter import TorchOptimizer
from ..sink import GradientSink
from .placeholder import check_elementwise
from .precision import MixedPrecision, mixed_precision
from .step import ShardedTorchStep

__all__ = ["ShardedState", "torch_sharding", "stage_options", "wait_hooks"]


class ShardedState:
    """The checkpoint state of a sharded torch optimizer, in torch's layout.

    :meth:`state_dict` consolidates every rank's pieces into full tensors
    (collective: one all-gather of the pickled pieces), so the result loads
    into the same optimizer unsharded, at any world size, or into plain
    torch; ``sharded=True`` gives this rank's pieces only, under
    ``"distopt_shard"`` (``{"world_size", "rank", "steps", "pieces"}``, each
    piece ``(parameter number, start, stop, state)``). Loads check that the
    shards are one checkpoint's (:func:`check_shards`).

    Args:
        shards: the :class:`ShardedTorchStep`.
        comm: the communicator.
        steps: the number of steps applied so far (``DistOpt.stats["steps"]``).
    """

    def __init__(self, shards: ShardedTorchStep, comm: Any, steps: Callable[[], int]) -> None:
        self.shards, self.comm, self.steps = shards, comm, steps
        self._held: tuple[int, dict[str, Any]] | None = None  # (steps, consolidated state) kept on one rank
        self._pending: dict[int, dict[str, Any]] | None = None

    def _as_torch(self, per_param: dict[int, dict[str, Any]]) -> dict[str, Any]:
        from collections import defaultdict

        opt = self.shards.local.optimizer
        params = self.shards.local.params()
        saved = opt.state
        opt.state = defaultdict(dict, {params[n]: entry for n, entry in per_param.items()})
        try:
            return opt.state_dict()
        finally:
            opt.state = saved

    def consolidate(self, to: int) -> None:
        """Consolidate the state now, on every rank (collective), and keep it on rank ``to`` only, so that
        rank alone may call :meth:`state_dict` until the next step (torch's ``ZeroRedundancyOptimizer.
        consolidate_state_dict``: a checkpoint writer that runs on rank 0 only).

        Raises:
            ValueError: ``to`` is not a rank (on every rank).
        """
        if not 0 <= to < self.comm.size:
            raise ValueError(f"consolidate_state_dict(to={to}): to must be a rank, 0 <= to < {self.comm.size}")
        state = self.state_dict(sharded=False)
        self._held = (self.steps(), state) if self.comm.rank == to else None

    def state_dict(self, sharded: bool, params: bool = False) -> dict[str, Any]:
        """The optimizer's state: consolidated (collective, unless :meth:`consolidate` kept it on this rank
        since the last step), or this rank's pieces with ``sharded``; with ``params`` too, this rank's
        parameter elements, one 1-D tensor per piece (``"params"`` in ``"distopt_shard"``), so the shards hold
        the trained parameters without any rank gathering them.

        Raises:
            CollectiveTimeoutError: the other ranks did not call it within the
                communicator's timeout; the message names the fix.
            CollectiveMismatchError: the other ranks reached another collective
                (e.g. the next step's) instead; the message names the fix.
        """
        if not sharded and self._held is not None and self._held[0] == self.steps():
            return self._held[1]
        self.shards.wait()
        with self.shards.unswapped():
            try:
                return self._state_dict(sharded, params)
            except (CollectiveTimeoutError, CollectiveMismatchError) as exc:
                raise type(exc)(
                    f"{exc}; with zero=1|2|3, state_dict() consolidates every rank's shard: call it on every rank, "
                    "or call opt.consolidate_state_dict(to=0) on every rank first, then state_dict() on rank 0 "
                    "alone (a rank-0-only checkpoint writer)") from exc

    def _state_dict(self, sharded: bool, params: bool) -> dict[str, Any]:
        if sharded and self._pending is not None:  # restored before any step: take this rank's pieces now
            self.shards.bind_planned()
            self._restore_pending()
        pieces = self.shards.pieces()
        if sharded:
            shard = {"world_size": self.comm.size, "rank": self.comm.rank, "steps": self.steps(), "pieces": pieces}
            if params:
                shard["params"] = self.shards.piece_values()
            return {**self._as_torch({}), "distopt_shard": shard}
        shapes = [self.shards.shape(p) for p in self.shards.local.params()]
        full = consolidate(gather_objects(self.comm, pieces), shapes)
        if self._pending is not None:  # restored before any step: not re-sharded yet
            full = {**self._pending, **full}
        return self._as_torch(full)

    def load_state_dict(self, state: Any) -> None:
        """Restore a consolidated state (any world size) or this rank's own sharded state (every rank's:
        :meth:`load_stream`).

        Collective with a sharded state (every rank loads its own, and the
        ranks agree that they are of the same step).

        Raises:
            ValueError: a single sharded state of another rank or world size,
                or of another step than another rank's (on every rank).
        """
        self.shards.wait()
        self._held = None
        with self.shards.unswapped():
            self._load(state)

    def load_stream(self, stream: ShardStream, split: Callable[[Any], tuple[dict[str, Any], Any]]) -> Any:
        """Re-shard every rank's sharded state of one checkpoint (any world size) as ``stream`` yields it, one
        shard at a time: this rank keeps only the elements of its own pieces (and writes the parameters'
        values a shard holds), so no rank holds the whole state. Collective when the stream is.

        Args:
            stream: the shards and their headers.
            split: parts a shard into (torch's state dict, distopt's own part).

        Returns:
            distopt's own part of the first shard.

        Raises:
            ValueError: the headers are not one checkpoint's every rank once (:func:`check_shards`), or a
                shard is not the one its header names (the optimizer's state is then unchanged; the values of
                parameters in shards read before it are written).
        """
        check_shards(stream.headers)
        self.shards.wait()
        self._held = None
        first: Any = None
        with self.shards.unswapped():
            self.shards.bind_planned()
            taken: dict[Any, dict[str, Any]] = {}
            groups = None
            steps: set[Any] = set()
            shards = iter(stream.shards)
            for header in stream.headers:  # not zip(): its reused result tuple holds a shard until the next is read
                shard = next(shards, None)
                if shard is None:
                    break
                clean, extras = split(shard)
                mine = clean["distopt_shard"]
                steps.add(mine.get("steps"))
                if (mine["world_size"], mine["rank"]) != (header["world_size"], header["rank"]) or len(steps) > 1:
                    raise ValueError(f"the shard read for rank {header['rank']} of {header['world_size']} is rank "
                                     f"{mine['rank']} of {mine['world_size']}'s, saved at step {mine.get('steps')} "
                                     f"(others at {sorted(steps - {mine.get('steps')}, key=str)})")
                self.shards.take_pieces(mine["pieces"], mine.get("params"), taken)
                if groups is None:
                    first, groups = extras, clean["param_groups"]
                del shard, clean, mine  # before the stream reads the next shard: one shard held at a time, not two
            self.shards.local.optimizer.load_state_dict({**self._as_torch({}), "param_groups": groups})
            self.shards.install(taken)
        self._pending = None
        return first

    def _load(self, state: Any) -> None:
        opt = self.shards.local.optimizer
        params = self.shards.local.params()
        if "distopt_shard" in state:
            mine = state["distopt_shard"]
            problem = None
            if (mine["world_size"], mine["rank"]) != (self.comm.size, self.comm.rank):
                problem = ValueError(f"state is rank {mine['rank']} of {mine['world_size']}'s shard; this is rank "
                                     f"{self.comm.rank} of {self.comm.size}: load the list of every rank's sharded "
                                     "state, or a consolidated one")
            agree(self.comm, {"the step of the sharded state loaded": mine.get("steps")},
                  call="load_state_dict(sharded state)", error=ValueError, problem=problem,
                  hint="a stale shard: every rank loads its shard of the same checkpoint")
            self.shards.bind_planned()
            if self.shards.plan is not None:  # its pieces are this rank's: taken as they are, never consolidated
                taken: dict[Any, dict[str, Any]] = {}
                self.shards.take_pieces(mine["pieces"], mine.get("params"), taken)
                opt.load_state_dict({**self._as_torch({}), "param_groups": state["param_groups"]})
                self.shards.install(taken)
                self._pending = None
                return
            shapes = [self.shards.shape(p) for p in params]
            opt.load_state_dict({**self._as_torch(consolidate([mine["pieces"]], shapes)),
                                 "param_groups": state["param_groups"]})
            if mine.get("params") is not None:  # this rank's own parameter elements
                for (number, start, stop, _), values in zip(mine["pieces"], mine["params"]):
                    self.shards.write_values(number, start, stop, values)
        else:
            opt.load_state_dict(state)
        full = {n: opt.state.pop(p) for n, p in enumerate(params) if p in opt.state}
        for s in self.shards.shards:
            opt.state.pop(s, None)
        if self.shards.plan is None:
            self._pending = full
            self.shards.restore = self._restore_pending
        else:
            self.shards.load_full(full, params)

    def adopt_existing(self) -> None:
        """Keep the state already in the inner optimizer (a checkpoint loaded before the wrap, as most DDP
        scripts do): it is taken out and each rank keeps its own pieces at the first sharded step."""
        opt = self.shards.local.optimizer
        full = {n: opt.state.pop(p) for n, p in enumerate(self.shards.local.params()) if p in opt.state}
        if full:
            self._pending = full
            self.shards.restore = self._restore_pending

    def _restore_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending:
            self.shards.load_full(pending, self.shards.local.params())


def torch_sharding(zero: int, comm: Any, local: TorchOptimizer, overlap_param_gather: bool, model: Any,
                   bucket_view: bool, counters: Any, reshard_after_forward: bool = True,
                   init: Callable[[Any], Any] | None = None, precision: Any = None
                   ) -> tuple[GradientSink, ShardedState | None]:
    """The gradient sink of a torch optimizer's follower at stage ``zero``, and the sharded checkpoint
    state (None at ``zero=0``: the inner optimizer's own ``state_dict`` is the state). At ``zero=3`` a model
    built on the meta device is taken here (:mod:`~distopt.torch.zero.materialize`; ``init``: its modules'
    initialization instead of ``reset_parameters()``); ``precision``: the mixed-precision policy
    (:mod:`~distopt.torch.zero.precision`; below ``zero=3``: :mod:`~distopt.torch.mixed`,
    :mod:`~distopt.torch.zero.mixed_step`), or None.

    Raises:
        ValueError: the optimizer is not elementwise (:func:`check_elementwise`);
            ``zero=2|3`` with ``gradient_as_bucket_view`` (whose buckets keep
            the whole gradient); ``overlap_param_gather`` or ``zero=3``
            without ``model=``; a meta-built model or ``init`` below ``zero=3``; ``precision`` without ``model=``
            or with ``gradient_as_bucket_view``.
    """
    if zero != 3:
        from .materialize import refuse_meta

        refuse_meta(model, local, zero, init)
    if precision is not None and (model is None or bucket_view):
        raise ValueError("param_dtype=/reduce_dtype= (mixed precision) run forward and backward in param_dtype copies "
                         "of the model's parameters and cast its inputs, so they need model=your_module, and "
                         "gradient_as_bucket_view=False (the buckets hold reduce_dtype, not the gradients' dtype)")
    if not zero:
        if precision is not None:
            from ..mixed import MixedSink

            return MixedSink(local, model, precision), None
        return GradientSink(), None
    check_elementwise(local.optimizer, zero)
    if zero >= 2 and bucket_view:
        raise ValueError(f"zero={zero} frees each gradient bucket once reduced; gradient_as_bucket_view=True keeps "
                         "every bucket as .grad memory: use zero=1 with it, or gradient_as_bucket_view=False")
    if zero == 3 and model is None:
        raise ValueError("zero=3 gathers each module's parameters in its forward and backward, so it needs "
                         "model=your_module (the module whose parameters the optimizer trains)")
    if overlap_param_gather and model is None:
        raise ValueError("overlap_param_gather=True waits for each bucket's gather in the forward pre-hooks of "
                         "model=; pass model=your_module")
    if zero == 3:
        from .full import FullyShardedTorchStep

        shards: ShardedTorchStep = FullyShardedTorchStep(comm, local, model, counters, reshard_after_forward, init,
                                                         precision)
    elif precision is not None:
        from .mixed_step import MixedShardedStep

        shards = MixedShardedStep(comm, local, zero, overlap_param_gather, model, precision)
    else:
        shards = ShardedTorchStep(comm, local, zero, overlap_param_gather)
    if overlap_param_gather and zero < 3:
        local.handles.extend(wait_hooks(model, shards.wait))
    state = ShardedState(shards, comm, lambda: counters.steps)
    state.adopt_existing()
    return shards, state


def stage_options(zero: int, reshard_after_forward: bool, param_dtype: Any, reduce_dtype: Any,
                  local: Any) -> MixedPrecision | None:
    """Check DistOpt's option that only ``zero=3`` takes (``reshard_after_forward``) against the stage, before any
    communicator is made; returns the mixed-precision policy of ``param_dtype`` and ``reduce_dtype``, at any stage
    (:func:`mixed_precision`).

    Raises:
        ValueError: ``reshard_after_forward=False`` below ``zero=3``; as :func:`mixed_precision`.
        TypeError: as :func:`mixed_precision` (``local`` is not a :class:`~distopt.torch.adapter.TorchOptimizer`).
    """
    if not reshard_after_forward and zero != 3:
        raise ValueError(f"reshard_after_forward=False keeps zero=3's gathered parameters from forward to "
                         f"backward; with zero={zero} the parameters are never freed: drop it, or use zero=3")
    return mixed_precision(param_dtype, reduce_dtype, zero, isinstance(local, TorchOptimizer))


def wait_hooks(model: Any, wait: Callable[..., None]) -> list[Any]:
    """``overlap_param_gather`` at ``zero=1|2``: forward pre-hooks on every module of ``model`` that owns parameters,
    each calling ``wait(its own parameters)`` (the gathers holding them complete), and a ``model.state_dict()``
    pre-hook calling ``wait()`` (all of them). Returns the hook handles."""
    handles = [model.register_state_dict_pre_hook(lambda *args, **kwargs: wait())]
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            handles.append(module.register_forward_pre_hook(lambda m, args, own=own: wait(own)))
    return handles
