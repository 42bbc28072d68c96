"""``cupy.cuda.runtime`` stand-in: the device count and CUDA runtime errors."""
from __future__ import annotations

from .. import _state

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "deviceSynchronize"]

_NAMES = {100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
          101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
          400: ("cudaErrorInvalidResourceHandle", "invalid resource handle")}


class CUDARuntimeError(RuntimeError):
    """As CuPy's: ``status`` and a message ``'<name>: <description>'``."""

    def __init__(self, status: int) -> None:
        self.status = status
        name, text = _NAMES.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (type(self), (self.status,))


def _init() -> int:
    """cuInit: counted; raises as the runtime does when no device is visible."""
    _state.counters.cuda_inits += 1
    count = len(_state.visible_devices())
    if count == 0:
        raise CUDARuntimeError(100)
    return count


def getDeviceCount() -> int:
    return _init()


def getDevice() -> int:
    return int(getattr(_state.local, "device", 0))


def setDevice(device: int) -> None:
    if not 0 <= int(device) < _init():
        raise CUDARuntimeError(101)
    _state.local.device = int(device)


def deviceSynchronize() -> None:
    from .streams import synchronize_device

    synchronize_device(getDevice())
