"""``torch.distributed.checkpoint`` with a DistOpt at every stage: ``get_state_dict``/``set_state_dict`` and
``dcp.save``/``dcp.load``, run by ``tests/torch/test_torch_dcp.py`` on real backends."""
from __future__ import annotations

from typing import Any

import distopt
from tests.support.zero_cases import _batch, _model, _params


def _train(model: Any, opt: Any, rank: int, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        model(_batch(rank % 2, s)).pow(2).mean().backward()  # the same data whatever the world size
        opt.step()


def _finish(model: Any, opt: Any, rank: int, directory: str | None, restored: Any) -> dict[str, Any]:
    """With ``directory``, rank 0's consolidated ``plain.pt`` there (the reference route; collective); then the
    parameters, ``restored``, and the DistOpt closed."""
    import os

    import torch

    if directory is not None:
        plain = {"model": model.state_dict(), "optim": opt.state_dict()}
        if rank == 0:
            torch.save(plain, os.path.join(directory, "plain.pt"))
    out = {"params": _params(model, opt), "restored": restored}
    opt.close()
    return out


def case_dcp(rank: int, comm: Any, zero: int, directory: str, mode: str, steps: int) -> dict[str, Any]:
    """Adam at ``zero``, ``steps`` steps. ``mode``: ``"save"``: from the start, then ``get_state_dict`` and
    ``dcp.save`` into ``directory`` (and rank 0 a consolidated ``torch.save`` of ``opt.state_dict()`` and the
    model beside it); ``"dcp"``: ``dcp.load`` and ``set_state_dict`` from ``directory`` first;
    ``"plain"``: ``opt.load_state_dict`` of the consolidated file first (the reference route). Returns the
    parameters and ``stats['steps']`` after the load."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=zero, buffSize=40,
                          model=model)
    start = 0 if mode == "save" else 2
    if mode == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    elif mode == "plain":
        saved = torch.load(os.path.join(directory, "plain.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    restored = opt.stats["steps"]
    _train(model, opt, rank, range(start, start + steps))
    if mode == "save":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    return _finish(model, opt, rank, directory if mode == "save" else None, restored)


def case_reference(rank: int, comm: Any, steps: int) -> list[Any]:
    """``zero=0`` for ``steps`` steps from the start (the uninterrupted run)."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, buffSize=40, model=model)
    _train(model, opt, rank, range(steps))
    out = _params(model, opt)
    opt.close()
    return out


def case_state(rank: int, comm: Any, zero: int, directory: str, mode: str, steps: int) -> dict[str, Any]:
    """``distopt.elastic.State`` (Adam at ``zero``, an ``ElasticSampler``, a plain value) as a torch ``Stateful``.
    ``mode``: ``"save"``: ``steps`` steps from the start, then ``dcp.save({"state": state})`` into ``directory``
    and rank 0's consolidated ``plain.pt`` beside it (as :func:`case_dcp`); ``"load"``: ``dcp.load`` of it first.
    Returns the parameters after ``steps`` more steps, and the step count, sampler position and value loaded."""
    import torch
    import torch.distributed.checkpoint as dcp

    from distopt.elastic import ElasticSampler, State

    torch.set_num_threads(1)
    model = _model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=zero, buffSize=40,
                          model=model)
    sampler = ElasticSampler(60, 3, rank=rank, world_size=comm.size)
    state = State(model, opt, sampler, epoch=0)
    start = 0 if mode == "save" else 2
    if mode == "load":
        dcp.load({"state": state}, checkpoint_id=directory)
    restored = (opt.stats["steps"], sampler.processed, state.epoch)
    for s in range(start, start + steps):
        _train(model, opt, rank, range(s, s + 1))
        sampler.record_batch()
    if mode == "save":
        state.epoch = 7
        dcp.save({"state": state}, checkpoint_id=directory)
    return _finish(model, opt, rank, directory if mode == "save" else None, restored)
