"""Per-rank output under any launcher: ``[rank r]`` log prefixes, INFO and progress bars from rank 0 only.

:func:`setup_logging` (``distopt.setup_logging()``) finds the rank from the launcher's variables, so it can run before
any communicator exists; :func:`distopt.launch.spawn` sets up the same format in its workers. :func:`progress` shows a
tqdm bar on rank 0 and nothing on the others.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO, TypeVar

from . import ranks

__all__ = ["setup_logging", "rank_filter", "progress", "LOG_FORMAT"]

T = TypeVar("T")

#: The record format: rank, level, logger name, message.
LOG_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def rank_filter(rank: int) -> logging.Filter:
    """A filter that stamps ``record.rank = rank`` on every record it sees (and keeps them all)."""

    class _Stamp(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.rank = rank
            return True

    return _Stamp()


class _Handler(logging.StreamHandler):
    """distopt's rank-tagging handler (so a second setup replaces it instead of adding one)."""


def setup_logging(level: int = logging.INFO, rank: int | None = None, stream: TextIO | None = None) -> int:
    """Send log records to ``stream`` as ``[rank r] LEVEL logger: message``; rank 0 alone below WARNING.

    Idempotent: calling it again replaces its handler on the root logger.

    Args:
        level: the lowest level shown on rank 0 (others: ``max(level, WARNING)``).
        rank: this process's global rank; default: from the launcher's environment variables
            (:func:`distopt.launch.ranks.from_env`), else 0.
        stream: where records go; default ``sys.stderr``.

    Returns:
        The rank used.

    Raises:
        ValueError: the launcher's variables are incomplete or inconsistent.
    """
    if rank is None:
        info = ranks.from_env(os.environ)
        rank = 0 if info is None else info.global_rank
    shown = level if rank == 0 else max(level, logging.WARNING)
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(rank_filter(rank))
    handler.setLevel(shown)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _Handler)] + [handler]
    root.setLevel(shown)
    return rank


def progress(iterable: Iterable[T], rank: int, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable, **kwargs)`` on rank 0; the bare iterable (no bar) on the others.

    Raises:
        ImportError: tqdm is not installed (on every rank alike), naming the extra that installs it.
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError(f"distopt.launch.progress needs tqdm ({exc}): pip install 'distopt[progress]'") from exc
    return tqdm(iterable, **kwargs) if rank == 0 else iterable
