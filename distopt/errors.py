"""Exceptions raised by distopt. Every error that a collective can raise on one rank is raised on every rank that
reaches the same collective, so a job never hangs on a failed check."""
from __future__ import annotations

__all__ = ["DistOptError", "BackendUnavailableError", "CollectiveMismatchError", "CollectiveTimeoutError",
           "CommunicatorClosedError"]


class DistOptError(RuntimeError):
    """Base class of distopt's runtime errors."""


class BackendUnavailableError(DistOptError, ImportError):
    """A communicator backend was asked for but its dependency is missing. distopt never falls back to another backend
    silently; the message names the backend and the package to install."""


class CollectiveMismatchError(DistOptError, ValueError):
    """Ranks called the same collective with different arguments. Raised on every rank, naming the first difference
    (element count, dtype, operation, parameter shape, ...) and the ranks involved."""


class CollectiveTimeoutError(DistOptError, TimeoutError):
    """A collective did not complete before its deadline. The message names the operation, the deadline in seconds and,
    where the backend can tell, the ranks that did not arrive."""


class CommunicatorClosedError(DistOptError, ValueError):
    """A communicator was used after :meth:`close`. Raised at once on the rank that made the call, before anything is
    sent, so every rank that uses its closed communicator gets it without waiting for the others. The message names the
    backend, the rank and the call."""
