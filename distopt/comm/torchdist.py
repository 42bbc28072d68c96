"""torch.distributed backend: gloo for CPU arrays and tensors, NCCL for CUDA tensors.

The job is joined with ``env://`` as ``torchrun`` sets it up, or through a new group of all the ranks of the script's
own process group, so distopt's traffic never interleaves with the caller's (:mod:`~distopt.comm.torch_join`). NumPy
arrays travel as CPU tensors that share their memory, CuPy arrays as CUDA tensors through DLPack, torch tensors as they
are; collectives return the caller's array type (:mod:`~distopt.comm.torch_arrays`).

Every collective first all-gathers a descriptor over gloo in a fixed-size control block (:mod:`~distopt.comm.control`),
so ranks that disagree get :class:`~distopt.errors.CollectiveMismatchError` on every rank instead of a garbled result; a
small call on CPU memory (up to 512 bytes per rank: a step header, a metric, a flag) carries its data in that block and
is reduced locally in rank order (16-bit floats in float32, rounded once). A wait on CPU work blocks in
``Work.wait(timeout)`` (gloo's threads move the data; nothing polls). A missed deadline, or a peer that exited, is a
:class:`~distopt.errors.CollectiveTimeoutError` naming the ranks that did not arrive (:mod:`~distopt.comm.torch_where`);
the communicator is unusable after it. CUDA work is ordered on torch's streams, bounded by the NCCL watchdog.

gloo reduces the dtypes of :data:`~distopt.comm.torch_arrays.REDUCIBLE` (float16 and bfloat16 summed in their own
precision, pairwise); broadcast and gathers move any dtype. The sharded collectives are in
:mod:`~distopt.comm.torch_shards`.
"""
from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # turned into BackendUnavailableError by distopt.comm.create
    raise ImportError(f"the torch backend needs PyTorch: {exc}") from exc
if not dist.is_available():
    raise ImportError("this PyTorch build has no torch.distributed")

from ..core.spares import Spares
from ..errors import CollectiveTimeoutError
from ..launch.devices import device_index
from . import control
from .base import REDUCE_OPS, check_reduce_args
from .lifecycle import CommunicatorState, close_at_exit, collective, forget_at_exit
from .messages import STALLED, UNUSABLE, failure_message, timeout_message, where
from .rank_order import reduce_in_rank_order
from .torch_arrays import REDUCIBLE, FlatTensor, descriptor_code as _code, movable, torch_op
from .torch_join import join
from .torch_shards import TorchShardHandle, TorchShards, _all_gather_single as _gather_flat
from .torch_uneven import TorchUneven
from .torch_where import StoreWhere, post_after
from .torch_exit import wait_for_workers_at_exit
from .wait import resolve_timeout

if TYPE_CHECKING:
    from ..launch.ranks import RankInfo
    from ..launch.info import Launch

__all__ = ["TorchCommunicator", "TorchHandle"]

#: A CPU wait that fails after this fraction of the deadline timed out (gloo's own timer, as long as
#: ours, starts when its thread takes the work up, a moment before or after the wait begins).
_LATE = 0.9


class TorchHandle(TorchShardHandle):
    """An all-reduce in flight (see :meth:`TorchCommunicator.all_reduce_async`): ``test()`` never blocks; ``wait()``
    completes it (bounded by the communicator's timeout) and returns the array."""

    def __init__(self, comm: TorchCommunicator, work: Any, t: FlatTensor, op: str) -> None:
        def finish() -> Any:
            if op == "avg" and work is not None:
                t.flat.div_(comm.size)
            return t.array

        super().__init__(comm, work, t, finish, f"all_reduce_async of {t.flat.numel()} elements")


