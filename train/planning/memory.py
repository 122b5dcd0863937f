"""Per-rank memory and all-to-all traffic of a training layout, from the config alone (no tensors).

Shape legend: T tokens per micro-batch on a rank (micro_batch * seq_len / cp), H hidden, V vocab, N / K query /
key-value heads, D head dim, F FFN width, E experts, k slots per token, R expert rows a rank computes
(T * k when dropless and balanced), a bytes of the compute dtype (2 bf16, 4 fp32).

Every term counts what moekit's code keeps, read off the modules and checked against a measured CPU run
(tests/test_dryrun.py):

    parameters   fp32 master weights: the rank's shard of every tensor (TP, EP, FSDP below)
    gradients    fp32, same shards
    optimizer    AdamW: exp_avg + exp_avg_sq (fp32, same shards) + one fp32 step scalar per tensor; Muon
                 (--train.optimizer muon): one fp32 momentum buffer per weight matrix, AdamW's for the rest; a
                 parameter average (--train.ema_decay, moekit.train.ema): one more fp32 copy, same shards
    activations  what autograd holds from forward to backward, per micro-batch and block, term by term in
                 moekit.train.planning.activations (residual, norms, attention, router, dispatch, experts, dense
                 FFN, head, mtp: the multi-token-prediction depths; activation checkpointing, sequence
                 parallelism)
      weight casts  autocast without FSDP: a bf16 copy of every matmul weight lives until backward, except
                    in checkpointed blocks, whose backward casts again
    Transient (at the peak only): what backward recomputes (one block / one FFN), FSDP's unsharded copies,
    and one chunk of the logits [T, V] with its gradient on the last stage (the loss from hidden states,
    models.loss; the whole logits with models.transformer.LOSS_CHUNKS = "never").

The parallel recipe (models/parallelize.py, comm/tensor_parallel.py, comm/fsdp.py, models/pipeline.py):
    TP shards attention heads and the dense FFN width; embedding, norms, lm_head and the whole MoE layer
    are replicated, and the MoE layer routes a 1/tp slice of the tokens on each TP rank. Sequence
    parallelism (``Workload.sequence_parallel``) also keeps the residual stream and norms on 1/tp of the
    sequence; parameters are unchanged.
    EP shards the experts' dim 0. FSDP shards dense tensors' dim 0 over fsdp x cp (the "world" mesh's "fsdp"
    dim spans a data rank's context-parallel ranks), and experts' dim 1 over the dp x fsdp x cp / ep ranks
    holding the same experts; it computes in bf16 parameters (so the residual stream is bf16 too) and keeps
    two blocks unsharded at a time (transient). Without FSDP, cp ranks hold whole replicas, as dp ranks do.
    CP: each rank holds S / cp positions of every sequence (zigzag chunks, comm.context_parallel): every term
    per token (residual, norms, MoE, loss, all-to-all) is on micro_batch * S / cp tokens; attention keeps the
    keys and values of whole sequences (moekit.train.planning.activations._gqa_kept, _mla).
    Document masking (``Workload.document_mask``): every attention call masked, a mask per sequence
    (moekit.train.planning.activations); the documents [B, S] int32 kept by checkpointed blocks, else a transient.
    PP: a rank holds its stage's layers (``Stage``); activations are multiplied by the micro-batches the
    stage holds at once: GPipe all M, 1F1B pp - stage, interleaved Megatron's warm-up count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moekit.train.planning import cost_model
from moekit.comm.topology import Layout, Topology
from moekit.models.config import ModelConfig
from moekit.moe.activations import get_activation
from moekit.train.planning.activations import (DTYPE_BYTES, FP32, _backend, _loss_chunks, in_flight, shapes,
                                               stage_activations)

AC_MODES = ("none", "full", "ffn", "selective")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Workload:
    micro_batch: int  # sequences per forward on one data-parallel rank
    seq_len: int
    dtype: str = "bfloat16"  # float32 | bfloat16 (autocast over fp32 master weights)
    activation_checkpointing: str = "none"  # none | full | ffn | selective
    device: str = "cuda"  # cuda | cpu: the kernels that run decide what is kept (RMSNorm, SDPA layout)
    microbatches: int = 1  # forward + backward passes per optimizer step on one rank
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    sequence_parallel: bool = False  # with tp > 1: residual, norms and MoE layers on 1/tp of the sequence
    expert_replicas: int = 0  # redundant expert slots over the EP group (--layout.expert_replicas, a placement file)
    cp_rank: int | None = None  # with cp > 1: whose zigzag chunks attention runs (None: the rank keeping the most)
    document_mask: bool = False  # attention within each document of a packed sequence (--data.document_mask)
    optimizer: str = "adamw"  # adamw | muon (train.muon: one momentum buffer per weight matrix, AdamW's rest)
    residual: str = "auto"  # the residual stream's dtype, as train.residual_dtype: auto (bf16 under bf16 autocast on
    #                         CUDA, else fp32), float32, bfloat16 (needs dtype bfloat16)
    ema: bool = False  # a parameter average in the optimizer state (--train.ema_decay): one fp32 copy of the shards
    # partial training (--train.trainable / freeze, moekit.train.freezing): (part, share of its elements that train);
    # gradients, optimizer state and the average exist for those only. Empty: everything trains
    trainable: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        for name, value, allowed in (("dtype", self.dtype, tuple(DTYPE_BYTES)), ("pp_schedule", self.pp_schedule, SCHEDULES),
                                     ("optimizer", self.optimizer, ("adamw", "muon")),
                                     ("activation_checkpointing", self.activation_checkpointing, AC_MODES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is invalid; use one of {list(allowed)}")
        if self.residual not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"residual={self.residual!r} is invalid; use one of ['auto', 'float32', 'bfloat16']")
        if self.residual == "bfloat16" and self.dtype != "bfloat16":
            raise ValueError("residual='bfloat16' needs dtype='bfloat16' (a bf16 residual stream under bf16 autocast)")

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch's whole sequences (a context-parallel rank holds 1 / cp of them)."""
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
    if get_activation(cfg.activation).gated:
        out.append((part, (width, H), dims[0]))  # w_gate
    return out


