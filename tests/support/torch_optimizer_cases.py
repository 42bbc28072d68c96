"""Cases for DistOpt as a torch optimizer: each ``case_*(rank, comm, ...)`` runs on every rank of a world
(see :mod:`tests.support.backends`) and returns what the tests compare with one process.

Data: rank r holds rows ``[B*r, B*(r+1))`` of one float64 batch, so the mean
over ranks of the per-rank mean losses is the full batch's mean loss, and
one process on the whole batch is the reference (``reference_*``).
"""
from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import numpy as np
import torch

from distopt import DistOpt
from distopt.errors import CollectiveMismatchError

B = 4


def make_model(seed: int = 0, batchnorm: bool = False) -> Any:
    g = torch.Generator().manual_seed(seed)
    layers = [torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)]
    if batchnorm:
        layers.insert(1, torch.nn.BatchNorm1d(6))
    model = torch.nn.Sequential(*layers).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def data(step: int, world: int) -> tuple[Any, Any]:
    """The full batch of ``step`` for a world of ``world`` ranks (``B`` rows per rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(B * world, 3, generator=g, dtype=torch.float64),
            torch.randn(B * world, 1, generator=g, dtype=torch.float64))


def mine(x: Any, rank: int) -> Any:
    return x[B * rank:B * (rank + 1)]


def loss_of(model: Any, x: Any, y: Any) -> Any:
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model: Any) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


SCHEDULERS = ("StepLR", "LambdaLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau")
STEPS = 6


def make_scheduler(kind: str, opt: Any) -> Any:
    S = torch.optim.lr_scheduler
    if kind == "StepLR":
        return S.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "LambdaLR":
        return S.LambdaLR(opt, lambda e: 1.0 / (1 + e))
    if kind == "OneCycleLR":
        return S.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS)
    if kind == "SequentialLR":
        return S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.5, total_iters=2), S.ExponentialLR(opt, 0.9)],
                              milestones=[2])
    return S.ReduceLROnPlateau(opt, factor=0.5, patience=0)


def _train_with_scheduler(kind: str, model: Any, opt: Any, rank: int | None, world: int) -> list[float]:
    scheduler = make_scheduler(kind, opt)
    lrs = []
    for s in range(STEPS):
        _steps(model, opt, rank, world, s, s + 1)
        lrs.append(opt.param_groups[0]["lr"])
        if kind == "ReduceLROnPlateau":
            scheduler.step(1.0)  # the same metric on every rank, never improving: the lr halves each step
        else:
            scheduler.step()
    return lrs


def case_scheduler(rank: int, comm: Any, kind: str) -> tuple[bool, list[float], Any]:
    model = make_model()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, model=model)
    lrs = _train_with_scheduler(kind, model, opt, rank, comm.size)
    return isinstance(opt, torch.optim.Optimizer), lrs, flat(model)


def reference_scheduler(kind: str, world: int) -> tuple[list[float], Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return _train_with_scheduler(kind, model, opt, None, world), flat(model)


def _steps(model: Any, opt: Any, rank: int | None, world: int, first: int, last: int) -> None:
    for s in range(first, last):
        x, y = data(s, world)
        if rank is not None:
            x, y = mine(x, rank), mine(y, rank)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def case_state_dict(rank: int, comm: Any) -> dict[str, Any]:
    """Torch's layout; weights-only round trip; resume bitwise; plain torch loads it; it loads plain torch's
    and the previous distopt format."""
    out: dict[str, Any] = {}
    model = make_model()
    opt = DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, model=model)
    _steps(model, opt, rank, comm.size, 0, 2)
    state = opt.state_dict()
    out["keys"] = sorted(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    plain = torch.optim.Adam(make_model().parameters(), lr=0.01)
    plain.load_state_dict(copy.deepcopy(loaded))  # plain torch reads a distopt checkpoint as its own
    out["plain_step"] = float(plain.state_dict()["state"][0]["step"])
    saved_params = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, rank, comm.size, 2, 4)
    out["uninterrupted"] = flat(model)
    resumed = make_model(seed=7)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), saved_params):
            p.copy_(q)
    opt2 = DistOpt(torch.optim.Adam(resumed.parameters(), lr=0.01), comm=comm, model=resumed)
    opt2.load_state_dict(loaded)
    out["steps_restored"] = opt2.stats.steps
    _steps(resumed, opt2, rank, comm.size, 2, 4)
    out["resumed"] = flat(resumed)
    single = make_model()
    single_opt = torch.optim.Adam(single.parameters(), lr=0.01)
    _steps(single, single_opt, None, comm.size, 0, 2)
    opt3 = DistOpt(torch.optim.Adam(make_model().parameters(), lr=0.01), comm=comm)
    opt3.load_state_dict(single_opt.state_dict())  # a single-process (or DDP) run's optimizer state
    out["from_plain"] = opt3.state_dict()["state"][0]["exp_avg"]
    out["single_exp_avg"] = single_opt.state_dict()["state"][0]["exp_avg"]
    ours = {**state["param_groups"][0]["distopt"], **state["distopt"]}  # replicated part, then rank_local
    old = {"format": 2, "local": single_opt.state_dict(), **{k: v for k, v in ours.items() if k != "format"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt3.load_state_dict(old)
    out["old_format_warned"] = any("older distopt" in str(w.message) for w in caught)
    return out


def _lbfgs_closure(model: Any, opt: Any, x: Any, y: Any, counter: list[int]) -> Any:
    def closure() -> Any:
        counter[0] += 1
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        return loss
    return closure


def case_lbfgs(rank: int, comm: Any, line_search: str | None) -> tuple[int, Any]:
    model = make_model()
    opt = DistOpt(torch.optim.LBFGS(model.parameters(), lr=1, max_iter=20, line_search_fn=line_search),
                  comm=comm, model=model)
    x, y = data(0, comm.size)
    counter = [0]
    for _ in range(2):
        opt.step(_lbfgs_closure(model, opt, mine(x, rank), mine(y, rank), counter))
    return counter[0], flat(model)


def reference_lbfgs(line_search: str | None, world: int) -> tuple[int, Any]:
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=20, line_search_fn=line_search)
    x, y = data(0, world)
    counter = [0]
    for _ in range(2):
        opt.step(_lbfgs_closure(model, opt, x, y, counter))
    return counter[0], flat(model)


def case_lr_mismatch(rank: int, comm: Any) -> str:
    """Each rank's own learning rate: the step raises on every rank, naming the group, the key, the values."""
    model = make_model()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    opt.param_groups[0]["lr"] = 0.1 * (rank + 1)
    x, y = data(0, comm.size)
    try:
        loss_of(model, mine(x, rank), mine(y, rank)).backward()
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_broadcast_state(rank: int, comm: Any) -> tuple[float, int]:
    """A scheduler's state restored on rank 0 only reaches every rank through broadcast_state."""
    model = make_model()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if rank == 0:
        opt.param_groups[0]["lr"] = 0.0125
        scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": 3, "_last_lr": [0.0125]})
    opt.broadcast_state(0, schedulers=[scheduler])
    return opt.param_groups[0]["lr"], scheduler.last_epoch


