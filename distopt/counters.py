"""The counters behind ``DistOpt.stats``."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields

__all__ = ["Counters"]


@dataclass
class Counters(Mapping):
    """What this rank's steps did, cumulative since construction (or the last restore).

    Read as attributes or, as before, as a read-only mapping (``stats["wire_bytes"]``,
    ``dict(stats)``).

    Attributes:
        steps: averaged steps applied (skipped ones not included).
        wire_bytes: BYTES this rank handed to the collectives for gradient
            (or partial parameter) exchange.
        dense_bytes: bytes a dense all-reduce of the same gradients would
            have handed over.
        sparse_entries: entries the sparse strategy selected on this rank.
        sparse_dense_fallbacks: sparse buckets that travelled densely
            because that moved fewer bytes.
        buckets_started_in_backward: reductions started before backward
            returned (overlap).
        skipped_steps: steps skipped on every rank by ``check_finite``.
        wait_seconds: SECONDS this process spent inside the communicator's
            blocking calls and waits (data movement included).
        host_syncs: times the host waited on the device (NCCL without a
            host control communicator; 0 on CPU backends).
        control_collectives: the engine's own small collectives (the step
            header; the gradient flags when the header could not settle a
            step; the ``check_finite`` vote), not the buckets' reductions.
    """

    steps: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    sparse_entries: int = 0
    sparse_dense_fallbacks: int = 0
    buckets_started_in_backward: int = 0
    skipped_steps: int = 0
    wait_seconds: float = 0.0
    host_syncs: int = 0
    control_collectives: int = 0

    def __getitem__(self, name: str) -> float:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def state_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore :meth:`state_dict` output (missing counters start at 0)."""
        for f in fields(self):
            setattr(self, f.name, (float if f.name == "wait_seconds" else int)(state.get(f.name, 0)))
