"""``cupy.cuda`` stand-in: devices, streams, events, memory pointers; ``nccl`` and ``runtime`` submodules."""
from __future__ import annotations

from . import runtime
from .memory import MemoryPointer, UnownedMemory
from .streams import Device, Event, ExternalStream, Stream, get_current_stream

__all__ = ["Device", "Event", "ExternalStream", "Stream", "get_current_stream", "MemoryPointer", "UnownedMemory",
           "runtime", "is_available"]


def is_available() -> bool:
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False
