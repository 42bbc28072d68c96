"""Cases of the sharded optimizer (``DistOpt(zero=1|2)``), run by ``tests/sharding/test_zero.py`` on any backend.

Each case is ``fn(rank, comm, *args)`` (see :mod:`tests.support.backends`) and
returns plain data: parameters after training, stats, state dicts.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

import distopt
from distopt.strategies import Dense, Half
from tests.support.strategy_data import SHAPES, grads_for, params_for

STEPS = 4


def _strategy(name: str) -> Any:
    return {"dense": Dense(), "half": Half("float16")}[name]


def case_arrays(rank: int, comm: Any, zero: int, strategy: str, threshold: int | None) -> dict[str, Any]:
    """distopt.SGD on NumPy arrays (momentum, weight decay), buckets of 64 elements."""
    params = params_for(SHAPES, np.float32)
    sgd = distopt.SGD(lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt = distopt.DistOpt(sgd, comm=comm, zero=zero, buffSize=64, strategy=_strategy(strategy))
    for s in range(STEPS):
        opt.step(params, grads_for(s, rank, SHAPES, np.float32), threshold=threshold)
    return {"params": params, "stats": dict(opt.stats)}


def _model(seed: int = 0) -> Any:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3),
                                torch.nn.Linear(3, 1, bias=True))
    rng = np.random.default_rng(seed)  # not torch's global generator: the simulated ranks are threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.4, 0.4, tuple(p.shape)).astype(np.float32)))
    return model


def _optimizer(name: str, params: Any) -> Any:
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=0.01, foreach=True)
    if name == "adamw-single":
        return torch.optim.AdamW(params, lr=0.01, foreach=False)
    raise ValueError(name)


def _params(model: Any, opt: Any) -> list[Any]:
    """Copies of the model's parameters, whole at any stage (``zero=3`` frees them between steps)."""
    with opt.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


def _batch(rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3 + rank, 7, generator=g)  # per-rank batch sizes differ


def case_torch(rank: int, comm: Any, zero: int, optimizer: str, options: dict[str, Any]) -> dict[str, Any]:
    """A small MLP (a 1-element bias: smaller than W) with a torch optimizer and StepLR, buckets of 40
    elements. ``options``: ``strategy``, ``clip``, ``accumulate`` (no_sync passes), ``scaler``,
    ``overlap_param_gather``, ``check_finite``, ``reshard_after_forward`` (``zero=3`` only)."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer(optimizer, model.parameters()), comm=comm, zero=zero, buffSize=40,
                          model=model, strategy=_strategy(options.get("strategy", "dense")),
                          overlap_param_gather=options.get("overlap_param_gather", False),
                          check_finite=options.get("check_finite", False),
                          reshard_after_forward=options.get("reshard_after_forward", True) or zero != 3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if options.get("scaler") else None
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for _ in range(options.get("accumulate", 0)):
            with opt.no_sync():
                model(_batch(rank, s + 50)).pow(2).mean().backward()
        loss = model(_batch(rank, s)).pow(2).mean()
        if options.get("poison_step") == s and rank == comm.size - 1:
            loss = loss * float("inf")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if options.get("clip"):
            norms.append(float(opt.clip_grad_norm_(options["clip"])))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
    if options.get("overlap_param_gather"):
        opt.synchronize()  # the last step's gathers are still in flight: no forward has waited for them
    out = {"params": _params(model, opt), "stats": dict(opt.stats), "norms": norms,
           "state": opt.state_dict(), "bucket_bytes": max(b.size for b in opt.engine.layout.buckets) * 4}
    if scaler is not None:
        out["scale"] = float(scaler.get_scale())
    return out


def case_resume(rank: int, comm: Any, zero: int, blob: bytes | None, sharded_blobs: list[bytes] | None,
                steps: int, params_in_shards: bool = False) -> dict[str, Any]:
    """Adam: from a saved consolidated state (``blob``) or the list of every rank's sharded states, run
    ``steps`` more steps; without either, run ``steps`` from the start. Returns the parameters, the
    consolidated state and this rank's sharded state (``"shard"``; ``"shard_params"``: with its parameter
    elements). ``params_in_shards``: the model starts from another seed and its trained parameters come from
    the shards' elements (``state_dict(sharded=True, params=True)``), streamed one shard at a time."""
    import torch

    torch.set_num_threads(1)
    model = _model(seed=9 if params_in_shards else 0)
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    start = 0
    if params_in_shards:
        saved = [torch.load(io.BytesIO(b), weights_only=True) for b in sharded_blobs]
        read = []

        def one_at_a_time() -> Any:
            for shard in saved:
                read.append(shard["distopt_shard"]["rank"])
                yield shard

        opt.load_state_dict(distopt.ShardStream([{"world_size": 2, "rank": r} for r in range(2)], one_at_a_time()))
        assert read == [0, 1], read
        start = 2
    elif blob is not None or sharded_blobs is not None:
        saved = torch.load(io.BytesIO(blob), weights_only=True) if blob is not None else \
            [torch.load(io.BytesIO(b), weights_only=True) for b in sharded_blobs]
        model.load_state_dict((saved if blob is not None else saved[0])["distopt_model"])
        opt.load_state_dict({k: v for k, v in saved.items() if k != "distopt_model"} if blob is not None else
                            [{k: v for k, v in s.items() if k != "distopt_model"} for s in saved])
        start = 2
    for s in range(start, start + steps):
        opt.zero_grad()
        model(_batch(rank % 2, s)).pow(2).mean().backward()  # the same data whatever the world size
        opt.step()
    full = {**opt.state_dict(), "distopt_model": model.state_dict()}
    shard = {**opt.state_dict(sharded=True), "distopt_model": model.state_dict()} if zero else None
    with_params = opt.state_dict(sharded=True, params=True) if zero else None

    def dump(obj: Any) -> bytes:
        f = io.BytesIO()
        torch.save(obj, f)
        return f.getvalue()

    return {"params": _params(model, opt), "full": dump(full),
            "shard": None if shard is None else dump(shard),
            "shard_params": None if with_params is None else dump(with_params)}


