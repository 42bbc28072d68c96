"""DistOpt: wrap a local optimizer so every step averages gradients across ranks.

DistOpt is the face: it holds one :class:`~distopt.strategies.Strategy`
(default :class:`~distopt.strategies.Dense`), one
:class:`~distopt.engine.Engine` and one
:class:`~distopt.local.LocalOptimizer`. The engine lays out buckets,
agrees with the other ranks and reduces; the strategy decides how a bucket
travels; the local optimizer updates. SINGA's per-call methods live in
:mod:`distopt.singa`.
"""
from __future__ import annotations

from typing import Any, Sequence

from .accumulate import GradientAccumulator
from .buckets import is_float
from .comm.base import Communicator
from .counters import Counters
from .engine import Engine
from .failfast import install_abort_on_exception
from .join import JoinMethods, LastStep
from .local import checked_pairs, wrap_local
from .autosync import AutoSync
from .torch import TorchOptimizer
from .model_sync import attach_model
from .collectives import CollectiveMethods
from .singa import SingaMethods
from .state import STATE_FORMAT, StateMethods
from .strategy_set import StrategySet
from .strategies import Dense, Strategy, UpdateContext
from .surface import SurfaceMethods
from .world import World, comm_for

__all__ = ["DistOpt", "STATE_FORMAT"]

