"""At exit, give gloo's worker threads a moment with the GIL before the interpreter finalises.

A gloo work holds its tensors (and, when started during ``backward()``, autograd's context object). The worker thread
that ran it (``pt_gloo_runloop``) drops its own reference a moment after the work is marked complete, so it is often the
last holder; when it gets there only once the interpreter is finalising, taking the GIL cancels the thread inside a C++
destructor and the process aborts with ``terminate called without an active exception`` (SIGABRT) after the script
finished correctly (pytorch/pytorch issue 190489; plain DDP shows it too; here 4 of 32 two-rank torchrun jobs beside a
CPU hog, and none of 60 with this grace). Keeping the finished works alive instead would keep a bucket's buffer each
(+90 MiB peak RSS for ``zero=2`` on a 27M-parameter GPT). So :func:`wait_for_workers_at_exit` has the interpreter, at
exit after every communicator closed, sleep :data:`GRACE_S` with the GIL released. It narrows the window; it cannot
close it (nothing in torch tells when a worker let go).
"""
from __future__ import annotations

import time

from .lifecycle import last_at_exit

__all__ = ["GRACE_S", "wait_for_workers_at_exit"]

#: SECONDS the interpreter sleeps at exit, GIL released, once a torch communicator was made.
GRACE_S = 0.1


def _grace() -> None:
    time.sleep(GRACE_S)


def wait_for_workers_at_exit() -> None:
    """Have the interpreter sleep :data:`GRACE_S` at exit (once, however often this is called)."""
    last_at_exit(_grace)
