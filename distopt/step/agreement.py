"""Checks that every rank holds the same parameters and strategy settings.

NCCL #1417 and #1394: buffers that differ across ranks either
hang or return a mix of reduced and unreduced values. distopt compares a
short digest every step and, when digests differ, the full descriptions,
raising :class:`~distopt.errors.CollectiveMismatchError` on every rank with
the first difference.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

import numpy as np

from ..comm.base import Communicator
from ..errors import CollectiveMismatchError

__all__ = ["digest", "check_same"]


def digest(obj: Any) -> int:
    """A stable 63-bit digest of a JSON-able object (the same in every process, unlike ``hash``)."""
    raw = hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def _describe(spec: Sequence[Any] | None) -> str:
    return "no parameter" if spec is None else f"shape {tuple(spec[0])} dtype {spec[1]}"


def check_same(comm: Communicator, params: Sequence[Any], settings: Mapping[str, Any]) -> None:
    """Compare parameter shapes/dtypes and ``settings`` across ranks (collective).

    Every rank's description travels in one variable-length all-gather of
    its JSON bytes.

    Raises:
        CollectiveMismatchError: on every rank, naming the first differing
            setting, or the first parameter whose shape or dtype (or
            existence) differs between rank 0 and another rank.
    """
    mine = {"params": [[list(p.shape), str(p.dtype)] for p in params], **settings}
    blob = np.frombuffer(json.dumps(mine, sort_keys=True, default=str).encode(), dtype=np.uint8)
    everyone = [json.loads(b.tobytes()) for b in comm.all_gather_v(blob.copy())]
    ref = everyone[0]
    for r, other in enumerate(everyone[1:], start=1):
        if other == ref:
            continue
        for key in sorted(set(ref) | set(other)):
            if key != "params" and ref.get(key) != other.get(key):
                raise CollectiveMismatchError(
                    f"setting {key!r} differs: rank 0 has {ref.get(key)!r}, rank {r} has {other.get(key)!r}")
        a, b = ref["params"], other["params"]
        for i in range(max(len(a), len(b))):
            sa = a[i] if i < len(a) else None
            sb = b[i] if i < len(b) else None
            if sa != sb:
                raise CollectiveMismatchError(
                    f"parameter #{i} differs across ranks: rank 0 has {_describe(sa)}, rank {r} has "
                    f"{_describe(sb)} (rank 0 holds {len(a)} parameters, rank {r} holds {len(b)}); every "
                    "rank must build the same model and pass its parameters in the same order")
