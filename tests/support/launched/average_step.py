"""One averaged step under any launcher, with DistOpt() given no arguments.

Rank r's gradient is r + 1, so with lr=1 the parameter becomes -(W + 1) / 2.
Prints ``RESULT [backend, rank, world size, local rank, node rank, p]``.
"""
import json

import numpy as np

import distopt

opt = distopt.DistOpt(distopt.SGD(lr=1.0))
p = np.zeros(3, np.float32)
opt.step([p], [np.full(3, opt.global_rank + 1.0, np.float32)])
print("RESULT " + json.dumps([opt.comm.name, opt.global_rank, opt.world_size, opt.local_rank, p.tolist()]),
      flush=True)
