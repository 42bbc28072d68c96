"""H39 on one rank of any launcher: one step, close() twice, then a step, a metric reduction and an
object broadcast must each raise CommunicatorClosedError naming the communicator, within a second.

Then a new DistOpt (three in turn, each closed) works under the same launcher: its step averages.

Prints ``H39 <rank> <backend> ok`` when every check passed.
"""
import sys
import time

import numpy as np

import distopt
from distopt.errors import CommunicatorClosedError

opt = distopt.DistOpt(distopt.SGD(lr=1.0), abort_on_exception=False)
w = np.zeros(4, np.float32)
opt.step([w], [np.ones(4, np.float32)])
opt.close()
opt.close()
for name, call in [("step", lambda: opt.step([w], [np.ones(4, np.float32)])),
                   ("metrics", lambda: opt.all_reduce_metrics({"loss": 1.0})),
                   ("object", lambda: opt.broadcast_object({"a": 1}))]:
    start = time.monotonic()
    try:
        call()
    except CommunicatorClosedError as exc:
        assert f"closed {opt.comm.name} communicator" in str(exc), str(exc)
        assert time.monotonic() - start < 1.0, f"{name}: {time.monotonic() - start:.2f} s"
    else:
        sys.exit(f"{name} after close did not raise")
for again in range(3):
    second = distopt.DistOpt(distopt.SGD(lr=1.0), abort_on_exception=False)
    v = np.zeros(4, np.float32)
    second.step([v], [np.full(4, float(second.global_rank), np.float32)])
    size = second.world_size
    assert np.array_equal(v, np.full(4, -(size - 1) / 2, np.float32)), (again, v)
    second.close()
print(f"H39 {opt.global_rank} {opt.comm.name} ok", flush=True)