def case_mismatched_zero(rank: int, comm: Any) -> str:
    """Rank 0 asks for zero=1, the others for zero=0: the first step raises on every rank."""
    params = params_for(SHAPES, np.float32)
    opt = distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, zero=1 if rank == 0 else 0)
    try:
        opt.step(params, grads_for(0, rank, SHAPES, np.float32))
    except distopt.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_layout_change(rank: int, comm: Any, zero: int) -> list[Any]:
    """Adam; the first layer is frozen at step 2 and trained again at step 3, a parameter group is added
    at step 4: every change lays the buckets out anew (and re-shards a sharded optimizer's state)."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    extra = torch.nn.Parameter(torch.full((5,), 0.5))
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    for s in range(6):
        model[0].weight.requires_grad_(s != 2)
        if s == 4:
            opt.add_param_group({"params": [extra], "lr": 0.05})
        opt.zero_grad()
        (model(_batch(rank, s)).pow(2).mean() + (extra.pow(2).sum() if s >= 4 else 0)).backward()
        opt.step()
    if zero:  # each re-shard drops the old shard tensors' state: what is left is this rank's pieces' alone
        pieces = opt.state_dict(sharded=True)["distopt_shard"]["pieces"]
        assert len(opt.state) <= len(pieces), f"rank {rank}: {len(opt.state)} state entries, {len(pieces)} pieces"
    return _params(model, opt) + [extra.detach().clone()]


def case_join(rank: int, comm: Any, zero: int) -> list[Any]:
    """Uneven inputs: rank r runs 2 + r batches inside ``join()``."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("sgd", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    with opt.join():
        for s in range(2 + rank):
            opt.zero_grad()
            model(_batch(rank, s)).pow(2).mean().backward()
            opt.step()
    return _params(model, opt)


def _gpt(vocab: int = 37, width: int = 16, context: int = 8) -> Any:
    """A GPT-style model: token and position embeddings, one pre-norm causal self-attention block with
    an MLP, a final LayerNorm and a head tied to the token embedding."""
    import torch

    class TinyGPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
            self.ln1, self.ln2, self.ln_f = (torch.nn.LayerNorm(width) for _ in range(3))
            self.attn = torch.nn.MultiheadAttention(width, 2, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))
            self.head = torch.nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tok.weight
            self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1))

        def forward(self, idx: Any) -> Any:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=self.mask[:idx.shape[1], :idx.shape[1]], need_weights=False)[0]
            x = x + self.mlp(self.ln2(x))
            return self.head(self.ln_f(x))

    return fill_normal(TinyGPT(), 3, 0.1)


