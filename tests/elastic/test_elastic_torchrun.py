"""Elastic training under torchrun's elastic agent (c10d rendezvous): a node killed, a node added, two killed.

Each test runs a real elastic job of ``tests/support/launched/elastic_train.py`` (SGD with momentum at
``zero=0`` and AdamW at ``zero=1``, side by side) and a reference of the same schedule without the fault:
one job of the first world that stops right after the last commit before the change, then a job of the
second world that resumes from that commit. The final parameters must be bitwise equal, and the sampler's
indices of the counted steps (the first world's up to that commit, all of the second world's) must cover
every sample of every epoch exactly once. Every job runs under a wall clock that names the stalled ranks,
and no process may outlive it. The jobs and checks are in ``tests/elastic/jobs.py``; each reference runs once
per session (``tests/elastic/conftest.py``), shared with ``test_elastic_recovery_faults.py``.
"""
from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.elastic.jobs import assert_exactly_once, assert_no_orphans, assert_same_final, node_commits, start_job
from tests.support.elastic_job import read_steps

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

COMMIT = 2  # the change comes after commit 2 (step 6)
Reference = Callable[[int, int, int], Path]


def _assert_restored(base: Path, out: Path, second: int, alive: range) -> None:
    starts = [r for r in read_steps(out) if r["event"] == "start" and r["resumed"] > 0]
    assert starts and all(r["world"] == second and r["commits"] == COMMIT for r in starts), starts
    for node in alive:  # a killed node's commit stays where it was (its machine is gone, or it rejoins)
        left = node_commits(base, node)
        assert not left, f"node {node}'s commits outlived the run: {left}"


def test_elastic_kill_one_of_three_matches_reference(tmp_path: Path, elastic_reference: Reference) -> None:
    job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", str(COMMIT)], f"kill-{uuid.uuid4().hex[:8]}")
    try:
        job.kill_node(out / "paused.rank2")  # rank 2's worker and its agent, SIGKILL
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert sorted(codes) == [-9, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    _assert_restored(tmp_path, out, 2, range(2))
    assert_exactly_once(read_steps(out), 3, 2, COMMIT)
    assert_same_final(out, elastic_reference(3, 2, COMMIT))


def test_elastic_grow_two_to_three_matches_reference(tmp_path: Path, elastic_reference: Reference) -> None:
    job, out = start_job(tmp_path, "out", 2, ["--pause-after-commit", str(COMMIT), "--pause-ranks", "all"],
                         f"grow-{uuid.uuid4().hex[:8]}")
    try:
        for rank in range(2):
            job.wait_for(out / f"paused.rank{rank}", 90)
        job.add_agent(2)  # a node with no commit of its own: it receives commit 2 by broadcast
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert codes == [0, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    _assert_restored(tmp_path, out, 3, range(3))
    joined = [r for r in read_steps(out) if r["event"] == "start" and r["node"] == "node2"]
    assert joined and joined[0]["files"] == [f"commit-{COMMIT}.part{k}of2.pt" for k in range(2)], \
        f"the node that joined does not keep the commit it received: {joined}"
    assert_exactly_once(read_steps(out), 2, 3, COMMIT)
    assert_same_final(out, elastic_reference(2, 3, COMMIT))


def test_elastic_nnodes_1_to_3_last_node_goes_on_alone(tmp_path: Path, elastic_reference: Reference) -> None:
    """``--nnodes 1:3``: two of three nodes killed, the last one re-forms a world of one from the commit."""
    job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", str(COMMIT), "--pause-ranks", "1,2"],
                         f"alone-{uuid.uuid4().hex[:8]}", nnodes="1:3")
    try:
        for rank in (1, 2):
            job.kill_node(out / f"paused.rank{rank}")
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert sorted(codes) == [-9, -9, 0], f"agents' exit codes {codes}\n{job.report()}"
    starts = [r for r in read_steps(out) if r["event"] == "start" and r["resumed"] > 0]
    assert len(starts) == 1 and starts[0]["world"] == 1 and starts[0]["commits"] == COMMIT, starts
    assert_exactly_once(read_steps(out), 3, 1, COMMIT)
    assert_same_final(out, elastic_reference(3, 1, COMMIT))


def test_three_agents_sharing_one_hosts_commit_directory_need_no_restart(tmp_path: Path) -> None:
    """Three torchrun agents on one host, their commits in one directory (as in ``/dev/shm`` by default),
    no fault: every commit of every agent goes through (no writer removes another agent's file), no worker
    restarts, and the run's directory is gone at the end."""
    job, out = start_job(tmp_path, "out", 3, [], f"host-{uuid.uuid4().hex[:8]}", nnodes="3:3", max_restarts=0,
                         one_host=True)
    try:
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert codes == [0, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    rows = read_steps(out)
    assert rows and all(r["restart"] == 0 for r in rows), job.report()
    assert sum(r["event"] == "commit" for r in rows) >= 3 * COMMIT, rows
    assert not list((tmp_path / "host").glob("distopt-elastic-*")), "the run's commits outlived it"


def test_elastic_run_under_mpiexec_is_a_clear_error(tmp_path: Path) -> None:
    from tests.support.harness import run_job

    script = tmp_path / "mpi_elastic.py"
    script.write_text(
        "import torch, distopt\nfrom distopt import elastic\n"
        "m = torch.nn.Linear(2, 2)\nopt = distopt.DistOpt(torch.optim.SGD(m.parameters(), lr=0.1), model=m)\n"
        "try:\n    elastic.run(lambda state: None)(elastic.State(model=m, optimizer=opt))\n"
        "except elastic.ElasticLaunchError as exc:\n    print(f'rank {opt.global_rank}: {exc}', flush=True)\n"
        "opt.close()\n")
    proc = run_job([sys.executable, str(script)], 2, 60)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in range(2):
        assert f"rank {rank}: distopt.elastic.run does not work under mpiexec" in proc.stdout, proc.stdout[-3000:]
    assert "torchrun" in proc.stdout
