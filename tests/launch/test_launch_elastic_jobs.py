"""The elastic mode of ``python -m distopt.launch`` on real copies: a copy killed, the world grown, the run stopped.

Each test runs ``tests/support/launched/elastic_shm_train.py`` (SGD with momentum at ``zero=0`` and AdamW
at ``zero=1``, side by side, over the shared-memory backend; its commits in the real
``/dev/shm/distopt-elastic-<run id>``) under the elastic launcher, and, where the run finishes, a
reference of the same schedule without the fault: a launch of the first world's size that stops right
after the commit the change resumed from, then a launch of the second world's size with the same run id.
The final parameters must be bitwise equal, and the counted steps (the first world's up to that commit,
the second world's) must use every sample of every epoch once. Every launch runs under a wall clock whose
failure names the ranks that stalled and the launcher's stderr; every test asserts that no copy outlived
the launcher and that no shared-memory segment of any of the run's worlds is left.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.elastic.jobs import EVERY, assert_exactly_once, assert_same_final
from tests.support.harness import ROOT
from tests.support.shm_workers import job_segments

pytestmark = [pytest.mark.job, pytest.mark.timeout(300)]

SCRIPT = ROOT / "tests" / "support" / "launched" / "elastic_shm_train.py"
# elastic_shm_train.py has elastic_train.py's sizes (EVERY: steps between commits), so the torchrun tests' checks apply
COMMIT = 2  # every change comes after commit 2 (step 6)


class Launch:
    """``python -m distopt.launch -n NPROC OPTIONS --run-id RUN_ID elastic_shm_train.py OUT ARGS`` in a session
    of its own; its stderr goes to ``OUT/launcher.err``."""

    def __init__(self, out: Path, nproc: int, options: list[str], args: list[str], run_id: str) -> None:
        out.mkdir(parents=True)
        self.out, self.run_id = out, run_id
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "distopt.launch", "-n", str(nproc), *options, "--run-id", run_id,
               str(SCRIPT), str(out), *args]
        self.err = out / "launcher.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)

    def rows(self) -> list[dict]:
        """Every JSON line the copies wrote, in file order per copy."""
        rows = []
        for f in sorted(self.out.glob("steps.*.jsonl")):
            rows.extend(json.loads(line) for line in f.read_text().splitlines() if line.strip())
        return rows

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def report(self) -> str:
        """Each copy's last logged event (by restart, world and rank), then the launcher's stderr tail."""
        last = {(r["restart"], r["world"], r["rank"]): r for r in self.rows()}
        lines = [f"restart {r} world {w} rank {k}: last {row['event']} at step {row.get('step')}"
                 for (r, w, k), row in sorted(last.items())]
        return "\n".join(lines + ["--- launcher stderr tail ---", self.stderr()[-4000:]])

    def wait_for(self, test: Callable[[], object], what: str, timeout: float) -> None:
        """Poll ``test()`` until true; AssertionError naming ``what`` and the report after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not test():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no {what} after {timeout:.0f} s (launcher status {self.proc.poll()})\n"
                                     f"{self.report()}")
            time.sleep(0.02)

    def paused_pid(self, name: str, timeout: float = 120) -> int:
        path = self.out / name
        self.wait_for(lambda: path.exists() and path.read_text(), name, timeout)
        return int(path.read_text())

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; on overrun everything is killed and an AssertionError names the
        stalled ranks."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            report = self.report()
            self.close()
            raise AssertionError(f"the elastic launch overran {timeout:.0f} s\n{report}") from None

    def alive(self) -> list[str]:
        """``"pid: command line"`` of every process (not a zombie) whose command line names ``out``."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                zombie = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except (OSError, IndexError):
                continue
            if os.fsencode(self.out) in argv and not zombie:
                found.append(f"{proc.name}: {b' '.join(argv).decode(errors='replace')[:300]}")
        return found

    def assert_clean(self) -> None:
        """No copy outlived the launcher; no segment of any world of the run is left in /dev/shm."""
        assert not self.alive(), "processes outlived the launcher:\n" + "\n".join(self.alive())
        jobs = {r["job"] for r in self.rows()}
        assert jobs, self.report()
        left = [name for job in jobs for name in job_segments(job)]
        assert not left, f"shared-memory segments left: {left}"

    def close(self, keep_commits: bool = False) -> None:
        """Kill whatever of the launch still runs (its session); remove the run's commits unless
        ``keep_commits``."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if keep_commits:
            return
        shutil.rmtree(Path("/dev/shm") / f"distopt-elastic-{self.run_id}", ignore_errors=True)


def _run_id(kind: str) -> str:
    return f"shm-{kind}-{uuid.uuid4().hex[:8]}"


def _reference(base: Path, first: int, second: int) -> Path:
    """``first`` copies up to commit ``COMMIT`` (then they end), ``second`` copies from it; the out dir."""
    run_id = _run_id("ref")
    for name, n, args in (("a", first, ["--stop-after-commit", str(COMMIT)]), ("b", second, [])):
        launch = Launch(base / name, n, ["--min-np", str(n)], args, run_id)
        try:
            assert launch.wait(150) == 0, launch.report()
            if name == "b":
                assert {r["resumed"] for r in launch.rows()} == {COMMIT}, launch.report()
        finally:
            launch.close(keep_commits=name == "a")
    return base / "b"


def _first_step_of(rows: list[dict], world: int) -> float:
    """When the last rank of the world of ``world`` copies that resumed took its first step (time.time())."""
    firsts: dict[int, float] = {}
    for r in rows:
        if r["event"] == "step" and r["world"] == world and r["resumed"] > 0:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["at"]), r["at"])
    assert len(firsts) == world, firsts
    return max(firsts.values())


