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
from distopt.launch.nccl_id import NcclIdHolder
from tests.support import shm_workers
from tests.support.shm_workers import job_segments, pid_alive

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.mark.unit
def test_nccl_id_holder_pickles():
    holder = NcclIdHolder()
    copy = pickle.loads(pickle.dumps(holder))
    assert copy.job_id == holder.job_id and re.fullmatch(r"[0-9a-f]{32}", holder.job_id)
    assert NcclIdHolder().job_id != holder.job_id
    assert holder.job_id in repr(holder)


@pytest.mark.unit
def test_progress_bar_only_on_rank_0():
    items = [1, 2, 3]
    assert progress(items, rank=1) is items
    assert list(progress(items, rank=0, disable=True)) == items


@pytest.mark.timeout(60)
@pytest.mark.job
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
@pytest.mark.job
def test_killed_worker_reported_with_signal():
    """Rank 1 SIGKILLs itself: reported as killed by SIGKILL; its segments are swept."""
    holder = NcclIdHolder()
    results = multiprocessing.get_context("spawn").Queue()
    with pytest.raises(WorkerFailedError, match="rank 1 was killed by signal SIGKILL") as info:
        spawn(shm_workers.dead_peer_worker, 2, (results,), nccl_id=holder, timeout=50)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert job_segments(holder.job_id) == []


@pytest.mark.timeout(60)
@pytest.mark.job
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
@pytest.mark.job
def test_cli_runs_all_reduce(tmp_path):
    res = _cli(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "rank 0 sum 3" in res.stdout and "rank 1 sum 3" in res.stdout
    job_id = re.search(r"job (\w+)", res.stdout).group(1)
    assert job_segments(job_id) == []


@pytest.mark.timeout(60)
@pytest.mark.job
def test_cli_sets_one_omp_thread_per_process_unless_the_user_did(tmp_path):
    """As torchrun: OMP_NUM_THREADS=1 for each of N > 1 copies when unset (said once on stderr); a value
    the user set is kept."""
    script = tmp_path / "threads.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'omp', os.environ.get('OMP_NUM_THREADS'))\n")
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for extra, want in (({}, "1"), ({"OMP_NUM_THREADS": "3"}, "3")):
        res = subprocess.run([sys.executable, "-m", "distopt.launch", "-n", "2", str(script)], cwd=ROOT,
                             env={**base, "PYTHONPATH": str(ROOT), **extra}, capture_output=True, text=True,
                             timeout=40)
        assert res.returncode == 0, res.stderr
        assert sorted(re.findall(r"rank (\d) omp (\S+)", res.stdout)) == [("0", want), ("1", want)], res.stdout
        assert ("OMP_NUM_THREADS=1 for each of the 2 processes" in res.stderr) == (not extra), res.stderr


@pytest.mark.timeout(60)
@pytest.mark.job
def test_cli_fail_fast(tmp_path):
    start = time.monotonic()
    res = _cli(tmp_path, "fail")
    assert time.monotonic() - start < 30
    assert res.returncode == 3
    assert "rank 1 exited with code 3; terminating the other ranks" in res.stderr


# ------------------------------------------------------------------ H45: the launcher is killed

TRAIN_LOOP = textwrap.dedent("""
    def train(opt, rank, out):
        import os, time
        import numpy as np
        open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
        w = np.zeros(1000, np.float32)
        start, step = time.monotonic(), 0
        while time.monotonic() - start < 60:
            opt.step([w], [np.ones(1000, np.float32)])
            step += 1
            if step == 5:
                open(os.path.join(out, f"ready{rank}"), "w").close()
            time.sleep(0.01)
""")

SPAWN_PARENT = TRAIN_LOOP + textwrap.dedent("""
    import sys
    import distopt
    from distopt.launch import spawn

    def worker(nccl_id, rank, size, out):
        train(distopt.DistOpt(distopt.SGD(lr=0.01), nccl_id=nccl_id, gpu_num=rank, gpu_per_node=size), rank, out)

    if __name__ == "__main__":
        holder = distopt.NcclIdHolder()
        open(sys.argv[1] + "/job", "w").write(holder.job_id)
        spawn(worker, 2, (sys.argv[1],), nccl_id=holder)
""")

CLI_CHILD = TRAIN_LOOP + textwrap.dedent("""
    import os, sys
    import distopt
    opt = distopt.DistOpt(distopt.SGD(lr=0.01))     # no arguments: shm, from the launcher's variables
    assert opt.comm.name == "shm", opt.comm.name
    open(sys.argv[1] + "/job", "w").write(os.environ["DISTOPT_JOB_ID"])
    train(opt, opt.global_rank, sys.argv[1])
""")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` has SIGINT ignored (bit SIGINT - 1 of the SigIgn mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


def _kill_launcher(tmp_path: Path, argv: list[str], sig: int, ignore_sigint: bool = False) -> None:
    """Start the launcher, wait for 5 steps on both ranks, send ``sig`` to it alone; check all ends in time.

    With ``ignore_sigint`` the launcher starts with SIGINT ignored (as under ``nohup``); otherwise it
    inherits this process's disposition (ignored too when pytest runs as a background shell job).
    Either way the ranks must not have SIGINT ignored.
    """
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DISTOPT_TIMEOUT="30", OMP_NUM_THREADS="1")
    parent = subprocess.Popen([sys.executable, *argv, str(tmp_path)], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                              preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint
                              else None)
    try:
        deadline = time.monotonic() + 40
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            if parent.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ranks {[r for r in range(2) if not (tmp_path / f'ready{r}').exists()]} did not take "
                            f"5 steps (launcher exit {parent.poll()}): {parent.stderr.read().decode()[-3000:]}")
            time.sleep(0.05)
        job_id = (tmp_path / "job").read_text()
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        assert [r for r, pid in enumerate(pids) if _ignores_sigint(pid)] == [], "ranks inherit an ignored SIGINT"
        parent.send_signal(sig)
        limit = 15 if sig == signal.SIGKILL else 10
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            parent.poll()
            if parent.returncode is not None and not any(map(_alive, pids)) and not job_segments(job_id):
                return
            time.sleep(0.1)
        alive = [f"rank {r} (pid {pid})" for r, pid in enumerate(pids) if _alive(pid)]
        pytest.fail(f"{limit} s after {signal.Signals(sig).name}: launcher exit {parent.poll()}, still running: "
                    f"{alive or 'none'}, segments left: {job_segments(job_id)}")
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.job
def test_h45_spawn_parent_killed(tmp_path, sig):
    (tmp_path / "parent.py").write_text(SPAWN_PARENT)
    _kill_launcher(tmp_path, ["parent.py"], sig)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.job
def test_h45_cli_launcher_killed(tmp_path, sig):
    (tmp_path / "child.py").write_text(CLI_CHILD)
    _kill_launcher(tmp_path, ["-m", "distopt.launch", "-n", "2", "child.py"], sig)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher", ["spawn", "cli"])
@pytest.mark.job
def test_h45_launcher_with_sigint_ignored_ends_job(tmp_path, launcher):
    """As torchrun: SIGINT ends the job even when the launcher started with SIGINT ignored."""
    script, argv = {"spawn": (SPAWN_PARENT, ["parent.py"]),
                    "cli": (CLI_CHILD, ["-m", "distopt.launch", "-n", "2", "child.py"])}[launcher]
    (tmp_path / argv[-1]).write_text(script)
    _kill_launcher(tmp_path, argv, signal.SIGINT, ignore_sigint=True)
