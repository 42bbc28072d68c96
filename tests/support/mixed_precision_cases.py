"""Cases of mixed precision at ``zero=0|1|2|3`` (``DistOpt(param_dtype=, reduce_dtype=)``), run by
``tests/sharding/test_mixed_precision.py`` on any backend, and their one-process emulation.

The emulation is FSDP2's ``MixedPrecisionPolicy`` written out by hand: a float32 master model; per step, for each
rank ``r``, a ``param_dtype`` copy of the masters runs forward and backward on rank ``r``'s batch (floating-point
inputs cast to ``param_dtype``), each gradient is cast to ``reduce_dtype``; the ranks' gradients are summed in rank
order (``((g0 + g1) + g2) + ...``, in ``reduce_dtype``, as every backend's reduce-scatter sums rows) and divided by
W, cast to float32 and given to the optimizer of the masters.
"""
from __future__ import annotations

import copy
from typing import Any

import distopt
from tests.support.zero_cases import _gpt, _model

VOCAB = 37


def _net(name: str) -> Any:
    return _gpt() if name == "gpt" else _model()


def _batch(name: str, rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "gpt":
        return torch.randint(0, VOCAB, (3, 9), generator=g)
    return torch.randn(3 + rank, 7, generator=g)  # per-rank batch sizes differ


def _loss(name: str, model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    if name == "gpt":
        return F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
    return model(batch).float().pow(2).mean()


def _optimizer(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, name)


def case_train(rank: int, comm: Any, net: str, param_dtype: str | None, reduce_dtype: str | None, steps: int,
               options: dict[str, Any]) -> dict[str, Any]:
    """``steps`` AdamW steps of ``net`` (``"gpt"``: the GPT-style model; ``"mlp"``: the small MLP) at ``zero``
    (an option, default 3) with the given dtypes (names of torch dtypes; None leaves one out). ``options``:
    ``overlap_gather`` (``overlap_param_gather=True``), ``clip`` (max norm),
    ``scaler`` (a ``GradScaler``, initial scale ``scale`` or 2**10, with float16), ``buff`` (bucket elements,
    default 600), ``no_sync`` (a micro-batch accumulated inside ``no_sync()`` first), ``reshard`` (False:
    ``reshard_after_forward=False``).
    Returns the whole parameters (the masters), each step's loss, ``step_gather_bytes``, ``step_wire_bytes``,
    the dtypes the forward saw and ``model.state_dict()``'s."""
    import torch

    torch.set_num_threads(1)
    model = _net(net)
    opt = distopt.DistOpt(_optimizer(model.parameters()), comm=comm, zero=options.get("zero", 3), model=model,
                          buffSize=options.get("buff", 600), param_dtype=_dtype(param_dtype),
                          reduce_dtype=_dtype(reduce_dtype), reshard_after_forward=options.get("reshard", True),
                          overlap_param_gather=options.get("overlap_gather", False))
    scaler = torch.amp.GradScaler("cpu", init_scale=options.get("scale", 2.0 ** 10)) if options.get("scaler") else None
    seen: set[str] = set()  # the dtypes of the model's output and of the parameters inside its first module
    first = next(m for m in model.modules() if list(m.parameters(recurse=False)))
    hooks = [model.register_forward_hook(lambda m, a, out: seen.add(str(out.dtype))),
             first.register_forward_hook(lambda m, a, out: seen.update(str(p.dtype) for p in m.parameters()))]
    losses, gathered, wired, scales = [], [], [], []
    for s in range(steps):
        opt.zero_grad()
        if options.get("no_sync"):
            with opt.no_sync():
                _loss(net, model, _batch(net, rank, s + 50)).backward()
        loss = _loss(net, model, _batch(net, rank, s))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if options.get("clip"):
            opt.clip_grad_norm_(options["clip"])
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        losses.append(float(loss.detach()))
        gathered.append(int(opt.stats["step_gather_bytes"]))
        wired.append(int(opt.stats["step_wire_bytes"]))
    for h in hooks:
        h.remove()
    with opt.summon_full_params():
        params = [p.detach().clone() for p in model.parameters()]
    saved = {k: (str(v.dtype), v.clone()) for k, v in model.state_dict().items()}
    return {"params": params, "losses": losses, "gathered": gathered, "wired": wired, "seen": sorted(seen),
            "saved": saved, "scales": scales, "rest": sorted({str(p.dtype) for p in model.parameters()})}


def emulate(world: int, net: str, param_dtype: str | None, reduce_dtype: str | None, steps: int,
            options: dict[str, Any]) -> dict[str, Any]:
    """The one-process emulation of :func:`case_train` (see the module docs): the masters after ``steps``
    steps and each step's losses per rank."""
    import torch

    torch.set_num_threads(1)
    low, red = _dtype(param_dtype), _dtype(reduce_dtype)
    master = _net(net)
    opt = _optimizer(master.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=options.get("scale", 2.0 ** 10)) if options.get("scaler") else None
    losses: list[list[float]] = [[] for _ in range(world)]
    for s in range(steps):
        per_rank = []
        for r in range(world):
            copy_ = copy.deepcopy(master) if low is None else copy.deepcopy(master).to(low)
            batch = _batch(net, r, s)
            if low is not None and batch.is_floating_point():
                batch = batch.to(low)
            if options.get("no_sync"):
                extra = _batch(net, r, s + 50)
                _loss(net, copy_, extra.to(low) if low is not None and extra.is_floating_point() else extra).backward()
            loss = _loss(net, copy_, batch)
            (loss if scaler is None else scaler.scale(loss)).backward()
            losses[r].append(float(loss.detach()))
            per_rank.append([p.grad if red is None else p.grad.to(red) for p in copy_.parameters()])
        for i, p in enumerate(master.parameters()):
            total = per_rank[0][i]
            for grads in per_rank[1:]:
                total = total + grads[i]
            p.grad = (total / world).to(p.dtype)
        if scaler is not None:
            scaler.unscale_(opt)
        if options.get("clip"):
            torch.nn.utils.clip_grad_norm_(list(master.parameters()), options["clip"])
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in master.parameters()], "losses": losses}


