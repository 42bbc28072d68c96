"""Sharded training against its peers: time per step, peak RSS and bytes held, on a GPT with AdamW.

Run (a driver: it starts the torchrun jobs itself)::

    python benchmarks/zero.py                      # W = 2, a 27.4M-parameter GPT, every variant
    python benchmarks/zero.py --quick --gpt 512,64,4,2,32,4 --variants ddp,zero1

Variants, every one built from seed 0 with the same data on each rank:

* ``ddp``: ``DistributedDataParallel`` (gloo) and ``torch.optim.AdamW``;
* ``zero0`` ... ``zero3``: ``DistOpt(AdamW, backend="torch",
  model=..., zero=0|1|2|3)``; ``zero1_overlap``: ``zero=1`` with
  ``overlap_param_gather=True`` (each bucket's all-gather completes when the
  next forward reaches it); ``zero3_keep``: ``zero=3`` with
  ``reshard_after_forward=False``;
* ``zero_torch``: DDP and torch's ``ZeroRedundancyOptimizer`` over AdamW;
* ``fsdp2``: torch's ``fully_shard`` (FSDP2) on every block and the root.

Two kinds of job, one after the other:

1. **timing**: one ``torchrun`` job builds every variant; after
   ``--warmup`` untimed iterations each, ``--rounds`` rounds run every
   variant ``--iters`` iterations, the order alternating (A B ..., ... B A),
   each iteration after a barrier and timed as the max over ranks.
   ``time_ms`` is the median over rounds of the round's mean, ``x_ddp`` the
   median of the round's time over ``ddp``'s, ``max_abs_diff_vs_ddp`` the
   largest difference of any final parameter element from ``ddp``'s (every
   variant ran the same iterations on the same data);
2. **memory**: one ``torchrun`` job per variant builds only that variant
   and runs ``--warmup`` + 3 iterations; ``peak_rss_mib`` is the largest
   ``ru_maxrss`` over the ranks (the process's peak resident set, MiB), and
   ``parameter_bytes``, ``optimizer_state_bytes`` and ``gradient_bytes`` are
   what rank 0 holds after the last step (BYTES: its parameter tensors or
   FSDP2's local shards; its optimizer's state tensors; its ``.grad``
   tensors after the last step, or distopt's ``stats["gradient_bytes"]``,
   which also counts its fusion buffers; DDP's own buckets are not counted).

Prints a table and writes ``benchmarks/results/zero.json`` (``--out``) with
``results[variant]`` holding those fields, the config and the machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import _common
import numpy as np
from netsim_worker import make_gpt

VARIANTS = ("ddp", "zero0", "zero1", "zero1_overlap", "zero2", "zero3", "zero3_keep", "zero_torch", "fsdp2")
#: distopt's backend under each launcher.
BACKENDS = {"torchrun": "torch", "mpiexec": "mpi", "distopt": "shm"}


def parse_args(argv: list[str] | None = None, name: str = "zero", variants: tuple[str, ...] = VARIANTS,
               doc: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc-per-node; default 2)")
    p.add_argument("--launcher", choices=tuple(BACKENDS), default="torchrun",
                   help="start the jobs with torchrun (distopt on its torch backend), mpiexec (distopt on MPI) or "
                        "python -m distopt.launch (distopt on shared memory); DDP, ZeroRedundancyOptimizer and "
                        "FSDP2 always on gloo (a group made from the ranks the launcher gave)")
    p.add_argument("--variants", default=",".join(variants), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--gpt", default="8192,512,8,6,64,2",
                   help="GPT vocab,d_model,heads,layers,seq_len,batch (default 8192,512,8,6,64,2: 27.4M parameters)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 2 iterations, 1 warm-up (default 4 x 2, 2)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--out", type=Path, default=_common.default_out(name), help="JSON output path")
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", choices=("timing", "memory"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.iters = args.iters or 2
    args.warmup = args.warmup or (1 if args.quick else 2)
    keys = [k for k in args.variants.split(",") if k]
    unknown = sorted(set(keys) - set(VARIANTS))
    if unknown or not keys:
        p.error(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    args.keys, args.name = keys, name
    return args


# ------------------------------------------------------------------ inside a torchrun job

class Variant:
    """One variant's iteration, its model, its optimizer and (distopt) its DistOpt."""

    def __init__(self, key: str, model: Any, opt: Any, step: Callable[[], None], dopt: Any = None) -> None:
        self.key, self.model, self.opt, self.step, self.dopt = key, model, opt, step, dopt
        self.rounds: list[list[float]] = []


