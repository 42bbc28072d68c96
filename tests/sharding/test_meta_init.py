"""``DistOpt(zero=3)`` over a model built on the meta device, against the same model built on the CPU: bitwise.

The CPU reference is built once in the test's process from a seed and copied to every rank; each rank seeds and builds
the meta model itself (in the simulated world, threads of one process share torch's global generator, which the
materialization saves and restores around each module's initialization). Compared: the whole parameters right after
construction, the buffers, the global RNG state DistOpt leaves, and the parameters after 5 AdamW steps; in the
simulated world at W = 2 and 3, on MPI, shared memory and torch.distributed at W = 2.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest

import distopt
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional


VOCAB, WIDTH, CONTEXT, SEED = 37, 16, 8, 11


class Attention(nn.Module):
    """Causal self-attention over a ``qkv`` and a ``proj`` projection; the mask is a buffer it owns."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.empty(CONTEXT, CONTEXT, dtype=torch.bool), persistent=False)
        self.reset_parameters()  # its own tensors first (no RNG), then its children's
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def reset_parameters(self) -> None:
        self.mask.copy_(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril())

    def forward(self, x: Any) -> Any:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, 2, WIDTH // 2).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def reset_parameters(self) -> None:  # re-initializes its children: owning no tensor, it is never called
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def forward(self, x: Any) -> Any:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A position parameter of its own, token embeddings, two blocks, a final LayerNorm, a head tied to the
    token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.empty(CONTEXT, WIDTH))
        self.reset_parameters()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: Any) -> Any:
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _full(model: Any, opt: Any) -> list[Any]:
    with opt.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


def case_gpt(rank: int, comm: Any, reference: Any, steps: int) -> dict[str, Any]:
    """The GPT copied from ``reference``, or built on the meta device after seeding with :data:`SEED` when it is
    None, at ``zero=3`` with AdamW: its parameters after construction and after ``steps`` steps, its buffers, the
    RNG state DistOpt left."""
    torch.set_num_threads(1)
    if reference is None:
        torch.manual_seed(SEED)  # every rank (threads of the simulated world: the same state, before any draws)
        with torch.device("meta"):
            model = GPT()
    else:
        model = copy.deepcopy(reference)
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = distopt.DistOpt(adamw, comm=comm, zero=3, buffSize=600, model=model)
    rng = torch.get_rng_state().clone()
    built = _full(model, opt)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    for s in range(steps):
        tokens = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    return {"built": built, "trained": _full(model, opt), "buffers": buffers, "rng": rng,
            "tied": model.head.weight is model.tok.weight, "adamw": adamw.param_groups[0]["params"][0] is model.pos,
            "held": int(opt.stats["parameter_bytes"])}


def _compare(backend: str, world: int, steps: int) -> None:
    """The meta-built GPT against the CPU-built one on ``backend``: bitwise after construction and ``steps``."""
    torch.manual_seed(SEED)
    reference = GPT()
    rng_after_build = torch.get_rng_state()
    cpu = run_case(backend, world, case_gpt, reference, steps)
    meta = run_case(backend, world, case_gpt, None, steps)
    whole = [p.detach() for p in reference.parameters()]
    for rank, (c, m) in enumerate(zip(cpu, meta)):
        assert m["tied"] and m["adamw"], f"rank {rank}: the model's and the optimizer's parameters were replaced"
        assert torch.equal(m["rng"], rng_after_build), f"rank {rank}: the RNG is not where building on CPU left it"
        assert len(m["built"]) == len(whole) == len(c["trained"])
        for i, (ref, got) in enumerate(zip(whole, m["built"])):
            assert torch.equal(ref, got), f"rank {rank} parameter {i} after construction"
        for i, (ref, got) in enumerate(zip(c["trained"], m["trained"])):
            assert torch.equal(ref, got), f"rank {rank} parameter {i} after {steps} AdamW steps"
        assert c["buffers"].keys() == m["buffers"].keys()
        assert all(torch.equal(c["buffers"][n], m["buffers"][n]) for n in c["buffers"])
        assert m["held"] == c["held"]  # the same segments held at rest
    assert any(not torch.equal(a, b) for a, b in zip(whole, meta[0]["trained"]))  # it trained


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_meta_built_gpt_equals_cpu_built_after_construction_and_five_adamw_steps(world):
    _compare("sim", world, 5)


