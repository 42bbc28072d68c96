"""The shm backend's collectives: all-reduce, broadcast and the gathers over the control rows (the sharded ones,
reduce-scatter, in-place all-gather and all-to-all, are in :mod:`~distopt.comm.shm.shards`).

``all_reduce`` is a reduce-scatter followed by an all-gather, as in the bandwidth-optimal algorithms of Patarasuk &
Yuan (2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations") and NCCL's ring. With N ranks,
rank r reduces the r-th 1/N slice of the elements across all ranks' inputs, writes it into its own segment and
publishes ``reduced = c``; every rank then copies the other N - 1 slices out. Rank r never copies its own input slice
into shared memory (it reads it from the caller's array), so each rank copies (N-1)/N of the array's bytes in and as
many out. Reductions add in rank order (:func:`~distopt.comm.rank_order.reduce_in_rank_order`), so float results are
deterministic and identical on every rank; float16 is accumulated in float32 (``"avg"`` divides there, before
rounding). An array of at most 8 KiB skips the reduce-scatter: every rank publishes all of it and reduces the whole
array from every rank's copy, in the same rank order (the same bits), so it waits for its peers once instead of twice.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..base import REDUCE_OPS, check_reduce_args
from ..lifecycle import CommunicatorState, collective
from ..rank_order import accumulator_dtype, reduce_in_rank_order
from ..staging import staged
from ..wait import resolve_timeout
from .rows import REDUCED, ControlRows, check_platform, dtype_code
from .segments import Segments
from .shards import ShmShards, require_ndarray

if TYPE_CHECKING:
    from ...launch.ranks import RankInfo
    from ...launch.info import Launch

__all__ = ["ShmCommunicator"]

# Bytes of accumulator a reduction works on at a time (stays in L2; 256 KiB measured fastest against 64 KiB-4 MiB).
_CHUNK_BYTES = 1 << 18
_SLICE_ALIGN = 64  # bytes; reduce-scatter slices start on cache lines
_SMALL_BYTES = 8192  # an all-reduce of at most this many bytes is reduced whole by every rank
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
_built_from_launch: dict[str, int] = {}  # job id -> communicators this process built from it


class ShmCommunicator(ShmShards, CommunicatorState):
    """Collectives between the processes of one machine through shared memory.

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: the number of processes.
        job_id: the id every process of the job shares (:attr:`distopt.launch.nccl_id.NcclIdHolder.job_id`);
            letters, digits, ``_`` and ``-``.
        timeout: deadline of the rendezvous and of each collective, in seconds. Default: ``$DISTOPT_TIMEOUT``, else
            :data:`~distopt.comm.base.DEFAULT_TIMEOUT`.

    Raises:
        ValueError: bad rank, size, job id or timeout.
        BackendUnavailableError: ``size > 1`` on a CPU other than x86 (see :mod:`distopt.comm.shm.rows`).
        FileExistsError: a communicator for ``job_id`` is already open.
        CollectiveMismatchError: ranks were given different sizes.
        CollectiveTimeoutError: not every rank joined before the deadline.

    Every collective raises :class:`~distopt.errors.CollectiveTimeoutError` naming the operation, its number and the
    missing ranks when they do not arrive in time, or promptly when one has exited or closed; the communicator should
    be closed after that. A :class:`~distopt.errors.CollectiveMismatchError` leaves it usable.
    """

    name = "shm"

    def __init__(self, rank: int, size: int, job_id: str, timeout: float | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank={rank}, size={size}")
        if not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id must be 1-200 letters, digits, '_' or '-', got {job_id!r}")
        check_platform(size)
        self.rank, self.size, self.job_id, self.timeout = rank, size, job_id, resolve_timeout(timeout)
        self._segments = Segments(job_id, rank, size)
        self._splits = [0]  # a list: shared with the views of this communicator (distopt.launch.world.shared_view)
        self._ctl: ControlRows | None = None
        self._scratch = np.empty(_CHUNK_BYTES, np.uint8)
        try:
            self._ctl = ControlRows(self._segments, size, self.timeout)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[ShmCommunicator, RankInfo]:
        """Build it for ``python -m distopt.launch`` or :func:`distopt.launch.spawn`: the launch's ranks and
        job id (which names the segments). Building it is collective, like MPI's ``Comm_dup``: the k-th
        communicator a process builds from its launch (k > 0: a second DistOpt) names its segments
        ``<job_id>-c<k>``, so every rank must build them in the same order. Raises as :class:`ShmCommunicator`."""
        info = launch.rank_info()
        k = _built_from_launch.setdefault(launch.job_id, 0)
        _built_from_launch[launch.job_id] = k + 1
        job_id = launch.job_id if k == 0 else f"{launch.job_id}-c{k}"
        return cls(info.global_rank, info.world_size, job_id, launch.timeout), info

    def _bounds(self, n: int, itemsize: int, p: int) -> tuple[int, int]:
        """Element range of rank p's reduce-scatter slice of n elements."""
        unit = max(1, _SLICE_ALIGN // itemsize)
        units = -(-n // unit)
        return min(n, units * p // self.size * unit), min(n, units * (p + 1) // self.size * unit)

    @staged
    @collective
    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``array`` across ranks in place (reduce-scatter + all-gather).

        Args:
            array: C-contiguous NumPy array, same element count and dtype on every rank.
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; see :meth:`distopt.comm.base.Communicator.all_reduce`.

        Returns:
            ``array``, holding the result (identical on every rank).

        Raises:
            TypeError: not a NumPy array, unsupported dtype, integer ``avg`` or a non-contiguous array (checked
                locally, before any communication).
            CollectiveMismatchError: element counts, dtypes or ops differ.
            CollectiveTimeoutError: a rank did not arrive in time, exited or closed.
        """
        require_ndarray(array)
        check_reduce_args(array, op)
        code = dtype_code(array.dtype)
        if self.size == 1:
            return array
        ctl, n, itemsize, me = self._ctl, array.size, array.itemsize, self.rank
        flat = array.reshape(-1)
        if 0 < array.nbytes <= _SMALL_BYTES:
            c, _, _ = ctl.arrive("all_reduce", n, code, REDUCE_OPS.index(op), flat.view(np.uint8))
            views = [ctl.published(p)[:array.nbytes].view(array.dtype) for p in range(self.size)]
            wide = accumulator_dtype(array.dtype)
            acc = flat if wide == array.dtype else np.empty(n, wide)
            self._reduce(views, op, acc, flat)
            ctl.finish(c)
            return array
        lo, hi = self._bounds(n, itemsize, me)
        c, deadline, _ = ctl.arrive("all_reduce", n, code, REDUCE_OPS.index(op),
                                    flat.view(np.uint8), (lo * itemsize, hi * itemsize))
        if n == 0:
            ctl.finish(c)
            return array
        views = [flat if p == me else ctl.published(p)[:n * itemsize].view(array.dtype) for p in range(self.size)]
        own = self._segments.mine()[:array.nbytes].view(array.dtype)
        self._reduce_range(views, lo, hi, op, [flat[lo:hi], own[lo:hi]], direct=me < 2)
        ctl.rows[me, REDUCED] = c
        for k in range(1, self.size):
            p = (me + k) % self.size
            ctl.wait(REDUCED, c, [p], "all_reduce", c, deadline, "did not finish its reduction")
            plo, phi = self._bounds(n, itemsize, p)
            flat[plo:phi] = views[p][plo:phi]
        ctl.finish(c)
        return array

    def _reduce(self, views: list[np.ndarray], op: str, acc: np.ndarray, *outs: np.ndarray) -> None:
        """Reduce ``views`` (every rank's elements, rank order) into ``acc``, divide there for ``"avg"``,
        then copy the result into each of ``outs`` that is not ``acc``."""
        reduce_in_rank_order(views, op, acc)
        if op == "avg":
            np.divide(acc, self.size, out=acc)
        for out in outs:
            if out is not acc:
                out[...] = acc

    def _reduce_range(self, views: list[np.ndarray], lo: int, hi: int, op: str, outs: list[np.ndarray],
                      direct: bool) -> None:
        """Reduce elements [lo, hi) of every rank's input (rank order) into each of ``outs`` (``hi - lo`` elements),
        chunk by chunk of the scratch accumulator; ``direct``: accumulate in ``outs[0]`` instead where the dtype is its
        own accumulator (all-reduce: ranks 0 and 1, whose input the first addition consumes)."""
        scratch = self._scratch.view(accumulator_dtype(views[0].dtype))
        direct = direct and scratch.dtype == views[0].dtype
        for start in range(lo, hi, scratch.size):
            stop = min(start + scratch.size, hi)
            chunk = [out[start - lo:stop - lo] for out in outs]
            acc = chunk[0] if direct else scratch[:stop - start]
            self._reduce([view[start:stop] for view in views], op, acc, *chunk)

    @staged
    @collective
    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with root's contents, in place.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            ValueError: ``root`` out of range.
            CollectiveMismatchError: element counts, dtypes or roots differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        require_ndarray(array)
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        code = dtype_code(array.dtype)
        is_root = self.rank == root
        payload = np.ascontiguousarray(array).reshape(-1).view(np.uint8) if is_root else None
        c, _, _ = self._ctl.arrive("broadcast", array.size, code, root, payload)
        if not is_root and array.nbytes:
            src = self._ctl.published(root)[:array.nbytes].view(array.dtype)
            np.copyto(array, src.reshape(array.shape))
        self._ctl.finish(c)
        return array

    @staged
    @collective
    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Gather equal-sized arrays from every rank.

        Returns:
            A new array of shape ``(size, *array.shape)``; row r is rank r's input.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            CollectiveMismatchError: element counts or dtypes differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        require_ndarray(array)
        code = dtype_code(array.dtype)
        payload = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        c, _, _ = self._ctl.arrive("all_gather", array.size, code, 0, payload)
        out = np.empty((self.size, *array.shape), array.dtype)
        rows = out.reshape(self.size, array.size).view(np.uint8)
        for p in range(self.size):
            if payload.nbytes:
                rows[p] = payload if p == self.rank else self._ctl.published(p)[:payload.nbytes]
        self._ctl.finish(c)
        return out

    @staged
    @collective
    def all_gather_v(self, array: np.ndarray) -> list[np.ndarray]:
        """Gather 1-D arrays whose lengths (in elements, may be 0) differ per rank.

        Returns:
            ``size`` new arrays; entry r is rank r's input.

        Raises:
            TypeError: not a NumPy array or unsupported dtype.
            ValueError: ``array`` is not 1-D.
            CollectiveMismatchError: dtypes differ.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        require_ndarray(array)
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes 1-D arrays, got shape {array.shape}")
        code = dtype_code(array.dtype)
        payload = np.ascontiguousarray(array).view(np.uint8)
        c, _, counts = self._ctl.arrive("all_gather_v", array.size, code, 0, payload)
        out = []
        for p, count in enumerate(counts):
            if p == self.rank:
                out.append(array.copy())
            elif count == 0:
                out.append(np.empty(0, array.dtype))
            else:
                out.append(self._ctl.published(p)[:count * array.itemsize].view(array.dtype).copy())
        self._ctl.finish(c)
        return out

    @collective
    def split(self, ranks: Sequence[int]) -> ShmCommunicator | None:
        """A communicator of ``ranks`` (ascending, renumbered from 0) on segments of its own; None outside them.

        Collective: every rank calls it with the same ranks, in the same order (use :func:`distopt.comm.groups.split`,
        which checks that first). The k-th split of a communicator names its segments ``<job_id>-g<k>``, so groups of
        the same ranks never share memory.
        """
        self._splits[0] += 1
        job_id = f"{self.job_id}-g{self._splits[0]}"
        self.barrier()  # every rank has counted this split before any member builds the segments
        if self.rank not in ranks:
            return None
        return ShmCommunicator(list(ranks).index(self.rank), len(ranks), job_id, self.timeout)

    @collective
    def barrier(self) -> None:
        """Block until every rank has reached the barrier.

        Raises:
            CollectiveMismatchError: another rank called a different collective.
            CollectiveTimeoutError: as for :meth:`all_reduce`.
        """
        c, _, _ = self._ctl.arrive("barrier", 0, 0, 0)
        self._ctl.finish(c)

    def close(self) -> None:
        """Unmap everything and unlink the segments this rank created; idempotent.

        First waits (up to the timeout; not for peers that exited or closed) until every peer has finished the last
        collective this rank completed, since a peer may still be reading this rank's segment. Peers waiting on this
        rank in a later collective then fail promptly.
        """
        if self.closed:
            return
        self.closed = True
        if self._ctl is not None:
            self._ctl.close()
        self._segments.close()

    def __repr__(self) -> str:
        return f"ShmCommunicator(rank={self.rank}, size={self.size}, job_id={self.job_id!r}, timeout={self.timeout:g})"
