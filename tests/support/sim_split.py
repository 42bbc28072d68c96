"""``Communicator.split`` for the simulated world, as an autouse fixture: import :func:`sim_can_split` into a test
module and its simulated ranks can make process groups."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.support.simworld import SimCommunicator, _Shared

_SPLIT_LOCK = threading.Lock()


def sim_split(self: SimCommunicator, ranks: Any) -> SimCommunicator | None:
    """Stand-in ``Communicator.split`` for the simulated world: the k-th split of a world is one new world."""
    ranks = list(ranks)
    with _SPLIT_LOCK:
        self._splits = getattr(self, "_splits", 0) + 1
        children = self._shared.__dict__.setdefault("children", {})
        shared = children.setdefault((self._splits, tuple(ranks)), _Shared(len(ranks), self._shared.timeout))
    return SimCommunicator(shared, ranks.index(self.rank)) if self.rank in ranks else None


@pytest.fixture(autouse=True)
def sim_can_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give :class:`SimCommunicator` :func:`sim_split` for the test (unless it has a ``split`` of its own)."""
    if not hasattr(SimCommunicator, "split"):
        monkeypatch.setattr(SimCommunicator, "split", sim_split, raising=False)
