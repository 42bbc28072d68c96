"""Checkpoints that one rank writes and every rank reads.

``save`` writes the file from global rank 0 only (never one writer per node:
apex #886), atomically (a temporary file in the same directory, then
``os.replace``; the temporary file is removed if the write fails or is
interrupted, a SIGTERM included, and a later save of the same path sweeps
those a killed writer left), creating the parent directory first; every rank returns
only after the file is complete (a barrier), so an immediate ``load`` on any
rank sees the same bytes. State that differs per rank (error-feedback
residuals: ``state_dict()["rank_local"]``) is written by each rank to its
own ``<path>.rank<r>.residuals`` file next to it.

The file format: with PyTorch installed, ``torch.save`` of plain containers,
numbers, strings and tensors (arrays as tensors, :mod:`distopt.portable`),
read back with ``torch.load(weights_only=True, map_location=...)``: no
arbitrary code runs at load time. Without PyTorch, a pickle read by an
unpickler that only rebuilds NumPy arrays and builtin containers. The file
records its format version, the world size and the strategy. NumPy scalars
are stored as numbers and come back as NumPy scalars; any other value the
safe loaders would refuse makes ``save`` fail before a file is written.

Errors are the job's, not one rank's: ``save`` and ``load`` each end with one
small all-gather of every rank's error flag (then, if any rank failed, of
the errors), and then every rank raises the same error, naming the ranks
that failed (``"load on rank 1: checkpoint ... is truncated or corrupt"``; a
damaged residual file is read by its rank only). A file is called "truncated or corrupt" only when
its structure says so (a zip archive that is cut short or fails its CRC
check, a pickle stream that ends early or has unknown opcodes); an intact
file that cannot be loaded is reported with the loader's own error.
"""
from __future__ import annotations

import glob
import io
import logging
import os
import pickle
import pickletools
import signal
import socket
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from .comm.consensus import agree
from .portable import HAVE_TORCH, from_portable, to_portable

__all__ = ["save", "load", "dumps", "dump_into", "loads", "write_atomically", "CHECKPOINT_FORMAT", "TMP_SUFFIX"]

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
               ("numpy", "ndarray"), ("numpy", "dtype"), ("builtins", "complex"), ("collections", "OrderedDict"),
               ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer")}  # numpy >= 2.4

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or module == "numpy.dtypes":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a distopt checkpoint")


def dump_into(payload: Any, what: str, f: BinaryIO) -> None:
    """Write ``payload`` in the checkpoint format (:func:`save`'s) into the open binary file ``f``, streamed: no
    copy of the bytes in memory.

    Raises:
        TypeError: a value the safe loaders would refuse (:func:`~distopt.portable.to_portable`), naming ``what``.
    """
    _dump(to_portable(payload, what), f)


def dumps(payload: Any, what: str) -> bytes:
    """``payload`` in the checkpoint format (:func:`save`'s), as bytes.

    Raises:
        TypeError: a value the safe loaders would refuse (:func:`~distopt.portable.to_portable`), naming ``what``.
    """
    buf = io.BytesIO()
    dump_into(payload, what, buf)
    return buf.getvalue()


def loads(raw: bytes | Path, where: str, map_location: Any = "cpu") -> Any:
    """Read what :func:`dumps` or :func:`dump_into` wrote (``where`` names it in errors), safely (no code runs):
    ``raw`` is its bytes or its file (read from the file, with no copy of its bytes in memory).

    Raises:
        ValueError: truncated or corrupt contents (see :func:`_damage`), or intact but refused by the loader.
        OSError: the file cannot be read.
    """
    size = raw.stat().st_size if isinstance(raw, Path) else len(raw)
    with (open(raw, "rb") if isinstance(raw, Path) else io.BytesIO(raw)) as f:
        zipped = f.read(2) == b"PK"  # torch.save's zip format
        f.seek(0)
        damage = _damage(f, zipped)
        if damage is not None:
            raise ValueError(f"checkpoint {where} is truncated or corrupt ({size} bytes): {damage}")
        f.seek(0)
        try:
            if zipped:
                import torch

                return torch.load(f, map_location=map_location, weights_only=True)
            return _ArraysOnly(f).load()
        except Exception as exc:  # noqa: BLE001 (any loader error of an intact file)
            raise ValueError(f"checkpoint {where} is intact ({size} bytes) but cannot be loaded: "
                             f"{type(exc).__name__}: {exc}") from exc


