"""H84 and H85 (issue 30, item 7): teardown is bounded on every launcher.

Each test launches one job (its variants run inside it, see the scripts in ``tests/support/faults``)
under a guard; an overrun kills the job and fails naming every rank that did not finish and the
phase it was in (``$DISTOPT_TEST_PROGRESS``, :mod:`tests.support.faults.teardown_progress`).

The jobs spend most of their time asleep (ranks arriving seconds apart, collective timeouts), so the
launches of every selected test start together, each in a thread of its own (the ``launches``
fixture); each test then checks its own jobs' outcomes, and a job's guard still bounds it alone.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.harness import ROOT, rank_streams, run_job

FAULTS = ROOT / "tests" / "support" / "faults"


def _stalled(progress: Path, n: int) -> str:
    states = {r: (progress / f"rank{r}").read_text().strip() if (progress / f"rank{r}").exists() else "never started"
              for r in range(n)}
    return "\n".join(f"rank {r} stalled in: {s}" for r, s in states.items() if s != "done") or \
        "every rank reported done, but the launcher did not exit"


def guarded(argv: list[str], n: int, guard: float) -> tuple[int, str, float]:
    """Run a launcher command line under ``guard`` seconds: (exit code, output, wall seconds).

    Raises:
        AssertionError: the job overran; names the stalled ranks and their phases, with the output tail.
    """
    progress = Path(tempfile.mkdtemp(prefix="distopt-h8x-"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", DISTOPT_TEST_PROGRESS=str(progress))
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=guard)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(argv[-3:])} overran its {guard:.0f} s guard\n{_stalled(progress, n)}\n"
                             f"--- output tail ---\n{out[-4000:]}") from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)
    return proc.returncode, out, time.monotonic() - start


def launch(launcher: str, script: str, *args: str, guard: float) -> tuple[int, dict[int, str], float]:
    """Run ``script`` on 2 ranks under ``launcher``: (exit code, output per rank, wall seconds)."""
    path = str(FAULTS / script)
    if launcher == "mpiexec":
        start = time.monotonic()
        res = run_job([sys.executable, path, *args], n=2, timeout=guard)
        return res.returncode, rank_streams(res.stdout), time.monotonic() - start
    if launcher == "torchrun":
        # --standalone: torchrun binds its own store on a free port and hands it to the ranks, so jobs
        # started together cannot race for a port picked beforehand
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", path, *args]
    else:
        argv = [sys.executable, "-m", "distopt.launch", "-n", "2", path, *args]
    code, out, seconds = guarded(argv, 2, guard)
    return code, {r: out for r in range(2)}, seconds  # the ranks share one stream: lines carry the rank


def _lines(case: str, out: str, rank: int) -> dict[str, str]:
    return dict(re.findall(rf"^{case} {rank} (\S+) (.*?)\s*$", out, re.MULTILINE))


H84_LAUNCHERS = ["mpiexec", "torchrun"]
H85_LAUNCHERS = ["mpiexec", "torchrun", "distopt.launch"]
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _h84(launcher: str) -> tuple:
    """H84's two jobs, one after the other: ``late`` (with ``close``), then ``raise``."""
    return launch(launcher, "h84_async.py", "late", guard=45), launch(launcher, "h84_async.py", "raise", guard=45)


@pytest.fixture(scope="module")
def launches(request):
    """The jobs of the selected tests of this module, started at once: ``(test, launcher) -> future``."""
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    jobs = {}
    for launcher in H84_LAUNCHERS:
        if f"test_h84_async_handle_faults[{launcher}]" in selected and (launcher != "torchrun" or HAVE_TORCH):
            jobs[("h84", launcher)] = (_h84, launcher)
    for launcher in H85_LAUNCHERS:
        if f"test_h85_teardown_with_ranks_arriving_apart[{launcher}]" in selected and (
                launcher != "torchrun" or HAVE_TORCH):
            jobs[("h85", launcher)] = (lambda la: launch(la, "h85_teardown.py", guard=150), launcher)
    pool = ThreadPoolExecutor(max_workers=max(len(jobs), 1))
    yield {key: pool.submit(fn, arg) for key, (fn, arg) in jobs.items()}
    pool.shutdown(wait=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", H84_LAUNCHERS)
@pytest.mark.job
def test_h84_async_handle_faults(launcher, launches):
    """``late`` and ``close`` in one job (guard 45 s, the two variants' 30 s each in one launch); ``raise``
    in a job of its own, which must end within 30 s (it fails: a rank raised)."""
    if launcher == "torchrun":
        pytest.importorskip("torch")
    (code, outs, _), raised_job = launches[("h84", launcher)].result()
    for r in range(2):
        got = _lines("H84", outs[r], r)
        assert code == 0, f"exit code {code}\n{outs[r][-3000:]}"
        raised = got.get("late-raised", "")
        assert re.search(rf"(rank |arrive: ){1 - r}\b", raised), f"rank {r}'s timeout does not name rank {1 - r}: {got}"
        assert "late-closed" in got, got
    assert "close-closed" in _lines("H84", outs[0], 0), outs[0][-3000:]
    code, outs, seconds = raised_job
    assert code != 0 and seconds < 30, f"exit code {code} after {seconds:.0f} s\n{outs[0][-3000:]}"
    assert "ValueError: boom" in outs[1], outs[1][-3000:]


#: The timeout of the DistOpts h85_teardown.py closes, in seconds.
H85_TIMEOUT = 5.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", H85_LAUNCHERS)
@pytest.mark.job
def test_h85_teardown_with_ranks_arriving_apart(launcher, launches):
    """slowclose, asyncclose, order and slowexit in one job: exit 0, every close returns well within the
    60 s guard of a variant (MPI: at most two timeouts per communicator), no leak warning at exit; the
    opposite-order closes take well under one timeout (MPI matches closes by communicator, not by order)."""
    if launcher == "torchrun":
        pytest.importorskip("torch")
    code, outs, _ = launches[("h85", launcher)].result()
    for r in range(2):
        assert code == 0, f"exit code {code}\n{outs[r][-3000:]}"
        got = _lines("H85", outs[r], r)
        assert sorted(got) == ["asyncclose", "order", "slowclose", "slowexit"], f"rank {r}: {got}\n{outs[r][-3000:]}"
        assert all(float(s) < 30 for s in got.values()), f"rank {r}: {got}"
        assert float(got["order"]) < 0.2 * H85_TIMEOUT, f"rank {r}: {got}"
        assert "UCX" not in outs[r] and "Traceback" not in outs[r], outs[r][-3000:]


@pytest.mark.timeout(90)
@pytest.mark.job
def test_close_orders_differing_on_three_ranks_are_prompt():
    """mpiexec, 3 ranks, three DistOpts (timeout 5 s) closed A B C, C B A, C A B: exit 0, and on every rank
    the three closes together take well under one timeout."""
    timeout = 5.0
    res = run_job([sys.executable, str(FAULTS / "close_orders.py"), "--timeout", str(timeout)], n=3, timeout=60)
    outs = rank_streams(res.stdout)
    assert res.returncode == 0, res.stdout[-3000:]
    for r in range(3):
        seconds = _lines("ORDERS", outs.get(r, ""), r).get("closed")
        assert seconds is not None, res.stdout[-3000:]
        assert float(seconds) < 0.2 * timeout, f"rank {r}: the closes took {seconds} s (timeout {timeout:g} s)"
