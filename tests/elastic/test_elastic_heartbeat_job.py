"""A node that freezes (its connections stay open: no collective fails) is seen by the heartbeat in seconds.

Three nodes of ``--nnodes 2:3`` run ``tests/support/launched/elastic_train.py``; two steps after commit 2 one
node is frozen (SIGSTOP of its worker and its agent, like a cut cable): rank 2's, or rank 0's, whose worker
hosts the job's TCPStore that carries the heartbeat. The two survivors wait in the next step's collective,
which never fails. The first survivor's heartbeat must see rank 2's counter stop (or the store stop
answering) and write its ``PeerLostError`` line within 15 s of the freeze (``lost_after`` 6 s plus a beat),
far from DistOpt's 300-s timeout, and both surviving workers must have ended within those 15 s (the second
by its own heartbeat, by the first one's closed connection, or stopped by its agent, which sees the first
agent back at the rendezvous). torch's rendezvous drops the frozen agent after its keep-alive (3 s here), the
survivors form a world of two from commit 2 and finish bitwise as the reference of that schedule, with every
sample of every epoch used once. The frozen processes are SIGKILLed at the end and no process outlives the
job.
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.elastic.jobs import assert_exactly_once, assert_no_orphans, assert_same_final, resumed_after, start_job
from tests.support.elastic_job import read_steps

pytestmark = [pytest.mark.job, pytest.mark.timeout(300)]

Reference = Callable[[int, int, int], Path]
BOUND = 15.0  # s from the freeze to the first survivor's heartbeat line (lost_after 6 s, a beat 1 s)


def _gone(pid: int) -> bool:
    """``pid`` has exited (no such process, or a zombie its agent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("victim", [2, 0], ids=["rank2", "rank0-store-host"])
def test_a_frozen_node_is_seen_by_the_heartbeat(tmp_path: Path, elastic_reference: Reference, victim: int) -> None:
    job, out = start_job(tmp_path, "out", 3, ["--pause-after-commit", "2", "--pause-ranks", str(victim)],
                         f"freeze-{uuid.uuid4().hex[:8]}")
    message = ("PeerLostError: no heartbeat from rank 2 for " if victim == 2 else
               "PeerLostError: the heartbeat store (rank 0's TCPStore) did not answer for ")
    frozen: tuple[int, int] | None = None
    try:
        frozen = job.freeze_node(out / f"paused.rank{victim}")
        froze = time.monotonic()
        froze_wall = time.time()
        survivors = [a for a in job.agents if a.pid != frozen[1]]
        logs = [out / f"agent{job.agents.index(a)}.log" for a in survivors]
        workers = [int(f.name.split(".")[1]) for f in out.glob("steps.*.jsonl")]
        workers.remove(frozen[0])  # the first world's two surviving workers
        ended: dict[int, float] = {}  # worker pid -> seconds from the freeze to its end
        first_heartbeat = None
        while (len(ended) < 2 or first_heartbeat is None) and time.monotonic() - froze < 60:
            for pid in workers:
                if pid not in ended and _gone(pid):
                    ended[pid] = time.monotonic() - froze
            for log in logs:
                if first_heartbeat is None and message in log.read_text(errors="replace"):
                    first_heartbeat = time.monotonic() - froze
            time.sleep(0.05)
        codes = job.wait(150, survivors)
        os.kill(frozen[0], signal.SIGKILL)
        os.kill(frozen[1], signal.SIGKILL)
        next(a for a in job.agents if a.pid == frozen[1]).wait(10)
        time.sleep(0.5)
        assert_no_orphans(job)
    finally:
        if frozen is not None:
            for pid in frozen:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        job.close()
    assert codes == [0, 0], f"the survivors' agents' exit codes {codes}\n{job.report()}"
    assert first_heartbeat is not None and first_heartbeat < BOUND, \
        f"no survivor wrote {message!r} within {BOUND} s ({first_heartbeat})\n{job.report()}"
    assert len(ended) == 2 and max(ended.values()) < BOUND, \
        f"the surviving workers ended after {ended} s\n{job.report()}"
    rows = read_steps(out)
    starts = [r for r in rows if r["event"] == "start" and r["resumed"] > 0]
    assert len(starts) == 2 and all(r["world"] == 2 and r["commits"] == 2 for r in starts), starts
    assert_exactly_once(rows, 3, 2, 2)
    assert_same_final(out, elastic_reference(3, 2, 2))
    print(f"frozen rank {victim}'s node: first heartbeat line {first_heartbeat:.1f} s after the freeze, both "
          f"survivors' workers ended by {max(ended.values()):.1f} s, the world of two stepped "
          f"{resumed_after(rows, froze_wall):.1f} s after it")
