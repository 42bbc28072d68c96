"""What an elastic job commits and restores: the model, the optimizer, the sampler and the script's own values
(after Horovod Elastic's ``TorchState``), in the checkpoint format of :mod:`distopt.checkpoint`.

A commit is made of parts. Without a sharded optimizer it is one part, the same on every rank. With one
(``DistOpt(torch_optimizer, zero=1|2|3)``) it has one part per rank: rank r's part holds its shard of every
sharded optimizer's state and of the parameters those train (``state_dict(sharded=True, params=True)``),
and every part also holds the rest (other objects, the model's buffers and untrained parameters, plain values).
No rank ever serialises, holds or loads the whole sharded state: a restore streams the parts one at a time
(:class:`~distopt.sharding.shard_state.ShardStream`), each rank keeping its new pieces.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..checkpoint import dumps, loads

__all__ = ["State"]

#: Version of a commit part's layout.
COMMIT_FORMAT = 1


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _sharded(value: Any) -> bool:
    return bool(getattr(value, "state_sharded", False))


def _module_entries(module: Any, skip: set[int]) -> dict[str, Any]:
    """A module's parameters and persistent buffers by ``state_dict`` name, but for those in ``skip`` (ids):
    read without ``module.state_dict()`` (which gathers a ``zero=3`` model)."""
    out = {name: p for name, p in module.named_parameters() if id(p) not in skip}
    for prefix, sub in module.named_modules():
        for name, b in sub.named_buffers(prefix=prefix, recurse=False):
            if b is not None and name.rsplit(".", 1)[-1] not in sub._non_persistent_buffers_set:
                out[name] = b
    return out


class State:
    """The training state that :func:`distopt.elastic.run` rolls back to after the world changes.

    ``commit()`` serialises every object's state (a copy, not a view of the live tensors) and the plain
    values, keeps this rank's part, and, under :func:`~distopt.elastic.run`, writes the parts to each node's
    shared memory (:class:`~distopt.elastic.snapshot.SnapshotDir`) so that the worker torchrun restarts finds
    them. ``restore()`` loads the last commit back into the same objects. It is a torch ``Stateful``
    (:meth:`state_dict`, :meth:`load_state_dict`): ``torch.distributed.checkpoint`` saves and loads it.

    Args:
        model: a ``torch.nn.Module`` (its parameters and persistent buffers; those a sharded optimizer trains
            are committed as shards, never gathered).
        optimizer: the :class:`distopt.DistOpt` of the job. At ``zero=1|2|3`` each rank commits its shard of the
            state (a collective under :func:`~distopt.elastic.run`: every rank commits at the same step); a
            restore at another world size re-shards it.
        sampler: an :class:`~distopt.elastic.ElasticSampler` (its global position).
        **values: more objects with ``state_dict``/``load_state_dict`` (a second model or DistOpt, a
            scheduler, a GradScaler), or plain values (``epoch=0``: numbers, strings, tensors, plain
            containers) read and written as attributes (``state.epoch += 1``). Values must be the same on
            every rank.

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
        object.__setattr__(self, "_store", None)
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

    @property
    def part_bytes(self) -> int:
        """BYTES of this rank's part of the last commit (0 before the first)."""
        part = self._committed
        return 0 if part is None else part.stat().st_size if isinstance(part, Path) else len(part)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions (no arguments) that :func:`~distopt.elastic.run` calls after restoring a commit into a new
        world, in order: e.g. a learning rate that follows the world size."""
        self._callbacks.extend(callbacks)

    def sharded(self) -> dict[str, Any]:
        """The objects whose state is sharded across the ranks (DistOpts at ``zero=1|2|3``), by name."""
        return {k: v for k, v in self._objects.items() if _sharded(v)}

    def commit(self) -> None:
        """Snapshot the state now. Under :func:`~distopt.elastic.run` the commit is also written to every
        node's shared memory (collective: every rank commits at the same step). Its cost: each sharded
        optimizer's shard and each other object's ``state_dict()``, serialised once, and the writes to tmpfs
        (``benchmarks/elastic.py`` prints it)."""
        seq = self.commits + 1
        part = self._part(seq)
        object.__setattr__(self, "commits", seq)
        try:  # the store streams the part into its file (restore() reads it back, nothing is kept in memory)
            kept = None if self._store is None else self._store(seq, part)
        except Exception:  # not stored (a full /dev/shm): restore() still has it (a regroup's exit passes)
            object.__setattr__(self, "_committed", dumps(part, "distopt.elastic.State"))
            raise
        object.__setattr__(self, "_committed", kept if kept is not None else dumps(part, "distopt.elastic.State"))

    def restore(self) -> None:
        """Load the last commit back (the objects in place, the values replaced), at the same world size.

        Raises:
            RuntimeError: nothing was committed yet.
        """
        if self._committed is None:
            raise RuntimeError("distopt.elastic.State.restore: nothing was committed yet (call state.commit())")
        part = self._committed
        self.load(self.commits, self._rank(), self.parts(), lambda: iter([part]), own=True)

    def _rank(self) -> int:
        opts = self.sharded()
        return next(iter(opts.values())).global_rank if opts else 0

    def parts(self) -> int:
        """How many parts a commit of this state has: the world size with a sharded optimizer, else 1."""
        opts = self.sharded()
        return next(iter(opts.values())).world_size if opts else 1

    def _part(self, seq: int) -> dict[str, Any]:
        """This rank's part of commit ``seq``: its shards, and everything that is not sharded (to serialise in the
        checkpoint format, :func:`~distopt.checkpoint.dump_into`)."""
        sharded = self.sharded()
        skip = {id(p) for opt in sharded.values() for g in opt.param_groups for p in g["params"]}
        return {"format": COMMIT_FORMAT, "seq": seq, "part": self._rank(), "parts": self.parts(),
                "sharded": {k: v.state_dict(sharded=True, params=True) for k, v in sharded.items()},
                "objects": {k: {n: t.detach() for n, t in _module_entries(v, skip).items()}
                            if hasattr(v, "named_parameters") else v.state_dict()
                            for k, v in self._objects.items() if k not in sharded},
                "values": dict(self._values)}

    def load(self, seq: int, part: int, parts: int, read: Callable[[], Iterator[bytes | Path]],
             own: bool = False) -> None:
        """Load commit ``seq``, re-sharding sharded optimizers for this world.

        Args:
            seq: the commit's number.
            part: with ``own``, the one part ``read`` yields (this rank's own, at the same world size).
            parts: the number of parts of the commit.
            read: yields the parts in order, one at a time, each as its bytes or its file; each call is a new pass
                (collective when the reads are: every rank makes the same calls).
            own: ``read`` yields only this rank's own part (:meth:`restore`); it is kept as the last commit.

        Raises:
            ValueError: a part of another commit or layout, or a commit that holds no state for an object
                of this state.
        """
        from ..sharding.shard_state import ShardStream

        first: list[dict[str, Any]] = []

        def records() -> Iterator[dict[str, Any]]:
            for k, raw in enumerate(read()):
                record = loads(raw, f"commit {seq} part {part if own else k}")
                expected = (COMMIT_FORMAT, seq, part if own else k, parts)
                if (record.get("format"), record.get("seq"), record.get("part"), record.get("parts")) != expected:
                    raise ValueError(f"distopt.elastic: a part of commit {seq} is (format, seq, part, parts) "
                                     f"{tuple(record.get(x) for x in ('format', 'seq', 'part', 'parts'))}, "
                                     f"expected {expected}")
                if own:
                    object.__setattr__(self, "_committed", raw)
                del raw  # one part's bytes in memory at a time, not two
                if not first:  # the rest of the state, without its shards (dropped once taken)
                    first.append({key: value for key, value in record.items() if key != "sharded"})
                yield record

        sharded = self.sharded()
        for name, opt in sharded.items():
            stream = (r["sharded"][name] for r in records())
            opt.load_state_dict(next(stream) if own else ShardStream(
                [{"world_size": parts, "rank": k} for k in range(parts)], stream))
        rest = first[0] if first else next(records())
        missing = sorted(set(self._objects) - set(sharded) - set(rest["objects"]))
        if missing:
            raise ValueError(f"distopt.elastic.State: the commit holds no state for {missing}; it was taken of "
                             f"{sorted(rest['objects'])}")
        for name, obj in self._objects.items():
            if name in sharded:
                continue
            saved = rest["objects"][name]
            if hasattr(obj, "named_parameters"):
                import torch

                entries = _module_entries(obj, set())
                with torch.no_grad():
                    for key, value in saved.items():
                        entries[key].copy_(value)
            else:
                obj.load_state_dict(saved)
        self._values.update(rest["values"])
        object.__setattr__(self, "commits", seq)
        if not own:  # this world has no part of its own until its first commit
            object.__setattr__(self, "_committed", None)

    def state_dict(self) -> dict[str, Any]:
        """torch's ``Stateful`` protocol, so that ``torch.distributed.checkpoint`` saves and loads this state
        (``dcp.save({"state": state}, checkpoint_id=...)``), at any world size and ``zero`` stage. Collective.

        Returns:
            ``"model"`` and ``"optimizer"``: what ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives
            for them (whole tensors: a DistOpt at ``zero=1|2|3`` consolidates its state on every rank, and a
            ``zero=3`` model is gathered, unlike :meth:`commit`); every other object's ``state_dict()``;
            ``"values"``: the plain values.
        """
        model, optimizer = self._objects.get("model"), self._objects.get("optimizer")
        out: dict[str, Any] = {k: v.state_dict() for k, v in self._objects.items() if k not in ("model", "optimizer")}
        if model is not None and optimizer is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            out["model"], out["optimizer"] = get_state_dict(model, optimizer)
        elif model is not None or optimizer is not None:
            out["model" if model is not None else "optimizer"] = (model or optimizer).state_dict()
        out["values"] = dict(self._values)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (after ``torch.distributed.checkpoint.load`` filled it): the
        objects in place, the values replaced. Collective.

        Raises:
            ValueError: ``state_dict`` holds no state for an object of this state.
        """
        missing = sorted(set(self._objects) - set(state_dict))
        if missing:
            raise ValueError(f"distopt.elastic.State.load_state_dict: no state for {missing}; it holds "
                             f"{sorted(state_dict)}")
        model, optimizer = self._objects.get("model"), self._objects.get("optimizer")
        if model is not None and optimizer is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(model, optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optimizer"])
        for name, obj in self._objects.items():
            if name not in ("model", "optimizer") or model is None or optimizer is None:
                obj.load_state_dict(state_dict[name])
        self._values.update(state_dict.get("values", {}))

    def _attach(self, store: Callable[[int, dict[str, Any]], Path | None] | None) -> None:
        """Under :func:`~distopt.elastic.run`: what stores each commit's part (:meth:`_part`; collective on every
        rank); it returns the file holding this rank's own part, if it wrote one (:meth:`restore` then reads it, not
        a copy kept in memory)."""
        object.__setattr__(self, "_store", store)

    def _reset(self) -> None:
        for callback in self._callbacks:
            callback()
