"""Elastic training under torchrun's elastic agent (c10d rendezvous): a node killed, a node added.

Each test runs a real elastic job of ``tests/support/launched/elastic_train.py`` (SGD with momentum at
``zero=0`` and AdamW at ``zero=1``, side by side) and a reference of the same schedule without the fault:
one job of the first world that stops right after the last commit before the change, then a job of the
second world that resumes from that commit. The final parameters must be bitwise equal, and the sampler's
indices of the counted steps (the first world's up to that commit, all of the second world's) must cover
every sample of every epoch exactly once. Every job runs under a wall clock that names the stalled ranks.
"""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.support.elastic_job import ElasticJob, read_steps
from tests.support.harness import ROOT

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

SCRIPT = ROOT / "tests" / "support" / "launched" / "elastic_train.py"
N, EPOCHS, EVERY, COMMIT = 48, 2, 3, 2  # elastic_train.py's sizes; the change comes after commit 2 (step 6)


def _job(base: Path, name: str, nodes: int, args: list[str], run_id: str) -> tuple[ElasticJob, Path]:
    out = base / name
    out.mkdir(parents=True)
    job = ElasticJob(out, SCRIPT, args, nnodes="2:3", run_id=run_id)
    for node in range(nodes):
        job.add_agent(node)
    return job, out


def _reference(base: Path, first: int, second: int) -> Path:
    """``first`` workers up to commit ``COMMIT`` (then they end), ``second`` workers from it; the out dir."""
    run_id = f"ref-{uuid.uuid4().hex[:8]}"
    job, out = _job(base / "ref", "a", first, ["--stop-after-commit", str(COMMIT)], run_id)
    try:
        assert job.wait(120) == [0] * first, job.report()
    finally:
        job.close()
    job, out = _job(base / "ref", "b", second, [], run_id)
    try:
        assert job.wait(120) == [0] * second, job.report()
    finally:
        job.close()
    return out


def _assert_same_final(got: Path, want: Path) -> None:
    a, b = torch.load(got / "final.pt"), torch.load(want / "final.pt")
    for model in ("a", "b"):
        for name, value in b[model].items():
            assert torch.equal(a[model][name], value), f"model {model} {name}: max abs diff " \
                f"{(a[model][name] - value).abs().max().item():.3e}"


def _assert_exactly_once(out: Path, first: int, second: int) -> None:
    rows = [r for r in read_steps(out) if r["event"] == "step"]
    counted = [r for r in rows if r["world"] == first and r["resumed"] == 0 and r["step"] <= COMMIT * EVERY]
    counted += [r for r in rows if r["world"] == second and r["resumed"] == COMMIT]
    rolled_back = [r for r in rows if r["world"] == first and r["step"] > COMMIT * EVERY]
    assert rolled_back, "the first world took no step after the commit: the test did not exercise a rollback"
    for epoch in range(EPOCHS):
        seen = sorted(i for r in counted if r["epoch"] == epoch for i in r["idx"])
        assert seen == list(range(N)), f"epoch {epoch}: samples seen {len(seen)} times in all, " \
            f"duplicates {sorted({i for i in seen if seen.count(i) > 1})}, missing {sorted(set(range(N)) - set(seen))}"


def _assert_restored(out: Path, second: int, alive: range) -> None:
    starts = [r for r in read_steps(out) if r["event"] == "start" and r["resumed"] > 0]
    assert starts and all(r["world"] == second and r["commits"] == COMMIT for r in starts), starts
    for node in alive:  # a killed node's commit stays where it was (its machine is gone, or it rejoins)
        left = list((out.parent / f"node{node}").glob("distopt-elastic-*"))
        assert not left, f"node {node}'s commits outlived the run: {left}"


def test_elastic_kill_one_of_three_matches_reference(tmp_path: Path) -> None:
    job, out = _job(tmp_path / "run", "out", 3, ["--pause-after-commit", str(COMMIT)], f"kill-{uuid.uuid4().hex[:8]}")
    try:
        job.kill_node(out / "paused.rank2")  # rank 2's worker and its agent, SIGKILL
        codes = job.wait(150)
    finally:
        job.close()
    assert sorted(codes) == [-9, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    _assert_restored(out, 2, range(2))
    _assert_exactly_once(out, 3, 2)
    _assert_same_final(out, _reference(tmp_path, 3, 2))


def test_elastic_grow_two_to_three_matches_reference(tmp_path: Path) -> None:
    job, out = _job(tmp_path / "run", "out", 2, ["--pause-after-commit", str(COMMIT), "--pause-ranks", "all"],
                    f"grow-{uuid.uuid4().hex[:8]}")
    try:
        for rank in range(2):
            job.wait_for(out / f"paused.rank{rank}", 90)
        job.add_agent(2)  # a node with no commit of its own: it receives commit 2 by broadcast
        codes = job.wait(150)
    finally:
        job.close()
    assert codes == [0, 0, 0], f"agents' exit codes {codes}\n{job.report()}"
    _assert_restored(out, 3, range(3))
    _assert_exactly_once(out, 2, 3)
    _assert_same_final(out, _reference(tmp_path, 2, 3))


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
