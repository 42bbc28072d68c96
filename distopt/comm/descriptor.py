"""The per-call descriptor ranks exchange before a collective, and its comparison.

MPI and torch.distributed do not check that every rank called the same
collective with the same element count and dtype; a difference gives a
partial sum, garbage or a hang. Those backends therefore all-gather four
int64s per call first, ``(kind, sequence number, element count, code)``,
and :func:`check` raises :class:`~distopt.errors.CollectiveMismatchError` on
every rank (all see the same table) naming the first difference.
"""
from __future__ import annotations

import numpy as np

from ..errors import CollectiveMismatchError

__all__ = ["KINDS", "kind_name", "dtype_code", "check"]

#: Collective kinds, by code.
KINDS = ("all_reduce", "broadcast", "all_gather", "all_gather_v", "barrier")


def kind_name(code: int) -> str:
    """Name of a collective kind code (robust to garbage from a mismatched exchange)."""
    return KINDS[code] if 0 <= code < len(KINDS) else f"an unknown collective (code {code})"


def dtype_code(dtype: np.dtype) -> int:
    """An int64 that differs between dtypes (byte order, kind, item size)."""
    return int.from_bytes(dtype.str.encode()[:6].ljust(6, b"\0"), "little") ^ (dtype.itemsize << 48)


def check(everyone: np.ndarray, what: str) -> None:
    """Raise on every rank if the rows of ``everyone`` differ.

    Args:
        everyone: int64, shape ``(size, 4)``: every rank's descriptor.
        what: the collective, e.g. ``"all_reduce #12"``, for the message.

    Raises:
        CollectiveMismatchError: naming rank 0's and the first differing
            rank's collective, element count, or dtype/op.
    """
    differs = ~(everyone == everyone[0]).all(axis=1)
    if not differs.any():
        return
    first = int(np.argmax(differs))
    a, b = everyone[0], everyone[first]
    if a[0] != b[0] or a[1] != b[1]:
        detail = (f"rank 0 is in {kind_name(a[0])} #{a[1]}, rank {first} in {kind_name(b[0])} #{b[1]} "
                  "(ranks reached different collectives or different step counts)")
    elif a[2] != b[2]:
        detail = (f"element count differs: rank 0 has {a[2]}, rank {first} has {b[2]} (different buffers, "
                  "or ranks at unequal step counts calling different collectives)")
    else:
        detail = f"dtype or op differs between rank 0 and rank {first}"
    raise CollectiveMismatchError(f"{what}: {detail}")
