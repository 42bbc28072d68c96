"""DistOpt, the face: every public name is a one-line delegation to an owned, typed collaborator.

The collaborators: :class:`~distopt.step.runner.StepRunner` (the one step path),
:class:`~distopt.torch.follower.Follower` (PyTorch's backward hooks and optimizer surface),
:class:`~distopt.torch.model_sync.ModelSync` (the model's tensors), :class:`~distopt.collectives.Collectives`
(raw collectives) and :class:`~distopt.step.state.StepState` (checkpoints).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from .accumulation import AccumulationMethods
from .collectives import CollectiveMethods, Collectives
from .comm.base import Communicator
from .core.counters import Counters
from .launch.failfast import install_abort_on_exception
from .launch.world import World, acquire_comm
from .sharding.plan import check_sharding
from .sharding.shard_state import ShardStream
from .sharding.policy import bucket_sync
from .torch.zero.state import stage_options, torch_sharding
from .singa import SingaMethods
from .step.accumulate import GradientAccumulator
from .step.engine import Engine
from .step.local import ArrayOptimizer
from .step.runner import JoinResult, StepRunner
from .step.state import StepState
from .step.strategy_set import StrategySet
from .compression import strategy_for
from .strategies import Strategy
from .torch.adapter import TorchOptimizer, is_torch_optimizer, local_optimizer
from .torch.bucket_views import check_bucket_view
from .torch.follower import Follower
from .torch.model_sync import ModelSync
from .torch.optimizer import optimizer_class

__all__ = ["DistOpt"]


class DistOpt(SingaMethods, CollectiveMethods, AccumulationMethods):
    """Data-parallel wrapper around a local optimizer.

    Args:
        opt: the local optimizer: :class:`distopt.SGD`, any object with ``update(param, grad)``
            (arrays updated in place), or a ``torch.optim.Optimizer`` (rank 0's parameters broadcast here).
        nccl_id: the job's :class:`~distopt.launch.nccl_id.NcclIdHolder` in the multiprocessing launch mode.
        gpu_num: this process's device number on its node (rank in the multiprocessing mode).
        gpu_per_node: processes per node (world size in the multiprocessing mode).
        buffSize: capacity of one fusion buffer in ELEMENTS (default 4194304: 16 MiB of float32).
        strategy: how :meth:`step` and :meth:`backward_and_update` average (default
            :class:`~distopt.strategies.Dense`); the same strategy and settings on every rank.
        compression: Horovod's ``Compression.fp16`` (``strategy=Half()``; ValueError with a ``strategy``) or ``.none``.
        backend: force a backend (see :func:`distopt.launch.backend_rule.build_world`).
        comm: an existing communicator to use instead of building one.
        timeout: collective deadline in seconds (default ``$DISTOPT_TIMEOUT`` or 300).
        backward_passes_per_step: micro-batches accumulated locally per update (Horovod's name). Array models:
            their MEAN is all-reduced once per k calls (see :meth:`flush`). PyTorch: the first k-1
            ``loss.backward()`` calls accumulate in ``.grad``, the k-th averages the sum (use ``loss / k``).
        check_finite: skip a step on EVERY rank when any rank's gradient has a NaN or inf.
        abort_on_exception: under MPI, an uncaught exception on any rank aborts the whole job (printing its traceback).
        overlap: start each bucket's reduction during backward as soon as it is ready (strategies that
            support it); results identical to False.
        model: the ``torch.nn.Module``: rank 0's parameters and buffers are broadcast here, names checked
            across ranks (without it: only the optimizer's parameters, never buffers).
        broadcast_buffers: with ``model``, broadcast rank 0's buffers before each training-mode forward
            (DDP's default).
        sparse_as_dense: average sparse gradients (``nn.Embedding(sparse=True)``) densely in the buckets
            (Horovod's name; ``SparseAdam`` gets them back sparse). False: all-gathered as sparse, coalesced and
            divided by the world size (:mod:`distopt.torch.sparse`); dense with bucket views or ``zero``.
        world: an existing :class:`~distopt.launch.world.World` to join.
        gradient_as_bucket_view: PyTorch DDP's option, for a ``torch.optim.Optimizer`` only: each trainable
            parameter's ``.grad`` becomes a view into its bucket's flat buffer, so the buckets ARE the gradient
            memory (about 0 extra bytes instead of a second copy of every gradient); bitwise the results of
            False. Caveats as DDP's (:mod:`distopt.torch.bucket_views`, ``docs/porting.md``); no ``join()``.
        divide_by_initial_world_size: inside :meth:`join`, divide by the world size (DDP's default) rather
            than by the ranks still training.
        named_parameters: Horovod's: ``model.named_parameters()``, naming every optimizer parameter (compared
            across ranks; ValueError for a duplicate or missing name).
        zero: shard the optimizer (ZeRO, ``docs/sharding.md``): 0 none; 1 reduce-scatters each bucket so every
            rank updates (and keeps optimizer state for) 1/W of it, then all-gathers the parameters; 2 also
            keeps only this rank's gradient segments; 3 also keeps only this rank's segments of the parameters,
            gathered for each module's forward and backward (needs ``model``; ``summon_full_params()``). Dense or
            Half; an elementwise optimizer.
        overlap_param_gather: with ``zero`` and ``model``, leave each bucket's parameter all-gather in flight until
            the next forward reaches its parameters (what ``zero=3`` always does: there it changes nothing).
        reshard_after_forward: FSDP's option, for ``zero=3``: True (the default) frees each bucket after the
            forward that used it and gathers it again for backward; False keeps every bucket gathered from
            forward until its gradients are ready (one all-gather per step instead of two, for the memory of
            the whole model during forward and backward; still 1/W at rest).
        init: ``zero=3`` with a ``model`` built on the meta device (``docs/sharding.md``): ``init(module)``
            initializes each module owning meta tensors in place, instead of its ``reset_parameters()``.
        param_dtype: mixed precision at any ``zero``, with ``model`` (FSDP2's ``MixedPrecisionPolicy``): the dtype of
            forward, backward and the parameters' gathers; the optimizer steps float32 masters.
        reduce_dtype: the gradients' reduction's dtype (None: ``param_dtype``; :mod:`distopt.torch.zero.precision`).
        hierarchical: the all-reduce across nodes (:mod:`distopt.comm.hierarchy`): None picks it on the torch
            backend when there are several nodes (host names) with the same number (> 1) of processes; True
            requires it (mpi or torch; ValueError where it cannot be); False keeps the flat all-reduce.
        group: a process group (:func:`distopt.new_group`): average over its ranks only (instead of
            ``comm``/``world``); ValueError on a rank outside it. Flat unless ``hierarchical=True``.

    Attributes:
        rank_in_global / global_rank: this process's rank, ``0..world_size-1``.
        rank_in_local / local_rank: its rank among the processes of its node.
        world_size: number of processes.
        zero: the ZeRO stage, 0 to 3 (``zero=``).
        engine: the step engine (layout, agreement, bucket pipeline).
        follower: the :class:`~distopt.torch.follower.Follower` of a PyTorch optimizer (None for array optimizers).
        model_sync: the :class:`~distopt.torch.model_sync.ModelSync` of a PyTorch optimizer (None for array optimizers).
        sampler: a :class:`~distopt.data.DistributedSampler` whose epoch :meth:`state_dict` saves (assign it).

    Raises:
        TypeError: ``opt``, ``strategy`` or ``compression`` is none of the supported kinds.
        ValueError: ``buffSize < 1``, inconsistent rank arguments, or ``gradient_as_bucket_view=True`` with an array
            optimizer or a strategy that averages parameters (partial); ``zero`` not in (0, 1, 2, 3), with another
            strategy or an optimizer that is not elementwise; ``zero=3`` without ``model`` or with an array
            optimizer; ``param_dtype``/``reduce_dtype`` not a floating-point ``torch.dtype``, or without ``model``.
    """

    def __new__(cls, opt: Any, *args: Any, **kwargs: Any) -> DistOpt:  # noqa: ARG003
        """A :class:`DistOpt` that is also a ``torch.optim.Optimizer`` when ``opt`` is one."""
        return super().__new__(optimizer_class(cls) if is_torch_optimizer(opt) else cls)

    def __init__(self, opt: Any, nccl_id: Any = None, gpu_num: int | None = None,
                 gpu_per_node: int | None = None, buffSize: int = 4194304, *, strategy: Strategy | None = None,
                 backend: str | None = None, comm: Communicator | None = None, timeout: float | None = None,
                 backward_passes_per_step: int = 1, check_finite: bool = False, abort_on_exception: bool = True,
                 overlap: bool = True, model: Any = None, broadcast_buffers: bool = True,
                 sparse_as_dense: bool = False, world: World | None = None, compression: Any = None,
                 gradient_as_bucket_view: bool = False, divide_by_initial_world_size: bool = True,
                 named_parameters: Any = None, zero: int = 0, overlap_param_gather: bool = False,
                 reshard_after_forward: bool = True, init: Any = None, param_dtype: Any = None,
                 reduce_dtype: Any = None, hierarchical: bool | None = None, group: Any = None) -> None:
        if buffSize < 1:
            raise ValueError(f"buffSize must be >= 1 element, got {buffSize}")
        self.opt = opt
        self.local = local = local_optimizer(opt)
        held = strategy_for(strategy, compression)  # TypeError for a bad strategy (before the communicator)
        if gradient_as_bucket_view:
            check_bucket_view(local, held)
        if any(x is not None for x in (model, named_parameters, init)) and not isinstance(local, TorchOptimizer):
            raise TypeError("model=, named_parameters= and init= need a torch.optim.Optimizer inside DistOpt")
        precision = stage_options(zero, bool(reshard_after_forward), param_dtype, reduce_dtype, local)
        accumulator = (GradientAccumulator(backward_passes_per_step)
                       if backward_passes_per_step != 1 and isinstance(local, ArrayOptimizer) else None)
        self.comm, self.rank_in_local, self.local_size, self._release = acquire_comm(
            nccl_id, gpu_num, gpu_per_node, backend, timeout, comm, world, hierarchical, group)
        self.rank_in_global, self.world_size = self.comm.rank, self.comm.size
        self._counters = Counters()
        zero = self.zero = check_sharding(zero, held, opt if isinstance(local, ArrayOptimizer) else None,
                                          overlap_param_gather)
        self.engine = Engine(self.comm, int(buffSize), bool(check_finite), self._counters,
                             bool(divide_by_initial_world_size), bucket_sync(zero, self.comm))
        strategies = StrategySet(held)
        self._runner = StepRunner(self.engine, local, strategies, self._counters, bool(overlap), accumulator)
        counters = self._counters
        sink, sharded_state = (torch_sharding(zero, self.comm, local, overlap_param_gather, model,
                                              gradient_as_bucket_view, counters, bool(reshard_after_forward), init,
                                              precision) if isinstance(local, TorchOptimizer) else (None, None))
        self._state = StepState(local, self._counters, strategies, sharded_state)
        self._collectives = Collectives(self.comm, self.engine, local)
        self.sampler: Any = None
        if abort_on_exception and self.comm.name == "mpi":
            install_abort_on_exception()
        self.follower: Follower | None = None
        self.model_sync: ModelSync | None = None
        if isinstance(local, TorchOptimizer):
            self.follower = Follower(self._runner, local, backward_passes_per_step, sparse_as_dense,
                                     bool(gradient_as_bucket_view), model, sink)
            follower = self.follower
            self.model_sync = ModelSync(self.comm, self.engine, local, model, broadcast_buffers,
                                        lambda: follower.join_phase(), named_parameters, follower.forward_syncs)
            follower.sink.bind(follower)  # zero=3: each rank keeps its segments of rank 0's parameters

    @property
    def state_sharded(self) -> bool:
        """The optimizer's state is sharded across the ranks (a PyTorch optimizer at ``zero=1|2|3``)."""
        return self._state.sharding is not None

    @property
    def local_rank(self) -> int:
        """Rank among the processes of this node (alias of ``rank_in_local``)."""
        return self.rank_in_local

    @property
    def global_rank(self) -> int:
        """Rank in the job (alias of ``rank_in_global``)."""
        return self.rank_in_global

    @property
    def stats(self) -> Counters:
        """What this rank's steps did (:class:`~distopt.core.counters.Counters`), with the communicator's
        seconds waited and host synchronisations."""
        self._counters.wait_seconds = float(getattr(self.comm, "wait_seconds", 0.0))
        self._counters.host_syncs = int(getattr(self.comm, "host_syncs", 0))
        return self._counters

    @property
    def strategy(self) -> Strategy:
        """The strategy of :meth:`step` and :meth:`backward_and_update`."""
        return self._runner.strategy

    @property
    def active_strategy(self) -> Strategy:
        """The strategy the last step used (a SINGA method's own after such a call): its residuals and cursors."""
        return self._runner.active_strategy

    @property
    def overlap(self) -> bool:
        """Whether buckets start during backward (strategies that support it)."""
        return self._runner.overlap

    @property
    def model(self) -> Any:
        """The ``torch.nn.Module`` given as ``model=`` (None without one)."""
        return None if self.model_sync is None else self.model_sync.model

    @property
    def buff_size(self) -> int:
        """Capacity of one fusion buffer in elements."""
        return self.engine.buff_size

    @property
    def check_finite(self) -> bool:
        """Whether steps with a non-finite gradient on some rank are skipped everywhere."""
        return self.engine.check_finite

    def _torch(self, what: str) -> Follower:
        if self.follower is None:
            raise TypeError(f"{what} needs a torch.optim.Optimizer inside DistOpt; this one wraps "
                            f"{type(self.opt).__name__} (use step(params, grads) for array models)")
        return self.follower

    def step(self, params: Any = None, grads: Sequence[Any] | None = None, threshold: int | None = None, *,
             closure: Any = None) -> Any:
        """Average ``grads`` across ranks with :attr:`strategy`, then update ``params``.

        PyTorch: ``step()``, ``step(closure)`` or ``step(closure=closure)`` is
        ``optimizer.step(closure)`` (``.grad`` was averaged by
        ``loss.backward()``; returns the closure's loss).

        Args:
            params: arrays (NumPy or CuPy) in the same order on every rank.
            grads: one gradient per parameter (same shape), or None for a
                parameter without a gradient this step; overwritten with the average.
            threshold: parameters of more than this many ELEMENTS are reduced alone, smaller ones fused into
                buffers of ``buffSize`` elements; None: the strategy's ``default_threshold``.

        Raises:
            TypeError: ``params``/``grads`` with a PyTorch optimizer.
            ValueError: ``params`` and ``grads`` differ in length or shape.
            CollectiveMismatchError / CollectiveTimeoutError: from the ranks' agreement or a missed deadline,
                naming the step and bucket; no parameter is changed then.
        """
        if closure is not None:
            params = closure
        if grads is None and (params is None or callable(params)):
            return self._torch("step() without params").step(params)
        return self._runner.run(self.strategy, params, grads, threshold)

    def backward_and_update(self, loss: Any, threshold: int | None = None) -> None:
        """Backward pass, reduction with :attr:`strategy`, local update (see :meth:`step`).

        Args:
            loss: a PyTorch loss tensor (``loss.backward()`` averages ``.grad``, then ``optimizer.step()`` runs),
                or for array models any object whose ``backward()`` yields ``(param, grad)`` pairs (in any order
                once :meth:`sync_params` fixed the shared order).
            threshold: see :meth:`step` (elements).
        """
        self._backward(self.strategy, loss, threshold)

    def _backward(self, strategy: Strategy, loss: Any, threshold: int | None) -> None:
        if self.follower is not None:
            return self.follower.backward_and_step(strategy, loss, threshold)
        return self._runner.backward_run(strategy, loss, threshold)

    def average(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None) -> list[Any]:
        """Average ``grads`` in place with :attr:`strategy`, without updating; returns them (a new array where
        a gradient was None and another rank had one; all None when ``check_finite`` skips the step).

        Raises:
            ValueError: the strategy averages parameters (partial), or ``params`` and ``grads`` do not match.
        """
        return self._runner.average(params, grads, threshold)

    def flush(self) -> None:
        """Apply a partial accumulation (``backward_passes_per_step=k``, array models) now, averaged over the
        micro-batches it holds; call it on every rank at an epoch end. Does nothing without one."""
        self._runner.flush()

    def discard_accumulation(self) -> None:
        """Drop a partial gradient accumulation (see :meth:`flush`)."""
        self._runner.discard_accumulation()

    @contextmanager
    def join(self, params: Sequence[Any] | None = None) -> Iterator[JoinResult]:
        """Let ranks with fewer batches finish early without hanging the others (Horovod's ``hvd.join``).

        Around the training loop on every rank (``with opt.join(): for batch in my_batches: ...``, counts may
        differ per rank). A rank that left the loop answers the others' steps with zero gradients and applies
        the same averaged update: PyTorch DDP's, the sum divided by the world size, joined ranks contributing
        zeros (``divide_by_initial_world_size=False``: by the ranks that contributed). With ``model=`` and
        buffers, joined ranks also shadow the buffer broadcasts, which then come from the lowest rank still
        training, and at the end every rank takes the buffers of the last rank to join. ``with opt.join() as
        result:`` gives ``result.last_joined`` afterwards (Horovod's ``join()`` value).

        Args:
            params: the parameters, for an array model that ran no step before joining.
        Raises:
            ValueError: nothing to shadow (no step yet and no ``params``), a strategy without ``supports_join``
                (every rank raises), ``gradient_as_bucket_view=True`` or ``zero=3``.
        """
        follower = self.follower
        if follower is not None and follower.views is not None:
            raise ValueError("join() is not supported with DistOpt(..., gradient_as_bucket_view=True): a joined "
                             "rank's shadow steps do not write into the bucket views")
        if self.engine.sync.stage == 3:
            raise ValueError("join() is not supported with zero=3: the ranks still training gather parameters in "
                             "every forward, which a joined rank does not run; use zero=2, or even out the batches "
                             "(distopt.DistributedSampler with drop_last)")
        forward, after = (None, None) if self.model_sync is None else self.model_sync.join_hooks()
        with self._runner.join(None if follower is None else follower.shadow, params, forward, after) as result:
            yield result

    def sync_params(self, params: Sequence[Any]) -> None:
        """Check that all ranks hold the same parameters, then broadcast rank 0's values (array models,
        once before the first forward pass). CollectiveMismatchError on every rank for a difference."""
        self._collectives.sync_params(params)

    def average_params(self, params: Sequence[Any] | None = None) -> None:
        """Average all (float) parameters across ranks at once, in place (``params`` optional with PyTorch)."""
        self._collectives.average_params(params)

    def state_dict(self, sharded: bool = False, params: bool = False) -> dict[str, Any]:
        """Everything needed to continue (see :class:`~distopt.step.state.StepState`); with ``zero=1|2|3``
        consolidated on every rank (collective), or only this rank's shard with ``sharded=True``, holding this
        rank's parameter elements too with ``params=True`` (a ``zero=3`` model's shard, never gathered)."""
        return self._state.state_dict(self.sampler, sharded, params)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """With ``zero=1|2|3``: consolidate the state now, on every rank (collective), so that rank ``to``
        ALONE may then call :meth:`state_dict` (a rank-0-only checkpoint writer) until the next step, as
        torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``. Nothing to do at ``zero=0``.

        Raises:
            ValueError: ``to`` is not a rank.
        """
        self._state.consolidate_state_dict(to)

    def load_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]] | ShardStream) -> None:
        """Restore :meth:`state_dict` output (``state_dict``: torch's argument name), a plain torch optimizer's,
        or every rank's ``state_dict(sharded=True)`` as a list or a
        :class:`~distopt.sharding.shard_state.ShardStream` (re-sharded one shard at a time at ``zero=1|2|3``;
        parameter elements in the shards are written into the parameters); ValueError for another format (an
        older distopt)."""
        self._state.load_state_dict(state_dict, self.sampler)

    def close(self) -> None:
        """Wait for the async collectives in flight, then release the communicators and the threads (a second call
        does nothing); every later collective raises :class:`~distopt.errors.CommunicatorClosedError` on every
        rank. The hooks on the model's tensors and the optimizer are removed.

        Releases only what this DistOpt owns: a communicator it built. One given as ``comm=`` is the caller's (as
        a process group handed to DDP): it stays open, and this DistOpt's later calls still reach it, until its
        owner closes it. The world of :func:`distopt.init` (or ``world=``) that other DistOpts, SyncBatchNorm
        layers and groups share stays open while the script holds it (until ``world.close()``) or another DistOpt
        uses it; the last of them to let go closes it. A group's communicator (``group=``) stays open. On MPI a
        close is bounded: see :meth:`distopt.comm.mpi.MPICommunicator.close`."""
        self.local.detach()  # the model and the optimizer no longer call into this DistOpt
        if self.follower is not None:
            self.follower.release()
        self._collectives.close()  # the asynchronous collectives in flight complete first
        self.engine.close()
        self._release()

    def __enter__(self) -> DistOpt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
