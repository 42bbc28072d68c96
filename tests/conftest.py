"""The test tiers: every test carries exactly one of the markers ``unit``, ``world`` and ``job``.

* ``unit``: in this process, including the simulated world (threads);
* ``world``: real backends (MPI, shared memory, torch.distributed) in worker processes;
* ``job``: a fresh job per test (launchers, faults, the CLI, examples, docs, netsim).

``python -m pytest -q -m unit`` runs the fast tier alone. A test with no
tier marker, or with more than one, fails the collection, naming it. The
inner suites under ``tests/support/mpi/`` are exempt: each runs inside one ``world``
test, under ``mpiexec``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "world", "job")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: ARG001
    wrong = []
    inner = Path(__file__).resolve().parent / "support" / "mpi"
    for item in items:
        if inner in Path(item.path).resolve().parents:
            continue
        found = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(found) != 1:
            wrong.append(f"{item.nodeid}: {found or 'no tier marker'}")
    if wrong:
        raise pytest.UsageError("every test needs exactly one of the markers " + ", ".join(TIERS) + ":\n  "
                                + "\n  ".join(wrong))
