"""A checkpoint loaded into a model built on the meta device at ``zero=3``: bitwise what the same checkpoint gives a
model built on the CPU.

A GPT (:class:`tests.sharding.test_meta_init.GPT`) trained 3 AdamW steps at W = 2 is saved three ways: a consolidated
file (``distopt.save``), the consolidated dicts (``opt.state_dict()`` and ``model.state_dict()``), and every rank's
shard with its parameters' elements (``opt.state_dict(sharded=True, params=True)``). Each is loaded at W = 2 and 3 into
the same GPT built from another seed, once on the meta device and once on the CPU (``distopt.load`` then
``model.load_state_dict``; ``opt.load_state_dict(full)`` then ``model.load_state_dict(full)``;
``opt.load_state_dict([every shard])``, streamed one shard at a time); compared: the whole parameters right after
loading (also against the saved ones) and after 2 more steps. The same for a ``torch.distributed.checkpoint`` saved at
W = 2 (``get_state_dict`` and ``dcp.save``) and loaded at W = 2 and 3 (``dcp.load`` and ``set_state_dict``) on torch's
backend.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

import distopt
from tests.sharding.test_meta_init import CONTEXT, GPT, VOCAB
from tests.support.backends import run_case

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _full(model: Any, opt: Any) -> list[Any]:
    with opt.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


def _steps(model: Any, opt: Any, rank: int, first: int, count: int) -> None:
    for s in range(first, first + count):
        tokens = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(100 * s + rank % 2))
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()


def _dump(obj: Any) -> bytes:
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def _build(comm: Any, device: str, seed: int) -> tuple[Any, Any]:
    """The GPT built on ``device`` from ``seed``, and AdamW at ``zero=3`` over it."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return model, distopt.DistOpt(adamw, comm=comm, zero=3, buffSize=600, model=model)


def _trained_on(model: Any, opt: Any, rank: int) -> dict[str, Any]:
    """The whole parameters just loaded, and after 2 more steps; the DistOpt closed."""
    loaded = _full(model, opt)
    _steps(model, opt, rank, 3, 2)
    out = {"loaded": loaded, "trained": _full(model, opt)}
    opt.close()
    return out


def _same(saved: list[Any], cpu: list[dict[str, Any]], meta: list[dict[str, Any]], what: str) -> None:
    """Every rank: the CPU-built and the meta-built model loaded ``saved`` bitwise, and stay equal 2 steps on."""
    for rank, (c, m) in enumerate(zip(cpu, meta)):
        for i, (ref, a, b) in enumerate(zip(saved, c["loaded"], m["loaded"])):
            assert torch.equal(ref, a) and torch.equal(ref, b), f"{what} rank {rank} parameter {i} loaded"
        for i, (a, b) in enumerate(zip(c["trained"], m["trained"])):
            assert torch.equal(a, b), f"{what} rank {rank} parameter {i} after 2 more steps"
    assert any(not torch.equal(a, b) for a, b in zip(saved, meta[0]["trained"]))  # it trained


def case(rank: int, comm: Any, device: str, seed: int, how: str, saved: Any) -> dict[str, Any]:
    """The GPT built on ``device`` from ``seed`` at ``zero=3`` with AdamW. ``how="save"``: 3 steps, then every form of
    checkpoint (``saved`` is the file's path); otherwise the checkpoint ``saved`` loaded ``how``, then 2 steps."""
    model, opt = _build(comm, device, seed)
    if how == "save":
        _steps(model, opt, rank, 0, 3)
        distopt.save(saved, model.state_dict(), opt)
        out = {"params": _full(model, opt), "opt": _dump(opt.state_dict()), "model": _dump(model.state_dict()),
               "shard": _dump(opt.state_dict(sharded=True, params=True))}
        opt.close()
        return out
    if how == "file":
        model.load_state_dict(distopt.load(saved, opt))
    elif how == "dicts":
        opt.load_state_dict(torch.load(io.BytesIO(saved["opt"]), weights_only=True))
        model.load_state_dict(torch.load(io.BytesIO(saved["model"]), weights_only=True))
    else:  # every rank's shard, read one at a time
        shards = (torch.load(io.BytesIO(b), weights_only=True) for b in saved)
        opt.load_state_dict(distopt.ShardStream([{"world_size": 2, "rank": r} for r in range(len(saved))], shards))
    return _trained_on(model, opt, rank)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_a_checkpoint_loads_into_a_meta_built_model_bitwise_as_into_a_cpu_built_one(world, tmp_path: Path):
    path = str(tmp_path / "gpt.pt")
    first = run_case("sim", 2, case, "cpu", 11, "save", path)
    forms = {"file": path, "dicts": {"opt": first[0]["opt"], "model": first[0]["model"]},
             "shards": [f["shard"] for f in first]}
    for how, saved in forms.items():
        cpu = run_case("sim", world, case, "cpu", 5, how, saved)
        meta = run_case("sim", world, case, "meta", 5, how, saved)
        _same(first[0]["params"], cpu, meta, f"{how} W={world}")


def case_dcp(rank: int, comm: Any, device: str, seed: int, directory: str, save: bool) -> dict[str, Any]:
    """The GPT built on ``device`` from ``seed`` at ``zero=3``. ``save``: 3 steps, then ``get_state_dict`` and
    ``dcp.save`` into ``directory``; else ``dcp.load`` and ``set_state_dict`` from it, then 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build(comm, device, seed)
    if save:
        _steps(model, opt, rank, 0, 3)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
        out = {"params": _full(model, opt)}
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return _trained_on(model, opt, rank)
    opt.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.world
def test_a_dcp_checkpoint_loads_into_a_meta_built_model_bitwise_as_into_a_cpu_built_one(world, tmp_path: Path):
    directory = str(tmp_path / "dcp")
    first = run_case("torch", 2, case_dcp, "cpu", 11, directory, True)
    cpu = run_case("torch", world, case_dcp, "cpu", 5, directory, False)
    meta = run_case("torch", world, case_dcp, "meta", 5, directory, False)
    _same(first[0]["params"], cpu, meta, f"dcp W={world}")
