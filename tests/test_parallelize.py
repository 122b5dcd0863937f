"""Every layout's gradients equal the single-process gradient of the same global batch (gloo, real ranks).

The reference is the unparallelised model on the whole batch; each layout runs models.parallelize's
recipe, takes its data rank's share, backpropagates, reduces (comm.grad_sync) and is compared parameter by
parameter after gathering DTensor shards (TP, EP, FSDP) into full tensors. The aux loss and z-loss are on,
so global-batch balancing across data ranks and TP token slices is part of what is checked.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comm.grad_sync import global_grad_norm, sync_gradients
from comm.topology import Layout, LayoutError, Topology
from models.config import preset
from models.parallelize import parallelize
from models.transformer import build_model
from tests.dist_utils import run_ranks

B, S = 8, 16


def tiny_config(**over):
    cfg = preset("mixtral-tiny")
    cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim = 32, 2, 4, 2, 8
    cfg.ffn_hidden_size = cfg.moe_ffn_hidden_size = 24
    cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.vocab_size = 4, 2, None, 64
    cfg.aux_loss_coeff, cfg.z_loss_coeff = 0.05, 0.01
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _layout_rank(rank, world, degrees, config_over, ac, sp=False):
    layout = Layout(**degrees)
    topo = Topology(layout, rank, world).build()
    cfg = tiny_config(**config_over)
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(5))
    ref = build_model(cfg, seed=3)
    _loss(ref, tokens).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    model = build_model(cfg, seed=3)
    done = parallelize(model, topo, activation_checkpointing=ac, sequence_parallel=sp)
    D = layout.data_parallel
    share = tokens.view(D, B // D, S + 1)[topo.data_rank()]
    _loss(model, share).backward()
    sync_gradients(model, topo, fsdp=done.fsdp)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(global_grad_norm(list(model.parameters()), torch.device("cpu")), ref_norm,
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world,degrees,over,ac", [
    (2, dict(tp=2), {}, "none"),
    (2, dict(fsdp=2), {}, "full"),
    (4, dict(dp=2, tp=2, ep=2), {"shared_ffn_hidden_size": 16}, "ffn"),
    (4, dict(fsdp=2, tp=2, ep=2), {"first_dense_layers": 1}, "none"),
    (4, dict(dp=2, fsdp=2, ep=4), {}, "none"),
], ids=["tp2", "fsdp2-ac", "dp2-tp2-ep2-shared", "fsdp2-tp2-ep2-dense", "hsdp-dp2-fsdp2-ep4"])
def test_layout_gradients_equal_single_process(world, degrees, over, ac):
    run_ranks(_layout_rank, world, degrees, over, ac)


@pytest.mark.parametrize("world,degrees,over", [
    (2, dict(tp=2), {"first_dense_layers": 1, "router": "hash", "router_options": {}}),
    (4, dict(fsdp=2, tp=2, ep=2), {"shared_ffn_hidden_size": 16}),
], ids=["sp-tp2-dense-hash", "sp-fsdp2-tp2-ep2-shared"])
def test_sequence_parallel_gradients_equal_single_process(world, degrees, over):
    run_ranks(_layout_rank, world, degrees, over, "full", True)


def test_tp_must_divide_heads():
    from comm.tensor_parallel import check_tensor_parallel

    with pytest.raises(LayoutError, match="--tp 3 must divide num_heads=4, num_kv_heads=2"):
        check_tensor_parallel(tiny_config(), 3)


def test_token_split_sizes_cover_every_token():
    from comm.tensor_parallel import split_sizes

    for tokens in (0, 1, 7, 16):
        for parts in (1, 2, 3, 4):
            sizes = split_sizes(tokens, parts)
            assert sum(sizes) == tokens and max(sizes) - min(sizes) <= 1
            assert sizes == [len(c) for c in torch.arange(tokens).tensor_split(parts)]
