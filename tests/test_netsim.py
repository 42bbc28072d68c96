"""benchmarks/netsim.py: the simulated link is built, used and always torn down.

The runs need root, ``ip``, ``tc`` and ``unshare`` (network namespaces);
elsewhere they skip and only the pure parts (rates, ratios, crossings) and
the non-root refusal are tested. A run is identified by its driver's pid:
namespaces ``dnsim<pid>n<i>``, ``/etc/netns/dnsim<pid>*``, temporary
directories ``dnsim<pid>-*`` and ``--run-id dnsim<pid>`` on every launched
command line; after each run none of them may remain, nor any new link in
the root namespace.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.harness import ROOT

NETSIM = ROOT / "benchmarks" / "netsim.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import netsim  # noqa: E402

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
TOOLS = all(shutil.which(t) for t in ("ip", "tc", "unshare", "hostname"))
TINY = ["--workload", "step", "--width-div", "16", "--warmup", "1", "--iters", "1", "--timeout", "150"]
HAVE_TORCH = __import__("importlib").util.find_spec("torch") is not None


def _can_make_netns() -> bool:
    if not (IS_ROOT and TOOLS):
        return False
    name = f"dnsimprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return ok


needs_netns = pytest.mark.skipif(not _can_make_netns(), reason="needs root with ip, tc and unshare, and "
                                 "permission to create network namespaces")
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="the workers need torch")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1"}


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line contains ``marker``."""
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append((int(d.name), cmd))
    return out


def _leftovers(pid: int) -> dict[str, list]:
    run_id = f"{netsim.PREFIX}{pid}"
    etc = Path("/etc/netns")
    return {"netns": [n for n in netsim.netns_list() if n.startswith(run_id)],
            "etc": sorted(p.name for p in etc.glob(f"{run_id}*")) if etc.is_dir() else [],
            "tmp": sorted(p.name for p in Path(tempfile.gettempdir()).glob(f"{run_id}-*")),
            "processes": _processes(run_id)}


