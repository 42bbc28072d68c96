"""Faults in the recovery itself, under torchrun's elastic agent: a second death while the world re-forms,
a death inside a commit, all nodes but one lost.

Each test runs a real elastic job of ``tests/support/launched/elastic_train.py`` (one torchrun agent per
simulated node, each node with its own commit directory standing for its ``/dev/shm``; see
``tests/elastic/jobs.py``) and, where the job finishes, compares it with the reference of its schedule:
bitwise equal final parameters, every sample of every epoch used once. Every job runs under a wall clock
whose failure names the ranks that stalled (their last logged event) and the agents' log tails; every test
asserts that no agent or worker outlived its job.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from distopt.checkpoint import TMP_SUFFIX

from tests.elastic.jobs import (assert_exactly_once, assert_no_orphans, assert_same_final, node_commits,
                                resumed_after, start_job)
from tests.support.elastic_job import read_steps

pytestmark = [pytest.mark.job, pytest.mark.timeout(300)]

Reference = Callable[[int, int, int], Path]
JOIN_WAIT = 12  # s: DistOpt's timeout in the test of a death before the join (it bounds the wait in the join)
JOIN_TIMEOUT = 5  # s: torchrun's --rdzv-conf join_timeout for the last agent (torch's default: 600)


def _resumed(rows: list[dict]) -> list[dict]:
    """The ``start`` lines of the workers that resumed from a commit. (Not by restart count: torch's agent
    counts a restart only when its own worker failed first, not when another agent re-joined first.)"""
    return [r for r in rows if r["event"] == "start" and r["resumed"] > 0]


def _assert_nothing_in_dev_shm(run_id: str) -> None:
    """The job wrote its commits to the nodes' directories only, not to this machine's /dev/shm."""
    left = list(Path("/dev/shm").glob(f"distopt-elastic-{run_id}*"))
    assert not left, f"the test job wrote to /dev/shm: {left}"


@pytest.mark.parametrize("phase", ["restore", "join"])
def test_second_death_while_the_world_reforms(tmp_path: Path, elastic_reference: Reference, phase: str) -> None:
    """Four nodes; the last rank's node is killed between commits 2 and 3, then, in the world of three that
    the survivors form, that world's last rank's node is killed too: ``restore``, inside
    ``distopt.elastic.run``'s restore (the two others wait in its all-gather: they see the closed connection
    at once); ``join``, before its worker joins the process group (the two others wait in the join: they
    see it at DistOpt's timeout, 12 s here). The last two finish as the reference of four nodes up to commit 2
    and two from it (the world of three took no step); they step within 60 s of the second kill (plus the
    12 s for ``join``): nobody waits for DistOpt's default timeout (300 s). A killed node keeps commit 2."""
    run_id = f"second-{phase}-{uuid.uuid4().hex[:8]}"
    args = ["--pause-after-commit", "2", "--pause-in-rejoin", phase]
    if phase == "join":
        args += ["--timeout", str(JOIN_WAIT)]
    job, out = start_job(tmp_path, "out", 4, args, run_id, nnodes="2:4")
    try:
        job.kill_node(out / "paused.rank3")  # the first death, two steps after commit 2
        job.kill_node(out / f"paused-{phase}.rank2")  # the second, while the world of three forms
        killed = time.time()
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert sorted(codes) == [-9, -9, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    rows = read_steps(out)
    assert not [r for r in rows if r["world"] == 3], "a worker of the world of three got past the restore"
    last = _resumed(rows)
    assert len(last) == 2 and all(r["world"] == 2 and r["commits"] == 2 for r in last), last
    for node, code in enumerate(codes):  # the survivors removed their commits; a killed node keeps commit 2
        kept = node_commits(tmp_path, node)
        if code == 0:
            assert kept == [], f"node {node}'s commits outlived the run: {kept}"
        else:
            assert kept == [f"distopt-elastic-{run_id}/commit-2.part{k}of4.pt" for k in range(4)], kept
    _assert_nothing_in_dev_shm(run_id)
    took = resumed_after(rows, killed)
    bound = 60 + (JOIN_WAIT if phase == "join" else 0)
    assert took < bound, f"the world of two stepped {took:.1f} s after the second kill (bound {bound} s)"
    assert_exactly_once(rows, 4, 2, 2)
    assert_same_final(out, elastic_reference(4, 2, 2))
    print(f"second death at {phase}: the world of two stepped {took:.1f} s after the kill")


def test_death_inside_a_commit_before_it_is_written(tmp_path: Path, elastic_reference: Reference) -> None:
    """Three nodes; the last rank's node is killed inside commit 3 before its AdamW shard is taken, while the
    others wait in the commit's first broadcast: no node holds its part of commit 3, and the two survivors
    resume from commit 2, the previous complete one, as the reference of three nodes up to commit 2 and two
    from it."""
    run_id = f"commit-c-{uuid.uuid4().hex[:8]}"
    job, out = start_job(tmp_path, "out", 3, ["--die-in-commit", "3", "--die-at", "shard"], run_id)
    try:
        job.kill_node(out / "paused-commit.rank2")
        killed = time.time()
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert sorted(codes) == [-9, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    rows = read_steps(out)
    assert not [r for r in rows if r["event"] == "commit" and r["resumed"] == 0 and r["commits"] == 3], \
        "a rank finished commit 3 without the dead rank"
    resumed = _resumed(rows)
    assert len(resumed) == 2 and all(r["world"] == 2 and r["commits"] == 2 for r in resumed), resumed
    for node, code in enumerate(codes):
        if code == 0:
            assert node_commits(tmp_path, node) == [], f"node {node}'s commits outlived the run"
    _assert_nothing_in_dev_shm(run_id)
    assert_exactly_once(rows, 3, 2, 2)
    assert_same_final(out, elastic_reference(3, 2, 2))
    print(f"death in a commit before its shard: the world of two stepped {resumed_after(rows, killed):.1f} s "
          "after the kill")


def test_death_while_writing_a_commit(tmp_path: Path, elastic_reference: Reference) -> None:
    """Three nodes; the last rank's worker is killed (its agent lives) when half of its own part of commit 3
    is written, under the temporary name, after the part was broadcast: the other nodes hold every part of
    commit 3. The three nodes re-form: the killed writer's node holds commit 2, two parts of commit 3 and the
    half-written file, which no rank reads; it receives the missing part by broadcast, and the job ends as the
    reference of three nodes up to commit 3 and three from it. After the node's next commit it keeps that
    commit alone (no half-written file, no older commit)."""
    run_id = f"commit-w-{uuid.uuid4().hex[:8]}"
    job, out = start_job(tmp_path, "out", 3, ["--die-in-commit", "3", "--die-at", "write"], run_id)
    try:
        paused = out / "paused-commit.rank2"
        job.wait_for(paused, 90)
        victim_node = next(r["node"] for r in read_steps(out) if r["rank"] == 2)
        half = [f for f in node_commits(tmp_path, int(victim_node[4:])) if f.endswith(TMP_SUFFIX)]
        job.kill_worker(paused)
        killed = time.time()
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert codes == [0, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    assert len(half) == 1 and f".{paused.read_text().split()[0]}." in half[0], half  # the killed writer's pid
    rows = read_steps(out)
    resumed = _resumed(rows)
    assert len(resumed) == 3 and all(r["world"] == 3 and r["commits"] == 3 for r in resumed), resumed
    after = [r for r in rows if r["event"] == "commit" and r["resumed"] and r["node"] == victim_node]
    assert after and after[0]["files"] == [f"commit-{after[0]['commits']}.part{k}of3.pt" for k in range(3)], \
        f"{victim_node} after its first commit in the new world holds {after[0]['files'] if after else None}"
    for node in range(3):
        assert node_commits(tmp_path, node) == [], f"node {node}'s commits outlived the run"
    _assert_nothing_in_dev_shm(run_id)
    assert_exactly_once(rows, 3, 3, 3, rollback=False)
    assert_same_final(out, elastic_reference(3, 3, 3))
    print(f"death in a commit's write: the world of three stepped {resumed_after(rows, killed):.1f} s "
          "after the kill")


def test_all_but_one_die_then_a_relaunch_resumes(tmp_path: Path, elastic_reference: Reference) -> None:
    """Three nodes of ``--nnodes 2:3``; ranks 1 and 2's nodes are killed two steps after commit 2. The last
    agent, below the minimum, stops within its rendezvous join_timeout (5 s) plus a few seconds, exit code 1,
    its log naming what happened (distopt's line: the commit it keeps and how to resume; torch's
    RendezvousTimeoutError), and leaves no process. Its node keeps commit 2; a relaunch with the same run id
    on that node and a fresh one resumes from it and ends as the reference of three nodes up to commit 2 and
    two from it."""
    run_id = f"last-{uuid.uuid4().hex[:8]}"
    job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", "2", "--pause-ranks", "1,2"], run_id,
                         rdzv_conf={"join_timeout": JOIN_TIMEOUT})
    try:
        job.wait_for(out / "paused.rank1", 90)
        job.kill_node(out / "paused.rank1")
        job.kill_node(out / "paused.rank2")
        killed = time.monotonic()
        codes = job.wait(JOIN_TIMEOUT + 60)
        took = time.monotonic() - killed
        assert_no_orphans(job)
    finally:
        job.close()
    assert sorted(codes) == [-9, -9, 1], f"agents' exit codes {codes}\n{job.report()}"
    last = codes.index(1)
    assert took < JOIN_TIMEOUT + 15, f"the last agent stopped {took:.1f} s after the kills\n{job.report()}"
    log = (out / f"agent{last}.log").read_text(errors="replace")
    for text in ("RendezvousTimeoutError", "lost the world", "fewer nodes than torchrun's --nnodes MIN",
                 f"commit 2 stays in {tmp_path / f'node{last}' / f'distopt-elastic-{run_id}'}",
                 f"--rdzv-id {run_id} resumes from it"):
        assert text in log, f"{text!r} not in the last agent's log:\n{log[-4000:]}"
    kept = node_commits(tmp_path, last)
    assert kept == [f"distopt-elastic-{run_id}/commit-2.part{k}of3.pt" for k in range(3)], kept
    _assert_nothing_in_dev_shm(run_id)

    launched = time.time()
    job, again = start_job(tmp_path, "again", [last, 3], [], run_id, nnodes="2:2")  # node 3: no commit
    try:
        codes = job.wait(150)
        assert_no_orphans(job)
    finally:
        job.close()
    assert codes == [0, 0], f"agents' exit codes {codes}\n{job.report()}"
    rows = read_steps(again)
    starts = _resumed(rows)
    assert len(starts) == 2 and all(r["world"] == 2 and r["commits"] == 2 for r in starts), starts
    fresh = next(r for r in starts if r["node"] == "node3")  # it received commit 2 by broadcast, and keeps it
    assert fresh["files"] == [f"commit-2.part{k}of3.pt" for k in range(3)], fresh["files"]
    assert node_commits(tmp_path, last) == [] and node_commits(tmp_path, 3) == []
    assert_exactly_once(read_steps(out) + rows, 3, 2, 2)
    assert_same_final(again, elastic_reference(3, 2, 2))
    print(f"the last agent stopped {took:.1f} s after the kills (join_timeout {JOIN_TIMEOUT} s); the relaunch "
          f"stepped from commit 2 {resumed_after(rows, launched):.1f} s after it started")
