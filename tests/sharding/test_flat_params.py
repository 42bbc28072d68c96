"""Parameters as views of their bucket at ``zero=1|2`` (:mod:`distopt.torch.zero.flat_params`): the all-gather after
the update writes them in place, nothing is packed or unpacked for a fused bucket, the result is ``zero=0``'s bitwise,
and a parameter whose storage was replaced is refused before the update."""
from __future__ import annotations

from typing import Any

import pytest

import distopt
from distopt.sharding.gather import ParamGather
from tests.support import zero_cases as cases
from tests.support.backends import run_case

torch = pytest.importorskip("torch")


def case_views(rank: int, comm: Any, zero: int, replace: bool) -> dict[str, Any]:
    """The zero_cases MLP with Adam at ``zero``, buckets of 40 elements, 3 steps; ``replace``: a parameter's ``.data``
    replaced by a copy before the third. Returns the parameters, per fused bucket whether its parameters view
    consecutive elements of one storage, and the error of the third step (or None)."""
    torch.set_num_threads(1)
    model = cases._model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.01), comm=comm, zero=zero, buffSize=40,
                          model=model)
    error = None
    for s in range(3):
        if replace and s == 2:
            fused = next(b for b in opt.engine.layout.buckets if not b.alone)
            moved = list(model.parameters())[fused.slots[0].index]
            moved.data = moved.data.clone()
        opt.zero_grad()
        try:
            model(cases._batch(rank, s)).pow(2).mean().backward()  # the reduction's end adopts the gradients
            opt.step()
        except RuntimeError as e:
            error = str(e)
            break
    params = list(model.parameters())
    views = []
    for bucket in opt.engine.layout.buckets:
        if bucket.alone:
            continue
        members = [params[s.index] for s in bucket.slots]
        base = members[0].data_ptr() - bucket.slots[0].offset * 4
        views.append(all(t.data_ptr() == base + s.offset * 4 and
                         t.untyped_storage().data_ptr() == members[0].untyped_storage().data_ptr()
                         for s, t in zip(bucket.slots, members)))
    out = {"params": cases._params(model, opt), "views": views, "error": error}
    opt.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.unit
def test_parameters_view_their_bucket_and_the_gather_packs_none_of_them(zero, world, monkeypatch):
    packed = []
    real = ParamGather._pack_own
    monkeypatch.setattr(ParamGather, "_pack_own", lambda self, run, buffer: packed.append(run.bucket) or
                        real(self, run, buffer))
    got = run_case("sim", world, case_views, zero, False)
    ref = run_case("sim", world, case_views, 0, False)
    for rank, (g, r) in enumerate(zip(got, ref)):
        assert g["views"] and all(g["views"]), f"rank {rank}: a fused bucket's parameters are not views of it"
        for i, (a, b) in enumerate(zip(g["params"], r["params"])):
            assert torch.equal(a, b), f"zero={zero} W={world} rank {rank} parameter {i} differs from zero=0"
    assert all(b.alone for b in packed), "a fused bucket was packed for the gather"


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.unit
def test_a_parameter_whose_storage_was_replaced_is_refused_before_the_update(zero):
    for rank, g in enumerate(run_case("sim", 2, case_views, zero, True)):
        assert g["error"] is not None and "parameters [" in g["error"] and "copy_" in g["error"], (rank, g["error"])
