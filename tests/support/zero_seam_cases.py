"""Cases where real training scripts touch a sharded optimizer (``DistOpt(zero=1|2)``): ``.grad``, clipping,
state loaded before the wrap. Run by ``tests/sharding/test_zero_seams.py`` on any backend; each case is
``fn(rank, comm, *args)`` and returns plain data."""
from __future__ import annotations

from typing import Any

import numpy as np

import distopt


def _mlp(sizes: tuple[int, ...], seed: int = 0) -> Any:
    import torch

    layers: list[Any] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    rng = np.random.default_rng(seed)  # not torch's global generator: the simulated ranks are threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(p.shape)).astype(np.float32)))
    return model


def _data(rank: int, step: int, rows: int, cols: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows + rank, cols, generator=g)  # rank-dependent data and batch size


def case_h69_clipping(rank: int, comm: Any, zero: int, mode: str) -> dict[str, Any]:
    """H69: MLP 8-32-32-4, SGD(lr 1.0), buffSize=128, 2 steps, clipping by ``mode`` between backward and
    step: ``distopt`` (``opt.clip_grad_norm_(0.05)``), ``distopt-inf`` (the same, ``norm_type=inf``),
    ``torch`` (``torch.nn.utils.clip_grad_norm_``), ``torch-inf``, ``value`` (``clip_grad_value_(1e-3)``),
    ``zero-grads`` (``p.grad.mul_(0)``). Returns the parameters and norms, or the error raised."""
    import torch

    torch.set_num_threads(1)
    model = _mlp((8, 32, 32, 4))
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=1.0), comm=comm, zero=zero, buffSize=128,
                          model=model)
    norms = []
    try:
        for s in range(2):
            opt.zero_grad()
            model(_data(rank, s, 5, 8)).pow(2).mean().backward()
            if mode == "distopt":
                norms.append(float(opt.clip_grad_norm_(0.05)))
            elif mode == "distopt-inf":
                norms.append(float(opt.clip_grad_norm_(0.05, norm_type=float("inf"))))
            elif mode == "torch":
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            elif mode == "torch-inf":
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type="inf")))
            elif mode == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            elif mode == "zero-grads":
                for p in model.parameters():
                    p.grad.mul_(0)
            opt.step()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"params": [p.detach().clone().numpy() for p in model.parameters()], "norms": norms}


def case_state_before_wrap(rank: int, comm: Any, zero: int, optimizer: str) -> dict[str, Any]:
    """An optimizer trained 2 steps alone on rank 0's data (the same on every rank), its state saved and
    loaded into a fresh torch optimizer BEFORE ``DistOpt(opt, zero=zero)`` wraps it (a ``--resume`` of
    most DDP scripts), then 2 distributed steps. Returns the parameters and the consolidated state."""
    import torch

    torch.set_num_threads(1)

    def make(params: Any) -> Any:
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = _mlp((6, 16, 3))
    warm = make(model.parameters())
    for s in range(2):
        warm.zero_grad()
        model(_data(0, 10 + s, 4, 6)).pow(2).mean().backward()
        warm.step()
    saved = warm.state_dict()
    inner = make(model.parameters())
    inner.load_state_dict(saved)
    opt = distopt.DistOpt(inner, comm=comm, zero=zero, buffSize=32, model=model)
    for s in range(2):
        opt.zero_grad()
        model(_data(rank, s, 4, 6)).pow(2).mean().backward()
        opt.step()
    state = opt.state_dict()
    return {"params": [p.detach().clone().numpy() for p in model.parameters()],
            "state": {n: {k: np.asarray(v) for k, v in entry.items()} for n, entry in state["state"].items()}}


def _h87_opt(comm: Any) -> tuple[Any, Any]:
    import torch

    torch.set_num_threads(1)
    model = _mlp((6, 32, 32, 2))
    return model, distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=1, buffSize=128,
                                  model=model)


