"""Checkpoints that one rank writes and every rank reads.

``save`` writes the file from global rank 0 only (never one writer per node:
apex #886), atomically (a temporary file in the same directory, then
``os.replace``), creating the parent directory first; every rank returns
only after the file is complete (a barrier), so an immediate ``load`` on any
rank sees the same bytes. State that differs per rank (error-feedback
residuals: ``state_dict()["rank_local"]``) is written by each rank to its
own ``<path>.rank<r>.residuals`` file next to it.

The file format: with PyTorch installed, ``torch.save`` of plain containers,
numbers, strings and tensors (arrays as tensors, :mod:`distopt.portable`),
read back with ``torch.load(weights_only=True, map_location=...)``: no
arbitrary code runs at load time. Without PyTorch, a pickle read by an
unpickler that only rebuilds NumPy arrays and builtin containers. The file
records its format version, the world size and the strategy.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from .portable import HAVE_TORCH, from_portable, to_portable

__all__ = ["save", "load", "CHECKPOINT_FORMAT"]

log = logging.getLogger("distopt")

#: Version of the checkpoint file's layout.
CHECKPOINT_FORMAT = 2


def _dump(payload: Any, f: Any) -> None:
    if HAVE_TORCH:
        import torch

        torch.save(payload, f)
    else:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)


class _ArraysOnly(pickle.Unpickler):
    """Rebuilds builtin containers and NumPy arrays only (files written without PyTorch)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("builtins", "complex"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or module == "numpy.dtypes":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a distopt checkpoint")


def _read(path: Path, map_location: Any) -> Any:
    """Read a file written by :func:`_dump`; any failure becomes a ValueError naming the file."""
    raw = path.read_bytes()
    try:
        if raw.startswith(b"PK"):  # torch.save's zip format
            import torch

            return torch.load(io.BytesIO(raw), map_location=map_location, weights_only=True)
        return _ArraysOnly(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 (every reader error means the same thing here)
        raise ValueError(f"checkpoint {path} is truncated or corrupt ({len(raw)} bytes): "
                         f"{type(exc).__name__}: {exc}") from exc


def _write_atomically(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _residual_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank{rank}.residuals")


def save(path: str | os.PathLike, model_state: Any, opt: Any) -> bool:
    """Save ``model_state`` and ``opt.state_dict()``; collective (every rank calls it).

    Args:
        path: file to write (its directory is created if missing).
        model_state: tensors, arrays, numbers, strings and plain containers
            (e.g. ``model.state_dict()`` or a list of NumPy parameter arrays;
            arrays come back as arrays).
        opt: the :class:`~distopt.DistOpt`.

    Returns:
        True on the rank that wrote the checkpoint file (global rank 0).

    Raises:
        OSError: the file cannot be written (on rank 0; the other ranks then
            time out in the barrier with a CollectiveTimeoutError).
    """
    path = Path(path)
    state = opt.state_dict()
    residuals = state.pop("rank_local", {})
    wrote = opt.rank_in_global == 0
    if wrote:
        _write_atomically(path, {"format": CHECKPOINT_FORMAT, "world_size": opt.world_size,
                                 "strategy": dict(opt.strategy.describe()),
                                 "model": to_portable(model_state), "opt": state})
    if residuals:
        _write_atomically(_residual_path(path, opt.rank_in_global), residuals)
    else:  # never leave a stale residual file next to a newer checkpoint
        _residual_path(path, opt.rank_in_global).unlink(missing_ok=True)
    opt.comm.barrier()
    return wrote


def load(path: str | os.PathLike, opt: Any, map_location: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`save` into ``opt``; returns the model state.

    Every rank reads the same file. At the world size it was written with,
    this rank's residual file is loaded too (missing: residuals start at
    zero, logged). At another world size the replicated state (optimizer,
    counters, partial cursor, sampler) is restored and per-rank state
    (error-feedback residuals) starts at zero, with a warning.

    Args:
        path: the checkpoint file.
        opt: the :class:`~distopt.DistOpt` to restore.
        map_location: where tensors go (``torch.load``'s argument; default
            ``"cpu"``). Arrays saved from NumPy come back as NumPy arrays,
            from CuPy as CuPy arrays where they land on a GPU.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: a truncated or corrupt file, or one of another format
            (an older distopt), on every rank.
    """
    path = Path(path)
    payload = _read(path, map_location)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format", 1) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"checkpoint {path} has format {found!r}; this distopt reads format {CHECKPOINT_FORMAT}: "
                         "re-create it with this version")
    state = dict(payload["opt"])
    rpath = _residual_path(path, opt.rank_in_global)
    if payload["world_size"] != opt.world_size:
        log.warning("checkpoint %s was written with world size %d, this job has %d: replicated state restored, "
                    "error-feedback residuals start at zero", path, payload["world_size"], opt.world_size)
        state["rank_local"] = {}
    elif rpath.exists():
        state["rank_local"] = _read(rpath, map_location)
    else:
        state["rank_local"] = {}
        log.info("no residual file %s: error-feedback residuals start at zero", rpath)
    opt.load_state_dict(state)
    return from_portable(payload["model"])
