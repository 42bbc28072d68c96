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
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..comm.base import Communicator
from ..errors import CollectiveMismatchError

__all__ = ["digest", "check_same", "GroupSettings", "group_settings"]


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


@dataclass(frozen=True)
class GroupSettings:
    """The local optimizer's hyper-parameters, which every rank must share, folded into the step header.

    Attributes:
        key: the values, as tuples (compared each step: cheap).
        digest: the digest the step header carries (computed when ``key`` changes).
        values: ``{"param_groups[i]['lr']": value, ...}``, compared by
            :func:`check_same` when digests differ, so the error names the
            group, the key and the values.
    """

    key: tuple[Any, ...]
    digest: int
    values: dict[str, Any] = field(default_factory=dict)


_SKIP = object()


def _plain(value: Any) -> Any:
    """``value`` as a JSON-able scalar or tuple of scalars (one-element tensors as floats), else ``_SKIP``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return _SKIP if any(v is _SKIP for v in items) else items
    if getattr(value, "numel", None) is not None and value.numel() == 1:  # a torch tensor lr (capturable)
        return float(value)
    return _SKIP


def group_settings(groups: Sequence[Mapping[str, Any]], previous: GroupSettings | None = None) -> GroupSettings:
    """The :class:`GroupSettings` of ``groups`` (parameter groups without their ``params``); ``previous``
    itself when nothing changed, so the digest is recomputed only after a change (a scheduler step)."""
    key = tuple(tuple((k, v) for k, v in ((k, _plain(v)) for k, v in g.items() if k != "params") if v is not _SKIP)
                for g in groups)
    if previous is not None and previous.key == key:
        return previous
    values = {f"param_groups[{i}][{k!r}]": v for i, g in enumerate(key) for k, v in g}
    return GroupSettings(key, digest(values), values)