def _damage(f: BinaryIO, zipped: bool) -> str | None:
    """What is wrong with the structure of a file's contents (``f``, at its start), or None for an intact file.

    A zip archive (torch.save's format) must have its central directory and
    every entry its recorded CRC-32 (torch.load does not check those, and
    none are recorded after ``torch.serialization.set_crc32_options(False)``); a
    pickle stream must be a complete sequence of known opcodes that ends
    with STOP at the file's last byte.
    """
    if zipped:
        try:
            archive = zipfile.ZipFile(f)
            bad = archive.testzip() if any(entry.CRC for entry in archive.infolist()) else None
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            return f"not a complete zip archive ({exc})"
        return None if bad is None else f"entry {bad} fails its CRC-32 check"
    stop = -1
    try:
        for _, _, stop in pickletools.genops(f):
            pass
    except ValueError as exc:
        return f"not a complete pickle stream ({exc})"
    size = f.seek(0, os.SEEK_END)
    return None if stop == size - 1 else f"{size - stop - 1} bytes after the end of the pickle stream"


#: What a rank's error is raised as on every rank (:func:`~distopt.comm.consensus.agree`): its own class
#: when a builtin OSError (FileNotFoundError, IsADirectoryError, ...) or a TypeError, else ValueError.
#: The message lists every failing rank: ``"<save|load> on rank R: message; on rank S: ErrorClass: message"``
#: (the class named where it is not the one raised).
_RAISED_AS = (ValueError, OSError, TypeError)


#: Ends the name of every temporary file a save writes (``.<name>.<host>.<pid>.<random>`` before it).
#: The suffix of :func:`write_atomically`'s temporary files.
TMP_SUFFIX = ".distopt-tmp"


def _sweep(path: Path) -> None:
    """Remove the temporary files earlier saves of ``path`` left (a writer killed by a signal that cannot be
    caught): those whose writer, a process of this host, is gone. Others' (another host's: it cannot tell)
    are left."""
    host = socket.gethostname()
    for old in path.parent.glob(f".{glob.escape(path.name)}.*{TMP_SUFFIX}"):
        parts = old.name[len(path.name) + 2:-len(TMP_SUFFIX)].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):  # a save in progress (this process's own included: another thread's)
            continue
        old.unlink(missing_ok=True)
        log.info("distopt.save: removed %s, the temporary file of an interrupted save", old)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


@contextmanager
def _removed_on_sigterm(tmp: str) -> Iterator[None]:
    """Inside the block, a SIGTERM removes ``tmp`` before the process ends by it (as it would have: the
    default action, re-raised). Only in the main thread, and only while SIGTERM has its default action (a
    handler of the script's own, e.g. a graceful stop, is left alone: its exception unwinds the write)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001
        Path(tmp).unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """The package's one atomic writer: ``write(f)`` fills a temporary file next to ``path`` (flushed and
    fsynced), then ``os.replace`` gives it its name, so a reader sees the whole file or none.

    The temporary file (``.<name>.<host>.<pid>.<random>`` + :data:`TMP_SUFFIX`) is removed when the write
    fails, is interrupted (an exception, SIGINT) or ends by SIGTERM; stale ones of earlier interrupted
    writes of ``path`` by processes no longer alive are swept first. Used by :func:`save` and by the
    elastic commits (:class:`distopt.elastic.snapshot.SnapshotDir`).

    Raises:
        OSError: the directory or the file cannot be written; whatever ``write`` raises.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{socket.gethostname()}.{os.getpid()}.", suffix=TMP_SUFFIX,
                               dir=path.parent)
    try:
        with _removed_on_sigterm(tmp):
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _extras(state: dict[str, Any]) -> dict[str, Any]:
    """Where ``DistOpt.state_dict()`` keeps distopt's own state: under ``"distopt"`` in torch's layout (a
    PyTorch optimizer), at the top for array optimizers."""
    if "distopt" in state:
        state["distopt"] = dict(state["distopt"])
        return state["distopt"]
    return state


