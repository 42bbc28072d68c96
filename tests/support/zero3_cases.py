"""Cases of fully sharded parameters (``DistOpt(zero=3)``), run by ``tests/sharding/test_zero3.py`` on any backend.

Each case is ``fn(rank, comm, *args)`` (see :mod:`tests.support.backends`) and
returns plain data. The models and batches are those of
:mod:`tests.support.zero_cases`, so a ``zero=3`` run compares with ``zero=0``.
"""
from __future__ import annotations

from typing import Any

import distopt
from tests.support.zero_cases import _batch, _gpt, _model, _optimizer, _params


def _held(opt: Any) -> dict[str, int]:
    stats = opt.stats
    return {k: int(stats[k]) for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                                       "gathered_bytes_peak", "gather_bytes")}


def case_memory(rank: int, comm: Any, zero: int, steps: int = 3) -> dict[str, Any]:
    """The GPT-style model with AdamW, buckets of 600 elements: what a rank holds at rest after each step,
    the largest bucket (BYTES) and the parameters' elements; the model's parameter tensors' own bytes."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = _gpt()
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=3e-3), comm=comm, zero=zero, buffSize=600,
                          model=model)
    held = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        tokens = torch.randint(0, 37, (4, 9), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 37), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        held.append(_held(opt))
    with torch.no_grad():
        model(torch.zeros(2, 8, dtype=torch.long))  # an evaluation: gathered, then freed again
    own = sum(p.untyped_storage().nbytes() - p.element_size() for p in model.parameters())  # freed: one element
    bucket = max(b.size for b in opt.engine.layout.buckets) * 4
    elements = sum(b.size for b in opt.engine.layout.buckets)
    return {"held": held, "bucket_bytes": bucket, "elements": elements, "own_after_eval": own,
            "params": _params(model, opt)}


def _blocks(width: int = 12, depth: int = 3) -> Any:
    """Pre-LN residual blocks whose modules are registered in another order than they run (both norms
    first, as many GPT implementations do), then a head."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.mix, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
            self.fc1, self.fc2 = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

        def forward(self, x: Any) -> Any:
            x = x + self.out(torch.tanh(self.mix(self.ln1(x))))
            return x + self.fc2(torch.tanh(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block() for _ in range(depth)), torch.nn.Linear(width, 3))


def case_gathered(rank: int, comm: Any, zero: int, buff: int) -> dict[str, Any]:
    """Three steps of the blocks with SGD at ``zero=3``, buckets of ``buff`` elements: how many gathers
    started after the first step, and how many of them were freed before any module needed the bucket (a
    prefetch wasted: its bucket is gathered again when needed)."""
    import gc
    import warnings

    import torch

    from distopt.torch.zero.params import Gathered, ParamShards

    torch.set_num_threads(1)
    model = _blocks()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=zero, buffSize=buff,
                          model=model)
    g = torch.Generator().manual_seed(rank)
    opt.zero_grad()
    model(torch.randn(4, 12, generator=g)).pow(2).mean().backward()
    opt.step()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        (store,) = [o for o in gc.get_objects() if isinstance(o, ParamShards) and o.comm is comm]
    unused: set[int] = set()
    counts = {"started": 0, "wasted": 0}
    start, gather, free = store._start, store.gather, store.free

    def counting_start(b: int) -> None:
        if store._state[b] is Gathered.FREE:
            counts["started"] += 1
            unused.add(b)
        start(b)

    def counting_gather(phase: int, where: int, need: Any, *rest: Any) -> None:
        gather(phase, where, need, *rest)
        unused.difference_update(need)

    def counting_free(b: int) -> None:
        counts["wasted"] += b in unused
        unused.discard(b)
        free(b)

    store._start, store.gather, store.free = counting_start, counting_gather, counting_free
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    return counts


def case_checkpointed(rank: int, comm: Any, zero: int, reentrant: bool) -> list[Any]:
    """SGD with momentum; the middle of the MLP under ``torch.utils.checkpoint`` (its forward runs again in
    backward), a ``torch.no_grad()`` evaluation and a second forward before each backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("sgd", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    first, middle = model[0], torch.nn.Sequential(model[1], model[2])
    for s in range(3):
        opt.zero_grad()
        with torch.no_grad():
            model(_batch(rank, s + 20))
        x = _batch(rank, s)
        h = checkpoint(middle, first(x), use_reentrant=reentrant)
        loss = model[3](h).pow(2).mean() + model(x).pow(2).mean()  # a second forward of every module
        loss.backward()
        opt.step()
    return _params(model, opt)


def case_frozen(rank: int, comm: Any, zero: int) -> list[Any]:
    """Adam; the first layer frozen from the start (it stays whole at ``zero=3``)."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    for s in range(3):
        opt.zero_grad()
        model(_batch(rank, s)).pow(2).mean().backward()
        opt.step()
    return _params(model, opt) + [tuple(model[0].weight.shape)]


