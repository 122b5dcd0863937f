"""Decoder-only MoE transformer: Mixtral-, Switch- and DeepSeek-style by configuration.

Shape legend: B batch, S sequence, H hidden, V vocab, N query heads, K key/value heads, D head dim,
T = B*S tokens.

    tokens [B, S] -> embed -> L x Block -> RMSNorm -> lm_head -> logits [B, S, V]
    Block:  h = x + Attention(RMSNorm(x))          causal, RoPE, GQA, scaled_dot_product_attention
            y = h + FFN(RMSNorm(h))                FFN = MoELayer or DenseMLP (config.is_moe_layer)

Single-device code: nothing here knows about ranks (DESIGN.md); comm/ parallelises a built model.
Build on the meta device, move with ``to_empty``, then ``init_weights(seed)``: every parameter is
filled from one generator in module order, so the weights depend on the seed only.

Incremental decoding (generation): ``model(tokens [B, S_new], cache=KVCache(...))`` runs only the new
positions P .. P+S_new-1 (P = ``cache.length``): RoPE at those positions, attention over the cached keys
and values plus the new ones, MoE layers routing the new tokens only. With a router whose choice for a
token depends on that token alone (top-k / switch / hash without capacity, Sinkhorn in eval) the logits
equal a full forward of the whole sequence up to rounding. Without ``cache`` the forward is the training
one, unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.models.config import ModelConfig
from moekit.moe import DenseMLP, MoELayer, build_router


def rope_angles(seq_len: int, head_dim: int, theta: float, device, start: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin [S, D/2] of position * theta^(-2i/D) (Su et al. 2021) for positions start .. start+S-1, in
    float32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # [D/2]
    positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)  # [S]
    angles = torch.outer(positions, inv_freq)  # [S, D/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, heads, S, D] by the position angle (GPT-NeoX/HF layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, n, S, D/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [B, n, S, D]
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: K key/value heads serve N query heads (N % K == 0)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.attn_head_dim
        H, D = config.hidden_size, self.head_dim
        self.wq = nn.Linear(H, self.num_heads * D, bias=False)
        self.wk = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.wv = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.wo = nn.Linear(self.num_heads * D, H, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV | None = None) -> Tensor:
        """x [B, S, H] at the positions cos/sin describe. ``kv``: this layer's cache (incremental decoding);
        the new keys/values are appended and the queries attend to every cached position as well."""
        B, S, _ = x.shape
        # -1 heads: under tensor parallelism this rank's q/k/v projections produce N/tp and K/tp heads
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, N, S, D]
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, K, S, D]
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, K, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.num_kv_heads != self.num_heads
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # [B, N, S, D]
        else:
            start = kv.length
            k, v = kv.append(k, v)  # [B, K, start+S, D]: every position so far
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(start, S, q.device),
                                               is_causal=start == 0 and S > 1, enable_gqa=gqa)  # [B, N, S, D]
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]


def causal_mask(start: int, new: int, device) -> Tensor | None:
    """[new, start+new] bool: query start+i sees keys 0 .. start+i. None where no mask is needed: one new
    query sees every key; a first chunk (start 0) is plain causal attention (is_causal)."""
    if new == 1 or start == 0:
        return None
    keys = torch.arange(start + new, device=device)  # [P+S]
    return keys[None, :] <= torch.arange(start, start + new, device=device)[:, None]  # [S, P+S]


class LayerKV:
    """One attention layer's cached keys and values: [B, K, capacity, D] buffers, ``length`` filled.

    Allocated at the first ``append`` with the keys' batch, heads, dtype and device (the model's compute
    dtype: autocast's when it is on), so one cache serves any model without being told its layout."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, K, S, D] at positions length .. length+S-1; return every position's [B, K, length, D]."""
        B, K, S, D = k.shape
        end = self.length + S
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; appending {S} at position {self.length} "
                             f"overflows it: make a larger cache (at most model.max_seq_len) or start a new one")
        if self.keys is None:
            self.keys = k.new_empty(B, K, self.capacity, D)
            self.values = v.new_empty(B, K, self.capacity, D)
        elif self.keys.shape[0] != B or self.keys.dtype != k.dtype:
            raise ValueError(f"KV cache was filled with batch {self.keys.shape[0]} in {self.keys.dtype}, got batch "
                             f"{B} in {k.dtype}; use one cache per batch of sequences")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Per-layer keys and values of the positions decoded so far (``Transformer.forward(tokens, cache=...)``).

    ``capacity``: the most positions it will hold (default and limit: model.max_seq_len). Memory is
    2 * L * B * K * capacity * D elements, allocated as the layers first write. A cache belongs to one
    batch of sequences that all share positions: start a new one for another prompt.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        capacity = config.max_seq_len if capacity is None else capacity
        if not 1 <= capacity <= config.max_seq_len:
            raise ValueError(f"KV cache capacity {capacity} is invalid; it must be in [1, model.max_seq_len="
                             f"{config.max_seq_len}]")
        self.capacity = capacity
        self.layers = [LayerKV(capacity) for _ in range(config.num_layers)]

    @property
    def length(self) -> int:
        """Positions cached: the next token's position."""
        return self.layers[0].length if self.layers else 0


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        H = config.hidden_size
        self.attn_norm = nn.RMSNorm(H, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = nn.RMSNorm(H, eps=config.norm_eps)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            router = build_router(config.router, H, config.num_experts, **config.router_kwargs())
            self.ffn = MoELayer(H, config.moe_ffn_hidden_size, config.num_experts, router, config.activation,
                                config.shared_ffn_hidden_size, shared_expert_gate=config.shared_expert_gate,
                                backend=config.expert_backend)
        else:
            self.ffn = DenseMLP(H, config.ffn_hidden_size, config.activation)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, tokens: Tensor, kv: LayerKV | None = None) -> Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, kv=kv)  # [B, S, H]
        f = self.ffn_norm(h)
        return h + (self.ffn(f, token_ids=tokens) if self.is_moe else self.ffn(f))  # [B, S, H]


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        # Tied: the output projection reads embed.weight directly, so there is one Parameter and no
        # tie to restore after to_empty() or a checkpoint load.
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """tokens [B, S] int64 -> logits [B, S, V] float32.

        ``cache``: incremental decoding (module docstring): tokens are the positions after the cached ones,
        whose keys and values are appended to it."""
        B, S = tokens.shape
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"KV cache has {len(cache.layers)} layers, the model {len(self.layers)}; build it with "
                             f"KVCache(model.config)")
        start = 0 if cache is None else cache.length  # position of tokens[:, 0]
        if start + S > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + S} exceeds model.max_seq_len={self.config.max_seq_len}")
        cos, sin = rope_angles(S, self.config.attn_head_dim, self.config.rope_theta, tokens.device, start)  # [S, D/2]
        x = self.embed(tokens)  # [B, S, H]
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, cos, sin, tokens)  # [B, S, H]
            else:
                x = layer(x, cos, sin, tokens, cache.layers[i])  # [B, S, H]
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight  # [V, H]
        return F.linear(x, weight).float()  # [B, S, V]

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter and buffer from ``seed`` alone (device and layout independent).

        Residual-stream inputs (embedding, q/k/v, FFN in, router) get N(0, init_std); projections
        back into the residual stream (attention out, FFN out) get init_std / sqrt(2 L) (GPT-2) so the
        residual's variance does not grow with depth. Draws happen on the CPU generator and are
        copied, so a GPU run starts from the same weights as a CPU run.
        """
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        std, std_out = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def normal_(t: Tensor, s: float) -> None:
            t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, s, generator=gen))

        normal_(self.embed.weight, std)
        for layer in self.layers:
            for norm in (layer.attn_norm, layer.ffn_norm):
                norm.weight.fill_(1.0)
            for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv):
                normal_(w.weight, std)
            normal_(layer.attn.wo.weight, std_out)
            init_ffn(layer.ffn, normal_, std, std_out)
        self.norm.weight.fill_(1.0)
        if self.lm_head is not None:
            normal_(self.lm_head.weight, std)


def init_ffn(ffn: nn.Module, normal_, std: float, std_out: float) -> None:
    """Initialise a DenseMLP or an MoELayer (router, experts, shared expert, router state)."""
    if isinstance(ffn, DenseMLP):
        if ffn.w_gate is not None:
            normal_(ffn.w_gate.weight, std)
        normal_(ffn.w_up.weight, std)
        normal_(ffn.w_out.weight, std_out)
        if ffn.gate is not None:
            normal_(ffn.gate.weight, std)
        return
    if ffn.router.weight is not None:
        normal_(ffn.router.weight, std)
    normal_(ffn.experts.w_in, std)
    normal_(ffn.experts.w_out, std_out)
    if ffn.shared_expert is not None:
        init_ffn(ffn.shared_expert, normal_, std, std_out)
    for _, buf in ffn.router.named_buffers():  # e.g. the aux-loss-free expert_bias and its pending load
        buf.zero_()


def build_model(config: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build on the meta device (no memory, no init), materialise on ``device``, init from ``seed``."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
