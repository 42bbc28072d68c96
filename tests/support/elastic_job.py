"""A torchrun elastic job on one machine, for the tests and the benchmark: agents that can be killed one by one.

The rendezvous store is hosted here (a c10d ``TCPStore``), or by a process of
the caller's (``network=``, e.g. on a simulated machine of its own),
and every agent is started with ``--rdzv-conf is_host=0``, so any agent, the
first one included, can be killed without taking the store down (as when the
store runs on a machine of its own). With ``network=`` each agent runs inside its
node (``tests/support/elastic_netsim.py``: network namespaces on a simulated
link). Each agent runs one worker (``--nproc-per-node 1``): an
agent and its worker together are one "node". The agents' keep-alive is 1 s
with 3 misses, so a killed node leaves the rendezvous within about 3 s.

Every process of a job (agents and workers) has the job's ``out`` directory on
its command line: :meth:`ElasticJob.alive` finds them by it, so that a test can
assert that nothing outlived the job (no orphaned worker) before
:meth:`ElasticJob.close` kills what is left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from torch.distributed import TCPStore

from .harness import ROOT
from .torch_workers import free_port

__all__ = ["ElasticJob", "Network", "RDZV_CONF", "read_steps"]

#: The agents' ``--rdzv-conf``: the store is not theirs, a dead node leaves within about 3 s, a round closes
#: 1 s after its last arrival.
RDZV_CONF: dict[str, float | int | str] = {"is_host": 0, "last_call_timeout": 1, "keep_alive_interval": 1,
                                           "keep_alive_max_attempt": 3}


def read_steps(out: Path) -> list[dict]:
    """Every JSON line the workers of ``elastic_train.py`` wrote, in file order per worker."""
    rows = []
    for f in sorted(out.glob("steps.*.jsonl")):
        rows.extend(json.loads(line) for line in f.read_text().splitlines() if line.strip())
    return rows


class Network(Protocol):
    """Where a job's agents run when they are not all on this machine's loopback."""

    endpoint: str  #: the rendezvous store's ``host:port`` (hosted by the caller)
    env: dict[str, str]  #: added to every agent's environment (e.g. ``GLOO_SOCKET_IFNAME``)

    def addr(self, node: int) -> str:
        """Node ``node``'s address (the agent's ``--local-addr``)."""

    def node_argv(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``."""


