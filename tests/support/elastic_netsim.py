"""The "nodes" of an elastic job as network namespaces on a simulated link (``benchmarks/netsim.py``'s ``SimNet``).

``SimNetNodes(n)`` makes n + 1 namespaces on one bridge, each link rate-limited
(``tc tbf``): nodes 0 ... n-1 run one torchrun agent each (with ``--local-addr``
their link address and gloo bound to the link, ``GLOO_SOCKET_IFNAME``), and the
last one, the *head*, hosts the rendezvous ``TCPStore`` in a process of its own,
so that killing or cutting off any node leaves the store up. Pass it as
``ElasticJob(..., network=...)``. :meth:`SimNetNodes.cut` takes a node's link down
(a cut cable: its processes live on, but nothing reaches them). Leaving the
``with`` block ends every process in the namespaces and deletes them. Needs root
with ``ip``, ``tc`` and ``unshare`` (:func:`why_not`).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
from types import TracebackType

from .harness import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import netsim  # noqa: E402

__all__ = ["SimNetNodes", "why_not"]

STORE_PORT = 29500
_STORE = ("import sys, time\nfrom torch.distributed import TCPStore\n"
          "store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)\n"
          "print('ready', flush=True)\nwhile True:\n    time.sleep(60)\n")


def why_not() -> str | None:
    """Why this machine cannot make the namespaces (not root, a tool missing, no permission), or None."""
    reason = netsim.requirements()
    if reason is not None:
        return reason
    name = f"{netsim.PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.strip()}"


class SimNetNodes:
    """``count`` nodes and a head on a bridge of ``rate_bits`` bit/s per link and direction (see the module).

    Args:
        count: number of nodes that run agents.
        rate_bits: each link's rate, bits/s.
        delay_ms: one-way delay added on each node's link (applied where the kernel has ``sch_netem``).
    """

    def __init__(self, count: int, rate_bits: float = 1e9, delay_ms: float = 1.0) -> None:
        self.count = count
        self.net = netsim.SimNet(f"{netsim.PREFIX}{os.getpid()}", count + 1, rate_bits, delay_ms,
                                 log=lambda line: None)
        self.endpoint = f"{self.net.addr(count)}:{STORE_PORT}"
        self.env = {"GLOO_SOCKET_IFNAME": netsim.IFNAME}
        self._store: subprocess.Popen | None = None

    def addr(self, node: int) -> str:
        """Node ``node``'s link address."""
        return self.net.addr(node)

    def node_argv(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node`` (its namespace, hostname ``node<node>``)."""
        return self.net.node_argv(node, argv)

    def node_of(self, pid: int) -> int | None:
        """The node whose namespace process ``pid`` runs in (None: another namespace, this machine's own)."""
        name = netsim._run(["ip", "netns", "identify", str(pid)], check=False).stdout.strip()
        return self.net.names.index(name) if name in self.net.names else None

    def cut(self, node: int) -> None:
        """Take node ``node``'s link down."""
        netsim._run(["ip", "-n", self.net.names[node], "link", "set", netsim.IFNAME, "down"])

    def __enter__(self) -> "SimNetNodes":
        try:
            self.net.up()
            host, port = self.endpoint.split(":")
            self._store = subprocess.Popen(self.net.node_argv(self.count, [sys.executable, "-c", _STORE, host, port]),
                                           stdout=subprocess.PIPE, text=True, preexec_fn=netsim._set_pdeathsig)
            assert self._store.stdout is not None
            ready, _, _ = select.select([self._store.stdout], [], [], 60)
            line = self._store.stdout.readline() if ready else ""
            if line.strip() != "ready":
                raise RuntimeError(f"the head's TCPStore at {self.endpoint} did not start (said {line!r})")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.close()

    def close(self) -> None:
        """End the store and every process left in the namespaces; delete the namespaces (idempotent)."""
        if self._store is not None and self._store.poll() is None:
            self._store.kill()
            self._store.wait()
        self.net.down()