class DistOpt(StateMethods, SurfaceMethods, CollectiveMethods, JoinMethods, SingaMethods):
    """Data-parallel wrapper around a local optimizer.

    Args:
        opt: the local optimizer: :class:`distopt.SGD`, any object with
            ``update(param, grad)`` (arrays updated in place), or a
            ``torch.optim.Optimizer`` (its parameters are broadcast from rank
            0 here, at construction).
        nccl_id: the job's :class:`~distopt.nccl_id.NcclIdHolder` in the
            multiprocessing launch mode; None under ``mpiexec``.
        gpu_num: this process's device number on its node (rank in the
            multiprocessing mode).
        gpu_per_node: processes per node (world size in the multiprocessing
            mode).
        buffSize: capacity of one fusion buffer in ELEMENTS (default
            4194304, i.e. 16 MiB of float32).
        strategy: how :meth:`step` and :meth:`backward_and_update` average
            (default :class:`~distopt.strategies.Dense`, the plain fused
            all-reduce). Every rank must use the same strategy and settings.
        backend: force ``"mpi"``, ``"shm"`` or ``"nccl"`` (see
            :func:`distopt.world.build_world` for the default rule).
        comm: an existing communicator to use instead of building one.
        timeout: collective deadline in seconds (default
            ``$DISTOPT_TIMEOUT`` or 300).
        backward_passes_per_step: micro-batches accumulated locally per
            update (Horovod's name). Array models: their MEAN is all-reduced
            once per k calls (see :meth:`flush`). PyTorch: the first k-1
            ``loss.backward()`` calls accumulate in ``.grad``, the k-th
            averages the sum (use ``loss / k``; see :mod:`distopt.autosync`).
        check_finite: skip a step on EVERY rank when any rank's gradient has
            a NaN or inf, counted in ``stats["skipped_steps"]``.
        abort_on_exception: under MPI, make an uncaught exception on any
            rank abort the whole job (printing its traceback) instead of
            leaving the others blocked.
        overlap: start each bucket's reduction during backward, as soon as
            its gradients are ready, for strategies that support it (PyTorch
            post-accumulate-grad hooks, or an array loss whose
            ``backward()`` yields ``(param, grad)`` pairs). Results are
            identical to ``overlap=False``. Not combined with
            ``backward_passes_per_step > 1`` for array models.
        model: the ``torch.nn.Module``: rank 0's parameters (all of them)
            and buffers are broadcast here, and parameter names join the
            cross-rank check. Without it only the optimizer's parameters
            are broadcast; buffers never are.
        broadcast_buffers: with ``model``, broadcast rank 0's buffers before
            each training-mode forward (DDP's default).
        sparse_as_dense: densify sparse PyTorch gradients before averaging
            (else a sparse gradient raises TypeError at the first backward).
        gradient_as_bucket_view: PyTorch DDP's option, for a
            ``torch.optim.Optimizer`` only. True makes each trainable
            parameter's ``.grad`` a view into its bucket's flat buffer (a
            tensor of the parameter's dtype and device, allocated once per
            bucket layout), so the buckets ARE the gradient memory: the
            reduction runs in place on them and nothing is unpacked. The
            engine then holds about 0 extra bytes instead of a second copy
            of every gradient (1x the gradient bytes), and saves a copy in
            and a copy out per step. Results are bitwise those of False.
            A ``.grad`` that is not its view when its final gradient is
            ready (the first step, after ``zero_grad(set_to_none=True)``,
            PyTorch's default, or a ``.grad`` the user replaced) is copied
            into the view and ``.grad`` set to the view (the fresh tensor is
            then freed); one that is the view (``zero_grad(set_to_none=False)``,
            ``no_sync()``, ``backward_passes_per_step``) is not copied. A
            layout change (parameters added or removed, ``requires_grad``
            switched) gives new buffers and new views. Caveats, as DDP's:
            ``.grad`` is a view only after the first synchronizing backward
            (measure the memory saved from then on); ``.grad.detach_()``
            fails on a view (``torch.optim``'s ``zero_grad`` does not call
            it on gradients without a graph); a ``.grad`` kept across steps
            is overwritten by the next backward and reduction (clone it to
            keep it). If a backward raises, the reductions it started run on
            ``.grad`` memory and complete at the next ``zero_grad()`` of
            DistOpt, ``step()`` or backward, writing the sum of the ranks'
            partial gradients there: call DistOpt's ``zero_grad()`` (not
            the inner optimizer's ``zero_grad(set_to_none=False)``) before
            the next backward, and the next step is right on every rank.
            ``backward_and_update(loss)`` then runs ``loss.backward()`` and
            ``step()`` (an explicit ``threshold`` takes the engine's path,
            without views); ``join()`` is not supported with it.

    Attributes:
        rank_in_global / global_rank: this process's rank, ``0..world_size-1``.
        rank_in_local / local_rank: its rank among the processes of its node.
        world_size: number of processes.
        strategy: the strategy of :meth:`step` and :meth:`backward_and_update`.
        active_strategy: the strategy the last step used (a SINGA method's
            own strategy after such a call), where residuals and cursors live.
        stats: a :class:`~distopt.counters.Counters` (``stats["wire_bytes"]``
            works as before).
        sampler: a :class:`~distopt.data.DistributedSampler` whose epoch is
            saved in :meth:`state_dict` (assign it to include it).

    Raises:
        TypeError: ``opt`` or ``strategy`` is none of the supported kinds.
        ValueError: ``buffSize < 1``, inconsistent rank arguments, or
            ``gradient_as_bucket_view=True`` with an array (non-PyTorch)
            optimizer or a strategy that reduces no gradients (partial).
    """

    def __init__(self, opt: Any, nccl_id: Any = None, gpu_num: int | None = None,
                 gpu_per_node: int | None = None, buffSize: int = 4194304, *, strategy: Strategy | None = None,
                 backend: str | None = None, comm: Communicator | None = None, timeout: float | None = None,
                 backward_passes_per_step: int = 1, check_finite: bool = False, abort_on_exception: bool = True,
                 overlap: bool = True, model: Any = None, broadcast_buffers: bool = True,
                 sparse_as_dense: bool = False, world: World | None = None,
                 gradient_as_bucket_view: bool = False) -> None:
        if buffSize < 1:
            raise ValueError(f"buffSize must be >= 1 element, got {buffSize}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a distopt.strategies.Strategy, got {type(strategy).__name__}")
        self.local = wrap_local(opt)
        torch_opt = isinstance(self.local, TorchOptimizer)
        held = Dense() if strategy is None else strategy
        if gradient_as_bucket_view and not torch_opt:
            raise ValueError("gradient_as_bucket_view=True needs a torch.optim.Optimizer (it makes param.grad a "
                             f"view into the bucket buffers); {type(opt).__name__} is an array optimizer: drop "
                             "gradient_as_bucket_view")
        if gradient_as_bucket_view and not held.reduces_gradients:
            raise ValueError(f"gradient_as_bucket_view=True needs a strategy that reduces gradient buckets in place "
                             f"(plain, half, sparse, dgc, powersgd), not {held.name!r}, which averages parameters "
                             "after the update")
        self._accumulator = (GradientAccumulator(backward_passes_per_step)
                             if backward_passes_per_step != 1 and not torch_opt else None)
        self.opt = opt
        comm, self.rank_in_local, self.local_size = comm_for(nccl_id, gpu_num, gpu_per_node, backend, timeout,
                                                             comm, world)
        self.comm = comm
        self.rank_in_global, self.world_size = comm.rank, comm.size
        self._counters = Counters()
        self.engine = Engine(comm, int(buffSize), bool(check_finite), self._counters)
        self._strategies = StrategySet(held)
        self.active_strategy = self.strategy
        self.sampler: Any = None
        self.overlap = bool(overlap)
        self._last: LastStep | None = None
        self._joining = False
        if abort_on_exception and comm.name == "mpi":
            install_abort_on_exception()
        self.model = model
        self._sync = (AutoSync(self, self.local, backward_passes_per_step, sparse_as_dense, None,
                               bool(gradient_as_bucket_view)) if torch_opt else None)
        owned = self.local.arrays()
        if model is not None:
            attach_model(self, model, broadcast_buffers)
        elif owned is not None:
            self.sync_params(owned)

    # ------------------------------------------------------------- names
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
        """What this rank's steps did (:class:`~distopt.counters.Counters`), with the communicator's
        seconds waited and host synchronisations."""
        self._counters.wait_seconds = float(getattr(self.comm, "wait_seconds", 0.0))
        self._counters.host_syncs = int(getattr(self.comm, "host_syncs", 0))
        return self._counters

    @property
    def strategy(self) -> Strategy:
        """The strategy of :meth:`step` and :meth:`backward_and_update`."""
        return self._strategies.held

    @property
    def buff_size(self) -> int:
        """Capacity of one fusion buffer in elements."""
        return self.engine.buff_size

    @property
    def check_finite(self) -> bool:
        """Whether steps with a non-finite gradient on some rank are skipped everywhere."""
        return self.engine.check_finite

    # ------------------------------------------------------------ steps
    def step(self, params: Any = None, grads: Sequence[Any] | None = None,
             threshold: int | None = None) -> Any:
        """Average ``grads`` across ranks with :attr:`strategy`, then update ``params``.

        PyTorch: ``step()`` or ``step(closure)`` is ``optimizer.step(closure)``
        (``.grad`` was averaged by ``loss.backward()``; returns the closure's loss).

        Args:
            params: arrays (NumPy or CuPy) in the same order on every rank.
            grads: one gradient per parameter (same shape), or None for a
                parameter without a gradient this step. Given arrays are
                overwritten with the average.
            threshold: parameters with more than this many ELEMENTS are
                reduced alone (in place when contiguous), smaller ones
                fused into buffers of ``buffSize`` elements; None means
                the strategy's ``default_threshold`` (65536 for plain and
                half, whose results do not depend on the layout; SINGA's
                2097152 for the others).

        Raises:
            ValueError: ``params`` and ``grads`` differ in length or shape.
            CollectiveMismatchError / CollectiveTimeoutError: from the ranks'
                agreement checks or a missed deadline, naming the step and
                bucket; no parameter is changed then.
        """
        if grads is None and (params is None or callable(params)):
            return self._torch_step(params)
        self._run(self.strategy, params, grads, threshold)
        return None

    def backward_and_update(self, loss: Any, threshold: int | None = None) -> None:
        """Backward pass, reduction with :attr:`strategy`, local update (see :meth:`step`).

        With ``overlap=True`` (the default) each bucket's reduction starts
        during backward as soon as its gradients are ready.

        Args:
            loss: for a PyTorch optimizer, the loss tensor (``loss.backward()``
                runs, ``.grad`` is averaged in place, ``optimizer.step()``
                runs). For array models, any object whose ``backward()``
                yields ``(param, grad)`` pairs: in any order once
                :meth:`sync_params` has fixed the shared parameter order,
                else in the same order on every rank.
            threshold: see :meth:`step` (elements).
        """
        self._backward_run(self.strategy, loss, threshold)

    def _backward_run(self, strategy: Strategy, loss: Any, threshold: int | None) -> None:
        if (self._sync is not None and strategy is self.strategy
                and (self._sync.k > 1 or (self._sync.bucket_view and threshold is None))):
            loss.backward()  # accumulates in .grad (bucket views with gradient_as_bucket_view); the k-th averages
            if self._sync.passes == 0:
                self.local.optimizer.step()  # type: ignore[attr-defined]
            return
        if self.overlap and strategy.supports_overlap and self._accumulator is None:
            run = self.local.overlapped_backward(
                loss, lambda params: self._begin(strategy, params, threshold, joined=self._joining))
            if run is not None:
                params, grads, pipeline = run
                self.stats.buckets_started_in_backward += pipeline.next
                self._last = LastStep(strategy, params, threshold)
                self._step(strategy, params, grads, threshold, pipeline)
                return
        self._run(strategy, *self.local.backward(loss), threshold)

    def _begin(self, strategy: Strategy, params: list[Any], threshold: int | None, joined: bool = False,
               views: bool = True, grads: Sequence[Any] | None = None, bucket_view: bool = False) -> Any:
        strategy.bind(self.world_size, self.local)
        return self.engine.begin(strategy, params, threshold, joined, views, grads, bucket_view)

    def _after_update(self, strategy: Strategy, params: Sequence[Any], threshold: int | None) -> None:
        """The strategy's after-update (partial averaging) over the float ``params``."""
        floats = [p for p in params if is_float(p)]
        strategy.after_update(UpdateContext(floats, strategy.threshold(threshold), self.comm, self.stats,
                                            self.local.momentum_arrays, self.engine.average_arrays))
        self.stats.dense_bytes += sum(int(p.nbytes) for p in floats)

    def _run(self, strategy: Strategy, params: Sequence[Any], grads: Sequence[Any], threshold: int | None) -> None:
        """Check arguments, accumulate micro-batches if asked, then step with ``strategy``."""
        params, grads = checked_pairs(params, grads)
        self.local.remember(params)  # the shared order of an array model's later overlapped backward
        self._last = LastStep(strategy, params, threshold)
        if self._accumulator is not None:
            released = self._accumulator.add(grads)
            if released is None:
                return
            grads = released
        self._step(strategy, params, grads, threshold)

    def _step(self, strategy: Strategy, params: list[Any], grads: list[Any], threshold: int | None,
              pipeline: Any = None, active: bool = True) -> int:
        """Reduce, update, run the strategy's after-update; returns the number of active ranks."""
        self.active_strategy = strategy
        self._strategies.restore(strategy)
        if pipeline is None:
            pipeline = self._begin(strategy, params, threshold, joined=self._joining, grads=grads)
        if strategy.reduces_gradients:
            outcome = self.engine.complete(pipeline, grads, active)
            if outcome.applies:
                self.stats.steps += 1
                if any(outcome.present):
                    self.local.apply(params, grads, outcome.present)
            return outcome.active
        outcome = self.engine.agree_on_gradients(params, grads, active, pipeline.settled)
        if outcome.applies:
            self.local.apply(params, grads, [g is not None and is_float(p) for p, g in zip(params, grads)])
            self.stats.steps += 1
            self._after_update(strategy, params, threshold)
        return outcome.active

    def close(self) -> None:
        """Release the communicator and the reduction thread; a second call does nothing.

        Afterwards every collective raises
        :class:`~distopt.errors.CommunicatorClosedError` on every rank; the
        hooks it put on the model's tensors and the optimizer are removed.
        """
        self.local.detach()  # the model and the optimizer no longer call into this DistOpt
        self.engine.close()
        self.comm.close()

    def __enter__(self) -> DistOpt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

