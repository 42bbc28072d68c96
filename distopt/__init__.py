"""distopt: data-parallel training by wrapping your optimizer.

``DistOpt(opt)`` averages gradients across all workers each step (fused
all-reduce over MPI, NCCL or shared memory), then lets the local optimizer
update. See the README and ``docs/`` for the launch modes and strategies.
"""
from __future__ import annotations

from .checkpoint import load, save
from .data import DistributedSampler, eval_partition_indices, partition, partition_indices
from .errors import BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError, DistOptError
from .opt import DistOpt
from .nccl_id import NcclIdHolder
from .optim import SGD

__all__ = [
    "DistOpt",
    "SGD",
    "NcclIdHolder",
    "save",
    "load",
    "DistributedSampler",
    "partition",
    "partition_indices",
    "eval_partition_indices",
    "DistOptError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
]
__version__ = "0.1.0"