def attention_tensors(cfg: ModelConfig, i: int | None = None) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(part, full shape, TP-sharded dim or None) of one attention module's parameters (models.attention): layer
    ``i``'s, a Gated DeltaNet's where it is a linear layer (models.linear_attention: under TP wz, wb, wa sharded by
    rows and wo by columns, the rest replicated)."""
    H, N = cfg.hidden_size, cfg.num_heads
    if i is not None and cfg.is_linear_layer(i):
        Nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + Nv * dv
        shapes = [(C, H), (Nv * dv, H), (Nv, H), (Nv, H), (C, 1, cfg.linear_conv_kernel), (Nv,), (Nv,), (dv,),
                  (H, Nv * dv)]  # wqkv, wz, wb, wa, conv_weight, dt_bias, A_log, the gated norm, wo
        dims = (None, 0, 0, 0, None, None, None, None, 1)
        return [("attention", shape, dim) for shape, dim in zip(shapes, dims)]
    if cfg.attention == "mla":
        qk, v, rope, c = cfg.attn_qk_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = ([("attention", (cfg.q_lora_rank, H), None), ("norms", (cfg.q_lora_rank,), None),
              ("attention", (N * qk, cfg.q_lora_rank), 0)] if cfg.q_lora_rank else [("attention", (N * qk, H), 0)])
        return q + [("attention", (c + rope, H), None), ("norms", (c,), None),
                    ("attention", (N * (cfg.qk_nope_head_dim + v), c), 0), ("attention", (H, N * v), 1)]
    K, D = cfg.num_kv_heads, cfg.attn_head_dim
    gate = 2 if cfg.attention_output_gate else 1  # wq also emits the output gate, per head
    out = [("attention", (gate * N * D, H), 0), ("attention", (K * D, H), 0), ("attention", (K * D, H), 0),
           ("attention", (H, N * D), 1)]
    if cfg.attention_bias:
        out += [("attention", (N * D,), 0), ("attention", (K * D,), 0), ("attention", (K * D,), 0)]
    if cfg.attention_out_bias:  # wo is row-parallel under TP: its bias is whole on every rank
        out.append(("attention", (H,), None))
    if cfg.attention_sinks:  # one logit per query head, sharded with the heads
        out.append(("attention", (N,), 0))
    if cfg.qk_norm == "head":  # the norms inside attention count as norms, as dryrun.part_of files them
        out += [("norms", (D,), None), ("norms", (D,), None)]
    elif cfg.qk_norm == "full":  # over the whole projection: sharded with its columns under TP (TPFullRMSNorm)
        out += [("norms", (N * D,), 0), ("norms", (K * D,), 0)]
    return out


def layer_tensors(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(part, full shape, TP-sharded dim or None) of every parameter of block ``i``, LoRA adapters included."""
    return _with_adapters(_base_layer_tensors(cfg, i), cfg, i)


