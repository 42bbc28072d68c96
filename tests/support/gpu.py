"""CuPy for the GPU tests: the real one where it is installed (and ``--cupy`` is not ``standin``), else the
CPU stand-in in ``tests/standin`` (a faithful double of the CuPy and NCCL subset distopt uses).

The GPU tests run twice where a device exists (``pytest -m gpu`` and
``pytest -m gpu --cupy standin``), and on the stand-in everywhere else. The
stand-in is imported into this process only (its folder leaves ``sys.path``
right after), with no device until a test asks for some
(:func:`devices`), so the rest of the suite sees a machine without a GPU.
Worker processes get it through :func:`standin_env`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

STANDIN = Path(__file__).resolve().parents[1] / "standin"
ROOT = STANDIN.parents[1]
#: set from the ``--cupy`` option: ``auto`` (real CuPy if installed), ``real`` or ``standin``
MODE = "auto"

__all__ = ["load_cupy", "is_standin", "devices", "require_device", "require_real_device", "standin_env", "run_nccl_world",
           "STANDIN"]


def load_cupy() -> ModuleType:
    """The ``cupy`` module of this run (imported once per process)."""
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    if MODE != "standin" and importlib.util.find_spec("cupy") is not None:
        import cupy

        return cupy
    if MODE == "real":
        pytest.skip("--cupy real: CuPy is not installed", allow_module_level=True)
    sys.path.insert(0, str(STANDIN))
    try:
        import cupy
    finally:
        sys.path.remove(str(STANDIN))
    cupy._state.config.devices = 0  # the rest of the suite runs on a machine without a GPU
    return cupy


def is_standin(cupy: ModuleType | None = None) -> bool:
    return bool(getattr(cupy or load_cupy(), "STANDIN", False))


@contextlib.contextmanager
def devices(count: int = 1, **config: object) -> Iterator[ModuleType]:
    """``count`` GPUs for the body: the stand-in's machine gets them (and ``config``: ``version``,
    ``char_signed``, ``nccl``; counters reset), a real machine must have them (else the test skips)."""
    cupy = load_cupy()
    if not is_standin(cupy):
        if config:
            pytest.skip(f"stand-in only: {sorted(config)}")
        try:
            have = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError:
            have = 0
        if have < count:
            pytest.skip(f"needs {count} CUDA devices, {have} visible")
        yield cupy
        return
    state = cupy._state.config
    saved = dict(vars(state))
    state.devices = count
    for key, value in config.items():
        setattr(state, key, value)
    cupy._state.counters.reset()
    cupy._state.local.__dict__.clear()
    try:
        yield cupy
    finally:
        vars(state).update(saved)
        cupy._state.local.__dict__.clear()


def require_device() -> None:
    """Skip unless CuPy sees a CUDA device (the stand-in's count included)."""
    cupy = load_cupy()
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")


def require_real_device() -> None:
    """Skip unless a real CUDA device is there (tests of CUDA tensors in PyTorch, timings)."""
    if is_standin():
        pytest.skip("needs a real CUDA device (CuPy here is the stand-in)")
    require_device()


def standin_env(devices: int = 1, **config: str) -> dict[str, str]:
    """The environment of a worker process that uses the stand-in: ``PYTHONPATH`` with it first, and its
    machine (``CUPY_STANDIN_DEVICES``, ``CUPY_STANDIN_<KEY>`` for each of ``config``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["CUPY_STANDIN_DEVICES"] = str(devices)
    for key, value in config.items():
        env[f"CUPY_STANDIN_{key.upper()}"] = value
    return env


def run_nccl_world(size: int, fn: Callable[[int, Any], Any], timeout: float = 60.0,
                   comm_timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank, comm)`` on ``size`` threads, each rank on device ``rank`` with an NCCL communicator
    over a simulated control plane (the NCCL id agreed over it, as in a real job); closed after ``fn``.
    Results in rank order; a rank that raised or stalled fails the call, naming it (see
    :func:`tests.support.simworld.run_world`)."""
    from distopt.comm.nccl import NcclCommunicator
    from tests.support.simworld import run_world

    cupy = load_cupy()

    def body(rank: int, control: Any) -> Any:
        cupy.cuda.Device(rank).use()
        comm = NcclCommunicator(rank, size, None, rank, timeout=comm_timeout, control=control)
        try:
            return fn(rank, comm)
        finally:
            comm.close()

    return run_world(size, body, timeout)
