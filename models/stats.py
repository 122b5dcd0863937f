"""Parameter counts, active parameters and FLOPs per token, from a model built on the meta device.

Counting a meta model (no memory is allocated) instead of a formula means the numbers always agree
with the code that trains. Active parameters: everything except the routed experts a token does not
visit, i.e. each MoE layer counts top_k of its num_experts routed experts.

FLOPs per token (the convention of Kaplan et al. 2020 / PaLM appendix B, with the causal mask):
    forward  = 2 * active matmul parameters (active parameters except the embedding lookup and the
               RMSNorm scales and biases; a tied output projection counts as a matmul)
             + sum over layers 2 * K * N * (Dqk + Dv)   (q.k and attn.v: 2 FLOPs per key and channel; K the
                                        keys a query sees on average: S / 2 causal, W - W^2 / (2 S) with a
                                        sliding window W < S; Dqk = Dv = D for GQA, nope + rope and v for MLA)
             + per Gated DeltaNet layer (models.linear_attention) in place of the attention term, the chunked delta
               rule's products: P / S * Nv * (4 L dk + 2 L dv + 6 dk dv), L = min(chunk, S) the chunk, P = S rounded
               up to whole chunks (its triangular solves, L^2 (dk + dv) / 2 per chunk and head, are not counted, as
               FlopCounterMode counts none)
    training = 3 * forward         (backward costs twice the forward); a frozen weight (partial training, LoRA's
               base) skips its weight gradient: 2 per active parameter less (``frozen_wgrad_flops``)
With multi-token prediction (models.mtp), depth k runs its projection, block and the shared head on S - k of
every S positions: (S - k) / S * (2 * its active matmul parameters + 2 * head + (S - k) * N * (Dqk + Dv)).

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
    blocks = [*model.layers, *(module.block for module in model.mtp)]
    active = params - sum(_inactive(block, config) for block in blocks)
    embedding = model.embed.weight.numel()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)  # norm scales, biases: not matmuls
    vectors += sum(_expert_bias_vectors(block, config) for block in model.layers)  # 2-d, but biases too
    matmul = active - vectors - embedding + (embedding if config.tie_embeddings else 0)
    per_key = config.num_heads * (config.attn_qk_head_dim + config.attn_v_head_dim)
    forward = 2.0 * matmul + sum(linear_attention_flops(config, seq_len) if config.is_linear_layer(i)
                                 else 2 * mean_keys(seq_len, config.attention_window(i),
                                                    config.attention_chunk_of(i)) * per_key
                                 for i in range(config.num_layers))
    head = embedding if config.tie_embeddings else model.lm_head.weight.numel()
    for k, module in enumerate(model.mtp, start=1):  # models.mtp: depth k runs on S - k of every S positions
        mtp_matmul = (sum(p.numel() for p in module.parameters() if p.dim() >= 2) - _inactive(module.block, config)
                      - _expert_bias_vectors(module.block, config))
        n = max(seq_len - k, 0)
        forward += -2.0 * mtp_matmul + n / seq_len * (2.0 * (mtp_matmul + head) + n * per_key)
    return ModelStats(params, active, embedding, 3.0 * forward, seq_len)


def frozen_wgrad_flops(config: ModelConfig, frozen: set[str], seq_len: int | None = None,
                       model: Transformer | None = None) -> float:
    """Training FLOPs per token that frozen weights do not cost: 2 per active matmul parameter, the weight gradient
    autograd skips for a parameter without ``requires_grad`` (``frozen``: one-process names; LoRA's base weights,
    --train.freeze). Active as in model_stats: an expert stack's top_k / E share, an MTP depth's (S - k) / S. Their
    input gradients still count: exact where every frozen weight's input needs a gradient (something below it
    trains); below the lowest trained parameter autograd skips those too, which this count still includes.
    ``model``: the config's model when the caller has one built (the meta device will do)."""
    seq_len = seq_len or config.max_seq_len
    if not frozen:
        return 0.0
    from moekit.models.init import canonical_name

    if model is None:
        with meta_device():
            model = Transformer(config)
    E = config.num_experts
    head = "embed.weight" if config.tie_embeddings else "lm_head.weight"
    total = 0.0
    for name, p in model.named_parameters():
        name = canonical_name(name)
        if name not in frozen or p.dim() < 2 or (name == "embed.weight" and not config.tie_embeddings):
            continue  # vectors and the embedding lookup are no matmuls (model_stats)
        if name.split(".")[-1] in ("b_in", "b_out"):
            continue  # expert biases: 2-d, added
        f = min(config.top_k, E) / E if ".ffn.experts." in name else 1.0
        if name.startswith("mtp."):
            f *= max(seq_len - int(name.split(".")[1]) - 1, 0) / seq_len
        if name == head:  # the head, which MTP depth k reuses on S - k positions
            f += sum(max(seq_len - k, 0) / seq_len for k in range(1, config.mtp_layers + 1))
        total += 2.0 * p.numel() * f
    return total


def linear_attention_flops(config: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one Gated DeltaNet layer's chunked rule (module docstring), besides its
    projections and convolution (counted with the matmul parameters)."""
    L = max(1, min(config.linear_chunk, seq_len))
    padded = -(-seq_len // L) * L
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return padded / seq_len * config.linear_num_value_heads * (4 * L * dk + 2 * L * dv + 6 * dk * dv)


def mean_keys(seq_len: int, window: int = 0, chunk: int = 0) -> float:
    """Keys a query attends to on average over a causal sequence of seq_len (PaLM's S / 2), with a sliding
    window of ``window`` positions (0: none): W - W^2 / (2 S) when W < S, the same convention's integral; in
    chunks of ``chunk`` (Llama 4): each chunk of C its C / 2, the last one of r its r / 2."""
    if chunk and chunk < seq_len:
        full, rest = divmod(seq_len, chunk)
        return (full * chunk * chunk + rest * rest) / (2 * seq_len)
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def _inactive(layer, config: ModelConfig) -> int:
    """Routed-expert parameters a token does not visit in ``layer`` (a Block)."""
    if not layer.is_moe:
        return 0
    experts = layer.ffn.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_experts  # weights (+ biases)
    return per_expert * (experts.num_experts - min(config.top_k, experts.num_experts))


def _expert_bias_vectors(layer, config: ModelConfig) -> int:
    """Active routed-expert bias parameters in ``layer`` (a Block): [E, .] tensors, yet added, not multiplied."""
    if not layer.is_moe or not layer.ffn.experts.bias:
        return 0
    experts = layer.ffn.experts
    per_expert = (experts.b_in.numel() + experts.b_out.numel()) // experts.num_experts
    return per_expert * min(config.top_k, experts.num_experts)
