"""A DDP training script ported to DistOpt, run at zero=0|1|2 next to DDP itself in the same job.

Usage: ``torchrun --nproc-per-node 2 tests/support/launched/ddp_port.py OUT_DIR`` or
``mpiexec -n 2 python tests/support/launched/ddp_port.py OUT_DIR``.

The script has what real DDP scripts (timm's ``train.py``) do: a ResNet-style
CNN with fused BatchNorm + activation layers, AdamW, a cosine LR schedule
stepped every step, ``torch.nn.utils.clip_grad_norm_``, gradient
accumulation through ``model.no_sync()``, a checkpoint written by rank 0
alone, and a resume that loads the optimizer state BEFORE wrapping it. Each
variant (``ddp``, ``zero0``, ``zero1``, ``zero2``) trains 6 steps straight,
and again 3 steps, checkpoint, a fresh model and optimizer resumed from it,
3 more steps. Rank r writes ``OUT_DIR/rank<r>.json``: per variant, the
losses of both runs and a hex digest of the final parameters and buffers.

Under mpiexec, ``distopt.init()`` joins MPI and makes torch.distributed's
default gloo group (for the DDP reference), and DistOpt runs on MPI; under
torchrun both use the torch backend.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distopt

STEPS, SPLIT, MICRO = 6, 3, 2


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """timm's fused layer: BatchNorm, then an activation (the forward does more than BatchNorm's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = BatchNormAct2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn1(self.stem(x))
        h = h + self.bn2(self.conv(h))  # a residual block
        return self.head(h.mean((2, 3)))


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


def digest(tensors: object) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(variant: str, rank: int, steps: range, model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, wrapped: torch.nn.Module, clip: object) -> list[float]:
    losses = []
    for s in steps:
        opt.zero_grad()
        for m in range(MICRO):
            x, y = batch(rank, s, m)
            with wrapped.no_sync() if m < MICRO - 1 else nullcontext():
                loss = F.cross_entropy(wrapped(x), y) / MICRO
                loss.backward()
        losses.append(loss.item())
        clip()
        opt.step()
        sched.step()
    return losses


def build(variant: str, backend: str, model: torch.nn.Module, inner: torch.optim.Optimizer) -> tuple:
    """The variant's (wrapped model, optimizer to step, clip function)."""
    if variant == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, inner, lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
    zero = int(variant[-1])
    opt = distopt.DistOpt(inner, model=model, zero=zero, backend=backend, buffSize=2048)
    if zero == 2:  # .grad is sharded at zero=2: the global norm over every rank's shard
        return model, opt, lambda: opt.clip_grad_norm_(0.5)
    return model, opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def run(variant: str, backend: str, rank: int, ckpt: Path) -> dict:
    model, inner, _ = fresh()
    wrapped, opt, clip = build(variant, backend, model, inner)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    straight = train(variant, rank, range(STEPS), model, opt, sched, wrapped, clip)
    final, buffers = digest(model.parameters()), digest(model.buffers())
    if variant != "ddp":
        opt.close()

    model, inner, _ = fresh()
    wrapped, opt, clip = build(variant, backend, model, inner)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    first = train(variant, rank, range(SPLIT), model, opt, sched, wrapped, clip)
    if variant != "ddp":
        opt.consolidate_state_dict(to=0)  # every rank; then rank 0 writes alone
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
    dist.barrier()
    if variant != "ddp":
        opt.close()

    model, inner, _ = fresh()
    saved = torch.load(ckpt, weights_only=True)
    model.load_state_dict(saved["model"])
    state = saved["opt"]
    state.pop("distopt", None)
    inner.load_state_dict(state)  # resume loaded into the torch optimizer before the wrap
    wrapped, opt, clip = build(variant, backend, model, inner)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    sched.load_state_dict(saved["sched"])
    second = train(variant, rank, range(SPLIT, STEPS), model, opt, sched, wrapped, clip)
    resumed = digest(model.parameters())
    if variant != "ddp":
        opt.close()
    dist.barrier()
    return {"straight": straight, "final": final, "buffers": buffers, "resumed_losses": first + second,
            "resumed": resumed}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        backend = "torch"
        dist.init_process_group("gloo")
    else:  # distopt's MPI world makes torch's default (gloo) process group, for DDP and dist.barrier
        backend = distopt.init().comm.name
    rank = dist.get_rank()
    result = {v: run(v, backend, rank, out / f"{v}.pt") for v in ("ddp", "zero0", "zero1", "zero2")}
    (out / f"rank{rank}.json").write_text(json.dumps({"backend": backend, "world": dist.get_world_size(),
                                                     **result}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
