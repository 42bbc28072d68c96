"""One DistOpt step on ResNet-50's gradients against raw all-reduce baselines.

Run under MPI::

    mpiexec -n 2 python benchmarks/step.py            # full: 3 warm-up + 10 timed steps each
    mpiexec -n 2 python benchmarks/step.py --quick    # 1 warm-up + 3 timed steps each

The gradients have ResNet-50's shapes (torchvision's ``resnet50()``
parameters in ``model.parameters()`` order: 161 float32 tensors, 25,557,032
elements, built by hand below), filled with N(0, 1) noise (a different seed
per rank). Every variant starts each iteration from the same gradients
(restored, untimed), then a barrier, then the timed call. ``time`` is the
max over ranks of each iteration's time, averaged over the timed iterations
(``min`` is the fastest iteration; ``x raw`` and ``x ddp`` use ``time``).

The variants' timed iterations are interleaved (iteration 1 of every
variant, then iteration 2, ...) after each variant's warm-ups, so a burst
of load from other processes on a shared machine hits them alike.

Baselines (communication only):

* ``raw-allreduce``: one mpi4py ``Allreduce(IN_PLACE)`` of all 25,557,032
  floats in a preallocated flat buffer: the reference for ``x raw``;
* ``naive-per-tensor``: one ``Allreduce`` per gradient tensor (161 calls);
* ``layout``: DistOpt's own bucket layout for the plain strategy (reverse
  order, 1 MiB first bucket, the plain strategy's default threshold and
  the default buffer size), the buckets prepacked in flat buffers and
  reduced one ``Allreduce`` at a time (no packing timed);
* ``layout-avg``: the same, each bucket then divided by the world size
  (the mean, which a step must deliver: the floor of a dense step here);
* ``ddp-gloo-bucketed``: PyTorch DDP's scheme without the backward overlap:
  tensors in reverse order packed into 25 MiB buckets, each divided by the
  world size and all-reduced with ``torch.distributed`` gloo
  (``async_op=True``, all buckets in flight, as DDP launches them), then
  unpacked. ``x ddp`` refers to it.

* ``update``: the local ``SGD(lr, momentum=0.9, weight_decay=1e-4)``
  update alone, on the same arrays (no communication);
* ``copy``: one pass over the gradient buffers (``np.copyto`` of every
  gradient into a preallocated twin; no communication): the unit of
  ``passes`` below.

DistOpt (MPI backend, default threshold and buffer size):

* ``step`` (dense, includes the local SGD update of the 25.6M parameters,
  momentum 0.9, weight decay 1e-4), and ``step, no-op update``: the same
  with a local optimizer whose update does nothing, i.e. DistOpt's
  communication path alone;
* with a local optimizer that does nothing (the strategy's path alone, as
  ``step, no-op update``): ``step_half`` (float16 and bfloat16 wire),
  ``step_sparse`` top-K 1 % and 0.1 %,
  ``step_sparse`` threshold (``|g| >= 2.5758``: 1 % of N(0, 1) entries;
  residuals zeroed before each iteration, untimed, so the density stays at
  the first step's), ``step_partial``, DGC (``DGC(sparsity=0.99)``: 1 %
  kept per tensor, with momentum correction) and
  PowerSGD (``PowerSGD(matrix_rank=2)``, 1-D tensors dense).

Every rank runs its BLAS (``threadpoolctl``) and torch thread pools with
``max(1, CPUs // ranks)`` threads, its share of the machine: with
OpenBLAS's default of one thread per CPU in every rank, two ranks on two
CPUs oversubscribe them, and PowerSGD's matrix-vector products then cost
several times their single-threaded CPU time in spinning worker threads.

``cpu ms`` is this process's CPU time per timed call (``time.process_time``:
every thread of the rank, the max over ranks), and ``passes`` that over the
``copy`` row's: how many passes over the gradients a step costs in CPU.

``wire MB`` and ``dense MB`` are this rank's bytes handed to the collectives
per step and what a dense all-reduce of the same gradients would hand over
(deltas of ``opt.stats``); ``ctl/step`` counts the engine's own small
collectives per step (``stats.control_collectives``: the step header, plus
the gradient flags when the header could not settle the step). ``extra MB`` is the memory a DistOpt variant
still holds after its warm-up steps (fusion buffers, residuals, wire
buffers), traced by ``tracemalloc`` (NumPy reports its allocations there),
and ``extra/grad`` that over the gradients' bytes.

Ratios printed after the table (the performance targets): the no-op step over
the fastest raw baseline, the SGD step over (fastest raw + update alone),
each compressor over the dense no-op step, and the ZeRO steps over the
dense step of the same local optimizer.
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import _common
import _zero
import numpy as np

RESNET50_PARAMS = 25_557_032
RESNET50_TENSORS = 161
THRESHOLD_1PCT = 2.5758  # P(|N(0,1)| >= t) = 1 %


def resnet50_shapes(num_classes: int = 1000, width_div: int = 1) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ``resnet50()``, in ``model.parameters()`` order.

    conv1 7x7/64 (no bias), bn1; four stages of Bottleneck blocks
    ([3, 4, 6, 3] blocks, widths 64, 128, 256, 512, expansion 4): conv1 1x1,
    bn1, conv2 3x3, bn2, conv3 1x1, bn3, plus a downsample (1x1 conv, bn) in
    each stage's first block; fc 2048 -> ``num_classes`` with bias. Convs
    have no bias; each BatchNorm has a weight and a bias. ``width_div``
    divides every width (the same 161 tensors, smaller: for smoke runs).
    """
    w = 64 // width_div
    shapes: list[tuple[int, ...]] = [(w, 3, 7, 7), (w,), (w,)]
    inplanes = w
    for planes, blocks in zip((w, 2 * w, 4 * w, 8 * w), (3, 4, 6, 3)):
        for b in range(blocks):
            out = planes * 4
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (out, planes, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    shapes += [(num_classes, 32 * w), (num_classes,)]
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed iterations per variant")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 3; 1 quick)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; 3 quick)")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of the variant keys (default: all); see --list")
    p.add_argument("--list", action="store_true", help="print the variant keys and exit")
    p.add_argument("--bucket-mib", type=float, default=25.0, help="DDP-style bucket size (default 25 MiB)")
    p.add_argument("--width-div", type=int, default=1,
                   help="divide ResNet-50's widths by this (smoke runs; default 1: the real shapes)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--out", type=Path, default=_common.default_out("step"), help="JSON output path")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (phases as stacked bars)")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.iters is None:
        args.iters = 3 if args.quick else 10
    return args