def _residual_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank{rank}.residuals")


def save(path: str | os.PathLike, model_state: Any, opt: Any) -> bool:
    """Save ``model_state`` and ``opt.state_dict()``; collective (every rank calls it).

    Args:
        path: file to write (its directory is created if missing).
        model_state: tensors, arrays, NumPy scalars, numbers, strings and
            plain containers (e.g. ``model.state_dict()`` or a list of NumPy
            parameter arrays; arrays come back as arrays, NumPy scalars as
            NumPy scalars). Only rank 0's is written.
        opt: the :class:`~distopt.DistOpt`.

    Returns:
        True on the rank that wrote the checkpoint file (global rank 0).

    Raises:
        TypeError: on every rank, before any file is written: rank 0's
            ``model_state`` holds a value ``torch.load(weights_only=True)``
            could not read back (an object of another class, a named tuple,
            a NumPy datetime64, ...), naming its key and type.
        OSError: on every rank, a file cannot be written on some rank (of
            that error's class, naming the rank and the file).
    """
    path = Path(path)
    state = opt.state_dict()
    residuals = _extras(state).pop("rank_local", {})
    wrote = opt.rank_in_global == 0
    payload, error = None, None
    if wrote:
        try:
            payload = {"format": CHECKPOINT_FORMAT, "world_size": opt.world_size,
                       "strategy": to_portable(dict(opt.strategy.describe()), "strategy"),
                       "model": to_portable(model_state, "model_state"), "opt": state}
        except TypeError as exc:
            error = exc
    agree(opt.comm, {}, call="save", problem=error, kinds=_RAISED_AS)
    rpath = _residual_path(path, opt.rank_in_global)
    try:
        if wrote:
            write_atomically(path, lambda f: _dump(payload, f))
        if residuals:
            write_atomically(rpath, lambda f: _dump(residuals, f))
        else:  # never leave a stale residual file next to a newer checkpoint
            rpath.unlink(missing_ok=True)
    except OSError as exc:
        error = exc
    # also the barrier: every file is complete when it returns
    agree(opt.comm, {}, call="save", problem=error, kinds=_RAISED_AS)
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
        FileNotFoundError: on every rank, no checkpoint at ``path`` on some
            rank (the message names the ranks).
        ValueError: on every rank, a truncated or corrupt checkpoint or
            residual file (on any rank: the message names the rank and the
            file), an intact one the safe loader refuses, or one of another
            format (an older distopt).
    """
    path = Path(path)
    model, error = None, None
    try:
        model = _restore(path, opt, map_location)
    except Exception as exc:  # noqa: BLE001 (raised below, on every rank)
        error = exc
    agree(opt.comm, {}, call="load", problem=error, kinds=_RAISED_AS)
    return model


def _restore(path: Path, opt: Any, map_location: Any) -> Any:
    """This rank's part of :func:`load` (no collective); returns the model state."""
    payload = loads(path, str(path), map_location)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format", 1) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"checkpoint {path} has format {found!r}; this distopt reads format {CHECKPOINT_FORMAT}: "
                         "re-create it with this version")
    state = dict(payload["opt"])
    extras = _extras(state)
    rpath = _residual_path(path, opt.rank_in_global)
    if payload["world_size"] != opt.world_size:
        log.warning("checkpoint %s was written with world size %d, this job has %d: replicated state restored, "
                    "error-feedback residuals start at zero", path, payload["world_size"], opt.world_size)
        extras["rank_local"] = {}
    elif rpath.exists():
        extras["rank_local"] = loads(rpath, str(rpath), map_location)
    else:
        extras["rank_local"] = {}
        log.info("no residual file %s: error-feedback residuals start at zero", rpath)
    opt.load_state_dict(state)
    return from_portable(payload["model"])
