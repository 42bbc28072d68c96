"""distopt over a simulated link: N network namespaces ("nodes") joined by a rate-limited link.

Run as root (it creates network namespaces; without root it exits with
status 2 and says so)::

    python benchmarks/netsim.py --nodes 2 --procs-per-node 1 --rate 1gbit --delay-ms 0.2 --workload step
    python benchmarks/netsim.py --workload step --sweep 0.1gbit,1gbit,10gbit      # + a PNG: time vs rate
    python benchmarks/netsim.py --workload cnn --max-steps 200 --variants ddp,plain,dgc,powersgd
    python benchmarks/netsim.py --workload gpt --iters 20
    python benchmarks/netsim.py --plot benchmarks/results/netsim_*.json --png rates.png
    python benchmarks/netsim.py --cleanup      # remove what crashed (SIGKILLed) runs left behind

The network. Every node is a network namespace ``dnsim<pid>n<i>`` (the
driver's pid: parallel runs never collide) with one interface ``eth0``,
address ``10.77.0.<i+1>``, and its own hostname (a UTS namespace per
launched process tree: ``node<i>``, listed in the namespace's
``/etc/hosts`` through ``/etc/netns/<ns>/hosts``). Two nodes are joined by a
veth pair; more than two by a bridge in a namespace of its own
(``dnsim<pid>br``), each node's veth peer a bridge port. Every sending end
(each node's ``eth0``, each bridge port towards its node) gets ``tc qdisc
... tbf rate R burst max(256 KiB, R x 1 ms) latency 20ms``, so each node has
a full-duplex link of rate R; ``--delay-ms D`` adds ``netem delay D`` (one
way) on each node's ``eth0`` where the kernel has ``sch_netem``. Where it
has not (``CONFIG_NET_SCH_NETEM`` unset), the run goes on without the
delay and the JSON says so (``link.delay_applied`` false, with the
reason); ``link.rtt_ms`` is the measured round trip either way, and
``link.tcp_bits`` the TCP throughput one node measured to another before
the workload (``--no-probe`` skips both).

The ranks. ``--launcher torchrun`` (the default) starts one ``torchrun`` per
node inside its namespace, with a c10d rendezvous on node 0's link address
(``--rdzv-endpoint 10.77.0.1:29400``, ``--local-addr`` the node's own) and
``GLOO_SOCKET_IFNAME=eth0``: distopt's ``torch`` backend (gloo).
``--launcher mpiexec`` starts MPICH's ``mpiexec`` in node 0 with
``-hosts node0,node1,...``; Hydra reaches the other nodes through a
generated ``-launcher-exec`` script that plays ssh by running the proxy with
``ip netns exec`` in that host's namespace; MPICH's UCX netmod is held to
TCP on ``eth0`` (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``: left to
itself UCX finds the peer on the same machine and moves the bytes through
shared memory, past the link) and ranks of one node use MPICH's shared
memory: distopt's ``mpi`` backend. The workers are ``benchmarks/netsim_worker.py``.

Teardown. Whatever happens (an exception, a failing rank, a timeout,
SIGINT, SIGTERM or SIGHUP), the driver ends the process groups it started
(SIGTERM, then SIGKILL), then every process still inside its namespaces
(``ip netns pids``), deletes the namespaces (their veths and bridge go with
them) and the ``/etc/netns`` entries and temporary files. Its children also
get SIGTERM from the kernel if the driver itself is SIGKILLed
(``PR_SET_PDEATHSIG``); ``--cleanup`` then removes the namespaces of runs
whose driver is gone.

Every number has the CPUs of one machine behind it: all nodes share its
cores (``env.cpus``), so a "node" computes more slowly than a real one
would and compression's CPU cost weighs more. Each worker runs
``max(1, cpus // ranks)`` torch / OpenMP threads.

Workloads (see ``netsim_worker.py`` for each variant's construction):

* ``step``: one optimizer step on ResNet-50's gradient shapes
  (``step.resnet50_shapes``, 161 float32 tensors, 25,557,032 elements;
  ``--width-div`` shrinks them), N(0, 1) gradients, a local optimizer that
  does nothing (the communication path alone, like ``step.py``'s
  ``step, no-op update``); variants ``ddp`` (``step.ddp_bucketed``: DDP's
  reducer without autograd, 25 MiB buckets over gloo), ``dense``, ``half``
  (float16 wire), ``topk1`` (``Sparse(density=0.01, select="topk")``),
  ``dgc`` (``DGC(sparsity=0.999)``, no warm-up), ``powersgd``
  (``PowerSGD(matrix_rank=2)`` from the first step); with
  ``--procs-per-node`` > 1 also ``flat`` and ``hier`` (``hierarchical=``;
  skipped with a note when ``DistOpt`` has no such argument). A barrier, then
  the timed step; warm-ups first, then the timed iterations interleaved
  across variants. ``time_ms`` = median over the timed iterations of the
  max over ranks (``mean_ms``, ``min_ms`` too); ``wire_bytes`` = bytes this
  rank handed to collectives per step (``opt.stats``); ``link_bytes`` =
  bytes all nodes' ``eth0`` sent per step (the kernel's counters: headers,
  control messages and barrier included). ``link_allreduce_ms`` = 2(W-1)/W x
  dense bytes / rate, W the world size: the link's time for one ring
  all-reduce of the gradients. ``cpu_ms`` = median of the max over ranks of
  the rank's CPU time during the step (all its threads, gloo's included);
  ``link_busy_ms`` = ``link_bytes`` / nodes / rate: how long each node's
  link must carry its share. ``time_ms`` close to ``cpu_ms`` and well above
  ``link_busy_ms``: the step is CPU-bound, not link-bound.
* ``cnn``: ``examples/cnn_mpi.py``'s CNN on Fashion-MNIST, one run per
  variant in one job (``ddp`` = PyTorch DDP over gloo, then ``cnn_mpi.train``
  for ``plain``, ``dgc``, ``powersgd``, ...; cnn_mpi's defaults and flags):
  the epoch's training time and the evaluation accuracy.
* ``gpt``: a small GPT-style decoder (``--layers``, ``--d-model``, ...)
  trained with AdamW on synthetic tokens (a fixed random Markov chain with
  4 successors per token: the loss can fall from ln(vocab) to ln 4): time
  per iteration (median of the timed iterations, max over ranks) and the
  final loss.

Writes ``benchmarks/results/netsim_<workload>.json`` unless ``--out``:
``{"benchmark": "netsim", "link": {...}, "env": {...}, "results": {VARIANT:
{"time_ms", "wire_bytes", ...}}, "link_allreduce_ms", "targets", ...}``;
with ``--sweep`` also ``"sweep": [one such record per rate]`` (the top
level holds the ``--rate`` one, else the first) and a PNG of time against
rate per variant next to the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import _common

PREFIX = "dnsim"
SUBNET = "10.77.0"
IFNAME = "eth0"
RDZV_PORT = 29400
PROBE_PORT = 29399
WORKER = _common.BENCH_DIR / "netsim_worker.py"
WORKLOADS = ("step", "cnn", "gpt")
STEP_VARIANTS = ("ddp", "dense", "half", "topk1", "dgc", "powersgd")
NODE_VARIANTS = ("flat", "hier")  # with more than one process per node
CNN_VARIANTS = ("ddp", "plain", "half", "topk1", "dgc", "powersgd")
CNN_DEFAULT = ("ddp", "plain", "dgc", "powersgd")
GPT_VARIANTS = ("ddp", "dense", "half", "topk1", "dgc", "powersgd")
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NAME = re.compile(rf"^{PREFIX}(\d+)(n\d+|br)$")


class Interrupted(Exception):
    """A signal (SIGINT, SIGTERM, SIGHUP) arrived: unwind, tear down, exit ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class JobFailed(Exception):
    """A launched job exited non-zero or ran past its timeout (its output tail attached)."""


