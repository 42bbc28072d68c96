"""The torchrun worker of ``benchmarks/fits.py``: one variant of a GPT trained under a per-rank memory cap.

Usage (by ``benchmarks/fits.py``)::

    torchrun --nproc-per-node W fits_worker.py OUT --variant V --gpt SPEC --steps N --cap-bytes C
    python fits_worker.py OUT --variant reference --world W --gpt SPEC --steps N      # one process, no cap

Variants: ``ddp`` (``DistributedDataParallel`` over a CPU-built model, AdamW), ``zero0`` (``DistOpt(AdamW,
zero=0)`` over a CPU-built model), ``fsdp2`` (torch's ``fully_shard`` on every block and the root of a model
built on the meta device, then ``to_empty`` and each module's ``reset_parameters()`` on its own whole tensors
from seed 0, of which each rank keeps its shard: the CPU build's values), ``fsdp2_bf16`` (the same with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` on every ``fully_shard``),
``zero3`` (a meta-built model and
``DistOpt(AdamW, zero=3, model=m)``), ``zero3_bf16`` (the same with ``param_dtype=torch.bfloat16,
reduce_dtype=torch.float32``), and ``reference`` (one process, float32, plain AdamW on a CPU-built model,
the W ranks' batches of each step concatenated: the float32 reference of the losses).

**The cap** (:class:`Cap`): after the imports and ``init_process_group`` each rank reads its ``VmData``
(``/proc/self/status``: the private writable memory the kernel counts, BYTES) and sets ``RLIMIT_DATA`` to
that baseline plus ``C``: every allocation beyond it fails (Linux >= 4.7 counts private anonymous
``mmap``s), so torch raises ``RuntimeError: DefaultCPUAllocator: can't allocate memory`` and Python
``MemoryError``, which the worker catches and reports as ``"status": "oom"`` (out of memory inside the
cap) instead of the OOM killer ending it. The cap is on virtual data growth, which is at least the resident
growth of that memory.

Each rank writes ``OUT/<variant>.rank<r>.json``: ``status`` (``ok``, ``oom``, ``error``: a peer's failure
seen in a collective), ``error`` and ``where`` (the phase that failed), ``baseline_mib``, ``cap_mib``,
``peak_growth_mib`` (the largest ``VmData`` growth above the baseline, sampled every 2 ms; ``growth_mib``:
[its peak so far, the growth now] after the build and after each step),
``peak_rss_mib`` (``ru_maxrss``: the process's peak resident set, baseline included), ``step_s`` (each
step's seconds), ``losses`` (this rank's loss at each step, before its update), ``gather_bytes`` and
``reduce_bytes`` (BYTES one step all-gathered and handed to the gradients' reduction: distopt's
``stats["step_gather_bytes"]`` and ``["step_wire_bytes"]``; FSDP2's all-gather outputs and reduce-scatter
inputs, counted by wrapping ``torch.distributed``'s collectives; the last step's).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import _common  # noqa: F401  (the repository root on sys.path)
import torch
import torch.distributed as dist
from netsim_worker import make_gpt
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import distopt

VARIANTS = ("ddp", "zero0", "fsdp2", "fsdp2_bf16", "zero3", "zero3_bf16")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def vm_data() -> int:
    """BYTES of this process's ``VmData`` (what ``RLIMIT_DATA`` limits)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _statm_data() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[5]) * PAGE


class Cap:
    """``RLIMIT_DATA`` at this process's ``VmData`` now plus ``cap`` BYTES (0: no limit), and a thread that
    samples the data growth every 2 ms (started before the baseline, so its stack is in it)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.peak, self._stop = cap, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        time.sleep(0.01)
        self.baseline, self._base_statm = vm_data(), _statm_data()
        self.hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        if cap > 0:
            resource.setrlimit(resource.RLIMIT_DATA, (self.baseline + cap, self.hard))

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _statm_data())
            except MemoryError:  # the cap refused the read's buffer: the next sample will do
                pass
            time.sleep(0.002)

    def growth(self) -> int:
        """The peak data growth above the baseline so far, BYTES."""
        return max(self.peak, _statm_data()) - self._base_statm

    def now(self) -> int:
        """The data growth above the baseline now, BYTES."""
        return _statm_data() - self._base_statm

    def lift(self) -> None:
        """Stop sampling and remove the limit (to write the report whatever happened)."""
        self._stop.set()
        resource.setrlimit(resource.RLIMIT_DATA, (self.hard, self.hard))


def is_oom(exc: BaseException) -> bool:
    """An allocation refused by the cap: ``MemoryError``, torch's ``DefaultCPUAllocator`` error, ``bad_alloc``."""
    text = str(exc)
    return isinstance(exc, MemoryError) or any(s in text for s in (
        "can't allocate memory", "not enough memory", "bad_alloc", "Cannot allocate memory"))


def spec(text: str) -> tuple[int, ...]:
    """``vocab,d_model,heads,layers,seq_len,batch`` as integers."""
    return tuple(int(v) for v in text.split(","))


