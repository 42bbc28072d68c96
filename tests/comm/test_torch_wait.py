"""A torch CPU wait that outlives its brief first wait: finishing just after it is success, not failure."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from distopt.comm.torchdist import TorchCommunicator  # noqa: E402


class _LateWork:
    """A gloo work that completes just after the brief wait ran out (``fails``: completes with an error)."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.calls = fails, 0

    def wait(self, timeout=None):  # noqa: ANN001
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("Operation timed out!")
        if self.fails:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        return True

    def is_completed(self) -> bool:
        return self.calls >= 1


class _NoStore:
    def post(self, *args) -> None:  # noqa: ANN002
        raise AssertionError("a completed work must not be recorded as a stalled wait")


def _comm() -> TorchCommunicator:
    comm = TorchCommunicator.__new__(TorchCommunicator)  # only the wait's state: no process group needed
    comm.timeout, comm._where = 10.0, _NoStore()
    return comm


@pytest.mark.unit
def test_work_completing_just_after_the_brief_wait_is_a_success():
    """Seen under load at exit of a torchrun job: rank 0 reported step 3's all-reduce as failed although it
    had completed (its peer printed the same parameters)."""
    work = _LateWork(fails=False)
    _comm()._wait_cpu(work, 1, "all_reduce of 8 elements")
    assert work.calls == 2


@pytest.mark.unit
def test_work_failing_after_the_brief_wait_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _comm()._wait_cpu(_LateWork(fails=True), 1, "all_reduce of 8 elements")
