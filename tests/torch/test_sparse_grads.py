"""Sparse gradients (``nn.Embedding(sparse=True)``) averaged as sparse (distopt.torch.sparse), against one process.

Every case runs in the simulated world at W = 2 and 3; ``test_every_case_on``
runs them all again on MPI, shm and torch.distributed at W = 2 and 3 (real
processes, each job under a hard timeout). float64 throughout. The reference
is one process over the concatenated batch (the ranks' lookups in rank
order). With W = 2, SparseAdam on the embedding alone is bitwise equal to
it: the division by 2 is exact, ``coalesce`` sums each row's entries in
the same order, and SparseAdam coalesces one process's gradient too. The
others agree to ``TOL``: W = 3 (a division by 3 rounds), sparse SGD (one
process adds its uncoalesced entries to the parameter one at a time, the
average is one coalesced row each), a dense layer (its bucket all-reduce
sums in another order than one process's batch), accumulation.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402
from distopt.errors import CollectiveMismatchError  # noqa: E402
from tests.support.backends import run_case  # noqa: E402

WORLDS = (2, 3)
TOL = 1e-12
V, D, N, S, STEPS = 12, 3, 4, 4.0, 4  # vocabulary, embedding width, lookups per rank, loss scale, steps


# ------------------------------------------------------------------------------ data and models
def batch(step: int, rank: int, world: int, kind: str) -> dict[str, Any]:
    """One rank's batch: ids (int64, (n,)), coefficients (float64, (n, D) or (n, 1)), and whether the
    rank skips the embedding (its gradient is then None). The last rank looks nothing up at step 1
    (a sparse gradient with 0 nnz); with a dense layer, rank 0 skips the embedding at step 2."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 0 if (step == 1 and rank == world - 1) else N
    ids = torch.randint(0, V, (n,), generator=g)
    width = 1 if kind in MIXED else D
    return {"ids": ids, "c": torch.randn(n, width, generator=g, dtype=torch.float64),
            "x": torch.randn(N, D, generator=g, dtype=torch.float64),
            "skip": kind in MIXED and step == 2 and rank == 0}


MIXED = ("sgd_mixed", "no_sync", "passes", "join")


def build(kind: str, sparse: bool = True) -> tuple[Any, Any, list[Any]]:
    """(embedding, linear or None, parameters) with the same initial values on every rank."""
    emb = torch.nn.Embedding(V, D, sparse=sparse).double()
    lin = torch.nn.Linear(D, 1).double() if kind in MIXED else None
    params = [*emb.parameters(), *(lin.parameters() if lin is not None else ())]
    g = torch.Generator().manual_seed(0)  # not torch's global generator: the simulated ranks are threads
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return emb, lin, params


def loss_of(emb: Any, lin: Any, b: dict[str, Any]) -> Any:
    if lin is None:
        return (emb(b["ids"]) * b["c"]).sum() / S
    y = lin(b["x"]) if b["skip"] else lin(emb(b["ids"]))
    c = torch.ones(len(b["x"]), 1, dtype=torch.float64) if b["skip"] else b["c"]
    return (y * c).sum() / S


def make_optimizer(kind: str, params: list[Any]) -> Any:
    if kind in ("sparse_adam", "dense_sparse_adam"):
        return torch.optim.SparseAdam(params, lr=0.1)
    if kind == "dense_adam":
        return torch.optim.Adam(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.1)


def steps_of(rank: int, world: int, kind: str) -> int:
    """Steps this rank trains: with ``join`` the last rank stops after 2."""
    return 2 if kind == "join" and rank == world - 1 else STEPS


# ------------------------------------------------------------------------------ the ranks' side
def case_train(rank: int, comm: Any, kind: str, overlap: bool = True) -> dict[str, Any]:
    """``kind``'s training on one rank: the final parameters and, per step, whether ``.grad`` of the
    embedding was sparse after backward (None: it had none)."""
    emb, lin, params = build(kind)
    world = comm.size
    opt = DistOpt(make_optimizer(kind, params), comm=comm, sparse_as_dense=kind.startswith("dense_"),
                  backward_passes_per_step=2 if kind == "passes" else 1, overlap=overlap)
    layouts = []
    with opt.join() if kind == "join" else _nothing():
        for s in range(steps_of(rank, world, kind)):
            opt.zero_grad()
            b = batch(s, rank, world, kind)
            if kind in ("no_sync", "passes"):  # two micro-batches: the halves of b
                half = [{k: (v if k == "skip" else v[:2]) for k, v in b.items()},
                        {k: (v if k == "skip" else v[2:]) for k, v in b.items()}]
                if kind == "no_sync":
                    with opt.no_sync():
                        loss_of(emb, lin, half[0]).backward()
                else:
                    loss_of(emb, lin, half[0]).backward()
                loss_of(emb, lin, half[1]).backward()
            else:
                loss_of(emb, lin, b).backward()
            grad = emb.weight.grad
            layouts.append(None if grad is None else grad.is_sparse)
            opt.step()
    out = {"params": [p.detach().clone() for p in params], "sparse": layouts,
           "control": opt.stats.control_collectives}
    _done(opt)
    return out


