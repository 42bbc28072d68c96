"""The one check GPU tests share: skip unless CuPy sees a CUDA device."""
from __future__ import annotations

import pytest


def require_device() -> None:
    """Skip the calling test (or fixture) unless a CUDA device is visible to CuPy."""
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
