"""Consensus: the ranks agree on a value, or every rank raises the same error naming each rank's value.

Every cross-rank check in distopt goes through this module, so the errors read alike whatever raised them: :func:`agree`
gathers and compares (for a caller with only a communicator); :func:`check_agreed` compares values already gathered (a
backend's control-block table or shared-memory rows). A value is a mapping of named *fields*
(``{"shape": ..., "dtype": ...}``); when ranks differ, the error names the first field whose values differ and every
rank's value of it (:func:`~distopt.comm.messages.mismatch_message`). All see the same values, so every rank raises.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollectiveMismatchError
from .messages import mismatch_message

if TYPE_CHECKING:
    from .base import Communicator

__all__ = ["digest", "gather_objects", "check_agreed", "agree"]

Show = Callable[[Any], str]


def digest(obj: Any) -> int:
    """A stable 63-bit digest of a JSON-able object (the same in every process, unlike ``hash``; others by ``str``)."""
    raw = hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def gather_objects(comm: Communicator, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (collective: one ``all_gather_v`` of the
    pickles)."""
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
    return [pickle.loads(part.tobytes()) for part in comm.all_gather_v(payload)]


def check_agreed(place: str, fields: Mapping[str, Sequence[Any]], *,
                 error: type[Exception] = CollectiveMismatchError, show: Show | Mapping[str, Show] = str,
                 hint: str | Mapping[str, str | None] | None = None,
                 shown: Mapping[str, Sequence[Any]] | None = None) -> None:
    """Raise ``error`` when some field's values differ across ranks; return when every field agrees.

    Not a collective: every rank that calls it with the same gathered values raises the same error.

    Args:
        place: the call, starting the message (``"mpi all_reduce #3 on rank 0"``, ``"all_gather"``).
        fields: field name -> every rank's value, in rank order; compared with ``==``, in order.
        error: the exception type raised (called with the message).
        show: how a value reads in the message: one function, or one per field (default ``str``).
        hint: the likely cause, appended to the message: one text, or one per field.
        shown: field -> every rank's value to show instead of the compared one (e.g. the full shape, where only its tail
            is compared).

    Raises:
        error: naming the first differing field and every rank's value of it
            (:func:`~distopt.comm.messages.mismatch_message`).
    """
    for field, values in fields.items():
        if all(v == values[0] for v in values[1:]):
            continue
        fmt = show.get(field, str) if isinstance(show, Mapping) else show
        why = hint.get(field) if isinstance(hint, Mapping) else hint
        display = shown[field] if shown is not None and field in shown else values
        raise error(mismatch_message(place, field, [fmt(v) for v in display], why))


def agree(comm: Communicator, fields: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *, call: str,
          error: type[Exception] = CollectiveMismatchError, show: Show | Mapping[str, Show] = str,
          hint: str | Mapping[str, str | None] | None = None, shown: Mapping[str, Any] | None = None,
          problem: BaseException | None = None, kinds: tuple[type[BaseException], ...] = (ValueError,),
          extra: Sequence[int] = (), key: int | None = None) -> np.ndarray:
    """Agree across the ranks of ``comm`` on ``fields`` (collective: every rank calls it at the same point).

    What travels:

    1. always, one ``comm.all_gather`` of ``2 + len(extra)`` int64 per rank: ``(1 if this rank has a problem else 0,
       key, *extra)``, ``key`` being :func:`digest` of ``fields``;
    2. when some rank has a problem or the keys differ, one :func:`gather_objects` of ``(fields, shown, problem)``.

    Args:
        comm: the communicator.
        fields: this rank's value, field name -> JSON-able value (compared with ``==`` once gathered); or a function
            returning it, called only when the ranks differ (then give ``key``).
        call: the call, starting every message (``"all_gather"``, ``"save"``).
        error: the exception type raised when the fields differ.
        show: as for :func:`check_agreed`.
        hint: as for :func:`check_agreed`.
        shown: field -> this rank's value to show in the message instead of the compared one.
        problem: this rank's own error (a bad argument, a failed write), or None.
        kinds: the exception types a problem is raised as: its own class when that is one of these (by name) or a
            builtin subclass of one, else ``kinds[0]``.
        extra: ints to gather alongside (every rank's, returned).
        key: this rank's digest of ``fields`` when the caller keeps one; default :func:`digest` of ``fields``.

    Returns:
        int64, shape ``(size, len(extra))``: every rank's ``extra``, in rank order.

    Raises:
        kinds: on every rank, when any rank has a problem, before the fields are compared:
            ``"<call> on rank <r>: <text>"`` for the first such rank, then ``"; on rank <s>: <text>"`` for every other
            (the text prefixed by its class name where that is not the class raised), chained on the rank with the
            problem.
        error: on every rank, the fields differ: naming the first one and every rank's value (:func:`check_agreed`).
    """
    if key is None:
        fields = fields() if callable(fields) else fields
        key = digest(fields)
    header = np.array([int(problem is not None), key, *extra], dtype=np.int64)
    everyone = comm.all_gather(header)
    if not everyone[:, 0].any() and (everyone[:, 1] == everyone[0, 1]).all():
        return everyone[:, 2:]
    mine = fields() if callable(fields) else fields
    report = None if problem is None else (type(problem).__name__, _text(problem))
    gathered = gather_objects(comm, (dict(mine), dict(shown or {}), report))
    failed = [(r, rep) for r, (_, _, rep) in enumerate(gathered) if rep is not None]
    if failed:
        _raise_problem(call, failed, kinds, problem)
    names = list(dict.fromkeys(name for values, _, _ in gathered for name in values))
    missing = "(none)"
    columns = {name: [values.get(name, missing) for values, _, _ in gathered] for name in names}
    displays = {name: [sh.get(name, values.get(name, missing)) for values, sh, _ in gathered]
                for name in names if any(name in sh for _, sh, _ in gathered)}
    check_agreed(call, columns, error=error, show=show, hint=hint, shown=displays)
    raise error(mismatch_message(call, "digest of the values", [f"{int(k):#x}" for k in everyone[:, 1]],
                                 "the values compare equal once gathered (a value that JSON shows differently?)"))


def _text(problem: BaseException) -> str:
    """A problem's message (a KeyError's own text, not its repr)."""
    if isinstance(problem, KeyError) and len(problem.args) == 1 and isinstance(problem.args[0], str):
        return problem.args[0]
    return str(problem)


def _kind(name: str, kinds: tuple[type[BaseException], ...]) -> type[BaseException]:
    found = next((kind for kind in kinds if kind.__name__ == name), getattr(builtins, name, None))
    return found if isinstance(found, type) and issubclass(found, kinds) else kinds[0]


def _raise_problem(call: str, failed: list[tuple[int, tuple[str, str]]], kinds: tuple[type[BaseException], ...],
                   problem: BaseException | None) -> None:
    def message(kind: type[BaseException]) -> str:
        return f"{call} " + "; ".join(f"on rank {r}: " + (f"{name}: " if name != kind.__name__ else "") + text
                                      for r, (name, text) in failed)

    kind = _kind(failed[0][1][0], kinds)
    try:
        exc = kind(message(kind))
    except TypeError:  # a builtin class that takes other arguments (UnicodeDecodeError): its kind
        kind = next(k for k in kinds if issubclass(kind, k))
        exc = kind(message(kind))
    raise exc from problem
