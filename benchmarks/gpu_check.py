"""The GPU check: one command that runs distopt's GPU path on this machine and prints a JSON report.

    python benchmarks/gpu_check.py             # the installed CuPy on this machine's GPU(s)
    python benchmarks/gpu_check.py --standin   # the CPU stand-in of CuPy and NCCL (tests/standin)

Parts, each in a process of its own under a deadline (a crash or a hang is
reported, the other parts still run):

* ``versions``: Python, NumPy, CuPy, whether CuPy loads NCCL and its
  version, the devices, PyTorch and whether it sees CUDA;
* ``tests``: ``pytest -m gpu`` (with ``--cupy standin`` on the stand-in):
  passed, failed and skipped counts;
* ``nccl_w1``: ``DistOpt`` in the multiprocessing mode at world size 1
  (NCCL), every registered strategy on CuPy arrays against its NumPy twin,
  bit for bit; distopt's host waits per step and, on the stand-in, every
  host synchronisation per step;
* ``shared``: two processes sharing device 0 over shared memory (NCCL
  refuses two ranks on one GPU), every strategy on CuPy against NumPy in
  each process, bit for bit, and the replicas against each other;
* ``timing``: a dense step of 4 Mi float32 elements in 16 tensors over NCCL
  at world size 1 against the same step on NumPy (median of 10, ms).

Every part has a deadline (:data:`PARTS`, 14 minutes in all), so the check
ends even when something hangs. The report goes to
``benchmarks/results/gpu_check.json`` (``--out``); the exit status is 1 when
a part failed, a test failed or a strategy's bits differ.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

STANDIN = _common.ROOT / "tests" / "standin"
MARK = "GPU-CHECK-RESULT "
SIZE = 1 << 22
TENSORS = 16


def _env(standin: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(STANDIN)] if standin else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(_common.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    if standin:
        env["CUPY_STANDIN_DEVICES"] = "1"  # a one-GPU machine, the kind this check is planned for
    return env


def _run_part(name: str, standin: bool, timeout: float) -> dict[str, Any]:
    """``gpu_check.py --part NAME`` in a process of its own: its result, or what went wrong."""
    start = time.monotonic()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name]
    try:
        res = subprocess.run(cmd, cwd=_common.ROOT, env=_env(standin), capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"ok": False, "error": f"did not finish within {timeout} s", "tail": out[-2000:],
                "seconds": round(time.monotonic() - start, 1)}
    found = [line[len(MARK):] for line in res.stdout.splitlines() if line.startswith(MARK)]
    if res.returncode != 0 or not found:
        return {"ok": False, "error": f"exit status {res.returncode}", "tail": (res.stdout + res.stderr)[-3000:],
                "seconds": round(time.monotonic() - start, 1)}
    result = json.loads(found[-1])
    result.setdefault("ok", True)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _report(result: Any) -> None:
    print(MARK + json.dumps(result, default=_common._json_default), flush=True)


# -- the parts, each run as ``--part NAME`` ---------------------------------------------------------------------

def part_versions() -> dict[str, Any]:
    import numpy as np

    import cupy
    from cupy.cuda import nccl

    info: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__, "cupy": cupy.__version__,
                            "standin": bool(getattr(cupy, "STANDIN", False)), "nccl_available": bool(nccl.available)}
    info["nccl_version"] = nccl.get_version() if nccl.available else None
    info["devices"] = cupy.cuda.runtime.getDeviceCount()
    if not info["standin"]:
        info["device_name"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    try:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.cuda.is_available())
    except ImportError:
        info.update(torch=None, torch_cuda=False)
    return info


STEPS = 4


def _train(opt: Any, xp: Any, rank: int, syncs: list[int] | None = None) -> list[Any]:
    """Parameters after :data:`STEPS` steps of rank ``rank``'s gradients (the strategy tests' shapes); the
    stand-in's host synchronisations during the steps are appended to ``syncs``."""
    import numpy as np

    sys.path.insert(0, str(_common.ROOT))
    from tests.support.strategy_data import SHAPES, grads_for, params_for

    params = [xp.asarray(p.astype(np.float32)) for p in params_for(SHAPES)]
    opt.sync_params(params)
    grads = [[xp.asarray(g) for g in grads_for(s, rank, SHAPES, np.float32)] for s in range(STEPS)]
    counters = getattr(getattr(xp, "_state", None), "counters", None)
    before = counters.host_syncs if counters else 0
    for s in range(STEPS):
        opt.step(params, grads[s], threshold=100)
    if counters and syncs is not None:
        syncs.append(counters.host_syncs - before)
    return [p.get() if hasattr(p, "get") else p for p in params]


