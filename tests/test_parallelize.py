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

from moekit.comm.grad_sync import global_grad_norm, sync_gradients
from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.models.config import preset
from moekit.models.parallelize import parallelize
from moekit.models.transformer import build_model
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


def _check_layout(rank, world, degrees, config_over, ac, sp):
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
    where = f"{degrees} {config_over} ac={ac} sp={sp}"
    for block in model.layers:  # a Gated DeltaNet under TP computes its share of the heads (not all of them)
        attn = block.attn
        if hasattr(attn, "tp_partial") and layout.tp > 1:
            assert attn.tp[1] == layout.tp and attn.heads() == (attn.nk // layout.tp, attn.nv // layout.tp), where
            mesh = getattr(attn.wz.weight, "device_mesh", None)  # wz sharded over the TP mesh dim (and FSDP's)
            assert mesh is not None and "tp" in (mesh.mesh_dim_names or ()), where
    _check_roles(done.grad_roles, model, sp and layout.tp > 1, where, tp=layout.tp > 1)
    sync_gradients(model, topo, done.grad_roles, fsdp=done.fsdp)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), want[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{where}: {name}: {m}")
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(global_grad_norm(list(model.parameters()), torch.device("cpu")), ref_norm,
                               rtol=1e-5, atol=1e-7, msg=lambda m: f"{where}: grad norm: {m}")


# under TP, the replicated parameters each rank reads its heads' part of: per-head q / k norms, and the Gated
# DeltaNet's fused projection, convolution, decay terms and gated norm
TP_PARTIAL = (".attn.q_norm.", ".attn.k_norm.", ".attn.wqkv.", ".attn.conv_weight", ".attn.dt_bias", ".attn.A_log",
              ".attn.norm.")


def _check_roles(roles, model, sequence_parallel, where, tp=False):
    """Every parameter has the role of what it saw: experts, the rest of an MoE layer, sequence-parallel
    norms (a slice of the tokens), a TP rank's heads of a replicated parameter, or dense."""
    assert list(roles) == [name for name, _ in model.named_parameters()], where
    for name, role in roles.items():
        if ".experts." in name:
            want = "expert"
        elif ".ffn." in name and ("router" in name or "shared_expert" in name):
            want = "moe"
        elif sequence_parallel and ("attn_norm" in name or "ffn_norm" in name):
            want = "moe"
        elif tp and any(part in name for part in TP_PARTIAL):
            want = "moe"
        else:
            want = "dense"
        assert role == want, f"{where}: {name} has role {role}, expected {want}"


def test_recipe_returns_gradient_roles_in_one_process():
    model = build_model(tiny_config(first_dense_layers=1, shared_ffn_hidden_size=16), seed=3)
    roles = parallelize(model, None, activation_checkpointing="full").grad_roles
    _check_roles(roles, model, False, "one process")
    assert roles["layers.1.ffn.router.weight"] == "moe" and roles["layers.1.ffn.experts.w_in"] == "expert"
    assert roles["layers.0.ffn.w_up.weight"] == "dense"  # the dense first layer


def _layouts_rank(rank, world, cases):
    for case in cases:  # one spawn checks several layouts (process start-up dominates on 2 cores)
        _check_layout(rank, world, *case)


# Qwen3.5's layer types at test size: a Gated DeltaNet layer (two chunks of S = 16) and a gated GQA layer, zero-centered
# norms, a gated shared expert
QWEN3_5 = {"linear_attention": "gated_deltanet", "full_attention_every": 2, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 4, "linear_chunk": 8,
           "attention_output_gate": True, "norm_zero_centered": True, "qk_norm": "head", "partial_rotary_factor": 0.5,
           "shared_ffn_hidden_size": 16, "shared_expert_gate": True}
# (degrees, model config overrides, activation checkpointing, sequence parallel)
TWO_RANKS = [
    (dict(fsdp=2, ep=2), QWEN3_5, "selective", False),
    (dict(tp=2), {}, "none", False),
    (dict(fsdp=2), {}, "full", False),
    (dict(tp=2), {"first_dense_layers": 1, "router": "hash", "router_options": {}}, "full", True),
    (dict(tp=2), QWEN3_5, "none", False),  # Gated DeltaNet's heads over TP (comm.tensor_parallel)
]
FOUR_RANKS = [
    (dict(dp=2, tp=2, ep=2), {"shared_ffn_hidden_size": 16}, "ffn", False),
    (dict(fsdp=2, tp=2, ep=2), {"first_dense_layers": 1}, "none", False),
    (dict(dp=2, fsdp=2, ep=4), {}, "none", False),
    (dict(fsdp=2, tp=2, ep=2), {"shared_ffn_hidden_size": 16}, "full", True),
    (dict(fsdp=2, tp=2, ep=2), QWEN3_5, "selective", True),  # and with sequence parallelism and FSDP
]


@pytest.mark.parametrize("world,cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_layout_gradients_equal_single_process(world, cases):
    """2 ranks: fsdp2 x ep2 with Qwen3.5's layers (Gated DeltaNet, gated attention; selective AC), tp2, fsdp2 + AC,
    tp2 + sequence parallel (dense layer, hash router), tp2 with Qwen3.5's layers (the Gated DeltaNet's heads split).
    4 ranks: dp2 x tp2 x ep2 (shared expert, selective AC), fsdp2 x tp2 x ep2 (dense layer), HSDP dp2 x fsdp2 x ep4,
    fsdp2 x tp2 x ep2 with sequence parallelism, and so with Qwen3.5's layers and selective AC."""
    run_ranks(_layouts_rank, world, cases)


def test_tp_must_divide_heads():
    from moekit.comm.tensor_parallel import check_tensor_parallel

    with pytest.raises(LayoutError, match="--tp 3 must divide num_heads=4, num_kv_heads=2"):
        check_tensor_parallel(tiny_config(), 3)


def test_token_split_sizes_cover_every_token():
    from moekit.comm.tensor_parallel import split_sizes

    for tokens in (0, 1, 7, 16):
        for parts in (1, 2, 3, 4):
            sizes = split_sizes(tokens, parts)
            assert sum(sizes) == tokens and max(sizes) - min(sizes) <= 1
            assert sizes == [len(c) for c in torch.arange(tokens).tensor_split(parts)]
