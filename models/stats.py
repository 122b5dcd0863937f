"""Parameter counts, active parameters and FLOPs per token, from a model built on the meta device.

Counting a meta model (no memory is allocated) instead of a formula means the numbers always agree
with the code that trains. Active parameters: everything except the routed experts a token does not
visit, i.e. each MoE layer counts top_k of its num_experts routed experts.

FLOPs per token (the convention of Kaplan et al. 2020 / PaLM appendix B, with the causal mask):
    forward  = 2 * active matmul parameters (active parameters except the embedding lookup and the
               RMSNorm scales and biases; a tied output projection counts as a matmul)
             + L * S * N * (Dqk + Dv)   (q.k and attn.v: 2 FLOPs per key and channel, half the keys on
                                        average; Dqk = Dv = D for GQA, nope + rope and v for MLA)
    training = 3 * forward         (backward costs twice the forward)

tests/test_models.py checks this count against torch's FlopCounterMode over a real forward and backward
(GQA and MLA attention, tied heads, shared and gated shared experts, dense first layers), exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

from moekit.models.config import ModelConfig
from moekit.models.transformer import Transformer, meta_device


@dataclass(frozen=True)
class ModelStats:
    params: int  # all parameters
    active_params: int  # parameters one token uses
    embedding_params: int  # the input embedding table (lookup, not a matmul)
    train_flops_per_token: float  # at sequence length seq_len
    seq_len: int

    def describe(self) -> str:
        return (f"{self.params / 1e9:.3f}B parameters, {self.active_params / 1e9:.3f}B active, "
                f"{self.train_flops_per_token / 1e9:.3f} GFLOP per token trained at seq {self.seq_len}")


def model_stats(config: ModelConfig, seq_len: int | None = None) -> ModelStats:
    """Count on the meta device; ``seq_len`` defaults to config.max_seq_len."""
    seq_len = seq_len or config.max_seq_len
    with meta_device():
        model = Transformer(config)
    params = sum(p.numel() for p in model.parameters())
    inactive = 0
    for layer in model.layers:
        if layer.is_moe:
            experts = layer.ffn.experts
            per_expert = (experts.w_in.numel() + experts.w_out.numel()) // experts.num_experts
            inactive += per_expert * (experts.num_experts - min(config.top_k, experts.num_experts))
    active = params - inactive
    embedding = model.embed.weight.numel()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)  # norm scales, biases: not matmuls
    matmul = active - vectors - embedding + (embedding if config.tie_embeddings else 0)
    attention = config.num_layers * seq_len * config.num_heads * (config.attn_qk_head_dim + config.attn_v_head_dim)
    return ModelStats(params, active, embedding, 3.0 * (2.0 * matmul + attention), seq_len)
