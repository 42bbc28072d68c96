"""DistOpt over the torch backend against PyTorch DDP, under torchrun on one node.

Run::

    torchrun --nproc-per-node 2 benchmarks/torch_step.py                    # every workload, full
    torchrun --nproc-per-node 2 benchmarks/torch_step.py --workload gpt --quick

Workloads (``--workload step``, ``cnn``, ``gpt`` or ``all``):

* ``step``: a module whose parameters have ResNet-50's 161 shapes
  (:func:`step.resnet50_shapes`, 25,557,032 float32 elements) and whose loss
  is ``sum_i (p_i * c_i).sum()`` with fixed N(0, 1) tensors ``c_i`` (a seed
  per rank), so backward writes ``c_i`` into every ``.grad``. One iteration
  is ``zero_grad``, forward, ``loss.backward()``, ``SGD.step()`` (momentum
  0.9, weight decay 1e-4). Variants: ``ddp`` (``DistributedDataParallel``,
  gloo, its defaults: 25 MiB buckets), ``distopt`` (``DistOpt(SGD,
  backend="torch", model=...)``, the defaults: dense strategy, overlap),
  ``ddp_view`` and ``distopt_view`` (both with ``gradient_as_bucket_view=True``)
  and ``gloo`` (:func:`step.ddp_bucketed`: DDP's reducer without autograd,
  communication only, a reference).
* ``cnn``: a small ResNet of timm's ``test_resnet`` size (:func:`make_cnn`:
  a 3x3 stem and four basic residual blocks of 32, 64, 64 and 128 channels,
  BatchNorm after every convolution, 382,634 parameters) trained with
  ``torch.optim.SGD`` (lr 0.1, momentum 0.9, weight decay 1e-4) on random
  3x32x32 images and 10 classes, batch 16 per rank (a seed per rank). One
  iteration is forward, cross-entropy, ``zero_grad``, ``loss.backward()``,
  ``SGD.step()``; the BatchNorm buffers are broadcast from rank 0 before each
  forward in both variants (DDP's ``broadcast_buffers``). Variants: ``ddp``
  and ``distopt``.
* ``gpt``: a GPT-style decoder (token and position embeddings, pre-LN blocks
  of causal self-attention and a 4x GELU MLP, a bias-free head) trained with
  ``torch.optim.AdamW`` (lr 1e-3, weight decay 0.01) on random tokens (a
  seed per rank). One iteration is forward, cross-entropy, ``zero_grad``,
  ``loss.backward()``, ``AdamW.step()``. Variants: ``ddp``, ``distopt``
  (``zero=0``), ``zero1`` and ``zero2`` (``DistOpt(..., zero=1|2)``: AdamW's
  moments sharded; at ``zero=2`` the gradients too).

Every variant of a workload is built at the start from the same seed. The
timed part is ``--rounds`` rounds; in each round every variant runs
``--iters`` iterations, the variants' order alternating between rounds
(A B, B A, ...), each iteration after a barrier. ``ms`` is the median over
rounds of the round's mean iteration time (each iteration's time the max
over ranks); ``x ddp`` is the median over rounds of the round's time over
``ddp``'s in the same round. ``ctl/step`` is DistOpt's own control
collectives per step (``stats["control_collectives"]``), ``buckets`` its
bucket reductions per step.

Writes ``benchmarks/results/torch_step.json`` (``--out``) with ``env``
(load average at start and end), the config, and per workload and variant
every round's time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import _common
import numpy as np
from netsim_worker import make_gpt
from step import ddp_bucketed, resnet50_shapes

WORKLOADS = {"step": ("ddp", "distopt", "ddp_view", "distopt_view", "gloo"), "cnn": ("ddp", "distopt"),
             "gpt": ("ddp", "distopt", "zero1", "zero2")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("step", "cnn", "gpt", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="3 rounds of 3 iterations (default 12 rounds)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 12; 3 quick)")
    p.add_argument("--iters", type=int, default=None, help="iterations per variant per round (default 5; 3 quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant first (default 3)")
    p.add_argument("--variants", default=None, help="comma-separated variants to run (each workload runs "
                   "those of its own; default: all)")
    p.add_argument("--width-div", type=int, default=1, help="divide ResNet-50's widths (smoke runs)")
    p.add_argument("--gpt", default="512,128,4,4,128,8",
                   help="GPT vocab,d_model,heads,layers,seq_len,batch (default 512,128,4,4,128,8)")
    p.add_argument("--out", type=Path, default=_common.default_out("torch_step"), help="JSON output path")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 12)
    args.iters = args.iters or (3 if args.quick else 5)
    return args


def shapes_model(torch: Any, shapes: list[tuple[int, ...]], rank: int) -> tuple[Any, Callable[[], Any]]:
    """A module with one parameter per shape and its loss ``sum_i (p_i * c_i).sum()`` (``.grad`` = ``c_i``)."""
    torch.manual_seed(99)
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes)
    g = torch.Generator().manual_seed(1234 + rank)
    consts = [torch.randn(s, generator=g) for s in shapes]

    def forward(module: Any) -> Any:
        return sum((p * c).sum() for p, c in zip(module.ps, consts))

    model.forward = lambda: forward(model)  # DDP calls module.forward through __call__
    return model, forward


class Variant:
    """One timed iteration function, and DistOpt's stats when it has them."""

    def __init__(self, key: str, fn: Callable[[], Any], opt: Any = None, close: Callable[[], Any] = lambda: None
                 ) -> None:
        self.key, self.fn, self.opt, self.close = key, fn, opt, close
        self.rounds: list[list[float]] = []
        self.before: dict[str, float] = {}


