"""Cases where DDP scripts meet distopt's features: GradScaler with check_finite (H70), join() with a per-step
LR scheduler (H72), sparse embeddings with SGD momentum (H75), a BatchNorm subclass with its own forward
(BatchNormAct), ``model.no_sync`` and distopt's own warnings. Run by ``tests/torch/test_ddp_seams.py`` on any
backend; each case is ``fn(rank, comm, *args)`` and returns plain data."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

import distopt


def _seeded(model: Any, seed: int = 0) -> Any:
    """``model`` with every parameter drawn from NumPy's generator (not torch's: the simulated ranks are threads)."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(p.shape)).astype(np.float32)))
    return model


def _mlp(sizes: tuple[int, ...]) -> Any:
    import torch

    layers: list[Any] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return _seeded(torch.nn.Sequential(*layers[:-1]))


def _randn(seed: int, *shape: int) -> Any:
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _params(model: Any) -> list[Any]:
    return [p.detach().clone().numpy() for p in model.parameters()]


# ----------------------------------------------------------------------------------------------- H70
def case_h70_scaler(rank: int, comm: Any, zero: int, check_finite: bool) -> dict[str, Any]:
    """H70: MLP 6-24-24-3, Adam(1e-2), ``GradScaler(init_scale=2**10)``, buffSize=64, 4 steps; step 1: the
    last rank's x[0,0] = inf; step 2: rank 0's x[1,2] = NaN. Returns the scale and the parameters after each
    step, or the error raised."""
    import torch

    torch.set_num_threads(1)
    model = _mlp((6, 24, 24, 3))
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=1e-2), comm=comm, zero=zero, buffSize=64,
                          model=model, check_finite=check_finite)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, params = [], []
    try:
        for s in range(4):
            x = _randn(100 * s + rank, 4 + rank, 6)
            if s == 1 and rank == comm.size - 1:
                x[0, 0] = float("inf")
            if s == 2 and rank == 0:
                x[1, 2] = float("nan")
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            params.append(_params(model))
    except (AssertionError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"scales": scales, "params": params}


# ----------------------------------------------------------------------------------------------- H72
def case_h72_join_scheduler(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """H72: Linear-BatchNorm1d-ReLU-Linear, Adam(1e-2), buffSize=40; rank r runs 2 + 2r batches inside
    ``with opt.join():``, ``StepLR(opt, 1, 0.7)`` stepped after every ``opt.step()``. Returns the parameters,
    buffers and the learning rate, or the error raised."""
    import torch

    torch.set_num_threads(1)
    model = _seeded(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 2)))
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=1e-2), comm=comm, zero=zero, buffSize=40,
                          model=model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    try:
        with opt.join():
            for s in range(2 + 2 * rank):
                opt.zero_grad()
                model(_randn(100 * s + rank, 6, 5)).pow(2).mean().backward()
                opt.step()
                scheduler.step()
    except (ValueError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"params": _params(model), "buffers": [b.clone().numpy() for b in model.buffers()],
            "lr": opt.param_groups[0]["lr"]}


# ----------------------------------------------------------------------------------------------- H75
def _h75_model() -> Any:
    import torch

    tok = torch.nn.Embedding(30, 4, sparse=True, padding_idx=0)
    aux = torch.nn.Embedding(10, 4, sparse=True)
    model = _seeded(torch.nn.ModuleList([tok, aux, torch.nn.Linear(4, 1)]))
    with torch.no_grad():
        tok.weight[0].zero_()  # as nn.Embedding(padding_idx=0) makes it
    return model


