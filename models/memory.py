"""Per-rank memory and all-to-all traffic of a training layout, from the config alone (no tensors).

Shape legend: T tokens per micro-batch on a rank (micro_batch * seq_len), H hidden, V vocab, N / K query /
key-value heads, D head dim, F FFN width, E experts, k slots per token, R expert rows a rank computes
(T * k when dropless and balanced), a bytes of the compute dtype (2 bf16, 4 fp32).

Every term counts what moekit's code keeps, read off the modules and checked against a measured CPU run
(tests/test_dryrun.py):

    parameters   fp32 master weights: the rank's shard of every tensor (TP, EP, FSDP below)
    gradients    fp32, same shards
    optimizer    AdamW: exp_avg + exp_avg_sq (fp32, same shards) + one fp32 step scalar per tensor
    activations  what autograd holds from forward to backward, per micro-batch and block:
      residual   block input and the post-attention sum h                           2 T H r
      norms      rsqrt [T], and x * rsqrt [T, H] (CPU's composite RMSNorm; CUDA's fused kernel keeps x only)
      attention  the norm output the projections read (autocast: one bf16 copy per projection), q and k
                 after RoPE, v, SDPA output and fp32 logsumexp; on CPU a copy of the output for wo
      router     fp32 logits (the z-loss logsumexp keeps them) and scores [T, E]; ids, weights [T, k]
      dispatch   int64 slot <-> row maps; under EP the reorder permutation and its inverse
      experts    input rows [R, H], [gate | up] [R, 2F] and SwiGLU output [R, F], outputs [R, H] (combine)
      dense FFN  / shared expert (DenseMLP): gate, up, silu(gate), product: 4 T F (GELU 2 T F, ReLU T F)
      head       final norm, the lm_head input, fp32 log-softmax [T, V]; token ids
      weight casts  autocast without FSDP: a bf16 copy of every matmul weight lives until backward
    Activation checkpointing: "full" keeps each block's input only; "ffn" keeps the FFN / MoE input and
    drops its internals. Transient (at the peak only): what backward recomputes (one block / one FFN),
    FSDP's unsharded copies, and the logits [T, V] with their gradient on the last pipeline stage.

The parallel recipe (models/parallelize.py, comm/tensor_parallel.py, comm/fsdp.py, models/pipeline.py):
    TP shards attention heads and the dense FFN width; embedding, norms, lm_head and the whole MoE layer
    are replicated, and the MoE layer routes a 1/tp slice of the tokens on each TP rank.
    EP shards the experts' dim 0. FSDP shards dense tensors' dim 0 over fsdp, and experts' dim 1 over the
    D / ep ranks holding the same experts; it computes in bf16 parameters (so the residual stream is bf16
    too) and keeps two blocks unsharded at a time (transient).
    PP: a rank holds its stage's layers (``Stage``); activations are multiplied by the micro-batches the
    stage holds at once: GPipe all M, 1F1B pp - stage, interleaved Megatron's warm-up count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from comm import cost_model
from comm.topology import Layout, Topology
from models.config import ModelConfig

FP32, INT64 = 4, 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
AC_MODES = ("none", "full", "ffn")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# Saved hidden state per row, in units of the FFN width. GroupedExperts' fused SwiGLU keeps [gate | up]
# and its output (3); DenseMLP keeps gate, up, silu(gate) and the product (4); GELU its input and output;
# ReLU only its output.
EXPERT_HIDDEN = {"swiglu": 3, "gelu": 2, "relu": 1}
DENSE_HIDDEN = {"swiglu": 4, "gelu": 2, "relu": 1}


@dataclass(frozen=True)
class Workload:
    micro_batch: int  # sequences per forward on one data-parallel rank
    seq_len: int
    dtype: str = "bfloat16"  # float32 | bfloat16 (autocast over fp32 master weights)
    activation_checkpointing: str = "none"  # none | full | ffn
    device: str = "cuda"  # cuda | cpu: the kernels that run decide what is kept (RMSNorm, SDPA layout)
    microbatches: int = 1  # forward + backward passes per optimizer step on one rank
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1

    def __post_init__(self):
        for name, value, allowed in (("dtype", self.dtype, tuple(DTYPE_BYTES)), ("pp_schedule", self.pp_schedule, SCHEDULES),
                                     ("activation_checkpointing", self.activation_checkpointing, AC_MODES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is invalid; use one of {list(allowed)}")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds: its decoder layers, and the embedding / head when it has them."""

    index: int
    layers: tuple[int, ...]
    first: bool
    last: bool


