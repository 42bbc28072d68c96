"""The torch route at DDP's cost: one control collective per steady-state step, and waits that do not spin.

* A PyTorch step (hooks, ``loss.backward()``, ``step()``) issues exactly one
  control collective (``stats["control_collectives"]``: the step header) in
  the steady state, with overlap or not, bucket views or not, in the
  simulated world and on MPI, shm and torch.distributed at W = 2. A
  parameter no rank used costs the gradient flags as well (its ``.grad``
  stays None on every rank); one only some ranks used does not (every rank
  gets the same average).
* :func:`distopt.comm.wait.wait_until` spins only as long as recent waits
  took, then yields the core.
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402
from distopt.comm import wait  # noqa: E402
from distopt.errors import CollectiveTimeoutError  # noqa: E402
from tests.support.backends import run_case  # noqa: E402

#: Per step: which ranks use the ``extra`` layer (None: every rank).
USES = (None, None, None, (), (0,), None)


class Net(torch.nn.Module):
    """A two-layer body and an ``extra`` linear term some steps leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
        self.extra = torch.nn.Linear(3, 1)

    def forward(self, x: Any, use_extra: bool) -> Any:
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


def case_control_collectives(rank: int, comm: Any, overlap: bool, bucket_view: bool, zero: int = 0) -> dict[str, Any]:
    """Steps of :data:`USES`: control collectives per step, whether ``extra``'s gradient is None after each
    backward (at ``zero=2``, whose ``.grad`` is a placeholder until ``step()``: whether ``step()`` left
    ``extra`` unchanged), and the parameters."""
    model = Net().double()
    # different inits (rank 0's are broadcast), from a generator of this rank's own: the simulated
    # world's ranks are threads sharing torch's global one
    init = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init, dtype=p.dtype))
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, model=model,
                  overlap=overlap, gradient_as_bucket_view=bucket_view, zero=zero)
    g = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {"control": [], "extra_grad_none": [], "extra_grad": [], "extra_unchanged": []}
    for users in USES:
        x, y = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 1, generator=g, dtype=torch.float64)
        before = opt.stats["control_collectives"]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, users is None or rank in users), y).backward()
        if zero < 2:
            out["extra_grad_none"].append(model.extra.weight.grad is None)
            out["extra_grad"].append(None if model.extra.weight.grad is None else model.extra.weight.grad.clone())
        else:
            before_step = model.extra.weight.detach().clone()
        opt.step()
        if zero == 2:  # a parameter nobody used keeps its value (momentum included): no update at all
            out["extra_unchanged"].append(bool(torch.equal(before_step, model.extra.weight.detach())))
        out["control"].append(opt.stats["control_collectives"] - before)
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.close()
    return out


def _check_control(results: list[dict[str, Any]], overlap: bool) -> None:
    # step 3: nobody used ``extra``; step 4: rank 0 alone did (after backward the header knows rank 1 lacks it)
    want = [1, 1, 2, 2 if not overlap else 1, 1]
    for out in results:
        assert out["control"][1:] == want, out["control"]
        assert out["extra_grad_none"] == [False, False, False, True, False, False]
    assert torch.equal(results[0]["extra_grad"][4], results[1]["extra_grad"][4])  # the same average
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results[1:])


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "bucket_view"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after_backward"])
@pytest.mark.unit
def test_steady_state_torch_step_issues_one_control_collective(overlap: bool, bucket_view: bool):
    _check_control(run_case("sim", 2, case_control_collectives, overlap, bucket_view), overlap)


@pytest.mark.unit
def test_zero2_step_folds_the_gradient_flags_into_its_finiteness_vote():
    """zero=2 votes on its reduced segments at every step (each rank sees only its own); that vote
    carries the gradient flags, so a step costs two control collectives (header, vote), a parameter
    nobody used (step 3) included, and the parameters equal zero=0's bitwise."""
    sharded = run_case("sim", 2, case_control_collectives, True, False, 2)
    dense = run_case("sim", 2, case_control_collectives, True, False, 0)
    for out in sharded:
        assert out["control"][1:] == [2, 2, 2, 2, 2], out["control"]
        assert out["extra_unchanged"] == [False, False, False, True, False, False]
    assert all(torch.equal(r["params"], dense[0]["params"]) for r in sharded)


@pytest.mark.parametrize("backend", ["mpi", "shm", "torch"])
@pytest.mark.world
def test_one_control_collective_per_step_on_every_backend(backend: str):
    _check_control(run_case(backend, 2, case_control_collectives, True, False), True)


