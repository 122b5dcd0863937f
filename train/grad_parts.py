"""The gradient norm by part of the model (metrics.jsonl ``grad_norm_by_part``): which part a step's gradient norm
comes from. In a MoE run the router's gradient is the usual first sign of trouble (its logits grow, tokens pile onto
a few experts), and a spike in the global norm is far easier to act on once it is known whether the experts, the
router, attention or the embedding made it.

Parts, by parameter name (``part_of``; the first rule that matches):

    mtp             everything of the multi-token-prediction depths (models.mtp)
    embedding       the token embedding and the output head
    norms           every norm's scale (the blocks', attention's q / k norms, the final norm)
    router          the MoE layers' routers (weights and biases)
    experts         the routed experts' stacked weights (and biases)
    shared_experts  the shared experts (and their gate)
    attention       the rest of attention (projections, sinks, linear attention's parameters)
    mlp             the dense layers' MLPs
    other           anything else

Each parameter carries its part's index (``tag``: ``p.grad_part``), and comm.grad_sync.global_grad_norm adds each
shard's sum of squares into its part beside the total, in the same collectives (a vector instead of a scalar), so
the parts cost no extra communication; the parts' squares add up to the global norm's.
"""
from __future__ import annotations

import re

from torch import nn

PARTS = ("embedding", "attention", "norms", "router", "experts", "shared_experts", "mlp", "mtp", "other")
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.)")


def part_of(name: str) -> str:
    n = _WRAPPERS.sub("", name)
    if re.search(r"(^|\.)mtp\.", n):
        return "mtp"
    if re.search(r"(^|\.)(embed|lm_head)\.", n):
        return "embedding"
    module = n.rsplit(".", 2)[-2] if n.count(".") else n
    if "norm" in module:
        return "norms"
    if ".router." in n:
        return "router"
    if ".experts." in n:
        return "experts"
    if ".shared_expert." in n:
        return "shared_experts"
    if ".attn." in n:
        return "attention"
    if ".ffn." in n:
        return "mlp"
    return "other"


def tag(model: nn.Module) -> None:
    """Mark every parameter with its part's index (again after anything that makes new Parameters: to_empty)."""
    for name, p in model.named_parameters():
        p.grad_part = PARTS.index(part_of(name))


def present(model: nn.Module) -> list[str]:
    """The parts ``model`` has parameters in, in PARTS order (the whole model's, before a pipeline splits it)."""
    found = {part_of(name) for name, _ in model.named_parameters()}
    return [p for p in PARTS if p in found]
