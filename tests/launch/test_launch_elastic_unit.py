"""The elastic mode of ``python -m distopt.launch``, in process: its options, the restart loop on fake copies,
the copies' side (``check_launch``, the growth check after a commit)."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from distopt.elastic import ElasticLaunchError, State, check_launch
from distopt.elastic.regroup import grow_check
from distopt.launch import elastic_agent
from distopt.launch.cli import main
from distopt.launch.elastic_agent import ElasticAgent, ElasticConfig, elastic_config
from distopt.launch.info import GROW_FILE_ENV, JOB_ID_ENV, REGROUP_EXIT, RESTART_COUNT_ENV, RUN_ID_ENV

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ the options

@pytest.mark.parametrize("args, match", [
    (["-n", "2", "--min-np", "3", "--run-id", "j"], r"--min-np must be in \[1, -n\] = \[1, 2\], got 3"),
    (["-n", "2", "--min-np", "0", "--run-id", "j"], r"--min-np must be in \[1, -n\] = \[1, 2\], got 0"),
    (["-n", "3", "--max-np", "2", "--run-id", "j"], r"--max-np must be >= -n \(3\), got 2"),
    (["-n", "2", "--max-np", "4", "--max-restarts", "-1", "--run-id", "j"], "--max-restarts must be >= 0, got -1"),
    (["-n", "2", "--min-np", "1"], "elastic mode needs --run-id ID: it names the run's commits in /dev/shm"),
    (["-n", "2", "--min-np", "1", "--run-id", "a/b"], "--run-id must be a plain name"),
    (["-n", "2", "--min-np", "1", "--run-id", ".."], "--run-id must be a plain name"),
    (["-n", "2", "--max-restarts", "2"], "--max-restarts: elastic mode only; give --min-np and/or --max-np too"),
    (["-n", "2", "--run-id", "j"], "--run-id: elastic mode only"),
    (["-n", "2", "--min-np", "x", "--run-id", "j"], "argument --min-np: invalid int value: 'x'"),
])
def test_cli_refuses_bad_elastic_options(args: list[str], match: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([*args, "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m distopt.launch" in err
    assert re.search(match, err), err


def test_elastic_config_defaults() -> None:
    assert elastic_config(3, None, None, None, None) is None  # fail-fast, as without the options
    assert elastic_config(3, 2, None, None, "job.1") == ElasticConfig(3, 2, 3, 3, "job.1")
    assert elastic_config(2, None, 4, 0, "j") == ElasticConfig(2, 2, 4, 0, "j")


# ------------------------------------------------------------------ the restart loop, on fake copies

class FakeCopy:
    """A copy that runs ``polls`` polls, then exits with ``code`` (None: runs until terminated)."""

    def __init__(self, polls: int, code: int | None) -> None:
        self.polls, self.code, self.returncode = polls, code, None

    def poll(self) -> int | None:
        if self.returncode is None and self.code is not None:
            self.polls -= 1
            if self.polls < 0:
                self.returncode = self.code
        return self.returncode


class Scripted:
    """The agent's ``start`` and ``end``: world ``i`` is ``worlds[i](nproc)``, a list of :class:`FakeCopy`."""

    def __init__(self, worlds: list, on_start: list | None = None) -> None:
        self.worlds, self.on_start = worlds, on_start or []
        self.started: list[tuple[int, str, dict[str, str]]] = []
        self.ended = 0

    def start(self, nproc: int, job_id: str, env: dict[str, str], procs: list, threads: list) -> None:
        i = len(self.started)
        self.started.append((nproc, job_id, env))
        procs.extend(self.worlds[i](nproc))
        if i < len(self.on_start):
            self.on_start[i]()

    def end(self, procs: list, threads: list) -> None:
        self.ended += 1
        for p in procs:
            if p.returncode is None:
                p.returncode = -15


def _agent(config: ElasticConfig, script: Scripted) -> tuple[ElasticAgent, io.StringIO]:
    err = io.StringIO()
    return ElasticAgent(config, script.start, script.end, grace=0.5, err=err), err


def _config(tmp_path: Path, nproc: int, min_np: int, max_np: int, max_restarts: int = 3) -> ElasticConfig:
    return ElasticConfig(nproc, min_np, max_np, max_restarts, "unit", commit_root=tmp_path)


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic_agent, "POLL_S", 0.001)


def test_a_failed_copy_restarts_a_smaller_world(tmp_path: Path) -> None:
    script = Scripted([lambda n: [FakeCopy(0, None), FakeCopy(0, None), FakeCopy(3, -9)],
                       lambda n: [FakeCopy(2, 0) for _ in range(n)]])
    agent, err = _agent(_config(tmp_path, 3, 2, 3), script)
    assert agent.run() == 0
    assert [(n, env[RESTART_COUNT_ENV], env[RUN_ID_ENV]) for n, _, env in script.started] == [
        (3, "0", "unit"), (2, "1", "unit")]
    assert script.started[0][1] != script.started[1][1]  # a fresh job id (fresh segments) per world
    assert script.ended == 2
    text = err.getvalue()
    assert "rank 2 was killed by signal SIGKILL" in text
    assert "restart 1 of --max-restarts 3: a world of 2 copies resumes from the newest commit of run unit" in text
    assert not Path(script.started[0][2][GROW_FILE_ENV]).parent.exists()  # the launcher's temporary directory