def case_join_batchnorm(rank: int, comm: Any, counts: list[int]) -> tuple[Any, Any, int]:
    """A BatchNorm model (buffers broadcast before each forward) with uneven batch counts inside join()."""
    model = make_model(batchnorm=True)
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    with opt.join() as joined:
        for s in range(counts[rank]):
            x, y = data(s, comm.size)
            opt.zero_grad()
            loss_of(model, mine(x, rank), mine(y, rank)).backward()
            opt.step()
    buffers = torch.cat([b.detach().double().reshape(-1) for b in model.buffers()])
    return flat(model), buffers, joined.last_joined


def case_horovod_idioms(rank: int, comm: Any) -> dict[str, Any]:
    """synchronize/skip_synchronize around clipping, DDP's require_backward_grad_sync toggle, the stats."""
    out: dict[str, Any] = {}
    x, y = data(0, comm.size)
    model = make_model()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model,
                  named_parameters=model.named_parameters())
    opt.zero_grad()
    loss_of(model, mine(x, rank), mine(y, rank)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    out["clipped"] = flat(model)
    out["started_in_backward"] = opt.stats["buckets_started_in_backward"]
    wire = opt.stats["wire_bytes"]
    opt.zero_grad()
    for micro in range(2):  # nanoGPT's toggle: only the last micro-step's backward averages
        model.require_backward_grad_sync = micro == 1
        loss_of(model, mine(x, rank)[2 * micro:2 * micro + 2], mine(y, rank)[2 * micro:2 * micro + 2]).div(
            2).backward()
    opt.step()
    out["toggle_wire_bytes"] = opt.stats["wire_bytes"] - wire
    out["toggle"] = flat(model)
    return out


def case_checkpointing(rank: int, comm: Any, reentrant: bool, variant: str) -> tuple[Any, int]:
    """A block checkpointed (reentrant or not), once or used twice, with accumulation or no_sync."""
    from torch.utils.checkpoint import checkpoint

    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = DistOpt(inner, comm=comm, model=model, backward_passes_per_step=2 if variant == "passes" else 1)
    x, y = data(0, comm.size)
    x, y = mine(x, rank), mine(y, rank)

    def loss_fn(xs: Any, ys: Any) -> Any:
        h = model[0](xs)
        block = lambda t: model[2](model[1](t))  # noqa: E731
        out = checkpoint(block, h, use_reentrant=reentrant)
        if variant == "twice":
            out = out + checkpoint(block, h * 0.5, use_reentrant=reentrant)
        return torch.nn.functional.mse_loss(out, ys)

    opt.zero_grad()
    if variant in ("once", "twice"):
        opt.backward_and_update(loss_fn(x, y))
    elif variant == "passes":
        for half in (slice(0, 2), slice(2, 4)):
            opt.backward_and_update(loss_fn(x[half], y[half]) / 2)
    else:  # no_sync
        with opt.no_sync():
            (loss_fn(x[:2], y[:2]) / 2).backward()
        (loss_fn(x[2:], y[2:]) / 2).backward()
        opt.step()
    return flat(model), opt.stats["wire_bytes"]


def reference_checkpointing(variant: str, world: int) -> Any:
    """One process: the average over ranks of each rank's plain local gradient, one SGD step (lr 1)."""
    model = make_model()
    x, y = data(0, world)
    total = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        xs, ys = mine(x, r), mine(y, r)
        model.zero_grad()
        out = model[2](model[1](model[0](xs)))
        if variant == "twice":
            out = out + model[2](model[1](model[0](xs) * 0.5))
        torch.nn.functional.mse_loss(out, ys).backward()
        for t, p in zip(total, model.parameters()):
            t += p.grad
    with torch.no_grad():
        for t, p in zip(total, model.parameters()):
            p -= t / world
    return flat(model)


def case_two_optimizers(rank: int, comm: Any) -> tuple[float, float]:
    """Two DistOpts over overlapping parameters: the shared one is averaged once per backward."""
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    v = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    first = DistOpt(torch.optim.SGD([w, v], lr=1.0), comm=comm)
    second = DistOpt(torch.optim.SGD([w], lr=1.0), comm=comm)
    first.zero_grad()
    ((rank + 1.0) * (w + 2 * v)).sum().backward()
    second.step()  # w -= mean over ranks of (r + 1)
    first.step()   # w again, and v -= mean of 2 (r + 1)
    second.close()
    first.close()
    return float(w.detach()), float(v.detach())


def expected_two_optimizers(world: int) -> tuple[float, float]:
    mean = float(np.mean([r + 1.0 for r in range(world)]))
    return -2 * mean, -2 * mean


DTYPES = ["bfloat16", "float32", "float16", "float64"]


def expected_dtypes(world: int) -> list[Any]:
    """One process: each parameter minus 0.1 times the mean over ranks of ``r + 1``, in its own dtype."""
    g = torch.Generator().manual_seed(3)
    mean = float(np.mean([r + 1.0 for r in range(world)]))
    out = []
    for d in DTYPES:
        p = torch.randn(4, 3, generator=g).to(getattr(torch, d))
        out.append(p.add_(torch.full_like(p, mean), alpha=-0.1))
    return out


def _registered(size: int) -> list[str]:
    """The registered strategy examples that run at world size ``size``."""
    from distopt.strategies import REGISTRY

    return sorted(k for k, e in REGISTRY.items() if e.worlds is None or size in e.worlds)


def case_every_item(rank: int, comm: Any, path: str) -> dict[str, Any]:
    """The items above in one job, for the real backends (one process start per backend and size)."""
    return {
        "save_load": case_save_load(rank, comm, path),
        "collective_errors": case_collective_errors(rank, comm),
        "dtypes": [case_dtypes(rank, comm, DTYPES, s)[0] for s in ("dense", "half", "half_bf16")],
        "scheduler": {kind: case_scheduler(rank, comm, kind) for kind in SCHEDULERS},
        "surface": case_optimizer_surface(rank, comm),
        "join_accumulating": {how: case_join_batchnorm_accumulating(rank, comm, [2] + [4] * (comm.size - 1), how)
                              for how in ("no_sync", "passes")},
        "state_dict": case_state_dict(rank, comm),
        "lbfgs": {search: case_lbfgs(rank, comm, search) for search in (None, "strong_wolfe")},
        "strategy_dtypes": {(e, d): case_strategy_dtype(rank, comm, e, d) for e in _registered(comm.size)
                            for d in ("bfloat16", "float16")},
        "lr_mismatch": case_lr_mismatch(rank, comm),
        "broadcast_state": case_broadcast_state(rank, comm),
        "join": case_join_batchnorm(rank, comm, [2] + [4] * (comm.size - 1)),
        "horovod": case_horovod_idioms(rank, comm),
        "checkpointing": {(reentrant, variant): case_checkpointing(rank, comm, reentrant, variant)
                          for reentrant in (True, False) for variant in ("once", "twice", "passes", "no_sync")},
        "two": case_two_optimizers(rank, comm),
    }


def reference_horovod_idioms(world: int) -> tuple[Any, Any]:
    """One process: a clipped step, then an unclipped one, on the full batch of step 0."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(0, world)
    opt.zero_grad()
    loss_of(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    clipped = flat(model)
    opt.zero_grad()
    loss_of(model, x, y).backward()
    opt.step()
    return clipped, flat(model)


def case_save_load(rank: int, comm: Any, path: str) -> tuple[Any, Any]:
    """distopt.save / load with a torch optimizer and per-rank residuals: the next step equals an
    uninterrupted run's, bitwise."""
    import distopt
    from distopt.strategies import Sparse

    def build() -> tuple[Any, Any]:
        model = make_model()
        return model, DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, model=model,
                              strategy=Sparse(density=0.25, select="topk"))

    model, opt = build()
    _steps(model, opt, rank, comm.size, 0, 2)
    distopt.save(path, model.state_dict(), opt)
    _steps(model, opt, rank, comm.size, 2, 4)
    resumed, opt2 = build()
    resumed.load_state_dict(distopt.load(path, opt2))
    _steps(resumed, opt2, rank, comm.size, 2, 4)
    return flat(model), flat(resumed)


