"""Who am I: global rank, local (on-node) rank and the device to use.

Everything here but :func:`resolve`'s MPI branch is a pure function. Where the information comes from (first wins),
and the :attr:`RankInfo.source` it gives:

1. Explicit ``gpu_num`` + ``gpu_per_node`` (+ ``node_rank``, ``num_nodes``), as SINGA's ``DistOpt``: ``"explicit"``.
2. Launcher environment variables (the table below): the launcher's name.
3. An MPI communicator, if passed: ``Split_type(COMM_TYPE_SHARED)`` groups the nodes, host names check it: ``"mpi"``.
4. Nothing: a single process, rank 0 of 1: ``"single"``.

Environment variables read, per launcher (in precedence order, left to right):

================ ================ ========================== =============== ==========================
source           torchrun         OMPI                       MPICH           Slurm
================ ================ ========================== =============== ==========================
global rank      RANK             OMPI_COMM_WORLD_RANK       PMI_RANK        SLURM_PROCID
world size       WORLD_SIZE       OMPI_COMM_WORLD_SIZE       PMI_SIZE        SLURM_NTASKS
local rank       LOCAL_RANK       OMPI_COMM_WORLD_LOCAL_RANK MPI_LOCALRANKID SLURM_LOCALID
local size       LOCAL_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_SIZE MPI_LOCALNRANKS SLURM_NTASKS_PER_NODE [1]_
node rank        GROUP_RANK       --                         --              SLURM_NODEID
number of nodes  GROUP_WORLD_SIZE --                         --              SLURM_NNODES
================ ================ ========================== =============== ==========================

.. [1] Used only when it is a plain integer and ``SLURM_NTASKS`` equals ``SLURM_NNODES * SLURM_NTASKS_PER_NODE``.

The innermost launcher wins. Every launcher can run inside a Slurm allocation, whose ``SLURM_*`` variables (e.g.
``SLURM_PROCID=0`` of the batch shell) every process ``mpirun``/``mpiexec``/``torchrun`` starts inherits, so Slurm
comes last; ``torchrun`` always starts its workers itself (also when ``mpirun`` or ``srun`` starts it once per node),
so it comes first. MPICH covers Hydra's ``mpiexec`` and Intel MPI. Open MPI's ``OMPI_COMM_WORLD_NODE_RANK`` is
deliberately not read: it is a rank within the node, not the index of the node.

A launcher counts as present when any of its variables is set (Slurm: ``SLURM_PROCID``, since allocation shells export
``SLURM_NTASKS`` and ``SLURM_NNODES`` without being a task); values it does not give are ``None``, never guessed.

The device a local rank uses is :func:`~distopt.launch.devices.device_index` (also importable from here).
"""
from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .devices import device_index

