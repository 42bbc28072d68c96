"""Checks that every rank holds the same parameters and strategy settings.

NCCL #1417 and #1394: buffers that differ across ranks either
hang or return a mix of reduced and unreduced values. distopt compares a
short digest every step and, when digests differ, the full descriptions,
raising :class:`~distopt.errors.CollectiveMismatchError` on every rank with
the first difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..comm.base import Communicator
from ..comm.consensus import agree, digest
from ..errors import CollectiveMismatchError

__all__ = ["check_same", "GroupSettings", "group_settings"]


def _describe(spec: Sequence[Any]) -> str:
    return f"shape {tuple(spec[0])} dtype {spec[1]}"


def check_same(comm: Communicator, params: Sequence[Any], settings: Mapping[str, Any]) -> None:
    """Compare parameter shapes/dtypes and ``settings`` across ranks (collective: one all-gather of one
    digest per rank, and every rank's description only when they differ; :func:`~distopt.comm.consensus.agree`).

    Raises:
        CollectiveMismatchError: on every rank, naming the first differing
            setting, or the first parameter whose shape or dtype (or
            existence) differs, with every rank's value.
    """
    fields: dict[str, Any] = {f"setting {k!r}": v for k, v in sorted(settings.items())}
    fields.update({f"parameter #{i}": _describe((list(p.shape), str(p.dtype))) for i, p in enumerate(params)})
    show = {name: repr for name in fields if name.startswith("setting ")}
    agree(comm, fields, call="parameter check", error=CollectiveMismatchError, show=show,
          hint="every rank must build the same model, pass its parameters in the same order, and call the "
               "same strategy with the same settings")


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