def case_zero_gradient(rank: int, comm: Any) -> tuple[list[int], Any]:
    """A parameter every rank uses with an exactly zero gradient: control collectives per step and its
    ``.grad`` after the last backward (zeros, not None: it exists)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = DistOpt(torch.optim.SGD([*model.parameters(), scale], lr=0.1), comm=comm)
    counts = []
    for s in range(3):
        before = opt.stats["control_collectives"]
        opt.zero_grad()
        x = torch.full((2, 3), float(rank + s), dtype=torch.float64)
        (model(x).sum() + 0.0 * scale.sum()).backward()
        counts.append(opt.stats["control_collectives"] - before)
        opt.step()
    return counts, scale.grad.clone()


@pytest.mark.unit
def test_a_gradient_that_is_zero_everywhere_costs_the_flags_and_stays_a_gradient():
    """All-zero reduced gradients are ambiguous (unused, or zero where used): the flags settle them."""
    for counts, grad in run_case("sim", 2, case_zero_gradient):
        assert counts[1:] == [2, 2]
        assert grad is not None and torch.equal(grad, torch.zeros(2, dtype=torch.float64))


def case_blocked_cpu(rank: int, comm: Any, rounds: int, late_s: float) -> tuple[float, float]:
    """Rank 1 arrives ``late_s`` late at each of ``rounds`` barriers; rank 0's (process CPU, wall) seconds."""
    comm.barrier()
    cpu, wall = time.process_time(), time.monotonic()
    for _ in range(rounds):
        if rank == 1:
            time.sleep(late_s)
        comm.barrier()
    return time.process_time() - cpu, time.monotonic() - wall


@pytest.mark.world
def test_torch_backend_waits_without_burning_a_core():
    """Waiting 1 s in all for a late peer (40 waits of 25 ms, each shorter than a busy-poll phase) costs
    rank 0 little CPU: it blocks in ``Work.wait`` instead of polling."""
    (cpu, wall), _ = run_case("torch", 2, case_blocked_cpu, 40, 0.025)
    assert wall >= 1.0
    assert cpu < 0.25 * wall, (cpu, wall)


@pytest.mark.unit
def test_wait_spins_only_as_long_as_recent_waits_took(monkeypatch):
    """After waits of ~1 ms the spin budget is ~2 ms; a later long wait yields the core past it instead of
    spinning through ``busy_s``."""
    backoff = wait.Backoff(busy_s=0.05, yield_s=0.2, min_sleep_s=1e-4, max_sleep_s=1e-3)
    assert wait.spin_budget(backoff) == 0.05  # nothing known yet: the whole busy phase
    for _ in range(20):
        end = time.monotonic() + 0.001
        wait.wait_until(lambda: time.monotonic() >= end, time.monotonic() + 5, lambda: CollectiveTimeoutError("x"),
                        backoff=backoff)
    assert wait.MIN_SPIN_S <= wait.spin_budget(backoff) < 0.01
    yields: list[float] = []
    start = time.monotonic()
    real_yield = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (yields.append(time.monotonic() - start), real_yield()))
    end = start + 0.04
    wait.wait_until(lambda: time.monotonic() >= end, start + 5, lambda: CollectiveTimeoutError("x"), backoff=backoff)
    assert yields and yields[0] < 0.01  # yielding long before busy_s (0.05)
    for _ in range(wait.RECENT):  # long waits raise the budget
        end = time.monotonic() + 0.02
        wait.wait_until(lambda: time.monotonic() >= end, time.monotonic() + 5, lambda: CollectiveTimeoutError("x"),
                        backoff=backoff)
    assert wait.spin_budget(backoff) > 0.03


@pytest.mark.unit
def test_wait_budget_stays_within_its_bounds():
    backoff = wait.Backoff(busy_s=1e-3, yield_s=1e-3, min_sleep_s=1e-5, max_sleep_s=1e-4)
    wait.wait_until(lambda: True, 0.0, lambda: CollectiveTimeoutError("never"), backoff=backoff)
    end = time.monotonic() + 0.02
    wait.wait_until(lambda: time.monotonic() >= end, time.monotonic() + 5, lambda: CollectiveTimeoutError("x"),
                    backoff=backoff)
    assert wait.spin_budget(backoff) == 1e-3  # capped at busy_s
    assert wait.spin_budget(wait.Backoff(busy_s=0.0, yield_s=0.0)) == 0.0  # no spin at all


@pytest.mark.job
def test_torch_step_benchmark_smoke(tmp_path):
    """``benchmarks/torch_step.py`` under torchrun with its smallest settings: the JSON holds every workload,
    every variant's rounds, and the distopt rows' control collectives (one per step)."""
    import json
    import subprocess
    import sys

    from tests.support.harness import ROOT
    from tests.support.torch_workers import free_port

    out = tmp_path / "torch_step.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    res = subprocess.run([*torchrun, str(ROOT / "benchmarks" / "torch_step.py"), "--quick", "--rounds", "2",
                          "--iters", "1", "--warmup", "1", "--width-div", "16", "--gpt", "64,32,2,1,16,2",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "torch_step" and data["world_size"] == 2
    assert {"loadavg_at_start", "loadavg_at_end"} <= set(data["env"])
    step, cnn, gpt = (data["workloads"][w]["results"] for w in ("step", "cnn", "gpt"))
    assert set(step) == {"ddp", "distopt", "ddp_view", "distopt_view", "gloo"}
    assert set(cnn) == {"ddp", "distopt"} and set(gpt) == {"ddp", "distopt", "zero1", "zero2"}
    assert data["workloads"]["cnn"]["params"] == 382_634
    for rec in [*step.values(), *cnn.values(), *gpt.values()]:
        assert len(rec["round_ms"]) == 2 and rec["ms"] > 0 and rec["x_ddp"] > 0
    for rec in (step["distopt"], step["distopt_view"], cnn["distopt"], gpt["distopt"]):
        assert rec["control_per_step"] == 1.0
    for rec in (gpt["zero1"], gpt["zero2"]):  # the header, and the sharded step's own agreements
        assert rec["control_per_step"] >= 1.0