def _h75_batch(rank: int, step: int) -> tuple[Any, Any, Any]:
    """Rank ``rank``'s batch at ``step``: token ids (all padding on rank 1 at step 1), aux ids (used by rank 0
    only at step 0, by nobody at steps 1 and 3, by every rank at step 2; None when unused) and targets."""
    import torch

    g = torch.Generator().manual_seed(10 * step + rank)
    ids = torch.randint(1, 30, (3, 5), generator=g)
    if rank == 1 and step == 1:
        ids = torch.zeros(3, 5, dtype=torch.long)
    aux = torch.randint(0, 10, (3, 2), generator=g) if (step == 0 and rank == 0) or step == 2 else None
    return ids, aux, torch.randn(3, 1, generator=g)


def _h75_loss(model: Any, ids: Any, aux: Any, y: Any) -> Any:
    tok, emb, head = model
    h = tok(ids).mean(1)
    if aux is not None:
        h = h + emb(aux).mean(1)
    return (head(h) - y).pow(2).mean()


def case_h75_sparse_momentum(rank: int, comm: Any, sparse_as_dense: bool) -> dict[str, Any]:
    """H75: tok = Embedding(30, 4, sparse, padding_idx=0), aux = Embedding(10, 4, sparse), head = Linear(4, 1);
    ``SGD(lr 0.5, momentum 0.9)``, 4 steps. Returns the parameters and the statistics read after each step."""
    import torch

    torch.set_num_threads(1)
    model = _h75_model()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), comm=comm, model=model,
                          sparse_as_dense=sparse_as_dense)
    state_bytes = []
    for s in range(4):
        opt.zero_grad()
        _h75_loss(model, *_h75_batch(rank, s)).backward()
        opt.step()
        state_bytes.append(int(opt.stats["optimizer_state_bytes"]))
    return {"params": _params(model), "state_bytes": state_bytes}


def reference_h75(world: int) -> list[Any]:
    """One process on the concatenated batches (the mean of the ranks' mean losses)."""
    import torch

    model = _h75_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for s in range(4):
        opt.zero_grad()
        (sum(_h75_loss(model, *_h75_batch(r, s)) for r in range(world)) / world).backward()
        opt.step()
    return _params(model)


# ----------------------------------------------------------------------------------- BatchNormAct
class BatchNormAct2d(torch.nn.BatchNorm2d):
    """A BatchNorm subclass with a forward of its own, as timm's ``BatchNormAct2d``: torch's batch norm
    formula (``F.batch_norm``), then drop, then the activation."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.drop = torch.nn.Identity()
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: Any) -> Any:
        import torch.nn.functional as F

        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        stats = (self.running_mean, self.running_var) if not self.training or self.track_running_stats \
            else (None, None)
        x = F.batch_norm(x, *stats, self.weight, self.bias, self.training or stats[0] is None, factor, self.eps)
        return self.act(self.drop(x))


def bn_act_model() -> Any:
    import torch

    return _seeded(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), BatchNormAct2d(3), torch.nn.Conv2d(3, 2, 1)))


def bn_act_batch(step: int, rows: int) -> Any:
    return _randn(50 + step, rows, 2, 5, 5) * (1 + step)


def _bn_act_train(model: Any, opt: Any, rank: int, sizes: tuple[int, ...]) -> None:
    lo = sum(sizes[:rank])
    for s in range(2):
        opt.zero_grad()
        model(bn_act_batch(s, sum(sizes))[lo:lo + sizes[rank]]).pow(2).mean().backward()
        opt.step()


def case_bn_act(rank: int, comm: Any, sizes: tuple[int, ...]) -> dict[str, Any]:
    """A converted BatchNormAct2d-like layer trained 2 steps on this rank's rows of the batch (``sizes``
    rows per rank); the parameters, the layer's buffers, its class name and the eval output."""
    import torch

    torch.set_num_threads(1)
    model = distopt.convert_sync_batchnorm(bn_act_model(), comm=comm)
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    _bn_act_train(model, opt, rank, sizes)
    model.eval()
    return {"params": _params(model), "class": type(model[1]).__name__,
            "buffers": [b.clone().numpy() for b in model[1].buffers()],
            "eval": model(bn_act_batch(5, 4)).detach().numpy()}