__all__ = ["RankInfo", "from_env", "under_mpi", "from_hosts", "from_explicit", "resolve", "describe", "device_index"]


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job.

    Attributes:
        global_rank: Rank among all processes, in ``[0, world_size)``.
        world_size: Number of processes.
        local_rank: Rank among the processes on this node, in ``[0, local_size)``.
        local_size: Number of processes on this node; ``None`` when the source did not say.
        node_rank: Index of this node, in ``[0, num_nodes)``; ``None`` when the source did not say.
        num_nodes: Number of nodes; ``None`` when the source did not say.
        source: What the values came from: ``"explicit"``, ``"torchrun"``, ``"OMPI"``, ``"MPICH"``, ``"Slurm"``,
            ``"hosts"``, ``"mpi"`` or ``"single"``.

    Raises:
        ValueError: On construction, when the values contradict each other (e.g. ``global_rank >= world_size``).
    """

    global_rank: int
    world_size: int
    local_rank: int
    local_size: int | None
    node_rank: int | None
    num_nodes: int | None
    source: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.global_rank < self.world_size:
            raise ValueError(f"global_rank must be in [0, world_size={self.world_size}), got {self.global_rank}")
        local_bound = self.world_size if self.local_size is None else self.local_size
        if self.local_size is not None and not 1 <= self.local_size <= self.world_size:
            raise ValueError(f"local_size must be in [1, world_size={self.world_size}], got {self.local_size}")
        if not 0 <= self.local_rank < local_bound:
            name = "world_size" if self.local_size is None else "local_size"
            raise ValueError(f"local_rank must be in [0, {name}={local_bound}), got {self.local_rank}")
        if self.num_nodes is not None and not 1 <= self.num_nodes <= self.world_size:
            raise ValueError(f"num_nodes must be in [1, world_size={self.world_size}], got {self.num_nodes}")
        if self.node_rank is not None:
            bound = self.world_size if self.num_nodes is None else self.num_nodes
            if not 0 <= self.node_rank < bound:
                name = "world_size" if self.num_nodes is None else "num_nodes"
                raise ValueError(f"node_rank must be in [0, {name}={bound}), got {self.node_rank}")


class _Vars(NamedTuple):
    global_rank: str
    world_size: str
    local_rank: str
    local_size: str | None
    node_rank: str | None
    num_nodes: str | None


#: Launchers in precedence order (see the module docstring).
_LAUNCHERS: tuple[tuple[str, _Vars], ...] = (
    ("torchrun", _Vars("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")),
    ("OMPI", _Vars("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE", None, None)),
    ("MPICH", _Vars("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None, None)),
    ("Slurm", _Vars("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID", "SLURM_NNODES")),
)
#: Launchers that start MPI processes (their rank variable says a process runs under ``mpiexec``/``mpirun``).
_MPI_LAUNCHERS = ("OMPI", "MPICH")
#: PMIx's rank variable (Open MPI 5's and Slurm's PMIx launchers set it; it gives no world size, so no row above).
_PMIX_RANK = "PMIX_RANK"


def under_mpi(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is an MPI launcher's (mpiexec/mpirun of Open MPI or MPICH/Hydra, or a PMIx launcher)."""
    mpi = [v.global_rank for name, v in _LAUNCHERS if name in _MPI_LAUNCHERS]
    return any(name in env for name in (*mpi, _PMIX_RANK))


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def from_env(env: Mapping[str, str]) -> RankInfo | None:
    """Derive the ranks from launcher environment variables (table and precedence in the module docstring).

    Reading MPICH's ``MPI_LOCALRANKID`` avoids Kokkos #5525, where every rank under MPICH used the first GPU because
    only Open MPI's local rank variable was known.

    Args:
        env: The environment, e.g. ``os.environ`` or a plain dict.

    Returns:
        The ranks, with ``source`` naming the launcher; ``None`` when no launcher variables are set.

    Raises:
        ValueError: A launcher is present but its variables are incomplete (e.g. a rank without a size), not
            integers, or inconsistent (e.g. rank >= size); the message names the variables.
    """
    for source, names in _LAUNCHERS:
        trigger = [names.global_rank] if source == "Slurm" else [n for n in names if n is not None]
        if not any(n in env for n in trigger):
            continue
        if source == "MPICH" and names.local_rank not in env and "SLURM_PROCID" in env:
            continue  # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but no local rank: Slurm's variables have it
        shown = ", ".join(f"{n}={env[n]}" for n in names if n is not None and n in env)
        missing = [n for n in names[:3] if n not in env]
        if missing:
            raise ValueError(f"incomplete {source} launcher variables ({shown}): {' and '.join(missing)} not set")
        values: dict[str, int | None] = {field: _env_int(env, name) if name is not None and name in env else None
                                         for field, name in names._asdict().items()}
        if source == "Slurm":
            values["local_size"] = _slurm_local_size(env)
        try:
            return RankInfo(**values, source=source)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"inconsistent {source} launcher variables ({shown}): {exc}") from None
    return None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    if not per_node.isdigit() or "SLURM_NNODES" not in env:
        return None
    if _env_int(env, "SLURM_NTASKS") != _env_int(env, "SLURM_NNODES") * int(per_node):
        return None  # the last node holds fewer tasks: no single per-node count
    return int(per_node)


def _group(labels: Sequence[Hashable], rank: int, source: str) -> RankInfo:
    """Local and node ranks of ``rank`` when ranks with equal labels share a node."""
    if not 0 <= rank < len(labels):
        raise ValueError(f"rank must be in [0, {len(labels)}), got {rank}")
    nodes = list(dict.fromkeys(labels))  # first-appearance order
    mine = labels[rank]
    same = [r for r, label in enumerate(labels) if label == mine]
    return RankInfo(global_rank=rank, world_size=len(labels), local_rank=same.index(rank), local_size=len(same),
                    node_rank=nodes.index(mine), num_nodes=len(nodes), source=source)


def from_hosts(hostnames: Sequence[str], rank: int) -> RankInfo:
    """Derive the ranks from the host name of every rank.

    The local rank is the index of ``rank`` among the ranks that share its host name, in rank order; the node rank is
    the index of its host in order of first appearance. This is right for any placement (block, round-robin, uneven
    nodes), unlike ``rank % gpu_per_node``, which assumes consecutive ranks fill one node after another and all nodes
    are the same size (TCLB #242).

    Args:
        hostnames: Host name of each rank, indexed by global rank (e.g. an allgather of ``MPI.Get_processor_name()``).
        rank: The global rank to describe.

    Returns:
        The ranks with ``source="hosts"``.

    Raises:
        ValueError: ``rank`` is not in ``[0, len(hostnames))``.
    """
    return _group(list(hostnames), rank, "hosts")