# ------------------------------------------------------------------ parsing
def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's decimal units: bit, kbit, mbit, gbit, tbit; a bare number is bit/s).

    Raises:
        ValueError: not a positive number with one of those units.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or (m.group(2) or "bit") not in _RATE_UNITS:
        raise ValueError(f"rate {text!r}: expected a number and one of {', '.join(_RATE_UNITS)} (e.g. 1gbit)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return value


def fmt_rate(bits: float) -> str:
    """1e9 -> ``"1gbit"``, 1e8 -> ``"100mbit"``."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The driver's flags (``--help``); unknown flags of ``--workload cnn`` go to ``examples/cnn_mpi.py``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="--workload cnn passes flags it does not know to examples/cnn_mpi.py "
                                       "(e.g. --dgc-warmup-steps 100, --powersgd-rank 4)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2; > 2: a bridge)")
    p.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--rate", default="1gbit", help="link rate per node and direction, tc units (default 1gbit)")
    p.add_argument("--delay-ms", type=float, default=0.2, help="one-way delay in ms (netem; default 0.2)")
    p.add_argument("--workload", choices=WORKLOADS, default="step")
    p.add_argument("--launcher", choices=("torchrun", "mpiexec"), default="torchrun",
                   help="torchrun per node (torch backend, default) or MPICH mpiexec across the nodes (mpi)")
    p.add_argument("--variants", default=None, help="comma-separated subset (default: the workload's list)")
    p.add_argument("--sweep", default=None, help="comma-separated rates: one run per rate, plus a PNG")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/netsim_<workload>.json)")
    p.add_argument("--no-plot", action="store_true", help="no PNG with --sweep")
    p.add_argument("--no-probe", action="store_true", help="skip measuring the link's TCP rate and round trip")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launched job (default 1800)")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the jobs' logs into this directory")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each rate's workload, wait up to this many seconds for the CPUs to be < 15%% busy "
                        "(shared machines; default 0: no wait)")
    # step / gpt
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: step 2, gpt 3)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: step 5, gpt 20)")
    p.add_argument("--width-div", type=int, default=1, help="step: divide ResNet-50's widths (smoke runs)")
    p.add_argument("--bucket-mib", type=float, default=25.0, help="step: DDP-style bucket size (default 25)")
    p.add_argument("--powersgd-rank", type=int, default=2, help="step/gpt: PowerSGD matrix_rank (default 2)")
    # cnn
    p.add_argument("--epochs", type=int, default=1, help="cnn: epochs per variant (default 1)")
    p.add_argument("--max-steps", type=int, default=None, help="cnn: steps per epoch (default: the whole shard)")
    p.add_argument("--eval-limit", type=int, default=None, help="cnn: test images evaluated (default all)")
    p.add_argument("--batch-size", type=int, default=None, help="cnn: per rank (default 64); gpt: per rank (8)")
    p.add_argument("--data-dir", default=None, help="cnn: Fashion-MNIST IDX directory")
    # gpt
    p.add_argument("--layers", type=int, default=4, help="gpt: transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=256, help="gpt: width (default 256)")
    p.add_argument("--heads", type=int, default=4, help="gpt: attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="gpt: tokens per sequence (default 128)")
    p.add_argument("--vocab", type=int, default=4096, help="gpt: vocabulary (default 4096)")
    p.add_argument("--lr", type=float, default=None, help="gpt: AdamW learning rate (default 1e-3)")
    # modes
    p.add_argument("--cleanup", action="store_true", help="remove leftovers of earlier runs whose driver is gone")
    p.add_argument("--plot", nargs="+", type=Path, default=None, metavar="JSON",
                   help="plot time against rate from these netsim JSONs (no run)")
    p.add_argument("--png", type=Path, default=None, help="with --plot: the PNG path")
    p.add_argument("--probe-serve", nargs=2, metavar=("ADDR", "BYTES"), help=argparse.SUPPRESS)
    p.add_argument("--probe-send", nargs=2, metavar=("ADDR", "BYTES"), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if rest and args.workload != "cnn":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.nodes < 2:
        p.error("--nodes must be >= 2")
    if args.procs_per_node < 1:
        p.error("--procs-per-node must be >= 1")
    if args.nodes > 250:
        p.error("--nodes must be <= 250 (one /24)")
    try:
        args.rate_bits = parse_rate(args.rate)
        args.sweep_bits = [parse_rate(r) for r in args.sweep.split(",") if r.strip()] if args.sweep else None
    except ValueError as e:
        p.error(str(e))
    if args.delay_ms < 0:
        p.error("--delay-ms must be >= 0")
    known = {"step": STEP_VARIANTS + NODE_VARIANTS, "cnn": CNN_VARIANTS, "gpt": GPT_VARIANTS}[args.workload]
    if args.variants is None:
        default = {"step": STEP_VARIANTS + (NODE_VARIANTS if args.procs_per_node > 1 else ()),
                   "cnn": CNN_DEFAULT, "gpt": GPT_VARIANTS}[args.workload]
        args.variant_list = list(default)
    else:
        args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in args.variant_list if v not in known]
        if bad:
            p.error(f"unknown variant(s) {', '.join(bad)} for --workload {args.workload}; choose from "
                    f"{', '.join(known)}")
    if args.warmup is None:
        args.warmup = {"step": 2, "gpt": 3, "cnn": 0}[args.workload]
    if args.iters is None:
        args.iters = {"step": 5, "gpt": 20, "cnn": 0}[args.workload]
    if args.out is None:
        args.out = _common.default_out(f"netsim_{args.workload}")
    return args


# ------------------------------------------------------------ shell helpers
def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a setup command (``ip``, ``tc``); a failure raises with its stderr."""
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def requirements() -> str | None:
    """Why this machine cannot run the harness (not root, no ``ip``/``tc``/``unshare``), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ("netsim.py creates network namespaces and needs root (run it with sudo, or as root in a VM "
                "or container with CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    missing = [t for t in ("ip", "tc", "unshare", "hostname") if shutil.which(t) is None]
    if missing:
        return f"netsim.py needs {', '.join(missing)} (iproute2, util-linux) on PATH"
    return None


def _set_pdeathsig() -> None:
    """``preexec_fn``: the child gets SIGTERM when the driver dies, even by SIGKILL (survives exec)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs a netsim driver (pid reuse by another program counts as gone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"netsim" in cmdline


def netns_list() -> list[str]:
    """Names of the network namespaces ``ip netns list`` shows."""
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    """Pids of the processes inside namespace ``name``."""
    res = _run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


def kill_netns_processes(name: str, grace: float = 3.0) -> None:
    """SIGTERM every process inside ``name``, SIGKILL what is left after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = netns_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and netns_pids(name):
            time.sleep(0.05)


def delete_netns(name: str) -> None:
    """End the processes in ``name``, delete it and its ``/etc/netns`` entry (idempotent)."""
    kill_netns_processes(name)
    if name in netns_list():
        _run(["ip", "netns", "delete", name], check=False)
    shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def cleanup_leftovers(force: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Delete the namespaces (and ``/etc/netns`` entries, temp dirs) of netsim runs whose driver is gone.

    Args:
        force: also those of drivers still running.
        log: where to say what was removed.

    Returns:
        The namespace names removed.
    """
    removed = []
    names = set(netns_list())
    etc = Path("/etc/netns")
    if etc.is_dir():
        names |= {p.name for p in etc.iterdir() if _NAME.match(p.name)}
    for name in sorted(names):
        m = _NAME.match(name)
        if m and (force or not _alive(int(m.group(1)))):
            delete_netns(name)
            removed.append(name)
            log(f"removed namespace {name}")
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        m = re.match(rf"{PREFIX}(\d+)-", d.name)
        if m and d.is_dir() and (force or not _alive(int(m.group(1)))):
            shutil.rmtree(d, ignore_errors=True)
            log(f"removed {d}")
    return removed


# ---------------------------------------------------------------- the network
class SimNet:
    """N namespaces on a rate-limited link with a delay; :meth:`down` removes everything :meth:`up` made.

    Args:
        run_id: unique prefix of the namespace names (``dnsim<pid>``).
        nodes: number of nodes (2: a veth pair; more: a bridge namespace).
        rate_bits: link rate per node and direction, bits/s.
        delay_ms: one-way delay added on each node's interface (netem).
        log: progress lines.
    """

    def __init__(self, run_id: str, nodes: int, rate_bits: float, delay_ms: float,
                 log: Callable[[str], None] = print) -> None:
        self.run_id, self.nodes, self.rate_bits, self.delay_ms, self.log = run_id, nodes, rate_bits, delay_ms, log
        self.names = [f"{run_id}n{i}" for i in range(nodes)]
        self.bridge = f"{run_id}br" if nodes > 2 else None
        self.created: list[str] = []
        self.delay_applied = False
        self.delay_note: str | None = None
        self.qdiscs: dict[str, str] = {}

    @staticmethod
    def addr(i: int) -> str:
        """Node ``i``'s link address."""
        return f"{SUBNET}.{i + 1}"

    @staticmethod
    def host(i: int) -> str:
        """Node ``i``'s hostname."""
        return f"node{i}"

    @property
    def topology(self) -> str:
        """``"veth pair"`` or ``"bridge"``."""
        return "bridge" if self.bridge else "veth pair"

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)  # from here on, down() deletes it
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def up(self) -> None:
        """Create the namespaces, links, addresses, hosts files and qdiscs."""
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(i)} {self.host(i)}\n" for i in range(self.nodes))
        for name in self.names + ([self.bridge] if self.bridge else []):
            self._add_ns(name)
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        if self.bridge is None:  # the veth ends are created inside the namespaces: nothing in the root one
            _run(["ip", "link", "add", IFNAME, "netns", self.names[0], "type", "veth", "peer", "name", IFNAME,
                  "netns", self.names[1]])
            ports: list[tuple[str, str]] = []
        else:
            br = self.bridge
            _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            ports = []
            for i, name in enumerate(self.names):
                port = f"p{i}"
                _run(["ip", "link", "add", IFNAME, "netns", name, "type", "veth", "peer", "name", port,
                      "netns", br])
                _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", br, "link", "set", port, "up"])
                ports.append((br, port))
        for i, name in enumerate(self.names):
            _run(["ip", "-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME])
            _run(["ip", "-n", name, "link", "set", IFNAME, "up"])
            self._shape(name, IFNAME, self.delay_ms)
        for ns, port in ports:  # towards each node: its download direction
            self._shape(ns, port, 0.0)
        self.log(f"network up: {self.nodes} nodes ({self.topology}), {fmt_rate(self.rate_bits)}, "
                 f"delay {self.delay_ms:g} ms {'applied' if self.delay_applied else 'NOT applied'}"
                 + (f" ({self.delay_note})" if self.delay_note else ""))

    def _shape(self, ns: str, dev: str, delay_ms: float) -> None:
        burst = max(256 * 1024, int(self.rate_bits / 8 * 1e-3))
        tbf = ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", "20ms"]
        if delay_ms > 0:
            res = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                        f"{delay_ms}ms", "limit", "100000"], check=False)
            if res.returncode == 0:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
                self.delay_applied = True
            else:
                self.delay_note = (f"tc netem failed: {res.stderr.strip()} (this kernel has no sch_netem, "
                                   "CONFIG_NET_SCH_NETEM): rate limit only, no added delay")
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
        self.qdiscs[f"{ns}/{dev}"] = _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip()

    def node_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``i``: its namespace, a UTS namespace with hostname ``node<i>``."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.host(i), *argv]

    def down(self) -> None:
        """Delete every namespace made (processes inside ended first); safe to call more than once."""
        for name in reversed(self.created):
            delete_netns(name)
        self.created.clear()


