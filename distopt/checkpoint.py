"""Checkpoints that one rank writes and every rank reads.

``save`` writes the file from global rank 0 only (never one writer per node:
apex #886), atomically (a temporary file in the same directory, then
``os.replace``), creating the parent directory first; every rank returns
only after the file is complete (a barrier), so an immediate ``load`` on any
rank sees the same bytes. Error-feedback residuals are per rank: each rank
writes its own ``<path>.rank<r>.residuals`` file next to it.
"""
from __future__ import annotations

import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["save", "load"]

log = logging.getLogger("distopt")


def _write_atomically(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
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
        model_state: any picklable object (e.g. ``model.state_dict()`` or a
            list of NumPy parameter arrays).
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
        _write_atomically(path, {"model": model_state, "opt": state, "world_size": opt.world_size})
    if residuals:
        _write_atomically(_residual_path(path, opt.rank_in_global), residuals)
    else:  # never leave a stale residual file next to a newer checkpoint
        _residual_path(path, opt.rank_in_global).unlink(missing_ok=True)
    opt.comm.barrier()
    return wrote


def load(path: str | os.PathLike, opt: Any) -> Any:
    """Load a checkpoint written by :func:`save` into ``opt``; returns the model state.

    Every rank reads the same file; this rank's residual file is loaded if
    present, else its error-feedback residuals start at zero (logged).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: it was written by a job of another world size.
    """
    path = Path(path)
    with open(path, "rb") as f:
        payload = pickle.load(f)
    if payload["world_size"] != opt.world_size:
        raise ValueError(f"checkpoint {path} was written with world size {payload['world_size']}, "
                         f"this job has {opt.world_size}")
    state = dict(payload["opt"])
    rpath = _residual_path(path, opt.rank_in_global)
    if rpath.exists():
        with open(rpath, "rb") as f:
            state["rank_local"] = pickle.load(f)
    else:
        state["rank_local"] = {}
        log.info("no residual file %s: error-feedback residuals start at zero", rpath)
    opt.load_state_dict(state)
    return payload["model"]
