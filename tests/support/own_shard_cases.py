"""A rank loading its own sharded state (``state_dict(sharded=True, params=True)`` at the same world size): what
``distopt.elastic`` restores. Run by ``tests/sharding/test_zero_own_shard.py``."""
from __future__ import annotations

import io
from typing import Any

import distopt
from tests.support.zero_cases import _batch, _model, _optimizer, _params


def case_own_shard(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """Adam over the small MLP: 2 steps, this rank's sharded state saved, 2 more steps (the reference); then a
    fresh model from another seed and a fresh DistOpt load the saved shard and run the same 2 steps. Returns both
    runs' parameters, whether the loaded optimizer state equals the saved pieces', and whether loading consolidated
    any state into whole tensors."""
    import torch

    from distopt.torch.zero import state as zero_state

    torch.set_num_threads(1)

    loaded: list[bool] = []

    def run(seed: int, shard: bytes | None) -> tuple[list[Any], bytes]:
        model = _model(seed=seed)
        opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
        saved = b""
        if shard is not None:
            mine = torch.load(io.BytesIO(shard), weights_only=True)
            opt.load_state_dict(mine)
            now = opt.state_dict(sharded=True)["distopt_shard"]["pieces"]
            loaded.append(len(now) == len(mine["distopt_shard"]["pieces"]) and all(
                a[:3] == b[:3] and sorted(a[3]) == sorted(b[3]) and all(torch.equal(a[3][k], b[3][k]) for k in a[3])
                for a, b in zip(now, mine["distopt_shard"]["pieces"])))
        for s in range(0 if shard is None else 2, 4):
            if s == 2 and shard is None:
                f = io.BytesIO()
                torch.save(opt.state_dict(sharded=True, params=True), f)
                saved = f.getvalue()
            opt.zero_grad()
            model(_batch(rank, s)).pow(2).mean().backward()
            opt.step()
        out = _params(model, opt)
        opt.close()
        return out, saved

    ref, shard = run(0, None)
    consolidated = []
    real = zero_state.consolidate
    zero_state.consolidate = lambda *a, **k: consolidated.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        got, _ = run(9, shard)
    finally:
        zero_state.consolidate = real  # type: ignore[assignment]
    return {"ref": ref, "got": got, "consolidated": bool(consolidated), "state_loaded": loaded == [True]}


def case_restore_own(rank: int, comm: Any, zero: int, root: str, restore: bool) -> dict[str, Any]:
    """Adam under an elastic ``State``: without ``restore``, 2 steps, this rank's part of commit 1 written to the
    node's commit directory under ``root`` (as a commit under ``distopt.elastic.run`` does), then 2 more steps; with
    it, a model of another seed restores the world's commit as a restarted ``distopt.elastic.run`` worker does, then
    runs the same 2 steps. Returns the parameters and, when restoring, whether each rank read only its own part."""
    import torch

    from distopt import elastic
    from distopt.elastic.run import _restore
    from distopt.elastic.snapshot import SnapshotDir

    torch.set_num_threads(1)
    model = _model(seed=9 if restore else 0)
    opt = distopt.DistOpt(_optimizer("adam", model.parameters()), comm=comm, zero=zero, buffSize=40, model=model)
    state = elastic.State(model=model, optimizer=opt, step=0)
    snapshots = SnapshotDir("own", root, agent=0)
    out: dict[str, Any] = {}
    if restore:
        owns: list[bool] = []
        load = state.load

        def recorded(seq: int, part: int, parts: int, read: Any, own: bool = False) -> None:
            owns.append(own)
            load(seq, part, parts, read, own)

        object.__setattr__(state, "load", recorded)
        seq, _ = _restore(state, opt, snapshots, rank == 0)
        out["own"] = owns == [True] and seq == 1 and state.step == 2
    else:
        for s in range(2):
            opt.zero_grad()
            model(_batch(rank, s)).pow(2).mean().backward()
            opt.step()
            state.step += 1
        snapshots.write(1, rank, comm.size, state._part(1))
    for s in range(2, 4):
        opt.zero_grad()
        model(_batch(rank, s)).pow(2).mean().backward()
        opt.step()
    out["params"] = _params(model, opt)
    opt.close()
    return out
