"""The shapes the activation estimate reads (moekit.train.planning.activations and .attention_memory): tokens per
rank under every layout, dtype bytes, the attention path, as ``Shapes`` of a configuration, layout and workload."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moekit.comm.topology import Layout
from moekit.models.attention import explicit_attention_applies
from moekit.models.config import ModelConfig

if TYPE_CHECKING:  # moekit.train.planning.memory imports the activations, which import this module
    from moekit.train.planning.memory import Workload

FP32, INT64 = 4, 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Shapes:
    T: int  # tokens of the micro-batch (attention, projections, dense MLP: gathered under SP)
    Ts: int  # tokens of the residual stream and norms on this rank: T, or T / tp with sequence parallelism
    Tm: int  # tokens the MoE layer routes on this rank (the TP ranks split them)
    R: int  # expert rows this rank computes and combines
    a: int  # bytes of the compute dtype
    r: int  # bytes of the residual stream: fp32, or bf16 (FSDP's bf16 parameters, or Workload.residual)
    casts: bool  # autocast over fp32 weights and an fp32 residual stream: each projection keeps its own bf16 copy of
    #              its input
    autocast: bool  # autocast over fp32 weights (no FSDP bf16 parameters): the weights' bf16 casts
    #                 (memory.weight_casts)
    cpu: bool
    S: int  # sequence length (the whole sequence's: the keys a query may see)
    explicit_attention: bool  # attention as bmm + softmax + bmm (models.attention.explicit_attention_applies)
    cp: int = 1  # context-parallel ranks splitting each sequence: T holds S / cp positions of each
    cp_rank: int | None = None  # whose zigzag chunks; None: the rank whose attention keeps the most
    documents: bool = False  # document masking: every call masked, by a [B, 1, queries, keys] mask

    @property
    def norm_in(self) -> int:
        """Bytes per element of the input a residual-stream RMSNorm keeps: the input itself on CUDA (the fused kernel),
        an fp32 copy on CPU (the composite kernel upcasts a bf16 residual stream; an fp32 one is its own copy)."""
        return FP32 if self.cpu else self.r

    @property
    def w(self) -> int:
        """Bytes of the parameters as the head's weight gradient holds them: fp32, or FSDP's bf16 compute copies."""
        return self.a if self.a == 2 and not self.autocast else FP32

    @property
    def B(self) -> int:
        """Sequences of the micro-batch."""
        return self.T * self.cp // self.S


def shapes(cfg: ModelConfig, layout: Layout, wl: Workload) -> Shapes:
    T = wl.tokens // layout.cp  # context parallel: this rank's S / cp positions of each sequence
    Tm = math.ceil(T / layout.tp)  # with SP the same: S / cp % tp == 0 (comm.tensor_parallel checks)
    Ts = Tm if wl.sequence_parallel and layout.tp > 1 else T
    k = min(cfg.top_k, cfg.num_experts)
    R = Tm * k
    if cfg.capacity_factor is not None and cfg.num_experts:  # capacity bounds the rows (moe.dispatch)
        R = min(R, cfg.num_experts * min(Tm, math.ceil(Tm * k / cfg.num_experts * cfg.capacity_factor)))
    a = DTYPE_BYTES[wl.dtype]
    bf16_params = fsdp_bf16_params(layout, wl)
    r = residual_bytes(wl, layout)
    # under context parallelism attention always runs SDPA, chunk by chunk (models.attention.context_attend), and
    # with documents straight through local_attention (models.attention.attend)
    explicit = layout.cp == 1 and not wl.document_mask and explicit_attention_applies(
        wl.device, torch.bfloat16 if a == 2 else torch.float32, wl.micro_batch, cfg.num_heads // layout.tp, wl.seq_len)
    return Shapes(T, Ts, Tm, R, a, r, a == 2 and r == FP32, a == 2 and not bf16_params, wl.device == "cpu",
                  wl.seq_len, explicit, layout.cp, wl.cp_rank, wl.document_mask)


def fsdp_bf16_params(layout: Layout, wl: Workload) -> bool:
    """Whether FSDP computes in bf16 parameters (the trainer's param_dtype: bf16 training on CUDA with fsdp > 1)."""
    return DTYPE_BYTES[wl.dtype] == 2 and layout.fsdp > 1 and wl.device == "cuda"


def residual_bytes(wl: Workload, layout: Layout) -> int:
    """Bytes of the residual stream's dtype (the trainer's train.residual_dtype: train.validation.residual_dtype):
    float32 / bfloat16 as asked; auto the compute dtype on CUDA (FSDP's bf16 parameters, or the embedding's output
    cast under autocast), fp32 on CPU."""
    if wl.residual == "float32":
        return FP32
    if wl.residual == "bfloat16" or fsdp_bf16_params(layout, wl) or wl.device == "cuda":
        return DTYPE_BYTES[wl.dtype]
    return FP32
