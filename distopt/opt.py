"""DistOpt: wrap a local optimizer so every step averages gradients across ranks.

Data flow of one dense step (SINGA's ``backward_and_update``, the fusion of
ChainerMN's ``pure_nccl`` communicator and Horovod's tensor fusion):

1. gradients arrive (``loss.backward()`` or explicit arrays);
2. they are packed into flat buckets (:mod:`distopt.buckets`) in the
   parameter order every rank shares, a missing gradient packed as zeros;
3. each bucket is all-reduced and divided by the world size exactly once;
4. the averaged gradients are unpacked and the local optimizer updates.

Before the first step, and whenever the parameter list changes, every rank
checks that all ranks hold the same parameter shapes and dtypes in the same
order (an error naming the first difference otherwise, shared case H03), and
rank 0's parameters are broadcast (never averaged: averaging independent
random inits shrinks them; shared case H20).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ._array import xp_of
from .buckets import Bucket, plan_buckets, unpack
from .comm.base import Communicator
from .accumulate import GradientAccumulator
from .errors import CollectiveMismatchError, CollectiveTimeoutError
from .failfast import install_abort_on_exception
from .agreement import check_same, digest
from .metrics import broadcast_object, reduce_metrics
from .overlap import BucketPipeline, Codec, DenseCodec, HalfCodec, float_buckets
from .torch import as_array
from .strategies import ChunkCursor, Residuals, average_sparse
from .world import build_world

__all__ = ["DistOpt"]

DEFAULT_THRESHOLD = 2097152  # elements
FIRST_BUCKET = 262144  # elements of the first (reverse-order) bucket: 1 MiB of float32, as PyTorch DDP


def _is_float(array: Any) -> bool:
    return np.dtype(array.dtype).kind == "f" or str(array.dtype) == "bfloat16"


class _ArrayOptimizer:
    """Local optimizer on arrays: anything with ``update(param, grad)``."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def apply(self, params: Sequence[Any], grads: Sequence[Any], present: Sequence[bool]) -> None:
        for p, g, ok in zip(params, grads, present):
            if ok and g is not None:
                self.opt.update(p, g)

    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:
        if not callable(getattr(self.opt, "momentum_buffer", None)):
            raise ValueError(f"average_momentum=True needs an optimizer with momentum_buffer(param); "
                             f"{type(self.opt).__name__} has none")
        return [self.opt.momentum_buffer(p) for p in params]

    def state_dict(self) -> Any:
        return self.opt.state_dict() if hasattr(self.opt, "state_dict") else None

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            self.opt.load_state_dict(state)


def _wrap_local(opt: Any) -> Any:
    from . import torch as torch_adapter

    if torch_adapter.is_torch_optimizer(opt):
        return torch_adapter.TorchOptimizer(opt)
    if callable(getattr(opt, "update", None)):
        return _ArrayOptimizer(opt)
    raise TypeError(
        f"opt must be distopt.SGD, an object with update(param, grad), or a torch.optim.Optimizer; "
        f"got {type(opt).__name__}"
    )