def _examples() -> dict[str, Any]:
    import cupy

    from distopt.strategies.registry import REGISTRY

    wanted = {}
    for key, example in REGISTRY.items():
        if key == "half-bf16" and int(cupy.__version__.split(".")[0]) < 14:
            continue  # bfloat16 on the device needs CuPy 14
        wanted[key] = example
    return wanted


def part_nccl_w1() -> dict[str, Any]:
    import numpy as np

    import cupy
    import distopt

    counters = getattr(cupy, "_state", None)
    strategies: dict[str, Any] = {}
    for key, example in _examples().items():
        local = distopt.SGD(lr=0.05, momentum=example.local_momentum)
        twin = _train(distopt.DistOpt(local, strategy=example.build(), backend="single"), np, 0)
        opt = distopt.DistOpt(distopt.SGD(lr=0.05, momentum=example.local_momentum), strategy=example.build(),
                              nccl_id=distopt.NcclIdHolder(), gpu_num=0, gpu_per_node=1)
        backend, waits, syncs = opt.comm.name, opt.stats.host_syncs, []
        got = _train(opt, cupy, 0, syncs)
        strategies[key] = {
            "backend": backend,
            "bitwise": all(np.array_equal(a, b) for a, b in zip(got, twin)),
            "host_waits_per_step": (opt.stats.host_syncs - waits) / STEPS,
            "host_syncs_per_step": syncs[0] / STEPS if syncs else None,
        }
        opt.close()
    return {"ok": all(s["bitwise"] and s["backend"] == "nccl" for s in strategies.values()),
            "strategies": strategies,
            "host_syncs_counted": "every synchronisation (the stand-in counts them)" if counters else
            "distopt's own host waits only (a real CuPy's implicit synchronisations are not counted here)"}


def _shared_worker(holder: Any, gpu_num: int, gpu_per_node: int, folder: str) -> None:
    import numpy as np

    import cupy
    import distopt

    cupy.cuda.Device(0).use()  # both processes on device 0
    results: dict[str, Any] = {}
    for key, example in _examples().items():
        runs = []
        for xp in (np, cupy):
            opt = distopt.DistOpt(distopt.SGD(lr=0.05, momentum=example.local_momentum), strategy=example.build(),
                                  nccl_id=holder, gpu_num=gpu_num, gpu_per_node=gpu_per_node)
            runs.append(_train(opt, xp, gpu_num))
            backend = opt.comm.name
            opt.close()
        results[key] = {"backend": backend, "bitwise": all(np.array_equal(a, b) for a, b in zip(*runs)),
                        "params": [p.tolist() for p in runs[1]]}
    Path(folder, f"rank{gpu_num}.json").write_text(json.dumps(results))


def part_shared() -> dict[str, Any]:
    from distopt.launch import spawn
    from distopt.strategies.registry import REGISTRY

    with tempfile.TemporaryDirectory() as folder:
        spawn(_shared_worker, 2, args=(folder,), timeout=300)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    strategies = {}
    for key in ranks[0]:
        same = ranks[0][key]["params"] == ranks[1][key]["params"]
        strategies[key] = {"backend": ranks[0][key]["backend"],
                           "bitwise": ranks[0][key]["bitwise"] and ranks[1][key]["bitwise"],
                           "replicas_identical": same if REGISTRY[key].build().identical_replicas else None}
    return {"ok": all(s["bitwise"] and s["replicas_identical"] is not False and s["backend"] == "shm"
                      for s in strategies.values()), "strategies": strategies}


