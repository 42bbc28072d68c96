"""Which DistOpt averages each tensor, when several DistOpts share parameters (a GAN, an optimizer over a
subset; Horovod issue 3077): the first one built over it, the same on every rank. The others leave its
gradient alone and step it with that average, so each gradient is averaged once per backward.
"""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["claim", "release"]

#: ``id(tensor)`` -> the follower that averages it: the first DistOpt built over it (the same on every rank).
_OWNERS: dict[int, Any] = {}


def claim(tensor: Any, follower: Any) -> bool:
    """Whether ``follower`` averages ``tensor`` (claiming it if no live follower did)."""
    owner = _OWNERS.get(id(tensor))
    if owner is None:
        _OWNERS[id(tensor)] = owner = follower
        weakref.finalize(tensor, _OWNERS.pop, id(tensor), None)
    return owner is follower


def release(tensors: Any, follower: Any) -> None:
    """Give up ``tensors`` that ``follower`` averages (its DistOpt closed): another DistOpt may claim them."""
    for t in tensors:
        if _OWNERS.get(id(t)) is follower:
            del _OWNERS[id(t)]