def case_dtypes(rank: int, comm: Any, dtypes: list[str], strategy: str) -> tuple[Any, list[str]]:
    """A model of ``dtypes`` parameters (bfloat16, float16, float32, float64), one SGD step (lr 0.1)."""
    from distopt.strategies import Dense, Half

    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g).to(getattr(torch, d))) for d in dtypes]
    chosen = {"dense": Dense(), "half": Half(), "half_bf16": Half(wire="bfloat16")}[strategy]
    opt = DistOpt(torch.optim.SGD(params, lr=0.1), comm=comm, strategy=chosen)
    opt.zero_grad()
    sum((p.float() * (rank + 1)).sum() for p in params).backward()
    opt.step()
    return [p.detach().clone() for p in params], [str(p.dtype) for p in params]


def case_collective_errors(rank: int, comm: Any) -> list[tuple[str, str]]:
    """Arguments that are bad on one rank only, or shapes that differ: every rank raises at once."""
    opt = DistOpt(torch.optim.SGD(make_model().parameters(), lr=0.1), comm=comm)
    calls = [
        lambda: opt.all_reduce(torch.ones(3, dtype=torch.int64 if rank == 1 else torch.float64), op="avg"),
        lambda: opt.all_reduce(torch.ones((2, 3) if rank == 1 else (3, 2), dtype=torch.float64)),
        lambda: opt.broadcast(torch.ones(4, dtype=torch.float64), root=comm.size if rank == 1 else 0),
        lambda: opt.all_reduce(torch.ones(6, dtype=torch.float64)[::2] if rank == 1 else torch.ones(3)),
    ]
    out = []
    for call in calls:
        try:
            call()
            out.append(("ok", ""))
        except (TypeError, ValueError, CollectiveMismatchError) as exc:
            out.append((type(exc).__name__, str(exc)))
    t = torch.full((3,), float(rank + 1), dtype=torch.float64)
    opt.all_reduce(t)  # the world still works afterwards
    out.append(("sum", str(t.tolist())))
    return out


