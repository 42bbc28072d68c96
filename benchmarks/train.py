"""The seed's CNN on Fashion-MNIST: DistOpt strategies, 1 vs 2 processes, against PyTorch DDP (gloo).

Run as the driver (it launches every job itself with ``mpiexec``)::

    python benchmarks/train.py            # 1 epoch per run, every strategy, 1 and 2 processes
    python benchmarks/train.py --quick    # --max-steps 40 --eval-limit 2000; 1 process: plain and DDP only

For each process count P the driver runs ``mpiexec -n P python
benchmarks/train.py --worker distopt --strategies ...``, which calls
``examples/cnn_mpi.py``'s ``train()`` (imported, not copied) once per
strategy (``plain``, ``half``, ``partialUpdate``, ``sparseTopK``,
``sparseThreshold``, ``dgc``, ``powerSGD``; cnn_mpi's defaults: ``--spars``
0.01 for both sparse ones, chunks of 10000 elements for partialUpdate, DGC at
99.9 % sparsity after 4 warm-up stages of 100 steps, PowerSGD rank 2 after
100 dense steps; their ``--dgc-*`` / ``--powersgd-*`` flags pass through), one after another in the
same processes, and one ``--worker ddp`` job: the same CNN, initial weights
(``torch.manual_seed``), optimizer (SGD, lr 0.005, momentum 0.9, weight
decay 1e-5), batch size per process, data order (``distopt.DistributedSampler``
with the same seed) and evaluation split, wrapped in
``torch.nn.parallel.DistributedDataParallel`` over gloo (tcp://127.0.0.1,
ranks from MPI). Both use ``cores // processes`` torch threads per process.

Columns: ``train s`` is the training part of the epoch (``train_time`` of
cnn_mpi's records: the step loop, no data loading, no evaluation);
``samples/s`` = samples trained by all processes / ``train s``; ``x1p`` =
samples/s over the same implementation's 1-process samples/s (plain for
DistOpt); ``xDDP`` = ``train s`` / DDP's ``train s`` at the same process
count (< 1: faster than DDP); ``eval acc`` on the test set (all 10,000
images unless ``--eval-limit``), ``d acc`` = eval acc - DDP's eval acc at the
same process count, in percentage points; ``wire`` = bytes sent / bytes of
a dense exchange over the whole run, ``last wire`` the same over the last
epoch alone (the steady state, after DGC's warm-up and PowerSGD's dense
steps).

Writes ``benchmarks/results/train.json`` unless ``--out``. Needs the
Fashion-MNIST IDX files (``--data-dir``, default Debian's
``/usr/share/datasets/fashion-mnist``) and torch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

EXAMPLES = _common.ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

STRATEGIES = ("plain", "half", "partialUpdate", "sparseTopK", "sparseThreshold", "dgc", "powerSGD")


# ----------------------------------------------------------------- workers
def worker_distopt(result_file: str, strategies: list[str], argv: list[str]) -> int:
    """Train once per strategy in this MPI job (``cnn_mpi.train``); rank 0 writes a list of results."""
    import functools

    import cnn_mpi
    from mpi4py import MPI

    # read and decode the IDX files once per job, not once per strategy (train() only reads the arrays)
    cnn_mpi.load = functools.lru_cache(maxsize=None)(cnn_mpi.load)
    out = []
    for strategy in strategies:
        args = cnn_mpi.parse_args(argv + ["--dist-option", strategy])
        history = cnn_mpi.train(args)
        out.append(_result(args, history, MPI.COMM_WORLD.size, strategy))
    if MPI.COMM_WORLD.rank == 0:
        Path(result_file).write_text(json.dumps(out))
    return 0


def worker_ddp(result_file: str, argv: list[str]) -> int:
    """Train the same CNN with PyTorch DDP (gloo); rank 0 writes a one-element list of results."""
    import cnn_mpi
    import torch
    import torch.nn.functional as F
    from fashion_mnist import load
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distopt

    args = cnn_mpi.parse_args(argv)
    world = MPI.COMM_WORLD
    dist = _common.init_gloo(world, timeout_s=300)
    rank, size = dist.get_rank(), dist.get_world_size()

    train_x, train_y, test_x, test_y = load(args.data_dir)
    torch.manual_seed(args.seed)
    model = cnn_mpi.CNN()
    ddp = DDP(model)  # broadcasts rank 0's parameters
    sgd = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
    torch.set_num_threads(args.threads or max(1, _common.cpus() // size))

    train_x, train_y = torch.from_numpy(train_x), torch.from_numpy(train_y)
    test_x, test_y = torch.from_numpy(test_x), torch.from_numpy(test_y)
    sampler = distopt.DistributedSampler(len(train_x), args.batch_size, rank, size, seed=args.seed)
    steps = sampler.num_batches() if args.max_steps is None else min(sampler.num_batches(), args.max_steps)
    n_eval = len(test_x) if args.eval_limit is None else min(len(test_x), args.eval_limit)
    eval_idx = distopt.eval_partition_indices(n_eval, rank, size)

    def reduce(totals: dict[str, float]) -> dict[str, float]:
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    history = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        ddp.train()
        totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
        for step, idx in enumerate(sampler.batches()):
            if step >= steps:
                break
            b = torch.from_numpy(idx)
            out = ddp(train_x[b])
            loss = F.cross_entropy(out, train_y[b])
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            totals["loss"] += loss.item() * len(idx)
            totals["correct"] += (out.argmax(1) == train_y[b]).sum().item()
            totals["count"] += len(idx)
        record: dict[str, Any] = {"epoch": epoch, **_summary(reduce(totals), "train")}
        record["train_time"] = time.perf_counter() - start
        record.update(_summary(reduce(cnn_mpi.evaluate(model, test_x, test_y, eval_idx)), "eval"))
        record["time"] = time.perf_counter() - start
        record["eval_time"] = record["time"] - record["train_time"]
        if rank == 0:
            print(f"DDP epoch {epoch}: train acc {record['train_acc']:.4f}, eval acc {record['eval_acc']:.4f}, "
                  f"train {record['train_time']:.1f} s", flush=True)
        history.append(record)
    if rank == 0:
        Path(result_file).write_text(json.dumps([_result(args, history, size, None)]))
    return 0


def _summary(totals: dict[str, float], prefix: str) -> dict[str, float]:
    count = max(totals["count"], 1.0)
    return {f"{prefix}_loss": totals["loss"] / count, f"{prefix}_acc": totals["correct"] / count,
            f"{prefix}_count": totals["count"]}


def _result(args: argparse.Namespace, history: list[dict[str, Any]], size: int, strategy: str | None
            ) -> dict[str, Any]:
    import distopt

    n_train = 60000  # Fashion-MNIST's training set
    sampler = distopt.DistributedSampler(n_train, args.batch_size, 0, size, seed=args.seed)
    steps = sampler.num_batches() if args.max_steps is None else min(sampler.num_batches(), args.max_steps)
    per_rank = min(steps * args.batch_size, sampler.num_samples)
    return {"strategy": strategy, "world_size": size, "history": history, "steps": steps,
            "samples_per_epoch": per_rank * size, "threads": args.threads or max(1, _common.cpus() // size)}


# ------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="--max-steps 40 --eval-limit 2000; 1 process only for plain and DDP")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--procs", default="1,2", help="process counts (default 1,2)")
    p.add_argument("--no-ddp", action="store_true", help="skip the PyTorch DDP baseline")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=None, help="steps per epoch (default: the whole shard)")
    p.add_argument("--eval-limit", type=int, default=None, help="test images evaluated (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX directory (default: cnn_mpi's)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per mpiexec job (default 1800)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each job, wait up to this many seconds for the CPUs to be < 15%% busy "
                        "(shared machines; default 0: no wait)")
    p.add_argument("--out", type=Path, default=_common.default_out("train"), help="JSON output path")
    p.add_argument("--worker", choices=("distopt", "ddp"), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    args.rest = rest
    if args.quick:
        args.max_steps = args.max_steps or 40
        args.eval_limit = args.eval_limit or 2000
    return args


def run_job(args: argparse.Namespace, impl: str, strategies: list[str], procs: int) -> list[dict[str, Any]]:
    """``mpiexec -n procs`` this script as a worker; returns its result list."""
    fd, result = tempfile.mkstemp(prefix="distopt-train-", suffix=".json")
    os.close(fd)
    cmd = [_common.mpiexec(), "-n", str(procs), sys.executable, str(Path(__file__).resolve()),
           "--worker", impl, "--result-file", result, "--strategies", ",".join(strategies), *_worker_argv(args)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=_common.ROOT, capture_output=True, text=True, timeout=args.timeout)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-4000:]}")
        data = json.loads(Path(result).read_text())
    finally:
        Path(result).unlink(missing_ok=True)
    for d in data:
        d["job_wall_s"] = time.perf_counter() - t0
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise SystemExit(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    if args.worker == "distopt":
        return _common.run_mpi_main(lambda: worker_distopt(args.result_file, strategies, _worker_argv(args)))
    if args.worker == "ddp":
        rc = _common.run_mpi_main(lambda: worker_ddp(args.result_file, _worker_argv(args)))
        # gloo's teardown (destroy_process_group, or its destructors at exit) intermittently aborts with
        # "terminate called without an active exception" (1 run in 10 here): finalize MPI and leave
        # without running destructors, once the result is written
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    if args.rest:  # examples/cnn_mpi.py's flags (--dgc-*, --powersgd-*, --lr ...) pass through to the workers
        import cnn_mpi

        cnn_mpi.parse_args(args.rest)  # exits with argparse's message on a flag it does not know

    env = _common.env_info(mpi=False)
    procs = [int(p) for p in args.procs.split(",")]
    jobs: list[tuple[str, list[str], int]] = []
    for p in procs:  # DDP right before DistOpt (plain first): the pair compared runs back to back
        if not args.no_ddp:
            jobs.append(("ddp", [], p))
        todo = ["plain"] if args.quick and p == 1 and "plain" in strategies else strategies
        jobs.append(("distopt", todo, p))
    runs = []
    t_start = time.perf_counter()
    for impl, todo, p in jobs:
        if args.wait_quiet > 0:
            busy = _common.wait_quiet(args.wait_quiet, 0.15, lambda m: print("  " + m, file=sys.stderr, flush=True))
        else:
            busy = None
        print(f"  running {impl} -n {p} {','.join(todo)} ...", file=sys.stderr, flush=True)
        for data in run_job(args, impl, todo, p):
            rec = data["history"][-1]
            train_time = sum(h["train_time"] for h in data["history"])
            samples = data["samples_per_epoch"] * len(data["history"])
            run = {"impl": impl, "strategy": data["strategy"] or "DDP", "procs": p, "threads": data["threads"],
                   "epochs": len(data["history"]), "steps_per_epoch": data["steps"], "samples": samples,
                   "train_time": train_time, "samples_per_s": samples / train_time,
                   "train_acc": rec["train_acc"], "eval_acc": rec["eval_acc"], "train_loss": rec["train_loss"],
                   "eval_time": rec["eval_time"], "job_wall_s": data["job_wall_s"], "cpu_busy_before": busy,
                   "wire_ratio": rec.get("wire_ratio", 1.0), "last_wire_ratio": rec.get("epoch_wire_ratio", 1.0),
                   "history": data["history"]}
            runs.append(run)
            print(f"    {run['strategy']}: train {train_time:.1f} s, {run['samples_per_s']:.0f} samples/s, "
                  f"eval acc {run['eval_acc']:.4f}", file=sys.stderr, flush=True)

    def find(impl: str, strategy: str, p: int) -> dict[str, Any] | None:
        return next((r for r in runs if r["impl"] == impl and r["strategy"] == strategy and r["procs"] == p), None)

    for r in runs:
        one = find(r["impl"], r["strategy"], 1) or (find("distopt", "plain", 1) if r["impl"] == "distopt" else None)
        ddp = find("ddp", "DDP", r["procs"])
        r["x_1proc"] = r["samples_per_s"] / one["samples_per_s"] if one else None
        r["x_ddp_time"] = r["train_time"] / ddp["train_time"] if ddp else None
        r["d_acc_pp"] = (r["eval_acc"] - ddp["eval_acc"]) * 100 if ddp else None
    runs.sort(key=lambda r: (r["impl"] == "ddp", STRATEGIES.index(r["strategy"]) if r["strategy"] in STRATEGIES
                             else 0, r["procs"]))
    headers = ["impl", "strategy", "procs", "threads", "train s", "samples/s", "x1p", "xDDP", "train acc",
               "eval acc", "d acc pp", "wire", "last wire"]
    rows = [[r["impl"], r["strategy"], r["procs"], r["threads"], f"{r['train_time']:.2f}", f"{r['samples_per_s']:.0f}",
             f"{r['x_1proc']:.2f}" if r["x_1proc"] else None, f"{r['x_ddp_time']:.2f}" if r["x_ddp_time"] else None,
             f"{r['train_acc']:.4f}", f"{r['eval_acc']:.4f}", f"{r['d_acc_pp']:+.2f}" if r["d_acc_pp"] is not None
             else None, f"{r['wire_ratio']:.4f}", f"{r['last_wire_ratio']:.4f}"] for r in runs]
    steps = "whole epoch" if args.max_steps is None else f"--max-steps {args.max_steps}"
    title = (f"CNN on Fashion-MNIST, {args.epochs} epoch(s) ({steps}), batch {args.batch_size} per process, "
             f"seed {args.seed}, {_common.cpus()} CPUs; eval on "
             f"{'all 10000' if args.eval_limit is None else args.eval_limit} test images")
    print(_common.table(headers, rows, title))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    data = {"benchmark": "train", "env": _common.finish_env(env),
            "config": {"epochs": args.epochs, "batch_size": args.batch_size, "max_steps": args.max_steps,
                       "eval_limit": args.eval_limit, "seed": args.seed, "strategies": strategies, "procs": procs,
                       "ddp": not args.no_ddp, "quick": args.quick},
            "runs": runs}
    print(f"wrote {_common.write_json(args.out, data)}")
    return 0


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The flags cnn_mpi.parse_args understands."""
    argv = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    if args.eval_limit is not None:
        argv += ["--eval-limit", str(args.eval_limit)]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    return argv + args.rest


if __name__ == "__main__":
    sys.exit(main())
