"""Helpers shared by the benchmark scripts (not a public module).

Every script imports this first: it puts the repository root on ``sys.path``
(so ``import distopt`` works from a plain checkout) and provides the output
path rule (``benchmarks/results/<name>.json`` unless ``--out``), a plain-text
table printer and a description of the machine and library versions that is
stored with every result.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["BENCH_DIR", "ROOT", "RESULTS_DIR", "default_out", "write_json", "table", "env_info",
           "fmt_bytes", "cpus", "cpu_busy", "finish_env", "wait_quiet", "free_port", "init_gloo", "mpiexec",
           "run_mpi_main"]


def default_out(name: str) -> Path:
    """``benchmarks/results/<name>.json``."""
    return RESULTS_DIR / f"{name}.json"


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    return str(obj)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Right-aligned plain-text table (floats already formatted by the caller, or with ``:.4g``)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def fmt_bytes(n: int) -> str:
    """``8 B``, ``32 KiB``, ``256 MiB`` (powers of two shown exactly, others to 3 digits)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def finish_env(info: dict[str, Any]) -> dict[str, Any]:
    """Add the end time, load and commit to :func:`env_info`'s record (taken at the start)."""
    end = git_info()
    info["date_end_utc"] = _now()
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if end != {k: info.get(k) for k in end}:
        info["git_at_end"] = end  # the checkout changed while the benchmark ran
    return info


def env_info(mpi: bool = True) -> dict[str, Any]:
    """Date, machine and library versions, stored with every result (call it when the run starts).

    ``mpi=False`` leaves out the MPI library's version, which needs MPI
    initialized (a driver that launches ``mpiexec`` jobs must not be an MPI
    process itself).
    """
    info: dict[str, Any] = {
        "date_utc": _now(),
        "host": socket.gethostname(),
        "cpus": cpus(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for mod in ("numpy", "torch", "mpi4py", "cupy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: just not recorded
            info[mod] = None
    if info["mpi4py"] and mpi:
        try:
            from mpi4py import MPI

            info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            pass
    info.update(git_info())
    for var in ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info


def git_info() -> dict[str, Any]:
    """The checkout's commit and whether ``distopt/`` differs from it (read-only git calls)."""
    import subprocess

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "distopt")
    return {"git_commit": commit, "distopt_modified": None if dirty is None else bool(dirty)}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy (user + system + ...) over ``interval`` seconds, from /proc/stat."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle

    import time

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(max_wait: float, busy: float = 0.15, log: Any = None) -> float:
    """Wait (up to ``max_wait`` s) until the CPUs are less than ``busy`` busy; returns the last reading.

    The benchmarks run on shared machines: another job's processes skew
    every number, so a full run can wait for a quiet moment first.
    """
    import time

    deadline = time.monotonic() + max_wait
    while True:
        b = cpu_busy(1.0)
        if b < busy or time.monotonic() >= deadline:
            return b
        if log:
            log(f"waiting for a quiet machine: CPUs {b:.0%} busy")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(mpi_comm: Any, timeout_s: float = 120.0) -> Any:
    """``torch.distributed`` with gloo over 127.0.0.1, ranks from ``mpi_comm``.

    Rank 0 picks a free port and broadcasts it (lowercase ``bcast``: setup,
    not the data path); a default group that exists (made by distopt's MPI
    world) is kept. Returns the ``torch.distributed`` module.
    """
    import datetime as _dt

    import torch.distributed as dist

    if dist.is_initialized():  # distopt's MPI world made the default group already
        return dist
    port = mpi_comm.bcast(free_port() if mpi_comm.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=mpi_comm.rank,
                            world_size=mpi_comm.size, timeout=_dt.timedelta(seconds=timeout_s))
    return dist


def run_mpi_main(main: Any) -> int:
    """Run ``main()`` under MPI; an exception on any rank aborts the whole job (no hang)."""
    try:
        return main()
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        return 1


def mpiexec() -> str:
    """The ``mpiexec`` next to this Python (pip's mpich), else the one on PATH."""
    import shutil

    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mpiexec not found: pip install 'distopt[mpich]' or install an MPI runtime")
    return found