def _h87_step(model: Any, opt: Any, rank: int, s: int) -> None:
    opt.zero_grad()
    model(_data(rank, s, 4, 6)).pow(2).mean().backward()
    opt.step()


def case_h87_save(rank: int, comm: Any) -> dict[str, Any]:
    """H87's checkpoints: W ranks of zero=1 Adam save ``state_dict(sharded=True)`` after steps 2 and 4
    (``torch.save`` bytes), with the consolidated state after step 4 and the parameters after steps 2 and 4."""
    import io

    import torch

    model, opt = _h87_opt(comm)
    out: dict[str, Any] = {}
    for s in range(4):
        _h87_step(model, opt, rank, s)
        if s in (1, 3):
            buf = io.BytesIO()
            torch.save(opt.state_dict(sharded=True), buf)
            out[f"shard{s + 1}"] = buf.getvalue()
            out[f"params{s + 1}"] = [p.detach().clone().numpy() for p in model.parameters()]
    full = opt.state_dict()
    out["full4"] = {n: {k: np.asarray(v) for k, v in e.items()} for n, e in full["state"].items()}
    return out


def case_h87_load(rank: int, comm: Any, blobs: Any) -> dict[str, Any]:
    """Load ``blobs`` into a fresh zero=1 DistOpt: a list of ``torch.save`` bytes (every rank the same
    list), or a list with one entry per rank (``blobs[rank]`` alone, each rank its own file). Returns the
    consolidated state, or the error raised."""
    import io

    import torch

    model, opt = _h87_opt(comm)
    def load(b: bytes) -> Any:
        return torch.load(io.BytesIO(b), weights_only=True)

    try:
        if isinstance(blobs, dict):
            opt.load_state_dict(load(blobs["own"][rank]))
        else:
            opt.load_state_dict([load(b) for b in blobs])
    except ValueError as exc:
        return {"error": str(exc)}
    full = opt.state_dict()
    return {"full": {n: {k: np.asarray(v) for k, v in e.items()} for n, e in full["state"].items()}}


def case_overlapping(rank: int, comm: Any, first: int, second: int) -> str:
    """Two DistOpts over overlapping parameters (the second over a subset), ``zero=first`` then
    ``zero=second``: the error text of the second's construction, or "built"."""
    import torch

    model = _mlp((4, 8, 2))
    distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=first)
    try:
        distopt.DistOpt(torch.optim.SGD(list(model.parameters())[:2], lr=0.1), comm=comm, zero=second)
    except ValueError as exc:
        return str(exc)
    return "built"


def case_rank0_writer(rank: int, comm: Any, zero: int, consolidate: bool, then_step: bool = False
                      ) -> dict[str, Any]:
    """A rank-0-only checkpoint writer (timm's saver): 2 steps, then ``consolidate_state_dict(to=0)`` on every
    rank (if ``consolidate``), then ``state_dict()`` on rank 0 alone, while the other ranks wait (or, with
    ``then_step``, go on to the next step, as a script's next epoch). Returns rank 0's state (its Adam
    moments), or each rank's error (its type and message)."""
    import torch

    torch.set_num_threads(1)
    model = _mlp((6, 16, 3))
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=zero, buffSize=32,
                          model=model, timeout=3.0)
    for s in range(2):
        opt.zero_grad()
        model(_data(rank, s, 4, 6)).pow(2).mean().backward()
        opt.step()
    out: dict[str, Any] = {}
    if consolidate:
        opt.consolidate_state_dict(to=0)
    try:
        if rank == 0:
            state = opt.state_dict()
            out["state"] = {n: {k: np.asarray(v) for k, v in e.items()} for n, e in state["state"].items()}
        if then_step:
            opt.zero_grad()
            model(_data(rank, 2, 4, 6)).pow(2).mean().backward()
            opt.step()
    except (distopt.CollectiveTimeoutError, distopt.CollectiveMismatchError) as exc:
        out["error"], out["type"] = str(exc), type(exc).__name__
    return out
