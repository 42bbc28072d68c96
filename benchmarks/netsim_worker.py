"""The ranks of ``benchmarks/netsim.py``: its workloads, run inside the simulated nodes.

Started by netsim.py, never by hand: one process per rank under ``torchrun``
(one per node, c10d rendezvous on the link; distopt's ``torch`` backend) or
MPICH's ``mpiexec`` (distopt's ``mpi`` backend). Every rank also joins a
gloo process group over the link (``GLOO_SOCKET_IFNAME=eth0``) for the
baselines (DDP), the barriers before the timed calls and the max over
ranks of the timings. Rank 0 writes one JSON object to ``--result-file``.

Workloads (the driver's docstring has the measured quantities):

* ``step``: ResNet-50's gradient shapes (``step.resnet50_shapes``), a local
  optimizer that does nothing (``step.NoOpUpdate``); ``ddp`` is
  ``step.ddp_bucketed`` (25 MiB buckets, gloo, all in flight), the others
  ``DistOpt(NoOpUpdate(), strategy=S, backend=B)``: ``dense`` = ``Dense()``,
  ``half`` = ``Half()`` (float16), ``topk1`` =
  ``Sparse(density=0.01, select="topk")`` (residuals zeroed before each
  iteration, untimed, as in ``step.py``), ``dgc`` = ``DGC(sparsity=0.999,
  momentum=0.9)`` (no warm-up), ``powersgd`` =
  ``PowerSGD(matrix_rank=--powersgd-rank)`` (compressing from the first
  step), ``flat`` = ``Dense()`` with ``hierarchical=False`` where DistOpt
  takes it, ``hier`` = ``hierarchical=True`` (skipped with a note where it
  does not).
* ``cnn``: ``examples/cnn_mpi.py``'s ``train()`` per strategy
  (``plain``, ``half``, ``topk1`` = ``sparseTopK``, ``dgc``, ``powersgd`` =
  ``powerSGD``), and ``ddp``: the same CNN, initial weights, optimizer,
  data order and evaluation in ``torch.nn.parallel.DistributedDataParallel``.
* ``gpt``: :class:`GPT` with ``torch.optim.AdamW`` on synthetic tokens
  (:func:`markov_batches`); ``ddp`` in DDP, the others in
  ``DistOpt(adamw, strategy=S, model=model)`` with ``backward_and_update``.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import _common
import numpy as np

IFNAME = "eth0"
EXAMPLES = _common.ROOT / "examples"
CNN_OPTIONS = {"plain": "plain", "half": "half", "topk1": "sparseTopK", "dgc": "dgc", "powersgd": "powerSGD"}
MARKOV_SUCCESSORS = 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags netsim.py passes (``--`` then cnn_mpi's own flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-id", required=True)
    p.add_argument("--result-file", type=Path, required=True)
    p.add_argument("--workload", choices=("step", "cnn", "gpt"), required=True)
    p.add_argument("--launcher", choices=("torchrun", "mpiexec"), required=True)
    p.add_argument("--variants", required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--width-div", type=int, default=1)
    p.add_argument("--bucket-mib", type=float, default=25.0)
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--eval-limit", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=None)
    args = p.parse_args(argv)
    args.rest = rest
    args.variant_list = [v for v in args.variants.split(",") if v]
    return args


class Ctx:
    """This rank's place in the job and the gloo group over the link (for baselines, barriers, maxima).

    Args:
        launcher: ``"torchrun"`` or ``"mpiexec"``.
        threads: torch threads for this process.
        timeout_s: the gloo group's timeout.
    """

    def __init__(self, launcher: str, threads: int, timeout_s: float) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.launcher = torch, dist, launcher
        torch.set_num_threads(threads)
        self.threads = threads
        timeout = datetime.timedelta(seconds=timeout_s)
        if launcher == "torchrun":
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
            self.backend = "torch"
            self.mpi = None
        else:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            here = None
            if world.rank == 0:
                addr = socket.gethostbyname(socket.gethostname())  # node0's link address (/etc/netns hosts)
                with socket.socket() as s:
                    s.bind((addr, 0))
                    here = (addr, s.getsockname()[1])
            addr, port = world.bcast(here, root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=world.rank,
                                    world_size=world.size, timeout=timeout)
            self.backend = "mpi"
            self.mpi = MPI
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        hosts: list[Any] = [None] * self.size
        dist.all_gather_object(hosts, self.host)
        self.hosts = hosts
        same = [r for r, h in enumerate(hosts) if h == self.host]
        self.local_rank, self.local_size = same.index(self.rank), len(same)
        self.nodes = len(set(hosts))

    def barrier(self) -> None:
        """A gloo barrier over the link."""
        self.dist.barrier()

    def reduce(self, values: Sequence[float], op: str) -> list[float]:
        """Element-wise ``"max"`` or ``"sum"`` of ``values`` over ranks (float64, on every rank)."""
        t = self.torch.tensor(list(values), dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM)
        return t.tolist()

    def tx_bytes(self) -> int:
        """Bytes this node's ``eth0`` has sent (its namespace's counter; 0 on ranks other than local rank 0)."""
        if self.local_rank != 0:
            return 0
        try:
            return int(Path(f"/sys/class/net/{IFNAME}/statistics/tx_bytes").read_text())
        except OSError:
            return 0

    def finish(self) -> None:
        """Last barrier, then leave without destructors (gloo's teardown can abort the process at exit)."""
        self.barrier()
        if self.mpi is not None:
            self.mpi.COMM_WORLD.Barrier()
            self.mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _stats_delta(after: Any, before: dict[str, int]) -> dict[str, int]:
    keys = set(dict(after)) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _wire(d: dict[str, int]) -> dict[str, Any]:
    steps = max(d.get("steps", 0), 1)
    return {"wire_bytes": d.get("wire_bytes", 0) / steps, "dense_bytes_opt": d.get("dense_bytes", 0) / steps,
            "wire_ratio": d.get("wire_bytes", 0) / max(d.get("dense_bytes", 0), 1),
            "control_per_step": d.get("control_collectives", 0) / steps}


def _hierarchical_supported() -> bool:
    import distopt

    return "hierarchical" in inspect.signature(distopt.DistOpt.__init__).parameters


def _gradient_strategy(key: str, powersgd_rank: int) -> Any:
    from distopt.strategies import DGC, Dense, Half, PowerSGD, Sparse

    return {"dense": Dense, "flat": Dense, "hier": Dense, "half": Half,
            "topk1": lambda: Sparse(density=0.01, select="topk"),
            "dgc": lambda: DGC(sparsity=0.999, momentum=0.9),
            "powersgd": lambda: PowerSGD(matrix_rank=powersgd_rank, start_step=0)}[key]()


# ------------------------------------------------------------------- step
def run_step(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    """Time one step per variant on ResNet-50's gradients; rank 0's result record."""
    import distopt
    from step import NoOpUpdate, ddp_bucketed, resnet50_shapes

    shapes = resnet50_shapes(width_div=args.width_div)
    rng = np.random.default_rng(1234 + ctx.rank)
    master = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [g.copy() for g in master]
    params_rng = np.random.default_rng(99)
    params = [params_rng.standard_normal(s, dtype=np.float32) * 0.01 for s in shapes]
    total = sum(int(np.prod(s)) for s in shapes)
    hier_ok = _hierarchical_supported()

    def restore() -> None:
        for g, m in zip(grads, master):
            np.copyto(g, m)

    class Variant:
        def __init__(self, key: str, fn: Callable[[], Any], opt: Any = None) -> None:
            self.key, self.fn, self.opt = key, fn, opt
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.tx: list[float] = []
            self.before: dict[str, int] = {}

        def run(self, timed: bool) -> None:
            restore()
            residuals = getattr(self.opt.active_strategy, "residuals", None) if self.opt is not None else None
            for r in residuals.buffers.values() if residuals is not None else ():
                r[...] = 0
            ctx.barrier()
            tx0 = ctx.tx_bytes()
            c0 = time.process_time()
            t0 = time.perf_counter()
            self.fn()
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0
            tx1 = ctx.tx_bytes()
            if timed:
                self.times.append(dt)
                self.cpu.append(cpu)
                self.tx.append(tx1 - tx0)

    variants: list[Variant] = []
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    for key in args.variant_list:
        if key == "ddp":
            variants.append(Variant(key, ddp_bucketed(ctx.torch, ctx.dist, grads, args.bucket_mib, ctx.size)))
            continue
        if key == "hier" and not hier_ok:
            skipped[key] = "DistOpt does not accept hierarchical= (hierarchical all-reduce not in this checkout)"
            continue
        kw: dict[str, Any] = {}
        if key == "flat":
            if hier_ok:
                kw["hierarchical"] = False
            else:
                notes[key] = "DistOpt has no hierarchical=: flat is the plain dense step over all ranks"
        elif key == "hier":
            kw["hierarchical"] = True
        opt = distopt.DistOpt(NoOpUpdate(), strategy=_gradient_strategy(key, args.powersgd_rank),
                              backend=ctx.backend, **kw)
        variants.append(Variant(key, lambda opt=opt: opt.step(params, grads), opt))
    for v in variants:  # warm-ups per variant, then the timed iterations interleaved
        for _ in range(args.warmup):
            v.run(False)
        v.before = dict(v.opt.stats) if v.opt is not None else {}
    for _ in range(args.iters):
        for v in variants:
            v.run(True)
    results: dict[str, Any] = {}
    for v in variants:
        per_iter = ctx.reduce(v.times, "max")
        link = ctx.reduce(v.tx, "sum")
        cpu = ctx.reduce(v.cpu, "max")
        rec: dict[str, Any] = {"time_ms": statistics.median(per_iter) * 1e3,
                               "mean_ms": statistics.fmean(per_iter) * 1e3, "min_ms": min(per_iter) * 1e3,
                               "max_ms": max(per_iter) * 1e3, "iters_ms": [t * 1e3 for t in per_iter],
                               "link_bytes": statistics.fmean(link), "cpu_ms": statistics.median(cpu) * 1e3}
        if v.opt is not None:
            rec.update(_wire(_stats_delta(v.opt.stats, v.before)))
            rec["strategy"] = type(v.opt.strategy).__name__
            rec["settings"] = v.opt.strategy.settings()
            v.opt.close()
        else:
            rec.update({"wire_bytes": total * 4.0, "wire_ratio": 1.0, "control_per_step": None,
                        "strategy": f"ddp_bucketed({args.bucket_mib:g} MiB, gloo)"})
        if v.key in notes:
            rec["note"] = notes[v.key]
        results[v.key] = rec
    return {"results": results, "skipped": skipped, "elements": total, "tensors": len(shapes),
            "dense_bytes": total * 4, "warmup": args.warmup, "iters": args.iters,
            "hierarchical_supported": hier_ok}


# -------------------------------------------------------------------- cnn
def _ddp_cnn(ctx: Ctx, cnn_args: argparse.Namespace) -> list[dict[str, Any]]:
    """examples/cnn_mpi.py's CNN in PyTorch DDP (gloo, the link): the same init, data order and evaluation."""
    import cnn_mpi
    import torch
    import torch.nn.functional as F
    from common import epoch_summary, shards
    from torch.nn.parallel import DistributedDataParallel as DDP

    train_x, train_y, test_x, test_y = cnn_mpi.load(cnn_args.data_dir)
    torch.manual_seed(cnn_args.seed)
    model = cnn_mpi.CNN()
    ddp = DDP(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=cnn_args.lr, momentum=cnn_mpi.MOMENTUM, weight_decay=1e-5)
    train_x, train_y = torch.from_numpy(train_x), torch.from_numpy(train_y)
    test_x, test_y = torch.from_numpy(test_x), torch.from_numpy(test_y)
    sampler, steps, eval_idx = shards(cnn_args, len(train_x), len(test_x), ctx.rank, ctx.size)

    def reduce(totals: dict[str, float]) -> dict[str, float]:
        keys = sorted(totals)
        return dict(zip(keys, ctx.reduce([totals[k] for k in keys], "sum")))

    history = []
    for epoch in range(cnn_args.epochs):
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
        record: dict[str, Any] = {"epoch": epoch, **epoch_summary(reduce(totals), "train")}
        record["train_time"] = time.perf_counter() - start
        record.update(epoch_summary(reduce(cnn_mpi.evaluate(model, test_x, test_y, eval_idx)), "eval"))
        record["time"] = time.perf_counter() - start
        record["eval_time"] = record["time"] - record["train_time"]
        record["wire_ratio"] = record["epoch_wire_ratio"] = 1.0
        history.append(record)
    return history


def run_cnn(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    """One training run per variant (DDP and cnn_mpi.train); rank 0's result record."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import cnn_mpi

    import distopt

    cnn_mpi.load = functools.lru_cache(maxsize=None)(cnn_mpi.load)  # decode the IDX files once per job
    base = ["--epochs", str(args.epochs), "--threads", str(args.threads)]
    for flag, value in (("--max-steps", args.max_steps), ("--eval-limit", args.eval_limit),
                        ("--batch-size", args.batch_size), ("--data-dir", args.data_dir)):
        if value is not None:
            base += [flag, str(value)]
    base += args.rest
    results: dict[str, Any] = {}
    for key in args.variant_list:
        if key == "ddp":
            cnn_args = cnn_mpi.parse_args(base)
            history = _ddp_cnn(ctx, cnn_args)
            option = "DDP"
        else:
            option = CNN_OPTIONS[key]
            cnn_args = cnn_mpi.parse_args(base + ["--dist-option", option])
            history = cnn_mpi.train(cnn_args, make_opt=lambda sgd, **kw: distopt.DistOpt(sgd, backend=ctx.backend,
                                                                                         **kw))
        train_s = ctx.reduce([sum(h["train_time"] for h in history)], "max")[0]
        last = history[-1]
        from common import shards

        _, steps, _ = shards(cnn_args, 60000, 10000, ctx.rank, ctx.size)
        results[key] = {"train_s": train_s, "time_ms": train_s * 1e3, "eval_acc": last["eval_acc"],
                        "train_acc": last["train_acc"], "train_loss": last["train_loss"],
                        "wire_ratio": last.get("wire_ratio", 1.0), "last_wire_ratio": last.get("epoch_wire_ratio", 1.0),
                        "wire_bytes": last.get("wire_bytes_per_step"), "steps": steps * len(history),
                        "epochs": len(history), "option": option, "history": history}
        ctx.barrier()
    return {"results": results, "skipped": {}, "cnn_argv": base}


# -------------------------------------------------------------------- gpt
def make_gpt(vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> Any:
    """A GPT-style decoder: token + position embeddings, pre-LN blocks (causal self-attention, 4x GELU MLP)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        """Logits ``(B, T, vocab)`` for tokens ``(B, T)``."""

        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return GPT()


def markov_batches(vocab: int, seq_len: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of ``batch`` sequences of ``seq_len + 1`` tokens from one fixed random Markov chain.

    Every token has :data:`MARKOV_SUCCESSORS` possible next tokens (the chain
    is drawn with seed 0, the same on every rank), each equally likely: a
    model can bring the loss from ln(vocab) down to ln(4). ``seed`` draws
    the sequences (one per rank).
    """
    succ = np.random.default_rng(0).integers(0, vocab, size=(vocab, MARKOV_SUCCESSORS))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        toks = np.empty((batch, seq_len + 1), dtype=np.int64)
        toks[:, 0] = rng.integers(0, vocab, size=batch)
        choice = rng.integers(0, MARKOV_SUCCESSORS, size=(batch, seq_len))
        for t in range(seq_len):
            toks[:, t + 1] = succ[toks[:, t], choice[:, t]]
        out.append(toks)
    return out


def run_gpt(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    """Train the GPT per variant for warm-up + timed iterations; rank 0's result record."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distopt

    batch = args.batch_size or 8
    lr = args.lr or 1e-3
    data = markov_batches(args.vocab, args.seq_len, batch, args.warmup + args.iters, seed=1000 + ctx.rank)
    results: dict[str, Any] = {}
    params = 0
    for key in args.variant_list:
        torch.manual_seed(0)
        model = make_gpt(args.vocab, args.d_model, args.heads, args.layers, args.seq_len)
        params = sum(p.numel() for p in model.parameters())
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        opt = None
        if key == "ddp":
            net = DDP(model)

            def step(x: torch.Tensor, y: torch.Tensor) -> float:
                loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
                adamw.zero_grad()
                loss.backward()
                adamw.step()
                return loss.item()
        else:
            opt = distopt.DistOpt(adamw, strategy=_gradient_strategy(key, args.powersgd_rank), backend=ctx.backend,
                                  model=model)

            def step(x: torch.Tensor, y: torch.Tensor, opt: Any = opt) -> float:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                opt.backward_and_update(loss)
                return loss.item()
        times, losses = [], []
        before: dict[str, int] = {}
        ctx.barrier()
        for i, toks in enumerate(data):
            if i == args.warmup and opt is not None:
                before = dict(opt.stats)
            t = torch.from_numpy(toks)
            t0 = time.perf_counter()
            losses.append(step(t[:, :-1], t[:, 1:]))
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        per_iter = ctx.reduce(times, "max")
        mean_losses = [x / ctx.size for x in ctx.reduce(losses, "sum")]
        tail = mean_losses[-min(5, len(mean_losses)):]
        rec: dict[str, Any] = {"time_ms": statistics.median(per_iter) * 1e3,
                               "mean_ms": statistics.fmean(per_iter) * 1e3, "min_ms": min(per_iter) * 1e3,
                               "iters_ms": [x * 1e3 for x in per_iter], "first_loss": mean_losses[0],
                               "final_loss": statistics.fmean(tail), "losses": mean_losses}
        if opt is not None:
            rec.update(_wire(_stats_delta(opt.stats, before)))
            rec["strategy"] = type(opt.strategy).__name__
            opt.close()
        else:
            rec.update({"wire_bytes": params * 4.0, "wire_ratio": 1.0, "strategy": "torch DDP (gloo)"})
        results[key] = rec
        ctx.barrier()
    return {"results": results, "skipped": {}, "params": params, "dense_bytes": params * 4, "warmup": args.warmup,
            "iters": args.iters, "batch_per_rank": batch, "lr": lr,
            "data": f"synthetic: a fixed random Markov chain over {args.vocab} tokens, {MARKOV_SUCCESSORS} "
                    f"equally likely successors each (loss floor ln {MARKOV_SUCCESSORS} = "
                    f"{np.log(MARKOV_SUCCESSORS):.3f}), sequences drawn per rank"}


def main(argv: Sequence[str] | None = None) -> int:
    """Join, run the workload, write rank 0's record, leave."""
    args = parse_args(argv)
    ctx = Ctx(args.launcher, args.threads, float(os.environ.get("DISTOPT_TIMEOUT", "600")))
    out = {"step": run_step, "cnn": run_cnn, "gpt": run_gpt}[args.workload](ctx, args)
    if ctx.rank == 0:
        out.update({"launcher": args.launcher, "backend": ctx.backend, "world_size": ctx.size,
                    "nodes_seen": ctx.nodes, "hosts": ctx.hosts, "threads": ctx.threads})
        tmp = args.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, default=_common._json_default))
        tmp.rename(args.result_file)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
