"""Hierarchical all-reduce: reduce inside each node, all-reduce across nodes, gather inside each node.

The "2D" all-reduce of Jia et al. 2018, "Highly Scalable Deep Learning Training System with Mixed-Precision" (Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``, NCCL's tree): with W = N nodes x L processes per node, local rank l reduce-scatters
its node's arrays over shared memory (segment l of ``split_counts(n, L)`` ELEMENTS; the node's ranks are told apart by
host name), all-reduces that segment across the nodes with the other ranks of local rank l (one communicator per local
rank, so the L segments cross the links in parallel), and all-gathers the node's segments over shared memory. Each
node's link then carries 2(N-1)/N of the array in each direction instead of L times a flat ring's 2(W-1)/W.

The sum is the per-node sums (local ranks ascending) added in the backend's inter-node order: it differs from the flat
all-reduce by re-association only (within a relative 2(W-1) units in the last place of the sum of absolute values) and
is identical on every rank. ``"avg"`` divides each segment by W once, before the gather. Each phase runs on a thread of
its own, the only user of its communicator, so successive all-reduces pipeline and every communicator sees its calls in
call order on every rank (on MPI this needs ``MPI_THREAD_MULTIPLE``). Only float ``"sum"``/``"avg"`` all-reduces of at
least :data:`MIN_BYTES` go this way; the rest runs on the flat communicator.
"""
from __future__ import annotations

import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from ..errors import BackendUnavailableError
from .base import Communicator, split_counts
from .consensus import agree
from .groups import split
from .shm.communicator import ShmCommunicator
from .shm.rows import check_platform

__all__ = ["HierarchicalCommunicator", "node_layout", "hierarchical_for", "MIN_BYTES"]

#: All-reduces smaller than this many BYTES stay flat (latency, not bandwidth, decides them).
MIN_BYTES = 1 << 16

_TORCH_FLOATS = ("torch.float16", "torch.float32", "torch.float64")


def node_layout(comm: Communicator, host: str | None = None) -> list[list[int]]:
    """The ranks of each node, nodes ordered by their lowest rank (collective: one all-gather of host names).

    Args:
        comm: the communicator.
        host: this process's node name; default ``socket.gethostname()``.

    Returns:
        One ascending list of ranks per node.
    """
    mine = np.frombuffer((host or socket.gethostname()).encode(), dtype=np.uint8).copy()
    names = [bytes(p).decode() for p in comm.all_gather_v(mine)]
    nodes: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        nodes.setdefault(name, []).append(r)
    return sorted(nodes.values())


def _eligible(nodes: list[list[int]]) -> str:
    """Why ``nodes`` cannot use the hierarchical all-reduce ('' when it can)."""
    if len(nodes) < 2:
        return "every rank is on one node"
    sizes = sorted({len(n) for n in nodes})
    if len(sizes) > 1:
        return f"the nodes have different numbers of processes ({sizes})"
    if sizes[0] < 2:
        return "there is one process per node"
    return ""


def _unsupported(comm: Communicator, local_size: int) -> str:
    """Why ``comm``'s backend or this machine cannot run it ('' when they can)."""
    if not callable(getattr(comm, "split", None)):
        return f"the {getattr(comm, 'name', '?')!r} communicator has no process groups"
    if comm.name == "mpi" and getattr(comm, "raw", None) is not None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return "MPI was initialised without MPI_THREAD_MULTIPLE"
    try:
        check_platform(local_size)
    except BackendUnavailableError as exc:
        return f"shared memory inside the node is unavailable ({exc})"
    return ""


def hierarchical_for(comm: Communicator, choice: bool | None, host: str | None = None) -> Communicator:
    """``comm``, or a :class:`HierarchicalCommunicator` over it (collective when it decides).

    Args:
        comm: the flat communicator.
        choice: None (automatic: hierarchical on the torch backend when there are several nodes with the same number,
            more than one, of processes each; MPI's own all-reduce already keeps most of its traffic inside the nodes,
            see ``docs/multinode.md``), True (required; mpi or torch), False (flat).
        host: this process's node name (default ``socket.gethostname()``).

    Raises:
        ValueError: on every rank, ``choice=True`` where the layout or the backend does not allow it (saying why).
    """
    if choice is False or (choice is None and getattr(comm, "name", "") != "torch"):
        return comm
    nodes = node_layout(comm, host)
    why = _eligible(nodes) or _unsupported(comm, len(nodes[0]))
    if why:
        if choice:
            raise ValueError(f"hierarchical=True needs several nodes with the same number (> 1) of processes, "
                             f"shared memory and process groups, but {why}; ranks per node: {nodes}")
        return comm
    return HierarchicalCommunicator(comm, nodes)


class _Pending:
    """An asynchronous hierarchical all-reduce: ``test()`` never blocks; ``wait()`` returns the array or raises the
    error of the phase that failed (each phase is bounded by its communicator's timeout)."""

    def __init__(self, future: Future, array: Any) -> None:
        self._future, self._array = future, array

    def test(self) -> bool:
        return self._future.done()

    def wait(self) -> Any:
        self._future.result()
        return self._array


