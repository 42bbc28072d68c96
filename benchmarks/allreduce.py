"""All-reduce bandwidth sweep in the style of nccl-tests' ``all_reduce_perf``.

Run under MPI (the world size comes from the launcher)::

    mpiexec -n 2 python benchmarks/allreduce.py            # full sweep, 8 B .. 256 MiB
    mpiexec -n 2 python benchmarks/allreduce.py --quick    # 8 B .. 4 MiB, fewer iterations

For every message size (float32, sum, in place) and every backend:

* ``distopt-mpi``: :class:`distopt.comm.mpi.MPICommunicator` ``all_reduce``;
* ``distopt-shm``: :class:`distopt.comm.shm.ShmCommunicator` ``all_reduce``
  (job id made by rank 0 and broadcast with mpi4py; skipped with a note if
  the backend fails to import or to start);
* ``mpi4py``: raw ``Comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` on the same
  buffer: the baseline every ratio refers to;
* ``gloo``: ``torch.distributed.all_reduce`` (gloo, tcp://127.0.0.1) on a
  tensor sharing the buffer's memory, when torch is installed.

Each backend first reduces a known pattern once and counts the wrong
elements (``#wrong``, summed over ranks), then runs the remaining warm-up
iterations; then come ``--rounds`` rounds of timed iterations back to back
(20 by default; fewer, but at least 5, when a round would last more than
``--round-seconds``), the backends' rounds interleaved (round 1 of every
backend, then round 2, ...). ``time`` is the max over ranks of the mean time per
iteration of a round, the best round taken (the machine's other processes
add millisecond stalls to single iterations on 2 cores); the median
iteration time is in the JSON too; ``algbw = bytes / time``; ``busbw = algbw *
2 (n - 1) / n`` (nccl-tests' bus bandwidth: the per-link traffic of an
optimal all-reduce, comparable across world sizes). ``xraw`` is a backend's
busbw divided by raw mpi4py's at the same size (> 1: faster than raw MPI).

Rank 0 prints the table and writes JSON (``benchmarks/results/allreduce.json``
unless ``--out``) and a PNG of busbw against message size next to it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import _common
import numpy as np

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="8 B .. 4 MiB, 2 warm-up + 5 timed iterations (seconds)")
    p.add_argument("--min-bytes", type=int, default=8, help="smallest message (default 8)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="largest message (default 256 MiB; 4 MiB with --quick)")
    p.add_argument("--factor", type=int, default=4, help="size step (default x4); the largest size is always run")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up iterations incl. the checked one (default 5; 2 quick)")
    p.add_argument("--iters", type=int, default=None, help="most timed iterations per round (default 1000, so that microsecond calls are timed over ~1000 calls; 5 quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds; time = best round's (max over ranks of the mean per-iteration time) "
                        "(default 3; 1 quick)")
    p.add_argument("--round-seconds", type=float, default=2.0,
                   help="cap on one round's length: fewer timed iterations for slow sizes (default 2 s)")
    p.add_argument("--min-iters", type=int, default=5, help="timed iterations never fewer than this (default 5)")
    p.add_argument("--backends", default="distopt-mpi,distopt-shm,mpi4py,gloo",
                   help="comma-separated subset of distopt-mpi,distopt-shm,mpi4py,gloo")
    p.add_argument("--out", type=Path, default=_common.default_out("allreduce"), help="JSON output path")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.max_bytes is None:
        args.max_bytes = 4 * MiB if args.quick else 256 * MiB
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    if args.iters is None:
        args.iters = 5 if args.quick else 1000
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    args.warmup = max(1, args.warmup)  # the first warm-up call is the checked one
    return args


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    """``lo, lo*factor, ...`` up to ``hi``, plus ``hi`` itself; multiples of 4 bytes."""
    out, s = [], max(4, lo - lo % 4)
    while s < hi:
        out.append(s)
        s *= factor
    out.append(hi - hi % 4)
    return sorted(set(out))


class Backend:
    """A name and ``prepare(buf) -> fn``: ``fn()`` all-reduces ``buf`` (sum, in place)."""

    def __init__(self, name: str, prepare: Callable[[np.ndarray], Callable[[], Any]],
                 close: Callable[[], None] = lambda: None) -> None:
        self.name, self.prepare, self.close = name, prepare, close
        self.error: str | None = None


def make_backends(wanted: list[str], world: Any) -> tuple[list[Backend], dict[str, str]]:
    """Build the requested backends on every rank; returns (usable, {skipped name: reason})."""
    from mpi4py import MPI

    backends: list[Backend] = []
    skipped: dict[str, str] = {}

    def agree(name: str, ok: bool, reason: str) -> bool:
        """All ranks must have built the backend; else it is skipped everywhere."""
        reasons = world.allgather(None if ok else reason)
        bad = [f"rank {r}: {x}" for r, x in enumerate(reasons) if x is not None]
        if bad:
            skipped[name] = "; ".join(bad)
        return not bad

    for name in wanted:
        if name == "distopt-mpi":
            from distopt.comm.mpi import MPICommunicator

            c = MPICommunicator()
            backends.append(Backend(name, lambda buf, c=c: (lambda: c.all_reduce(buf, "sum")), c.close))
        elif name == "mpi4py":
            raw = world.Dup()
            backends.append(Backend(name, lambda buf, raw=raw: (
                lambda: raw.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)), raw.Free))
        elif name == "distopt-shm":
            comm, reason = None, ""
            try:
                from distopt.comm.shm import ShmCommunicator
                from distopt.launch.nccl_id import new_job_id

                job_id = world.bcast(new_job_id() + "-bench" if world.rank == 0 else None, root=0)
                comm = ShmCommunicator(world.rank, world.size, job_id, timeout=60.0)
            except Exception as e:  # noqa: BLE001 - in-progress backend: skip its column
                reason = f"{type(e).__name__}: {e}"
            if agree(name, comm is not None, reason):
                backends.append(Backend(name, lambda buf, c=comm: (lambda: c.all_reduce(buf, "sum")), comm.close))
            elif comm is not None:
                comm.close()
        elif name == "gloo":
            dist, reason = None, ""
            try:
                import torch

                dist = _common.init_gloo(world)
            except Exception as e:  # noqa: BLE001
                reason = f"{type(e).__name__}: {e}"
            if agree(name, dist is not None, reason):
                def prep(buf: np.ndarray, dist: Any = dist, torch: Any = torch) -> Callable[[], Any]:
                    t = torch.from_numpy(buf)
                    return lambda: dist.all_reduce(t)
                backends.append(Backend(name, prep, dist.destroy_process_group))
        else:
            raise SystemExit(f"unknown backend {name!r}")
    return backends, skipped


class Run:
    """One backend at one message size: checked and warmed up, then timed round by round."""

    def __init__(self, be: Backend, fn: Callable[[], Any], iters: int, wrong: int, rounds: int) -> None:
        self.be, self.fn, self.iters, self.wrong = be, fn, iters, wrong
        self.times = np.zeros((rounds, iters))


def _agree_error(be: Backend, err: str | None, world: Any) -> bool:
    """True if no rank failed; else records the failure on ``be`` (every rank alike)."""
    errors = world.allgather(err)
    if any(errors):
        be.error = "; ".join(f"rank {r}: {x}" for r, x in enumerate(errors) if x)
        return False
    return True


def setup_run(be: Backend, buf: np.ndarray, expected: np.ndarray, rank: int, world: Any,
              args: argparse.Namespace) -> Run | None:
    """Check once, warm up, fix the timed-iteration count; None if the backend failed on any rank.

    Every rank runs the same number of calls: the count is derived from the
    warm-up times agreed with an ``allreduce(MAX)``.
    """
    from mpi4py import MPI

    err, wrong, fn, warm = None, 0, None, []
    try:
        fn = be.prepare(buf)
        pattern(buf, rank)
        fn()
        wrong = int(np.count_nonzero(buf != expected))
        buf[...] = 0  # keeps the repeated in-place sums finite
        for _ in range(args.warmup - 1):
            t0 = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - recorded, the backend is dropped on every rank
        err = f"{type(e).__name__}: {e}"
    if not _agree_error(be, err, world):
        return None
    est = world.allreduce(float(np.median(warm)) if warm else 0.0, op=MPI.MAX)
    iters = args.iters
    if est > 0:
        iters = int(min(args.iters, max(args.min_iters, args.round_seconds // est)))
    return Run(be, fn, iters, wrong, args.rounds)


def time_round(run: Run, r: int, world: Any) -> bool:
    """Round ``r`` of ``run``'s timed iterations; False if the backend failed on any rank."""
    err = None
    try:
        world.Barrier()
        for i in range(run.iters):
            t0 = time.perf_counter()
            run.fn()
            run.times[r, i] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    return _agree_error(run.be, err, world)


