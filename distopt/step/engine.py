"""The step engine: layout, agreement and the bucket pipeline, for any strategy.

Per step, the engine

1. agrees with the other ranks on the step (one small all-gather, the "step
   header": digests of the parameter shapes/dtypes and of the strategy's
   settings, whether this rank's parameter list changed, whether it is inside
   ``join()``, and, when the gradients are already known (a step called
   after backward), whether any is missing or not finite). Different digests raise
   :class:`~distopt.errors.CollectiveMismatchError` on every rank naming
   the first difference (so ranks on different strategies or models never
   exchange garbage); a changed parameter list on any rank makes every rank
   take rank 0's parameters (first step, parameters added, removed or
   resized) and lays the buckets out anew, with new buffers;
2. runs the strategy's bucket reductions through one
   :class:`~distopt.step.pipeline.BucketPipeline`;
3. agrees on which gradients exist, how many ranks contribute and whether
   to skip the step, then completes the buckets. That takes one more small
   all-reduce only when the header could not settle it: a gradient missing
   on some rank, a rank inside ``join()``, or gradients not known at the
   header (overlap) that the reduction cannot settle. It can (host arrays,
   ``check_finite`` off, no sharding, nobody joined): the reduced gradients
   are bitwise the same on every rank and one nobody had is all zeros, so
   every rank gives the same answer to "is a reduced gradient all zeros?"
   (read from its start, one element as a rule), and only a yes costs the
   flags (:meth:`Engine.complete`). A steady-state step costs one control
   collective, overlapped or not.

Averaging independent random inits would shrink them, so parameters are
broadcast from rank 0, never averaged. Every collective error carries the
step number and where it happened (bucket i of n).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..core._array import xp_of
from .agreement import GroupSettings, check_same, digest
from ..core.buckets import DEFAULT_THRESHOLD, Bucket, is_float, pack, plan_buckets, unpack
from ..comm.base import Communicator
from ..core.counters import Counters
from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from ..sharding.plan import ShardPlan
from ..sharding.sync import BucketSync
from .pipeline import BucketPipeline, Launcher
from ..strategies.base import GradientStrategy

__all__ = ["Engine", "Outcome", "DEFAULT_THRESHOLD", "FIRST_BUCKET"]

FIRST_BUCKET = 262144
"""ELEMENTS of the first reverse-order bucket (1 MiB of float32, as PyTorch DDP), so reduction starts early."""


@dataclass
class Outcome:
    """The ranks' agreement on one step.

    Attributes:
        present: per parameter, True when some rank had a (float) gradient.
        active: ranks that contributed (fewer than the world size while
            some have joined; 0 when every rank has joined).
        skipped: ``check_finite`` found a NaN or inf on some rank: every
            rank skips the update.
    """

    present: list[bool]
    active: int
    skipped: bool

    @property
    def applies(self) -> bool:
        """True when the step updates parameters."""
        return self.active > 0 and not self.skipped


class _Pending(Outcome):
    """The header's outcome of a step whose gradients the reduction settles (see the module docs)."""


def _all_zero(array: Any) -> bool:
    """True when every element of a host array is zero (or it has none), read in growing slices from its start."""
    flat = array.reshape(-1)
    if flat.size and flat[0] != 0:
        return False
    start, step = 0, 64
    while start < flat.size:
        if flat[start:start + step].any():
            return False
        start, step = start + step, step * 8
    return True


@dataclass
class _Layout:
    """One bucket layout of the current parameter list, with its packing buffers.

    ``buffers`` maps a bucket index to its flat buffer (``bucket.size``
    elements of ``bucket.dtype``), allocated once and kept while the layout
    lives; with ``gradient_as_bucket_view`` they are the gradients' memory
    (each ``.grad`` a view into one), allocated by the PyTorch adapter.
    """

    key: int
    buckets: list[Bucket]
    buffers: dict[int, Any] = field(default_factory=dict)
    shards: ShardPlan | None = None