def reference_bn_act(sizes: tuple[int, ...]) -> dict[str, Any]:
    """One process over the concatenated batch; per-rank mean losses averaged as the ranks' gradients are."""
    import torch

    model = bn_act_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        opt.zero_grad()
        out = model(bn_act_batch(s, sum(sizes))).pow(2)
        starts = np.cumsum((0,) + sizes)
        (sum(out[a:b].mean() for a, b in zip(starts, starts[1:])) / len(sizes)).backward()
        opt.step()
    model.eval()
    return {"params": _params(model), "buffers": [b.clone().numpy() for b in model[1].buffers()],
            "eval": model(bn_act_batch(5, 4)).detach().numpy()}


def case_bn_without_batch_norm_call(rank: int, comm: Any) -> str:  # noqa: ARG001
    """A BatchNorm subclass whose forward computes the norm itself (no ``F.batch_norm``): the error raised."""
    import torch

    class HandMadeNorm(torch.nn.BatchNorm1d):
        def forward(self, x: Any) -> Any:
            return (x - x.mean(0)) / (x.var(0, unbiased=False) + self.eps).sqrt() * self.weight + self.bias

    layer = distopt.convert_sync_batchnorm(HandMadeNorm(3), comm=comm)
    try:
        layer(_randn(rank, 4, 3))
    except TypeError as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------------------------------- no_sync
def case_model_no_sync(rank: int, comm: Any) -> dict[str, Any]:
    """Accumulation as timm writes it: ``with model.no_sync():`` when ``hasattr(model, "no_sync")``, for the
    first of 2 micro-batches, then a synchronizing backward and a step. Returns the ``.grad`` after the
    first micro-batch, the parameters, and whether the attribute is gone after ``opt.close()``."""
    import torch

    torch.set_num_threads(1)
    model = _mlp((4, 6, 2))
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    found = hasattr(model, "no_sync")
    opt.zero_grad()
    with model.no_sync():
        model(_randn(rank, 3, 4)).pow(2).mean().backward()
    first = [p.grad.clone().numpy() for p in model.parameters()]
    model(_randn(10 + rank, 3, 4)).pow(2).mean().backward()
    opt.step()
    out = {"found": found, "first": first, "params": _params(model)}
    opt.close()
    out["after_close"] = hasattr(model, "no_sync")
    return out


def local_grads(rank: int) -> list[Any]:
    """One process's gradients of rank ``rank``'s first micro-batch (what ``no_sync`` leaves in ``.grad``)."""
    model = _mlp((4, 6, 2))
    model(_randn(rank, 3, 4)).pow(2).mean().backward()
    return [p.grad.clone().numpy() for p in model.parameters()]


def reference_no_sync(world: int) -> list[Any]:
    """One process: the summed micro-batch gradients averaged over the ranks, one SGD step."""
    import torch

    model = _mlp((4, 6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = sum(model(_randn(r, 3, 4)).pow(2).mean() + model(_randn(10 + r, 3, 4)).pow(2).mean()
               for r in range(world)) / world
    loss.backward()
    opt.step()
    return _params(model)


# ------------------------------------------------------------------------------------- warnings
def case_no_warnings(rank: int, comm: Any, zero: int) -> list[str]:
    """Train 2 steps at ``zero``, then the sharded and the consolidated ``state_dict()``: the FutureWarnings
    and UserWarnings raised meanwhile (torch's deprecated collectives, a read-only NumPy array), as text."""
    import torch

    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _mlp((6, 16, 3))
        opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=zero, buffSize=32,
                              model=model)
        for s in range(2):
            opt.zero_grad()
            model(_randn(100 * s + rank, 4, 6)).pow(2).mean().backward()
            opt.step()
        if zero:
            opt.state_dict(sharded=True)
        opt.state_dict()
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen
            if issubclass(w.category, (FutureWarning, DeprecationWarning))
            or "not writable" in str(w.message)]
