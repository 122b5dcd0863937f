"""The ordered recipe that turns a built single-device model into its share of a parallel layout.

    1. tensor parallel        (issue 7: DTensor parallelize_module on attention / dense MLP)
    2. expert parallel        shard experts over the EP group, EP dispatchers, global-batch balancing
    3. activation checkpoint  apply_activation_checkpointing: whole blocks or only their FFN / MoE part
    4. torch.compile          (issue 7)
    5. FSDP                   (issue 7: fully_shard on blocks and root)

The model code itself never changes: every step swaps a strategy object or a parameter (DESIGN.md).
Weights are initialised in full from the seed before this runs, so every layout starts from the
same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from comm.all_to_all import Traffic
from comm.expert_parallel import apply_expert_parallel
from comm.topology import LayoutError, Topology


@dataclass
class Parallelized:
    topology: Topology
    traffic: Traffic  # all-to-all bytes per link class, for the training log


def parallelize(model: nn.Module, topology: Topology, *, hierarchical: bool | None = None) -> Parallelized:
    """Apply the layout to ``model`` in place. ``hierarchical=None`` picks two-level dispatch when the
    EP group spans several nodes."""
    L = topology.layout
    unsupported = {name: getattr(L, name) for name in ("tp", "pp", "fsdp") if getattr(L, name) > 1}
    if unsupported:
        flags = " ".join(f"--{k} {v}" for k, v in unsupported.items())
        raise LayoutError(f"{flags}: tensor, pipeline and fully-sharded parallelism are not available yet; "
                          f"use --dp and --ep (expert parallelism folds inside the data-parallel ranks)")
    # 2. expert parallelism (also installs the global-batch count reducer when ep == 1 and dp > 1)
    if hierarchical is None:
        ep_nodes = {topology.node_of(r) for r in topology.members("ep")}
        hierarchical = len(ep_nodes) > 1
    traffic = apply_expert_parallel(model, topology, hierarchical=hierarchical)
    return Parallelized(topology, traffic)


AC_MODES = ("none", "full", "ffn")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute activations in backward instead of keeping them.

    full: every transformer block keeps only its input.
    ffn:  selective, only the FFN / MoE sublayer is recomputed: its expert hidden states (N x 2F per
          layer, N = tokens x k) are the largest activations of an MoE block, while attention keeps its
          own (SDPA's backward needs them anyway).
    The forward is wrapped in place (state-dict keys unchanged). Recomputation replays the same routing
    (RNG state is restored, so router jitter repeats), and expert-load records skip recomputed forwards.
    Under expert parallelism the recomputed all-to-alls run in backward on every rank in the same order.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; use one of {list(AC_MODES)}")
    if mode == "none":
        return
    for block in model.layers:
        _checkpoint_forward(block if mode == "full" else block.ffn)


def _checkpoint_forward(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        if not (torch.is_grad_enabled() and module.training):  # eval / no_grad: nothing to save anyway
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
