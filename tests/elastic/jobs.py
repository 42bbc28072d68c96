"""What the torchrun elastic tests share: starting a job of ``elastic_train.py``, its reference run, the checks.

A *schedule* is the worlds a job trained in and the commit it resumed from: ``first`` nodes up to commit
``commit``, then ``second`` nodes from it (worlds that took no step in between do not count). Its
*reference* is two fault-free jobs: ``first`` nodes that stop right after commit ``commit``, then ``second``
nodes with the same run id that resume from that commit. A faulty job of the schedule must end with the
reference's parameters, bit for bit, and its counted steps (the first world's up to the commit, the
second world's from it) must use every sample of every epoch once.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import torch

from tests.support.elastic_job import ElasticJob, read_steps
from tests.support.harness import ROOT

__all__ = ["EPOCHS", "EVERY", "N", "SCRIPT", "assert_exactly_once", "assert_no_orphans", "assert_same_final",
           "node_commits", "reference", "resumed_after", "start_job"]

SCRIPT = ROOT / "tests" / "support" / "launched" / "elastic_train.py"
N, EPOCHS, EVERY = 48, 2, 3  # elastic_train.py's samples, epochs and steps between commits


def start_job(base: Path, name: str, nodes: int | list[int], args: list[str], run_id: str, *,
              nnodes: str = "2:3", **kwargs: object) -> tuple[ElasticJob, Path]:
    """A job of ``elastic_train.py args`` whose workers log to ``base/name``, with one agent per node of
    ``nodes`` (node numbers, or a count: nodes 0 ... count-1; a node's commits are in ``base/node<i>``, so a
    node of an earlier job under ``base`` keeps its commits). ``kwargs`` go to :class:`ElasticJob`
    (``rdzv_conf``, ``max_restarts``). Returns the job (``job.agents[i]`` is the i-th node listed) and its out
    directory."""
    out = base / name
    out.mkdir(parents=True)
    job = ElasticJob(out, SCRIPT, args, nnodes=nnodes, run_id=run_id, **kwargs)  # type: ignore[arg-type]
    for node in (range(nodes) if isinstance(nodes, int) else nodes):
        job.add_agent(node)
    return job, out


def reference(base: Path, first: int, second: int, commit: int) -> Path:
    """Run the reference of the schedule (``first`` nodes up to commit ``commit``, ``second`` nodes from it)
    under ``base``; its second job's out directory (``final.pt``). Each job's world is fixed
    (``--nnodes K:K``), so that no agent that starts late makes a smaller first world."""
    run_id = f"ref-{uuid.uuid4().hex[:8]}"
    job, _ = start_job(base, "a", first, ["--stop-after-commit", str(commit)], run_id, nnodes=f"{first}:{first}")
    try:
        assert job.wait(120) == [0] * first, job.report()
    finally:
        job.close()
    job, out = start_job(base, "b", second, [], run_id, nnodes=f"{second}:{second}")
    try:
        assert job.wait(120) == [0] * second, job.report()
    finally:
        job.close()
    return out


def assert_same_final(got: Path, want: Path) -> None:
    """Both models' final parameters (``final.pt`` of the out directories ``got`` and ``want``) are bitwise
    equal."""
    a, b = torch.load(got / "final.pt"), torch.load(want / "final.pt")
    for model in ("a", "b"):
        for name, value in b[model].items():
            assert torch.equal(a[model][name], value), f"model {model} {name}: max abs diff " \
                f"{(a[model][name] - value).abs().max().item():.3e}"


def assert_exactly_once(rows: list[dict], first: int, second: int, commit: int, *, rollback: bool = True) -> None:
    """The steps of the schedule in ``rows`` (the workers' JSON lines of one job, or of a job and its
    relaunch) use every sample of every epoch once: the first world's (``first`` ranks, a fresh start) up to
    commit ``commit``, and every step of the worlds of ``second`` ranks that resumed from it. With
    ``rollback``, also that the first world did take steps past the commit (else no rollback was
    exercised)."""
    steps = [r for r in rows if r["event"] == "step"]
    counted = [r for r in steps if r["world"] == first and r["resumed"] == 0 and r["step"] <= commit * EVERY]
    counted += [r for r in steps if r["world"] == second and r["resumed"] == commit]
    rolled_back = [r for r in steps if r["world"] == first and r["resumed"] == 0 and r["step"] > commit * EVERY]
    assert rolled_back or not rollback, "the first world took no step after the commit: no rollback exercised"
    for epoch in range(EPOCHS):
        seen = sorted(i for r in counted if r["epoch"] == epoch for i in r["idx"])
        assert seen == list(range(N)), f"epoch {epoch}: {len(seen)} samples used in all, duplicates " \
            f"{sorted({i for i in seen if seen.count(i) > 1})}, missing {sorted(set(range(N)) - set(seen))}"


def assert_no_orphans(job: ElasticJob) -> None:
    """No agent or worker of ``job`` is running any more (call it before :meth:`ElasticJob.close`)."""
    left = job.alive()
    assert not left, "processes of the job outlived it:\n" + "\n".join(left) + f"\n{job.report()}"


def node_commits(base: Path, node: int) -> list[str]:
    """The names in node ``node``'s commit directories (``base/node<node>/distopt-elastic-*/agent-*``, as
    ``distopt-elastic-<run>/<file>``): what the node keeps in its shared memory."""
    return sorted(f"{d.name}/{f.name}" for d in (base / f"node{node}").glob("distopt-elastic-*")
                  for a in d.glob("agent-*") for f in a.iterdir())  # a temporary file's name starts with "."


def resumed_after(rows: list[dict], since: float) -> float:
    """Seconds from ``since`` (a ``time.time()``, e.g. a kill) until every worker that resumed from a commit
    took its first step there: the recovery time the docs quote.

    Raises:
        AssertionError: no worker resumed and stepped.
    """
    firsts: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["event"] == "step" and r["resumed"] > 0 and r["at"] > since:
            key = (r["node"], r["resumed"])
            firsts[key] = min(firsts.get(key, r["at"]), r["at"])
    assert firsts, "no worker stepped after resuming from a commit"
    return max(firsts.values()) - since
