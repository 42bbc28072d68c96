"""Gradient-compression kernels: distopt's NumPy versions against plain NumPy baselines.

Single process::

    python benchmarks/compress.py            # 25.6M float32, 7 repeats
    python benchmarks/compress.py --quick    # 2M float32, 3 repeats

On one N(0, 1) float32 vector of ``--n`` elements (25.6M: about ResNet-50's
gradient), each operation is timed ``--repeat`` times after one warm-up
call; ``median ms`` and ``min ms`` are over those repeats, and ``speedup``
is the baseline's median divided by distopt's (> 1: distopt faster).

* top-K 1 % and 0.1 %: :func:`distopt.compress.topk_indices` vs
  ``np.argpartition(np.abs(x), n - k)[n - k:]`` (unsorted; distopt's result
  is sorted, which the baseline does not pay for);
* threshold (``|x| >= 2.5758``, 1 % of entries):
  :func:`distopt.compress.threshold_indices` vs
  ``np.flatnonzero(np.abs(x) >= t)`` (``t``: the smallest float32 >= 2.5758,
  the value distopt compares with);
* float16 cast: :func:`distopt.compress.to_wire` (with the scale 1/2 that
  ``step_half`` applies on 2 ranks) vs ``(x * 0.5).astype(np.float16)``,
  and :func:`distopt.compress.from_wire` vs ``w.astype(np.float32) * 2``;
* densify: :func:`distopt.compress.densify` of two ranks' top-1 % (index,
  value) lists that share half their indices (duplicates add) vs
  ``np.add.at`` into zeros.

The top-K and threshold scans split the array across the CPUs this process
may use (threads; the baselines are single-threaded NumPy): rows marked
``1 thread`` repeat them with the scan held to one thread.

Every distopt result is checked against its baseline (``ok``).

CuPy section: only when CuPy imports and sees a CUDA device. There each
operation's minimal bytes touched (read the input once, write the output
once) divided by its time, as a fraction of the measured device-to-device
copy bandwidth (``cupy.copyto``, read + write), is reported as ``HBM frac``.
Otherwise the section is printed as skipped.

Writes ``benchmarks/results/compress.json`` unless ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import _common
import numpy as np

THRESHOLD_1PCT = 2.5758
# the smallest float32 >= 2.5758: distopt compares |x| >= thr exactly (rounding thr up to x's dtype),
# so the baseline uses the same float32 value (np.float32(2.5758) rounds DOWN and would select more)
T32 = np.float32(THRESHOLD_1PCT)
if float(T32) < THRESHOLD_1PCT:
    T32 = np.nextafter(T32, np.float32(np.inf))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2M elements, 3 repeats")
    p.add_argument("--n", type=int, default=None, help="elements (default 25,600,000; 2,000,000 quick)")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats per operation (default 7; 3 quick)")
    p.add_argument("--no-cupy", action="store_true", help="skip the CuPy section even if CuPy is there")
    p.add_argument("--out", type=Path, default=_common.default_out("compress"), help="JSON output path")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = 2_000_000 if args.quick else 25_600_000
    if args.repeat is None:
        args.repeat = 3 if args.quick else 7
    return args


def bench(fn: Callable[[], Any], repeat: int, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """One warm-up call, then ``repeat`` timed calls; median and min in ms."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_ms": float(np.median(times) * 1e3), "min_ms": float(np.min(times) * 1e3)}