class Engine:
    """Drives any :class:`~distopt.strategies.Strategy` over one communicator.

    Args:
        comm: the communicator.
        buff_size: capacity of a fusion buffer in ELEMENTS (>= 1).
        check_finite: skip a step on every rank when any rank's gradient
            has a NaN or inf.
        counters: the counters to update (``DistOpt.stats``).
        divide_by_initial_world_size: while some ranks have joined, divide
            the sum by the world size (PyTorch DDP's default: joined ranks
            contribute zeros); False divides by the ranks that contributed.
        sync: what the step does with each bucket's reduction
            (:mod:`distopt.sharding.sync`): all-reduce (the default) or,
            sharded, reduce-scatter.
    """

    def __init__(self, comm: Communicator, buff_size: int, check_finite: bool, counters: Counters,
                 divide_by_initial_world_size: bool = True, sync: BucketSync | None = None) -> None:
        self.comm, self.buff_size, self.check_finite, self.counters = comm, buff_size, check_finite, counters
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.sync = BucketSync() if sync is None else sync
        self.layout: _Layout | None = None  # the last step's layout
        self.launch = Launcher(comm)
        self._specs: tuple[Any, ...] | None = None
        self._specs_digest: tuple[Any, int] = (None, 0)
        self._layouts: dict[tuple[int, bool, bool], _Layout] = {}

    # ------------------------------------------------------------ context
    @contextmanager
    def context(self, where: str | Callable[[], str]) -> Iterator[None]:
        """Prefix a collective error with the step number and ``where`` it happened (a string, or a
        function building it, called only on an error)."""
        try:
            yield
        except (CollectiveTimeoutError, CollectiveMismatchError) as exc:
            if str(exc).startswith("step "):
                raise
            place = where if isinstance(where, str) else where()
            raise type(exc)(f"step {self.counters.steps + 1}, {place}: {exc}") from exc

    # ------------------------------------------------- parameters and layout
    def broadcast_params(self, params: Sequence[Any], settings: Mapping[str, Any]) -> None:
        """Check that all ranks hold the same parameters and ``settings``, then take rank 0's values.

        Raises:
            CollectiveMismatchError: on every rank, naming the first difference.
        """
        params = list(params)
        check_same(self.comm, params, settings)
        for bucket in plan_buckets([(p.shape, p.dtype) for p in params], DEFAULT_THRESHOLD, self.buff_size):
            flat, viewed = pack(bucket, params)
            self.comm.broadcast(flat, root=0)
            if not viewed:
                unpack(bucket, flat, params)
        specs = tuple((p.shape, p.dtype) for p in params)
        if specs != self._specs:  # the next step with these parameters needs no second broadcast
            self._specs, self._layouts = specs, {}

    def _not_finite(self, grads: Sequence[Any]) -> bool:
        return any(not bool(xp_of(g).isfinite(g).all()) for g in grads if g is not None and is_float(g))

    def _agree(self, strategy: GradientStrategy, params: list[Any], threshold: int, joined: bool,
               grads: Sequence[Any] | None, groups: GroupSettings | None) -> tuple[_Layout, Outcome | None]:
        """The step header (see the module docs); returns the layout for this step, and the step's
        outcome when the header settled it."""
        reverse = strategy.supports_overlap
        specs = tuple((p.shape, p.dtype) for p in params)  # dtype objects: str() per step is costly
        full = {"world_size": self.comm.size, "buffSize": self.buff_size, "threshold": threshold,
                "reverse": reverse, **self.sync.describe(), **strategy.describe()}
        if groups is not None:
            full["optimizer settings"] = groups.digest
        if specs != self._specs_digest[0]:
            self._specs_digest = (specs, digest([[list(shape), str(dtype)] for shape, dtype in specs]))
        # gradients: 0 known and every float one present; 1 not known yet, the reduction settles them;
        # 2 known with some missing, or not known and the flags must settle them
        if grads is not None:
            unsettled = 2 * any(g is None for p, g in zip(params, grads) if is_float(p))
        else:
            unsettled = 1 if (not self.check_finite and self.sync.settles_from_reduced and strategy.identical_replicas
                              and all(isinstance(p, np.ndarray) for p in params)) else 2
        not_finite = self.check_finite and not unsettled and self._not_finite(grads)  # type: ignore[arg-type]
        header = np.array([self._specs_digest[1], digest(full), int(specs != self._specs), int(joined),
                           unsettled, int(not_finite)], dtype=np.int64)
        everyone = self.comm.all_gather(header)
        self.counters.control_collectives += 1
        if (everyone[:, :2] != everyone[0, :2]).any():
            check_same(self.comm, params, {**{k: v for k, v in full.items() if k != "optimizer settings"},
                                           **(groups.values if groups is not None else {})})
            raise CollectiveMismatchError("parameters or settings differ across ranks (digests differ)")
        if everyone[:, 3].any() and not strategy.supports_join:
            raise ValueError(f"join() supports strategies with supports_join (plain, half), not {strategy.name!r}: "
                             f"rank(s) {np.flatnonzero(everyone[:, 3]).tolist()} are inside join()")
        if everyone[:, 2].any():
            self.broadcast_params(params, full)
        slot = (threshold, reverse, strategy.reduces)
        if slot not in self._layouts:
            first = min(FIRST_BUCKET, self.buff_size) if reverse else None
            buckets = plan_buckets([(p.shape, p.dtype) for p in params], threshold, self.buff_size,
                                   reverse=reverse, first_bucket=first) if strategy.reduces else []
            floats = [b for b in buckets if is_float(b.dtype)]
            shards = self.sync.plan(floats, self.comm.rank, self.comm.size)
            self._layouts[slot] = _Layout(digest([self._specs_digest[1], threshold, reverse]), floats, shards=shards)
        settled = None
        present = [is_float(p) for p in params]
        if not everyone[:, 3:5].any():  # nobody joined, every rank holds every float gradient
            settled = Outcome(present, self.comm.size, bool(everyone[:, 5].any()))
        elif not everyone[:, 3].any() and everyone[:, 4].max() == 1 and not everyone[:, 5].any():
            settled = _Pending(present, self.comm.size, False)
        return self._layouts[slot], settled

    # ------------------------------------------------------------- the step
    def begin(self, strategy: GradientStrategy, params: Sequence[Any], threshold: int | None,
              joined: bool = False, views: bool = True, grads: Sequence[Any] | None = None,
              bucket_view: bool = False, groups: GroupSettings | None = None) -> BucketPipeline:
        """Agree on the step, then return its pipeline (buckets may start at once: overlap).

        ``threshold``: elements above which a parameter is a bucket of its
        own; None means the strategy's ``default_threshold``.

        ``joined``: this rank is inside ``join()`` (stepping or shadowing).
        ``views``, ``bucket_view``: see :class:`~distopt.step.pipeline.BucketPipeline`
        (with ``bucket_view`` the caller fills the layout's buffers,
        ``pipeline.buffers``, before the first gradient is ready).
        ``grads``: the step's gradients when backward has already run (the
        header then settles the step's outcome); None during backward.
        ``groups``: the local optimizer's hyper-parameters, compared across
        ranks in the same header.

        Raises:
            CollectiveMismatchError: parameters or settings (the optimizer's
                included) differ across ranks, on every rank, naming the first.
            ValueError: a rank has joined and the strategy does not support ``join``.
        """
        params = list(params)
        threshold = strategy.threshold(threshold)
        with self.context("parameter check"):
            layout, settled = self._agree(strategy, params, threshold, joined, grads, groups)
        self.layout = layout
        buffers = self.sync.buffers(layout.buffers)
        sync = self.sync.begin(self.launch, layout.shards, layout.buckets, buffers, self.comm, self.context,
                               self.counters)
        return BucketPipeline(strategy, layout.buckets, buffers, layout.key, params, self.launch,
                              self.comm, self.counters, self.context, views, bucket_view, settled, sync)

    def complete(self, pipeline: BucketPipeline, grads: list[Any], active: bool = True) -> Outcome:
        """Start the buckets not started yet, agree on the step, then average ``grads`` in place.

        A missing gradient counts as zero; a parameter with no gradient on
        any rank is reported absent; integer and boolean parameters are
        never reduced. A step skipped before the reduction (a rank's own
        gradient is not finite) writes nothing.

        With ``check_finite`` the decision is also taken on the REDUCED
        gradient (an overflowing half-precision sum of finite inputs), with
        one more one-element all-reduce so every rank decides the same; the
        averaged (non-finite) values are then left in ``grads``.

        A step the header left pending (gradients not known then, see the
        module docs) completes the buckets first, then settles which
        gradients exist from the reduced ones (:meth:`_settle_from_reduced`).
        """
        if pipeline.settled is not None and not pipeline.settled.applies:  # skipped before any reduction
            return self.agree_on_gradients(pipeline.params, grads, active, pipeline.settled)
        pipeline.launch_rest(grads)
        if isinstance(pipeline.settled, _Pending):
            return self._settle_from_reduced(pipeline, grads, active)
        outcome = self.agree_on_gradients(pipeline.params, grads, active, pipeline.settled)
        if not outcome.applies:
            pipeline.abandon()
            return outcome
        pipeline.finish(grads, self.comm.size if self.divide_by_initial_world_size else outcome.active)
        if pipeline.buckets and pipeline.sync.vote(grads, outcome.present, self.check_finite, self._vote):
            outcome.skipped = True
            self.counters.skipped_steps += 1
        return outcome

    def _vote(self, bad: bool) -> bool:
        """Whether some rank's ``bad`` is set: one one-element all-reduce (max), on the reduced gradient."""
        flag = np.array([int(bad)], dtype=np.int32)
        with self.context("agreement on the reduced gradient being finite"):
            self.comm.all_reduce(flag, op="max")
        self.counters.control_collectives += 1
        return bool(flag[0])

    def _settle_from_reduced(self, pipeline: BucketPipeline, grads: list[Any], active: bool) -> Outcome:
        """Finish a pending step's buckets (nobody joined: divided by the world size), then its outcome:
        every float gradient present when none reduced to all zeros (the same answer on every rank, the
        reduced values being the same), else the gradient flags' all-reduce, from this rank's own ``grads``."""
        had = [g is not None for g in grads]
        pipeline.finish(grads, self.comm.size)
        params = pipeline.params
        for i, p in enumerate(params):
            if not is_float(p):
                continue
            reduced = grads[i]
            if reduced is None:  # a bucket view's slot: the gradient is its flat buffer, never unpacked
                b, s = pipeline.where[i]
                reduced = pipeline.flats[b][0][s.offset:s.offset + s.size]
            if _all_zero(reduced):
                return self.agree_on_gradients(params, [g if h else None for g, h in zip(grads, had)], active)
        return Outcome([is_float(p) for p in params], self.comm.size, False)

    def agree_on_gradients(self, params: Sequence[Any], grads: Sequence[Any], active: bool,
                           settled: Outcome | None = None) -> Outcome:
        """Per parameter, whether some rank has a gradient; how many ranks are active (not joined);
        whether any rank saw a non-finite gradient (only with ``check_finite``).

        ``settled``: the outcome the step header already agreed on (no
        collective then); None runs one small all-reduce.
        """
        if settled is not None:
            outcome = Outcome(list(settled.present), settled.active, settled.skipped)
            if outcome.skipped:
                self.counters.skipped_steps += 1
            return outcome
        flags = np.zeros(len(params) + 2, dtype=np.int32)
        for i, (p, g) in enumerate(zip(params, grads)):
            flags[i] = g is not None and is_float(p)
        flags[-2] = int(active)
        if self.check_finite and active:
            flags[-1] = self._not_finite(grads)
        with self.context("agreement on gradients present"):
            self.comm.all_reduce(flags, op="sum")
        self.counters.control_collectives += 1
        outcome = Outcome([bool(c) for c in flags[:-2]], int(flags[-2]), bool(flags[-1]))
        if outcome.skipped:
            self.counters.skipped_steps += 1
        return outcome

    def average_arrays(self, bucket: Bucket, arrays: Sequence[Any], where: str) -> int:
        """All-reduce the arrays of one bucket layout to their mean, in place; returns the bytes sent."""
        flat, viewed = pack(bucket, arrays)
        with self.context(where):
            self.comm.all_reduce(flat, op="avg")
        if not viewed:
            unpack(bucket, flat, list(arrays))
        return int(flat.nbytes)

    def close(self) -> None:
        """Stop the reduction thread (backends without asynchronous all-reduce)."""
        self.launch.close()