def even_stages(cfg: ModelConfig, layout: Layout, stages_per_rank: int = 1) -> list[Stage]:
    """Pipeline ranks' layers when the layers split evenly into pp * v stages (stage s on rank s % pp).
    The trainer balances stages by cost (models.pipeline); pass its split to ``estimate_memory`` instead."""
    n, pp = layout.pp * stages_per_rank, layout.pp
    size, rem = divmod(cfg.num_layers, n)
    starts = [s * size + min(s, rem) for s in range(n + 1)]
    return [Stage(r, tuple(i for s in range(r, n, pp) for i in range(starts[s], starts[s + 1])), r == 0,
                  (n - 1) % pp == r) for r in range(pp)]


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int  # pipeline rank described
    params: int  # bytes
    grads: int
    optimizer: int
    activations: int
    transient: int  # extra at the peak: the recomputed block / FFN, FSDP's unsharded copies, the logits
    param_numel: dict[str, int] = field(default_factory=dict)  # local elements by part
    breakdown: dict[str, int] = field(default_factory=dict)  # activation bytes by part, then transient_*

    @property
    def total(self) -> int:
        """Everything held at once when gradients accumulate over micro-batches; with one micro-batch a
        step frees activations as gradients appear, so this (and ``peak``) is an upper bound."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def peak(self) -> int:
        return self.total + self.transient


# ---------------------------------------------------------------------------------------------------
# Parameters: every tensor with the dim TP shards; EP and FSDP shards applied per tensor
# ---------------------------------------------------------------------------------------------------


def _dense_mlp(cfg: ModelConfig, part: str, width: int, tp: bool) -> list:
    H = cfg.hidden_size
    dims = (0, 1) if tp else (None, None)
    out = [(part, (width, H), dims[0]), (part, (H, width), dims[1])]  # w_up, w_out
    if cfg.activation == "swiglu":
        out.append((part, (width, H), dims[0]))  # w_gate
    return out


def layer_tensors(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(part, full shape, TP-sharded dim or None) of every parameter of block ``i``."""
    H, N, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim
    out = [("norms", (H,), None), ("norms", (H,), None), ("attention", (N * D, H), 0),
           ("attention", (K * D, H), 0), ("attention", (K * D, H), 0), ("attention", (H, N * D), 1)]
    if not cfg.is_moe_layer(i):
        return out + _dense_mlp(cfg, "dense_ffn", cfg.ffn_hidden_size, tp=True)
    E, F, Fs = cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.shared_ffn_hidden_size
    if cfg.router != "hash":  # hash routing has no gate
        out.append(("router", (E, H), None))
    out += [("experts", (E, H, 2 * F if cfg.activation == "swiglu" else F), None), ("experts", (E, F, H), None)]
    if Fs:
        out += _dense_mlp(cfg, "shared_expert", Fs, tp=False)
        if cfg.shared_expert_gate:
            out.append(("shared_expert", (1, H), None))
    return out


