"""Joining the job and sharing it: :func:`init`'s :class:`World`, the communicator each ``DistOpt`` acquires (built,
handed over, a group's or the world's, see :func:`acquire_comm`), and process groups.

Which backend a launch gets is the rule of :mod:`distopt.launch.backend_rule` (:func:`build_world`, re-exported here).
"""
from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .backend_rule import build_world, choose_backend
from .ranks import RankInfo
from ..comm.base import Communicator
from ..errors import CommunicatorClosedError
from ..comm.groups import Group, split
from ..comm.hierarchy import hierarchical_for

__all__ = ["build_world", "choose_backend", "init", "current", "World", "comm_for", "acquire_comm", "shared_view",
           "new_group"]

@dataclass(frozen=True)
class World:
    """This process's place in the job, before any optimizer exists (see :func:`init`).

    Attributes:
        comm: the communicator (pass the whole World to ``DistOpt``).
        info: where the ranks came from (:class:`~distopt.launch.ranks.RankInfo`).
    """

    comm: Communicator
    info: RankInfo
    _users: list[int] = field(default_factory=lambda: [0, 0], init=False, repr=False, compare=False)

    @property
    def users(self) -> int:
        """How many hold this world now: its DistOpts, and the script while it holds :func:`init`'s world."""
        return self._users[0] + self._users[1]

    def acquire(self) -> None:
        """Count one more DistOpt on this world.

        Raises:
            CommunicatorClosedError: the world's communicator is closed already.
        """
        if getattr(self.comm, "closed", False):
            raise CommunicatorClosedError(
                f"DistOpt(world=...) on the closed {self.comm.name} communicator (rank {self.rank} of "
                f"{self.world_size}): the world was closed (world.close(), or its last DistOpt closed); "
                "call distopt.init() again for a new one")
        self._users[0] += 1

    def hold(self) -> None:
        """The script holds the world (what :func:`init` does), until :meth:`close`; idempotent."""
        self._users[1] = 1

    def release(self) -> None:
        """Count one DistOpt less (not past zero); once nobody holds the world, it closes (collective on MPI)."""
        if self._users[0] > 0:
            self._users[0] -= 1
            self._close_if_unused()

    def _close_if_unused(self) -> None:
        if self.users == 0:
            self.comm.close()

    @property
    def rank(self) -> int:
        """Global rank, ``0 <= rank < world_size``."""
        return self.info.global_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        """Rank among the processes of this node (picks the GPU)."""
        return self.info.local_rank

    @property
    def local_size(self) -> int | None:
        """Processes on this node, when known."""
        return self.info.local_size

    @property
    def backend(self) -> str:
        """The communicator's backend name."""
        return self.comm.name

    def close(self) -> None:
        """Let go of the world (idempotent): its communicator closes now, or when the last DistOpt on it closes."""
        self._users[1] = 0
        self._close_if_unused()


_current: World | None = None


def init(backend: str | None = None, timeout: float | None = None) -> World:
    """Join the job now and return where this process stands, e.g. to scale the learning rate.

    Idempotent: a second call returns the same :class:`World` while its communicator is open. The script holds the
    world until ``world.close()`` (or exit); DistOpts built on it share it and never close it while the script holds
    it. Example::

        world = distopt.init()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01 * world.world_size)

    Args:
        backend: force a backend (see :func:`build_world`); None: the launch-mode rule.
        timeout: collective deadline in seconds (default ``$DISTOPT_TIMEOUT`` or 300).

    Raises:
        ValueError: as :func:`build_world`; or a second call asks for another backend.
        BackendUnavailableError: as :func:`build_world`.
    """
    global _current
    if _current is not None and not getattr(_current.comm, "closed", False):
        if backend is not None and backend != _current.comm.name:
            raise ValueError(f"distopt.init() already joined the job over {_current.comm.name!r}; "
                             f"got backend={backend!r}")
        _current.hold()
        return _current
    comm, info = build_world(backend=backend, timeout=timeout)
    _current = World(comm, info)
    _current.hold()
    return _current


def current() -> World | None:
    """The :class:`World` of the last :func:`init` while its communicator is open, else None."""
    if _current is None or getattr(_current.comm, "closed", False):
        return None
    return _current


def shared_view(comm: Communicator) -> Communicator:
    """A view of ``comm`` for one user: the same object state (the same MPI communicator, process group, control
    block and sequence numbers), but its own ``closed`` flag and ``wait_seconds``; its ``close()`` only marks the view
    closed (every later call through it raises :class:`~distopt.errors.CommunicatorClosedError`), ``comm`` stays open
    for its other users."""
    view = copy.copy(comm)
    view.closed = False
    if hasattr(view, "wait_seconds"):
        view.wait_seconds = 0.0

    def close(self: Communicator) -> None:
        self.closed = True

    view.close = types.MethodType(close, view)  # type: ignore[method-assign]
    return view