@pytest.mark.parametrize("backend", tiered(["mpi", "shm", "torch"]))
def test_meta_built_gpt_equals_cpu_built_on_real_backends(backend):
    _compare(backend, 2, 5)


class Scaled(nn.Module):
    """A parameter of its own and no ``reset_parameters()``; its constructor draws it from the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 5))
        nn.init.normal_(self.w)

    def forward(self, x: Any) -> Any:
        return x * self.w.sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(5, 5), Scaled()])
        self.out = nn.Linear(5, 2)

    def forward(self, x: Any) -> Any:
        return self.out(self.body[1](self.body[0](x)))


def _init(module: Any) -> None:
    """The ``init=`` escape: Scaled's initialization, every other module's ``reset_parameters()``."""
    if isinstance(module, Scaled):
        nn.init.normal_(module.w)
    else:
        module.reset_parameters()


def case_net(rank: int, comm: Any, init: Any, zero: int = 3, build: Any = Net) -> Any:
    """``build()`` on the meta device at ``zero``: its whole parameters, or the error's type and message."""
    with torch.device("meta"):
        model = build()
    try:
        opt = distopt.DistOpt(torch.optim.AdamW(model.parameters()), comm=comm, zero=zero, buffSize=16,
                              model=model, init=init)
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return _full(model, opt)


@pytest.mark.unit
def test_a_module_without_reset_parameters_is_named_with_the_escape():
    for kind, message in run_case("sim", 2, case_net, None):  # every rank raises
        assert kind == "ValueError"
        assert "'body.1'" in message and "Scaled" in message and "reset_parameters()" in message
        assert "init=" in message and "['w']" in message


class FrozenNet(Net):
    """:class:`Net` with its first layer's weight frozen (outside the sharded layout: kept whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.body[0].weight.requires_grad_(False)


@pytest.mark.parametrize("build", [Net, FrozenNet])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_init_escape_initializes_the_module_as_its_constructor_did(world, build):
    torch.manual_seed(SEED)
    whole = [p.detach() for p in build().parameters()]
    torch.manual_seed(SEED)
    for rank, got in enumerate(run_case("sim", world, case_net, _init, 3, build)):
        assert len(got) == len(whole)
        assert all(torch.equal(a, b) for a, b in zip(whole, got)), f"rank {rank}"


class Replaces(nn.Module):
    """Its ``reset_parameters()`` assigns a new ``Parameter`` instead of writing the one the optimizer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        self.w = nn.Parameter(torch.zeros(4))


@pytest.mark.unit
def test_an_initialization_that_replaces_a_parameter_is_named():
    for kind, message in run_case("sim", 2, case_net, None, 3, Replaces):
        assert kind == "RuntimeError"
        assert "'w'" in message and "in place" in message


class LeavesMeta(nn.Module):
    """Its ``reset_parameters()`` replaces its buffer by another meta tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def reset_parameters(self) -> None:
        self.scale = torch.ones(4, device="meta")


@pytest.mark.unit
def test_a_meta_tensor_left_after_initialization_is_named():
    for kind, message in run_case("sim", 2, case_net, None, 3, LeavesMeta):
        assert kind == "RuntimeError"
        assert "['scale']" in message and "meta device" in message and "'the model'" in message


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.unit
def test_a_meta_built_model_below_zero3_is_refused(zero):
    for kind, message in run_case("sim", 2, case_net, None, zero):
        assert kind == "ValueError"
        assert "meta device" in message and f"zero={zero}" in message and "zero=3" in message
