"""The stand-in's configuration and counters (not part of CuPy's API; tests read and set them).

Configuration comes from the environment when the stand-in is imported, so
that worker processes started by a test see the same machine:

* ``CUPY_STANDIN_DEVICES``: GPUs the machine has (default 1); ``CUDA_VISIBLE_DEVICES``
  then filters them as the CUDA runtime does.
* ``CUPY_STANDIN_NCCL``: ``0`` makes ``cupy.cuda.nccl`` behave as when libnccl
  cannot be loaded (``available = False``, no other names).
* ``CUPY_STANDIN_VERSION``: the CuPy major version to imitate, ``13`` or ``14``
  (default 14): the NCCL unique id is a tuple of C ``char`` in 13, ``bytes`` in 14.
* ``CUPY_STANDIN_CHAR``: ``signed`` (x86-64, default) or ``unsigned`` (aarch64),
  the sign of C ``char`` under CuPy 13.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

__all__ = ["config", "counters", "local", "Config", "Counters", "physical_devices", "visible_devices"]


@dataclass
class Config:
    devices: int = int(os.environ.get("CUPY_STANDIN_DEVICES", "1"))
    nccl: bool = os.environ.get("CUPY_STANDIN_NCCL", "1") != "0"
    version: int = int(os.environ.get("CUPY_STANDIN_VERSION", "14"))
    char_signed: bool = os.environ.get("CUPY_STANDIN_CHAR", "signed") != "unsigned"
    #: seconds a blocking wait on a peer lasts before the stand-in gives up (a real GPU would wait forever)
    hang_s: float = float(os.environ.get("CUPY_STANDIN_HANG_S", "120"))


@dataclass
class Counters:
    """What a real GPU would make costly, counted: host synchronisations (a device-to-host copy,
    ``float()``/``int()``/``bool()`` of a device array, a result whose size depends on the data),
    events created (and those with timing on), CUDA initialisations, NCCL bootstrap roots started."""
    host_syncs: int = 0
    events: int = 0
    timing_events: int = 0
    cuda_inits: int = 0
    nccl_roots: int = 0
    sync_sites: list = field(default_factory=list)

    def reset(self) -> None:
        self.__init__()


config = Config()
counters = Counters()
local = threading.local()  # current device (``device``) and stream stack (``streams``), per host thread


def physical_devices() -> int:
    return config.devices


def visible_devices() -> list[int]:
    """Physical ids of the devices this process sees: ``CUDA_VISIBLE_DEVICES`` as CUDA reads it
    (entries up to the first invalid one; an id past the machine's count ends the list)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(config.devices))
    seen: list[int] = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) >= config.devices or int(entry) in seen:
            break
        seen.append(int(entry))
    return seen
