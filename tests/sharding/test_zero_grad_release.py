"""At ``zero=2|3`` a synchronizing backward drops each parameter's gradient once it is packed into its bucket (FSDP
frees each unsharded gradient once reduce-scattered): when backward reaches the first layer, no ``.grad`` of the
layers after it is held, nor referenced anywhere (weak references to the gradient tensors are dead); inside
``no_sync()`` the gradients accumulate in ``.grad`` as before. The steps equal ``zero=0``'s (float64, 1e-10), with a
weight tied between the first and the last layer (its hook fires once, after both uses accumulated), and with mixed
precision (``param_dtype=float32``: the gradients are cast into ``reduce_dtype`` buckets; float32 rounding)."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case

torch = pytest.importorskip("torch")

import distopt  # noqa: E402

W, B, WIDTH = 2, 3, 8


class Layers(torch.nn.Module):
    """Four square float64 layers (one bucket each at ``buffSize=72``); ``tied``: the last one reuses the first's
    weight (as a GPT's head its embedding)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.tied = tied
        if tied:
            self.layers[3].weight = self.layers[0].weight
        self.double()
        rng = np.random.default_rng(0)  # not torch's global generator: the simulated ranks are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(p.shape))))
        self.seen: Any = None  # called with nothing when backward reaches the first layer's output

    def forward(self, x: Any) -> Any:
        h = self.layers[0](x)
        if h.requires_grad and self.seen is not None:
            h.register_hook(lambda grad: self.seen())
        for layer in self.layers[1:]:
            h = layer(torch.tanh(h))
        return h


def _batch(step: int, micro: int, rank: int) -> Any:
    rng = np.random.default_rng(100 * step + micro)
    return torch.from_numpy(rng.standard_normal((W * B, WIDTH))[rank * B:(rank + 1) * B])


def case_release(rank: int, comm: Any, zero: int, tied: bool, mixed: bool = False) -> dict[str, Any]:
    """Two steps: one backward; then one inside ``no_sync()`` and one outside. At each backward's arrival at the first
    layer: the BYTES held by the ``.grad`` of the later layers' parameters, and how many of their gradient tensors are
    still alive (referenced anywhere)."""
    model = Layers(tied)
    first = {id(p) for p in model.layers[0].parameters()}
    later = [p for p in model.parameters() if id(p) not in first]
    refs: dict[int, Any] = {}
    for p in later:  # registered before DistOpt's hooks: runs first, sees the final gradient
        p.register_post_accumulate_grad_hook(lambda p: refs.__setitem__(id(p), weakref.ref(p.grad)))
    precision = {"param_dtype": torch.float32, "reduce_dtype": torch.float64} if mixed else {}
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, zero=zero,
                          model=model, buffSize=WIDTH * WIDTH + WIDTH, **precision)
    records: list[tuple[int, int]] = []

    def seen() -> None:
        held = sum(int(p.grad.nbytes) for p in later if p.grad is not None)
        records.append((held, sum(r() is not None for r in refs.values())))

    model.seen = seen
    for step, passes in enumerate(([False], [True, False])):
        opt.zero_grad()
        for micro, inside in enumerate(passes):
            refs.clear()
            with opt.no_sync() if inside else _nothing():
                model(_batch(step, micro, rank)).square().mean().backward()
        opt.step()
    with opt.summon_full_params(writeback=False):
        params = [p.detach().numpy().copy() for p in model.parameters()]
    opt.close()
    later_bytes = sum(p.numel() * (4 if mixed else 8) for p in later)  # mixed: param_dtype gradients
    return {"records": records, "params": params, "later": later_bytes, "count": len(later)}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@pytest.mark.unit
@pytest.mark.parametrize("tied, mixed", [(False, False), (True, False), (False, True)], ids=["plain", "tied", "mixed"])
def test_zero_2_3_drop_each_gradient_once_packed(tied: bool, mixed: bool) -> None:
    ref = run_case("sim", W, case_release, 0, tied, mixed)
    for zero in (2, 3):
        for rank, got in enumerate(run_case("sim", W, case_release, zero, tied, mixed)):
            where = f"zero={zero} rank {rank} tied={tied} mixed={mixed}"
            synced, inside, after = got["records"]
            assert synced == (0, 0), f"{where}: a synchronizing backward holds (BYTES, tensors) {synced}"
            assert after == (0, 0), f"{where}: the backward after no_sync() holds (BYTES, tensors) {after}"
            assert inside == (got["later"], got["count"]), f"{where}: no_sync() must keep .grad, got {inside}"
            for a, b in zip(got["params"], ref[rank]["params"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 if mixed else 1e-10, err_msg=where)
    for rank, got in enumerate(ref):  # zero=0 keeps every gradient until the average lands in it
        assert got["records"][0] == (got["later"], got["count"]), got["records"]