def acquire_comm(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
                 backend: str | None = None, timeout: float | None = None, comm: Communicator | None = None,
                 world: World | None = None, hierarchical: bool | None = None, group: Group | None = None
                 ) -> tuple[Communicator, int, int, Callable[[], None]]:
    """The communicator of a new ``DistOpt``, its ``(local rank, local size)``, and how to release it.

    In order: a process ``group``'s communicator (local rank and size from ``world`` or an earlier :func:`init`), an
    explicit ``comm`` (local rank and size from ``gpu_num`` / ``gpu_per_node``, else the communicator's rank and
    size), an explicit ``world``, the :class:`World` of an earlier :func:`init`, else a new communicator by
    :func:`build_world`. Then :func:`~distopt.comm.hierarchy.hierarchical_for` (``hierarchical``; a group's
    communicator stays flat unless it is True).

    Ownership, what the returned release closes: only a communicator built here. An explicit ``comm`` stays the
    caller's, as a process group given to DDP: the DistOpt uses the object itself (a subclass's own state, such as call
    counters, stays in it) and never closes it; only a hierarchical layer built over it is closed. A group's
    communicator and a world's are shared: the DistOpt gets a :func:`shared_view` (its calls raise once it is released),
    the group's communicator stays open, and the world counts one user more (:meth:`World.acquire`): it closes when
    neither the script (the holder of :func:`init`'s world, until ``world.close()``) nor any DistOpt uses it.

    Raises:
        ValueError: as :func:`build_world`; a rank outside ``group``; as
            :func:`~distopt.comm.hierarchy.hierarchical_for`.
        BackendUnavailableError: as :func:`build_world`.
        CommunicatorClosedError: ``world`` is closed.
    """
    if group is not None:
        if not isinstance(group, Group):
            raise TypeError(f"group must be a distopt process group (distopt.new_group), got {type(group).__name__}")
        sub = group.require("DistOpt(group=)")
        outer = world if world is not None else current()
        local = (outer.info.local_rank, outer.info.local_size) if outer is not None else (sub.rank, sub.size)
        made = hierarchical_for(shared_view(sub), bool(hierarchical))
        return made, local[0], local[1], made.close
    if comm is not None:  # the caller's: used as it is, never closed here
        made = hierarchical_for(comm, hierarchical)
        release = (lambda: None) if made is comm else made.close_layers  # type: ignore[attr-defined]
        return (made, comm.rank if gpu_num is None else gpu_num, comm.size if gpu_per_node is None else gpu_per_node,
                release)
    world = world if world is not None else (current() if nccl_id is None and backend is None else None)
    if world is not None:
        world.acquire()  # raises on a closed world: a view of freed MPI objects must never be made
        made = hierarchical_for(shared_view(world.comm), hierarchical)
        done = [False]

        def release() -> None:
            if not done[0]:
                done[0] = True
                made.close()
                world.release()

        return made, world.info.local_rank, world.info.local_size, release
    built, info = build_world(nccl_id, gpu_num, gpu_per_node, backend, timeout)
    made = hierarchical_for(built, hierarchical)
    return made, info.local_rank, info.local_size, made.close


def comm_for(nccl_id: Any = None, gpu_num: int | None = None, gpu_per_node: int | None = None,
             backend: str | None = None, timeout: float | None = None, comm: Communicator | None = None,
             world: World | None = None, hierarchical: bool | None = None, group: Group | None = None
             ) -> tuple[Communicator, int, int]:
    """:func:`acquire_comm` without its release: ``(communicator, local rank, local size)``."""
    return acquire_comm(nccl_id, gpu_num, gpu_per_node, backend, timeout, comm, world, hierarchical, group)[:3]


def new_group(ranks: Iterable[int], world: World | None = None, name: str | None = None) -> Group:
    """A process group of ``ranks`` (torch's ``new_group``, Horovod's process sets): collective over the job.

    Every rank of the job calls it, in the same order, with the same ``ranks``; pass the result to
    ``DistOpt(opt, group=g)`` or to a collective's ``group=``. See :func:`distopt.comm.groups.split`.

    Args:
        ranks: the members' global ranks (any order, distinct).
        world: the job; default the one of :func:`init` (joined now if needed).
        name: a name for error messages (default from the ranks).

    Returns:
        A :class:`~distopt.comm.groups.Group`; its ``comm`` is None on a rank outside it.

    Raises:
        TypeError / ValueError / CollectiveMismatchError: on every rank, as :func:`~distopt.comm.groups.split` (bad
            ranks, ranks that disagree on the members, a backend without groups).
    """
    return split((world if world is not None else init()).comm, ranks, name)
