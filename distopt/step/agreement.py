"""Checks that every rank holds the same parameters and strategy settings. NCCL #1417 and #1394: buffers that differ
across ranks either hang or return a mix of reduced and unreduced values. distopt compares a short digest every step
and, when digests differ, the full descriptions, raising :class:`~distopt.errors.CollectiveMismatchError` on every rank
with the first difference."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, MutableMapping, Sequence

import numpy as np

from ..comm.base import Communicator
from ..comm.consensus import agree, digest, gather_objects
from ..errors import CollectiveMismatchError

__all__ = ["check_same", "GroupSettings", "group_settings", "shadow_settings", "borrowed"]


def check_same(comm: Communicator, params: Sequence[Any], settings: Mapping[str, Any],
               names: Sequence[str] | None = None) -> None:
    """Compare parameter shapes/dtypes and ``settings`` across ranks (collective: one all-gather of one digest per
    rank, and every rank's description only when they differ; :func:`~distopt.comm.consensus.agree`).

    ``names``: each parameter's name (its module path), shown beside its number in the error; None: numbers only.

    Raises:
        CollectiveMismatchError: on every rank, naming the first differing setting, or the first parameter whose
            shape or dtype (or existence) differs, with every rank's value.
    """
    first = sorted(settings, key=lambda k: (k != "strategy", k))  # the strategy's name before its settings
    fields: dict[str, Any] = {f"setting {k!r}": settings[k] for k in first}
    named = names is not None and len(names) == len(params)
    fields.update({f"parameter #{i}": (f"{names[i]!r} " if named else "")  # type: ignore[index]
                   + f"shape {tuple(p.shape)} dtype {p.dtype}" for i, p in enumerate(params)})
    show = {name: repr for name in fields if name.startswith("setting ")}
    agree(comm, fields, call="settings and parameters", error=CollectiveMismatchError, show=show,
          hint="every rank must build the same model, pass its parameters in the same order, and call the "
               "same strategy with the same settings")


@dataclass(frozen=True)
class GroupSettings:
    """The local optimizer's hyper-parameters, which every rank must share, folded into the step header.

    Attributes:
        key: the values, as tuples (compared each step: cheap).
        digest: the digest the step header carries (computed when ``key`` changes).
        values: ``{"param_groups[i]['lr']": value, ...}``, compared by :func:`check_same` when digests differ, so
            the error names the group, the key and the values.
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
    """The :class:`GroupSettings` of ``groups`` (parameter groups without their ``params``); ``previous`` itself when
    nothing changed, so the digest is recomputed only after a change (a scheduler step)."""
    key = tuple(tuple((k, v) for k, v in ((k, _plain(v)) for k, v in g.items() if k != "params") if v is not _SKIP)
                for g in groups)
    if previous is not None and previous.key == key:
        return previous
    values = {f"param_groups[{i}][{k!r}]": v for i, g in enumerate(key) for k, v in g}
    return GroupSettings(key, digest(values), values)


def shadow_settings(comm: Communicator, digests: np.ndarray, shadows: np.ndarray, groups: GroupSettings | None,
                    shadow: bool) -> tuple[Any, ...] | None:
    """The stepping ranks' hyper-parameters for a joined rank's shadow step, from the step header.

    A rank inside ``join()`` answers the others' steps (a shadow step) with its hyper-parameters frozen where it left
    the loop (its per-step LR scheduler no longer steps), so they are not compared, and it applies the stepping ranks'
    values (:func:`borrowed`). Collective only when some shadow rank's settings differ (decided from the header, the
    same on every rank): one :func:`~distopt.comm.consensus.gather_objects` of the first stepping rank's
    ``GroupSettings.key``.

    Args:
        comm: the communicator.
        digests: every rank's settings digest from the header (0: none).
        shadows: every rank's shadow flag from the header.
        groups: this rank's settings (None: it has none).
        shadow: this rank's step is a shadow step.

    Returns:
        On a shadow rank whose settings differ, the stepping ranks' ``key``; else None.
    """
    stepping = np.flatnonzero(shadows == 0)
    if not stepping.size or digests[stepping[0]] == 0 or (digests == digests[stepping[0]]).all():
        return None
    root = int(stepping[0])
    theirs = gather_objects(comm, groups.key if comm.rank == root and groups is not None else None)[root]
    return tuple(theirs) if shadow and groups is not None and groups.digest != digests[root] else None


@contextmanager
def borrowed(groups: Sequence[MutableMapping[str, Any]], key: tuple[Any, ...] | None) -> Iterator[None]:
    """Inside the block, the parameter groups hold the values of ``key`` (a :class:`GroupSettings` key, from
    :func:`shadow_settings`) where theirs differ; their own values are put back after it. A one-element tensor value
    (a ``capturable`` lr) gets a new tensor of its dtype and device."""
    saved: list[tuple[MutableMapping[str, Any], str, Any]] = []
    for group, items in zip(groups, key or ()):
        for k, v in items:
            if k not in group or _plain(group[k]) == v:
                continue
            old = group[k]
            saved.append((group, k, old))
            group[k] = old.detach().clone().fill_(v) if getattr(old, "numel", None) is not None else v
    try:
        yield
    finally:
        for group, k, old in reversed(saved):
            group[k] = old