def _base_layer_tensors(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    H = cfg.hidden_size
    out = [("norms", (H,), None), ("norms", (H,), None), *attention_tensors(cfg, i)]
    if not cfg.is_moe_layer(i):
        return out + _dense_mlp(cfg, "dense_ffn", cfg.ffn_hidden_size, tp=True)
    E, F, Fs = cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.shared_ffn_hidden_size
    if cfg.router != "hash":  # hash routing has no gate
        out.append(("router", (E, H), None))
        if cfg.router_options.get("gate_bias"):  # logits = x W^T + b (gpt-oss)
            out.append(("router", (E,), None))
    F_in = get_activation(cfg.activation).in_features(F)
    out += [("experts", (E, H, F_in), None), ("experts", (E, F, H), None)]
    if cfg.moe_ffn_bias:  # b_in, b_out: EP shards dim 0 as the weights', FSDP dim 1
        out += [("experts", (E, F_in), None), ("experts", (E, H), None)]
    if Fs:
        out += _dense_mlp(cfg, "shared_expert", Fs, tp=False)
        if cfg.shared_expert_gate:
            out.append(("shared_expert", (1, H), None))
    return out


LORA_SHARE = "lora"  # Workload.trainable's key for the share of LoRA adapter elements that train


class AdapterPart(str):
    """The part name of a LoRA adapter tensor: equal to (and hashed as) its weight's part, so every by-part count
    files it there, and told apart by its type where only the adapters train (Workload.trainable's LORA_SHARE)."""


def _with_adapters(tensors: list, cfg: ModelConfig, i: int) -> list:
    """LoRA adapters (model.lora_rank) join their weights' parts (AdapterPart), with the dim TP shards them on."""
    if not getattr(cfg, "lora_rank", 0):
        return tensors
    from moekit.models.lora import adapter_shapes
    from moekit.train.planning.dryrun import part_of

    out = []
    for name, shape in adapter_shapes(cfg, i):
        part = AdapterPart(part_of(name))
        # a Linear's A under lora_dropout: moe.lora_dropout's product saves the parameter, not autocast's copy
        part.uncast = bool(cfg.lora_dropout) and name.endswith(".lora_a")
        out.append((part, shape, _adapter_tp_dim(name)))
    return tensors + out


_COLUMNS = ("wq", "wk", "wv", "wq_b", "wkv_b", "wz", "wb", "wa")  # comm.tensor_parallel's column-wise projections


def _adapter_tp_dim(name: str) -> int | None:
    """The dim TP shards a LoRA adapter on: a column-wise projection's B [out, r] on dim 0, with its weight's rows; the
    rest are replicated over TP: that projection's A (comm.tensor_parallel re-places it), a row-wise projection's
    A and B (RowwiseParallel shards the weight alone and replicates the module's other parameters), MLA's wq_a /
    wkv_a, Gated DeltaNet's wqkv, the shared and routed experts."""
    parts = name.split(".")
    where, proj, leaf = parts[-3], parts[-2], parts[-1]
    if leaf != "lora_b":
        return None
    if where == "attn":
        return 0 if proj in _COLUMNS else None
    if where == "ffn":  # a dense block's FFN (an MoE block's shared expert sits one level deeper)
        return 0 if proj in ("w_up", "w_gate") else None
    return None


def _local_numel(part: str, shape: tuple[int, ...], tp_dim: int | None, layout: Layout, fsdp: bool = True,
                 replicas: int = 0) -> int:
    """Elements of the first rank's shard (FSDP's first chunk is the largest). ``replicas``: redundant expert
    slots over the EP group, (E + replicas) / ep slots per rank (comm.placement)."""
    dims = list(shape)
    if part == "experts":
        dims[0] = (dims[0] + replicas) // layout.ep
        if fsdp and layout.fsdp > 1:  # FSDP over the ranks holding the same experts, on dim 1 (dim 0 is EP's)
            dims[1] = math.ceil(dims[1] / (layout.dp_cp // layout.ep))
        return math.prod(dims)
    if tp_dim is not None:
        dims[tp_dim] = math.ceil(dims[tp_dim] / layout.tp)
    if fsdp and layout.fsdp > 1:  # over the fsdp x cp ranks of the "world" mesh (cp ranks hold the same tensors)
        dims[0] = math.ceil(dims[0] / (layout.fsdp * layout.cp))
    return math.prod(dims)


def _stage_tensors(cfg: ModelConfig, stage: Stage) -> list:
    V, H = cfg.vocab_size, cfg.hidden_size
    # the last stage of a pipeline keeps a replica of the embedding for a tied head or MTP (models.pipeline)
    replica = stage.last and (cfg.tie_embeddings or cfg.mtp_layers > 0)
    tensors = [("embedding", (V, H), None)] if stage.first or replica else []
    for i in stage.layers:
        tensors += layer_tensors(cfg, i)
    if stage.last:
        tensors.append(("norms", (H,), None))
        if not cfg.tie_embeddings:
            tensors.append(("head", (V, H), None))
        for k in range(cfg.mtp_layers):  # multi-token prediction depths (models.mtp): norms, projection, block
            tensors += [("norms", (H,), None)] * 3 + [("mtp", (H, 2 * H), None)]
            tensors += layer_tensors(cfg, cfg.num_layers + k)
    return tensors


def param_tensors(cfg: ModelConfig, layout: Layout, stage: Stage, replicas: int = 0) -> list[tuple[str, int]]:
    """(part, local numel) of every parameter tensor a rank of ``stage`` holds (``replicas``: redundant expert
    slots over the EP group)."""
    return [(part, _local_numel(part, shape, tp_dim, layout, replicas=replicas))
            for part, shape, tp_dim in _stage_tensors(cfg, stage)]



def _weight_copies(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage) -> tuple[int, int]:
    """bf16 copies of matmul weights: (kept until backward: autocast's, transient: FSDP's unsharded)."""
    if wl.dtype == "float32":
        return 0, 0
    a = DTYPE_BYTES[wl.dtype]
    if layout.fsdp > 1:  # FSDP all-gathers each block in bf16 and frees it after use; two are live at once
        largest = max((sum(_local_numel(*t, layout, fsdp=False, replicas=wl.expert_replicas) for t in layer_tensors(cfg, i))
                       for i in stage.layers), default=0)
        return 0, 2 * largest * a
    # matmul weights only: a bias's cast copy is not saved (addmm's backward never reads its input bias), and
    # neither are the sinks' (sink_attention's first op on them is a division by the scale); but the loop
    # backend's fused function (moe.loop_experts._LoopGLU) saves the expert biases it was given: their casts
    from moekit.moe.experts import LOOP_FUSED_ACTIVATIONS

    saved_biases = _backend(cfg, wl.device == "cpu") == "loop" and cfg.activation in LOOP_FUSED_ACTIVATIONS

    def cast(tensors) -> int:
        return sum(_local_numel(part, shape, tp_dim, layout, replicas=wl.expert_replicas)
                   for part, shape, tp_dim in tensors
                   if (_matmul_weight(part, shape) and not getattr(part, "uncast", False))
                   or (saved_biases and part == "experts" and len(shape) == 2))

    # the chunked loss (models.loss) casts the head inside its function and keeps no copy (the logits transient
    # counts it); the plain loss's F.linear keeps its cast until backward
    chunks = _loss_chunks()
    kept = cast(t for t in _stage_tensors(cfg, stage) if not (chunks and t[0] == "head"))
    # inside a checkpoint the casts are recomputed too; the head, the MTP depths and, under "ffn", attention
    # run outside one
    mode = wl.activation_checkpointing
    if mode != "none":
        inside = ("dense_ffn", "experts", "shared_expert") if mode == "ffn" else ("attention", "dense_ffn",
                                                                               "experts", "shared_expert")
        kept -= cast(t for i in stage.layers for t in layer_tensors(cfg, i) if t[0] in inside)
    if cfg.tie_embeddings and stage.last and not chunks:  # the tied output projection casts the embedding table
        kept += cfg.vocab_size * cfg.hidden_size
    return kept * a, 0


def _matmul_weight(part: str, shape: tuple[int, ...]) -> bool:
    """Whether a parameter is a matmul weight autocast keeps a copy of: [out, in] Linears, [E, in, out] experts
    (the biases beside them have one dim fewer); the embedding and the fp32 router are never cast."""
    matmul = ("attention", "dense_ffn", "experts", "shared_expert", "head", "mtp")  # mtp: each depth's eh_proj
    return part in matmul and len(shape) == (3 if part == "experts" else 2)


def estimate_memory(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage | None = None,
                    ranks_per_node: int | None = None, hierarchical: bool | None = None) -> MemoryEstimate:
    """Per-rank bytes of a rank of ``stage`` (default: pipeline rank 0, even split) training with AdamW; under
    context parallelism of the cp rank ``wl.cp_rank``, else of the one whose activations are the most (whole: one
    rank's windowed layers may keep more and its full ones less than another's)."""
    stage = stage or even_stages(cfg, layout, wl.pp_stages_per_rank)[0]
    if layout.cp > 1 and wl.cp_rank is None:
        return max((estimate_memory(cfg, layout, replace(wl, cp_rank=r), stage, ranks_per_node, hierarchical)
                    for r in range(layout.cp)), key=lambda e: (e.activations, e.peak))
    tensors = param_tensors(cfg, layout, stage, wl.expert_replicas)
    numel = sum(n for _, n in tensors)
    traffic = all_to_all(cfg, layout, wl, stage, ranks_per_node, hierarchical)
    per_mb, recompute = stage_activations(cfg, layout, wl, stage, traffic.node_rows)
    held = in_flight(layout, wl, stage.index)
    breakdown = {k: int(v * held) for k, v in per_mb.items()}
    kept, gathered = _weight_copies(cfg, layout, wl, stage)
    if kept:
        breakdown["weight_casts"] = kept
    acts = sum(breakdown.values())
    # the loss: logits (and their fp32 copy under autocast) next to the kept log-softmax, then its gradient;
    # from hidden states in chunks (models.loss; a pipeline's last stage too) only one chunk's logits, plus the head in a
    a, tokens = DTYPE_BYTES[wl.dtype], wl.tokens // layout.cp  # a context-parallel rank's loss: its own positions
    low = a if a != FP32 else 0
    if not stage.last:
        logits = 0
    elif _loss_chunks():
        from moekit.models.loss import DEFAULT_CHUNK

        logits = min(tokens, DEFAULT_CHUNK) * cfg.vocab_size * (FP32 + low) + cfg.vocab_size * cfg.hidden_size * low
    else:
        logits = tokens * cfg.vocab_size * (FP32 + low)
    # document masking: each position's document [B, S] int32 (models.attention.document_segments) lives through the
    # forward, its loss included; checkpointed blocks keep it as their input (then an activation, "documents")
    kept_documents = "documents" in per_mb
    documents = wl.micro_batch * wl.seq_len * 4 if wl.document_mask and stage.last and not kept_documents else 0
    transient = {"recompute": recompute, "fsdp_unsharded": gathered, "logits": logits, "documents": documents}
    breakdown.update({f"transient_{k}": v for k, v in transient.items() if v})
    by_part: dict[str, int] = {}
    for part, n in tensors:
        by_part[part] = by_part.get(part, 0) + n
    share = dict(wl.trainable)  # partial training: a part's frozen share has no gradient and no optimizer state

    def trains(part: str) -> float:  # LoRA adapters have a share of their own (AdapterPart)
        return share.get(LORA_SHARE if isinstance(part, AdapterPart) else part, 1.0)

    trained = [(part, n * trains(part) if share else n) for part, n in tensors]
    steps = sum(FP32 for _, n in trained if n)  # AdamW's step scalar per trained tensor
    optimizer = 2 * sum(n for _, n in trained) * FP32 + steps  # AdamW: two moments and a step scalar per tensor
    if wl.optimizer == "muon":  # a momentum buffer per weight matrix (train.muon), AdamW's state for the rest
        matrix = [_muon_matrix(part, shape) for part, shape, _ in _stage_tensors(cfg, stage)]
        optimizer = sum(n * FP32 if m else (2 * n * FP32 + FP32 if n else 0) for (_, n), m in zip(trained, matrix))
    grads = int(sum(n for _, n in trained)) * FP32
    if wl.ema:  # the parameter average (moekit.train.ema): a copy of every trained shard in the optimizer state
        optimizer += grads
    return MemoryEstimate(stage.index, numel * FP32, grads, int(optimizer), acts, sum(transient.values()), by_part,
                          breakdown)


def _muon_matrix(part: str, shape: tuple[int, ...]) -> bool:
    """Whether train.muon orthogonalises this parameter: a weight matrix (or expert stack), not the embedding, the
    head, a norm or a bias (expert biases: the experts' 2-D tensors)."""
    return len(shape) >= 2 and part not in ("embedding", "head") and not (part == "experts" and len(shape) == 2)


# ---------------------------------------------------------------------------------------------------
# All-to-all bytes per optimizer step: moekit.train.planning.cost_model's rows per token x what moekit sends
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class A2A:
    dispatcher: str  # "none" (ep == 1), "flat" or "hierarchical"
    nodes: int  # nodes the EP group of the rank spans
    ranks_per_node: int  # EP ranks per node
    inter_rows: float  # rows per token crossing nodes, per direction (moekit.train.planning.cost_model)
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
    s = shapes(cfg, layout, wl)
    tokens = s.Tm * wl.microbatches * sum(cfg.is_moe_layer(i) for i in stage.layers)
    row = cfg.hidden_size * 2 * s.a  # one dispatch row + one combine row, both in the compute dtype
    forwards = 1 + (wl.activation_checkpointing != "none")
    fwd = {"inter": tokens * t.inter_rows * row * forwards, "intra": tokens * t.intra_rows * row * forwards}
    step = {"inter": fwd["inter"] + tokens * t.inter_rows * row, "intra": fwd["intra"] + tokens * t.intra_rows * row}
    return A2A("hierarchical" if hier else "flat", N, G, t.inter_rows, t.intra_rows, node_rows, fwd, step)