def numpy_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    from distopt.compress import densify, from_wire, k_for, threshold, threshold_indices, to_wire, topk_indices

    n, rep = args.n, args.repeat
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    rows: list[dict[str, Any]] = []

    def row(op: str, dist_fn: Callable[[], Any], base_fn: Callable[[], Any], check: Callable[[Any, Any], bool],
            one_thread: bool = False) -> None:
        d, b = dist_fn(), base_fn()
        ok = bool(check(d, b))
        td, tb = bench(dist_fn, rep), bench(base_fn, rep)
        rows.append({"op": op, "distopt": td, "baseline": tb, "speedup": tb["median_ms"] / td["median_ms"], "ok": ok})
        print(f"  {op}: distopt {td['median_ms']:.1f} ms, baseline {tb['median_ms']:.1f} ms", file=sys.stderr,
              flush=True)
        if one_thread:
            with mock.patch.object(threshold, "_cpus", lambda: 1):
                t1 = bench(dist_fn, rep)
            rows.append({"op": op + " (1 thread)", "distopt": t1, "baseline": tb,
                         "speedup": tb["median_ms"] / t1["median_ms"], "ok": ok})

    same_set = lambda d, b: np.array_equal(np.asarray(d, dtype=np.int64), np.sort(b))  # noqa: E731
    for label, ratio in (("top-K 1%", 0.01), ("top-K 0.1%", 0.001)):
        k = k_for(n, ratio)
        row(label, lambda k=k: topk_indices(x, k), lambda k=k: np.argpartition(np.abs(x), n - k)[n - k:],
            same_set, one_thread=True)
    row(f"threshold |x|>={THRESHOLD_1PCT}", lambda: threshold_indices(x, THRESHOLD_1PCT),
        lambda: np.flatnonzero(np.abs(x) >= T32), same_set, one_thread=True)
    row("float16 cast (x0.5)", lambda: to_wire(x, "float16", 0.5), lambda: (x * np.float32(0.5)).astype(np.float16),
        lambda d, b: np.array_equal(d, b))
    w = to_wire(x, "float16", 0.5)
    row("float16 -> float32 (x2)", lambda: from_wire(w, np.float32, 2.0),
        lambda: w.astype(np.float32) * np.float32(2.0), lambda d, b: np.array_equal(d, b))

    k = k_for(n, 0.01)
    i0 = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
    i1 = np.concatenate([i0[: k // 2], rng.choice(n, k - k // 2, replace=False).astype(np.int32)])
    v0, v1 = rng.standard_normal(k, dtype=np.float32), rng.standard_normal(k, dtype=np.float32)
    idx, val = np.concatenate([i0, i1]), np.concatenate([v0, v1])

    def add_at() -> np.ndarray:
        out = np.zeros(n, dtype=np.float32)
        np.add.at(out, idx, val)
        return out
    row("densify 2x1% (50% dup)", lambda: densify([i0, i1], [v0, v1], n, np.float32), add_at,
        lambda d, b: np.allclose(d, b, rtol=1e-6, atol=1e-6))
    return rows


def cupy_section(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, str | None, float | None]:
    """(rows, skip reason, copy bandwidth in GB/s)."""
    if args.no_cupy:
        return None, "--no-cupy", None
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device", None
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no device
        return None, f"CuPy unavailable ({type(e).__name__}: {e})", None
    import cupyx

    from distopt.compress import densify, from_wire, k_for, threshold_indices, to_wire, topk_indices

    n, rep = args.n, max(args.repeat, 10)
    sync = cp.cuda.Device().synchronize
    x = cp.random.standard_normal(n, dtype=cp.float32)
    y = cp.empty_like(x)
    copy = bench(lambda: cp.copyto(y, x), rep * 5, sync)
    copy_bw = 2 * x.nbytes / (copy["median_ms"] / 1e3) / 1e9
    rows: list[dict[str, Any]] = []

    def row(op: str, nbytes: int, dist_fn: Callable[[], Any], base_fn: Callable[[], Any] | None) -> None:
        td = bench(dist_fn, rep, sync)
        rec: dict[str, Any] = {"op": op, "bytes": nbytes, "distopt": td,
                               "GBps": nbytes / (td["median_ms"] / 1e3) / 1e9}
        rec["hbm_frac"] = rec["GBps"] / copy_bw
        if base_fn is not None:
            tb = bench(base_fn, rep, sync)
            rec["baseline"] = tb
            rec["speedup"] = tb["median_ms"] / td["median_ms"]
        rows.append(rec)

    for label, ratio in (("top-K 1%", 0.01), ("top-K 0.1%", 0.001)):
        k = k_for(n, ratio)
        row(label, 4 * n + 4 * k, lambda k=k: topk_indices(x, k),
            lambda k=k: cp.argpartition(cp.abs(x), n - k)[n - k:])
    thr_k = int(cp.count_nonzero(cp.abs(x) >= T32))
    row(f"threshold |x|>={THRESHOLD_1PCT}", 4 * n + 4 * thr_k, lambda: threshold_indices(x, THRESHOLD_1PCT),
        lambda: cp.flatnonzero(cp.abs(x) >= T32))
    row("float16 cast (x0.5)", 6 * n, lambda: to_wire(x, "float16", 0.5),
        lambda: (x * cp.float32(0.5)).astype(cp.float16))
    w = to_wire(x, "float16", 0.5)
    row("float16 -> float32 (x2)", 6 * n, lambda: from_wire(w, cp.float32, 2.0),
        lambda: w.astype(cp.float32) * cp.float32(2.0))
    k = k_for(n, 0.01)
    i0 = cp.asarray(np.sort(np.random.default_rng(1).choice(n, k, replace=False)).astype(np.int32))
    i1 = cp.concatenate([i0[: k // 2], cp.asarray(np.random.default_rng(2).choice(n, k - k // 2).astype(np.int32))])
    v0, v1 = cp.random.standard_normal(k, dtype=cp.float32), cp.random.standard_normal(k, dtype=cp.float32)
    idx, val = cp.concatenate([i0, i1]), cp.concatenate([v0, v1])

    def scatter() -> Any:
        out = cp.zeros(n, dtype=cp.float32)
        cupyx.scatter_add(out, idx, val)
        return out
    row("densify 2x1% (50% dup)", 4 * n + 16 * k, lambda: densify([i0, i1], [v0, v1], n, cp.float32), scatter)
    return rows, None, copy_bw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = _common.env_info()
    print(f"NumPy section: {args.n:,} float32, {args.repeat} repeats, {_common.cpus()} CPUs", file=sys.stderr)
    rows = numpy_section(args)
    headers = ["operation", "distopt ms", "min", "baseline ms", "min", "speedup", "ok"]
    table_rows = [[r["op"], f"{r['distopt']['median_ms']:.2f}", f"{r['distopt']['min_ms']:.2f}",
                   f"{r['baseline']['median_ms']:.2f}", f"{r['baseline']['min_ms']:.2f}",
                   f"{r['speedup']:.2f}", "yes" if r["ok"] else "NO"] for r in rows]
    print(_common.table(headers, table_rows,
                        f"NumPy, {args.n:,} float32 (N(0,1)), {args.repeat} repeats, {_common.cpus()} CPUs; "
                        "median / min ms; speedup = baseline median / distopt median"))
    cupy_rows, why, copy_bw = cupy_section(args)
    if cupy_rows is None:
        print(f"CuPy section: skipped ({why})")
    else:
        headers = ["operation", "distopt ms", "GB/s", "HBM frac", "baseline ms", "speedup"]
        trows = [[r["op"], f"{r['distopt']['median_ms']:.3f}", f"{r['GBps']:.0f}", f"{r['hbm_frac']:.3f}",
                  f"{r['baseline']['median_ms']:.3f}" if "baseline" in r else None,
                  f"{r['speedup']:.2f}" if "speedup" in r else None] for r in cupy_rows]
        print(_common.table(headers, trows, f"CuPy, {args.n:,} float32; device-to-device copy {copy_bw:.0f} GB/s "
                                            "(read + write); HBM frac = minimal bytes / time / copy bandwidth"))
    data = {"benchmark": "compress", "env": _common.finish_env(env),
            "config": {"n": args.n, "repeat": args.repeat, "threshold_value": THRESHOLD_1PCT, "quick": args.quick,
                       "scan_threads": _threads()},
            "numpy": rows, "cupy": cupy_rows, "cupy_skipped": why, "cupy_copy_GBps": copy_bw}
    print(f"wrote {_common.write_json(args.out, data)}")
    return 0


def _threads() -> int:
    from distopt.compress import threshold

    return threshold._cpus()


if __name__ == "__main__":
    sys.exit(main())