# ----------------------------------------------------------------- processes
class Jobs:
    """The process groups the driver started; :meth:`stop` ends them all."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, argv: Sequence[str], env: dict[str, str], name: str) -> subprocess.Popen:
        """Start ``argv`` in a new session (its own process group), output to ``<logdir>/<name>.log``."""
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(list(argv), env=env, cwd=_common.ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_set_pdeathsig)
        self.procs.append((proc, log))
        return proc

    def wait(self, timeout: float, what: str) -> None:
        """Wait for every started process; the first failure or the deadline raises :class:`JobFailed`."""
        deadline = time.monotonic() + timeout
        while True:
            running = False
            for proc, log in self.procs:
                rc = proc.poll()
                if rc is None:
                    running = True
                elif rc != 0:
                    raise JobFailed(f"{what}: {' '.join(map(str, proc.args[-12:]))} exited {rc}\n"
                                    f"--- {log.name} ---\n{_tail(log)}" + self._other_tails(log))
            if not running:
                return
            if time.monotonic() > deadline:
                raise JobFailed(f"{what}: still running after the {timeout:g} s timeout"
                                + self._other_tails(None))
            time.sleep(0.1)

    def _other_tails(self, skip: Path | None) -> str:
        return "".join(f"\n--- {log.name} ---\n{_tail(log, 1500)}" for _, log in self.procs if log != skip)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM each process group still running, SIGKILL after ``grace`` s; reap them all."""
        live = [p for p, _ in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p, _ in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):  # grandchildren left in the group
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread while inside."""
    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise Interrupted(signum)

    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while tearing down (a second Ctrl-C must not cut the teardown short)."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---------------------------------------------------------------- the probe
def probe_serve(addr: str, nbytes: int) -> None:
    """Probe server: echo 200 one-byte pings, then receive ``nbytes`` and print the seconds taken."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, PROBE_PORT))
    srv.listen(1)
    srv.settimeout(60)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200):
        c.sendall(c.recv(1))
    buf = bytearray(1 << 20)
    got = 0
    t0 = time.perf_counter()
    while got < nbytes:
        k = c.recv_into(buf)
        if not k:
            break
        got += k
    c.sendall(b"k")
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}), flush=True)


