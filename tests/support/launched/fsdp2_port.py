"""pytorch/examples' ``distributed/FSDP2`` (model, training loop, checkpointers) ported to ``DistOpt(zero=3)``.

A copy of the example's shapes and calls, written here: its ``Transformer``
(10 layers, dim 16, 4 heads, vocabulary 1024, sequence 64, batch 32,
dropout 0), built on the meta device, ``to_empty`` + ``reset_parameters``
(or its checkpoint loaded), Adam (lr 1e-2), ``model(x).sum()``, clipping
to 1.0, 10 steps, then its checkpointer's ``save``. What changed for
distopt: ``fully_shard(layer)`` / ``fully_shard(model)`` became
``optim = distopt.DistOpt(optim, zero=3, model=model)`` after the optimizer
is built, and ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
became ``optim.clip_grad_norm_(1.0)``. ``--plain`` runs the example without
either (one process: the reference).

Checkpointers (``--api``): ``dcp_api`` is the example's own (full state
dicts through ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``
with ``broadcast_from_rank0``, written by rank 0 with ``torch.save``);
``dcp`` saves and loads sharded through ``dcp.save``/``dcp.load`` of
``get_state_dict``. The example's third route (``dtensor_api``) calls DTensor
methods (``full_tensor``, ``distribute_tensor``) that need DTensor
parameters, which distopt does not make.

Unlike the example, ``Transformer.reset_parameters`` also resets its layers
(the example's leaves them as ``to_empty`` left them: uninitialised memory,
so its runs differ from each other).

``--mixed-precision`` is the example's option of that name: its
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
became ``DistOpt(..., param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
``--fsdp2`` runs the example on torch's own ``fully_shard`` instead (the
model built on the meta device and initialized before the wrap, so that both
start from the same weights; no checkpoint is loaded or saved), the
reference of ``--mixed-precision``; ``--steps`` sets the number of steps.

Writes ``--out`` (rank 0): every parameter after the last step and the
losses, for the test to compare (``--fsdp2``: the losses only).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)

import distopt


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim, self.n_heads, self.dropout_p = args.dim // args.n_heads, args.n_heads, args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q, k, v = (t.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in (self.wq(x), self.wk(x), self.wv(x)))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0)
        return self.resid_dropout(self.wo(out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)))

    def reset_parameters(self) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            lin.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1, self.gelu, self.w2 = nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))

    def reset_parameters(self) -> None:
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(args.dim), Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self) -> None:
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(0, seq_len, device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self) -> None:
        for m in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            m.reset_parameters()


class Checkpointer:
    """The example's checkpointer (``dcp_api``), and a sharded DCP one (``dcp``), in ``folder/<api>``."""

    def __init__(self, folder: str, api: str) -> None:
        self.folder, self.api = os.path.join(folder, api), api
        self.last = self.folder if os.path.isdir(self.folder) else None

    def is_empty(self) -> bool:
        return self.last is None

    def load_model(self, model) -> None:
        full_sd = torch.load(f"{self.folder}/model_state_dict.pt", mmap=True, weights_only=True, map_location="cpu")
        set_model_state_dict(model=model, model_state_dict=full_sd,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_optim(self, model, opt) -> None:
        if self.api == "dcp":
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=self.folder)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            return
        full_sd = torch.load(f"{self.folder}/optim_state_dict.pt", mmap=True, weights_only=True, map_location="cpu")
        set_optimizer_state_dict(model=model, optimizers=opt, optim_state_dict=full_sd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def save(self, model, optim, out: str) -> None:
        if self.api == "dcp":
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
            return
        model_sd = get_model_state_dict(model=model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        optim_sd = get_optimizer_state_dict(model=model, optimizers=optim,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            torch.save(model_sd, f"{out}/model_state_dict.pt")
            torch.save(optim_sd, f"{out}/optim_state_dict.pt")


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    vocab_size, batch_size, seq_len = 1024, 32, 64
    model_args = ModelArgs(n_layers=10, n_heads=4, vocab_size=vocab_size, max_seq_len=seq_len, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    checkpointer = Checkpointer(args.folder, args.api)
    if checkpointer.is_empty() or args.api == "dcp":
        model.to_empty(device=device)
        model.reset_parameters()
    else:
        checkpointer.load_model(model)
    mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision else {}
    if args.fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(**mixed)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if not (args.plain or args.fsdp2):  # was: fully_shard(layer) per layer, fully_shard(model), with mp_policy
        optim = distopt.DistOpt(optim, zero=3, model=model, **mixed)
    if not checkpointer.is_empty():
        checkpointer.load_optim(model, optim)
    losses = []
    for _ in range(args.steps):
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        if args.plain or args.fsdp2:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        else:
            optim.clip_grad_norm_(1.0)  # was: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
    if args.fsdp2:
        if dist.get_rank() == 0:
            torch.save({"params": {}, "losses": losses}, args.out)
        dist.destroy_process_group()
        return
    checkpointer.save(model, optim, os.path.join(args.save_to, args.api))
    params = {k: v.clone() for k, v in model.state_dict().items()}  # whole tensors (collective at zero=3)
    if dist.get_rank() == 0:
        torch.save({"params": params, "losses": losses}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="pytorch/examples FSDP2, on distopt zero=3")
    parser.add_argument("--folder", required=True, help="load the latest checkpoint from here, if any")
    parser.add_argument("--save-to", required=True, help="write this run's checkpoint here")
    parser.add_argument("--api", choices=("dcp_api", "dcp"), default="dcp_api")
    parser.add_argument("--plain", action="store_true", help="no distopt: the one-process reference")
    parser.add_argument("--mixed-precision", action="store_true", help="bfloat16 parameters, float32 reduction")
    parser.add_argument("--fsdp2", action="store_true", help="torch's fully_shard instead of distopt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    main(parser.parse_args())
