"""No host synchronisation in the router or the local dispatch / combine (issue 9), checked on CPU.

A CUDA host sync comes from an op that must read device memory on the host: ``.item()`` / ``int()`` /
``bool()`` (aten._local_scalar_dense), ``.tolist()``, and ops whose output size depends on the data
(nonzero, unique, masked_select, boolean indexing, repeat_interleave without ``output_size``). A
TorchDispatchMode sees every aten op on CPU too, so the check runs in CI; ``.tolist()`` bypasses the
dispatcher, so it is trapped separately. On a GPU, tools/bench/moe_layer.py confirms it with
torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit.moe import MoELayer
from moekit.moe.dispatch import LocalDispatcher
from moekit.moe.router import build_router

DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.unique.default",
                  "aten._unique2.default", "aten.unique_consecutive.default", "aten.masked_select.default"}


class HostSyncs(TorchDispatchMode):
    """Records every aten op that would make a CUDA host wait for the device."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in DATA_DEPENDENT:
            self.found.append(name)
        elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None and \
                isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and len(args) < 3:
            self.found.append(name + " without output_size")
        elif name.startswith("aten.index.Tensor") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None):
            self.found.append("boolean indexing")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_syncs():
    mode, tolist = HostSyncs(), torch.Tensor.tolist

    def trapped(self):
        mode.found.append("tolist")
        return tolist(self)

    torch.Tensor.tolist = trapped
    try:
        with mode:
            yield mode.found
    finally:
        torch.Tensor.tolist = tolist


def test_the_detector_sees_every_kind_of_sync():
    x = torch.randn(6)
    with host_syncs() as found:
        x.sum().item(), x.tolist(), x[x > 0], torch.nonzero(x), bool(x.any())
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert found == ["aten._local_scalar_dense.default", "tolist", "boolean indexing", "aten.nonzero.default",
                     "aten._local_scalar_dense.default", "aten.repeat_interleave.Tensor without output_size"]


H, E, T = 16, 8, 48
ROUTERS = {
    "topk-dropless": ("topk", dict(top_k=2)),
    "topk-capacity": ("topk", dict(top_k=2, capacity_factor=1.0, z_loss_coeff=1e-3)),
    "topk-position-drop": ("topk", dict(top_k=2, capacity_factor=0.5, drop_policy="position")),
    "deepseek-group-bias": ("topk", dict(top_k=4, score="sigmoid", num_groups=4, group_top_k=2,
                                         expert_bias=torch.zeros(E), bias_update_rate=0.01)),
    "switch-jitter": ("switch", dict(capacity_factor=1.25, jitter=0.01)),
    "expert_choice": ("expert_choice", dict(capacity_factor=1.0)),
    "sinkhorn": ("sinkhorn", dict(top_k=2)),
    "hash": ("hash", dict(top_k=1)),
}


@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_router_forward_and_backward_never_sync(case):
    name, options = ROUTERS[case]
    router = build_router(name, H, E, **options).train()
    x = torch.randn(T, H, requires_grad=True)
    with host_syncs() as found:
        routing = router(x, torch.randint(0, 1000, (T,))) if name == "hash" else router(x)
        loss = (routing.weights.float() * torch.arange(1.0, routing.weights.shape[1] + 1)).sum() + routing.aux_loss
        if loss.requires_grad:
            loss.backward()
    assert found == [], f"{case}: {found}"
    assert routing.indices.shape[0] == T  # it routed


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_local_dispatch_and_combine_never_sync(capacity):
    """The permutation sizes come from the routing's shape, not its values (DESIGN: no host sync)."""
    layer = MoELayer(H, 24, E, build_router("topk", H, E, top_k=2, capacity_factor=capacity))
    assert isinstance(layer.dispatcher, LocalDispatcher)
    x = torch.randn(T, H, requires_grad=True)
    routing = layer.router(x)
    with host_syncs() as found:
        d = layer.dispatcher.dispatch(x, routing)
        rows = d.rows * 2.0  # stands in for the experts (the CPU loop backend syncs on purpose: split sizes)
        y = layer.dispatcher.combine(rows, d.meta)
        y.square().sum().backward()
    assert found == [], found


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "qwen3.5-tiny", "gpt-oss-tiny"])
def test_a_whole_training_micro_batch_never_syncs(name):
    """The model's forward with targets (the chunked loss) and its backward, with the torch grouped-GEMM experts (the
    GPU's data flow: the per-expert loop syncs by design, .tolist of its counts): no host sync, so on a GPU the host
    can queue a whole micro-batch ahead (the trainer syncs once a step, for the loss and the gradient norm)."""
    import dataclasses

    from moekit.models.config import preset
    from moekit.models.transformer import build_model

    cfg = dataclasses.replace(preset(name), expert_backend="torch", num_layers=2)
    if cfg.linear_attention != "none":
        cfg.full_attention_every = 2  # one Gated DeltaNet layer, one attention layer
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (2, 32), generator=gen) for _ in range(2))
    model(x, targets=y).backward()  # first calls may build caches
    with host_syncs() as found:
        model(x, targets=y).backward()
    assert found == [], found
