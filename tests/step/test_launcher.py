"""The engine's launcher: a backend without asynchronous collectives runs its reductions on one worker thread,
and any other collective of the same communicator made meanwhile (the step header, zero=3's gathers and their
checks) goes through that thread too, after the reductions submitted before it, and is complete when the call
returns (two threads interleaving one communicator's calls pair different collectives across ranks)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from distopt.comm.launcher import Launcher


class _Recording:
    """A communicator without ``*_async`` methods that records each call and the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _record(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))

    def reduce_scatter(self, array, counts, op):  # noqa: ARG002
        time.sleep(0.05)  # still running when the next call is made
        self._record("reduce_scatter")
        return array[:counts[0]]

    def all_gather_into(self, array, counts):  # noqa: ARG002
        self._record("all_gather_into")
        return array

    def all_gather(self, array):
        self._record("all_gather")
        return np.stack([array])


class _Native(_Recording):
    def all_gather_into_async(self, array, counts):
        self._record("all_gather_into_async")
        return None


@pytest.mark.unit
def test_threaded_launcher_runs_gathers_and_checks_after_the_reductions_on_its_worker():
    comm = _Recording()
    launch = Launcher(comm)
    started = launch.scatter([2, 2])(np.zeros(4), "sum")
    rows = launch.call(comm.all_gather, np.arange(3))  # submitted while the reduce-scatter still runs
    handle = launch.gather(np.zeros(4), [2, 2])
    assert handle.test() and len(comm.calls) == 3  # complete on return: nothing left on the worker
    started.wait()
    launch.close()
    assert [name for name, _ in comm.calls] == ["reduce_scatter", "all_gather", "all_gather_into"]
    assert comm.calls[1][1] == "distopt-allreduce_0"  # the worker still ran the reduce-scatter
    assert rows.shape == (1, 3)


@pytest.mark.unit
def test_native_launcher_calls_on_the_callers_thread():
    comm = _Native()
    launch = Launcher(comm)
    launch.call(comm.all_gather, np.arange(3))
    launch.gather(np.zeros(4), [2, 2])
    assert comm.calls == [("all_gather", threading.current_thread().name),
                          ("all_gather_into_async", threading.current_thread().name)]


@pytest.mark.unit
def test_threaded_launcher_calls_on_the_callers_thread_once_its_worker_is_idle():
    comm = _Recording()
    launch = Launcher(comm)
    launch.scatter([2, 2])(np.zeros(4), "sum").wait()
    launch.call(comm.all_gather, np.arange(3))
    launch.close()
    assert comm.calls == [("reduce_scatter", "distopt-allreduce_0"), ("all_gather", threading.current_thread().name)]
