"""Elastic training across simulated machines: each node in a network namespace of its own, on a 1 Gbit/s link.

The nodes of ``--nnodes 2:3`` (``tests/support/elastic_netsim.py``) reach each other and the rendezvous store
(hosted on a fourth namespace, the head) only over the simulated link, by their link addresses, as agents on
separate machines do. Two faults, two steps after commit 2:

- node 2's agent and worker are SIGKILLed;
- node 2's cable is cut (its link taken down): its processes live on, but no packet reaches them or leaves, so
  no connection fails. A survivor's heartbeat must say ``no heartbeat from rank 2`` within 15 s.

In both, the two survivors re-form the world from commit 2 and end bitwise equal to the reference of that
schedule (run on loopback: the network does not change a bit), with every sample of every epoch used once and
no process outliving the job (the cut-off node's processes are killed at the end, as a machine that is
unplugged for good would be by its operator). Needs root with ``ip``, ``tc`` and ``unshare``; skips elsewhere.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.elastic.jobs import assert_exactly_once, assert_no_orphans, assert_same_final, resumed_after, start_job
from tests.support.elastic_job import ElasticJob, read_steps
from tests.support.elastic_netsim import SimNetNodes, why_not

REASON = why_not()
pytestmark = [pytest.mark.job, pytest.mark.timeout(300),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

Reference = Callable[[int, int, int], Path]
BOUND = 15.0  # s from the cut to a survivor's heartbeat line (lost_after 6 s, a beat 1 s)


def _check(out: Path, codes: list[int], want: list[int], elastic_reference: Reference, job: ElasticJob
           ) -> list[dict]:
    """The agents' exit codes are ``want``; the world of two resumed from commit 2 and ended as the reference,
    every sample once. Returns the workers' rows."""
    assert sorted(codes) == want, f"agents' exit codes {codes}\n{job.report()}"
    rows = read_steps(out)
    starts = [r for r in rows if r["event"] == "start" and r["resumed"] > 0]
    assert len(starts) == 2 and all(r["world"] == 2 and r["commits"] == 2 for r in starts), starts
    assert_exactly_once(rows, 3, 2, 2)
    assert_same_final(out, elastic_reference(3, 2, 2))
    return rows


def test_elastic_kill_one_of_three_simulated_machines(tmp_path: Path, elastic_reference: Reference) -> None:
    with SimNetNodes(3) as nodes:
        job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", "2"], f"netkill-{uuid.uuid4().hex[:8]}",
                             network=nodes)
        try:
            pid = int(job.wait_for(out / "paused.rank2", 90).split()[0])
            assert nodes.node_of(pid) == 2, f"rank 2's worker runs in node {nodes.node_of(pid)}, not node 2's namespace"
            job.kill_node(out / "paused.rank2")
            killed = time.time()
            codes = job.wait(150)
            assert_no_orphans(job)
        finally:
            job.close()
    rows = _check(out, codes, [-9, 0, 0], elastic_reference, job)
    print(f"simulated machines, node 2 killed: the world of two stepped {resumed_after(rows, killed):.1f} s later")


def test_elastic_cut_cable_is_seen_by_the_heartbeat(tmp_path: Path, elastic_reference: Reference) -> None:
    message = "PeerLostError: no heartbeat from rank 2 for "
    with SimNetNodes(3) as nodes:
        job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", "2", "--pause-ranks", "2"],
                             f"netcut-{uuid.uuid4().hex[:8]}", network=nodes)
        try:
            pid, agent = (int(v) for v in job.wait_for(out / "paused.rank2", 90).split())
            assert nodes.node_of(pid) == 2, f"rank 2's worker runs in node {nodes.node_of(pid)}, not node 2's namespace"
            nodes.cut(2)
            cut, cut_wall = time.monotonic(), time.time()
            survivors = [a for a in job.agents if a.pid != agent]
            logs = [out / f"agent{job.agents.index(a)}.log" for a in survivors]
            seen = None
            while seen is None and time.monotonic() - cut < 60:
                if any(message in log.read_text(errors="replace") for log in logs):
                    seen = time.monotonic() - cut
                time.sleep(0.05)
            codes = job.wait(150, survivors)
            job.close()  # the cut-off node: its agent and worker are still running, unreachable
            assert_no_orphans(job)
        finally:
            job.close()
    assert seen is not None and seen < BOUND, f"no survivor wrote {message!r} within {BOUND} s ({seen})\n" \
        f"{job.report()}"
    rows = _check(out, codes, [0, 0], elastic_reference, job)
    print(f"simulated machines, node 2's cable cut: heartbeat line {seen:.1f} s later, the world of two stepped "
          f"{resumed_after(rows, cut_wall):.1f} s later")
