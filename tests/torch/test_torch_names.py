"""Errors name a parameter by its module path when ``model=`` is given, not only by its number."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import distopt  # noqa: E402
from tests.support.simworld import run_world  # noqa: E402


def case_shapes(rank: int, comm: Any) -> str:
    """Rank 1 builds a wider head: the construction's check names it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2 + rank))
    try:
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    except distopt.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_frozen(rank: int, comm: Any) -> str:
    """Rank 1 freezes the first layer's bias before a step: the step's check names the parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    model[0].bias.requires_grad_(rank == 0)
    try:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    except distopt.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        opt.close()
    return "no error"


@pytest.mark.unit
def test_construction_mismatch_names_the_module_path() -> None:
    for message in run_world(2, case_shapes):
        assert "'1.weight'" in message and "shape (3, 4)" in message, message


@pytest.mark.unit
def test_step_mismatch_names_the_module_path() -> None:
    for message in run_world(2, case_frozen):
        assert "'0.bias'" in message or "'1.weight'" in message, message
