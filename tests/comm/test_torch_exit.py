"""At exit, gloo's worker threads get a moment with the GIL before the interpreter finalises (H53)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from distopt.comm import lifecycle, torch_exit  # noqa: E402


@pytest.mark.unit
def test_h53_exit_grace_is_registered_once_to_run_after_the_communicators_close():
    """However many communicators ask, one sleep of GRACE_S runs among the last exit functions (after
    every communicator closed, :func:`~distopt.comm.lifecycle.last_at_exit`)."""
    torch_exit.wait_for_workers_at_exit()
    torch_exit.wait_for_workers_at_exit()
    assert lifecycle._last.count(torch_exit._grace) == 1
    start = time.monotonic()
    torch_exit._grace()
    assert time.monotonic() - start >= torch_exit.GRACE_S