def expected_collective_errors(world: int) -> list[tuple[str, str]]:
    total = float(sum(range(1, world + 1)))
    return [("TypeError", "all_reduce on rank 1: op='avg'"), ("CollectiveMismatchError", "shape differs"),
            ("ValueError", "broadcast on rank 1: root must be in"), ("TypeError", "all_reduce on rank 1:"),
            ("sum", str([total] * 3))]


def case_optimizer_surface(rank: int, comm: Any) -> dict[str, Any]:
    """Step hooks, zero_grad(set_to_none=...), add_param_group (rank 0's values for the new group)."""
    out: dict[str, Any] = {}
    model = make_model()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x, y = data(0, comm.size)
    loss_of(model, mine(x, rank), mine(y, rank)).backward()
    opt.step()
    out["hooks"] = list(calls)
    opt.zero_grad(set_to_none=False)
    out["zeroed"] = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    out["none"] = all(p.grad is None for p in model.parameters())
    extra = torch.nn.Parameter(torch.full((2,), float(rank), dtype=torch.float64))
    opt.add_param_group({"params": [extra], "lr": 1.0})
    out["broadcast"] = extra.detach().clone()  # rank 0's value
    (extra * (rank + 1.0)).sum().backward()
    opt.step()
    out["extra"] = extra.detach().clone()
    return out


