"""Which DistOpt averages each tensor, when several DistOpts share parameters (a GAN, an optimizer over a
subset; Horovod issue 3077): the first one built over it, the same on every rank. The others leave its
gradient alone and step it with that average, so each gradient is averaged once per backward.
"""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["claim", "release", "check_sharing"]

#: ``id(tensor)`` -> the follower that averages it: the first DistOpt built over it (the same on every rank).
_OWNERS: dict[int, Any] = {}


def claim(tensor: Any, follower: Any) -> bool:
    """Whether ``follower`` averages ``tensor`` (claiming it if no live follower did)."""
    owner = _OWNERS.get(id(tensor))
    if owner is None:
        _OWNERS[id(tensor)] = owner = follower
        weakref.finalize(tensor, _OWNERS.pop, id(tensor), None)
    return owner is follower


def check_sharing(tensors: Any, follower: Any, names: Any) -> None:
    """Claim ``tensors`` for ``follower`` now (the first DistOpt built over a tensor averages it), refusing a tensor
    shared with another live follower when either of the two shards its optimizer: a sharded optimizer updates only
    its own pieces of its own tensors, so a shared tensor would be stepped wrongly.

    Args:
        tensors: the follower's parameters.
        follower: the new follower (its ``sink.shards_optimizer`` tells whether it shards).
        names: ``names(indices)``: how to name the parameters at ``indices`` in the error.

    Raises:
        ValueError: a tensor is shared with a sharding DistOpt, or this one shards and shares one (naming them).
    """
    owners = [_OWNERS.get(id(t)) for t in tensors]
    shared = [i for i, owner in enumerate(owners) if owner is not None and owner is not follower
              and (follower.sink.shards_optimizer or owner.sink.shards_optimizer)]
    if shared:
        raise ValueError(f"parameters {names(shared)} belong to another live DistOpt too, and one of the two "
                         "shards its optimizer (zero=1|2|3), which updates only its own pieces of its own tensors: "
                         "give each parameter to one DistOpt, or use zero=0 for both (or close() the other first)")
    for t in tensors:
        claim(t, follower)


def release(tensors: Any, follower: Any) -> None:
    """Give up ``tensors`` that ``follower`` averages (its DistOpt closed): another DistOpt may claim them."""
    for t in tensors:
        if _OWNERS.get(id(t)) is follower:
            del _OWNERS[id(t)]