def _then(future: Future, pool: ThreadPoolExecutor, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(future.result())`` run on ``pool``: submitted when ``future`` completes, by the thread that
    completed it, so the calls reach ``pool`` in the order their inputs completed."""
    out: Future = Future()

    def relay(inner: Future) -> None:
        error = inner.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(inner.result())

    def submit(done: Future) -> None:
        if done.exception() is not None:
            relay(done)
        else:
            pool.submit(fn, done.result()).add_done_callback(relay)

    future.add_done_callback(submit)
    return out


class HierarchicalCommunicator:
    """A communicator whose large float all-reduces are hierarchical (see the module docstring).

    Every other call, and every attribute, is the flat communicator's.

    Args:
        flat: the communicator over all ranks (mpi or torch).
        nodes: the ranks of each node (:func:`node_layout`), every node with the same number of processes.

    Attributes:
        intra: this node's shared-memory communicator (the reduce-scatters), ranks = local ranks.
        gather_comm: a second one of the same node (the all-gathers).
        inter: the flat backend's communicator of this local rank across the nodes.
    """

    def __init__(self, flat: Communicator, nodes: list[list[int]]) -> None:
        self.flat, self.nodes = flat, nodes
        self.name, self.rank, self.size = flat.name, flat.rank, flat.size
        index, node = next((i, n) for i, n in enumerate(nodes) if flat.rank in n)
        token = np.frombuffer(os.urandom(8), dtype=np.uint8).copy()
        flat.broadcast(token, root=0)  # names this job's node segments: the same on every rank
        job_id = f"hier-{token.tobytes().hex()}-node{index}"
        across = [split(flat, [n[lr] for n in nodes], name=f"local{lr}") for lr in range(len(node))]
        self.inter = across[node.index(flat.rank)].require("hierarchical all-reduce")
        self.intra = ShmCommunicator(node.index(flat.rank), len(node), job_id, flat.timeout)
        self.gather_comm = self.intra.split(range(len(node)))
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"distopt-hier{p}") for p in range(3)]

    def __getattr__(self, name: str) -> Any:
        if name == "flat":  # not set yet (an instance being copied or unpickled): no recursion
            raise AttributeError(name)
        return getattr(self.flat, name)

    def counts(self, n: int) -> list[int]:
        """ELEMENTS of each local rank's segment of an ``n``-element array."""
        return split_counts(n, self.intra.size)

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's segment ``[lo, hi)`` of an ``n``-element array."""
        counts = self.counts(n)
        lo = sum(counts[:self.intra.rank])
        return lo, lo + counts[self.intra.rank]

    @staticmethod
    def _hierarchical(array: Any, op: str) -> bool:
        """True for a large float sum/avg of a contiguous NumPy array or CPU torch tensor."""
        if op not in ("sum", "avg"):
            return False
        if isinstance(array, np.ndarray):
            return array.dtype.kind == "f" and array.nbytes >= MIN_BYTES and array.flags.c_contiguous
        contiguous = getattr(array, "is_contiguous", None)
        return (callable(contiguous) and not getattr(array, "is_cuda", True) and contiguous()
                and str(array.dtype) in _TORCH_FLOATS and array.numel() * array.element_size() >= MIN_BYTES)

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        """All-reduce ``array`` in place (hierarchically when large, float, sum/avg; else flat); returns it.

        The ranks first compare the element count, dtype and op over the flat communicator
        (:func:`~distopt.comm.consensus.agree`; large float sums only, the flat communicator checks the others).

        Raises:
            CollectiveMismatchError: on every rank, the element count, dtype or op differs (``"<backend> hierarchical
                all_reduce: element count differs across ranks (...)"``); or as the flat ``all_reduce``.
            CollectiveTimeoutError: a phase (inside the node or across) missed its deadline.
        """
        if not self._hierarchical(array, op):
            return self.flat.all_reduce(array, op)
        n = array.size if isinstance(array, np.ndarray) else array.numel()
        agree(self.flat, {"element count": n, "dtype": str(array.dtype), "op": op},
              call=f"{self.name} hierarchical all_reduce", hint="different buffers, or ranks at unequal step counts")
        return self._start(array, op).wait()

    def all_reduce_async(self, array: Any, op: str = "sum") -> Any:
        """Start :meth:`all_reduce` (no agreement check, as the backends' ``all_reduce_async``); a handle with
        ``test()`` and ``wait()`` (returns ``array``). Calls complete in the order they started."""
        if not self._hierarchical(array, op):
            return self.flat.all_reduce_async(array, op)
        return self._start(array, op)

    def _start(self, array: Any, op: str) -> _Pending:
        """Queue the three phases of one hierarchical all-reduce of ``array``."""
        flat = (array if isinstance(array, np.ndarray) else array.numpy()).reshape(-1)  # a view of a CPU tensor
        counts, (lo, hi) = self.counts(flat.size), self.bounds(flat.size)

        def across(segment: np.ndarray) -> np.ndarray:
            self.inter.all_reduce(segment, "sum")
            return segment

        def gather(segment: np.ndarray) -> None:
            if op == "avg":
                segment /= self.size
            flat[lo:hi] = segment
            self.gather_comm.all_gather_into(flat, counts)

        scattered = self._pools[0].submit(self.intra.reduce_scatter, flat, counts, "sum")
        return _Pending(_then(_then(scattered, self._pools[1], across), self._pools[2], gather), array)

    def close_layers(self) -> None:
        """Finish the queued calls and close the communicators built here, not the flat one (idempotent)."""
        for pool in self._pools:
            pool.shutdown()
        for comm in (self.gather_comm, self.inter, self.intra):
            comm.close()

    def close(self) -> None:
        """:meth:`close_layers`, then close the flat communicator (idempotent)."""
        self.close_layers()
        self.flat.close()

    def __repr__(self) -> str:
        return f"HierarchicalCommunicator({self.flat!r}, nodes={self.nodes})"
