"""The counters behind ``DistOpt.stats``: the step path's own, and those strategies report."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields

__all__ = ["Counters"]


@dataclass
class Counters(Mapping):
    """What this rank's steps did, cumulative since construction (or the last restore).

    Read as attributes or as a read-only mapping (``stats["wire_bytes"]``, ``dict(stats)``). The mapping holds the
    attributes below, then every count a strategy reported with :meth:`add` (for example the sparse strategies'
    ``sparse_entries``, entries this rank selected, and ``sparse_dense_fallbacks``, buckets that travelled densely
    because that moved fewer bytes), in the order first reported. A new strategy names its counts in
    ``Strategy.counter_names`` and reports them; this module does not change.

    Attributes:
        steps: averaged steps applied (skipped ones not included).
        wire_bytes: BYTES this rank handed to the collectives for gradient (or partial parameter) exchange.
        dense_bytes: bytes a dense all-reduce of the same gradients would have handed over.
        buckets_started_in_backward: reductions started before backward returned (overlap).
        skipped_steps: steps skipped on every rank by ``check_finite``.
        wait_seconds: SECONDS this process spent inside the communicator's blocking calls and waits (data movement
            included).
        host_syncs: times the host waited on the device (NCCL without a host control communicator; 0 on CPU
            backends).
        control_collectives: the engine's own small collectives (the step header; the gradient flags when the header
            could not settle a step; the ``check_finite`` vote; a sharded step's vote on its reduced segments being
            finite), not the buckets' reductions.
        gather_bytes: BYTES of parameters all-gathered after sharded updates (``zero=1|2``), or before the forward
            and backward passes that use them (``zero=3``); the buckets' sizes, as ``wire_bytes`` counts a
            reduce-scatter's input.
        optimizer_state_bytes: BYTES of this rank's optimizer state after the last step (-1 where the local optimizer
            cannot tell).
        gradient_bytes: BYTES of gradient memory after the last step: what distopt holds (bucket buffers, reduced
            segments) plus the ``.grad`` tensors of a PyTorch optimizer's parameters.
        parameter_bytes: BYTES of parameter memory a PyTorch optimizer's parameters hold at rest after the last step
            (at ``zero=3``: this rank's segments and the parameters left whole; -1 for an array optimizer, whose
            arrays are the caller's).
        gathered_bytes_peak: BYTES, at most, of full parameters gathered at one time since the previous step
            (``zero=3``; 0 otherwise).
        gathered_bytes: BYTES of full parameters gathered (or being gathered) now (``zero=3``; 0 otherwise).
        step_gather_bytes: BYTES of ``gather_bytes`` added between the end of the previous applied step and the end
            of the last one: what one step gathers (``zero=3``: its forward and backward; ``zero=1|2``: the update's
            all-gather), in the dtype gathered (``param_dtype`` with mixed precision: half of float32's for bfloat16).
        step_wire_bytes: BYTES of ``wire_bytes`` added over the same span: what one step hands to the gradients'
            reductions, in the dtype reduced (``reduce_dtype`` with mixed precision).
    """

    steps: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    buckets_started_in_backward: int = 0
    skipped_steps: int = 0
    wait_seconds: float = 0.0
    host_syncs: int = 0
    control_collectives: int = 0
    gather_bytes: int = 0
    optimizer_state_bytes: int = 0
    gradient_bytes: int = 0
    parameter_bytes: int = 0
    gathered_bytes_peak: int = 0
    gathered_bytes: int = 0
    step_gather_bytes: int = 0
    step_wire_bytes: int = 0
    _marks: tuple[int, int] = field(default=(0, 0), repr=False, compare=False)  # the totals at the last step's end
    _reported: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def add(self, name: str, n: int) -> None:
        """Add ``n`` to the strategy-reported count ``name`` (created at 0; ``n`` may be 0 to create it).

        Raises:
            ValueError: ``name`` is one of the attributes above (set those directly).
        """
        if name in self._own():
            raise ValueError(f"{name!r} is a step counter of its own (an attribute), not a strategy's count")
        self._reported[name] = self._reported.get(name, 0) + int(n)

    def step_done(self) -> None:
        """At the end of an applied step: set ``step_gather_bytes`` and ``step_wire_bytes`` from the totals."""
        self.step_gather_bytes = self.gather_bytes - self._marks[0]
        self.step_wire_bytes = self.wire_bytes - self._marks[1]
        self._marks = (self.gather_bytes, self.wire_bytes)

    def declare(self, names: Iterable[str]) -> None:
        """Make the strategy-reported counts ``names`` read 0 until first reported (e.g. ``Strategy.counter_names``)."""
        for name in names:
            self.add(name, 0)

    def __getitem__(self, name: str) -> float:
        if name in self._reported:
            return self._reported[name]
        if name not in self._own():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter((*self._own(), *self._reported))

    def __len__(self) -> int:
        return len(self._own()) + len(self._reported)

    @classmethod
    def _own(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.name.startswith("_"))

    def state_dict(self) -> dict[str, float]:
        """Every counter as a plain dict (``dict(self)``)."""
        return dict(self)

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore :meth:`state_dict` output: missing attributes start at 0; any other name is a reported count."""
        for name in self._own():
            setattr(self, name, (float if name == "wait_seconds" else int)(state.get(name, 0)))
        self._marks = (self.gather_bytes, self.wire_bytes)
        self._reported = {name: int(value) for name, value in state.items() if name not in self._own()}