class TorchCommunicator(TorchShards, TorchUneven, CommunicatorState):
    """Collectives over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

    Args:
        rank: this process's rank; default ``$RANK`` (read by ``env://``). With an already initialised default process
            group it must match ``torch.distributed.get_rank()``.
        size: the world size; default ``$WORLD_SIZE``.
        timeout: deadline of one collective and of the rendezvous, in seconds; default ``$DISTOPT_TIMEOUT``, else 300.
        device: CUDA device index to make current (``torch.cuda.set_device``) for NCCL, or None to leave it.

    Raises:
        ValueError: ``MASTER_ADDR``/``MASTER_PORT`` missing when no process group is initialised, a bad timeout, or
            ``rank``/``size`` that contradict the existing process group.
        DistOptError: the rendezvous failed (e.g. a peer never came).
    """

    name = "torch"

    def __init__(self, rank: int | None = None, size: int | None = None, *, timeout: float | None = None,
                 device: int | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        group, backend, self._owns_default = join(rank, size, self.timeout, device)
        self._bind(group, backend)
        for name, given, actual in (("rank", rank, self.rank), ("size", size, self.size)):
            if given is not None and int(given) != actual:
                self.close()
                raise ValueError(f"{name}={given} contradicts torch.distributed's process group ({name} {actual})")

    def _bind(self, group: Any, backend: str) -> None:
        """Use ``group`` (None: the default group): its rank, size and control buffers."""
        self._group, self._backend = group, backend
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        block, table = control.new_buffers(self.size)
        self._block, self._table = torch.from_numpy(block), torch.from_numpy(table)  # shared with the numpy views
        self._ctl = control.ControlBlock("torch", self.rank, block, table, self._exchange)
        self._where, self._waits = StoreWhere(group, self.rank, self.size), 0
        self._spares = Spares(2)  # the CPU reduce-scatter's receive buffers, kept between calls
        close_at_exit(self)
        wait_for_workers_at_exit()

    @classmethod
    def from_launch(cls, launch: Launch) -> tuple[TorchCommunicator, RankInfo]:
        """Join the job of a ``torchrun`` (or ``srun`` with ``MASTER_ADDR``/``MASTER_PORT``) launch: its ranks, and with
        CUDA the local rank's device. Raises as :class:`TorchCommunicator`."""
        info = launch.rank_info()
        device = (device_index(info.local_rank, launch.env, torch.cuda.device_count(), local_size=info.local_size)
                  if torch.cuda.is_available() else None)
        return cls(info.global_rank, info.world_size, timeout=launch.timeout, device=device), info

    def _complete(self, work: Any, t: FlatTensor, what: str) -> None:
        """Wait for ``work``: stream-ordered on CUDA; on CPU blocked in ``Work.wait(timeout)`` (the GIL released, no
        polling) until the deadline, recording itself in the store once it has waited
        :func:`~distopt.comm.torch_where.post_after` seconds (:mod:`~distopt.comm.torch_where`).

        Raises:
            CollectiveTimeoutError: the deadline passed (ours, or gloo's own, which is as long), or a peer exited; the
                communicator is unusable then. On CPU the message names the ranks that did not arrive.
        """
        self._waits += 1
        number, start = self._waits, time.monotonic()
        try:
            if t.flat.is_cuda:
                work.wait()  # orders the current stream after the work; no host wait
            else:
                self._wait_cpu(work, number, what)
        except RuntimeError as exc:  # ours: "Operation timed out!"; gloo's: a closed connection, its timeout
            self._ctl.broken = what
            place = where("torch", what, self.rank)
            late = not work.is_completed() or time.monotonic() - start >= _LATE * self.timeout
            if t.flat.is_cuda:
                raise CollectiveTimeoutError(failure_message(place, str(exc).splitlines()[0], UNUSABLE)) from exc
            self._where.post(number, what, "failed")
            who = self._where.missing(number)
            if late:
                raise CollectiveTimeoutError(timeout_message(place, self.timeout, f"{STALLED}; {UNUSABLE}",
                                                             who)) from exc
            raise CollectiveTimeoutError(failure_message(
                place, f"{str(exc).splitlines()[0]} (a peer exited or timed out; {who})", UNUSABLE)) from exc

    def _wait_cpu(self, work: Any, number: int, what: str) -> None:
        """``work.wait`` for at most the timeout; past :func:`~distopt.comm.torch_where.post_after` seconds, record this
        rank's wait ``number`` (the call ``what``) in the store first."""
        brief = post_after(self.timeout)
        try:
            work.wait(datetime.timedelta(seconds=brief))
            return
        except RuntimeError:
            if work.is_completed():  # failed (a peer closed its connection), or finished just after the brief wait
                work.wait()  # returns at once if it succeeded; raises its error if it failed
                return
        self._where.post(number, what)
        work.wait(datetime.timedelta(seconds=self.timeout - brief))

    def _exchange(self, what: str) -> None:
        """The control block's exchange: one gloo all-gather of every rank's block."""
        if self.size == 1:
            self._table.copy_(self._block.reshape(1, -1))
            return
        work = _gather_flat(self._table.reshape(-1), self._block, group=self._group, async_op=True)
        self._complete(work, FlatTensor(self._table), what)

    def _agree(self, kind: str, count: int, code: int, payload: torch.Tensor | None = None) -> str:
        """:meth:`~distopt.comm.control.ControlBlock.agree` with ``payload`` a CPU tensor."""
        data = None if payload is None else payload.reshape(-1).view(torch.uint8).numpy()
        return self._ctl.agree(kind, count, code, data)

    def _small(self, t: FlatTensor) -> bool:
        """True when ``t`` travels inside the control block (CPU memory, at most ``self._ctl.inline`` bytes)."""
        return not t.flat.is_cuda and t.flat.numel() * t.flat.element_size() <= self._ctl.inline

    def _inline_rows(self, like: torch.Tensor) -> torch.Tensor:
        """Every rank's inline copy of a flat tensor like ``like``, shape ``(size, like.numel())``: a view into the
        table (read it before the next call)."""
        head = control.HEAD_BYTES
        return self._table[:, head:head + like.numel() * like.element_size()].view(like.dtype)

    def _reduce_inline(self, flat: torch.Tensor, op: str) -> None:
        """Reduce every rank's inline copy of ``flat`` into it (:func:`~distopt.comm.control.reduce_inline`; float16 and
        bfloat16 widened to float32 and rounded by torch, so no NumPy bfloat16 is needed)."""
        rows = self._inline_rows(flat)
        if flat.dtype not in (torch.float16, torch.bfloat16):
            control.reduce_inline(rows.numpy(), op, flat.numpy())
            return
        acc = np.empty(flat.numel(), np.float32)
        flat.copy_(torch.from_numpy(reduce_in_rank_order(rows.float().numpy(), op, acc)))
        if op == "avg":
            flat.div_(self.size)

    def _reduce_work(self, t: FlatTensor, op: str) -> Any:
        return dist.all_reduce(t.flat, op=torch_op(t.flat.dtype, op), group=self._group, async_op=True)

    @collective
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """Reduce ``array`` in place across ranks and return it; see :class:`~distopt.comm.base.Communicator`.

        Raises:
            TypeError: unsupported array type or dtype, integer ``avg``.
            CollectiveMismatchError: ranks passed different counts/dtypes/ops.
            CollectiveTimeoutError: the deadline passed or a peer exited.
        """
        check_reduce_args(array, op)
        t = FlatTensor(array)
        if t.flat.dtype not in REDUCIBLE:
            self._reduce_work(t, op)  # raises the TypeError before any communication
        code = _code(t, REDUCE_OPS.index(op))
        if self._small(t):
            self._agree("all_reduce", t.flat.numel(), code, t.flat)
            self._reduce_inline(t.flat, op)
            return array
        what = self._agree("all_reduce", t.flat.numel(), code)
        if t.flat.numel() and self.size > 1:
            self._complete(self._reduce_work(t, op), t, what)
        if op == "avg":
            t.flat.div_(self.size)
        return array

    @collective
    def all_reduce_async(self, array: Any, op: str = "sum") -> TorchHandle:
        """Start an in-place all-reduce and return at once.

        As for the MPI backend there is no per-call agreement check (it would block); every rank must start the same
        reductions in the same order. gloo progresses in its own threads.

        Returns:
            A handle; ``wait()`` completes the reduction (bounded) and divides by the world size for ``op="avg"``.
        """
        check_reduce_args(array, op)
        t = FlatTensor(array)
        work = self._reduce_work(t, op) if t.flat.numel() and self.size > 1 else None
        return TorchHandle(self, work, t, op)

    @collective
    def broadcast(self, array: Any, root: int = 0) -> Any:
        """Overwrite ``array`` with root's contents on every rank (in place)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        t = FlatTensor(array)
        if self._small(t):
            self._agree("broadcast", t.flat.numel(), _code(t, root), t.flat if self.rank == root else None)
            t.flat.copy_(self._inline_rows(t.flat)[root])
            return array
        what = self._agree("broadcast", t.flat.numel(), _code(t, root))
        if t.flat.numel() and self.size > 1:
            src = dist.get_global_rank(self._group, root) if self._group is not None else root
            self._complete(dist.broadcast(movable(t.flat), src=src, group=self._group, async_op=True), t, what)
        return array

    def _gather(self, t: FlatTensor, what: str) -> torch.Tensor:
        out = t.new(self.size * t.flat.numel())
        if t.flat.numel():
            self._complete(_gather_flat(movable(out), movable(t.flat), group=self._group, async_op=True), t, what)
        return out

    @collective
    def all_gather(self, array: Any) -> Any:
        """Gather equal-sized arrays; returns a new array of shape ``(size, *array.shape)``."""
        t = FlatTensor(array)
        if self._small(t):
            self._agree("all_gather", t.flat.numel(), _code(t, 0), t.flat)
            return t.back(self._inline_rows(t.flat).clone().reshape(self.size, *tuple(array.shape)))
        what = self._agree("all_gather", t.flat.numel(), _code(t, 0))
        return t.back(self._gather(t, what).reshape(self.size, *tuple(array.shape)))

    @collective
    def all_gather_v(self, array: Any) -> list[Any]:
        """Gather 1-D arrays of per-rank lengths (0 allowed); a list of ``size`` new arrays."""
        if array.ndim != 1:
            raise ValueError(f"all_gather_v takes a 1-D array, got shape {tuple(array.shape)}")
        t = FlatTensor(array)
        what = self._agree("all_gather_v", 0, _code(t, 0))
        counts = self._gather(FlatTensor(torch.tensor([t.flat.numel()], dtype=torch.int64)), what).tolist()
        padded = t.new(max(counts, default=0))
        padded[:t.flat.numel()] = t.flat
        rows = self._gather(FlatTensor(padded), what).reshape(self.size, -1) if padded.numel() else None
        return [t.back(rows[r, :c].clone() if rows is not None else t.new(0)) for r, c in enumerate(counts)]

    @collective
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the timeout)."""
        self._agree("barrier", 0, 0)  # the exchange completes only when every rank has arrived

    @collective
    def split(self, ranks: Sequence[int]) -> TorchCommunicator | None:
        """A communicator of ``ranks`` (ascending, renumbered from 0) by ``new_group``; None outside them.

        Collective: every rank calls it with the same ranks (:func:`distopt.comm.groups.split` checks that first).

        Raises:
            ValueError: this communicator is not the whole job's (``new_group`` needs every process of the job, so a
                group of a group is not supported on this backend).
        """
        if self.size != dist.get_world_size():
            raise ValueError(f"the torch backend splits only the whole job's communicator ({dist.get_world_size()} "
                             f"ranks; this one has {self.size}): torch.distributed.new_group needs every process of "
                             "the job, so a group of a group is not supported")
        self.barrier()  # bounded: new_group's own rendezvous waits for every rank
        group = dist.new_group(ranks=list(ranks), backend=self._backend,
                               timeout=datetime.timedelta(seconds=self.timeout))
        if self.rank not in ranks:
            return None
        sub = TorchCommunicator.__new__(TorchCommunicator)
        sub.timeout, sub._owns_default = self.timeout, False
        sub._bind(group, self._backend)
        return sub

    def close(self) -> None:
        """Destroy the process group distopt created (the default one, or its own group); idempotent, and a no-op after
        the script's own ``dist.destroy_process_group()`` (which destroys every group).

        Local: no rank waits for the others. Every later call raises :class:`~distopt.errors.CommunicatorClosedError`.
        """
        if self.closed:
            return
        self.closed = True
        forget_at_exit(self)
        if not dist.is_initialized():
            return  # the script destroyed the default group already, and every group with it
        if self._owns_default:
            dist.destroy_process_group()
        elif self._group is not None:
            dist.destroy_process_group(self._group)

    def __repr__(self) -> str:
        return f"TorchCommunicator(rank={self.rank}, size={self.size}, timeout={self.timeout:g})"