def step_variants(torch: Any, dist: Any, distopt: Any, keys: list[str], rank: int, size: int, width_div: int
                  ) -> list[Variant]:
    """The ``step`` workload's variants (see the module docs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    shapes = resnet50_shapes(width_div=width_div)
    out = []
    for key in keys:
        if key == "gloo":
            g = np.random.default_rng(1234 + rank)
            grads = [g.standard_normal(s, dtype=np.float32) for s in shapes]
            out.append(Variant(key, ddp_bucketed(torch, dist, grads, 25.0, size)))
            continue
        model, forward = shapes_model(torch, shapes, rank)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        view = key.endswith("_view")
        if key.startswith("ddp"):
            net = DDP(model, gradient_as_bucket_view=view)
            opt, call, close = sgd, (lambda net=net: net()), (lambda: None)
        else:
            opt = distopt.DistOpt(sgd, backend="torch", model=model, gradient_as_bucket_view=view)
            call, close = (lambda model=model: forward(model)), opt.close

        def iteration(opt: Any = opt, call: Callable[[], Any] = call) -> None:
            opt.zero_grad()
            call().backward()
            opt.step()
        out.append(Variant(key, iteration, opt if not key.startswith("ddp") else None, close))
    return out


def model_variants(torch: Any, distopt: Any, keys: list[str], make_model: Callable[[], Any],
                   make_opt: Callable[[Any], Any], loss: Callable[[Any], Any]) -> tuple[list[Variant], int]:
    """A model workload's variants (``ddp``: DDP; ``distopt``, ``zero1``, ``zero2``: DistOpt at zero=0|1|2),
    each from seed 0, and the model's parameter count. One iteration: ``loss(net)``, ``zero_grad``,
    ``backward``, ``step``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out, count = [], 0
    for key in keys:
        torch.manual_seed(0)
        model = make_model()
        count = sum(p.numel() for p in model.parameters())
        inner = make_opt(model)
        if key == "ddp":
            net, opt, dopt = DDP(model), inner, None
        else:
            zero = {"zero1": 1, "zero2": 2}.get(key, 0)
            net, dopt = model, distopt.DistOpt(inner, backend="torch", model=model, zero=zero)
            opt = dopt

        def iteration(net: Any = net, opt: Any = opt) -> None:
            value = loss(net)
            opt.zero_grad()
            value.backward()
            opt.step()
        out.append(Variant(key, iteration, dopt, dopt.close if dopt is not None else (lambda: None)))
    return out, count


def gpt_variants(torch: Any, distopt: Any, keys: list[str], rank: int, spec: str) -> tuple[list[Variant], int]:
    """The ``gpt`` workload's variants and the model's parameter count."""
    vocab, d_model, heads, layers, seq_len, batch = (int(v) for v in spec.split(","))
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return model_variants(torch, distopt, keys, lambda: make_gpt(vocab, d_model, heads, layers, seq_len),
                          lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
                          lambda net: torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()))