class ElasticJob:
    """Agents of ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` running ``script`` with ``args``.

    Args:
        out: a fresh directory; the agents' logs go to ``out/agent<i>.log``.
        script: the training script; ``args`` follow it.
        nnodes: torchrun's ``--nnodes`` (``"2:3"``).
        run_id: ``--rdzv-id`` (it also names the commits in ``/dev/shm``).
        max_restarts: torchrun's ``--max-restarts``.
        rdzv_conf: ``--rdzv-conf`` entries that replace or add to the harness's own (:data:`RDZV_CONF`), e.g.
            ``{"join_timeout": 5}``.
        network: run each agent inside its node of ``network``, against the store at ``network.endpoint``;
            default: every agent on loopback, against a store hosted here.
        one_host: every agent's commits in one directory, ``out/../host`` (agents sharing one host's
            ``/dev/shm``, as with the default ``commit_dir``); default: ``out/../node<node>`` each.
    """

    def __init__(self, out: Path, script: Path, args: list[str], *, nnodes: str, run_id: str,
                 max_restarts: int = 3, rdzv_conf: dict[str, float | int | str] | None = None,
                 network: Network | None = None, one_host: bool = False) -> None:
        self.out, self.script, self.args, self.one_host = out, script, args, one_host
        self.nnodes, self.run_id, self.max_restarts = nnodes, run_id, max_restarts
        self.rdzv_conf = ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, **(rdzv_conf or {})}.items())
        self.network = network
        self.store: TCPStore | None = None
        if network is None:
            port = free_port()
            self.store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            self.endpoint = f"127.0.0.1:{port}"
        else:
            self.endpoint = network.endpoint
        self.agents: list[subprocess.Popen] = []

    def add_agent(self, node: int) -> subprocess.Popen:
        """Start one more agent (a node of one worker) whose commits go to ``out/../node<node>`` (a node's
        directory outlives one job: a reference run's second job resumes from it); returns its process."""
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes, "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
               "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.2",
               "--rdzv-conf", self.rdzv_conf]
        if self.network is not None:
            env.update(self.network.env)
            cmd += ["--local-addr", self.network.addr(node)]
        commits = self.out.parent / ("host" if self.one_host else f"node{node}")
        cmd += [str(self.script), str(self.out), "--commit-dir", str(commits), *self.args]
        if self.network is not None:
            cmd = self.network.node_argv(node, cmd)
        log = open(self.out / f"agent{len(self.agents)}.log", "w")
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.agents.append(agent)
        return agent

    def wait_for(self, path: Path, timeout: float) -> str:
        """The text of ``path`` once a worker wrote it; AssertionError naming the logs after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {path.name} after {timeout:.0f} s\n{self.report()}")
            time.sleep(0.05)
        time.sleep(0.05)
        return path.read_text()

    def kill_node(self, paused: Path) -> None:
        """SIGKILL the worker that wrote ``paused`` (``"pid agent_pid"``) and its agent."""
        pid, agent = (int(v) for v in self.wait_for(paused, 60).split())
        os.kill(agent, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)

    def freeze_node(self, paused: Path) -> tuple[int, int]:
        """SIGSTOP the agent and then the worker that wrote ``paused`` (``"pid agent_pid"``): a node that
        vanishes without closing its connections (a cut cable, a frozen machine). Returns (worker pid, agent
        pid); the test SIGKILLs them when it is done (:meth:`close` does too)."""
        pid, agent = (int(v) for v in self.wait_for(paused, 60).split())
        os.kill(agent, signal.SIGSTOP)
        os.kill(pid, signal.SIGSTOP)
        return pid, agent

    def kill_worker(self, paused: Path) -> int:
        """SIGKILL only the worker that wrote ``paused`` (a crash, an OOM kill: its agent lives on and restarts
        it); returns its agent's pid."""
        pid, agent = (int(v) for v in self.wait_for(paused, 60).split())
        os.kill(pid, signal.SIGKILL)
        return agent

    def wait(self, timeout: float, agents: list[subprocess.Popen] | None = None) -> list[int]:
        """The exit codes of ``agents`` (default: every agent); on overrun every process is killed and an
        AssertionError names the ranks whose workers stalled (their last logged step) with the agents' log
        tails."""
        deadline = time.monotonic() + timeout
        codes = []
        for agent in (self.agents if agents is None else agents):
            try:
                codes.append(agent.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                report = self.report()
                self.close()
                raise AssertionError(f"the elastic job overran {timeout:.0f} s\n{report}") from None
        return codes

    def report(self) -> str:
        """Each worker's last logged event (by world and rank), then the tail of every agent's log."""
        last: dict[tuple, dict] = {}
        for row in read_steps(self.out):
            last[(row.get("restart", row.get("resumed")), row.get("world"), row.get("rank"))] = row
        lines = [f"restart {r} world {w} rank {k}: last {row.get('event')} at step {row.get('step')}"
                 for (r, w, k), row in sorted(last.items(), key=lambda kv: str(kv[0]))]
        for i in range(len(self.agents)):
            text = (self.out / f"agent{i}.log").read_text(errors="replace")
            lines.append(f"--- agent{i}.log tail ---\n{text[-2500:]}")
        return "\n".join(lines)

    def alive(self) -> list[str]:
        """``"pid: command line"`` of every process still running of this job (agents and workers: their
        command lines name ``out``), zombies excepted."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                zombie = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if os.fsencode(self.out) in argv and not zombie:
                found.append(f"{proc.name}: {b' '.join(argv).decode(errors='replace')[:300]}")
        return found

    def close(self) -> None:
        """Kill every agent and every worker still alive (workers run in sessions of their own)."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for f in self.out.glob("steps.*.jsonl"):
            pid = int(f.name.split(".")[1])
            try:  # only a process still running this script (a finished worker's pid may be reused)
                if self.script.name in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        self.store = None