def case_strategy_dtype(rank: int, comm: Any, example_id: str, dtype: str) -> Any:
    """Three steps of a registered strategy over a ``dtype`` parameter: returns the parameter."""
    from distopt.strategies import REGISTRY

    example = REGISTRY[example_id]
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(8, 6, generator=g).to(getattr(torch, dtype)))
    opt = DistOpt(torch.optim.SGD([p], lr=0.1, momentum=example.local_momentum), comm=comm,
                  strategy=example.build())
    for _ in range(3):
        opt.zero_grad()
        (p.float() * (rank + 1)).sum().backward()
        opt.step()
    return p.detach().clone()


def case_join_batchnorm_accumulating(rank: int, comm: Any, counts: list[int], how: str) -> tuple[Any, Any]:
    """join() with a BatchNorm model and two micro-batches per step (no_sync or backward_passes_per_step)."""
    model = make_model(batchnorm=True)
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model,
                  backward_passes_per_step=2 if how == "passes" else 1)
    with opt.join():
        for s in range(counts[rank]):
            x, y = data(s, comm.size)
            x, y = mine(x, rank), mine(y, rank)
            opt.zero_grad()
            if how == "no_sync":
                with opt.no_sync():
                    loss_of(model, x[:2], y[:2]).div(2).backward()
            else:
                loss_of(model, x[:2], y[:2]).div(2).backward()
            loss_of(model, x[2:], y[2:]).div(2).backward()
            opt.step()
    buffers = torch.cat([b.detach().double().reshape(-1) for b in model.buffers()])
    return flat(model), buffers
