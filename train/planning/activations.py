"""What autograd holds from forward to backward on one rank, per micro-batch (moekit.train.planning.memory's activations).

Shape legend as in moekit.train.planning.memory: T tokens of the micro-batch, Ts those of the residual stream on this
rank (T, or T / tp with sequence parallelism), Tm those the MoE layer routes (T / tp when tp > 1), R expert
rows, a / r bytes of the compute dtype / of the residual stream.

    residual   block input and the post-attention sum h                           2 Ts H r
    norms      rsqrt [Ts], and x * rsqrt [Ts, H] (CPU's composite RMSNorm; CUDA's fused kernel keeps x only)
    attention  the norm output the projections read (autocast: its one bf16 copy, models.attention), q and k
               after RoPE, v, SDPA output and fp32 logsumexp; on CPU a copy of the output for wo. A
               sliding window or sinks (gpt-oss) give SDPA a mask, which it keeps (``_gqa_kept``); sinks
               widen q / k / v and pad the keys (models.attention.sink_attention)
    router     fp32 logits (the z-loss logsumexp keeps them) and scores [Tm, E]; ids, weights [Tm, k]
    dispatch   int64 slot <-> row maps; under EP the reorder permutation and its inverse
    experts    input rows [R, H], [gate | up] [R, 2F] and SwiGLU output [R, F], outputs [R, H] (combine);
               the Triton backend keeps only [gate | up] (its second GEMM's input is recomputed)
    dense FFN  / shared expert (DenseMLP): gate, up, silu(gate), product: 4 T F (GELU 2 T F, ReLU T F)
               (what an activation keeps is measured once from moe.activations' table: ``ffn_widths``)
    lora       LoRA adapters (model.lora_rank): each one's r-wide product [rows, r] (B's gradient reads it); with
               model.lora_dropout its input's bool mask [rows, in] (moe.lora_dropout keeps no dropped copy)
    head       final norm and the loss: its gradients dh [T, H] and dW [V, H] (models.loss, no logits),
               or under pipeline parallelism the lm_head input and the fp32 log-softmax [T, V]; token ids
Activation checkpointing: "full" keeps each block's input only; "ffn" keeps the FFN / MoE input and drops
its internals; "selective" keeps each block's input and the outputs models.parallelize.selective_policy
caches (``_selective``: projections, fused attention, router logits and routing decisions, the experts'
GEMMs where the dispatcher sees them); the transient is what backward recomputes (one block / one FFN).

Context parallelism (comm.context_parallel, cp > 1): T, Ts, Tm are this rank's S / cp positions of each sequence,
so every term per token shrinks cp times; attention keeps the whole sequence's keys and values (``_gqa_kept``:
the gathered [B, K, S, 2D]; ``_mla``: the gathered latent expanded to [B, N, S, Dqk + Dv]) and a mask per chunk
(on CUDA; the CPU's later chunks without a window or documents keep none: models.attention.PrefixCausalAttention).

Document masking (``Workload.document_mask``, --data.document_mask): every attention call is masked, with a mask per
sequence [B, 1, queries, keys] (``_calls``, ``_mask_bytes``), and none runs the explicit CPU path; the documents
[B, S] int32 (models.attention.document_segments, of whole sequences under context parallelism) are an activation
where checkpointed blocks keep them as their input, else a transient of the forward (memory.estimate_memory).

Sequence parallelism (comm.tensor_parallel, tp > 1) keeps only the regions between the TP matmuls on 1/tp
of the sequence: residual, norms and the whole MoE layer (its input already is the rank's slice, so Tm = Ts).
Attention and the dense MLP all-gather their input over the sequence, and that gathered [T, H] is what
their projections save, so those terms do not shrink. Each model chunk's first block copies its slice of
the input (a view would keep the whole [T, H] alive), and the last block's output is all-gathered (the
final norm / the next stage read all T).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from moekit.comm.context_parallel import ContextParallel
from moekit.comm.topology import Layout
from moekit.models.config import ModelConfig
from moekit.models.mtp import ahead_spans
from moekit.moe.activations import get_activation
# the shapes and the attention term live in their own modules; their names stay importable from here
from moekit.train.planning.attention_memory import (  # noqa: F401
    MEM_EFF_ALIGN, SINK_PAD, _attention, _calls, _cp_ranks, _explicit_probs, _gqa_kept, _mask_bytes, _mla, sink_keys)
from moekit.train.planning.shapes import DTYPE_BYTES, FP32, INT64, Shapes, shapes  # noqa: F401

if TYPE_CHECKING:  # moekit.train.planning.memory imports this module
    from moekit.train.planning.memory import Stage, Workload

@functools.lru_cache(maxsize=None)
def ffn_widths(activation: str, dense: bool) -> int:
    """Tensors of the FFN width F that autograd keeps per row between an FFN's two projections, in units of
    [rows, F]: measured once by running the activation of moe.activations' table on a small fp32 example under
    saved_tensors_hooks, plus its output (the second projection keeps it), each storage counted once. So any
    table entry is right without a case here. ``dense``: DenseMLP's form (separate gate and up Linears,
    ``Activation.combine``), else the routed experts' (``Activation.fn`` over [gate | up]).

    SwiGLU: experts 3 (the fused function keeps [gate | up], the GEMM its output), dense 4 (gate, up, silu(gate),
    product); swiglu_oai: experts 3, dense 7 (its clamps and sigmoid are composite ops); GELU 2; ReLU 1."""
    act, rows, F = get_activation(activation), 2, 8
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if dense:
            up = torch.randn(rows, F, requires_grad=True)
            out = act.combine(torch.randn(rows, F, requires_grad=True), up) if act.gated else act.unit(up)
        else:
            out = act(torch.randn(rows, act.in_features(F), requires_grad=True))
    pack(out)
    return sum(seen.values()) // (rows * F * 4)
def fused_router_applies(cfg: ModelConfig, cpu: bool) -> bool:
    """Whether the layer's router runs as moe.kernels.topk_route (moe.router.FUSED_ROUTER "auto": on CUDA,
    top-k / Switch without expert groups or force_expert)."""
    from moekit.moe import router

    opts = cfg.router_options
    return (router.FUSED_ROUTER == "always" or (router.FUSED_ROUTER == "auto" and not cpu)) and \
        cfg.router in ("topk", "switch") and opts.get("num_groups") is None and opts.get("force_expert") is None


def fused_permute_applies(cfg: ModelConfig, cpu: bool) -> bool:
    """Whether the MoE layers take moe.experts.FUSED_PERMUTE: the Triton backend and the switch on for the device.
    What that saves depends on the dispatch (_moe): the local one keeps the experts' [T, H] input instead of the
    [R, H] rows (flat expert parallelism's fused reorder keeps the received rows instead of their reordered copy:
    the same bytes); local and flat expert-parallel dispatch, without output biases, also apply the routing weights
    in the last GEMM, so the combine keeps no [R, H] expert outputs."""
    from moekit.moe import experts

    mode = experts.FUSED_PERMUTE
    return _backend(cfg, cpu) == "triton" and (mode == "always" or (mode == "auto" and not cpu))


def _router(cfg: ModelConfig, s: Shapes) -> int:
    E, k, T, H = cfg.num_experts, cfg.top_k, s.Tm, cfg.hidden_size
    opts = cfg.router_options
    sigmoid = opts.get("score", "softmax") == "sigmoid"
    jitter = 2 * T * H * FP32 if cfg.router == "switch" and opts.get("jitter", 0.01) > 0 else 0
    # Switch's jitter: the noise and the jittered input; sequence-wise balancing (moe.losses.sequence_balance_loss):
    # the shares f [B, E] and the lengths [B, 1]
    if opts.get("balance") == "sequence" and cfg.aux_loss_coeff > 0:
        jitter += s.B * (E + 1) * FP32
    if fused_router_applies(cfg, s.cpu):  # the kernel keeps the logits and the ids; torch ops on its outputs
        b = T * E * FP32 + T * k * INT64 + E * FP32  # + the balance loss's [E] operand of its dot product
        b += T * E * FP32 + 2 * T * FP32 if sigmoid else 0  # the balance distribution: scores / clamped sum
        b += T * FP32 if cfg.z_loss_coeff > 0 else 0  # the z-loss squares the kernel's logsumexp
        return b + jitter
    b = 2 * T * E * FP32 + T * FP32 + T * k * (INT64 + FP32)  # logits, scores, logsumexp; ids, gathered scores
    if (cfg.router == "topk" and opts.get("normalize", k > 1)) or sigmoid:  # weights / their clamped sum
        b += 2 * T * FP32 + T * k * FP32
    elif opts.get("scaling", 1.0) != 1.0:
        b += T * k * FP32
    b += T * FP32 if sigmoid else 0  # the balance distribution divides by the scores' sum
    return b + jitter  # a bf16 input is saved as bf16 (moe.precision.upcast_linear), counted with the block's inputs


def _moe(cfg: ModelConfig, layout: Layout, s: Shapes, node_rows: float) -> dict[str, int]:
    """The MoE FFN's internals (its input is counted by the caller)."""
    H, k, F = cfg.hidden_size, cfg.top_k, cfg.moe_ffn_hidden_size
    dispatch = s.Tm * k * INT64 + s.R * INT64 + (2 * s.R * INT64 if layout.ep > 1 else 0)
    dispatch += int(node_rows * s.Tm) * (H * s.a + INT64)  # two-level: one partial sum back per (token, node)
    backend = _backend(cfg, s.cpu)
    # the Triton kernel keeps [gate | up] alone (moe.kernels.expert_mlp.FusedExpertMLPFunction saves pre, and its
    # backward recomputes the activation); the other backends keep what the activation and the second GEMM keep
    act = get_activation(cfg.activation)
    hidden = act.in_features(F) if backend == "triton" else F * ffn_widths(cfg.activation, False)
    fused = fused_permute_applies(cfg, s.cpu)
    outputs = s.R * H * s.a  # the experts' output rows, which the weighted combine keeps for the weights' gradient
    if fused:  # the weights in the last GEMM (local, flat or hierarchical EP: comm.hierarchical's inner exchange),
        # the [R] fp32 row weights kept instead of the outputs and the combine's [T, k] fp32 weights
        outputs = s.R * FP32 - s.Tm * k * FP32
        if cfg.moe_ffn_bias and s.autocast:  # and b_out, which the weights' gradient reads: under autocast the
            # local experts' bf16 cast of it (else the parameter itself, or FSDP's unsharded copy, freed after use)
            outputs += cfg.num_experts // layout.ep * H * s.a
    if fused and layout.ep == 1:  # the experts keep their [T, H] input, not the [R, H] rows: the block's input
        # itself, or under autocast the one bf16 copy the layer casts
        rows = s.Tm * H * s.a if s.casts else 0
    else:
        rows = s.R * H * (s.a if s.casts else s.r)
    experts = rows + s.R * hidden * s.a + outputs
    if cfg.moe_ffn_bias and backend == "torch":  # add_expert_bias keeps each row's int64 expert id, per bias
        experts += 2 * s.R * INT64
    out = {"router": _router(cfg, s), "dispatch": dispatch, "experts": experts}
    if cfg.shared_ffn_hidden_size:
        gate = cfg.shared_expert_gate
        shared = s.Tm * cfg.shared_ffn_hidden_size * ffn_widths(cfg.activation, True) * s.a
        if s.casts:  # the one bf16 copy of the input w_up, w_gate and the gate read (moe.layer.DenseMLP), the
            # gated product keeps the output y and the sigmoid (in the compute dtype)
            shared += s.Tm * H * s.a * (1 + gate) + s.Tm * s.a * gate
        else:  # the gated product keeps y and the fp32 sigmoid (and its input)
            shared += s.Tm * H * s.a * gate + 2 * s.Tm * FP32 * gate
        out["shared_expert"] = shared
    return out