def test_kill_one_of_three_the_two_survivors_match_the_reference(tmp_path: Path) -> None:
    """SIGKILL of rank 2 two steps after commit 2 (ranks 0 and 1 wait in the next step's collectives): the
    launcher ends the world, drops the slot, and a world of 2 resumes from commit 2 (restart 1)."""
    launch = Launch(tmp_path / "run", 3, ["--min-np", "2"], ["--pause-after-commit", str(COMMIT)], _run_id("kill"))
    try:
        pid = launch.paused_pid("paused.rank2")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        status = launch.wait(150)
        launch.assert_clean()
    finally:
        launch.close()
    err = launch.stderr()
    assert status == 0, launch.report()
    assert "rank 2 was killed by signal SIGKILL" in err
    assert "restart 1 of --max-restarts 3: a world of 2 copies resumes from the newest commit" in err
    rows = launch.rows()
    starts = [r for r in rows if r["event"] == "start" and r["resumed"] > 0]
    assert len(starts) == 2 and all((r["world"], r["restart"], r["commits"]) == (2, 1, COMMIT) for r in starts)
    assert [r for r in rows if r["event"] == "step" and r["world"] == 3 and r["step"] > COMMIT * EVERY], \
        "the world of 3 took no step after the commit: no rollback exercised"
    assert not (Path("/dev/shm") / f"distopt-elastic-{launch.run_id}").exists(), "the commits outlived the run"
    assert_exactly_once(rows, 3, 2, COMMIT)
    assert_same_final(launch.out, _reference(tmp_path / "ref", 3, 2))
    print(f"recovery: kill to the last survivor's first step {_first_step_of(rows, 2) - killed:.2f} s (kill to "
          f"the new copies' start {min(r['t0'] for r in starts) - killed:.2f} s, to the last one restored "
          f"{max(r['at'] for r in starts) - killed:.2f} s)")


def test_grow_two_to_three_at_the_next_commit_matches_the_reference(tmp_path: Path) -> None:
    """Both copies hold after step 4 (between commits 1 and 2); SIGUSR1 to the launcher; they go on, stop at
    commit 2 (no step is lost) and a world of 3 resumes from it, as the reference of 2 up to commit 2 and 3
    from it."""
    launch = Launch(tmp_path / "run", 2, ["--max-np", "3"], ["--hold-after-step", str(COMMIT * EVERY - 2)],
                    _run_id("grow"))
    try:
        for rank in range(2):
            launch.paused_pid(f"held.rank{rank}")
        os.kill(launch.proc.pid, signal.SIGUSR1)
        launch.wait_for(lambda: "growing from 2 to 3 copies at the next commit" in launch.stderr(),
                        "growth line on the launcher's stderr", 30)
        go = time.time()
        (launch.out / "go").touch()
        status = launch.wait(150)
        launch.assert_clean()
    finally:
        launch.close()
    err = launch.stderr()
    assert status == 0, launch.report()
    assert "every copy stopped at its commit; starting a world of 3 copies" in err
    rows = launch.rows()
    first = [r for r in rows if r["event"] == "step" and r["world"] == 2]
    assert max(r["step"] for r in first) == COMMIT * EVERY, "the world of 2 went past the commit it stopped at"
    starts = [r for r in rows if r["event"] == "start" and r["resumed"] > 0]
    assert len(starts) == 3 and all((r["world"], r["restart"], r["commits"]) == (3, 0, COMMIT) for r in starts)
    assert_exactly_once(rows, 2, 3, COMMIT, rollback=False)
    assert_same_final(launch.out, _reference(tmp_path / "ref", 2, 3))
    print(f"growth: from the go to the last new rank's first step {_first_step_of(rows, 3) - go:.2f} s (to the "
          f"new copies' start {min(r['t0'] for r in starts) - go:.2f} s, to the last one restored "
          f"{max(r['at'] for r in starts) - go:.2f} s)")


@pytest.mark.parametrize("nproc, options, why", [
    (2, ["--min-np", "2"], "1 copy left, below --min-np 2: stopping (exit status 137)"),
    (3, ["--min-np", "1", "--max-restarts", "0"], "--max-restarts 0 reached (0 restarts used): stopping "
                                                  "(exit status 137)"),
])
def test_a_run_that_cannot_go_on_stops_with_a_clear_message(tmp_path: Path, nproc: int, options: list[str],
                                                            why: str) -> None:
    """The last rank is SIGKILLed after commit 2 where no restart is allowed: the launcher ends the world
    and exits 137 at once, naming the limit; no copy and no segment is left; commit 2 stays in
    /dev/shm/distopt-elastic-<run id>, and the message says how to resume from it."""
    launch = Launch(tmp_path / "run", nproc, options, ["--pause-after-commit", str(COMMIT)], _run_id("stop"))
    commits = Path("/dev/shm") / f"distopt-elastic-{launch.run_id}"
    try:
        pid = launch.paused_pid(f"paused.rank{nproc - 1}")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        status = launch.wait(60)
        took = time.monotonic() - killed
        launch.assert_clean()
        kept = sorted(f.name for f in commits.glob("agent-*/*"))
    finally:
        launch.close()
    err = launch.stderr()
    assert status == 128 + signal.SIGKILL, launch.report()
    assert took < 15, f"the launcher took {took:.1f} s to stop\n{launch.report()}"
    assert f"rank {nproc - 1} was killed by signal SIGKILL" in err
    assert why in err, err
    assert f"commit {COMMIT} stays in {commits}: the same command with --run-id {launch.run_id} resumes" in err
    assert kept == [f"commit-{COMMIT}.part{k}of{nproc}.pt" for k in range(nproc)], kept  # one part per rank
    assert {r["world"] for r in launch.rows()} == {nproc}, "a second world was started"
    print(f"stop: from the kill to the launcher's exit {took:.2f} s")
