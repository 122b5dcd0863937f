"""moekit's single-device MoE math: routers, dispatch, grouped experts, the MoE layer.

Nothing here imports torch.distributed; comm/ plugs distributed strategies (expert-parallel
dispatchers, global load-balance reducers) into these modules.
"""
from torch import nn

from moekit.moe.dispatch import Dispatched, Dispatcher, LocalDispatcher
from moekit.moe.experts import GroupedExperts, available_backends, register_backend
from moekit.moe.layer import DenseMLP, MoELayer
from moekit.moe.load import ExpertLoad, LoadSummary, collect_load, moe_layers
from moekit.moe.router import Router, Routing, build_router, register_router, registered_routers


def update_router_biases(model: nn.Module) -> None:
    """``Router.apply_bias_update()`` in every router of ``model`` (aux-loss-free balancing); call once per
    optimizer step, after ``optimizer.step()``."""
    for module in model.modules():
        if isinstance(module, Router):
            module.apply_bias_update()


__all__ = [
    "Dispatched", "Dispatcher", "LocalDispatcher", "GroupedExperts", "available_backends", "register_backend",
    "DenseMLP", "MoELayer", "ExpertLoad", "LoadSummary", "collect_load", "moe_layers",
    "Router", "Routing", "build_router", "register_router", "registered_routers", "update_router_biases",
]
