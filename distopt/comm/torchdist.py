"""torch.distributed backend: gloo for CPU arrays and tensors, NCCL for CUDA tensors.

The job is joined with ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, as ``torchrun`` sets them), or an already initialised default
process group is reused through a new group of all its ranks, so distopt's
traffic never interleaves with the caller's. With CUDA available the group is
``"cpu:gloo,cuda:nccl"``: torch routes each tensor by its device.

Arrays: NumPy arrays travel as CPU tensors that share their memory
(``torch.from_numpy``, no copy; bfloat16 from ``ml_dtypes`` through a 16-bit
view), CuPy arrays as CUDA tensors through DLPack, torch tensors as they are.
Collectives return the caller's array type.

Every collective first all-gathers a 4-integer descriptor (kind, sequence
number, element count, dtype/op code) over gloo, so ranks that disagree get
:class:`~distopt.errors.CollectiveMismatchError` on every rank instead of a
garbled result. The descriptor travels in a fixed-size control block (see
:mod:`~distopt.comm.descriptor`), and a small call on CPU memory (up to 512
bytes per rank: a step header, a metric, a broadcast flag) carries its data
in that same block: one collective per call, reduced locally in rank order
(16-bit floats in float32, rounded once). Waits on CPU work poll ``Work.is_completed()`` against the
deadline (:func:`distopt.comm.wait.wait_until`): a missed deadline, or a
peer that exited (gloo reports a closed connection), is a
:class:`~distopt.errors.CollectiveTimeoutError`, after which the communicator
is unusable. CUDA work is ordered on torch's streams (``Work.wait()``, no host
wait), bounded by the process group's own timeout (NCCL watchdog).

Reductions: gloo reduces float16, bfloat16, float32, float64, int8, uint8,
int32, int64 and bool (sum/max: logical OR, min: logical AND); float16 and
bfloat16 are summed in their own precision pairwise. Broadcast and gathers
move any dtype (as bytes).
"""
from __future__ import annotations

import datetime
import os
import time
import zlib
from typing import Any

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # turned into BackendUnavailableError by distopt.comm.create
    raise ImportError(f"the torch backend needs PyTorch: {exc}") from exc

from ..errors import CollectiveTimeoutError, DistOptError
from . import descriptor
from .base import REDUCE_OPS, check_reduce_args
from .lifecycle import CommunicatorState, close_at_exit, collective, forget_at_exit, timed_call
from .wait import resolve_timeout, wait_until

__all__ = ["TorchCommunicator", "TorchHandle"]

if not dist.is_available():
    raise ImportError("this PyTorch build has no torch.distributed")

_REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int32, torch.int64, torch.bool}
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_BOOL_OPS = {"sum": dist.ReduceOp.MAX, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _bfloat16() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


_NP_BF16 = _bfloat16()


class _Tensor:
    """A caller's array as a flat tensor sharing its memory, and the way back to the caller's type."""

    def __init__(self, array: Any) -> None:
        self.array = array
        if isinstance(array, torch.Tensor):
            self.kind, self.flat = "torch", array.reshape(-1)
        elif isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                raise TypeError("array must be C-contiguous; pass np.ascontiguousarray(array)")
            self.kind = "numpy"
            if _NP_BF16 is not None and array.dtype == _NP_BF16:
                self.flat = torch.from_numpy(array.reshape(-1).view(np.uint16)).view(torch.bfloat16)
            else:
                try:
                    self.flat = torch.from_numpy(array.reshape(-1))
                except TypeError as exc:
                    raise TypeError(f"dtype {array.dtype} is not supported by the torch backend") from exc
        elif hasattr(array, "__dlpack__"):
            self.kind, self.flat = "dlpack", torch.from_dlpack(array).reshape(-1)
        else:
            raise TypeError(f"the torch backend takes NumPy or CuPy arrays or torch tensors, "
                            f"got {type(array).__name__}")

    def new(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.flat.dtype, device=self.flat.device)

    def back(self, tensor: torch.Tensor) -> Any:
        """``tensor`` as the caller's array type (NumPy: shares memory; CuPy: through DLPack)."""
        if self.kind == "torch":
            return tensor
        if self.kind == "numpy":
            if tensor.dtype == torch.bfloat16:
                return tensor.view(torch.uint16).numpy().view(_NP_BF16)
            return tensor.numpy()
        import cupy  # a DLPack array that is not a tensor: CuPy's, on the GPU

        return cupy.from_dlpack(tensor)


def _code(t: _Tensor, extra: int) -> int:
    """Descriptor code of the tensor's dtype and ``extra`` (op or root), the same on every rank."""
    return zlib.crc32(str(t.flat.dtype).encode()) * (1 << 24) + extra


_ROW_OPS = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduce_rows(rows: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """Reduce every rank's inline copy, in rank order, into ``out`` (the same bits on every rank).

    Args:
        rows: shape ``(size, out.numel())``, dtype ``out.dtype``: rank r's data in row r.
        op: ``"sum"``, ``"avg"`` (the sum divided by the number of rows), ``"max"`` or ``"min"``;
            booleans reduce as OR (sum, max) and AND (min); float16 and bfloat16 accumulate in
            float32 and are rounded once (``"avg"`` then divides in the tensor's dtype).
        out: flat CPU tensor, written in place.
    """
    if out.dtype == torch.bool:
        ufunc = torch.logical_and if op == "min" else torch.logical_or
    else:
        ufunc = _ROW_OPS[op]
    acc = rows[0].float() if out.dtype in (torch.float16, torch.bfloat16) else rows[0].clone()
    for row in rows[1:]:
        ufunc(acc, row, out=acc)
    out.copy_(acc)
    if op == "avg":
        out.div_(rows.shape[0])


class TorchHandle:
    """An all-reduce in flight (see :meth:`TorchCommunicator.all_reduce_async`)."""

    def __init__(self, comm: TorchCommunicator, work: Any, t: _Tensor, op: str) -> None:
        self._comm, self._work, self._t, self._op = comm, work, t, op

    def test(self) -> bool:
        """True once the reduction is complete (never blocks)."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> Any:
        """Complete the reduction (bounded by the communicator's timeout); returns the array.

        Raises:
            CollectiveTimeoutError: the deadline passed, or a peer exited.
            CommunicatorClosedError: the communicator was closed meanwhile.
        """
        if self._work is not None:
            self._comm._check_open("all_reduce_async wait")
            timed_call(self._comm, "distopt.all_reduce_async.wait", self._comm._complete, self._work, self._t,
                       f"all_reduce_async of {self._t.flat.numel()} elements")
            self._work = None
            if self._op == "avg":
                self._t.flat.div_(self._comm.size)
        return self._t.array


class TorchCommunicator(CommunicatorState):
    """Collectives over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

    Args:
        rank: this process's rank; default ``$RANK`` (read by ``env://``).
            With an already initialised default process group it must match
            ``torch.distributed.get_rank()``.
        size: the world size; default ``$WORLD_SIZE``.
        timeout: deadline of one collective and of the rendezvous, in
            seconds; default ``$DISTOPT_TIMEOUT``, else 300.
        device: CUDA device index to make current (``torch.cuda.set_device``)
            for NCCL, or None to leave it.

    Raises:
        ValueError: ``MASTER_ADDR``/``MASTER_PORT`` missing when no process
            group is initialised, a bad timeout, or ``rank``/``size`` that
            contradict the existing process group.
        DistOptError: the rendezvous failed (e.g. a peer never came).

    A communicator that was never closed is closed at interpreter exit.
    """

    name = "torch"

    def __init__(self, rank: int | None = None, size: int | None = None, *, timeout: float | None = None,
                 device: int | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self._seq = 0
        self._broken: str | None = None
        pg_timeout = datetime.timedelta(seconds=self.timeout)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if device is not None and torch.cuda.is_available():
            torch.cuda.set_device(device)
        self._owns_default = not dist.is_initialized()
        if self._owns_default:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise ValueError(
                    f"the torch backend joins the job through {' and '.join(missing)}, which are not set: "
                    "start the script with torchrun, or export MASTER_ADDR (rank 0's host) and MASTER_PORT "
                    "(a free port) on every rank")
            kwargs: dict[str, Any] = {}
            if rank is not None:
                kwargs["rank"] = int(rank)
            if size is not None:
                kwargs["world_size"] = int(size)
            try:
                dist.init_process_group(backend, init_method="env://", timeout=pg_timeout, **kwargs)
            except (RuntimeError, ValueError) as exc:
                raise DistOptError(f"torch.distributed rendezvous at {os.environ['MASTER_ADDR']}:"
                                   f"{os.environ['MASTER_PORT']} failed: {exc}") from exc
            self._group = None  # the default group
        else:
            self._group = dist.new_group(backend=backend, timeout=pg_timeout)
        self.rank: int = dist.get_rank(self._group)
        self.size: int = dist.get_world_size(self._group)
        self._inline = descriptor.inline_bytes(self.size)
        self._block = torch.zeros(descriptor.block_bytes(self.size), dtype=torch.uint8)
        self._table = torch.empty((self.size, self._block.numel()), dtype=torch.uint8)
        self._block_np, self._heads = self._block.numpy(), self._table.numpy().view(np.int64)[:, :4]
        for name, given, actual in (("rank", rank, self.rank), ("size", size, self.size)):
            if given is not None and int(given) != actual:
                self.close()
                raise ValueError(f"{name}={given} contradicts torch.distributed's process group ({name} {actual})")
        close_at_exit(self)

    # ------------------------------------------------------------------ helpers
    def _complete(self, work: Any, t: _Tensor, what: str) -> None:
        """Wait for ``work``: stream-ordered on CUDA, polled against the deadline on CPU."""
        try:
            if t.flat.is_cuda:
                work.wait()
                return

            def expired() -> CollectiveTimeoutError:
                self._broken = what
                return CollectiveTimeoutError(
                    f"torch {what} on rank {self.rank} did not complete within {self.timeout:g} s (a rank died, "
                    "is stuck, or ran a different number of steps); the communicator is unusable now")

            wait_until(work.is_completed, time.monotonic() + self.timeout, expired)
            work.wait()
        except RuntimeError as exc:  # gloo: a peer closed its connection, or gloo's own timeout
            self._broken = what
            raise CollectiveTimeoutError(
                f"torch {what} on rank {self.rank} failed: {str(exc).splitlines()[0]} (a peer exited or timed "
                "out); the communicator is unusable now") from exc

    def _agree(self, kind: str, count: int, code: int, payload: torch.Tensor | None = None) -> str:
        """Exchange (kind, seq, count, code) and ``payload`` (a CPU tensor of at most ``self._inline``
        bytes) in one control block over gloo; raise on every rank if ranks differ.

        Every rank's block is in ``self._table`` afterwards (uint8, shape ``(size, block bytes)``)
        until the next call.
        """
        if self._broken is not None:
            raise DistOptError(f"communicator unusable after a failed collective ({self._broken})")
        self._seq += 1
        what = f"{kind} #{self._seq}"
        data = None if payload is None else payload.reshape(-1).view(torch.uint8).numpy()
        descriptor.encode(self._block_np, descriptor.KINDS.index(kind), self._seq, count, code, data)
        if self.size == 1:
            self._table.copy_(self._block.reshape(1, -1))
            return what
        work = _gather_flat(self._table.reshape(-1), self._block, group=self._group, async_op=True)
        self._complete(work, _Tensor(self._table), what)
        if not descriptor.same(self._heads):
            descriptor.check(self._heads.copy(), what)
        return what

    def _small(self, t: _Tensor) -> bool:
        """True when ``t`` travels inside the control block (CPU memory, at most ``self._inline`` bytes)."""
        return not t.flat.is_cuda and t.flat.numel() * t.flat.element_size() <= self._inline

    def _inline_rows(self, like: torch.Tensor) -> torch.Tensor:
        """Every rank's inline copy of a flat tensor like ``like``, shape ``(size, like.numel())``: a view
        into the table (read it before the next call)."""
        nbytes = like.numel() * like.element_size()
        head = descriptor.HEAD_BYTES
        return self._table[:, head:head + nbytes].view(like.dtype)

    def _reduce_work(self, t: _Tensor, op: str) -> Any:
        dtype = t.flat.dtype
        if dtype not in _REDUCIBLE:
            raise TypeError(f"dtype {dtype} cannot be reduced by the torch backend (gloo); use one of "
                            + ", ".join(sorted(str(d).replace("torch.", "") for d in _REDUCIBLE)))
        torch_op = _BOOL_OPS[op] if dtype == torch.bool else _OPS[op]
        return dist.all_reduce(t.flat, op=torch_op, group=self._group, async_op=True)

    @staticmethod
    def _bytes(flat: torch.Tensor) -> torch.Tensor:
        """A dtype gloo can move: the tensor itself, or its bytes."""
        return flat if flat.dtype in _REDUCIBLE else flat.view(torch.uint8)

    # --------------------------------------------------------------- protocol
    @collective
    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """Reduce ``array`` in place across ranks and return it; see :class:`~distopt.comm.base.Communicator`.

        Raises:
            TypeError: unsupported array type or dtype, integer ``avg``.
            CollectiveMismatchError: ranks passed different counts/dtypes/ops.
            CollectiveTimeoutError: the deadline passed or a peer exited.
        """
        check_reduce_args(array, op)
        t = _Tensor(array)
        if t.flat.dtype not in _REDUCIBLE:
            self._reduce_work(t, op)  # raises the TypeError before any communication
        code = _code(t, REDUCE_OPS.index(op))
        if self._small(t):
            self._agree("all_reduce", t.flat.numel(), code, t.flat)
            _reduce_rows(self._inline_rows(t.flat), op, t.flat)
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

        As for the MPI backend there is no per-call agreement check (it
        would block); every rank must start the same reductions in the same
        order. gloo progresses in its own threads.

        Returns:
            A handle; ``wait()`` completes the reduction (bounded by the
            timeout) and divides by the world size for ``op="avg"``.
        """
        check_reduce_args(array, op)
        t = _Tensor(array)
        work = self._reduce_work(t, op) if t.flat.numel() and self.size > 1 else None
        return TorchHandle(self, work, t, op)

    @collective
    def broadcast(self, array: Any, root: int = 0) -> Any:
        """Overwrite ``array`` with root's contents on every rank (in place)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root must be in [0, {self.size}), got {root}")
        t = _Tensor(array)
        if self._small(t):
            self._agree("broadcast", t.flat.numel(), _code(t, root), t.flat if self.rank == root else None)
            t.flat.copy_(self._inline_rows(t.flat)[root])
            return array
        what = self._agree("broadcast", t.flat.numel(), _code(t, root))
        if t.flat.numel() and self.size > 1:
            src = dist.get_global_rank(self._group, root) if self._group is not None else root
            self._complete(dist.broadcast(self._bytes(t.flat), src=src, group=self._group, async_op=True), t, what)
        return array

    def _gather(self, t: _Tensor, what: str) -> torch.Tensor:
        out = t.new(self.size * t.flat.numel())
        if t.flat.numel():
            self._complete(_gather_flat(self._bytes(out), self._bytes(t.flat), group=self._group, async_op=True),
                           t, what)
        return out

    @collective
    def all_gather(self, array: Any) -> Any:
        """Gather equal-sized arrays; returns a new array of shape ``(size, *array.shape)``."""
        t = _Tensor(array)
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
        t = _Tensor(array)
        what = self._agree("all_gather_v", 0, _code(t, 0))
        counts = self._gather(_Tensor(torch.tensor([t.flat.numel()], dtype=torch.int64)), what).tolist()
        padded = t.new(max(counts, default=0))
        padded[:t.flat.numel()] = t.flat
        rows = self._gather(_Tensor(padded), what).reshape(self.size, -1) if padded.numel() else None
        return [t.back(rows[r, :c].clone() if rows is not None else t.new(0)) for r, c in enumerate(counts)]

    @collective
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the timeout)."""
        self._agree("barrier", 0, 0)  # the exchange completes only when every rank has arrived

    def close(self) -> None:
        """Destroy the process group distopt created (the default one, or its own group); idempotent.

        Local: no rank waits for the others. Every later call raises
        :class:`~distopt.errors.CommunicatorClosedError`.
        """
        if self.closed:
            return
        self.closed = True
        forget_at_exit(self)
        if self._owns_default:
            if dist.is_initialized():
                dist.destroy_process_group()
        elif self._group is not None:
            dist.destroy_process_group(self._group)

    def __repr__(self) -> str:
        return f"TorchCommunicator(rank={self.rank}, size={self.size}, timeout={self.timeout:g})"
