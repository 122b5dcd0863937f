"""Tensor parallelism over the TP group: DTensor sharding of attention and dense MLPs, MoE token split.

    Attention   wq wk wv  column-wise: each rank computes N/tp query and K/tp key/value heads
                wo        row-wise: partial [B, S, H] outputs all-reduced into a replicated one
    Dense MLP   w_gate w_up column-wise (matching gate / up columns), w_out row-wise
    MoE layer   the TP ranks hold the same tokens (replicated activations), so routing them on every rank
                would compute each token tp times. Instead each rank takes a contiguous 1/tp slice of the
                tokens, routes and computes it (with its own EP group: EP groups are per TP position),
                and the slices are all-gathered back (Megatron's token de-duplication):

                    x [T, H] (same on all TP ranks) --slice--> [T/tp, H] --MoE--> [T/tp, H] --all-gather--> [T, H]

                backward: the gathered output's gradient is replicated, so each rank keeps its slice's rows;
                the slice's input gradient is all-gathered (every rank's x contributed only its slice).
    Replicated: embedding, norms, lm_head, the router, experts and shared expert (token split instead).

Gradients: DTensor reduces what the sharded linears need. The MoE layer's parameters saw only this rank's
token slice, so their gradients are partial sums over the TP group; comm.grad_sync adds them up. Each
rank's aux loss covers its slice, so its gradient scale is divided by tp (the mean over slices).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from comm.topology import LayoutError
from moe.load import moe_layers


def check_tensor_parallel(config, tp: int) -> None:
    """Head and width divisibility, before anything is sharded (``config``: a models.config.ModelConfig)."""
    if tp == 1:
        return
    bad = {name: getattr(config, name) for name in ("num_heads", "num_kv_heads") if getattr(config, name) % tp}
    if config.num_layers > config.num_moe_layers and config.ffn_hidden_size % tp:
        bad["ffn_hidden_size"] = config.ffn_hidden_size
    if bad:
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise LayoutError(f"--tp {tp} must divide {values}: tensor parallelism shards attention heads and the "
                          f"dense MLP width; choose tp dividing all of them")


def apply_tensor_parallel(model: nn.Module, topology) -> None:
    """Shard every block of ``model.layers`` over the TP mesh and split MoE tokens over the TP group."""
    tp = topology.layout.tp
    if tp == 1:
        return
    mesh = topology.mesh("world")["tp"]
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        plan = {f"attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan["attn.wo"] = RowwiseParallel()
        if not block.is_moe:
            plan.update({"ffn.w_up": ColwiseParallel(), "ffn.w_out": RowwiseParallel()})
            if block.ffn.w_gate is not None:
                plan["ffn.w_gate"] = ColwiseParallel()
        parallelize_module(block, mesh, plan)
    group = topology.group("tp")
    rank = topology.members("tp").index(topology.rank)
    for _, layer in moe_layers(model):
        split_moe_tokens(layer, group, rank, tp)


def split_sizes(tokens: int, parts: int) -> list[int]:
    """Contiguous near-equal slices (torch.tensor_split's sizes): any token count works, e.g. 7 over 2 = [4, 3]."""
    return [tokens // parts + (i < tokens % parts) for i in range(parts)]


def _all_gather_rows(x: Tensor, sizes: list[int], group) -> Tensor:
    """Concatenate every rank's rows ([sizes[r], H] on rank r) in rank order; pads to the largest slice."""
    most = max(sizes)
    padded = x.new_zeros((most,) + x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _SliceTokens(torch.autograd.Function):
    """Replicated x [T, H] -> this rank's rows; backward all-gathers every rank's slice gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, start: int, sizes: list[int], rank: int, group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return x[start : start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None, None, None


class _GatherTokens(torch.autograd.Function):
    """This rank's output rows -> the replicated [T, H]; backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, y: Tensor, start: int, sizes: list[int], group) -> Tensor:
        ctx.start, ctx.n = start, y.shape[0]
        return _all_gather_rows(y, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.start : ctx.start + ctx.n].contiguous(), None, None, None


def split_moe_tokens(layer: nn.Module, group, rank: int, tp: int) -> None:
    """Wrap ``layer.forward`` (state-dict keys unchanged) so each TP rank routes 1/tp of the tokens."""
    inner = layer.forward
    layer.aux_loss_scale = layer.aux_loss_scale / tp  # mean over the tp slices' aux losses

    def forward(x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        sizes = split_sizes(flat.shape[0], tp)
        start = sum(sizes[:rank])
        mine = _SliceTokens.apply(flat, start, sizes, rank, group)  # [T/tp, H]
        ids = None if token_ids is None else token_ids.reshape(-1)[start : start + sizes[rank]]
        y = inner(mine, token_ids=ids)  # [T/tp, H]
        return _GatherTokens.apply(y, start, sizes, group).view(shape)  # [T, H] on every TP rank

    layer.forward = forward