def _local_numel(part: str, shape: tuple[int, ...], tp_dim: int | None, layout: Layout, fsdp: bool = True) -> int:
    """Elements of the first rank's shard (FSDP's first chunk is the largest)."""
    dims = list(shape)
    if part == "experts":
        dims[0] //= layout.ep
        if fsdp and layout.fsdp > 1:  # FSDP over the ranks holding the same experts, on dim 1 (dim 0 is EP's)
            dims[1] = math.ceil(dims[1] / (layout.data_parallel // layout.ep))
        return math.prod(dims)
    if tp_dim is not None:
        dims[tp_dim] = math.ceil(dims[tp_dim] / layout.tp)
    if fsdp:
        dims[0] = math.ceil(dims[0] / layout.fsdp)
    return math.prod(dims)


def _stage_tensors(cfg: ModelConfig, stage: Stage) -> list:
    V, H = cfg.vocab_size, cfg.hidden_size
    tensors = [("embedding", (V, H), None)] if stage.first else []
    for i in stage.layers:
        tensors += layer_tensors(cfg, i)
    if stage.last:
        tensors.append(("norms", (H,), None))
        if not cfg.tie_embeddings:
            tensors.append(("head", (V, H), None))
    return tensors


def param_tensors(cfg: ModelConfig, layout: Layout, stage: Stage) -> list[tuple[str, int]]:
    """(part, local numel) of every parameter tensor a rank of ``stage`` holds."""
    return [(part, _local_numel(part, shape, tp_dim, layout)) for part, shape, tp_dim in _stage_tensors(cfg, stage)]


# ---------------------------------------------------------------------------------------------------
# Activations of one micro-batch
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shapes:
    T: int  # tokens of the micro-batch (attention, projections, residual stream)
    Tm: int  # tokens the MoE layer routes on this rank (the TP ranks split them)
    R: int  # expert rows this rank computes and combines
    a: int  # bytes of the compute dtype
    r: int  # bytes of the residual stream: fp32, or bf16 when FSDP computes in bf16 parameters
    casts: bool  # autocast over fp32 weights: each projection keeps its own bf16 copy of its input
    cpu: bool


def _shapes(cfg: ModelConfig, layout: Layout, wl: Workload) -> _Shapes:
    Tm = math.ceil(wl.tokens / layout.tp)
    k = min(cfg.top_k, cfg.num_experts)
    R = Tm * k
    if cfg.capacity_factor is not None and cfg.num_experts:  # capacity bounds the rows (moe.dispatch)
        R = min(R, cfg.num_experts * min(Tm, math.ceil(Tm * k / cfg.num_experts * cfg.capacity_factor)))
    a = DTYPE_BYTES[wl.dtype]
    bf16_params = a == 2 and layout.fsdp > 1 and wl.device == "cuda"  # the trainer's FSDP param_dtype
    return _Shapes(wl.tokens, Tm, R, a, a if bf16_params else FP32, a == 2 and not bf16_params, wl.device == "cpu")


def _attention(cfg: ModelConfig, layout: Layout, s: _Shapes) -> int:
    H, D = cfg.hidden_size, cfg.attn_head_dim
    N, K = cfg.num_heads // layout.tp, cfg.num_kv_heads // layout.tp
    inputs = 3 * s.T * H * s.a if s.casts else s.T * H * s.r
    kept = s.T * (2 * N + 2 * K) * D * s.a + s.T * N * FP32  # q, k (after RoPE), v, output; logsumexp
    copy = s.T * N * D * s.a if s.cpu else 0  # CPU SDPA returns [B, N, S, D]: the reshape for wo copies
    return inputs + kept + copy


def _router(cfg: ModelConfig, s: _Shapes) -> int:
    E, k, T, H = cfg.num_experts, cfg.top_k, s.Tm, cfg.hidden_size
    opts = cfg.router_options
    b = 2 * T * E * FP32 + T * FP32 + T * k * (INT64 + FP32)  # logits, scores, logsumexp; ids, gathered scores
    sigmoid = opts.get("score", "softmax") == "sigmoid"
    if (cfg.router == "topk" and opts.get("normalize", k > 1)) or sigmoid:  # weights / their clamped sum
        b += 2 * T * FP32 + T * k * FP32
    elif opts.get("scaling", 1.0) != 1.0:
        b += T * k * FP32
    b += T * FP32 if sigmoid else 0  # the balance distribution divides by the scores' sum
    if cfg.router == "switch" and opts.get("jitter", 0.01) > 0:  # the noise and the jittered input
        b += 2 * T * H * FP32
    if s.r != FP32:  # bf16 residual: the router's fp32 copy of its input
        b += T * H * FP32
    return b


def _moe(cfg: ModelConfig, layout: Layout, s: _Shapes, node_rows: float) -> dict[str, int]:
    """The MoE FFN's internals (its input is counted by the caller)."""
    H, k, F = cfg.hidden_size, cfg.top_k, cfg.moe_ffn_hidden_size
    dispatch = s.Tm * k * INT64 + s.R * INT64 + (2 * s.R * INT64 if layout.ep > 1 else 0)
    dispatch += int(node_rows * s.Tm) * (H * s.a + INT64)  # two-level: one partial sum back per (token, node)
    experts = s.R * H * (s.a if s.casts else s.r) + s.R * F * EXPERT_HIDDEN[cfg.activation] * s.a + s.R * H * s.a
    out = {"router": _router(cfg, s), "dispatch": dispatch, "experts": experts}
    if cfg.shared_ffn_hidden_size:
        shared = s.Tm * cfg.shared_ffn_hidden_size * DENSE_HIDDEN[cfg.activation] * s.a
        shared += s.Tm * H * s.a * (s.casts + cfg.shared_expert_gate) + 2 * s.Tm * FP32 * cfg.shared_expert_gate
        out["shared_expert"] = shared
    return out


def _block(cfg: ModelConfig, layout: Layout, s: _Shapes, i: int, node_rows: float) -> tuple[dict, dict]:
    """Block i's activations: (kept outside the FFN, the FFN's internals)."""
    H = cfg.hidden_size
    norms = 2 * s.T * FP32 + (2 * s.T * H * s.r if s.cpu else 0)  # rsqrt; x * rsqrt on CPU
    outer = {"residual": 2 * s.T * H * s.r, "norms": norms, "attention": _attention(cfg, layout, s)}
    if cfg.is_moe_layer(i):
        outer["ffn_input"] = s.T * H * s.r  # kept by the router (whose own input cast is in _router)
        return outer, _moe(cfg, layout, s, node_rows)
    outer["ffn_input"] = s.T * H * (s.a if s.casts else s.r)
    F = cfg.ffn_hidden_size // layout.tp
    return outer, {"dense_ffn": s.T * F * DENSE_HIDDEN[cfg.activation] * s.a}


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for key, v in part.items():
        total[key] = total.get(key, 0) + v


def stage_activations(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage,
                      node_rows: float = 0.0) -> tuple[dict[str, int], int]:
    """One micro-batch's activations on a rank of ``stage`` by part, and the recompute transient."""
    s, H, mode = _shapes(cfg, layout, wl), cfg.hidden_size, wl.activation_checkpointing
    out, recompute = {"rope": wl.seq_len * cfg.attn_head_dim * FP32}, 0  # cos, sin [S, D/2], shared
    for i in stage.layers:
        outer, ffn = _block(cfg, layout, s, i, node_rows)
        inner = sum(ffn.values())
        if mode == "full":  # only the block input stays; backward recomputes the whole block
            _add(out, {"residual": s.T * H * s.r})
            recompute = max(recompute, sum(outer.values()) - s.T * H * s.r + inner)
            continue
        if mode == "ffn":  # the checkpoint keeps the FFN's input (the norm output) and recomputes the rest
            outer["ffn_input"] = s.T * H * s.r
            recompute = max(recompute, inner)
        else:
            _add(out, ffn)
        _add(out, outer)
    if stage.first:
        out["embedding"] = s.T * INT64  # token ids
    if stage.last:  # last block's output, final norm, lm_head input, fp32 log-softmax
        norm = s.T * FP32 + (s.T * H * s.r if s.cpu else 0)
        out["head"] = s.T * H * s.r + norm + s.T * H * (s.a if s.casts else s.r) + s.T * cfg.vocab_size * FP32
    else:  # the stage output waits for its gradient
        _add(out, {"residual": s.T * H * s.r})
    return out, recompute


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


def _weight_copies(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage) -> tuple[int, int]:
    """bf16 copies of matmul weights: (kept until backward: autocast's, transient: FSDP's unsharded)."""
    if wl.dtype == "float32":
        return 0, 0
    a = DTYPE_BYTES[wl.dtype]
    if layout.fsdp > 1:  # FSDP all-gathers each block in bf16 and frees it after use; two are live at once
        largest = max((sum(_local_numel(*t, layout, fsdp=False) for t in layer_tensors(cfg, i))
                       for i in stage.layers), default=0)
        return 0, 2 * largest * a
    matmul = ("attention", "dense_ffn", "experts", "shared_expert", "head")
    kept = sum(n for part, n in param_tensors(cfg, layout, stage) if part in matmul)
    if cfg.tie_embeddings and stage.last:  # the tied output projection casts the embedding table
        kept += cfg.vocab_size * cfg.hidden_size
    return kept * a, 0


def estimate_memory(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage | None = None,
                    ranks_per_node: int | None = None, hierarchical: bool | None = None) -> MemoryEstimate:
    """Per-rank bytes of a rank of ``stage`` (default: pipeline rank 0, even split) training with AdamW."""
    stage = stage or even_stages(cfg, layout, wl.pp_stages_per_rank)[0]
    tensors = param_tensors(cfg, layout, stage)
    numel = sum(n for _, n in tensors)
    traffic = all_to_all(cfg, layout, wl, stage, ranks_per_node, hierarchical)
    per_mb, recompute = stage_activations(cfg, layout, wl, stage, traffic.node_rows)
    held = in_flight(layout, wl, stage.index)
    breakdown = {k: int(v * held) for k, v in per_mb.items()}
    kept, gathered = _weight_copies(cfg, layout, wl, stage)
    if kept:
        breakdown["weight_casts"] = kept
    acts = sum(breakdown.values())
    # the loss: logits (and their fp32 copy under autocast) next to the kept log-softmax, then its gradient
    a = DTYPE_BYTES[wl.dtype]
    logits = wl.tokens * cfg.vocab_size * (FP32 + (a if a != FP32 else 0)) if stage.last else 0
    transient = {"recompute": recompute, "fsdp_unsharded": gathered, "logits": logits}
    breakdown.update({f"transient_{k}": v for k, v in transient.items() if v})
    by_part: dict[str, int] = {}
    for part, n in tensors:
        by_part[part] = by_part.get(part, 0) + n
    return MemoryEstimate(stage.index, numel * FP32, numel * FP32, 2 * numel * FP32 + len(tensors) * FP32, acts,
                          sum(transient.values()), by_part, breakdown)


# ---------------------------------------------------------------------------------------------------
# All-to-all bytes per optimizer step: comm.cost_model's rows per token x what moekit sends
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class A2A:
    dispatcher: str  # "none" (ep == 1), "flat" or "hierarchical"
    nodes: int  # nodes the EP group of the rank spans
    ranks_per_node: int  # EP ranks per node
    inter_rows: float  # rows per token crossing nodes, per direction (comm.cost_model)
    intra_rows: float  # rows per token between ranks of a node
    node_rows: float  # hierarchical: partial-sum rows per token (visited nodes, own node included)
    forward: dict[str, float]  # bytes a rank sends per optimizer step in forwards (recomputation included):
    #                            what the trainer's traffic counter logs, by link class "inter" / "intra"
    step: dict[str, float]  # forward + backward


def all_to_all(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage | None = None,
               ranks_per_node: int | None = None, hierarchical: bool | None = None) -> A2A:
    """Expected all-to-all bytes one rank sends per optimizer step, by link class.

    Dispatch and combine send rows in the compute dtype (under autocast the MoE layer casts before it
    dispatches: moe.layer); backward sends each exchange's
    gradient back in the same dtype; activation checkpointing repeats the forward exchanges. Capacity drops
    are ignored (an upper bound), and so are the two-level dispatcher's small id / weight side rows.
    """
    zero = {"inter": 0.0, "intra": 0.0}
    if layout.ep == 1 or not cfg.num_moe_layers:
        return A2A("none", 1, 1, 0.0, 0.0, 0.0, zero, zero)
    stage = stage or even_stages(cfg, layout, wl.pp_stages_per_rank)[0]
    topo = Topology(layout, 0, ranks_per_node or layout.world_size)
    group = topo.members("ep")
    N = len({topo.node_of(r) for r in group})
    G = len(group) // N
    hier = N > 1 if hierarchical is None else hierarchical
    opts, E, k = cfg.router_options, cfg.num_experts, cfg.top_k
    limit = opts.get("group_top_k") if opts.get("num_groups") == N else None  # node-limited routing
    t = (cost_model.hierarchical if hier else cost_model.flat)(N, G, E, k, limit)
    own_node = 1 - (math.comb(E - E // N, k) / math.comb(E, k) if E - E // N >= k else 0.0)
    node_rows = t.inter_rows + own_node if hier else 0.0
    s = _shapes(cfg, layout, wl)
    tokens = s.Tm * wl.microbatches * sum(cfg.is_moe_layer(i) for i in stage.layers)
    row = cfg.hidden_size * 2 * s.a  # one dispatch row + one combine row, both in the compute dtype
    forwards = 1 + (wl.activation_checkpointing != "none")
    fwd = {"inter": tokens * t.inter_rows * row * forwards, "intra": tokens * t.intra_rows * row * forwards}
    step = {"inter": fwd["inter"] + tokens * t.inter_rows * row, "intra": fwd["intra"] + tokens * t.intra_rows * row}
    return A2A("hierarchical" if hier else "flat", N, G, t.inter_rows, t.intra_rows, node_rows, fwd, step)