def probe_send(addr: str, nbytes: int) -> None:
    """Probe client: 200 one-byte round trips (median printed), then send ``nbytes``."""
    deadline = time.monotonic() + 30
    while True:
        try:
            c = socket.create_connection((addr, PROBE_PORT), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(200):
        t0 = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        rtts.append(time.perf_counter() - t0)
    data = bytes(4 << 20)
    sent = 0
    while sent < nbytes:
        c.sendall(data)
        sent += len(data)
    c.recv(1)
    rtts.sort()
    print(json.dumps({"rtt_ms": rtts[len(rtts) // 2] * 1e3, "rtt_min_ms": rtts[0] * 1e3}), flush=True)


def probe_link(net: SimNet, jobs: Jobs) -> dict[str, Any]:
    """TCP throughput node 1 -> node 0 (about 1 s of the nominal rate, 4-256 MiB) and the round trip."""
    nbytes = int(min(max(net.rate_bits / 8, 4 << 20), 256 << 20))
    env = dict(os.environ, PYTHONPATH=str(_common.ROOT))
    me = str(Path(__file__).resolve())
    server = jobs.start(net.node_argv(0, [sys.executable, me, "--probe-serve", net.addr(0), str(nbytes)]), env,
                        "probe-server")
    client = jobs.start(net.node_argv(1, [sys.executable, me, "--probe-send", net.addr(0), str(nbytes)]), env,
                        "probe-client")
    jobs.wait(120, "link probe")
    srv = json.loads(jobs.procs[-2][1].read_text().strip().splitlines()[-1])
    cli = json.loads(jobs.procs[-1][1].read_text().strip().splitlines()[-1])
    del server, client
    jobs.procs.clear()
    return {"tcp_bits": srv["bytes"] * 8 / srv["seconds"], "tcp_probe_bytes": srv["bytes"],
            "rtt_ms": cli["rtt_ms"], "rtt_min_ms": cli["rtt_min_ms"]}


# ---------------------------------------------------------------- launching
def _threads(args: argparse.Namespace) -> int:
    return max(1, _common.cpus() // (args.nodes * args.procs_per_node))


def worker_argv(args: argparse.Namespace, result_file: Path, run_id: str) -> list[str]:
    """The worker's command line (after the interpreter)."""
    argv = [str(WORKER), "--run-id", run_id, "--result-file", str(result_file), "--workload", args.workload,
            "--launcher", args.launcher, "--variants", ",".join(args.variant_list), "--warmup", str(args.warmup),
            "--iters", str(args.iters), "--width-div", str(args.width_div), "--bucket-mib", str(args.bucket_mib),
            "--powersgd-rank", str(args.powersgd_rank), "--threads", str(_threads(args)),
            "--epochs", str(args.epochs), "--layers", str(args.layers), "--d-model", str(args.d_model),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--vocab", str(args.vocab)]
    for flag, value in (("--max-steps", args.max_steps), ("--eval-limit", args.eval_limit),
                        ("--batch-size", args.batch_size), ("--data-dir", args.data_dir), ("--lr", args.lr)):
        if value is not None:
            argv += [flag, str(value)]
    if args.rest:
        argv += ["--", *args.rest]
    return argv


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment: the link interface for gloo and UCX, threads, the import path."""
    env = dict(os.environ)
    t = str(_threads(args))
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")])),
                "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t,
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFNAME, "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFNAME,
                "DISTOPT_TIMEOUT": env.get("DISTOPT_TIMEOUT", str(int(max(args.timeout, 60))))})
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def launch_torchrun(net: SimNet, jobs: Jobs, args: argparse.Namespace, worker: list[str], env: dict[str, str]
                    ) -> list[str]:
    """One ``torchrun`` per node, c10d rendezvous on node 0's link address; returns the node-0 command."""
    cmds = []
    for i in range(args.nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                "--nproc-per-node", str(args.procs_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{net.addr(0)}:{RDZV_PORT}", "--rdzv-id", net.run_id,
                "--local-addr", net.addr(i), "--max-restarts", "0", "--monitor-interval", "0.2",
                "--rdzv-conf", f"join_timeout={int(min(args.timeout, 600))}", *worker]
        cmds.append(" ".join(argv))
        jobs.start(net.node_argv(i, argv), env, f"node{i}")
    return cmds


def _rsh_script(net: SimNet, tmp: Path) -> Path:
    """A stand-in for ssh that Hydra calls as ``<script> [-x] HOST COMMAND``: runs COMMAND in HOST's node."""
    cases = "\n".join(f"  {net.host(i)}) ns={net.names[i]} ;;" for i in range(net.nodes))
    script = tmp / "netsim-rsh"
    script.write_text(f"""#!/bin/sh
# generated by benchmarks/netsim.py for run {net.run_id}: Hydra's ssh, into a network namespace
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "netsim-rsh: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
    script.chmod(0o755)
    return script


def launch_mpiexec(net: SimNet, jobs: Jobs, args: argparse.Namespace, worker: list[str], env: dict[str, str],
                   tmp: Path) -> list[str]:
    """MPICH ``mpiexec`` in node 0, the other nodes' proxies through the generated rsh script."""
    rsh = _rsh_script(net, tmp)
    hosts = ",".join(net.host(i) for i in range(args.nodes))
    argv = [_common.mpiexec(), "-launcher", "ssh", "-launcher-exec", str(rsh), "-hosts", hosts,
            "-n", str(args.nodes * args.procs_per_node), "-ppn", str(args.procs_per_node),
            *[x for k in ("UCX_TLS", "UCX_NET_DEVICES", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "PYTHONPATH",
                          "PYTHONUNBUFFERED", "DISTOPT_TIMEOUT") for x in ("-genv", k, env[k])],
            sys.executable, *worker]
    jobs.start(net.node_argv(0, argv), env, "mpiexec")
    return [" ".join(argv)]


# ------------------------------------------------------------------ one run
def run_once(args: argparse.Namespace, rate_bits: float, run_id: str, tmp: Path, log: Callable[[str], None]
             ) -> dict[str, Any]:
    """Build the network at ``rate_bits``, run the workload, tear down; one record of results."""
    net = SimNet(run_id, args.nodes, rate_bits, args.delay_ms, log)
    logdir = Path(tempfile.mkdtemp(prefix="logs-", dir=tmp))
    jobs = Jobs(logdir)
    record: dict[str, Any] = {}
    try:
        net.up()
        link: dict[str, Any] = {"rate_bits": rate_bits, "rate": fmt_rate(rate_bits), "delay_ms": args.delay_ms,
                                "delay_applied": net.delay_applied, "delay_note": net.delay_note,
                                "nodes": args.nodes, "procs_per_node": args.procs_per_node,
                                "topology": net.topology, "qdiscs": net.qdiscs}
        if not args.no_probe:
            link.update(probe_link(net, jobs))
            log(f"link probe: TCP {link['tcp_bits'] / 1e9:.3f} Gbit/s, round trip {link['rtt_ms']:.3f} ms")
        result_file = tmp / f"result-{fmt_rate(rate_bits)}.json"
        worker = worker_argv(args, result_file, run_id)
        env = worker_env(args)
        if args.wait_quiet > 0:
            _common.wait_quiet(args.wait_quiet, 0.15, log)
        busy = _common.cpu_busy(0.5)
        load_before = list(os.getloadavg())
        log(f"running --workload {args.workload} ({', '.join(args.variant_list)}) with {args.launcher}; "
            f"load {load_before[0]:.2f}, CPUs {busy:.0%} busy")
        t0 = time.perf_counter()
        if args.launcher == "torchrun":
            cmds = launch_torchrun(net, jobs, args, worker, env)
        else:
            cmds = launch_mpiexec(net, jobs, args, worker, env, tmp)
        jobs.wait(args.timeout, f"--workload {args.workload} at {fmt_rate(rate_bits)}")
        wall = time.perf_counter() - t0
        data = json.loads(result_file.read_text())
        record = {"link": link, **data, "job_wall_s": wall, "commands": cmds,
                  "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()), "cpu_busy_before": busy}
        _derive(record, args)
        return record
    finally:
        with signals_blocked():
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in logdir.glob("*.log"):
                    shutil.copy(f, args.keep_logs / f"{fmt_rate(rate_bits)}-{f.name}")
            jobs.stop()
            net.down()
            shutil.rmtree(logdir, ignore_errors=True)


def _derive(record: dict[str, Any], args: argparse.Namespace) -> None:
    """Ratios and the link's all-reduce time, in place (nothing typed in: all from the record)."""
    res = record["results"]
    link = record["link"]
    w = args.nodes * args.procs_per_node
    if args.workload in ("step", "gpt"):
        dense_bytes = record.get("dense_bytes")
        if dense_bytes:
            record["link_allreduce_ms"] = 2 * (w - 1) / w * dense_bytes * 8 / link["rate_bits"] * 1e3
            record["link_allreduce_nodes_ms"] = (2 * (args.nodes - 1) / args.nodes * dense_bytes * 8
                                                 / link["rate_bits"] * 1e3)
        base = res.get("dense", {}).get("time_ms")
        ddp = res.get("ddp", {}).get("time_ms")
        for rec in res.values():
            rec["x_dense"] = rec["time_ms"] / base if base else None
            rec["x_ddp"] = rec["time_ms"] / ddp if ddp else None
            rec["x_link"] = rec["time_ms"] / record["link_allreduce_ms"] if record.get("link_allreduce_ms") else None
            if rec.get("link_bytes") is not None:  # how long one node's link is busy with its share of the bytes
                rec["link_busy_ms"] = rec["link_bytes"] / args.nodes * 8 / link["rate_bits"] * 1e3
    record["targets"] = targets(record, args.workload)


def targets(record: dict[str, Any], workload: str) -> dict[str, dict[str, Any]]:
    """The issue's targets: ``{name: {"ratio", "target", "met"}}`` (ratio None where not measured)."""
    res = record["results"]

    def t(k: str, field: str = "time_ms") -> float | None:
        return res.get(k, {}).get(field)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    rows: dict[str, tuple[float | None, float]] = {}
    if workload == "step":
        rows = {"dense / link_allreduce": (ratio(t("dense"), record.get("link_allreduce_ms")), 1.15),
                "dense / ddp": (ratio(t("dense"), t("ddp")), 1.0),
                "half / dense": (ratio(t("half"), t("dense")), 0.6),
                "topk1 / dense": (ratio(t("topk1"), t("dense")), 0.15),
                "dgc / dense": (ratio(t("dgc"), t("dense")), 0.15),
                "powersgd / dense": (ratio(t("powersgd"), t("dense")), 0.15),
                "hier / flat": (ratio(t("hier"), t("flat")), 0.65)}
    elif workload == "cnn":
        rows = {"dgc epoch / ddp epoch": (ratio(t("dgc", "train_s"), t("ddp", "train_s")), 0.5),
                "powersgd epoch / ddp epoch": (ratio(t("powersgd", "train_s"), t("ddp", "train_s")), 0.5)}
        for k in ("dgc", "powersgd"):
            a, b = t(k, "eval_acc"), t("plain", "eval_acc")
            rows[f"{k} accuracy - plain (points)"] = ((a - b) * 100 if a is not None and b is not None else None,
                                                      -1.0)
    out = {}
    for name, (value, goal) in rows.items():
        met = None if value is None else (value >= goal if name.endswith("(points)") else value <= goal)
        out[name] = {"ratio": value, "target": goal, "met": met}
    return out


# ------------------------------------------------------------------- output
def print_record(record: dict[str, Any], workload: str) -> None:
    """The run's table and its targets."""
    link = record["link"]
    res = record["results"]
    delay = f"delay {link['delay_ms']:g} ms" + ("" if link["delay_applied"] else " (not applied: no netem)")
    probe = (f", TCP {link['tcp_bits'] / 1e9:.3f} Gbit/s, rtt {link['rtt_ms']:.3f} ms" if "tcp_bits" in link else "")
    title = (f"netsim {workload}: {link['nodes']} nodes x {link['procs_per_node']} procs, {link['rate']} "
             f"{link['topology']}, {delay}{probe}; {record.get('launcher', '?')} launcher, backend "
             f"{record.get('backend', '?')}; load {record['loadavg_before'][0]:.2f} -> "
             f"{record['loadavg_after'][0]:.2f}")
    if workload == "step":
        headers = ["variant", "time ms", "mean ms", "min ms", "cpu ms", "link busy ms", "x link", "x ddp", "x dense",
                   "wire MB", "link MB", "ctl/step"]
        rows = [[k, f"{r['time_ms']:.1f}", f"{r['mean_ms']:.1f}", f"{r['min_ms']:.1f}", _f(r.get("cpu_ms"), 1),
                 _f(r.get("link_busy_ms"), 1), _f(r.get("x_link")), _f(r.get("x_ddp")), _f(r.get("x_dense")),
                 f"{r['wire_bytes'] / 1e6:.2f}",
                 f"{r['link_bytes'] / 1e6:.2f}" if r.get("link_bytes") is not None else None,
                 _f(r.get("control_per_step"), 1)] for k, r in res.items()]
        title += (f"\n  {record['elements']:,} float32 elements ({record['dense_bytes'] / 1e6:.1f} MB), "
                  f"{record['warmup']} warm-up + {record['iters']} timed iterations; time = median over "
                  f"iterations of the max over ranks; link_allreduce_ms = {record.get('link_allreduce_ms', 0):.1f}")
    elif workload == "cnn":
        headers = ["variant", "train s", "x ddp", "eval acc", "d acc pp", "train acc", "wire/dense", "steps"]
        ddp = res.get("ddp", {}).get("train_s")
        plain = res.get("plain", {}).get("eval_acc")
        rows = [[k, f"{r['train_s']:.2f}", _f(r["train_s"] / ddp if ddp else None), f"{r['eval_acc']:.4f}",
                 f"{(r['eval_acc'] - plain) * 100:+.2f}" if plain is not None else None, f"{r['train_acc']:.4f}",
                 f"{r['wire_ratio']:.4f}", r["steps"]] for k, r in res.items()]
    else:
        headers = ["variant", "time ms", "mean ms", "x ddp", "x dense", "final loss", "first loss", "wire MB"]
        rows = [[k, f"{r['time_ms']:.1f}", f"{r['mean_ms']:.1f}", _f(r.get("x_ddp")), _f(r.get("x_dense")),
                 f"{r['final_loss']:.4f}", f"{r['first_loss']:.4f}", f"{r['wire_bytes'] / 1e6:.2f}"]
                for k, r in res.items()]
        title += (f"\n  {record['params']:,} parameters, {record['warmup']} warm-up + {record['iters']} timed "
                  "iterations; time = median per iteration, max over ranks")
    print(_common.table(headers, rows, title))
    for name, t in record["targets"].items():
        v = t["ratio"]
        verdict = "not measured" if v is None else ("met" if t["met"] else "MISSED")
        goal = f">= {t['target']}" if name.endswith("(points)") else f"<= {t['target']}"
        print(f"  {name}: {'-' if v is None else f'{v:.3f}'} (target {goal}) {verdict}")
    for k, why in record.get("skipped", {}).items():
        print(f"  skipped {k}: {why}")


def _f(v: float | None, digits: int = 3) -> str | None:
    return None if v is None else f"{v:.{digits}f}"


def crossings(sweep: list[dict[str, Any]], base: str = "dense") -> dict[str, Any]:
    """Per variant, the rates (bits/s, log-interpolated) where its time crosses ``base``'s in a sweep."""
    runs = sorted(sweep, key=lambda r: r["link"]["rate_bits"])
    out: dict[str, Any] = {}
    variants = {k for r in runs for k in r["results"]} - {base} if any(base in r["results"] for r in runs) else set()
    for v in sorted(variants):
        pts = [(r["link"]["rate_bits"], r["results"][v]["time_ms"] - r["results"][base]["time_ms"])
               for r in runs if v in r["results"] and base in r["results"]]
        found = []
        for (r0, d0), (r1, d1) in zip(pts, pts[1:]):
            if d0 == 0:
                found.append(r0)
            elif d0 * d1 < 0:
                f = d0 / (d0 - d1)
                found.append(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
        faster = [r for r, d in pts if d < 0]
        out[v] = {"cross_rate_bits": found, "faster_than_" + base + "_at": [fmt_rate(r) for r in faster]}
    return out


def plot(path: Path, runs: list[dict[str, Any]], title: str) -> str | None:
    """PNG of time per step (or per iteration) against link rate, one line per variant; an error note or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install 'distopt[bench]'): no plot"
    runs = sorted(runs, key=lambda r: r["link"]["rate_bits"])
    if not runs:
        return "no runs to plot"
    field = "train_s" if runs[0].get("workload") == "cnn" else "time_ms"
    fig, ax = plt.subplots(figsize=(8, 5))
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r["results"] if k not in keys]
    rates = [r["link"]["rate_bits"] / 1e9 for r in runs]
    for k in keys:
        xs = [rb for rb, r in zip(rates, runs) if k in r["results"]]
        ys = [r["results"][k][field] for r in runs if k in r["results"]]
        ax.plot(xs, ys, marker="o", label=k)
    if all("link_allreduce_ms" in r for r in runs) and field == "time_ms":
        ax.plot(rates, [r["link_allreduce_ms"] for r in runs], "k--", label="link all-reduce (2(W-1)/W bytes/rate)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate, Gbit/s (tc tbf per node and direction)")
    ax.set_ylabel("s per epoch" if field == "train_s" else "ms per step (median, max over ranks)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def plot_files(files: Sequence[Path], png: Path | None) -> int:
    """``--plot``: gather the runs of several netsim JSONs (single rates or sweeps) into one PNG."""
    by_rate: dict[float, dict[str, Any]] = {}  # one run per rate: a later file's replaces an earlier one's
    for f in files:
        data = json.loads(Path(f).read_text())
        if data.get("benchmark") != "netsim":
            raise SystemExit(f"{f}: not a netsim.py result")
        for r in data.get("sweep") or [data]:
            by_rate[r["link"]["rate_bits"]] = {**r, "workload": data.get("workload")}
    runs = list(by_rate.values())
    png = png or Path(files[0]).with_suffix(".png")
    note = plot(png, runs, f"netsim {runs[0].get('workload')}: time against link rate ({len(runs)} runs)")
    print(note or f"wrote {png}")
    for base in ("dense", "ddp"):
        _print_crossings(crossings(runs, base), base)
    return 0


def _print_crossings(per: dict[str, Any], base: str) -> None:
    for v, c in per.items():
        print(f"  {v} vs {base}: crosses at {[fmt_rate(x) for x in c['cross_rate_bits']] or 'no rate in range'}; "
              f"faster at {c['faster_than_' + base + '_at'] or 'none'}")


# --------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check root, run (one rate or a sweep) with teardown guaranteed; returns the exit status."""
    args = parse_args(argv)
    if args.probe_serve:
        probe_serve(args.probe_serve[0], int(args.probe_serve[1]))
        return 0
    if args.probe_send:
        probe_send(args.probe_send[0], int(args.probe_send[1]))
        return 0
    if args.plot:
        return plot_files(args.plot, args.png)
    why = requirements()
    if why:
        print(f"netsim.py: {why}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(f"[netsim] {line}", file=sys.stderr, flush=True)

    if args.cleanup:
        removed = cleanup_leftovers(log=log)
        log(f"cleanup: {len(removed)} namespace(s) removed")
        return 0
    if args.workload == "cnn" and args.rest:
        sys.path.insert(0, str(_common.ROOT / "examples"))
        import cnn_mpi

        cnn_mpi.parse_args(args.rest)  # exits with argparse's message on a flag it does not know
    run_id = f"{PREFIX}{os.getpid()}"
    env = _common.env_info(mpi=False)
    rates = args.sweep_bits or [args.rate_bits]
    tmp = Path(tempfile.mkdtemp(prefix=f"{run_id}-"))
    records = []
    try:
        with signals_raise():
            for rate in rates:
                rec = run_once(args, rate, run_id, tmp, log)
                print_record(rec, args.workload)
                records.append(rec)
    except Interrupted as e:
        log(f"{e}: everything torn down")
        return 128 + e.signum
    except JobFailed as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        with signals_blocked():
            shutil.rmtree(tmp, ignore_errors=True)
    main_rec = next((r for r in records if r["link"]["rate_bits"] == args.rate_bits), records[0])
    data: dict[str, Any] = {"benchmark": "netsim", "workload": args.workload, "link": main_rec["link"],
                            "env": _common.finish_env(env),
                            "config": {k: v for k, v in vars(args).items()
                                       if k not in ("out", "plot", "png", "probe_serve", "probe_send", "keep_logs")},
                            **{k: v for k, v in main_rec.items() if k != "link"}}
    if args.sweep_bits:
        data["sweep"] = records
        data["crossings"] = ({"dense": crossings(records, "dense"), "ddp": crossings(records, "ddp")}
                             if args.workload != "cnn" else None)
    out = _common.write_json(args.out, data)
    print(f"wrote {out}")
    if args.sweep_bits and not args.no_plot:
        png = out.with_suffix(".png")
        note = plot(png, [{**r, "workload": args.workload} for r in records],
                    f"netsim {args.workload}: {args.nodes} nodes x {args.procs_per_node}, {args.launcher}, "
                    f"{_common.cpus()} CPUs shared")
        print(note or f"wrote {png}")
        for base, per in (data["crossings"] or {}).items():
            _print_crossings(per, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