class NoOpUpdate:
    """A local optimizer whose update does nothing: times DistOpt's communication path alone."""

    def update(self, param: Any, grad: Any) -> None:  # noqa: ARG002
        pass


# key -> (label, group); group "base" = baselines, "dist" = DistOpt variants
VARIANTS: dict[str, tuple[str, str]] = {
    "raw": ("raw-allreduce (one flat buffer)", "base"),
    "naive": ("naive-per-tensor (161 Allreduce)", "base"),
    "layout": ("DistOpt's buckets, one Allreduce each", "base"),
    "layout_avg": ("DistOpt's buckets, Allreduce + divide", "base"),
    "update": ("SGD update alone (momentum, wd)", "base"),
    "ddp": ("ddp-gloo-bucketed (25 MiB, reverse)", "base"),
    "step": ("DistOpt.step (SGD update incl.)", "dist"),
    "step_noop": ("DistOpt.step, no-op update", "dist"),
    "half": ("DistOpt.step_half (float16)", "dist"),
    "half_bf16": ("DistOpt.step_half (bfloat16)", "dist"),
    "topk1": ("DistOpt.step_sparse topK 1%", "dist"),
    "topk01": ("DistOpt.step_sparse topK 0.1%", "dist"),
    "thresh": (f"DistOpt.step_sparse |g|>={THRESHOLD_1PCT}", "dist"),
    "partial": ("DistOpt.step_partial", "dist"),
    "dgc": ("DistOpt.step DGC 1%", "dist"),
    "powersgd": ("DistOpt.step PowerSGD rank 2", "dist"),
    "copy": ("one pass over the gradients (copy)", "base"),
    "zero1": ("DistOpt.step zero=1 (SGD)", "dist"),
    "zero2": ("DistOpt.step zero=2 (SGD)", "dist"),
    "step_adam": ("DistOpt.step (NumPy Adam)", "dist"),
    "zero1_adam": ("DistOpt.step zero=1 (NumPy Adam)", "dist"),
    "zero_torch": ("torch ZeroRedundancyOptimizer (SGD, gloo)", "base"),
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for k, (label, _) in VARIANTS.items():
            print(f"{k:10} {label}")
        return 0
    import threadpoolctl  # the bench extra (pip install -e ".[bench]")
    from mpi4py import MPI

    import distopt

    world = MPI.COMM_WORLD
    rank, n = world.rank, world.size
    env = _common.env_info() if rank == 0 else {}
    keys = list(VARIANTS) if args.variants is None else [k.strip() for k in args.variants.split(",") if k.strip()]
    for k in keys:
        if k not in VARIANTS:
            raise SystemExit(f"unknown variant {k!r}; choose from {', '.join(VARIANTS)}")

    shapes = resnet50_shapes()
    sizes = [int(np.prod(s)) for s in shapes]
    assert len(shapes) == RESNET50_TENSORS, len(shapes)
    assert sum(sizes) == RESNET50_PARAMS, sum(sizes)
    if args.width_div != 1:
        shapes = resnet50_shapes(width_div=args.width_div)
        sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)

    # one rank's share of the CPUs for every thread pool, as benchmarks/netsim.py gives its workers: the
    # ranks of one machine must not oversubscribe it (OpenBLAS would start one thread per CPU in every rank)
    threads = max(1, _common.cpus() // n)
    threadpoolctl.threadpool_limits(limits=threads, user_api="blas")
    torch = None
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass

    rng = np.random.default_rng(1234 + rank)
    master = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [g.copy() for g in master]
    params_rng = np.random.default_rng(99)  # same initial params everywhere (DistOpt broadcasts anyway)
    params = [(params_rng.standard_normal(s, dtype=np.float32) * 0.01) for s in shapes]

    def restore() -> None:
        for g, m in zip(grads, master):
            np.copyto(g, m)

    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}

    class Variant:
        """A timed call, what to do before it (untimed) and, for DistOpt, its stats and cleanup."""

        def __init__(self, key: str, fn: Callable[[], Any], prepare: Callable[[], Any] = restore,
                     stats: dict[str, int] | None = None, close: Callable[[], Any] = lambda: None) -> None:
            self.key, self.fn, self.prepare, self.stats, self.close = key, fn, prepare, stats, close
            self.times = np.zeros(args.iters)
            self.cpu = np.zeros(args.iters)  # process CPU seconds per timed call
            self.before: dict[str, int] | None = None

        def run(self) -> tuple[float, float]:
            """One call: ``(wall seconds, this process's CPU seconds)``."""
            self.prepare()
            world.Barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            self.fn()
            t1, c1 = time.perf_counter(), time.process_time()
            return t1 - t0, c1 - c0

    variants: list[Variant] = []
    extra: dict[str, int] = {}  # bytes a DistOpt variant holds after its warm-up (tracemalloc)
    memory: dict[str, dict[str, int]] = {}  # optimizer state and gradient bytes per rank after the warm-ups
    dist = None
    for key in keys:
        if key == "raw":
            raw = world.Dup()
            flat = np.concatenate([g.reshape(-1) for g in master])
            flat_master = flat.copy()
            variants.append(Variant(key, lambda raw=raw, flat=flat: raw.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT],
                                                                                  MPI.SUM),
                                    prepare=lambda flat=flat, fm=flat_master: np.copyto(flat, fm), close=raw.Free))
        elif key == "naive":
            raw = world.Dup()

            def naive(raw: Any = raw) -> None:
                for g in grads:
                    raw.Allreduce(MPI.IN_PLACE, [g, MPI.FLOAT], MPI.SUM)
            variants.append(Variant(key, naive, close=raw.Free))
        elif key in ("layout", "layout_avg"):
            raw = world.Dup()
            plan = distopt.core.buckets.plan_buckets([(g.shape, g.dtype) for g in master],
                                               distopt.strategies.Dense.default_threshold, 4194304, reverse=True,
                                               first_bucket=distopt.step.engine.FIRST_BUCKET)
            flats = [distopt.core.buckets.pack(b, master)[0].copy() for b in plan]

            def layout(raw: Any = raw, flats: list[np.ndarray] = flats, avg: bool = key == "layout_avg") -> None:
                for f in flats:
                    raw.Allreduce(MPI.IN_PLACE, [f, MPI.FLOAT], MPI.SUM)
                    if avg:
                        np.divide(f, n, out=f)
            variants.append(Variant(key, layout, prepare=lambda: None, close=raw.Free))
        elif key == "copy":
            twins = [np.empty_like(g) for g in grads]
            variants.append(Variant(key, lambda twins=twins: [np.copyto(t, g) for t, g in zip(twins, grads)],
                                    prepare=lambda: None))
        elif key == "update":
            sgd = distopt.SGD(lr=args.lr, momentum=0.9, weight_decay=1e-4)
            variants.append(Variant(key, lambda sgd=sgd: [sgd.update(p, g) for p, g in zip(params, grads)]))
        elif key == "ddp":
            reason = None
            try:
                if torch is None:
                    raise ImportError("torch is not installed")
                dist = _common.init_gloo(world)
            except Exception as e:  # noqa: BLE001
                reason = f"{type(e).__name__}: {e}"
            reasons = world.allgather(reason)
            if any(reasons):
                skipped[key] = "; ".join(f"rank {r}: {x}" for r, x in enumerate(reasons) if x)
                dist = None
                continue
            variants.append(Variant(key, ddp_bucketed(torch, dist, grads, args.bucket_mib, n)))
        elif key == "zero_torch":
            if dist is None or torch is None:
                skipped[key] = "needs the ddp variant (gloo) in the same run"
                continue
            step_fn, state_fn = _zero.zero_torch(torch, dist, params, grads, args.lr, args.bucket_mib, n, ddp_bucketed)
            variants.append(Variant(key, step_fn))
            for _ in range(max(args.warmup, 1)):
                variants[-1].run()
            memory[key] = {"optimizer_state_bytes": state_fn()}
        else:
            # only ``step`` updates (SGD, momentum, weight decay); the others time the strategy's path alone
            if key in ("step", "zero1", "zero2"):
                local: Any = distopt.SGD(lr=args.lr, momentum=0.9, weight_decay=1e-4)
            else:
                local = _zero.NumpyAdam(lr=1e-4) if key in ("step_adam", "zero1_adam") else NoOpUpdate()
            tracemalloc.start()
            traced_before = tracemalloc.get_traced_memory()[0]
            zero = {"zero1": 1, "zero2": 2, "zero1_adam": 1}.get(key, 0)
            strategy: Any = None
            if key == "dgc":
                strategy = distopt.strategies.DGC(sparsity=0.99)
            elif key == "powersgd":
                strategy = distopt.strategies.PowerSGD(matrix_rank=2)
            opt = distopt.DistOpt(local, backend="mpi", zero=zero, strategy=strategy)
            # every other variant times the plain step
            call: Callable[[], Any] = {
                "half": lambda opt=opt: opt.step_half(params, grads),
                "half_bf16": lambda opt=opt: opt.step_half(params, grads, wire="bfloat16"),
                "topk1": lambda opt=opt: opt.step_sparse(params, grads, spars=0.01, topK=True),
                "topk01": lambda opt=opt: opt.step_sparse(params, grads, spars=0.001, topK=True),
                "thresh": lambda opt=opt: opt.step_sparse(params, grads, spars=THRESHOLD_1PCT, topK=False),
                "partial": lambda opt=opt: opt.step_partial(params, grads),
            }.get(key, lambda opt=opt: opt.step(params, grads))

            def prepare(opt: Any = opt) -> None:
                restore()
                residuals = getattr(opt.active_strategy, "residuals", None)
                for r in residuals.buffers.values() if residuals is not None else ():
                    r[...] = 0
            variants.append(Variant(key, call, prepare=prepare, stats=opt.stats, close=opt.close))
            for _ in range(max(args.warmup, 1)):  # what the variant holds after its first steps
                variants[-1].run()
            if key not in ("step", "zero1", "zero2", "step_adam", "zero1_adam"):  # the optimizer's own state
                extra[key] = tracemalloc.get_traced_memory()[0] - traced_before  # is not DistOpt's extra memory
            tracemalloc.stop()
            memory[key] = {k: int(opt.stats[k]) for k in ("optimizer_state_bytes", "gradient_bytes")}

    # warm-ups, then the timed iterations interleaved (iteration i of every variant, then i + 1, ...)
    # so that a burst of load from other processes hits every variant alike
    for v in variants:
        for _ in range(args.warmup):
            v.run()
        v.before = dict(v.stats) if v.stats is not None else None
    for i in range(args.iters):
        for v in variants:
            v.times[i], v.cpu[i] = v.run()
    for v in variants:
        per_iter, cpu = np.empty_like(v.times), np.empty_like(v.cpu)
        world.Allreduce(v.times, per_iter, op=MPI.MAX)
        world.Allreduce(v.cpu, cpu, op=MPI.MAX)
        rec: dict[str, Any] = {"label": VARIANTS[v.key][0], "time_ms": float(per_iter.mean() * 1e3),
                               "min_ms": float(per_iter.min() * 1e3), "cpu_ms": float(cpu.mean() * 1e3),
                               "iters": args.iters}
        if v.stats is not None:
            d = {k: v.stats.get(k, 0) - v.before.get(k, 0) for k in set(v.stats) | set(v.before)}
            steps = max(d.get("steps", 0), 1)
            rec["wire_MB"] = d.get("wire_bytes", 0) / steps / 1e6
            rec["dense_MB"] = d.get("dense_bytes", 0) / steps / 1e6
            rec["wire_ratio"] = d.get("wire_bytes", 0) / max(d.get("dense_bytes", 0), 1)
            rec["control_per_step"] = d.get("control_collectives", 0) / steps
            if d.get("sparse_entries", 0):
                rec["density"] = d["sparse_entries"] / steps / total
                rec["dense_fallbacks_per_step"] = d.get("sparse_dense_fallbacks", 0) / steps
        else:
            rec["wire_MB"] = rec["dense_MB"] = total * 4 / 1e6 if v.key != "update" else 0.0
            rec["wire_ratio"] = 1.0 if v.key != "update" else 0.0
        for name, value in memory.get(v.key, {}).items():
            rec[name] = world.allreduce(value, op=MPI.MAX)  # the largest rank's
        if "gradient_bytes" in rec:
            rec["gradient_per_grad"] = rec["gradient_bytes"] / (total * 4)
        if d_gather := (d.get("gather_bytes", 0) if v.stats is not None else 0):
            rec["gather_MB"] = d_gather / steps / 1e6
        if v.key in extra:
            rec["extra_MB"] = world.allreduce(extra[v.key], op=MPI.MAX) / 1e6
            rec["extra_per_grad"] = rec["extra_MB"] * 1e6 / (total * 4)
        results[v.key] = rec
        v.close()
    if dist is not None:
        dist.destroy_process_group()

    if rank != 0:
        return 0
    raws = [results[k]["time_ms"] for k in ("raw", "naive", "layout") if k in results]
    fastest = min(raws) if raws else None
    ref = results.get("raw", {}).get("time_ms")
    ddp = results.get("ddp", {}).get("time_ms")
    copy_cpu = results.get("copy", {}).get("cpu_ms")
    for rec in results.values():
        rec["x_raw"] = rec["time_ms"] / ref if ref else None
        rec["x_ddp"] = rec["time_ms"] / ddp if ddp else None
        rec["copy_passes"] = rec["cpu_ms"] / copy_cpu if copy_cpu else None
    headers = ["variant", "time ms", "min ms", "cpu ms", "passes", "x raw", "x ddp", "wire MB", "dense MB",
               "wire/dense", "density", "extra MB", "extra/grad", "ctl/step"]
    rows = [[r["label"], f"{r['time_ms']:.1f}", f"{r['min_ms']:.1f}", f"{r['cpu_ms']:.1f}",
             f"{r['copy_passes']:.1f}" if r["copy_passes"] else None,
             f"{r['x_raw']:.2f}" if r["x_raw"] else None, f"{r['x_ddp']:.2f}" if r["x_ddp"] else None,
             f"{r['wire_MB']:.2f}", f"{r['dense_MB']:.2f}", f"{r['wire_ratio']:.4f}",
             f"{r['density']:.4f}" if "density" in r else None,
             f"{r['extra_MB']:.1f}" if "extra_MB" in r else None,
             f"{r['extra_per_grad']:.2f}" if "extra_per_grad" in r else None,
             f"{r['control_per_step']:.1f}" if "control_per_step" in r else None] for r in results.values()]
    model = "ResNet-50" if args.width_div == 1 else f"ResNet-50 / {args.width_div} widths"
    title = (f"{model} gradients ({len(shapes)} float32 tensors, {total:,} elements), "
             f"{n} processes, {_common.cpus()} CPUs; {args.warmup} warm-up + {args.iters} timed iterations; "
             "time = mean over iterations of the max over ranks; x raw / x ddp = time / baseline time")
    print(_common.table(headers, rows, title))
    targets = _targets(results, fastest)
    for name, (value, goal) in targets.items():
        print(f"{name}: {value:.2f} (target <= {goal})" if value is not None else f"{name}: not measured")
    for k, why in skipped.items():
        print(f"skipped {k}: {why}")
    data = {"benchmark": "step", "env": _common.finish_env(env), "world_size": n,
            "config": {"tensors": len(shapes), "elements": total, "width_div": args.width_div, "warmup": args.warmup,
                       "iters": args.iters, "bucket_mib": args.bucket_mib, "lr": args.lr,
                       "threshold_value": THRESHOLD_1PCT, "quick": args.quick},
            "results": results, "skipped": skipped,
            "targets": {k: {"ratio": v, "target": t} for k, (v, t) in targets.items()}}
    out = _common.write_json(args.out, data)
    print(f"wrote {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        print(plot(png, results, title.split(";")[0]) or f"wrote {png}")
    return 0


def plot(path: Path, results: dict[str, dict[str, Any]], title: str) -> str | None:
    """PNG: each DistOpt step as a stacked bar of phases; returns an error note or None.

    Phases come from the variants of the same run: the raw all-reduce of
    DistOpt's own buckets (``layout``), DistOpt's work beyond it (the no-op
    step or strategy minus ``layout``), and the local update (``step`` minus
    the no-op step).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install matplotlib): no plot"
    t = {k: r["time_ms"] for k, r in results.items()}
    comm = t.get("layout", t.get("raw"))
    if comm is None:
        return "no raw baseline (layout or raw) in this run: no plot"
    keys = [k for k in ("step", "step_noop", "half", "half_bf16", "topk1", "topk01", "thresh", "partial") if k in t]
    update = t["step"] - t["step_noop"] if "step" in t and "step_noop" in t else 0.0
    raw = [min(comm, t[k]) for k in keys]
    upd = [max(update, 0.0) if k == "step" else 0.0 for k in keys]
    rest = [max(t[k] - r - u, 0.0) for k, r, u in zip(keys, raw, upd)]
    fig, ax = plt.subplots(figsize=(9, 5))
    labels = [VARIANTS[k][0].replace("DistOpt.", "") for k in keys]
    ax.barh(labels, raw, label="raw all-reduce of the same buckets")
    ax.barh(labels, rest, left=raw, label="distopt and strategy work beyond it")
    ax.barh(labels, upd, left=[a + b for a, b in zip(raw, rest)], label="local SGD update")
    if "ddp" in t:
        ax.axvline(t["ddp"], color="k", linestyle="--", label="DDP-style gloo, bucketed")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over iterations, max over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _targets(results: dict[str, dict[str, Any]], fastest: float | None) -> dict[str, tuple[float | None, float]]:
    """The issue's ratios, each ``(measured, target)`` (None where a variant did not run)."""
    t = {k: r["time_ms"] for k, r in results.items()}

    def ratio(a: str, b: float | None) -> float | None:
        return t[a] / b if a in t and b else None
    dense = t.get("step_noop")
    update_ref = fastest + t["update"] if fastest and "update" in t else None
    return {"step no-op / fastest raw": (ratio("step_noop", fastest), 1.25),
            "step no-op / layout-avg (raw sums + the division)": (ratio("step_noop", t.get("layout_avg")), 1.10),
            "step SGD / (fastest raw + update)": (ratio("step", update_ref), 1.10),
            "half fp16 / dense step": (ratio("half", dense), 1.5),
            "half bf16 / dense step": (ratio("half_bf16", dense), 1.6),
            "top-K 1% / dense step": (ratio("topk1", dense), 2.0),
            "top-K 0.1% / dense step": (ratio("topk01", dense), 1.7),
            "DGC 1% / dense step": (ratio("dgc", dense), 2.2),
            "PowerSGD rank 2 / dense step": (ratio("powersgd", dense), 2.2),
            "control collectives per dense step": (results.get("step_noop", {}).get("control_per_step"), 1.0),
            "dense extra memory / gradient bytes": (results.get("step_noop", {}).get("extra_per_grad"), 1.0),
            "zero=1 SGD step / dense SGD step": (ratio("zero1", t.get("step")), 0.85),
            "zero=2 SGD step / dense SGD step": (ratio("zero2", t.get("step")), 0.85),
            "zero=1 Adam step / dense Adam step": (ratio("zero1_adam", t.get("step_adam")), 0.55),
            "zero=1 SGD step / torch ZeroRedundancyOptimizer": (ratio("zero1", t.get("zero_torch")), 0.5),
            "zero=1 optimizer state / dense's": (_mem(results, "zero1", "step", "optimizer_state_bytes"), 0.5),
            # array models keep their own gradient arrays; what zero=2 holds beyond them, per gradient byte:
            "zero=2 distopt gradient memory / gradient bytes": (results.get("zero2", {}).get("gradient_per_grad"), 0.5)}


def _mem(results: dict[str, dict[str, Any]], a: str, b: str, name: str) -> float | None:
    """``results[a][name] / results[b][name]``, None where either is missing or 0."""
    x, y = results.get(a, {}).get(name), results.get(b, {}).get(name)
    return x / y if x is not None and y else None


def ddp_bucketed(torch: Any, dist: Any, grads: list[np.ndarray], bucket_mib: float, world_size: int
                 ) -> Callable[[], None]:
    """PyTorch DDP's reducer without autograd: reverse-order 25 MiB buckets, packed, averaged, unpacked."""
    tensors = [torch.from_numpy(g).view(-1) for g in grads]
    cap = int(bucket_mib * (1 << 20))
    buckets: list[list[int]] = [[]]
    fill = 0
    for i in reversed(range(len(tensors))):
        nbytes = tensors[i].numel() * 4
        if buckets[-1] and fill + nbytes > cap:
            buckets.append([])
            fill = 0
        buckets[-1].append(i)
        fill += nbytes
    flats = [torch.empty(sum(tensors[i].numel() for i in b), dtype=torch.float32) for b in buckets]

    def run() -> None:
        works = []
        for b, flat in zip(buckets, flats):
            off = 0
            for i in b:
                k = tensors[i].numel()
                flat[off:off + k].copy_(tensors[i])
                off += k
            flat.div_(world_size)
            works.append(dist.all_reduce(flat, async_op=True))
        for b, flat, w in zip(buckets, flats, works):
            w.wait()
            off = 0
            for i in b:
                k = tensors[i].numel()
                tensors[i].copy_(flat[off:off + k])
                off += k

    return run


if __name__ == "__main__":
    sys.exit(_common.run_mpi_main(main))