class DistOpt:
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
        backend: force ``"mpi"``, ``"shm"`` or ``"nccl"`` (see
            :func:`distopt.world.build_world` for the default rule).
        comm: an existing communicator to use instead of building one.
        timeout: collective deadline in seconds (default
            ``$DISTOPT_TIMEOUT`` or 300).
        backward_passes_per_step: micro-batches accumulated locally per
            update (Horovod's name); their MEAN is all-reduced once per k
            calls. See :meth:`flush` for an epoch end.
        check_finite: skip a step on EVERY rank when any rank's gradient has
            a NaN or inf (decided by an all-reduce), counted in
            ``stats["skipped_steps"]``.
        abort_on_exception: under MPI, make an uncaught exception on any
            rank abort the whole job (printing its traceback) instead of
            leaving the others blocked. ``python -m mpi4py train.py`` is the
            alternative for scripts.
        overlap: start each bucket's all-reduce during backward, as soon as
            its gradients are ready (plain and half strategies through
            ``backward_and_update[_half]``: PyTorch post-accumulate-grad hooks,
            or an array loss whose ``backward()`` yields ``(param, grad)``
            pairs). Results are identical to ``overlap=False``. Not combined
            with ``backward_passes_per_step > 1``.

    Attributes:
        rank_in_global / global_rank: this process's rank, ``0..world_size-1``.
        rank_in_local / local_rank: its rank among the processes of its node.
        world_size: number of processes.
        stats: counters: ``steps``, ``wire_bytes`` (bytes this rank handed to
            the collectives, all steps), ``dense_bytes`` (what a dense
            all-reduce of the same gradients would hand over) and, for the
            sparse strategy, ``sparse_entries`` (entries selected by this
            rank) and ``sparse_dense_fallbacks`` (buckets whose selection
            travelled densely because that moved fewer bytes);
            ``buckets_started_in_backward`` counts reductions that overlap
            started before backward returned; ``skipped_steps`` counts steps
            skipped by ``check_finite``.
        residuals: error-feedback memory of the sparse strategy (per rank).
        cursor: the partial-update chunk cursor (same on every rank).
        sampler: a :class:`~distopt.data.DistributedSampler` whose epoch is
            saved in :meth:`state_dict` (assign it to include it).

    Raises:
        TypeError: ``opt`` is none of the supported kinds.
        ValueError: ``buffSize < 1`` or inconsistent rank arguments.
    """

    def __init__(self, opt: Any, nccl_id: Any = None, gpu_num: int | None = None,
                 gpu_per_node: int | None = None, buffSize: int = 4194304, *,
                 backend: str | None = None, comm: Communicator | None = None,
                 timeout: float | None = None, backward_passes_per_step: int = 1,
                 check_finite: bool = False, abort_on_exception: bool = True, overlap: bool = True) -> None:
        if buffSize < 1:
            raise ValueError(f"buffSize must be >= 1 element, got {buffSize}")
        self._accumulator = GradientAccumulator(backward_passes_per_step) if backward_passes_per_step != 1 else None
        self.check_finite = bool(check_finite)
        self.local = _wrap_local(opt)
        self.opt = opt
        self.buff_size = int(buffSize)
        if comm is None:
            comm, info = build_world(nccl_id, gpu_num, gpu_per_node, backend, timeout)
            self.rank_in_local = info.local_rank
            self.local_size = info.local_size
        else:
            self.rank_in_local = comm.rank if gpu_num is None else gpu_num
            self.local_size = comm.size if gpu_per_node is None else gpu_per_node
        self.comm = comm
        self.rank_in_global = comm.rank
        self.world_size = comm.size
        self.stats: dict[str, int] = {"steps": 0, "wire_bytes": 0, "dense_bytes": 0}
        self._specs: Any = None
        self._digested: tuple[Any, int] = (None, 0)
        self._plans: dict[tuple[int, bool], list[Bucket]] = {}
        self._buffers: dict[tuple[int, int], Any] = {}
        self.residuals = Residuals()
        self.cursor = ChunkCursor()
        self.sampler: Any = None
        self.overlap = bool(overlap)
        self._executor: ThreadPoolExecutor | None = None
        self._armed: tuple[BucketPipeline, dict[int, int]] | None = None
        self._hooked: set[int] = set()
        self._known: list[Any] | None = None  # parameter order learned from a generator-yielding loss
        self._last: tuple[str, list[Any], int, dict[str, Any]] | None = None
        self._joining = False
        self._strategies: dict[str, Callable[..., int]] = {
            "plain": self._dense, "half": self._half, "sparse": self._sparse, "partial": self._partial,
        }
        if abort_on_exception and comm.name == "mpi":
            install_abort_on_exception()
        if hasattr(self.local, "arrays"):
            self.sync_params(self.local.arrays())

    # ------------------------------------------------------------- names
    @property
    def local_rank(self) -> int:
        """Rank among the processes of this node (alias of ``rank_in_local``)."""
        return self.rank_in_local

    @property
    def global_rank(self) -> int:
        """Rank in the job (alias of ``rank_in_global``)."""
        return self.rank_in_global

    # ----------------------------------------------------- raw collectives
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """In-place all-reduce of one array (sum by default); see :class:`Communicator`."""
        return self.comm.all_reduce(array, op=op)

    def broadcast(self, array: Any, root: int = 0) -> Any:
        """In-place broadcast of one array from ``root``."""
        return self.comm.broadcast(array, root=root)

    def all_reduce_metrics(self, metrics: Mapping[str, Any], mean: tuple[str, ...] = ()) -> dict[str, float]:
        """Sum scalar metrics over ranks (means for names in ``mean``); see :func:`distopt.metrics.reduce_metrics`."""
        return reduce_metrics(self.comm, metrics, mean)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Send a picklable object from ``root`` to every rank; returns it on every rank.

        See :func:`distopt.metrics.broadcast_object`.
        """
        return broadcast_object(self.comm, obj, root)

    # ------------------------------------------------------ parameter sync
    def sync_params(self, params: Sequence[Any]) -> None:
        """Check that all ranks hold the same parameters, then broadcast rank 0's values.

        Call it once before the first forward pass for array models (the
        PyTorch adapter does it in the constructor; a step whose parameter
        list changed does it again, so parameters added later are broadcast
        when they first appear). Integer and boolean arrays (counters,
        masks) are broadcast too; a step never reduces or updates them.

        Args:
            params: arrays (NumPy or CuPy), modified in place on ranks != 0.

        Raises:
            CollectiveMismatchError: on every rank, naming the first
                parameter whose shape or dtype differs, or a count difference.
        """
        params = list(params)
        self._sync(params, {"world_size": self.world_size})
        if not hasattr(self.local, "arrays"):
            self._known = params  # the shared order for losses whose backward() yields (param, grad) pairs

    def _sync(self, params: list[Any], settings: Mapping[str, Any]) -> None:
        check_same(self.comm, params, settings)
        for bucket in plan_buckets([(p.shape, p.dtype) for p in params], DEFAULT_THRESHOLD, self.buff_size):
            flat, viewed = self._pack(bucket, params)
            self.comm.broadcast(flat, root=0)
            if not viewed:
                unpack(bucket, flat, params)

    # ------------------------------------------------------ pack / unpack
    @staticmethod
    def _pack(bucket: Bucket, arrays: Sequence[Any], buffer: Any = None) -> tuple[Any, bool]:
        """Return ``(flat, viewed)``: a flat view of a lone contiguous array (viewed=True)
        or a packed copy of the bucket's arrays in ``buffer`` (None packs as zeros)."""
        if bucket.alone:
            a = arrays[bucket.slots[0].index]
            if a is not None and a.flags.c_contiguous:
                return a.reshape(-1), True
        if buffer is None:
            ref = next((arrays[s.index] for s in bucket.slots if arrays[s.index] is not None), None)
            buffer = (np if ref is None else xp_of(ref)).empty(bucket.size, dtype=bucket.dtype)
        for s in bucket.slots:
            a = arrays[s.index]
            if a is None:
                buffer[s.offset:s.offset + s.size] = 0
            else:
                buffer[s.offset:s.offset + s.size] = a.reshape(-1)
        return buffer, False

    def _layout(self, params: list[Any], threshold: int, settings: Mapping[str, Any],
                reverse: bool = False) -> list[Bucket]:
        """Agree with the other ranks on this step, then return the bucket plan.

        One small all-gather per step (the "step header") carries a digest of
        the parameter shapes/dtypes, a digest of the strategy settings, and
        whether this rank's parameter list changed. Different digests raise
        :class:`CollectiveMismatchError` on every rank naming the first
        difference (so ranks on different strategies or models never
        exchange garbage); a changed parameter list on any rank makes every
        rank broadcast rank 0's parameters (first step, parameters added).
        """
        specs = tuple((p.shape, str(p.dtype)) for p in params)
        full = {"world_size": self.world_size, "buffSize": self.buff_size, "threshold": threshold,
                "reverse": reverse, **settings}
        if specs != self._digested[0]:
            self._digested = (specs, digest([[list(shape), dtype] for shape, dtype in specs]))
        header = np.array([self._digested[1], digest(full), int(specs != self._specs)], dtype=np.int64)
        everyone = self.comm.all_gather(header)
        if (everyone[:, :2] != everyone[0, :2]).any():
            check_same(self.comm, params, full)
            raise CollectiveMismatchError("parameters or settings differ across ranks (digests differ)")
        if everyone[:, 2].any():
            self._sync(params, full)
            self._specs, self._plans = specs, {}
        key = (threshold, reverse)
        if key not in self._plans:
            first = min(FIRST_BUCKET, self.buff_size) if reverse else None
            self._plans[key] = plan_buckets([(p.shape, p.dtype) for p in params], threshold, self.buff_size,
                                            reverse=reverse, first_bucket=first)
        return self._plans[key]

    @contextmanager
    def _context(self, where: str) -> Iterator[None]:
        """Prefix a collective error with the step number and ``where`` it happened."""
        try:
            yield
        except (CollectiveTimeoutError, CollectiveMismatchError) as exc:
            raise type(exc)(f"step {self.stats['steps'] + 1}, {where}: {exc}") from exc

    def _flags(self, params: list[Any], grads: list[Any], active: bool) -> tuple[np.ndarray, int, bool]:
        """One small all-reduce: per parameter, how many ranks have a gradient; how many ranks are active
        (not joined); whether any rank saw a non-finite gradient (only with ``check_finite``)."""
        flags = np.zeros(len(params) + 2, dtype=np.int32)
        for i, (p, g) in enumerate(zip(params, grads)):
            flags[i] = g is not None and _is_float(p)
        flags[-2] = int(active)
        if self.check_finite and active:
            flags[-1] = any(not bool(xp_of(g).isfinite(g).all()) for g in grads if g is not None and _is_float(g))
        with self._context("agreement on gradients present"):
            self.comm.all_reduce(flags, op="sum")
        skip = bool(flags[-1])
        if skip:
            self.stats["skipped_steps"] = self.stats.get("skipped_steps", 0) + 1
        return flags[:-2], int(flags[-2]), skip

    def _average(self, params: list[Any], grads: list[Any], threshold: int, settings: Mapping[str, Any],
                 reduce_bucket: Callable[[int, Any, int], int], active: bool = True) -> tuple[list[bool], int]:
        """Average ``grads`` across ranks bucket by bucket; given arrays are overwritten.

        ``reduce_bucket(i, flat, divisor)`` sums bucket ``i``'s flat buffer
        over ranks, divides it by ``divisor`` (the number of contributing
        ranks: the world size, fewer while ranks have joined) and returns
        the bytes it handed to the collectives. A missing gradient counts
        as zero (shared case H05); a parameter with no gradient on any rank
        is reported absent and not updated; integer/boolean parameters are
        never reduced (H09). Returns per-parameter update flags and the
        number of active ranks (0: every rank has joined, nothing was done).
        """
        with self._context("parameter check"):
            buckets = self._layout(params, threshold, settings)
        present, n_active, skip = self._flags(params, grads, active)
        if n_active == 0 or skip:
            return [False] * len(params), n_active
        for i, bucket in enumerate(buckets):
            if not _is_float(params[bucket.slots[0].index]):
                continue
            flat, viewed = self._pack(bucket, grads, self._buffers.get((threshold, i)))
            if not viewed:
                self._buffers[(threshold, i)] = flat
            with self._context(f"bucket {i + 1} of {len(buckets)} ({bucket.size} elements of {bucket.dtype})"):
                self.stats["wire_bytes"] += reduce_bucket(i, flat, n_active)
            self.stats["dense_bytes"] += int(flat.nbytes)
            if not viewed:
                unpack(bucket, flat, grads)
        self.stats["steps"] += 1
        return [bool(c) for c in present], n_active

    # ------------------------------------------------------ strategies
    def _apply(self, params: list[Any], grads: list[Any], present: list[bool]) -> None:
        """Local update of the parameters some rank had a gradient for (none: nothing runs)."""
        if any(present):
            self.local.apply(params, grads, present)

    def _pipeline(self, params: list[Any], threshold: int, settings: Mapping[str, Any],
                  codec: Codec) -> BucketPipeline:
        """A fresh bucket pipeline for one plain/half step (reverse-order buckets)."""
        with self._context("parameter check"):
            buckets = float_buckets(self._layout(params, threshold, settings, reverse=True))
        if self._executor is None and not hasattr(self.comm, "all_reduce_async"):
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distopt-allreduce")
        return BucketPipeline(self.comm, buckets, codec, self._buffers.setdefault(("pipeline", threshold), {}),
                              params, self._executor)

    def _pipelined(self, params: list[Any], grads: list[Any], threshold: int, active: bool,
                   settings: Mapping[str, Any], codec: Codec, pipeline: BucketPipeline | None = None) -> int:
        """Plain/half step: start every bucket (those not started during backward), then agree on
        which gradients exist and how many ranks are active, then finish, scale and update."""
        if pipeline is None:
            pipeline = self._pipeline(params, threshold, settings, codec)
        with self._context("bucket reductions"):
            pipeline.launch_rest(grads)
            pipeline.drain()
        present, n_active, skip = self._flags(params, grads, active)
        if n_active == 0 or skip:
            with self._context("bucket reductions"):
                pipeline.abandon()
            return n_active
        with self._context(f"bucket reductions ({len(pipeline.buckets)} buckets)"):
            self.stats["wire_bytes"] += pipeline.finish(grads, n_active)
        self.stats["dense_bytes"] += sum(int(b.size) * np.dtype(b.dtype).itemsize for b in pipeline.buckets)
        self.stats["steps"] += 1
        self._apply(params, grads, [bool(c) for c in present])
        return n_active

    def _dense(self, params: list[Any], grads: list[Any], threshold: int, active: bool = True,
               pipeline: BucketPipeline | None = None) -> int:
        return self._pipelined(params, grads, threshold, active, {"strategy": "plain"}, DenseCodec(), pipeline)

    def _half_codec(self, clip: float | None, wire: str, predivide: float | None) -> Codec:
        return HalfCodec(self.world_size, wire, predivide, clip)

    def _half(self, params: list[Any], grads: list[Any], threshold: int, active: bool = True,
              pipeline: BucketPipeline | None = None, *, clip: float | None, wire: str,
              predivide: float | None) -> int:
        settings = {"strategy": "half", "wire": wire, "predivide": predivide, "clip": clip}
        return self._pipelined(params, grads, threshold, active, settings,
                               self._half_codec(clip, wire, predivide), pipeline)

    def _sparse(self, params: list[Any], grads: list[Any], threshold: int, active: bool = True, *,
                spars: float, topK: bool, corr: bool) -> int:
        settings = {"strategy": "sparse", "spars": spars, "topK": topK, "corr": corr}

        def reduce_bucket(i: int, flat: Any, divisor: int) -> int:  # noqa: ARG001
            residual = self.residuals.get((threshold, i), flat) if corr else None
            return average_sparse(self.comm, flat, spars=spars, topK=topK, residual=residual, stats=self.stats)

        present, n_active = self._average(params, grads, threshold, settings, reduce_bucket, active)
        self._apply(params, grads, present)
        return n_active

    def _partial(self, params: list[Any], grads: list[Any], threshold: int, active: bool = True, *,
                 average_momentum: bool) -> int:
        with self._context("parameter check"):
            self._layout(params, threshold, {"strategy": "partial", "average_momentum": average_momentum})
        if average_momentum:
            self.local.momentum_arrays(params)  # raises before any update if the optimizer has none
        _, n_active, skip = self._flags(params, grads, active)
        if skip:
            return n_active
        self.local.apply(params, grads, [g is not None and _is_float(p) for p, g in zip(params, grads)])
        trainable = [i for i, p in enumerate(params) if _is_float(p)]
        chunks = plan_buckets([(params[i].shape, params[i].dtype) for i in trainable], threshold, max(threshold, 1))
        chunk = chunks[self.cursor.take(len(chunks))] if chunks else None
        self.stats["steps"] += 1
        if chunk is None:
            return n_active
        groups = [[params[i] for i in trainable]]
        if average_momentum:
            momenta = self.local.momentum_arrays([params[i] for i in trainable])
            if any(momenta[s.index] is None for s in chunk.slots):
                raise ValueError("average_momentum=True but a parameter of this chunk has no momentum buffer yet")
            groups.append(momenta)
        for arrays in groups:
            flat, viewed = self._pack(chunk, arrays)
            with self._context(f"partial chunk of {chunk.size} elements"):
                self.comm.all_reduce(flat, op="avg")
            if not viewed:
                unpack(chunk, flat, arrays)
            self.stats["wire_bytes"] += int(flat.nbytes)
        self.stats["dense_bytes"] += sum(int(params[i].nbytes) for i in trainable)
        return n_active

    def _run(self, kind: str, params: Sequence[Any], grads: Sequence[Any], threshold: int,
             **options: Any) -> None:
        """Check arguments, accumulate micro-batches if asked, then run strategy ``kind``."""
        if self._joining and kind in ("sparse", "partial"):
            raise ValueError(f"join() supports the plain and half strategies only, not {kind!r}")
        params, grads = _checked(params, grads)
        self._last = (kind, params, threshold, options)
        if self._accumulator is not None:
            released = self._accumulator.add(grads)
            if released is None:
                return
            grads = released
        self._strategies[kind](params, grads, threshold, **options)

    def step(self, params: Sequence[Any], grads: Sequence[Any], threshold: int = DEFAULT_THRESHOLD) -> None:
        """Average ``grads`` across ranks with a fused all-reduce, then update ``params``.

        Args:
            params: arrays (NumPy or CuPy) in the same order on every rank.
            grads: one gradient per parameter (same shape), or None for a
                parameter without a gradient this step. Given arrays are
                overwritten with the average.
            threshold: parameters with more than this many ELEMENTS are
                all-reduced alone, smaller ones fused into buffers of
                ``buffSize`` elements.

        Raises:
            ValueError: ``params`` and ``grads`` differ in length or shape.
            CollectiveMismatchError / CollectiveTimeoutError: from the ranks'
                agreement checks or a missed deadline, naming the step and
                bucket; no parameter is changed then.
        """
        self._run("plain", params, grads, threshold)

    def step_half(self, params: Sequence[Any], grads: Sequence[Any], threshold: int = DEFAULT_THRESHOLD,
                  clipping: bool = False, clip_Value: float = 100.0, *, wire: str = "float16",
                  predivide: float | None = None) -> None:
        """Like :meth:`step`, but gradients travel as 16-bit floats.

        See :class:`distopt.overlap.HalfCodec` for the scaling rule
        (``predivide``: default world size, no overflow; 1 keeps tiny
        gradients, may overflow) and what goes on the wire (2 bytes per
        element).

        Args:
            clipping: clip gradient elements to ``[-clip_Value, clip_Value]``
                before the cast (as the seed's DistOpt).
            wire: ``"float16"`` or ``"bfloat16"`` (NumPy: needs ml_dtypes).
        """
        self._run("half", params, grads, threshold, clip=clip_Value if clipping else None, wire=wire,
                  predivide=predivide)

    def step_sparse(self, params: Sequence[Any], grads: Sequence[Any], threshold: int = DEFAULT_THRESHOLD,
                    spars: float = 0.05, topK: bool = False, corr: bool = True) -> None:
        """Like :meth:`step`, but each bucket is sparsified before the exchange.

        Args:
            spars: with ``topK=True`` the fraction of each bucket's elements
                sent, in (0, 1]; else the magnitude threshold (>= 0).
            topK: top-K selection (exactly k per rank) or threshold selection.
            corr: error feedback: keep what was not sent as a per-bucket
                residual added to the next step's gradient.

        Raises:
            ValueError: ``spars`` out of range, raised on every rank before
                any communication.
        """
        if topK and not 0 < spars <= 1:
            raise ValueError(f"spars must be in (0, 1] with topK=True (the fraction of elements kept), got {spars}")
        if not topK and not spars >= 0:
            raise ValueError(f"spars must be >= 0 with topK=False (a magnitude threshold), got {spars}")
        self._run("sparse", params, grads, threshold, spars=spars, topK=topK, corr=corr)

    def step_partial(self, params: Sequence[Any], grads: Sequence[Any], threshold: int = DEFAULT_THRESHOLD,
                     average_momentum: bool = False) -> None:
        """Local update with this rank's own gradients, then average one chunk of parameters.

        Parameters are cut into chunks by the threshold rule (a parameter of
        more than ``threshold`` elements is its own chunk, smaller ones are
        fused up to ``threshold`` elements) in the shared order; each call
        averages the chunk under :attr:`cursor` and advances it, so after K
        calls all K chunks have been averaged once.

        Args:
            average_momentum: also average the chunk's momentum buffers.
                Default False, as in SINGA: it doubles the bytes per step,
                and the buffers are driven by gradients of parameters that
                are themselves kept close by the averaging.

        Raises:
            ValueError: ``average_momentum=True`` with an optimizer that
                exposes no momentum buffers.
        """
        self._run("partial", params, grads, threshold, average_momentum=average_momentum)

    def flush(self) -> None:
        """Apply a partial gradient accumulation now, as its own averaged update.

        With ``backward_passes_per_step=k``, an epoch whose micro-batch count
        is not a multiple of k leaves some micro-batches accumulated; call
        ``flush()`` on every rank at the epoch end to apply them (averaged
        over the micro-batches held), or :meth:`discard_accumulation` to
        drop them. Either way the next epoch starts with a clean counter
        (shared case H27). Does nothing without a pending accumulation.
        """
        if self._accumulator is None or self._accumulator.count == 0:
            return
        kind, params, threshold, options = self._last
        self._strategies[kind](params, self._accumulator.release(), threshold, **options)

    def discard_accumulation(self) -> None:
        """Drop a partial gradient accumulation (see :meth:`flush`)."""
        if self._accumulator is not None:
            self._accumulator.discard()

    @contextmanager
    def join(self, params: Sequence[Any] | None = None) -> Iterator[None]:
        """Let ranks with fewer batches finish early without hanging the others.

        Use around the training loop on every rank (Horovod's ``hvd.join``,
        PyTorch's ``Join``)::

            with opt.join():
                for batch in my_batches:      # counts may differ per rank
                    opt.backward_and_update(loss_of(batch))

        A rank that leaves the loop keeps answering the others' steps with
        zero gradients and applies the same averaged update, so parameters
        stay identical; while some ranks have joined, the average is taken
        over the ranks that contributed (sum / number of active ranks).
        Works with the plain and half strategies (the last one used); the
        sparse and partial strategies raise ValueError at their first step
        inside ``join``. Gradient accumulation is not combined with join.

        Args:
            params: the parameters, for an array model that ran no step
                before joining (the PyTorch adapter knows them).

        Raises:
            ValueError: nothing to shadow (no step yet and no ``params``).
        """
        self._joining = True
        try:
            yield
        except BaseException:
            self._joining = False
            raise
        if self._last is not None:
            kind, known, threshold, options = self._last
        elif params is not None or hasattr(self.local, "arrays"):
            kind, threshold, options = "plain", DEFAULT_THRESHOLD, {}
            known = list(params) if params is not None else self.local.arrays()
        else:
            self._joining = False
            raise ValueError("join() needs params= for an array model that has run no step")
        try:
            while self._strategies[kind](known, [None] * len(known), threshold, False, None, **options):
                pass
        finally:
            self._joining = False

    def agree(self, flag: bool, rule: str = "any") -> bool:
        """A decision every rank takes together (early stopping; shared case H31).

        Args:
            flag: this rank's vote.
            rule: ``"any"`` (true if some rank votes true), ``"all"``, or
                ``"root"`` (rank 0's vote).

        Returns:
            The same bool on every rank.
        """
        if rule not in ("any", "all", "root"):
            raise ValueError(f"rule must be 'any', 'all' or 'root', got {rule!r}")
        vote = np.array([bool(flag)], dtype=np.int32)
        if rule == "root":
            self.comm.broadcast(vote, root=0)
            return bool(vote[0])
        self.comm.all_reduce(vote, op="sum")
        return bool(vote[0] > 0) if rule == "any" else bool(vote[0] == self.world_size)

    def average_params(self, params: Sequence[Any] | None = None) -> None:
        """Average all (float) parameters across ranks at once, in place.

        The seed's examples do this before evaluation after partial updates.
        ``params`` may be omitted with a PyTorch optimizer.
        """
        params = self.local.arrays() if params is None else list(params)
        floats = [p for p in params if _is_float(p)]
        for bucket in plan_buckets([(p.shape, p.dtype) for p in floats], DEFAULT_THRESHOLD, self.buff_size):
            flat, viewed = self._pack(bucket, floats)
            self.comm.all_reduce(flat, op="avg")
            if not viewed:
                unpack(bucket, flat, floats)

    # --------------------------------------------------- backward + update
    def _backward(self, loss: Any) -> tuple[list[Any], list[Any]]:
        if hasattr(self.local, "arrays"):
            loss.backward()
            return self.local.arrays(), self.local.grads()
        params, grads = _pairs(loss.backward())
        if self._known is not None and len(params) == len(self._known):
            index_of = {id(p): i for i, p in enumerate(self._known)}
            if all(index_of.get(id(p)) is not None for p in params):  # arrival order -> the shared order
                ordered: list[Any] = [None] * len(params)
                for p, g in zip(params, grads):
                    ordered[index_of[id(p)]] = g
                return list(self._known), ordered
        return params, grads

    def _on_grad(self, param: Any) -> None:
        """PyTorch post-accumulate-grad hook: hand a final gradient to the armed pipeline."""
        if self._armed is not None:
            pipeline, index_of = self._armed
            index = index_of.get(id(param))
            if index is not None:
                pipeline.ready(index, as_array(param.grad))

    def _overlapped(self, kind: str, loss: Any, threshold: int, options: dict[str, Any]) -> bool:
        """Run a plain/half step with reductions started during backward; False if not applicable."""
        if not self.overlap or self._accumulator is not None:
            return False
        settings: dict[str, Any] = {"strategy": "plain"}
        codec: Codec = DenseCodec()
        if kind == "half":
            settings = {"strategy": "half", **options}
            codec = self._half_codec(**options)
        if hasattr(self.local, "arrays"):  # PyTorch
            tensors = self.local.params()
            if not all(hasattr(t, "register_post_accumulate_grad_hook") for t in tensors):
                return False
            for t in tensors:
                if id(t) not in self._hooked:
                    t.register_post_accumulate_grad_hook(self._on_grad)
                    self._hooked.add(id(t))
            params = self.local.arrays()
            pipeline = self._pipeline(params, threshold, settings, codec)
            self._armed = (pipeline, {id(t): i for i, t in enumerate(tensors)})
            try:
                loss.backward()
            finally:
                self._armed = None
            grads = self.local.grads()
            self.stats["buckets_started_in_backward"] = self.stats.get("buckets_started_in_backward", 0) + pipeline.next
        else:
            if self._known is None:
                return False
            params = self._known
            index_of = {id(p): i for i, p in enumerate(params)}
            pipeline = self._pipeline(params, threshold, settings, codec)
            grads = [None] * len(params)
            for p, g in loss.backward():
                i = index_of.get(id(p))
                if i is None or params[i] is not p:
                    raise ValueError("with overlap=True an array model's parameter list must stay fixed; a new "
                                     "parameter appeared (use DistOpt(..., overlap=False) to change it)")
                grads[i] = g
                pipeline.ready(i, g)
            self.stats["buckets_started_in_backward"] = self.stats.get("buckets_started_in_backward", 0) + pipeline.next
        self._last = (kind, params, threshold, options)
        self._strategies[kind](params, grads, threshold, True, pipeline, **options)
        return True

    def backward_and_update(self, loss: Any, threshold: int = DEFAULT_THRESHOLD) -> None:
        """Backward pass, fused all-reduce of the gradients, local update (see :meth:`step`).

        With ``overlap=True`` (the default) each bucket's all-reduce starts
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
        if not self._overlapped("plain", loss, threshold, {}):
            params, grads = self._backward(loss)
            self.step(params, grads, threshold)
            if not hasattr(self.local, "arrays"):
                self._known = params

    def backward_and_update_half(self, loss: Any, threshold: int = DEFAULT_THRESHOLD, clipping: bool = False,
                                 clip_Value: float = 100.0, *, wire: str = "float16",
                                 predivide: float | None = None) -> None:
        """Backward pass, then :meth:`step_half` (overlapped as :meth:`backward_and_update`)."""
        options = {"clip": clip_Value if clipping else None, "wire": wire, "predivide": predivide}
        if not self._overlapped("half", loss, threshold, options):
            params, grads = self._backward(loss)
            self.step_half(params, grads, threshold, clipping, clip_Value, wire=wire, predivide=predivide)
            if not hasattr(self.local, "arrays"):
                self._known = params

    def backward_and_partial_update(self, loss: Any, threshold: int = DEFAULT_THRESHOLD,
                                    average_momentum: bool = False) -> None:
        """Backward pass, then :meth:`step_partial`."""
        self.step_partial(*self._backward(loss), threshold, average_momentum)

    def backward_and_sparse_update(self, loss: Any, threshold: int = DEFAULT_THRESHOLD, spars: float = 0.05,
                                   topK: bool = False, corr: bool = True) -> None:
        """Backward pass, then :meth:`step_sparse`."""
        self.step_sparse(*self._backward(loss), threshold, spars, topK, corr)

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: the local optimizer's state and the counters."""
        state = {"local": self.local.state_dict(), "stats": dict(self.stats),
                 "residuals": self.residuals.state_dict(), "cursor": self.cursor.state_dict()}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.local.load_state_dict(state["local"])
        self.stats = dict(state["stats"])
        self.residuals.load_state_dict(state.get("residuals", {}))
        self.cursor.load_state_dict(state["cursor"])
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        """Release the communicator (and the reduction thread of backends without async all-reduce)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self.comm.close()


def _checked(params: Sequence[Any], grads: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"got {len(params)} params but {len(grads)} grads")
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is not None and g.shape != p.shape:
            raise ValueError(f"grads[{i}] has shape {g.shape}, params[{i}] has shape {p.shape}")
    return params, grads


def _pairs(pairs: Iterable[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    params: list[Any] = []
    grads: list[Any] = []
    for p, g in pairs:
        params.append(p)
        grads.append(g)
    return params, grads