def _lora(cfg: ModelConfig, layout: Layout, s: Shapes, i: int, cached: bool = False) -> tuple[int, int]:
    """Block i's LoRA adapters' own activations (models.lora, moe.lora_experts): (attention's, the FFN's). Each
    adapter keeps x A^T [rows, r] in the compute dtype, and with lora_dropout the one-byte mask of its input
    [rows, in]. Rows: attention and a dense FFN read T (the gathered sequence under SP; MLA's wkv_b every key
    position under CP), the shared expert Tm (TP's token split), the routed experts their R rows (the fused loop's
    u and v; both masks span the rows). A row-wise projection's input (wo, a dense FFN's w_out) is its TP shard.

    ``cached``: what an op-level selective checkpoint caches instead (``_selective``): each adapter's x A^T (the
    expansion u B^T is recomputed, moe.recompute; the fused loop's products the dispatcher does not see at all);
    masks are drawn again."""
    if not cfg.lora_rank:
        return 0, 0
    from moekit.models.lora import adapter_shapes
    from moekit.moe.experts import LOOP_FUSED_ACTIVATIONS

    drop = 1 if cfg.lora_dropout and not cached else 0
    fused_loop = _backend(cfg, s.cpu) in ("loop", "triton") and cfg.activation in LOOP_FUSED_ACTIVATIONS
    shapes = dict(adapter_shapes(cfg, i))
    attention = ffn = 0
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[-1] in ("lora_a_in", "lora_a_out"):  # [E, in, r]
            if cached:
                ffn += 0 if fused_loop else s.R * shape[2] * s.a
            else:
                ffn += s.R * (shape[2] * s.a + drop * shape[1])
            continue
        if parts[-1] != "lora_a":  # [r, in]
            continue
        r, width = shape
        shared = "shared_expert" in parts
        rows = s.Tm if shared else (s.B * s.S if s.cp > 1 and parts[-2] == "wkv_b" else s.T)
        if cached:
            part = rows * r * s.a
        else:
            if parts[-2] in ("wo", "w_out") and not shared:
                width //= layout.tp
            part = rows * (r * s.a + drop * width)
        if "attn" in parts:
            attention += part
        else:
            ffn += part
    return attention, ffn