def _done(opt: Any) -> None:
    """Let go of the model and the reduction thread, not of the communicator (the next case uses it)."""
    opt.local.detach()
    opt.follower.release()
    opt.engine.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def case_mismatch(rank: int, comm: Any) -> str:
    """Rank 0's embedding is sparse, the others' dense: the first backward raises on every rank."""
    emb, _, params = build("sparse_adam", sparse=rank == 0)
    opt = DistOpt(torch.optim.SGD(params, lr=0.1), comm=comm)
    try:
        loss_of(emb, None, batch(0, rank, comm.size, "sparse_adam")).backward()
    except CollectiveMismatchError as exc:
        return f"CollectiveMismatchError: {exc}"
    finally:
        _done(opt)
    return "no error"


def case_every(rank: int, comm: Any) -> dict[str, Any]:
    """Every training kind and the mismatch, one after another on the same communicator."""
    return {**{kind: case_train(rank, comm, kind) for kind in KINDS}, "mismatch": case_mismatch(rank, comm)}


KINDS = ("sparse_adam", "sgd", "sgd_mixed", "dense_sparse_adam", "dense_adam", "no_sync", "passes", "join")


# ------------------------------------------------------------------------------ one process
def reference(kind: str, world: int) -> list[Any]:
    """One process over the concatenated batch: each step's loss is the sum of the ranks' losses over
    W (the active ranks' when some joined: DDP's division by the world size), from one lookup of the
    concatenated ids for the embedding-only kinds."""
    emb, lin, params = build(kind, sparse=kind != "dense_adam")
    opt = make_optimizer(kind, params)
    for s in range(STEPS):
        opt.zero_grad()
        active = [r for r in range(world) if s < steps_of(r, world, kind)]
        batches = [batch(s, r, world, kind) for r in active]
        if lin is None:
            ids = torch.cat([b["ids"] for b in batches])
            c = torch.cat([b["c"] for b in batches])
            ((emb(ids) * c).sum() / (S * world)).backward()
        else:
            (sum(loss_of(emb, lin, b) for b in batches) / world).backward()
        opt.step()
    return [p.detach().clone() for p in params]


def check_train(results: list[dict[str, Any]], kind: str, world: int) -> None:
    want = reference(kind, world)
    first = results[0]["params"]
    for out in results:
        assert all(torch.equal(a, b) for a, b in zip(out["params"], first)), f"{kind}: replicas differ"
    bitwise = world == 2 and kind == "sparse_adam"
    for got, ref in zip(first, want):
        if bitwise:
            assert torch.equal(got, ref), f"{kind}: not bitwise one process's: {(got - ref).abs().max()}"
        else:
            torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg=kind)
    # sparse after backward, also where a rank had no gradient of its own (it holds the average);
    # dense_sparse_adam: densified for the reduction, handed back sparse; dense_adam: dense
    # (None at a step where no active rank looked anything up: join at W = 2, step 2)
    for out in results:
        want = [None if kind == "join" and world == 2 and s == 2 else kind != "dense_adam"
                for s in range(len(out["sparse"]))]
        assert out["sparse"] == want, (kind, out["sparse"])


def check_mismatch(messages: list[str]) -> None:
    for msg in messages:
        assert msg.startswith("CollectiveMismatchError"), msg
        assert "sparse" in msg and "rank(s) [0]" in msg and "sparse_as_dense=True" in msg, msg


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.unit
def test_sparse_gradients_match_one_process(kind: str, world: int):
    """SparseAdam, sparse SGD (embedding alone, and with a dense Linear in the same optimizer),
    sparse_as_dense with SparseAdam (handed back sparse) and with Adam (dense), no_sync and
    backward_passes_per_step accumulation, join(); a rank with 0 nnz at step 1, a rank without the
    embedding's gradient at step 2 (the dense-layer kinds)."""
    check_train(run_case("sim", world, case_train, kind), kind, world)