def fill_normal(model: Any, seed: int, scale: float) -> Any:
    """``model`` with every parameter drawn from ``scale`` times a standard normal of NumPy's generator of ``seed``
    (not torch's global one: the simulated ranks are threads), in ``parameters()`` order."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy((rng.standard_normal(tuple(p.shape)) * scale).astype(np.float32)))
    return model


def case_gpt(rank: int, comm: Any, zero: int, steps: int = 6) -> list[float]:
    """The GPT-style model with AdamW (weight decay 0.1, betas 0.9/0.95), clipping at 1.0, on random tokens
    (a different batch per rank and step); returns the loss curve averaged over the ranks."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = _gpt()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = distopt.DistOpt(adamw, comm=comm, zero=zero, buffSize=600, model=model)
    curve = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        tokens = torch.randint(0, 37, (4, 9), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 37), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        curve.append(opt.all_reduce_metrics({"loss": float(loss.detach())}, mean=("loss",))["loss"])
    return curve


def case_save_load(rank: int, comm: Any, zero: int, path: str, load: bool) -> list[Any]:
    """``distopt.save`` after 2 Adam steps, or ``distopt.load`` of that file and 2 more steps."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    if load:
        model.load_state_dict(distopt.load(path, opt))
    for s in range(2):
        opt.zero_grad()
        model(_batch(rank % 2, s)).pow(2).mean().backward()
        opt.step()
    if not load:
        distopt.save(path, model.state_dict(), opt)
    return _params(model, opt)


def case_elastic_parts(rank: int, comm: Any, zero: int, parts: list[bytes] | None, steps: int) -> dict[str, Any]:
    """Adam under an elastic ``State`` at ``zero``: without ``parts``, 2 steps then a commit (this rank's part
    and the consolidated state's size in bytes are returned); with them, a model of another seed restores
    the commit from its parts, read one at a time, then runs ``steps`` more steps (as :func:`case_resume`)."""
    import torch

    from distopt import elastic

    torch.set_num_threads(1)
    model = _model(seed=9 if parts else 0)
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    state = elastic.State(model=model, optimizer=opt, step=0)
    out: dict[str, Any] = {}
    if parts is None:
        for s in range(2):
            opt.zero_grad()
            model(_batch(rank % 2, s)).pow(2).mean().backward()
            opt.step()
            state.step += 1
        state.commit()
        out["part"] = state._committed
        f = io.BytesIO()
        torch.save(opt.state_dict(), f)
        out["consolidated_bytes"] = len(f.getvalue())
        steps = 0
    else:
        state.load(1, 0, len(parts), lambda: iter(parts))
        assert state.step == 2 and state.commits == 1
    for s in range(2, 2 + steps):
        opt.zero_grad()
        model(_batch(rank % 2, s)).pow(2).mean().backward()
        opt.step()
    out["params"] = _params(model, opt)
    opt.close()
    return out


def case_fresh_buffers(rank: int, comm: Any, zero: int) -> list[int]:
    """distopt.SGD on NumPy arrays at ``zero``, buckets of 64 elements: per step, the bucket buffers newly allocated
    (not taken from the engine's kept buffers)."""
    params = params_for(SHAPES, np.float32)
    opt = distopt.DistOpt(distopt.SGD(lr=0.1, momentum=0.9), comm=comm, zero=zero, buffSize=64)
    spares, fresh = opt.engine.sync.spares, [0]
    take = spares.take

    def counting(size: int, dtype: Any, new: Any) -> Any:
        def made(n: int) -> Any:
            fresh[0] += 1
            return new(n)
        return take(size, dtype, made)

    spares.take = counting
    per_step = []
    for s in range(STEPS):
        fresh[0] = 0
        opt.step(params, grads_for(s, rank, SHAPES, np.float32))
        per_step.append(fresh[0])
    return per_step
