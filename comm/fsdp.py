"""Fully-sharded data parallelism (FSDP2 ``fully_shard``) for dense and expert parameters.

    dense parameters   sharded over the fsdp ranks of the "world" mesh; with dp > 1 as well, replicated
                       over dp and sharded over fsdp (HSDP: fully_shard on the 2-D (dp, fsdp) mesh)
    experts            sharded over the ranks that hold the same experts (the "edp" dim of the "experts"
                       mesh, D / ep ranks). Under EP they are already DTensors Shard(0) over "ep", so FSDP
                       shards dim 1 (hidden / ffn width): the two shardings are on different dims and
                       compose without strided layouts, also when E / ep < D / ep.

Units: each MoE layer's experts, then each transformer block (the rest of its parameters), then the root
(embedding, final norm, head). Every gradient must end up divided by D = dp * fsdp, the number of data
ranks whose mean loss it sums. FSDP divides by its mesh size: D for dense parameters, D / ep for experts,
so comm.grad_sync scales expert gradients by 1 / ep afterwards (``set_gradient_divide_factor`` would do it
inside the reduction, but gloo has no PREMUL_SUM for the HSDP all-reduce it then needs).
Mixed precision: parameters computed in ``param_dtype`` (bf16 on GPU), gradients reduced in fp32.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moekit.moe.load import moe_layers


def _blocks(model: nn.Module):
    return model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers


def apply_fsdp(model: nn.Module, topology, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> None:
    L = topology.layout
    world, experts = topology.mesh("world"), topology.mesh("experts")
    dense_mesh = world["dp", "fsdp"] if L.dp > 1 else world["fsdp"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for _, layer in moe_layers(model):
        fully_shard(layer.experts, mesh=experts["edp"], mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda p: Shard(1))
    for block in _blocks(model):
        fully_shard(block, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # the roots: the model, or under pipeline parallelism each stage module this rank runs (only their
    # forwards run, so FSDP's root hooks must sit on them, not on the container holding every stage)
    for root in getattr(model, "stages", (model,)):
        fully_shard(root, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