def part_timing() -> dict[str, Any]:
    import numpy as np

    import cupy
    import distopt

    def median_ms(opt: Any, xp: Any) -> float:
        params = [xp.zeros(SIZE // TENSORS, dtype=xp.float32) for _ in range(TENSORS)]
        grads = [xp.ones(SIZE // TENSORS, dtype=xp.float32) for _ in range(TENSORS)]
        times = []
        for i in range(12):
            start = time.perf_counter()
            opt.step(params, grads)
            if xp is cupy:
                cupy.cuda.Device().synchronize()
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        opt.close()
        return float(np.median(times))

    numpy_ms = median_ms(distopt.DistOpt(distopt.SGD(lr=0.1), backend="single"), np)
    cupy_ms = median_ms(distopt.DistOpt(distopt.SGD(lr=0.1), nccl_id=distopt.NcclIdHolder(), gpu_num=0,
                                        gpu_per_node=1), cupy)
    return {"elements": SIZE, "tensors": TENSORS, "numpy_ms": round(numpy_ms, 3), "cupy_nccl_ms": round(cupy_ms, 3),
            "ratio": round(cupy_ms / numpy_ms, 3)}


def part_tests(standin: bool, timeout: float) -> dict[str, Any]:
    """``pytest -m gpu`` (its own process tree; the suite brings in the stand-in itself)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if standin:
        cmd += ["--cupy", "standin"]
    try:
        res = subprocess.run(cmd, cwd=_common.ROOT, env=_env(False), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"did not finish within {timeout} s"}
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", res.stdout)}
    return {"ok": res.returncode == 0 and counts.get("passed", 0) > 0, "counts": counts,
            "summary": res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-500:]}


PARTS = {"versions": 60, "tests": 300, "nccl_w1": 120, "shared": 240, "timing": 120}  # deadlines, seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--standin", action="store_true", help="use the CPU stand-in of CuPy and NCCL")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to leave out, of {', '.join(PARTS)}")
    parser.add_argument("--out", default=None, help="JSON report path (default benchmarks/results/gpu_check.json)")
    parser.add_argument("--part", choices=sorted(set(PARTS) - {"tests"}), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = {p for p in args.skip.split(",") if p} - set(PARTS)
    if unknown:
        parser.error(f"--skip: unknown parts {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part:
        _report(globals()[f"part_{args.part}"]())
        return 0
    started = time.monotonic()
    skipped = {p for p in args.skip.split(",") if p}
    report: dict[str, Any] = {"env": _common.env_info(mpi=False), "standin": args.standin}
    for name, timeout in PARTS.items():
        if name in skipped:
            continue
        if name == "tests":
            start = time.monotonic()
            result = part_tests(args.standin, timeout)
            result["seconds"] = round(time.monotonic() - start, 1)
        else:
            result = _run_part(name, args.standin, timeout)
        report[name] = result
        print(f"{name}: {'ok' if result.get('ok') else 'FAILED'} ({result.get('seconds')} s)", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = all(report[p].get("ok") for p in PARTS if p in report)
    _common.finish_env(report["env"])
    path = _common.write_json(args.out or _common.default_out("gpu_check"), report)
    rows = []
    for part in ("nccl_w1", "shared"):
        for key, s in (report.get(part) or {}).get("strategies", {}).items():
            rows.append([part, key, s["backend"], s["bitwise"], s.get("replicas_identical", ""),
                         s.get("host_waits_per_step", ""), s.get("host_syncs_per_step", "")])
    print(_common.table(["part", "strategy", "backend", "bitwise", "replicas", "waits/step", "syncs/step"], rows,
                        title="CuPy against its NumPy twin"))
    if "timing" in report and report["timing"].get("ok"):
        t = report["timing"]
        print(f"dense step, {t['elements']} float32 in {t['tensors']} tensors: NumPy {t['numpy_ms']} ms, "
              f"CuPy over NCCL {t['cupy_nccl_ms']} ms ({t['ratio']}x)")
    if "tests" in report:
        print(f"pytest -m gpu: {report['tests'].get('summary', report['tests'].get('error'))}")
    print(json.dumps({"ok": report["ok"], "report": str(path)}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