def make_cnn(torch: Any) -> Any:
    """timm ``test_resnet``-sized: stem conv 3->32, basic blocks 32->32, 32->64 (stride 2), 64->64,
    64->128 (stride 2), global average pool, linear 128->10; BatchNorm after every convolution."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.short(x))

    return nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         Block(32, 32, 1), Block(32, 64, 2), Block(64, 64, 1), Block(64, 128, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def cnn_variants(torch: Any, distopt: Any, keys: list[str], rank: int) -> tuple[list[Variant], int]:
    """The ``cnn`` workload's variants and the model's parameter count."""
    g = torch.Generator().manual_seed(2000 + rank)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    return model_variants(torch, distopt, keys, lambda: make_cnn(torch),
                          lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
                          lambda net: torch.nn.functional.cross_entropy(net(x), y))


def measure(torch: Any, dist: Any, variants: list[Variant], args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, run the interleaved rounds, and summarise (every rank; the times are max over ranks)."""
    def timed() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        v.fn()
        return time.perf_counter() - t0

    for v in variants:
        for _ in range(args.warmup):
            v.fn()
        v.before = dict(v.opt.stats) if v.opt is not None else {}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            v.rounds.append([timed() for _ in range(args.iters)])
    results: dict[str, Any] = {}
    for v in variants:
        per_iter = torch.tensor(v.rounds, dtype=torch.float64)
        dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
        rec: dict[str, Any] = {"round_ms": (per_iter.mean(dim=1) * 1e3).tolist()}
        rec["ms"] = float(np.median(rec["round_ms"]))
        rec["min_ms"] = float(per_iter.min() * 1e3)
        if v.opt is not None:
            d = {k: v.opt.stats[k] - v.before.get(k, 0) for k in v.opt.stats}
            steps = max(d["steps"], 1)
            rec["control_per_step"] = d["control_collectives"] / steps
            rec["buckets_per_step"] = d["buckets_started_in_backward"] / steps
            rec["wait_ms_per_step"] = d["wait_seconds"] / steps * 1e3
        results[v.key] = rec
        v.close()
    if "ddp" in results:
        ddp = np.array(results["ddp"]["round_ms"])
        for rec in results.values():
            rec["x_ddp"] = float(np.median(np.array(rec["round_ms"]) / ddp))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    import distopt

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    env = _common.env_info(mpi=False) if rank == 0 else {}
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    data: dict[str, Any] = {"benchmark": "torch_step", "world_size": size, "torch_threads": torch.get_num_threads(),
                            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                            "workloads": {}}
    wanted = None if args.variants is None else {k for k in args.variants.split(",") if k}
    unknown = (wanted or set()) - {k for w in workloads for k in WORKLOADS[w]}
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; choose from "
                         + "; ".join(f"{w}: {', '.join(WORKLOADS[w])}" for w in workloads))
    for w in workloads:
        keys = [k for k in WORKLOADS[w] if wanted is None or k in wanted]
        if w == "step":
            variants, params = step_variants(torch, dist, distopt, keys, rank, size, args.width_div), None
        elif w == "cnn":
            variants, params = cnn_variants(torch, distopt, keys, rank)
        else:
            variants, params = gpt_variants(torch, distopt, keys, rank, args.gpt)
        results = measure(torch, dist, variants, args)
        data["workloads"][w] = {"params": params, "results": results}
        if rank == 0:
            if w == "step":
                what = "ResNet-50's gradient shapes, SGD"
            elif w == "cnn":
                what = f"small ResNet with BatchNorm, {params:,} parameters, SGD, batch 16 of 3x32x32"
            else:
                what = f"GPT {args.gpt} (vocab,d_model,heads,layers,seq,batch), {params:,} parameters, AdamW"
            title = (f"{w}: {what}; {size} processes, {_common.cpus()} CPUs, {torch.get_num_threads()} torch "
                     f"thread(s); {args.rounds} rounds x {args.iters} iterations, interleaved")
            rows = [[k, f"{r['ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['x_ddp']:.3f}" if "x_ddp" in r else None,
                     r.get("control_per_step"), r.get("buckets_per_step")] for k, r in results.items()]
            print(_common.table(["variant", "ms", "min ms", "x ddp", "ctl/step", "buckets"], rows, title))
    dist.destroy_process_group()
    if rank == 0:
        data["env"] = _common.finish_env(env)
        print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
        print(f"wrote {_common.write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