def case_resume(rank: int, comm: Any, path: str, load: bool, first: int, steps: int,
                mixed: bool = True, zero: int = 3) -> dict[str, Any]:
    """The GPT-style model at ``zero``, AdamW, bfloat16/float32 (``mixed``) or float32: steps
    ``first .. first+steps-1`` after ``distopt.load(path)`` when ``load``, then ``distopt.save(path,
    model.state_dict(), opt)``. Returns the whole parameters after loading and at the end, and the dtypes of the
    saved model state and optimizer state."""
    import torch

    torch.set_num_threads(1)
    model = _gpt()
    opt = distopt.DistOpt(_optimizer(model.parameters()), comm=comm, zero=zero, model=model, buffSize=600,
                          param_dtype=torch.bfloat16 if mixed else None, reduce_dtype=torch.float32 if mixed else None)
    if load:
        model.load_state_dict(distopt.load(path, opt))
    with opt.summon_full_params():
        loaded = [p.detach().clone() for p in model.parameters()]
    for s in range(first, first + steps):
        opt.zero_grad()
        _loss("gpt", model, _batch("gpt", rank, s)).backward()
        opt.step()
    model_state = model.state_dict()
    state = opt.state_dict()
    distopt.save(path, model_state, opt)
    with opt.summon_full_params():
        params = [p.detach().clone() for p in model.parameters()]
    optimizer_dtypes = {str(v.dtype) for entry in state["state"].values() for k, v in entry.items() if k != "step"}
    return {"params": params, "loaded": loaded, "model_dtypes": sorted({str(v.dtype) for v in model_state.values()}),
            "optimizer_dtypes": sorted(optimizer_dtypes)}


def case_summon(rank: int, comm: Any, zero: int = 3) -> dict[str, Any]:
    """Two bfloat16/float32 steps of the GPT-style model at ``zero``, then ``summon_full_params()``: the dtypes
    inside, the masters before and after halving them inside the block, and the dtypes a forward sees after it."""
    import torch

    torch.set_num_threads(1)
    model = _gpt()
    opt = distopt.DistOpt(_optimizer(model.parameters()), comm=comm, zero=zero, model=model, buffSize=600,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for s in range(2):
        opt.zero_grad()
        _loss("gpt", model, _batch("gpt", rank, s)).backward()
        opt.step()
    with opt.summon_full_params():
        inside = sorted({str(p.dtype) for p in model.parameters()})
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    with opt.summon_full_params():
        after = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        out = model(_batch("gpt", rank, 5)[:, :-1])
    return {"inside": inside, "before": before, "after": after, "out": str(out.dtype)}


def case_sharded(rank: int, comm: Any, shards: list[bytes] | None, first: int, steps: int,
                 zero: int = 3) -> dict[str, Any]:
    """The GPT-style model at ``zero`` (1, 2 or 3), bfloat16/float32, AdamW; with ``shards`` (every rank's
    ``opt.state_dict(sharded=True, params=True)``) its weights halved first, then the shards loaded (their
    parameter elements overwrite them); steps ``first .. first+steps-1``. Returns this rank's sharded state and the
    whole parameters."""
    import io

    import torch

    torch.set_num_threads(1)
    model = _gpt()
    if shards is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    opt = distopt.DistOpt(_optimizer(model.parameters()), comm=comm, zero=zero, model=model, buffSize=600,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if shards is not None:
        opt.load_state_dict([torch.load(io.BytesIO(b), weights_only=True) for b in shards])
    for s in range(first, first + steps):
        opt.zero_grad()
        _loss("gpt", model, _batch("gpt", rank, s)).backward()
        opt.step()
    f = io.BytesIO()
    torch.save(opt.state_dict(sharded=True, params=True), f)
    with opt.summon_full_params():
        return {"shard": f.getvalue(), "params": [p.detach().clone() for p in model.parameters()]}