def _assert_clean(pid: int, links_before: set[str], wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        left = _leftovers(pid)
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(left.values()), f"left behind: {left}"
    assert _root_links() <= links_before, f"new links in the root namespace: {_root_links() - links_before}"


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(NETSIM), *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_workers(pid: int, timeout: float = 90.0) -> None:
    """Until the run's workers (netsim_worker.py with its run id) are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("netsim_worker.py" in cmd for _, cmd in _processes(f"{netsim.PREFIX}{pid}")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no worker of run {pid} started within {timeout} s")


# --------------------------------------------------------------- anywhere
@pytest.mark.unit
def test_parse_rate_and_format():
    assert netsim.parse_rate("1gbit") == 1e9
    assert netsim.parse_rate("0.1gbit") == pytest.approx(1e8)
    assert netsim.parse_rate("250mbit") == 2.5e8
    assert netsim.parse_rate("5000") == 5000.0
    assert netsim.fmt_rate(1e10) == "10gbit" and netsim.fmt_rate(1e8) == "100mbit"
    for bad in ("fast", "1gbps", "-1gbit", "0gbit"):
        with pytest.raises(ValueError):
            netsim.parse_rate(bad)


@pytest.mark.unit
def test_targets_and_crossings_from_results():
    rec = {"results": {"ddp": {"time_ms": 100.0}, "dense": {"time_ms": 90.0}, "half": {"time_ms": 45.0},
                       "topk1": {"time_ms": 20.0}}, "link_allreduce_ms": 80.0}
    t = netsim.targets(rec, "step")
    assert t["dense / ddp"] == {"ratio": 0.9, "target": 1.0, "met": True}
    assert t["dense / link_allreduce"]["ratio"] == pytest.approx(1.125) and t["dense / link_allreduce"]["met"]
    assert t["topk1 / dense"]["met"] is False and t["dgc / dense"]["ratio"] is None
    sweep = [{"link": {"rate_bits": r}, "results": {"dense": {"time_ms": d}, "half": {"time_ms": h}}}
             for r, d, h in ((1e8, 800.0, 400.0), (1e10, 10.0, 40.0))]
    (cross,) = netsim.crossings(sweep)["half"]["cross_rate_bits"]
    assert 1e8 < cross < 1e10  # log-interpolated: -400 at 1e8, +30 at 1e10
    assert netsim.crossings(sweep)["half"]["faster_than_dense_at"] == ["100mbit"]


@pytest.mark.job
def test_without_root_exits_2_with_a_message():
    """Not root: exit status 2 and a message naming the need (as root, with ``os.geteuid`` made to say 1000)."""
    argv = [str(NETSIM), *TINY]
    if IS_ROOT:  # dropping privileges for real may leave the interpreter unreadable (/root/.pyenv)
        code = ("import os, runpy, sys; os.geteuid = lambda: 1000; "
                f"sys.argv = {argv!r}; runpy.run_path({str(NETSIM)!r}, run_name='__main__')")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, *argv]
    res = subprocess.run(cmd, cwd=ROOT / "benchmarks", env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs root" in res.stderr
    assert not res.stdout  # nothing was started


# -------------------------------------------------------------- as root
@needs_netns
@needs_torch
@pytest.mark.job
def test_tiny_step_run_json_and_teardown(tmp_path):
    links = _root_links()
    out = tmp_path / "netsim.json"
    proc = _start([*TINY, "--out", str(out)])
    try:
        text, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, text[-6000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "netsim" and data["workload"] == "step"
    link = data["link"]
    assert link["rate_bits"] == 1e9 and link["nodes"] == 2 and link["procs_per_node"] == 1
    assert link["delay_ms"] == 0.2 and isinstance(link["delay_applied"], bool)
    assert link["tcp_bits"] > 0 and link["rtt_ms"] > 0
    assert {"date_utc", "cpus", "loadavg_at_start", "loadavg_at_end"} <= set(data["env"])
    assert set(data["results"]) == set(netsim.STEP_VARIANTS)
    for key, rec in data["results"].items():
        assert rec["time_ms"] > 0 and rec["mean_ms"] > 0 and rec["wire_bytes"] > 0, key
        assert rec["link_bytes"] > 0, key  # the bytes went over the namespaces' eth0
    assert data["results"]["topk1"]["wire_bytes"] < data["results"]["dense"]["wire_bytes"] / 10
    assert data["link_allreduce_ms"] > 0 and data["hosts"] == ["node0", "node1"]
    assert data["backend"] == "torch" and data["world_size"] == 2
    _assert_clean(proc.pid, links)


@needs_netns
@needs_torch
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.job
def test_signal_midway_leaves_nothing(sig):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM while its ranks train exits 128+signal, all torn down."""
    links = _root_links()
    proc = _start(["--workload", "step", "--width-div", "4", "--warmup", "1", "--iters", "200", "--rate", "100mbit",
                   "--no-probe", "--out", os.devnull])
    try:
        _wait_for_workers(proc.pid)
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(sig)
        text, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, text[-4000:]
    assert "torn down" in text
    _assert_clean(proc.pid, links)


@needs_netns
@needs_torch
@pytest.mark.job
def test_sigkilled_driver_children_die_and_cleanup_removes_the_rest():
    """SIGKILL leaves the namespaces, but the ranks die with the driver and --cleanup removes the rest."""
    links = _root_links()
    proc = _start(["--workload", "step", "--width-div", "4", "--warmup", "1", "--iters", "200", "--rate", "100mbit",
                   "--no-probe", "--out", os.devnull])
    try:
        _wait_for_workers(proc.pid)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 75  # torchrun's agent, on SIGTERM, gives its workers up to 30 s to exit
        while _processes(f"{netsim.PREFIX}{proc.pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes(f"{netsim.PREFIX}{proc.pid}"), "processes outlived the SIGKILLed driver"
    finally:
        res = subprocess.run([sys.executable, str(NETSIM), "--cleanup"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    _assert_clean(proc.pid, links)


@needs_netns
@pytest.mark.job
def test_cleanup_removes_leftovers_of_dead_drivers():
    """``--cleanup`` deletes the namespace and ``/etc/netns`` entry named after a driver pid that is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = f"{netsim.PREFIX}{dead.pid}n0"
    try:
        subprocess.run(["ip", "netns", "add", gone], check=True)
        (Path("/etc/netns") / gone).mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, str(NETSIM), "--cleanup"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert gone not in netsim.netns_list() and not (Path("/etc/netns") / gone).exists()
        assert f"removed namespace {gone}" in res.stderr
    finally:
        subprocess.run(["ip", "netns", "delete", gone], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / gone, ignore_errors=True)
