"""The job ticket, spawn()'s fail-fast and log forwarding, and the CLI launcher."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distopt.launch import WorkerFailedError, progress, spawn
from distopt.nccl_id import NcclIdHolder
from tests import shm_workers
from tests.shm_workers import job_segments, pid_alive

ROOT = Path(__file__).resolve().parent.parent

CLI_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from distopt.comm.shm import ShmCommunicator

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert os.environ["LOCAL_RANK"] == str(rank) and os.environ["LOCAL_WORLD_SIZE"] == str(size)
    if sys.argv[1:] == ["fail"]:
        if rank == 1:
            sys.exit(3)
        time.sleep(60)
    with ShmCommunicator(rank, size, os.environ["DISTOPT_JOB_ID"], timeout=10) as comm:
        a = np.full(5, rank + 1.0)
        comm.all_reduce(a)
    print(f"rank {rank} sum {a[0]:g} job {os.environ['DISTOPT_JOB_ID']}", flush=True)
""")


def test_nccl_id_holder_pickles():
    holder = NcclIdHolder()
    copy = pickle.loads(pickle.dumps(holder))
    assert copy.job_id == holder.job_id and re.fullmatch(r"[0-9a-f]{32}", holder.job_id)
    assert copy.nccl_id == holder.nccl_id
    assert NcclIdHolder().job_id != holder.job_id
    assert holder.job_id in repr(holder)


def test_progress_bar_only_on_rank_0():
    items = [1, 2, 3]
    assert progress(items, rank=1) is items
    assert list(progress(items, rank=0, disable=True)) == items


@pytest.mark.timeout(60)
def test_fail_fast_h02(tmp_path):
    """Rank 1 raises; ranks 0 and 2 wait in a barrier: spawn raises promptly and reaps all."""
    holder = NcclIdHolder()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        spawn(shm_workers.boom_worker, 3, (str(tmp_path),), nccl_id=holder, timeout=50,
              join_timeout=5)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "ValueError: boom" in err.traceback and "boom_worker" in err.traceback
    assert str(err).startswith("rank 1 raised an exception")
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 3
    assert not [pid for pid in pids if pid_alive(pid)], "worker processes left running"
    assert job_segments(holder.job_id) == []


@pytest.mark.timeout(60)
def test_killed_worker_reported_with_signal():
    """Rank 1 SIGKILLs itself: reported as killed by SIGKILL; its segments are swept."""
    holder = NcclIdHolder()
    results = multiprocessing.get_context("spawn").Queue()
    with pytest.raises(WorkerFailedError, match="rank 1 was killed by signal SIGKILL") as info:
        spawn(shm_workers.dead_peer_worker, 2, (results,), nccl_id=holder, timeout=50)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert job_segments(holder.job_id) == []


@pytest.mark.timeout(60)
def test_log_forwarding_h25c(capfd):
    spawn(shm_workers.log_worker, 3, timeout=50)
    out = capfd.readouterr().out
    assert out.count("INFO distopt: starting on 3 ranks") == 1
    assert "[rank 0] INFO distopt: starting on 3 ranks" in out
    for rank in range(3):
        assert f"[rank {rank}] WARNING distopt: warning from rank {rank}" in out


def _cli(tmp_path: Path, *args: str, timeout: float = 40) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(CLI_SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "distopt.launch", "-n", "2", str(script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
def test_cli_runs_all_reduce(tmp_path):
    res = _cli(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "rank 0 sum 3" in res.stdout and "rank 1 sum 3" in res.stdout
    job_id = re.search(r"job (\w+)", res.stdout).group(1)
    assert job_segments(job_id) == []


@pytest.mark.timeout(60)
def test_cli_fail_fast(tmp_path):
    start = time.monotonic()
    res = _cli(tmp_path, "fail")
    assert time.monotonic() - start < 30
    assert res.returncode == 3
    assert "rank 1 exited with code 3; terminating the other ranks" in res.stderr
