"""torch.distributed's default process group over an MPI world, for the DDP habits of a script under mpiexec.

Under ``mpiexec`` nothing sets ``MASTER_ADDR``/``MASTER_PORT``, so a ported DDP script's own torch.distributed calls
(``DistributedSampler``, ``dist.barrier()``, ...) would raise "Default process group has not been initialized".
:func:`init_default_group` initialises that group with torch's own machinery: rank 0 starts a c10d ``TCPStore`` on a
free port, the address is agreed over the MPI world (one bounded all-gather), and every rank calls
``init_process_group("gloo", store=...)`` with its MPI rank and world size (as Horovod's and mpi4py's users do by hand).
"""
from __future__ import annotations

import datetime
import logging
import socket
import sys
from typing import Any

import numpy as np

from ..comm.base import Communicator

log = logging.getLogger("distopt")

_HOST_BYTES = 255  # a host name is at most 255 bytes (RFC 1035)


def _record(wants: bool, port: int) -> np.ndarray:
    """This rank's entry of the agreement: ``[wants, port (8 bytes), host name (255 bytes)]``, uint8."""
    rec = np.zeros(9 + _HOST_BYTES, dtype=np.uint8)
    rec[0] = wants
    rec[1:9] = np.frombuffer(np.int64(port).tobytes(), dtype=np.uint8)
    host = socket.gethostname().encode()[:_HOST_BYTES]
    rec[9:9 + len(host)] = np.frombuffer(host, dtype=np.uint8)
    return rec


def _host(rec: np.ndarray) -> str:
    return bytes(rec[9:]).rstrip(b"\0").decode()


def init_default_group(comm: Communicator, timeout: float) -> bool:
    """Initialise torch.distributed's default (gloo) process group over ``comm``'s ranks, if it is wanted.

    Wanted when torch is imported in this process, torch.distributed is available and no default group exists yet —
    on every rank (one all-gather over ``comm`` decides; if any rank does not want it, none makes it). The store's
    host is 127.0.0.1 when every rank runs on rank 0's host, else rank 0's host name.

    Args:
        comm: the MPI world just built (collective: every rank calls this).
        timeout: seconds for the store's connections and the group's collectives.

    Returns:
        True if this call initialised the default group.

    Raises:
        RuntimeError: rank 0 could not start the store (on every rank), or torch's own errors from
            ``init_process_group``.
    """
    dist: Any = None
    if "torch" in sys.modules:
        import torch.distributed as dist
    wants = dist is not None and dist.is_available() and not dist.is_initialized()
    store: Any = None
    port = 0
    if wants and comm.rank == 0:
        try:
            store = dist.TCPStore("0.0.0.0", 0, comm.size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            port = int(store.port)
        except (RuntimeError, OSError) as exc:  # the others learn it from port 0 below
            log.error("rank 0 could not start torch.distributed's store: %s", exc)
    table = np.asarray(comm.all_gather(_record(wants, port)))
    if not bool(table[:, 0].all()):
        return False
    root_port = int(np.frombuffer(table[0, 1:9].tobytes(), dtype=np.int64)[0])
    if root_port == 0:
        raise RuntimeError("torch.distributed's default process group over MPI: rank 0 could not start its "
                           "TCPStore (see rank 0's log); call dist.init_process_group yourself before distopt")
    same_host = all(_host(row) == _host(table[0]) for row in table)
    host = "127.0.0.1" if same_host else _host(table[0])
    if store is None:
        store = dist.TCPStore(host, root_port, comm.size, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=timeout))
    if comm.rank == 0:
        log.info("torch.distributed default process group (gloo) over the MPI world: %d ranks, store %s:%d",
                 comm.size, host, root_port)
    return True
