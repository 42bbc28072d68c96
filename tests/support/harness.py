"""Run a pytest suite under ``mpiexec -n N`` with a hard wall-clock limit.

:func:`run_job` runs a fresh job: the inner plugin (``tests/support/mpi/conftest.py``)
of an inner pytest file (``tests/support/mpi/mpi_*.py``) writes, per rank, the test it is
in and ``done`` when the session ends. If the job overruns, every process is
killed and the failure names the ranks that did not finish and the test each
was stuck in. Collectives inside use a short ``DISTOPT_TIMEOUT`` so a desync
turns into an error long before the outer limit. :func:`run_mpi_suite` runs
an inner file on the run-long MPI worker pool instead (no job start-up).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPI_DIR = Path(__file__).resolve().parent / "mpi"


def mpiexec() -> str:
    """Path of the ``mpiexec`` next to this Python (pip's mpich), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install 'distopt[mpich]' or install an MPI runtime")
    return found


@functools.lru_cache(maxsize=1)
def launcher_flags() -> tuple[str, ...]:
    """``-l`` (rank-prefixed lines) for MPICH's Hydra; Open MPI (e.g. on a GPU machine) takes other flags."""
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        return ("--allow-run-as-root", "--oversubscribe")  # no rank prefixes: only exit codes are checked there
    return ("-l",)


def _stall_report(progress: Path, n: int) -> str:
    lines = []
    for r in range(n):
        f = progress / f"rank{r}"
        state = f.read_text().strip() if f.exists() else "never started"
        if state != "done":
            lines.append(f"rank {r} stalled in: {state}")
    return "\n".join(lines) or "all ranks reported done, but mpiexec did not exit"


def mpich_segments() -> set[str]:
    """The names of MPICH's shared-memory segments in /dev/shm (``mpich_shm_*``); empty where there is none."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("mpich_shm_*")} if shm.is_dir() else set()


def remove_orphaned_mpich_segments(before: set[str], min_age_s: float = 10.0) -> list[str]:
    """Unlink the MPICH segments made since ``before`` (:func:`mpich_segments`) that no live process maps
    and that are at least ``min_age_s`` seconds old (a job starting now maps its segment right after making
    it): MPICH cannot remove a segment whose ranks were SIGKILLed, as the fault tests do. Returns their names."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(re.findall(r"/dev/shm/(mpich_shm_\S+)", maps.read_text()))
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    now = time.time()
    orphaned = []
    for name in sorted(mpich_segments() - before - mapped):
        try:
            if now - (Path("/dev/shm") / name).stat().st_mtime >= min_age_s:
                orphaned.append(name)
        except FileNotFoundError:
            continue
    for name in orphaned:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    return orphaned


def run_job(argv: list[str], n: int, timeout: float, *, collective_timeout: float = 20.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n <argv>`` and return the finished process.

    Raises:
        AssertionError: the job overran ``timeout`` seconds; the message names
            the stalled ranks and carries the output tail.
    """
    progress = Path(tempfile.mkdtemp(prefix="distopt-progress-"))
    full_env = dict(os.environ)
    full_env.update({
        "PYTHONPATH": f"{ROOT}{os.pathsep}{full_env.get('PYTHONPATH', '')}",
        "DISTOPT_TEST_PROGRESS": str(progress),
        "DISTOPT_TIMEOUT": str(collective_timeout),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    full_env.update(env or {})
    cmd = [mpiexec(), *launcher_flags(), "-n", str(n), *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        report = _stall_report(progress, n)
        raise AssertionError(
            f"mpiexec -n {n} {' '.join(argv)} overran {timeout:.0f} s\n{report}\n--- output tail ---\n{out[-6000:]}"
        ) from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def rank_streams(out: str) -> dict[int, str]:
    """Demultiplex ``mpiexec -l`` output into one text per rank.

    Hydra labels every chunk it forwards (and every line inside a chunk) with
    ``[R] ``, and chunks of different ranks interleave, even inside one
    line of a traceback; text between two labels belongs to the first.
    """
    parts = re.split(r"\[(\d+)\] ", out)
    streams: dict[int, list[str]] = {}
    for rank, text in zip(parts[1::2], parts[2::2]):
        streams.setdefault(int(rank), []).append(text)
    return {r: "".join(chunks) for r, chunks in streams.items()}


def suite_case(rank: int, comm, suite: str, extra: tuple[str, ...], collective_timeout: float) -> tuple[int, str]:  # noqa: ARG001
    """A pool case (:mod:`tests.support.pool`): run the inner suite ``tests/support/mpi/<suite>`` in this
    rank's worker with ``pytest.main``; returns ``(exit code, the rank's pytest output)``.

    The inner plugin (``tests/support/mpi/conftest.py``) writes the inner test each rank is in to the
    pool's progress file, so an overrun names the stalled ranks and their tests.
    """
    import contextlib
    import io

    import pytest

    argv = ["-q", "-x", "-p", "no:cacheprovider", "-o", "python_files=mpi_*.py", "-rsxX", str(MPI_DIR / suite),
            *extra]
    saved = os.environ.get("DISTOPT_TIMEOUT")
    os.environ["DISTOPT_TIMEOUT"] = str(collective_timeout)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = int(pytest.main(argv))
    finally:
        if saved is None:
            os.environ.pop("DISTOPT_TIMEOUT", None)
        else:
            os.environ["DISTOPT_TIMEOUT"] = saved
    return code, out.getvalue()


def run_mpi_suite(suite: str, n: int, timeout: float = 240.0, *extra: str, collective_timeout: float = 20.0) -> list[str]:
    """Run the inner suite ``tests/support/mpi/<suite>`` on every rank of the ``mpiexec -n n`` worker pool
    (:mod:`tests.support.pool`: start-up paid once per pool, not per suite); the ranks' pytest outputs.

    Fails with every failing rank's output if any rank's suite fails (the pool is then discarded, so
    no message left in flight reaches the next case); an overrun of ``timeout`` seconds fails naming
    the stalled ranks and the inner test each was in.
    """
    from tests.support.pool import discard, run_pooled

    results = run_pooled("mpi", n, "tests.support.harness:suite_case", (suite, tuple(extra), collective_timeout),
                         timeout)
    failed = [(r, out) for r, (code, out) in enumerate(results) if code != 0]
    if failed:
        discard("mpi", n)
    assert not failed, f"{suite} failed at -n {n}:\n" + "\n".join(
        f"--- rank {r} (exit {results[r][0]}) ---\n{out[-6000:]}" for r, out in failed)
    return [out for _, out in results]