def _block(cfg: ModelConfig, layout: Layout, s: Shapes, i: int, node_rows: float) -> tuple[dict, dict]:
    """Block i's activations: (kept outside the FFN, the FFN's internals)."""
    outer, ffn = _block_base(cfg, layout, s, i, node_rows)
    attention, inner = _lora(cfg, layout, s, i)
    if attention:
        outer["lora"] = attention
    if inner:
        ffn["lora"] = inner
    return outer, ffn


def _block_base(cfg: ModelConfig, layout: Layout, s: Shapes, i: int, node_rows: float) -> tuple[dict, dict]:
    H = cfg.hidden_size
    norms = 2 * s.Ts * FP32 + (2 * s.Ts * H * FP32 if s.cpu else 0)  # rsqrt; x * rsqrt on CPU (in fp32)
    if cfg.norm_zero_centered and not s.cpu:  # the fp32 normalised rows (1 + w) multiplies, kept on CUDA as well
        norms += 2 * s.Ts * H * FP32
    # the two norms' inputs, the residual stream (on CPU their fp32 copies: Shapes.norm_in)
    outer = {"residual": 2 * s.Ts * H * s.norm_in, "norms": norms, "attention": _attention(cfg, layout, s, i)}
    if cfg.is_moe_layer(i):  # the router keeps the norm output (its own input cast is in _router): without
        # SP a view of the replicated [T, H] the MoE layer slices, with SP the rank's [Ts, H] slice
        outer["ffn_input"] = s.Ts * H * s.r
        return outer, _moe(cfg, layout, s, node_rows)
    # whole T: under SP the gathered sequence; under autocast the one bf16 copy w_up and w_gate read
    outer["ffn_input"] = s.T * H * (s.a if s.casts else s.r)
    F = cfg.ffn_hidden_size // layout.tp
    return outer, {"dense_ffn": s.T * F * ffn_widths(cfg.activation, True) * s.a}


