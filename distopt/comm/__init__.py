"""Communicator backends, chosen by name from a registry.

``create("mpi")`` returns an MPI communicator, ``create("shm", ...)`` the single-node shared-memory one,
``create("nccl", ...)`` NCCL through CuPy, ``create("torch")`` torch.distributed (gloo, NCCL for CUDA tensors) and
``create("single")`` the world of one process; :func:`from_launch` builds one from the launch information instead (each
backend's ``from_launch``). A backend whose optional dependency is missing raises
:class:`~distopt.errors.BackendUnavailableError` naming what to install; there is never a fallback to another backend.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError
from .base import DEFAULT_TIMEOUT, REDUCE_OPS, Communicator

if TYPE_CHECKING:
    from ..launch.ranks import RankInfo
    from ..launch.info import Launch

__all__ = ["Communicator", "create", "from_launch", "backend_class", "BACKENDS", "DEFAULT_TIMEOUT", "REDUCE_OPS"]

#: name -> (module, class, pip requirement that provides the dependency)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "mpi": ("distopt.comm.mpi", "MPICommunicator",
            "mpi4py and an MPI library: pip install 'distopt[mpi]' (with a system MPI) or 'distopt[mpich]' "
            "(MPICH from PyPI too)"),
    "nccl": ("distopt.comm.nccl", "NcclCommunicator",
             "cupy and NCCL: pip install 'distopt[cuda12]' or 'distopt[cuda13]'"),
    "shm": ("distopt.comm.shm", "ShmCommunicator", "nothing beyond numpy (Python >= 3.8)"),
    "torch": ("distopt.comm.torchdist", "TorchCommunicator", "PyTorch: pip install 'distopt[torch]'"),
    "single": ("distopt.comm.single", "SingleCommunicator", "nothing"),
}


def backend_class(name: str) -> type:
    """The class registered under ``name``, its module imported now.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the backend's dependency cannot be imported (the message names what to install).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    module_name, class_name, requirement = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {exc}. It needs {requirement}.") from exc
    return getattr(module, class_name)


def create(name: str, **kwargs: Any) -> Communicator:
    """Build the communicator registered under ``name``.

    Args:
        name: a key of :data:`BACKENDS`.
        **kwargs: passed to the backend's constructor.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the backend's dependency cannot be imported.
    """
    return backend_class(name)(**kwargs)


def from_launch(name: str, launch: Launch) -> tuple[Communicator, RankInfo]:
    """Build the backend ``name`` from the launch information: its class's ``from_launch(launch)``.

    Args:
        name: a key of :data:`BACKENDS`.
        launch: this process's :class:`~distopt.launch.info.Launch`.

    Returns:
        The communicator and this process's ranks.

    Raises:
        ValueError: unknown name, or launch information that does not fit the backend (the message says what fits).
        BackendUnavailableError: the backend's dependency cannot be imported.
    """
    return backend_class(name).from_launch(launch)
