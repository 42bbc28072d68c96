"""What an elastic job commits and restores: the model, the optimizer (ZeRO shards consolidated), the sampler,
and the script's own values (after Horovod Elastic's ``TorchState``)."""
from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

from .snapshot import SnapshotDir

__all__ = ["State"]


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class State:
    """The training state that :func:`distopt.elastic.run` rolls back to after the world changes.

    ``commit()`` serialises every object's ``state_dict()`` (``torch.save`` into memory: a copy, not a view of
    the live tensors) and the plain values, keeps it, and, under :func:`~distopt.elastic.run`, writes it to the
    node's shared memory (:class:`~distopt.elastic.snapshot.SnapshotDir`) so that the worker torchrun restarts
    finds it. ``restore()`` loads the last commit back into the same objects.

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict``: parameters and buffers; full tensors at ``zero=3``).
        optimizer: the :class:`distopt.DistOpt` of the job. Its ``state_dict()`` is consolidated across the
            ranks (a collective at ``zero=1|2|3``), so every rank must call :meth:`commit` at the same step;
            it loads at any world size, which re-shards ZeRO state for the new world.
        sampler: an :class:`~distopt.elastic.ElasticSampler` (its global position).
        **values: more objects with ``state_dict``/``load_state_dict`` (a second model, a scheduler, a
            GradScaler), or plain picklable values (``epoch=0``) read and written as attributes
            (``state.epoch += 1``). Values must be the same on every rank.

    Raises:
        ValueError: a value named like a method of this class.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, sampler: Any = None, **values: Any) -> None:
        objects = {"model": model, "optimizer": optimizer, "sampler": sampler}
        clash = sorted(set(values) & set(dir(State)))
        if clash:
            raise ValueError(f"distopt.elastic.State: value names {clash} are taken by State's own attributes")
        for name, value in values.items():
            if _stateful(value):
                objects[name] = value
        plain = {k: v for k, v in values.items() if k not in objects}
        object.__setattr__(self, "_objects", {k: v for k, v in objects.items() if v is not None})
        object.__setattr__(self, "_values", plain)
        object.__setattr__(self, "_callbacks", [])
        object.__setattr__(self, "_committed", None)
        object.__setattr__(self, "_snapshots", None)
        object.__setattr__(self, "_rank", 0)
        object.__setattr__(self, "_after_commit", None)
        object.__setattr__(self, "commits", 0)

    def __getattr__(self, name: str) -> Any:
        objects, values = self.__dict__["_objects"], self.__dict__["_values"]
        if name in objects:
            return objects[name]
        if name in values:
            return values[name]
        raise AttributeError(f"distopt.elastic.State has no value {name!r} (give it as State(..., {name}=...))")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"distopt.elastic.State: {name!r} is not a plain value of this state; values "
                                 f"are {sorted(self._values)} (objects are restored in place, not replaced)")
        self._values[name] = value

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions (no arguments) that :func:`~distopt.elastic.run` calls after restoring a commit into a new
        world, in order: e.g. a learning rate that follows the world size."""
        self._callbacks.extend(callbacks)

    def commit(self) -> None:
        """Snapshot the state now; collective (every rank at the same step). Under :func:`~distopt.elastic.run`
        the commit is also written to this node's shared memory (by local rank 0 of each node; each file holds
        the whole state, so one node's survivor can restore the world). Its cost is one ``state_dict()`` per
        object, one serialisation and one write to tmpfs: ``benchmarks/elastic.py`` prints it."""
        payload = self._serialise(self.commits + 1)
        object.__setattr__(self, "commits", self.commits + 1)
        object.__setattr__(self, "_committed", payload)
        if self._snapshots is not None:
            self._snapshots.write(self.commits, self._rank, payload)
        if self._after_commit is not None:
            self._after_commit()

    def restore(self) -> None:
        """Load the last commit back (the objects in place, the values replaced).

        Raises:
            RuntimeError: nothing was committed yet.
        """
        if self._committed is None:
            raise RuntimeError("distopt.elastic.State.restore: nothing was committed yet (call state.commit())")
        self._load(self._committed)

    def _serialise(self, seq: int) -> bytes:
        import torch

        record = {"seq": seq, "objects": {k: v.state_dict() for k, v in self._objects.items()},
                  "values": dict(self._values)}
        buf = io.BytesIO()
        torch.save(record, buf)
        return buf.getvalue()

    def _load(self, payload: bytes) -> None:
        import torch

        record = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
        missing = sorted(set(self._objects) - set(record["objects"]))
        if missing:
            raise ValueError(f"distopt.elastic.State: the commit holds no state for {missing}; it was taken of "
                             f"{sorted(record['objects'])}")
        for name, obj in self._objects.items():
            obj.load_state_dict(record["objects"][name])
        self._values.update(record["values"])
        object.__setattr__(self, "commits", int(record["seq"]))
        object.__setattr__(self, "_committed", payload)

    def _attach(self, snapshots: SnapshotDir | None, rank: int,
                after_commit: Callable[[], None] | None = None) -> None:
        """Under :func:`~distopt.elastic.run`: where commits go (None: not this rank), this rank's number, and
        what runs after each commit is written (collective on every rank: ``python -m distopt.launch``'s
        growth check, :mod:`distopt.elastic.regroup`)."""
        object.__setattr__(self, "_snapshots", snapshots)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_after_commit", after_commit)

    def _reset(self) -> None:
        for callback in self._callbacks:
            callback()