def case_state_dict(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """``model.state_dict()`` after 2 Adam steps; then a loaded state (every weight halved) and 1 step."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    for s in range(2):
        opt.zero_grad()
        model(_batch(rank, s)).pow(2).mean().backward()
        opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # zero=0's values are the live parameters
    model.load_state_dict({k: v * 0.5 for k, v in saved.items()})
    opt.zero_grad()
    model(_batch(rank, 2)).pow(2).mean().backward()
    opt.step()
    return {"saved": saved, "params": _params(model, opt)}


def case_one_rank_forward(rank: int, comm: Any) -> str:
    """Rank 0 alone runs the head once more between two steps: the next gather raises on every rank."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("sgd", model.parameters()), comm=comm, zero=3, buffSize=40, model=model)
    try:
        for s in range(3):
            opt.zero_grad()
            model(_batch(rank, s)).pow(2).mean().backward()
            opt.step()
            if rank == 0 and s == 1:
                with torch.no_grad():
                    model[2](torch.zeros(1, 13))
    except distopt.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_one_rank_skips_a_layer(rank: int, comm: Any) -> str:
    """Four layers; at step 2 rank 1's forward skips the third (a data-dependent branch on one rank only):
    the gathers that follow differ, and every rank raises before any of them moves (a gather check or an
    announcement of the prefetch)."""
    import torch

    torch.set_num_threads(1)
    layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))
    opt = distopt.DistOpt(torch.optim.SGD(layers.parameters(), lr=0.1), comm=comm, zero=3, buffSize=36,
                          model=layers)
    g = torch.Generator().manual_seed(rank)
    try:
        for s in range(4):
            x = torch.randn(3, 6, generator=g)
            for i, layer in enumerate(layers):
                if not (s == 2 and rank == 1 and i == 2):
                    x = torch.tanh(layer(x))
            opt.zero_grad()
            x.pow(2).mean().backward()
            opt.step()
    except distopt.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_errors(rank: int, comm: Any) -> dict[str, str]:
    """What a misuse raises: a layout change, ``join()``, a parameter used outside its module's forward,
    ``summon_full_params`` inside a forward."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("sgd", model.parameters()), comm=comm, zero=3, buffSize=40, model=model)
    out: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except (RuntimeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    def step() -> None:
        opt.zero_grad()
        model(_batch(rank, 0)).pow(2).mean().backward()
        opt.step()

    step()
    attempt("outside forward", lambda: _batch(rank, 1) @ model[0].weight.t())

    def summon_inside() -> None:
        handle = model[2].register_forward_pre_hook(lambda m, a: opt.summon_full_params().__enter__())
        try:
            with torch.no_grad():
                model(_batch(rank, 1))
        finally:
            handle.remove()

    attempt("summon inside forward", summon_inside)

    def join() -> None:
        with opt.join():
            pass

    attempt("join", join)
    model[0].weight.requires_grad_(False)
    attempt("layout change", step)
    return out


def _dump(obj: Any) -> bytes:
    import io

    import torch

    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def case_gpt_train(rank: int, comm: Any, zero: int, optimizer: str, start: bytes | None,
                   shards: list[bytes] | None, first: int, steps: int) -> dict[str, Any]:
    """The GPT-style model (embeddings, attention, LayerNorm, a tied head) trained from step ``first`` for
    ``steps`` steps, each with one ``no_sync`` micro-batch accumulated before the synchronised one and
    clipping at 0.5; ``optimizer`` is ``"sgd"`` (momentum 0.9, weight decay) or ``"adamw"``. Loads the
    consolidated checkpoint ``start`` or the list of every rank's sharded checkpoints ``shards`` first when
    given. Returns the whole parameters, the consolidated checkpoint and this rank's sharded one
    (``zero > 0``)."""
    import io

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = _gpt()
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2) \
        if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                                     weight_decay=0.1)
    opt = distopt.DistOpt(local, comm=comm, zero=zero, buffSize=600, model=model)
    if start is not None:
        saved = torch.load(io.BytesIO(start), weights_only=True)
        model.load_state_dict(saved.pop("distopt_model"))
        opt.load_state_dict(saved)
    elif shards is not None:
        saved = [torch.load(io.BytesIO(b), weights_only=True) for b in shards]
        model.load_state_dict(saved[0]["distopt_model"])
        opt.load_state_dict([{k: v for k, v in s.items() if k != "distopt_model"} for s in saved])

    def loss_of(step: int, micro: int) -> Any:
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        tokens = torch.randint(0, 37, (3, 9), generator=g)
        return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 37), tokens[:, 1:].reshape(-1))

    for s in range(first, first + steps):
        opt.zero_grad()
        with opt.no_sync():
            loss_of(s, 1).backward()
        loss_of(s, 0).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
    return {"params": _params(model, opt),
            "full": _dump({**opt.state_dict(), "distopt_model": model.state_dict()}),
            "shard": _dump({**opt.state_dict(sharded=True), "distopt_model": model.state_dict()}) if zero else None}


def case_uneven_no_grad_forwards(rank: int, comm: Any, counts: tuple[int, int], reshard: bool = True) -> dict[str, Any]:
    """Rank r runs ``counts[r]`` no-grad forwards of the whole model (generation on one rank), then every
    rank trains one step: returns the error and the seconds until it was raised."""
    import time

    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(_optimizer("sgd", model.parameters()), comm=comm, zero=3, buffSize=40, model=model,
                          reshard_after_forward=reshard)
    start = time.monotonic()
    try:
        with torch.no_grad():
            for _ in range(counts[rank]):
                model(_batch(rank, 0))
        opt.zero_grad()
        model(_batch(rank, 1)).pow(2).mean().backward()
        opt.step()
        error = "no error"
    except (distopt.CollectiveMismatchError, distopt.CollectiveTimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}
