"""distopt: data-parallel training by wrapping your optimizer.

``DistOpt(opt)`` averages gradients across all workers each step (fused all-reduce over MPI, NCCL, shared memory or
torch.distributed), then lets the local optimizer update. ``distopt.init()`` joins the job before any optimizer exists
(e.g. to scale the learning rate by the world size). See the README and ``docs/`` for the launch modes and
strategies."""
from __future__ import annotations

from typing import Any

from .async_collectives import CollectiveHandle
from .checkpoint import load, save
from .compression import Compression
from .data import DistributedSampler, eval_partition_indices, partition, partition_indices
from .errors import (BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError,
                     CommunicatorClosedError, DistOptError)
from .launch.logs import setup_logging
from .opt import DistOpt
from .launch.nccl_id import NcclIdHolder
from .optim import SGD
from .sharding.shard_state import ShardStream
from .comm.groups import Group
from .launch.world import World, init, new_group

__all__ = [
    "DistOpt", "SGD", "NcclIdHolder", "save", "load", "DistributedSampler", "partition", "partition_indices",
    "eval_partition_indices", "DistOptError", "BackendUnavailableError", "CollectiveMismatchError",
    "CollectiveTimeoutError", "CommunicatorClosedError", "setup_logging", "init", "World", "Group", "new_group",
    "CollectiveHandle", "ShardStream", "SyncBatchNorm", "convert_sync_batchnorm", "Compression",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The torch-only names (``SyncBatchNorm``, ``convert_sync_batchnorm``, the module ``distopt.autograd``:
    ``distopt.autograd.all_reduce`` after ``import distopt``), imported on first use (PEP 562), so
    ``import distopt`` does not import torch."""
    if name in ("SyncBatchNorm", "convert_sync_batchnorm"):
        from .torch import sync_batchnorm

        return getattr(sync_batchnorm, name)
    if name == "autograd":  # importlib: ``from . import autograd`` would ask this function again
        import importlib

        return importlib.import_module(f"{__name__}.autograd")
    raise AttributeError(f"module 'distopt' has no attribute {name!r}")