def _selective(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> dict[str, int]:
    """What an op-level selective checkpoint caches of block i besides its input (models.parallelize's
    SAVED_OPS): matmul outputs, fused attention outputs and the routing decisions; nothing elementwise. LoRA
    adapters' products too (``_lora``)."""
    out = _selective_base(cfg, layout, s, i)
    attention, ffn = _lora(cfg, layout, s, i, cached=True)
    if attention + ffn:
        out["lora"] = attention + ffn
    return out


def _selective_base(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> dict[str, int]:
    H, a, N = cfg.hidden_size, s.a, cfg.num_heads // layout.tp
    keys = s.B * s.S if s.cp > 1 else s.T  # context parallel: the gathered keys / latents of whole sequences
    if cfg.is_linear_layer(i):  # a Gated DeltaNet layer: its projections' outputs
        from moekit.train.planning.linear_memory import linear_attention_selective

        out = {"attention": linear_attention_selective(cfg, s)}
        return out | _selective_ffn(cfg, layout, s, i)
    if cfg.attention == "mla":
        Dqk, Dv, c = cfg.attn_qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # q (its latent and projection), kv_a, then kv_b over every key position
        proj = s.T * (cfg.q_lora_rank + N * Dqk + c) + keys * N * (cfg.qk_nope_head_dim + Dv)
        fused = not (s.cpu and Dqk != Dv)  # CPU SDPA falls back to math (bmm, not kept) when Dqk != Dv
    else:
        Dv, K = cfg.attn_head_dim, cfg.num_kv_heads // layout.tp
        gate = 2 if cfg.attention_output_gate else 1  # wq's output holds the gate as well
        proj, fused, c = s.T * (gate * N + 2 * K) * Dv, True, 2 * K * Dv
    # bmm + softmax + bmm (explicit; never for chunked attention over more than a chunk): nothing a selective
    # checkpoint caches
    chunk = cfg.attention_chunk_of(i)
    fused = fused and not (s.explicit_attention and not (chunk and s.S > chunk))
    # each SDPA call's output and fp32 logsumexp (``_calls``): sink attention's 8 channels wider, an unmasked one's
    # P' rows long; both flash calls of a CPU PrefixCausalAttention (a later context-parallel chunk)
    width = Dv + SINK_PAD if cfg.attention_sinks else Dv

    def sdpa(n: int, P: int, masked: bool) -> int:
        if not masked and P > n and s.cpu:  # PrefixCausalAttention (CUDA's bottom-right call: one output)
            return 2 * n * (Dv * a + FP32)
        return (n if masked or not cfg.attention_sinks else sink_keys(n)) * (width * a + FP32)

    same_widths = cfg.attention != "mla" or cfg.attn_qk_head_dim == Dv
    calls = [_calls(s, r, cfg.attention_window(i), same_widths, chunk=chunk, width=Dv, sinks=cfg.attention_sinks)
             for r in _cp_ranks(s)]
    kept = max(s.B * N * sum(sdpa(*call) for call in rank) for rank in calls) if fused else 0
    # q / k / v (or MLA's latents) and the output projection
    out = {"attention": (proj + s.T * H) * a + kept}
    if s.cp > 1:  # the key / value all-gather's output (a functional collective: cached) [B, S, 2KD or c + rope]
        out["attention"] += keys * c * a
    return out | _selective_ffn(cfg, layout, s, i)


def _selective_ffn(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> dict[str, int]:
    """The FFN / MoE part of ``_selective``."""
    H, a, out = cfg.hidden_size, s.a, {}
    gated = get_activation(cfg.activation).gated
    if not cfg.is_moe_layer(i):  # gate and up [T, F], out [T, H]
        out["dense_ffn"] = s.T * ((1 + gated) * cfg.ffn_hidden_size // layout.tp + H) * a
        return out
    E, k, T, opts = cfg.num_experts, min(cfg.top_k, cfg.num_experts), s.Tm, cfg.router_options
    router = T * E * FP32 * (cfg.router != "hash")  # fp32 logits
    router += 12 * T * k + 16 * T * k  # top-k (fp32 values, int64 ids), the dispatch's stable sort (int64 pairs)
    if opts.get("num_groups"):  # group-limited: the per-group top scores, then the chosen groups
        router += 12 * T * (opts["num_groups"] * opts.get("group_score_top", 2) + opts.get("group_top_k", 1))
    if cfg.capacity_factor is not None:  # the [T, E] priority sort that drops slots past capacity
        router += 12 * T * E
    out["router"] = router
    backend = _backend(cfg, s.cpu)
    # Triton launches are invisible to the dispatcher and the loop's gated function writes out=: both recomputed.
    # The loop runs that function for moe.experts.LOOP_FUSED_ACTIVATIONS (biases or not); other activations
    # compose autograd ops (moe.experts.loop_mlp), whose matmuls the checkpoint caches.
    from moekit.moe.experts import LOOP_FUSED_ACTIVATIONS

    if not (backend == "triton" or (backend == "loop" and cfg.activation in LOOP_FUSED_ACTIVATIONS)):
        out["experts"] = s.R * (cfg.moe_ffn_hidden_size * (1 + gated) + H) * a  # both GEMMs' outputs
    if cfg.shared_ffn_hidden_size:
        out["shared_expert"] = T * ((1 + gated) * cfg.shared_ffn_hidden_size + H + cfg.shared_expert_gate) * a
    return out


def _loss_chunks() -> bool:
    """Whether the trainer's loss runs from hidden states (models.transformer.LOSS_CHUNKS)."""
    from moekit.models import transformer

    return transformer.LOSS_CHUNKS == "auto"


def _backend(cfg: ModelConfig, cpu: bool) -> str:
    """The expert backend the layer runs: its configured one, or what "auto" resolves to."""
    return cfg.expert_backend if cfg.expert_backend != "auto" else _auto_backend(cfg, cpu)


def _auto_backend(cfg: ModelConfig, cpu: bool) -> str:
    """The expert backend "auto" takes: moe.experts.auto_order's first choice for this expert shape."""
    from moekit.moe.experts import auto_order

    w_out = torch.empty(0, cfg.moe_ffn_hidden_size, cfg.hidden_size, device="meta")  # only its shape is read
    return auto_order(torch.device("cpu" if cpu else "cuda"), w_out)[0]


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for key, v in part.items():
        total[key] = total.get(key, 0) + v


def stage_activations(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage,
                      node_rows: float = 0.0) -> tuple[dict[str, int], int]:
    """One micro-batch's activations on a rank of ``stage`` by part, and the recompute transient."""
    s, H, mode = shapes(cfg, layout, wl), cfg.hidden_size, wl.activation_checkpointing
    out, recompute = {"rope": s.T // s.B * cfg.rope_dim * FP32}, 0  # cos, sin [S / cp, D/2], shared
    for i in stage.layers:
        outer, ffn = _block(cfg, layout, s, i, node_rows)
        inner = sum(ffn.values())
        rule = 0  # a Gated DeltaNet layer's chunks run again in its backward (model.linear_recompute)
        if cfg.is_linear_layer(i):
            from moekit.train.planning.linear_memory import linear_rule_transient

            rule = linear_rule_transient(cfg, s, layout.tp)
        if mode == "full":  # only the block input stays; backward recomputes the whole block
            _add(out, {"residual": s.Ts * H * s.r})
            recompute = max(recompute, sum(outer.values()) - s.Ts * H * s.r + inner + rule)
            continue
        if mode == "selective":  # the block input and the cached op outputs; backward rebuilds the rest
            kept = _selective(cfg, layout, s, i)
            _add(out, {"residual": s.Ts * H * s.r, **kept})
            recompute = max(recompute, sum(outer.values()) + inner - s.Ts * H * s.r - sum(kept.values()) + rule)
            continue
        if mode == "ffn":  # the checkpoint keeps the FFN's input and recomputes the rest: the norm output,
            # which under SP is the MoE's own slice, but for a dense MLP the sequence gathered before it
            outer["ffn_input"] = (s.Ts if cfg.is_moe_layer(i) else s.T) * H * s.r
            recompute = max(recompute, inner, rule)
        else:
            _add(out, ffn)
            recompute = max(recompute, rule)
        _add(out, outer)
    if wl.document_mask and mode in ("full", "selective") and stage.layers:  # models.attention.document_segments:
        # [B, S] int32 of the whole sequences (under context parallelism from their gathered ids), which every
        # checkpointed block keeps as its input
        out["documents"] = s.B * s.S * 4
    if stage.first:
        out["embedding"] = s.T * INT64  # token ids
    if stage.last:  # last block's output (all-gathered under SP), final norm, then the loss's own
        out["head"] = _head(cfg, layout, s)
        if cfg.mtp_layers and wl.seq_len > 1:  # the final norm's output, which depth 1's hnorm keeps
            _add(out, {"mtp": s.T * H * s.norm_in})
            if not stage.first:  # a pipeline's last stage looks the tokens up again (its embedding replica)
                _add(out, {"mtp": s.T * H * s.r})
        for k in range(1, cfg.mtp_layers + 1):
            _add(out, _mtp_depth(cfg, layout, wl, k, node_rows))
    else:  # the stage output (all-gathered under SP) waits for its gradient
        _add(out, {"residual": s.T * H * s.r})
    return out, recompute


def _head(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """The final norm and the loss over s.T tokens: the main model's head, and each MTP depth's."""
    H, low = cfg.hidden_size, s.a if s.casts else s.r
    if _loss_chunks():  # models.loss: its gradients dh [T, H] and dW [V, H], no logits
        # measured on CPU: dh is in the dtype of the normed hidden states, the residual stream's (fp32 under
        # autocast over fp32 weights), as is the final norm's kept product
        # (dW in the head weight's dtype: fp32 but for FSDP's bf16 parameters)
        norm = s.T * FP32 + (s.T * H * FP32 if s.cpu else s.T * H * s.r if cfg.norm_zero_centered else 0)
        return s.T * H * s.norm_in + norm + s.T * H * s.r + cfg.vocab_size * H * s.w
    # LOSS_CHUNKS "never": lm_head input, fp32 log-softmax [T, V]
    norm = s.T * FP32 + (s.T * H * FP32 if s.cpu else 0)
    return s.T * H * s.norm_in + norm + s.T * H * low + s.T * cfg.vocab_size * FP32


def _mtp_depth(cfg: ModelConfig, layout: Layout, wl: Workload, k: int, node_rows: float) -> dict[str, int]:
    """Multi-token-prediction depth k (models.mtp; under TP its block is sharded as any block, on the whole
    sequence even with sequence parallelism): on S - k positions per sequence, its two
    input norms, the [embedding; state] concatenation its projection reads, its block (never checkpointed) and
    its own loss through the shared head (gradients dh and dW, as the main loss keeps them)."""
    n = wl.seq_len - k
    if n <= 0:
        return {}
    spans = None
    if layout.cp > 1:  # every local position runs (the attention gather needs equal shares), the FFN and the loss
        # only those with a token k + 1 ahead (models.mtp.context_depth_losses)
        n, spans = wl.seq_len, _ahead_spans(layout.cp, wl.cp_rank, wl.seq_len, k)
    whole = dataclasses.replace(wl, seq_len=n, sequence_parallel=False)  # whole sequences
    # the depth's input norms read the main model's stream (m); its block and head run on eh_proj's output, whose
    # residual stream is in the compute dtype under autocast whatever the main one's (s)
    m = shapes(cfg, layout, whole)
    if wl.dtype == "bfloat16":
        whole = dataclasses.replace(whole, residual="bfloat16")
    s = shapes(cfg, layout, whole)
    H, low = cfg.hidden_size, m.a if m.casts else m.r
    i = cfg.num_layers + k - 1
    outer, ffn = _block(cfg, layout, s, i, node_rows)
    norm = s.T * FP32 + (s.T * H * FP32 if s.cpu else 0)  # rsqrt; x * rsqrt on CPU (in fp32)
    out = {"mtp": 2 * norm + 2 * s.T * H * low, **outer}
    kept = s
    if spans is None and m.norm_in != m.r:  # enorm's input, a view of the embedding's output, is that of the first
        # block's attention norm, but on CPU each keeps its own fp32 copy of a bf16 residual stream
        out["mtp"] += s.T * H * FP32
    if spans is not None:
        out["mtp"] += s.T * H * m.norm_in  # the embedding of the ids k ahead, looked up per depth (enorm keeps it)
        rows = sum(b - a for a, b in spans)
        if rows * layout.cp != wl.seq_len:  # the FFN and the head see the kept rows only
            kept = shapes(cfg, layout, dataclasses.replace(whole, seq_len=rows * layout.cp))
            ffn = _block(cfg, layout, kept, i, node_rows)[1]
            if len(spans) > 1:  # the kept rows are a copy (one span: a view of the whole norm output)
                out["ffn_input"] = kept.T * H * s.r
    _add(out, ffn)
    out["head"] = _head(cfg, layout, kept)
    return out


def _ahead_spans(cp: int, cp_rank: int | None, seq_len: int, k: int) -> list[tuple[int, int]]:
    """The local position ranges of CP rank ``cp_rank`` whose token k ahead exists (models.mtp.ahead_spans);
    every local position for ``cp_rank`` None (the most a rank keeps)."""
    local = seq_len // cp
    if cp_rank is None:
        return [(0, local)]
    return ahead_spans(ContextParallel(cp, cp_rank), local, seq_len, k)


def in_flight(layout: Layout, wl: Workload, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once (in units of all its layers)."""
    pp, m, v = layout.pp, wl.microbatches, wl.pp_stages_per_rank
    if pp == 1:
        return 1.0
    if wl.pp_schedule == "gpipe":
        return float(m)
    if wl.pp_schedule == "1f1b" or v == 1:
        return float(min(pp - stage, m))
    chunks = 2 * (pp - stage - 1) + (v - 1) * pp + 1  # Megatron's interleaved warm-up + 1, in model chunks
    return min(chunks, m * v) / v

