"""Peak memory of ``DistOpt(AdamW, zero=3, model=m)`` over a GPT built on the meta device (mpiexec -n W).

Usage: ``mpiexec -n W python meta_memory.py meta|cpu|load [DIR]``. Every rank prints one JSON line: the growth of
its resident set (bytes, sampled every millisecond by a thread reading ``/proc/self/statm``) while it builds the
model and ``DistOpt(AdamW, zero=3, model=m, buffSize=BUCKET)`` over it, under ``torch.device("meta")`` (``meta``) or
on the CPU (``cpu``); the model's float32 parameter bytes, its largest module's (the bytes of the tensors one module
directly owns), the largest bucket's and this rank's segments' (what it holds of the parameters after
construction). With ``DIR``, ``meta`` then takes one step and writes this rank's ``state_dict(sharded=True,
params=True)`` to ``DIR/shard<rank>.pt``; ``load`` builds the meta model and DistOpt, then reports the growth while
``opt.load_state_dict`` streams those shards (``ShardStream``, one file read at a time) and the largest file's bytes.
One mode per process: pages a finished measurement freed would serve the next. A tiny meta-built model is
constructed first, so that imports and the communicator's setup are not counted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from rss import peak_growth  # this folder's module (run as a script)
from torch import nn

import distopt

VOCAB, WIDTH, CONTEXT, BLOCKS = 2048, 256, 64, 12  # 9.8M float32 parameters: 39 MB; the largest module 2 MB
BUCKET = 262144  # ELEMENTS per bucket: 1 MiB of float32




class Block(nn.Module):
    """A pre-norm transformer block: LayerNorms, a fused ``qkv`` and an output projection, a 4x MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Any) -> Any:
        b, t, w = x.shape
        q, k, v = (z.reshape(b, t, 4, w // 4).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``blocks`` blocks, a final LayerNorm and a head tied to the token embedding."""

    def __init__(self, vocab: int, width: int, context: int, blocks: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: Any) -> Any:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(device: str, shape: tuple[int, int, int, int]) -> tuple[Any, Any]:
    """The GPT of ``shape`` built on ``device`` from seed 0, and ``DistOpt(AdamW, zero=3)`` over it."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(*shape)
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=1e-3), zero=3, model=model, buffSize=BUCKET)
    return model, opt


def load(model: Any, opt: Any, folder: str) -> tuple[int, int]:
    """The growth while ``opt`` loads every rank's shard in ``folder``, read one at a time; the largest file's bytes."""
    files = sorted(Path(folder).glob("shard*.pt"))
    headers = [{"world_size": len(files), "rank": r} for r in range(len(files))]

    def stream() -> None:
        shards = (torch.load(folder + f"/shard{r}.pt", weights_only=True) for r in range(len(files)))
        opt.load_state_dict(distopt.ShardStream(headers, shards))

    return peak_growth(stream)[0], max(f.stat().st_size for f in files)


def main(mode: str, folder: str | None) -> None:
    torch.set_num_threads(1)
    _, warm = build("meta", (16, 8, 4, 1))  # imports, the communicator
    warm.close()
    if mode == "load":
        model, opt = build("meta", (VOCAB, WIDTH, CONTEXT, BLOCKS))
        assert folder is not None
        growth, file_bytes = load(model, opt, folder)
        state = sum(2 * t.numel() * t.element_size() for t in opt.follower.sink.store.segments)  # exp_avg, exp_avg_sq
        bucket = max(b.size for b in opt.follower.sink.store.buckets) * 4
        print(json.dumps({"mode": mode, "rank": opt.global_rank, "growth": growth, "file_bytes": file_bytes,
                          "state_bytes": state, "bucket_bytes": bucket}), flush=True)
        opt.close()
        return
    growth, (model, opt) = peak_growth(lambda: build(mode, (VOCAB, WIDTH, CONTEXT, BLOCKS)))
    params = list(model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(sum(t.numel() * t.element_size() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                  for m in model.modules())
    bucket = max(b.size for b in opt.follower.sink.store.buckets) * 4
    held = sum(s.numel() * s.element_size() for s in opt.follower.sink.store.segments)
    with opt.summon_full_params():  # the values, for a check that the run built what it should
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(json.dumps({"mode": mode, "rank": opt.global_rank, "world": opt.world_size, "growth": growth,
                      "model_bytes": model_bytes, "largest_module_bytes": largest, "bucket_bytes": bucket,
                      "held_bytes": held, "checksum": checksum}), flush=True)
    if folder is not None:
        opt.zero_grad()
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(opt.global_rank))
        model(tokens).sum().backward()
        opt.step()
        torch.save(opt.state_dict(sharded=True, params=True), f"{folder}/shard{opt.global_rank}.pt")
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
