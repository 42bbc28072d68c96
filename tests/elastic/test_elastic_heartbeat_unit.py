"""The heartbeat's rule (``distopt.elastic.heartbeat``), in process, with a fake clock and a fake store: a peer
whose counter moves slowly but within ``lost_after`` is not lost, a silent one is, a store that does not answer
is, a stall of this worker itself is not; the threads stop when told and never keep the process alive."""
from __future__ import annotations

import threading
import time

import pytest

from distopt.elastic import run
from distopt.elastic.heartbeat import Heartbeat, PeerWatch, check_lost_after, torchrun_heartbeat

pytestmark = pytest.mark.unit


def test_a_slow_peer_within_lost_after_is_not_lost() -> None:
    watch = PeerWatch([1, 2], lost_after=6.0, now=0.0)
    for t in range(1, 61):  # rank 1 beats every 5 s (slow, but within 6 s); rank 2 every second
        watch.observe({1: t // 5, 2: t}, float(t))
        assert watch.lost(float(t)) == ({}, None), t


def test_a_silent_peer_is_lost_after_lost_after() -> None:
    watch = PeerWatch([1, 2], lost_after=6.0, now=0.0)
    for t in range(1, 20):  # rank 2 stops at t=3 (its last move); rank 1 goes on
        watch.observe({1: t, 2: min(t, 3)}, float(t))
        silent, unread = watch.lost(float(t))
        assert unread is None
        if t < 9:
            assert silent == {}, t
        else:
            assert silent == {2: t - 3.0}, t
            break
    else:
        pytest.fail("rank 2 was never declared lost")


def test_a_peer_that_never_beats_is_lost_after_lost_after() -> None:
    watch = PeerWatch([1], lost_after=3.0, now=10.0)
    for t in (11.0, 12.0):  # add(key, 0) of a key never posted reads 0: not a beat
        watch.observe({1: 0}, t)
        assert watch.lost(t) == ({}, None)
    watch.observe({1: 0}, 13.0)
    assert watch.lost(13.0) == ({1: 3.0}, None)


def test_a_peer_still_starting_is_judged_only_once_armed() -> None:
    watch = PeerWatch([1, 2], lost_after=3.0, now=0.0, armed=False)
    for t in range(1, 20):  # rank 1 beats; rank 2 has not reached its heartbeat (loading data, say)
        watch.observe({1: t, 2: 0}, float(t))  # add(key, 0) of a key never posted reads 0
        assert watch.lost(float(t)) == ({}, None), t
    watch.arm(19.0)  # every rank is past the restore's all-gather, so every rank beats by now
    watch.observe({1: 20, 2: 0}, 21.0)
    assert watch.lost(21.0) == ({}, None)
    watch.observe({1: 22, 2: 0}, 22.0)
    assert watch.lost(22.0) == ({2: 3.0}, None)


def test_a_store_that_does_not_answer_is_a_loss() -> None:
    watch = PeerWatch([1], lost_after=6.0, now=0.0)
    watch.observe({1: 1}, 1.0)
    for t in (2.0, 4.0, 6.0):  # no read succeeds after t=1; the checker looks every 2 s (no stall)
        assert watch.lost(t) == ({}, None)
    silent, unread = watch.lost(7.0)
    assert silent == {} and unread == 6.0  # the peers are judged on fresh reads only: no peer is named


def test_a_stall_of_this_worker_is_not_a_loss() -> None:
    watch = PeerWatch([1], lost_after=6.0, now=0.0)
    watch.observe({1: 1}, 1.0)
    assert watch.lost(1.0) == ({}, None)
    assert watch.lost(20.0) == ({}, None)  # this process did not run for 19 s (the checker woke up late)
    watch.observe({1: 5}, 20.5)  # the peer beat meanwhile
    assert watch.lost(21.0) == ({}, None)
    assert watch.lost(23.0) == ({}, None)


class _Store:
    """A fake store whose peer ``frozen`` stops beating at ``freeze_at`` beats."""

    def __init__(self, frozen: int, freeze_at: int) -> None:
        self.counts: dict[str, int] = {}
        self.frozen, self.freeze_at, self.lock = frozen, freeze_at, threading.Lock()
        self.ticks = 0

    def add(self, key: str, value: int) -> int:
        with self.lock:
            if value:  # this rank's beat: the live peer 1 beats with it, the frozen peer until freeze_at
                self.ticks += 1
                self.counts["distopt-heartbeat/1"] = self.ticks
                self.counts[f"distopt-heartbeat/{self.frozen}"] = min(self.ticks, self.freeze_at)
            self.counts[key] = self.counts.get(key, 0) + value
            return self.counts[key]


def test_heartbeat_threads_report_a_silent_peer_and_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("distopt.elastic.heartbeat.BEAT_S", 0.05)
    lost: list[str] = []
    done = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        done.set()

    hb = Heartbeat(0, 3, 0.5, lambda: _Store(frozen=2, freeze_at=3), on_lost).start()
    hb.arm()
    assert done.wait(10), "the silent rank 2 was never reported"
    hb.stop()
    assert len(lost) == 1 and lost[0].startswith("no heartbeat from rank 2 for ") and "lost_after=0.5 s" in lost[0]

    quiet = Heartbeat(0, 2, 0.5, lambda: _Store(frozen=5, freeze_at=10 ** 9), on_lost).start()
    quiet.arm()
    time.sleep(1.0)  # 10 beats, rank 1 moving every beat: nothing to report
    quiet.stop()
    assert len(lost) == 1
    assert all(t.daemon for t in quiet._threads)
    assert not [t for t in threading.enumerate() if t.name == "distopt-heartbeat-check"]


def test_lost_after_is_validated() -> None:
    assert check_lost_after(None) is None and check_lost_after(6) == 6.0
    for bad in (0, 1.5, -3, float("inf"), float("nan"), True, "6"):
        with pytest.raises(ValueError, match="lost_after"):
            check_lost_after(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lost_after"):
        run(lost_after=1)


def test_no_heartbeat_without_a_torchrun_store() -> None:
    env = {"TORCHELASTIC_RUN_ID": "j", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert torchrun_heartbeat(0, 2, 6.0, env, print) is not None
    assert torchrun_heartbeat(0, 2, None, env, print) is None  # lost_after=None: off
    assert torchrun_heartbeat(0, 1, 6.0, env, print) is None  # a world of one
    assert torchrun_heartbeat(0, 2, 6.0, {"DISTOPT_RUN_ID": "j"}, print) is None  # python -m distopt.launch
