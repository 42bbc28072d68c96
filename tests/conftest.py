"""The test tiers: every test carries exactly one of the markers ``unit``, ``world`` and ``job``.

* ``unit``: in this process, including the simulated world (threads);
* ``world``: real backends (MPI, shared memory, torch.distributed) in worker processes;
* ``job``: a fresh job per test (launchers, faults, the CLI, examples, docs, netsim).

``python -m pytest -q -m unit`` runs the fast tier alone. A test with no
tier marker, or with more than one, fails the collection, naming it. The
inner suites under ``tests/support/mpi/`` are exempt: each runs inside one ``world``
test, under ``mpiexec``.

The tiers run in that order (each in file order). When the ``world`` tier is
selected, its worker pools (:mod:`tests.support.pool`) start right after
the collection, so their start-up (importing PyTorch on every worker)
overlaps the ``unit`` tier instead of the first case of each pool; they
end when the ``job`` tier begins, which does not use them (about 30
processes with PyTorch loaded: their memory goes back to the jobs).

At the end of the run, MPICH's shared-memory segments that the run left in
/dev/shm with no process mapping them (the fault tests SIGKILL MPI ranks,
and MPICH cannot remove those ranks' segments) are removed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

TIERS = ("unit", "world", "job")
#: MPICH's segments in /dev/shm when the run started.
MPICH_BEFORE = pytest.StashKey[set]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cupy", choices=("auto", "real", "standin"), default="auto",
                     help="CuPy of the GPU tests: the installed one (auto, real) or the CPU stand-in in "
                          "tests/standin (standin; also what auto uses where CuPy is not installed)")


def pytest_configure(config: pytest.Config) -> None:
    from tests.support import gpu

    gpu.MODE = config.getoption("--cupy")


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
    items.sort(key=_tier_index)  # stable: file order within a tier


def _tier_index(item: pytest.Item) -> int:
    """The position of ``item``'s tier in :data:`TIERS` (an inner suite's test: its own tier, last)."""
    found = [m.name for m in item.iter_markers() if m.name in TIERS]
    return TIERS.index(found[0]) if found else len(TIERS)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note MPICH's segments in /dev/shm before the run (see :func:`pytest_sessionfinish`); where
    ``PYTHONDONTWRITEBYTECODE`` is set, byte-compile the source once, or every worker process the suite
    starts would compile it again (about 0.2 s each)."""
    from tests.support.harness import ROOT, mpich_segments

    session.stash[MPICH_BEFORE] = mpich_segments()
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        import compileall

        for folder in ("distopt", "tests", "examples", "benchmarks"):
            compileall.compile_dir(str(ROOT / folder), quiet=2, workers=0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    """End the worker pools, then remove the MPICH segments this run left that no process maps."""
    from tests.support.harness import remove_orphaned_mpich_segments
    from tests.support.pool import OWNER_ENV, close_pools

    close_pools()
    if OWNER_ENV not in os.environ:  # the test run itself, not an inner suite inside a pool's worker
        remove_orphaned_mpich_segments(session.stash.get(MPICH_BEFORE, set()))


#: Selected ``world`` tests from which every pool starts at once (a single case starts only its own).
PRESTART_FROM = 20


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the worker pools while the ``unit`` tier runs, when the ``world`` tier (or much of it) is selected."""
    if sum(1 for item in session.items if item.get_closest_marker("world")) >= PRESTART_FROM:
        from tests.support.pool import prestart

        prestart()


#: Set at the first ``job`` test, once the ``world`` tier's pools were closed.
POOLS_CLOSED = pytest.StashKey[bool]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the first ``job`` test: end the ``world`` tier's worker pools (see above)."""
    if item.get_closest_marker("job") and POOLS_CLOSED not in item.session.stash:
        from tests.support.pool import close_pools

        close_pools()
        item.session.stash[POOLS_CLOSED] = True
