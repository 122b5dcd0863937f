"""Activation checkpointing: same losses, gradients and expert-load records, less saved activation memory."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moekit.comm.topology import Layout
from moekit.models.config import PRESETS
from moekit.models.parallelize import apply_activation_checkpointing
from moekit.models.transformer import build_model
from moekit.moe.activations import get_activation
from moekit.moe.experts import LOOP_FUSED_ACTIVATIONS
from moekit.moe.load import moe_layers
from moekit.train.planning.activations import sink_keys
from moekit.train.planning.memory import Workload, estimate_memory
from tests.dist_utils import run_ranks
from moekit.train.planning.linear_memory import new_objects_gc
from tests.test_dryrun import LiveStorages
from tests.test_train_distributed import TINY

from moekit.train.loop import main
from moekit.train.records import load_rows

B, S = 2, 32
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
CASES = {  # 2-layer variants of the presets, each routing differently
    "mixtral": ("mixtral-tiny", {}),  # top-2 softmax, dropless, loop SwiGLU experts (out=: recomputed)
    "mixtral-capacity-torch": ("mixtral-tiny", {"capacity_factor": 1.0, "expert_backend": "torch"}),  # grouped_mm kept
    "deepseek-mla": ("deepseek-tiny", MLA),  # dense first layer, shared expert, group-limited sigmoid + bias update
    "switch-jitter": ("switch-tiny", {"moe_every": 1}),  # top-1, jitter (RNG replay), capacity, ReLU
    # sinks (a full layer: causal SDPA over padded rows), an 8-position window, biases, swiglu_oai through the loop
    "gpt-oss": ("gpt-oss-tiny", {"sliding_window": 8}),
}


def _config(case: str):
    name, over = CASES[case]
    small = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "vocab_size": 128}
    if name == "switch-tiny":
        small["moe_ffn_hidden_size"] = 128
    return dataclasses.replace(PRESETS[name], **{**small, **over})


def _step(cfg, mode: str, tokens, targets) -> dict:
    """One forward / backward under ``mode``: loss, gradients, the bytes alive between forward and backward
    (whoever holds them: autograd, a checkpoint's inputs, SAC's cache), and each MoE layer's record."""
    model = build_model(cfg, seed=1)
    apply_activation_checkpointing(model, mode)
    model.train()
    torch.manual_seed(7)  # router jitter draws from the global generator
    track = LiveStorages()
    with new_objects_gc():  # alive()'s collection walks the forward's objects only
        with track:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        live = track.alive(list(model.parameters()) + list(model.buffers()) + [tokens, targets])
    loss.backward()
    loads = [layer.load.summary() for _, layer in moe_layers(model)]
    return {"loss": loss.detach(), "grads": [p.grad for p in model.parameters()], "live": live, "loads": loads}


