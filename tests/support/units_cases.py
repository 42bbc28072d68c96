"""Cases of how ``zero=3`` learns which module reads which parameter, run by ``tests/sharding/test_zero3_units.py``.

Each case is ``fn(rank, comm, *args)`` (see :mod:`tests.support.backends`) and returns plain data.
"""
from __future__ import annotations

from typing import Any

import distopt
from tests.support.zero_cases import fill_normal

VOCAB, WIDTH, CONTEXT = 29, 12, 6


def deep_model(blocks: int = 6) -> Any:
    """A deep GPT-style model: a token embedding, ``blocks`` pre-norm blocks (attention through
    ``nn.MultiheadAttention``, which reads its ``out_proj`` without calling it, then an MLP), a final LayerNorm
    and a head that the root computes from the embedding's weight (a read outside the reading module's subtree of
    modules that ran)."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

        def forward(self, x: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.ln_f = nn.LayerNorm(WIDTH)

        def forward(self, idx: Any) -> Any:
            x = self.tok(idx)
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln_f(x), self.tok.weight)

    return fill_normal(Deep(), 5, 0.2)


def case_deep(rank: int, comm: Any, zero: int, first: str, steps: int = 3) -> dict[str, Any]:
    """The deep model with AdamW, buckets of 400 elements, ``steps`` steps after a ``first`` forward: ``"none"``,
    ``"no_grad"`` (an evaluation) or ``"raises"`` (its fourth block raises, on every rank, and the error is caught):
    the parameters after them, each step's peak of gathered BYTES, the model's BYTES, and the error a freed
    parameter's ``.T`` raises between steps (``zero=3``)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = deep_model()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=1e-2), comm=comm, zero=zero, buffSize=400,
                          model=model)
    if first == "no_grad":
        with torch.no_grad():
            model(torch.zeros(2, CONTEXT, dtype=torch.long))
    elif first == "raises":
        def fail(x: Any) -> Any:
            raise ValueError("a failed forward")
        model.blocks[3].forward = fail
        try:
            model(torch.zeros(2, CONTEXT, dtype=torch.long))
        except ValueError:
            del model.blocks[3].forward
    peaks = []
    for s in range(steps):
        tokens = torch.randint(0, VOCAB, (3, CONTEXT + 1), generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        peaks.append(int(opt.stats["gathered_bytes_peak"]))
    error = "no error"
    if zero == 3:
        try:
            model.tok.weight.T.sum()
        except RuntimeError as exc:
            error = str(exc)
    with opt.summon_full_params(writeback=False):
        params = [p.detach().clone().numpy() for p in model.parameters()]
    opt.close()
    return {"params": params, "peaks": peaks, "full": full, "error": error}


def case_two_models(rank: int, comm: Any) -> str:
    """Two ``zero=3`` models; the second's first forward uses a parameter of the first (freed: it is outside the first
    one's forward) in one operation with its own: the error raised."""
    import torch

    torch.set_num_threads(1)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opts = [distopt.DistOpt(torch.optim.SGD(m.parameters(), lr=0.1), comm=comm, zero=3, model=m)
            for m in (first, second)]

    def forward(x: Any) -> Any:
        return torch.nn.functional.linear(x, second.weight + first.weight)

    second.forward = forward
    try:
        second(torch.ones(2, 4))
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    for opt in opts:
        opt.close()
    return error