def summarize(run: Run, nbytes: int, world: Any) -> dict[str, Any]:
    """The record of one backend at one size (same on every rank)."""
    from mpi4py import MPI

    round_means = _max_over_ranks(world, run.times.mean(axis=1))  # per round
    per_iter = _max_over_ranks(world, run.times.reshape(-1))
    wrong = world.allreduce(run.wrong, op=MPI.SUM)
    t = float(round_means.min())
    t_med = float(np.median(per_iter))
    factor = 2 * (world.size - 1) / world.size
    algbw = nbytes / t / 1e9
    return {"time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
            "median_time_us": t_med * 1e6, "median_busbw_GBps": nbytes / t_med / 1e9 * factor,
            "round_means_us": (round_means * 1e6).tolist(), "iters": run.iters, "wrong": wrong}


def _max_over_ranks(world: Any, a: np.ndarray) -> np.ndarray:
    from mpi4py import MPI

    out = np.empty_like(a, dtype=np.float64)
    world.Allreduce(np.ascontiguousarray(a, dtype=np.float64), out, op=MPI.MAX)
    return out


def pattern(buf: np.ndarray, rank: int) -> None:
    """Rank r's input: ``(r + 1) + (i % 5)``; exact in float32."""
    buf[...] = np.arange(buf.size, dtype=np.int64) % 5
    buf += rank + 1