def from_explicit(gpu_num: int, gpu_per_node: int, node_rank: int = 0, num_nodes: int = 1) -> RankInfo:
    """Ranks from explicit arguments, as SINGA's ``DistOpt(gpu_num, gpu_per_node)``.

    ``global_rank = node_rank * gpu_per_node + gpu_num``, ``world_size = num_nodes * gpu_per_node``,
    ``local_rank = gpu_num``.

    Args:
        gpu_num: This process's GPU (local rank) on its node.
        gpu_per_node: Processes (GPUs) per node.
        node_rank: Index of this node.
        num_nodes: Number of nodes.

    Returns:
        The ranks with ``source="explicit"``.

    Raises:
        TypeError: An argument is not an int.
        ValueError: An argument is out of range; the message names it and the expected range, e.g.
            ``"gpu_num must be in [0, gpu_per_node=4), got 5"``.
    """
    for name, value in (("gpu_num", gpu_num), ("gpu_per_node", gpu_per_node),
                        ("node_rank", node_rank), ("num_nodes", num_nodes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    for name, value in (("gpu_per_node", gpu_per_node), ("num_nodes", num_nodes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= gpu_num < gpu_per_node:
        raise ValueError(f"gpu_num must be in [0, gpu_per_node={gpu_per_node}), got {gpu_num}")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank must be in [0, num_nodes={num_nodes}), got {node_rank}")
    return RankInfo(global_rank=node_rank * gpu_per_node + gpu_num, world_size=num_nodes * gpu_per_node,
                    local_rank=gpu_num, local_size=gpu_per_node, node_rank=node_rank,
                    num_nodes=num_nodes, source="explicit")


def _from_mpi(comm: Any) -> RankInfo:
    """Collective over ``comm``: node grouping from shared memory, checked against host names."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        leader = local.bcast(rank, root=0)  # lowest global rank on this node names the node
    finally:
        local.Free()
    leaders = comm.allgather(leader)
    names = comm.allgather(MPI.Get_processor_name())
    # AMReX #3382: COMM_TYPE_SHARED sometimes yields one process per sub-communicator, so every rank picked GPU 0.
    # When that grouping is all singletons but host names are shared, trust host names (every rank sees the same
    # lists, so every rank makes the same choice).
    return _group(names if len(set(leaders)) == size and len(set(names)) < size else leaders, rank, "mpi")


def resolve(*, gpu_num: int | None = None, gpu_per_node: int | None = None, node_rank: int = 0,
            num_nodes: int = 1, env: Mapping[str, str] | None = None, mpi_comm: Any = None) -> RankInfo:
    """Find this process's ranks from the best available information.

    In the order of the module docstring. With ``mpi_comm`` and no launcher variables this is a collective over it:
    the local rank then comes from ``Split_type(MPI.COMM_TYPE_SHARED)`` (falling back to host names when that puts
    every rank alone, AMReX #3382), never from ``rank % gpu_per_node`` (TCLB #242); mpi4py is imported only then.

    Args:
        gpu_num: This process's GPU on its node; requires ``gpu_per_node``.
        gpu_per_node: Processes per node; requires ``gpu_num``.
        node_rank: Node index; only with ``gpu_num``/``gpu_per_node``.
        num_nodes: Number of nodes; only with ``gpu_num``/``gpu_per_node``.
        env: Environment to read; ``None`` reads ``os.environ``. Pass ``{}`` to ignore the environment.
        mpi_comm: An mpi4py communicator (e.g. ``MPI.COMM_WORLD``), or ``None`` to not use MPI.

    Returns:
        The ranks; ``source`` tells which information was used.

    Raises:
        ValueError: Only one of ``gpu_num``/``gpu_per_node`` was given; ``node_rank``/``num_nodes`` were given without
            them; an explicit argument is out of range; or the launcher variables are incomplete or inconsistent.
    """
    if (gpu_num is None) != (gpu_per_node is None):
        given, missing = ("gpu_num", "gpu_per_node") if gpu_num is not None else ("gpu_per_node", "gpu_num")
        raise ValueError(f"{given} was given without {missing}: pass both or neither")
    if gpu_num is not None and gpu_per_node is not None:
        return from_explicit(gpu_num, gpu_per_node, node_rank, num_nodes)
    if node_rank != 0 or num_nodes != 1:
        raise ValueError(f"node_rank={node_rank} and num_nodes={num_nodes} apply only together with "
                         "gpu_num and gpu_per_node")
    info = from_env(os.environ if env is None else env)
    if info is not None:
        return info
    if mpi_comm is not None:
        return _from_mpi(mpi_comm)
    return RankInfo(global_rank=0, world_size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1, source="single")


def describe(info: RankInfo, env: Mapping[str, str]) -> str:
    """Where ``info`` came from, for messages: ``"torchrun variables (RANK=1, WORLD_SIZE=2)"``, or the
    source's name (``"explicit"``, ``"mpi"``, ...) when no launcher variables gave it."""
    names = dict(_LAUNCHERS).get(info.source)
    shown = ", ".join(f"{n}={env[n]}" for n in (names[:2] if names else ()) if n in env)
    return f"{info.source} variables ({shown})" if shown else info.source


#: Set to 1 to let each process of an MPI launch run on its own (a world of its own) on purpose.
INDEPENDENT_ENV = "DISTOPT_INDEPENDENT_PROCESSES"


def mpi_launcher(env: Mapping[str, str]) -> tuple[str, int] | None:
    """The MPI launcher this process runs under and its world size, e.g. ``("MPICH/Hydra mpiexec (PMI_SIZE=2)", 2)``;
    None outside one (or with sizes that are not integers: :func:`from_env` reports those)."""
    for name, launcher in (("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec"), ("PMI_SIZE", "MPICH/Hydra mpiexec")):
        value = env.get(name, "").strip()
        if value.isdigit():
            return f"{launcher} ({name}={value})", int(value)
    return None
