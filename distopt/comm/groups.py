"""Process groups: a sub-world over some of a communicator's ranks.

The field's names for it: torch's ``dist.new_group(ranks)``, Horovod's process sets, MPI's ``Comm_split``. :func:`split`
is collective over the parent communicator: every rank of the parent calls it, in the same order, with the same ranks.
The group's communicator is a new one of the parent's backend (its collectives never interleave with the parent's); its
ranks are the members' parent ranks in ascending order, renumbered from 0. A rank outside the group gets a
:class:`Group` whose ``comm`` is None.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .base import Communicator
from .consensus import agree

__all__ = ["Group", "split", "communicator_of"]


class Group:
    """Some ranks of a parent communicator, and their own communicator.

    Attributes:
        ranks: the members' ranks in the parent, ascending.
        name: the name given to :func:`split` (used in error messages).
        comm: the group's communicator on a member; None on every other rank.
        parent_size: the parent's world size.
    """

    def __init__(self, ranks: tuple[int, ...], name: str, comm: Communicator | None, parent_size: int) -> None:
        self.ranks, self.name, self.comm, self.parent_size = ranks, name, comm, parent_size

    @property
    def is_member(self) -> bool:
        """True on the group's members."""
        return self.comm is not None

    @property
    def rank(self) -> int:
        """This rank's rank in the group; ValueError on a rank outside it."""
        return self.require("rank").rank

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    def require(self, what: str) -> Communicator:
        """The group's communicator, for ``what`` (named in the error).

        Raises:
            ValueError: this rank is not a member.
        """
        if self.comm is None:
            raise ValueError(f"{what}: this rank is not a member of process group {self.name!r} "
                             f"(ranks {list(self.ranks)})")
        return self.comm

    def close(self) -> None:
        """Close the group's communicator on a member (idempotent); a no-op elsewhere."""
        if self.comm is not None:
            self.comm.close()

    def __repr__(self) -> str:
        return f"Group(name={self.name!r}, ranks={list(self.ranks)}, member={self.is_member})"


def _check_ranks(ranks: Any, size: int) -> tuple[int, ...]:
    """``ranks`` as a sorted tuple of distinct ints in ``[0, size)``; ValueError/TypeError otherwise."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be an iterable of ints, got {type(ranks).__name__}")
    out = list(ranks)
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
    if bad:
        raise TypeError(f"ranks must be ints, got {bad[0]!r}")
    out = [int(r) for r in out]
    if not out:
        raise ValueError("ranks must name at least one rank, got none")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks must be distinct, got {out}")
    outside = [r for r in out if not 0 <= r < size]
    if outside:
        raise ValueError(f"ranks must be in [0, {size}), got {outside}")
    return tuple(sorted(out))


def split(parent: Communicator, ranks: Iterable[int], name: str | None = None) -> Group:
    """A process group of ``ranks`` of ``parent`` (collective over ``parent``).

    Every rank of ``parent`` first shares its ``ranks`` and ``name``, so a bad or differing argument is raised on every
    rank; then the backend builds the group's communicator (``parent.split(ranks)``: MPI ``Comm_split``,
    ``torch.distributed.new_group``, new shared-memory segments, or the single-process world).

    Args:
        parent: the communicator whose ranks are split.
        ranks: the members' ranks in ``parent`` (any order; distinct, in ``[0, parent.size)``).
        name: a name for error messages; default ``"group[r0,r1,...]"``.

    Returns:
        The :class:`Group` (``comm`` None on a rank outside it).

    Raises:
        TypeError / ValueError: on every rank, naming each rank whose ``ranks`` is bad (``"new_group on rank 1: ..."``).
        CollectiveMismatchError: on every rank, the ranks disagree on the members or name (naming every rank's).
        ValueError: the backend cannot split (NCCL; a torch group of a group).
    """
    if not callable(getattr(parent, "split", None)):
        raise ValueError(f"new_group: the {getattr(parent, 'name', type(parent).__name__)!r} communicator has no "
                         "process groups (they exist on the mpi, shm, torch and single backends)")
    problem, members = None, ()
    try:
        members = _check_ranks(ranks, parent.size)
    except (TypeError, ValueError) as exc:
        problem = exc
    label = name if name is not None else f"group{list(members)}"
    call = "new_group" if name is None else f"new_group {name!r}"
    agree(parent, {"member list": list(members), "group name": label}, call=call, problem=problem,
          kinds=(ValueError, TypeError), hint="every rank must call new_group with the same ranks and name")
    return Group(members, label, parent.split(members), parent.size)


def communicator_of(target: Any, what: str) -> Communicator:
    """The communicator behind ``target``: a :class:`Group` (ValueError on a non-member), or a communicator.

    Args:
        target: a :class:`Group` or a :class:`Communicator`.
        what: the call, named in the error.

    Raises:
        ValueError: a group this rank is not a member of.
        TypeError: ``target`` is neither.
    """
    if isinstance(target, Group):
        return target.require(what)
    if isinstance(target, Communicator):
        return target
    raise TypeError(f"{what}: group must be a distopt process group (distopt.new_group), "
                    f"got {type(target).__name__}")