def expected_sum(count: int, n: int) -> np.ndarray:
    e = (np.arange(count, dtype=np.int64) % 5).astype(np.float32) * n
    e += n * (n + 1) // 2
    return e


def plot(path: Path, results: list[dict[str, Any]], names: list[str], n: int) -> str | None:
    """PNG of busbw vs message size, one line per backend; returns an error note or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install matplotlib): no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        pts = [(r["bytes"], r["backends"][name]["busbw_GBps"]) for r in results if name in r["backends"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, float32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce, {n} processes, {_common.cpus()} CPUs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, n = world.rank, world.size
    env = _common.env_info() if rank == 0 else {}
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends, skipped = make_backends(wanted, world)
    names = [b.name for b in backends]
    results = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = nbytes // 4
        buf = np.empty(count, dtype=np.float32)
        expected = expected_sum(count, n)
        row: dict[str, Any] = {"bytes": nbytes, "count": count, "backends": {}}
        runs = [setup_run(be, buf, expected, rank, world, args) for be in backends if not be.error]
        runs = [run for run in runs if run is not None]
        for r in range(args.rounds):  # rounds interleaved across backends: load bursts hit all alike
            runs = [run for run in runs if time_round(run, r, world)]
        for run in runs:
            row["backends"][run.be.name] = summarize(run, nbytes, world)
        for be in backends:
            if be.error and be.name not in skipped:
                skipped[be.name] = f"failed at {nbytes} B: {be.error}"
        base = row["backends"].get("mpi4py")
        for rec in row["backends"].values():
            rec["xraw"] = base["time_us"] / rec["time_us"] if base else None
        results.append(row)
        if rank == 0:
            print(f"  {_common.fmt_bytes(nbytes):>8}: " + "  ".join(
                f"{k} {v['busbw_GBps']:.3g} GB/s" for k, v in row["backends"].items()), file=sys.stderr, flush=True)
        del buf, expected
    for be in backends:
        be.close()
    if rank != 0:
        return 0

    headers = ["size", "count"]
    for name in names:
        headers += [f"{name} us", "busbw", "xraw"]
    headers.append("#wrong")
    rows = []
    for r in results:
        line: list[Any] = [_common.fmt_bytes(r["bytes"]), r["count"]]
        for name in names:
            rec = r["backends"].get(name)
            line += ([f"{rec['time_us']:.1f}", f"{rec['busbw_GBps']:.3f}",
                      f"{rec['xraw']:.2f}" if rec["xraw"] else None] if rec else [None, None, None])
        line.append(sum(v["wrong"] for v in r["backends"].values()))
        rows.append(line)
    title = (f"all-reduce float32 sum in place, {n} processes, {_common.cpus()} CPUs; "
             f"{args.warmup} warm-up + up to {args.iters} timed iterations (>= {args.min_iters}, "
             f"~{args.round_seconds:g} s per round) x {args.rounds} rounds; us = best round's mean per-iteration "
             "time, max over ranks; busbw in GB/s; xraw = busbw / raw mpi4py busbw")
    print(_common.table(headers, rows, title))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")

    summary = {}
    for name in names:
        big = [r["backends"][name]["xraw"] for r in results
               if MiB <= r["bytes"] <= 256 * MiB and name in r["backends"] and r["backends"][name]["xraw"]]
        if big:
            summary[name] = {"xraw_geomean_1MiB_256MiB": float(np.exp(np.mean(np.log(big)))),
                             "xraw_min_1MiB_256MiB": min(big)}
    if "distopt-shm" in summary and "distopt-mpi" in names:
        per = [r["backends"]["distopt-shm"]["busbw_GBps"] / r["backends"]["distopt-mpi"]["busbw_GBps"]
               for r in results if MiB <= r["bytes"] and "distopt-shm" in r["backends"]
               and "distopt-mpi" in r["backends"]]
        if per:
            summary["distopt-shm"]["x_distopt_mpi_min_1MiB_256MiB"] = min(per)
    for name, s in summary.items():
        print(f"{name}: busbw / raw MPI over 1-256 MiB: geomean {s['xraw_geomean_1MiB_256MiB']:.2f}, "
              f"min {s['xraw_min_1MiB_256MiB']:.2f}")

    data = {"benchmark": "allreduce", "env": _common.finish_env(env), "world_size": n,
            "config": {"dtype": "float32", "op": "sum", "in_place": True, "warmup": args.warmup,
                       "iters": args.iters, "min_iters": args.min_iters, "rounds": args.rounds,
                       "round_seconds": args.round_seconds, "min_bytes": args.min_bytes, "max_bytes": args.max_bytes,
                       "factor": args.factor, "quick": args.quick},
            "backends": names, "skipped": skipped, "results": results, "summary": summary}
    out = _common.write_json(args.out, data)
    print(f"wrote {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        note = plot(png, results, names, n)
        print(note or f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run_mpi_main(main))