def test_below_min_np_stops_with_the_failed_status_and_names_the_commit(tmp_path: Path) -> None:
    commits = tmp_path / "distopt-elastic-unit"
    (commits / "agent-1").mkdir(parents=True)
    (commits / "agent-1" / "commit-5.part0of2.pt").write_bytes(b"x")
    script = Scripted([lambda n: [FakeCopy(0, None), FakeCopy(2, 3)]])
    agent, err = _agent(_config(tmp_path, 2, 2, 2), script)
    assert agent.run() == 3
    text = err.getvalue()
    assert "rank 1 exited with code 3" in text
    assert "1 copy left, below --min-np 2: stopping (exit status 3)" in text
    assert f"commit 5 stays in {commits}: the same command with --run-id unit resumes from it" in text
    assert len(script.started) == 1


def test_max_restarts_bounds_the_failures(tmp_path: Path) -> None:
    fail_last = lambda n: [*(FakeCopy(0, None) for _ in range(n - 1)), FakeCopy(1, -9)]  # noqa: E731
    script = Scripted([fail_last, fail_last])
    agent, err = _agent(_config(tmp_path, 4, 1, 4, max_restarts=1), script)
    assert agent.run() == 128 + 9
    assert [n for n, _, _ in script.started] == [4, 3]
    text = err.getvalue()
    assert "--max-restarts 1 reached (1 restarts used): stopping (exit status 137)" in text
    assert "no commit of run unit in" in text


def test_a_failure_after_a_copy_finished_is_not_restarted(tmp_path: Path) -> None:
    script = Scripted([lambda n: [FakeCopy(1, 0), FakeCopy(4, 1), FakeCopy(0, None)]])
    agent, err = _agent(_config(tmp_path, 3, 1, 3), script)
    assert agent.run() == 1
    assert len(script.started) == 1
    assert "another copy had already finished (exit 0)" in err.getvalue()


def test_sigusr1_grows_the_world_at_the_next_commit(tmp_path: Path) -> None:
    """Two requests, room for one: the world of 2 stops at its commit (REGROUP_EXIT, once the grow file
    exists) and a world of 3 starts, without counting a restart."""
    def stopping(n: int) -> list:
        grow = Path(script.started[-1][2][GROW_FILE_ENV])
        return [GrowCopy(grow) for _ in range(n)]

    class GrowCopy(FakeCopy):
        def __init__(self, grow: Path) -> None:
            super().__init__(0, None)
            self.grow = grow

        def poll(self) -> int | None:
            if self.returncode is None and self.grow.exists():
                self.returncode = REGROUP_EXIT
            return self.returncode

    def ask_twice() -> None:
        agent.requests += 2

    script = Scripted([stopping, lambda n: [FakeCopy(1, 0) for _ in range(n)]], on_start=[ask_twice])
    agent, err = _agent(_config(tmp_path, 2, 2, 3), script)
    assert agent.run() == 0
    assert [(n, env[RESTART_COUNT_ENV]) for n, _, env in script.started] == [(2, "0"), (3, "0")]
    text = err.getvalue()
    assert "SIGUSR1: already 3 copies of --max-np 3; 1 request(s) ignored" in text
    assert "SIGUSR1: growing from 2 to 3 copies at the next commit" in text
    assert "every copy stopped at its commit; starting a world of 3 copies" in text


def test_regroup_exit_without_a_growth_is_a_failure(tmp_path: Path) -> None:
    script = Scripted([lambda n: [FakeCopy(0, None), FakeCopy(1, REGROUP_EXIT)]])
    agent, err = _agent(_config(tmp_path, 2, 2, 2), script)
    assert agent.run() == REGROUP_EXIT
    assert f"rank 1 exited with code {REGROUP_EXIT}" in err.getvalue()


# ------------------------------------------------------------------ the copies' side

def test_check_launch_accepts_the_elastic_launcher() -> None:
    assert check_launch({JOB_ID_ENV: "abc", RUN_ID_ENV: "job9", "RANK": "0"}) == "job9"


def test_check_launch_refuses_the_fail_fast_launcher_naming_the_elastic_options() -> None:
    with pytest.raises(ElasticLaunchError, match="without its elastic mode .--min-np/--max-np and --run-id.") as info:
        check_launch({JOB_ID_ENV: "abc", "RANK": "0"})
    assert "python -m distopt.launch -n 3 --min-np 2 --max-np 4 --run-id JOB train.py" in str(info.value)
    assert "torchrun --nnodes" in str(info.value)


class _Opt:
    global_rank, world_size = 0, 2

    def __init__(self) -> None:
        self.calls = 0

    def broadcast_object(self, obj: object, root: int) -> object:
        assert root == 0
        self.calls += 1
        return obj


def test_grow_check_stops_every_rank_after_the_commit_only_when_asked(tmp_path: Path) -> None:
    assert grow_check(_Opt(), {}) is None  # torchrun, or the fail-fast launcher: no check, no collective
    grow, opt = tmp_path / "grow", _Opt()
    check = grow_check(opt, {GROW_FILE_ENV: str(grow)})
    state = State(epoch=0)
    state._attach(lambda seq, part: check())  # what elastic.run's store calls after the parts are stored
    state.commit()
    assert (state.commits, opt.calls) == (1, 1)
    grow.touch()
    with pytest.raises(SystemExit) as info:
        state.commit()
    assert info.value.code == REGROUP_EXIT
    assert state.commits == 2  # stopped after the commit, not instead of it