def selective_cache_bytes(cfg, run: dict) -> int:
    """What the policy implies a selective block caches besides its input, from the shapes (fp32, CPU): the
    projections' and SDPA's outputs, the router's logits and decisions, the expert GEMMs the dispatcher sees."""
    T, H, N, f = B * S, cfg.hidden_size, cfg.num_heads, 4
    total = 0
    # rows the experts compute: the loop skips the slots capacity dropped, grouped_mm runs over all T * k
    rows = iter(s.total_slots if cfg.expert_backend == "torch" else sum(s.tokens_per_expert) for s in run["loads"])
    for i in range(cfg.num_layers):
        if cfg.attention == "mla":  # q_a, q_b, kv_a, kv_b, o; CPU SDPA with Dqk != Dv runs the math path (bmm)
            dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            total += T * f * (cfg.q_lora_rank + N * dqk + cfg.kv_lora_rank + cfg.qk_rope_head_dim
                              + N * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H)
        else:  # q, k, v, o; SDPA output and its fp32 logsumexp (sinks: 8 channels wider, and without a window the
            # queries padded to the keys' rows: models.attention.sink_attention)
            D = cfg.attn_head_dim
            total += T * f * ((N + 2 * cfg.num_kv_heads) * D + H)
            sdpa_rows = B * sink_keys(S) if cfg.attention_sinks and not cfg.attention_window(i) else T
            total += sdpa_rows * N * (D + 8 * cfg.attention_sinks + 1) * f
        gated = 1 + get_activation(cfg.activation).gated
        if not cfg.is_moe_layer(i):
            total += T * f * (gated * cfg.ffn_hidden_size + H)
            continue
        E, k, opts = cfg.num_experts, cfg.top_k, cfg.router_options
        total += T * E * f + T * k * (f + 8) + T * k * 16  # logits; top-k values + ids; dispatch sort (int64 x2)
        if opts.get("num_groups"):  # top-2 scores per group, then the chosen groups
            total += T * (opts["num_groups"] * 2 + opts["group_top_k"]) * (f + 8)
        if cfg.capacity_factor is not None:  # priority sort over [T, E]
            total += T * E * (f + 8)
        R = next(rows)
        # both GEMM outputs, unless the loop's hand-written function (out= matmuls: recomputed) runs them
        if cfg.expert_backend == "torch" or cfg.activation not in LOOP_FUSED_ACTIVATIONS:
            total += R * f * (gated * cfg.moe_ffn_hidden_size + H)
        total += T * f * (gated * cfg.shared_ffn_hidden_size + H) if cfg.shared_ffn_hidden_size else 0
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_selective_checkpointing_keeps_what_its_policy_says_and_the_gradients(case):
    cfg = _config(case)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
    modes = ("none", "selective", "full") + (("ffn",) if case == "mixtral" else ())
    runs = {mode: _step(cfg, mode, tokens, targets) for mode in modes}
    for mode in modes[1:]:
        torch.testing.assert_close(runs[mode]["loss"], runs["none"]["loss"], rtol=0, atol=0)
        for a, b in zip(runs[mode]["grads"], runs["none"]["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
        assert runs[mode]["loads"] == runs["none"]["loads"], f"{mode}: recomputed forwards were recorded"
    assert all(s.forwards == 1 for s in runs["none"]["loads"])
    # selective keeps each block's input, as full does, plus exactly the cached op outputs
    cache = runs["selective"]["live"] - runs["full"]["live"]
    assert cache == selective_cache_bytes(cfg, runs["selective"]), (case, runs["selective"]["live"])
    # ... and none keeps at least what selective recomputes: the norm outputs the projections read and the
    # experts' activation output [R, F]
    T, F_ = B * S, cfg.moe_ffn_hidden_size
    recomputed = sum(2 * T * cfg.hidden_size * 4 + sum(s.tokens_per_expert) * F_ * 4 for s in runs["none"]["loads"])
    live = {m: r["live"] for m, r in runs.items()}
    assert live["none"] - live["selective"] >= recomputed, (case, live)
    # the dry run's estimate knows the mode (exact up to small tensors; capacity bounds the rows from above)
    est = estimate_memory(cfg, Layout(), Workload(B, S, "float32", "selective", "cpu"))
    tol = 0.1 if cfg.capacity_factor is not None else 0.005
    assert est.activations == pytest.approx(runs["selective"]["live"], rel=tol), est.breakdown
    if "ffn" in runs:  # the loop's SwiGLU experts are recomputed whole (out=), so selective is below ffn here
        assert live["full"] < live["selective"] < live["ffn"] < live["none"], live


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'some'.*selective"):
        apply_activation_checkpointing(build_model(_config("mixtral")), "some")


def _records(run_dir: Path):
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    load = load_rows(run_dir)
    return [(m["loss"], m["grad_norm"]) for m in metrics], load


def test_same_losses_and_load_records_with_and_without_checkpointing(tmp_path):
    """Recomputed forwards are not counted twice: the expert-load records are identical."""
    out = {}
    for mode in ("none", "full", "ffn"):
        d = tmp_path / mode
        assert main([*TINY, "--steps", "3", "--run-dir", str(d), "--checkpoint.every", "0",
                     "--train.activation_checkpointing", mode]) == 0
        out[mode] = _records(d)
    assert out["full"] == out["none"] and out["ffn"] == out["none"]


# (degrees, model overrides, activation checkpointing, sequence parallel): tests.test_parallelize's check,
# the gradients of every parameter against one process on the whole batch
RANK_CASES = [
    (dict(dp=2, ep=2), {}, "full", False),  # the recomputed all-to-alls run in backward on both ranks
    (dict(dp=2, ep=2), {"capacity_factor": 2.0}, "selective", False),  # all-to-alls re-run, routing replayed
    (dict(fsdp=2, ep=2), {"expert_backend": "torch", "shared_ffn_hidden_size": 16}, "selective", False),
    (dict(tp=2), {"first_dense_layers": 1}, "selective", True),  # DTensor ops and collectives inside the cache
]


def _rank_cases(rank, world):
    from tests.test_parallelize import _check_layout

    for case in RANK_CASES:  # one spawn for all (process start-up dominates on 2 cores)
        _check_layout(rank, world, *case)


def test_checkpointing_under_expert_parallelism_fsdp_and_tp_matches_one_process():
    run_ranks(_rank_cases, 2)
