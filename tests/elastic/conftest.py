"""The reference runs of the torchrun elastic tests, run once per session and schedule (see ``jobs.py``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.elastic.jobs import reference


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, int], Path]:
    """``ref(first, second, commit)``: the out directory of the reference of that schedule (its
    ``final.pt``), run on first use and shared by the tests of the session that need the same one."""
    done: dict[tuple[int, int, int], Path] = {}

    def ref(first: int, second: int, commit: int) -> Path:
        key = (first, second, commit)
        if key not in done:
            done[key] = reference(tmp_path_factory.mktemp(f"ref-{first}-{second}-{commit}"), *key)
        return done[key]

    return ref