@pytest.mark.parametrize("kind", ["sparse_adam", "sgd_mixed", "dense_sparse_adam", "no_sync", "join"])
@pytest.mark.unit
def test_sparse_gradients_without_overlap(kind: str):
    """overlap=False: the buckets start after backward, the sparse average is the same."""
    check_train(run_case("sim", 2, case_train, kind, False), kind, 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.unit
def test_16_and_32_bit_sparse_gradients(dtype: str):
    """The values travel as raw bytes: any dtype; W = 3, every row's count of lookups over 3, twice."""
    def rank_fn(rank: int, comm: Any) -> Any:
        emb = torch.nn.Embedding(6, 2, sparse=True).to(getattr(torch, dtype))
        torch.nn.init.ones_(emb.weight)
        opt = DistOpt(torch.optim.SGD(emb.parameters(), lr=0.5), comm=comm)
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([rank, 3, rank + 1])).sum().backward()
            opt.step()
        _done(opt)
        return emb.weight.detach().clone()

    results = run_case("sim", 3, rank_fn)
    assert all(torch.equal(r, results[0]) for r in results[1:]) and results[0].dtype == getattr(torch, dtype)
    counts = torch.tensor([1.0, 2.0, 2.0, 4.0, 0.0, 0.0])  # lookups per row per step, all ranks together
    want = (1 - 2 * 0.5 * counts / 3)[:, None].expand(6, 2)
    torch.testing.assert_close(results[0].float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_ranks_that_disagree_on_a_sparse_gradient_raise_on_every_rank(world: int):
    check_mismatch(run_case("sim", world, case_mismatch))


@pytest.mark.unit
def test_steady_state_costs_two_all_gathers_and_the_header():
    """After the first step (classification, then the dense layout without the embedding), a mixed
    model's step is the dense header plus the two sparse all-gathers; a dense-only model pays the
    classification once, on its first step."""
    def rank_fn(rank: int, comm: Any) -> list[list[str]]:
        emb, lin, params = build("sgd_mixed")
        opt = DistOpt(torch.optim.SGD(params, lr=0.1), comm=comm)
        calls = []
        for s in range(3):
            before = len(comm.calls)
            opt.zero_grad()
            b = batch(s, rank, comm.size, "sgd")
            b["skip"] = False
            (lin(emb(b["ids"])).sum()).backward()
            opt.step()
            calls.append([c for c, _ in comm.calls[before:]])
        return calls

    for calls in run_case("sim", 2, rank_fn):
        assert calls[0].count("all_gather") == 2  # the header and the classification
        assert sorted(calls[2]) == sorted(["all_gather", "all_gather_v", "all_gather_v", "all_reduce_async"]), calls


@pytest.mark.unit
def test_zero_and_bucket_views_densify_sparse_gradients():
    """zero=1|2 and gradient_as_bucket_view=True average sparse gradients densely (as sparse_as_dense); zero=2 drops
    each densified gradient once packed."""
    def rank_fn(rank: int, comm: Any, how: str) -> list[Any]:
        emb, lin, params = build("sgd_mixed")
        kwargs = {"zero": int(how[4:])} if how.startswith("zero") else {"gradient_as_bucket_view": how == "views"}
        opt = DistOpt(torch.optim.SGD(params, lr=0.1), comm=comm, **kwargs)
        for s in range(3):
            opt.zero_grad()
            b = batch(s, rank, comm.size, "sgd")
            b["skip"] = False
            lin(emb(b["ids"])).sum().backward()
            opt.step()
        return [p.detach().clone() for p in params]

    sparse = run_case("sim", 2, rank_fn, "sparse")[0]
    for how in ("zero1", "zero2", "views"):
        for got in run_case("sim", 2, rank_fn, how):
            for a, b in zip(got, sparse):
                torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.unit
def test_check_finite_skips_a_non_finite_sparse_average_on_every_rank():
    def rank_fn(rank: int, comm: Any) -> tuple[Any, Any]:
        emb, _, params = build("sgd")
        opt = DistOpt(torch.optim.SGD(params, lr=0.1), comm=comm, check_finite=True)
        before = emb.weight.detach().clone()
        scale = float("inf") if rank == 1 else 1.0
        (emb(torch.tensor([1, 2])).sum() * scale).backward()
        grad = emb.weight.grad
        opt.step()
        return torch.equal(emb.weight.detach(), before), grad, opt.stats.skipped_steps

    for unchanged, grad, skipped in run_case("sim", 2, rank_fn):
        assert unchanged and skipped == 1
        assert grad is not None and bool(torch.isnan(grad).all())  # the non-finite average GradScaler finds


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", ["mpi", "shm", "torch"])
@pytest.mark.world
def test_every_case_on(backend: str, world: int):
    """Every kind and the mismatch on real processes (one job per backend and W, under a timeout)."""
    results = run_case(backend, world, case_every, timeout=240)
    for kind in KINDS:
        check_train([r[kind] for r in results], kind, world)
    check_mismatch([r["mismatch"] for r in results])