def _fsdp(torch: Any, model: Any) -> None:
    """Shard ``model`` with torch's FSDP2 ``fully_shard`` on every block and the root, in place."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def build(torch: Any, distopt: Any, key: str, spec: str, rank: int, backend: str) -> Variant:
    """The variant ``key`` on a GPT of ``spec`` (see the module docs), from seed 0."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    vocab, d_model, heads, layers, seq_len, batch = (int(v) for v in spec.split(","))
    torch.manual_seed(0)
    model = make_gpt(vocab, d_model, heads, layers, seq_len)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    adamw = {"lr": 1e-3, "weight_decay": 0.01}
    net, dopt = model, None
    if key == "ddp":
        net, opt = DDP(model), torch.optim.AdamW(model.parameters(), **adamw)
    elif key == "zero_torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    elif key == "fsdp2":
        _fsdp(torch, model)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    else:
        dopt = opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), **adamw), backend=backend, model=model,
                                     zero=int(key[4]), overlap_param_gather=key.endswith("_overlap"),
                                     reshard_after_forward=not key.endswith("_keep"))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return Variant(key, model, opt, step, dopt)


def _nbytes(t: Any) -> int:
    """BYTES of ``t`` on this rank: a DTensor's local shard (FSDP2), or the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def held_bytes(torch: Any, v: Variant) -> dict[str, int]:
    """BYTES this rank holds for ``v``: parameters, optimizer state, gradients (see the module docs)."""
    params = sum(_nbytes(p) for p in v.model.parameters())
    if v.dopt is not None:  # its parameter_bytes: zero=3's segments (its parameters are 0-element tensors at rest)
        stats = v.dopt.stats
        return {"parameter_bytes": int(stats["parameter_bytes"]),
                "optimizer_state_bytes": int(stats["optimizer_state_bytes"]),
                "gradient_bytes": int(stats["gradient_bytes"]),
                "gathered_bytes_peak": int(stats["gathered_bytes_peak"])}
    inner = v.opt.optim if hasattr(v.opt, "optim") else v.opt  # ZeroRedundancyOptimizer's local optimizer
    state = sum(_nbytes(t) for s in inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    grads = sum(_nbytes(p.grad) for p in v.model.parameters() if p.grad is not None)  # kept until zero_grad()
    return {"parameter_bytes": params, "optimizer_state_bytes": state, "gradient_bytes": grads}


def full_params(torch: Any, v: Variant) -> list[Any]:
    """Every parameter, whole (FSDP2's gathered, distopt's inside ``summon_full_params``: it completes the
    all-gathers that ``overlap_param_gather`` leaves in flight, and gathers ``zero=3``'s segments), in
    ``model.parameters()`` order."""
    if v.dopt is not None:
        with v.dopt.summon_full_params():
            return [p.detach().clone() for p in v.model.parameters()]
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in v.model.parameters()]


def timing_job(torch: Any, dist: Any, distopt: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant interleaved (see the module docs); rank 0's record of each."""
    rank = dist.get_rank()
    variants = [build(torch, distopt, k, args.gpt, rank, BACKENDS[args.launcher]) for k in args.keys]
    for v in variants:
        for _ in range(args.warmup):
            v.step()
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            times = []
            for _ in range(args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                v.step()
                times.append(time.perf_counter() - t0)
            v.rounds.append(times)
    out: dict[str, Any] = {}
    ref = full_params(torch, variants[[v.key for v in variants].index("ddp")]) if "ddp" in args.keys else None
    for v in variants:
        per_iter = torch.tensor(v.rounds, dtype=torch.float64)
        dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
        round_ms = (per_iter.mean(dim=1) * 1e3).tolist()
        rec = {"round_ms": round_ms, "time_ms": float(np.median(round_ms)), "params": sum(
            p.numel() for p in full_params(torch, v))}
        if ref is not None:
            rec["max_abs_diff_vs_ddp"] = max(float((a - b).abs().max()) for a, b in zip(full_params(torch, v), ref))
        out[v.key] = rec
    if "ddp" in out:
        ddp = np.array(out["ddp"]["round_ms"])
        for rec in out.values():
            rec["x_ddp"] = float(np.median(np.array(rec["round_ms"]) / ddp))
    for v in variants:
        if v.dopt is not None:
            v.dopt.close()
    return out


def memory_job(torch: Any, dist: Any, distopt: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The one variant of ``args.keys`` alone: its peak RSS (max over ranks) and what rank 0 holds."""
    (key,) = args.keys
    v = build(torch, distopt, key, args.gpt, dist.get_rank(), BACKENDS[args.launcher])
    for _ in range(args.warmup + 3):
        v.step()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    rec = {"peak_rss_mib": float(peak), **held_bytes(torch, v)}
    if v.dopt is not None:
        v.dopt.close()
    return {key: rec}


def job_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import distopt

    torch.set_num_threads(1)
    if args.launcher == "mpiexec":  # the peers' gloo group, from the MPI ranks (no torchrun variables set)
        from mpi4py import MPI

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=MPI.COMM_WORLD.Get_rank(), world_size=MPI.COMM_WORLD.Get_size())
    elif args.launcher == "distopt":  # RANK and WORLD_SIZE from python -m distopt.launch
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    record = (timing_job if args.job == "timing" else memory_job)(torch, dist, distopt, args)
    if dist.get_rank() == 0:
        args.job_out.write_text(json.dumps(record))
    gc.collect()  # the variants (DDP's reducer, FSDP2's state) go before their process group, not at exit
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the driver

def run_job(args: argparse.Namespace, job: str, keys: list[str], folder: Path) -> dict[str, Any]:
    """One torchrun job of this script (``--job``); its rank 0's JSON record.

    Raises:
        SystemExit: the job failed (its exit code and output tail).
    """
    out = folder / f"{job}-{'-'.join(keys)}.json"
    port = str(_common.free_port())
    launch = {"mpiexec": [_common.mpiexec(), "-n", str(args.nproc), sys.executable],
              "distopt": [sys.executable, "-m", "distopt.launch", "-n", str(args.nproc)],
              "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                           "--master-addr", "127.0.0.1", "--master-port", port]}[args.launcher]
    cmd = [*launch, __file__, "--job", job, "--job-out", str(out), "--launcher", args.launcher, "--port", port,
           "--variants", ",".join(keys), "--gpt", args.gpt, "--rounds", str(args.rounds), "--iters",
           str(args.iters), "--warmup", str(args.warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0 or not out.is_file():
        tail = (res.stdout + res.stderr)[-4000:]
        raise SystemExit(f"the {job} job of {keys} failed (exit {res.returncode}):\n{tail}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None, name: str = "zero", variants: tuple[str, ...] = VARIANTS,
         doc: str | None = None) -> int:
    """The driver (or, with ``--job``, one job); ``name`` names the JSON file and ``benchmark`` field,
    ``variants`` are the default ``--variants``."""
    args = parse_args(argv, name, variants, doc)
    if args.job is not None:
        job_main(args)
        return 0
    env = _common.env_info(mpi=False)  # the driver is no MPI process (it launches the mpiexec jobs)
    with tempfile.TemporaryDirectory(prefix="distopt-zero-bench-") as tmp:
        results = run_job(args, "timing", args.keys, Path(tmp))
        for key in args.keys:
            results[key].update(run_job(args, "memory", [key], Path(tmp))[key])
    data = {"benchmark": name, "world_size": args.nproc, "launcher": args.launcher, "results": results,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "env": _common.finish_env(env)}
    mib = 1 << 20
    rows = [[k, f"{r['time_ms']:.1f}", f"{r['x_ddp']:.3f}" if "x_ddp" in r else None, f"{r['peak_rss_mib']:.0f}",
             f"{r['parameter_bytes'] / mib:.1f}", f"{r['optimizer_state_bytes'] / mib:.1f}",
             f"{r['gradient_bytes'] / mib:.1f}", f"{r['max_abs_diff_vs_ddp']:.2e}" if "max_abs_diff_vs_ddp" in r
             else None] for k, r in results.items()]
    title = (f"GPT {args.gpt} (vocab,d_model,heads,layers,seq,batch), {next(iter(results.values()))['params']:,} "
             f"parameters, AdamW; {args.nproc} processes ({args.launcher}), {_common.cpus()} CPUs, 1 torch thread; "
             f"{args.rounds} "
             f"rounds x {args.iters} iterations, interleaved; memory: one job per variant")
    print(_common.table(["variant", "ms", "x ddp", "peak RSS MiB", "params MiB", "opt state MiB", "grad MiB",
                         "max |diff| vs ddp"], rows, title))
    print(f"load average at start {env['loadavg_at_start']}, at end {data['env']['loadavg_at_end']}")
    print(f"wrote {_common.write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