def batch(vocab: int, seq_len: int, n: int, step: int, rank: int) -> Any:
    """Rank ``rank``'s ``(n, seq_len + 1)`` tokens of step ``step`` (the same in every variant)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (n, seq_len + 1), generator=g)


def loss_of(model: Any, tokens: Any) -> Any:
    """Mean cross-entropy of next-token prediction, in float32 whatever the logits' dtype."""
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def fsdp2_init(model: Any, rank: int, world: int) -> None:
    """Fill FSDP2's local shards with the CPU build's values: seed 0, each module that owns parameters
    (``model.modules()`` order, the construction order) initialized on whole CPU tensors put in place of its
    sharded ones for the call, this rank's rows of them kept (FSDP2 shards dim 0 as ``torch.chunk``)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            for name, p in own.items():
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape))
            module.reset_parameters()
            whole = {name: module._parameters[name].detach() for name in own}
            module._parameters.update(own)
            for name, p in own.items():
                local, rows = p.to_local(), whole[name].chunk(world, dim=0)
                if local.numel():
                    local.copy_(rows[rank])


class Counted:
    """Wraps ``torch.distributed``'s single-tensor all-gather and reduce-scatter (FSDP2's) to count BYTES."""

    def __init__(self) -> None:
        self.gather = self.reduce = 0
        for name, count in (("all_gather_single", "gather"), ("all_gather_into_tensor", "gather"),
                            ("reduce_scatter_single", "reduce"), ("reduce_scatter_tensor", "reduce")):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), count))

    def _wrap(self, fn: Callable[..., Any], count: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if count == "gather":
                t = kwargs.get("output_tensor", args[0] if args else None)
            else:
                t = kwargs.get("input", args[1] if len(args) > 1 else kwargs.get("input_tensor"))
            if t is not None:
                setattr(self, count, getattr(self, count) + t.numel() * t.element_size())
            return fn(*args, **kwargs)
        return call


def build(variant: str, gpt: tuple[int, ...], rank: int, world: int) -> tuple[Any, Any, Any, Callable[[], dict]]:
    """(network to call, the model, optimizer, a function giving the last step's gathered/reduced BYTES)."""
    vocab, d_model, heads, layers, seq_len, _ = gpt
    torch.manual_seed(0)
    if variant in ("ddp", "zero0", "reference"):
        model = make_gpt(vocab, d_model, heads, layers, seq_len)
        if variant == "ddp":
            return DistributedDataParallel(model), model, torch.optim.AdamW(model.parameters(), **ADAMW), dict
        if variant == "reference":
            return model, model, torch.optim.AdamW(model.parameters(), **ADAMW), dict
        opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), **ADAMW), backend="torch", model=model, zero=0)
        return model, model, opt, lambda: {"gather_bytes": 0, "reduce_bytes": int(opt.stats["step_wire_bytes"])}
    with torch.device("meta"):
        model = make_gpt(vocab, d_model, heads, layers, seq_len)
    if variant.startswith("fsdp2"):
        counted = Counted()
        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if variant == "fsdp2_bf16" else {}
        for block in model.blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        model.to_empty(device="cpu")
        fsdp2_init(model, rank, world)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        marks = [0, 0]

        def fsdp_bytes() -> dict:
            out = {"gather_bytes": counted.gather - marks[0], "reduce_bytes": counted.reduce - marks[1]}
            marks[:] = [counted.gather, counted.reduce]
            return out
        return model, model, opt, fsdp_bytes
    mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if variant == "zero3_bf16" else {}
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), **ADAMW), backend="torch", model=model, zero=3,
                          timeout=180, **mixed)
    return model, model, opt, lambda: {"gather_bytes": int(opt.stats["step_gather_bytes"]),
                                       "reduce_bytes": int(opt.stats["step_wire_bytes"])}


def train(args: argparse.Namespace, rec: dict[str, Any], rank: int, world: int, cap: Cap) -> None:
    """Build ``args.variant`` and run its steps, filling ``rec`` as it goes (``where``: the phase now)."""
    gpt = spec(args.gpt)
    vocab, seq_len, n = gpt[0], gpt[4], gpt[5]
    rec["where"] = "build"
    net, model, opt, moved = build(args.variant, gpt, rank, world)
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["growth_mib"] = [[round(cap.growth() / MIB, 1), round(cap.now() / MIB, 1)]]
    for step in range(args.steps):
        rec["where"] = f"step {step + 1}"
        tokens = (torch.cat([batch(vocab, seq_len, n, step, r) for r in range(world)]) if args.variant == "reference"
                  else batch(vocab, seq_len, n, step, rank))
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(net, tokens)
        loss.backward()
        opt.step()
        rec["step_s"].append(time.perf_counter() - t0)
        rec["losses"].append(float(loss.detach()))
        rec.update(moved())
        rec["growth_mib"].append([round(cap.growth() / MIB, 1), round(cap.now() / MIB, 1)])
    rec["where"] = "done"
    if hasattr(opt, "close"):
        opt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--variant", choices=(*VARIANTS, "reference"), required=True)
    p.add_argument("--gpt", required=True, help="vocab,d_model,heads,layers,seq_len,batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cap-bytes", type=int, default=0, help="the cap above the baseline, BYTES (0: none)")
    p.add_argument("--world", type=int, default=4, help="reference only: the world whose batches it joins")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.variant == "reference":
        rank, world = 0, args.world
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
        rank, world = dist.get_rank(), dist.get_world_size()
    cap = Cap(args.cap_bytes)
    rec: dict[str, Any] = {"variant": args.variant, "rank": rank, "world": world, "status": "ok",
                           "baseline_mib": cap.baseline / MIB, "cap_mib": args.cap_bytes / MIB, "step_s": [],
                           "losses": []}
    try:
        train(args, rec, rank, world, cap)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        rec["status"] = "oom" if is_oom(exc) else "error"
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    cap.lift()
    rec["peak_growth_mib"] = cap.growth() / MIB
    rec["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (args.out / f"{args.variant}.rank{rank}.json").write_text(json.dumps(rec))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown collective: a peer may have failed, and the record is written


if __name__ == "__main__":
    main()
