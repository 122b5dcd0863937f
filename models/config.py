"""ModelConfig and the named presets.

A config is plain data: every field is a number, a string, a bool or a small dict, so it round-trips
through TOML, JSON and command-line overrides. ``validate()`` checks everything short of building a
router; building the model (on the meta device, which allocates nothing) checks the router options.
Router configuration lives here too: ``router_kwargs()`` (what build_router gets) and ``set_router()``.

Layer pattern: layer i has an MoE FFN iff i >= first_dense_layers and
(i - first_dense_layers) % moe_every == moe_every - 1; every other layer has a dense FFN.

    mixtral  (moe_every=1, first_dense_layers=0):  M M M M
    switch   (moe_every=2, first_dense_layers=0):  D M D M
    deepseek (moe_every=1, first_dense_layers=1):  D M M M
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

# Options every router family understands under these names, with the value that means "off": build_router()
# gets each one the router accepts (ModelConfig.router_kwargs); a router that does not take one behaves as
# if it had that value. Router-specific options go in ``router_options``.
COMMON_ROUTER_FIELDS = {"top_k": 1, "capacity_factor": None, "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}


@dataclass
class ModelConfig:
    name: str = "custom"  # preset name, for logs and checkpoints
    vocab_size: int = 256  # byte-level by default: the embedded data has 256 symbols
    hidden_size: int = 128  # H, the residual stream width
    num_layers: int = 4  # L decoder blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA); must divide num_heads
    head_dim: int = 0  # 0 = hidden_size // num_heads
    max_seq_len: int = 256  # longest sequence the model is trained / evaluated on
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the input embedding with the output projection
    # Dense FFN (layers without experts)
    ffn_hidden_size: int = 512  # dense FFN width
    activation: str = "swiglu"  # swiglu | gelu | relu, for dense and expert FFNs
    # Mixture of experts
    num_experts: int = 8  # E routed experts per MoE layer (0 = dense model)
    moe_ffn_hidden_size: int = 256  # width of one routed expert
    shared_ffn_hidden_size: int = 0  # > 0: an always-on shared expert of this width (DeepSeek)
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w_g) gates the shared expert per token
    moe_ffn_bias: bool = False  # routed experts' projections carry biases b_in [E, F_in], b_out [E, H] (gpt-oss)
    moe_every: int = 1  # an MoE FFN every n-th layer (Switch: 2)
    first_dense_layers: int = 0  # leading layers that keep a dense FFN (DeepSeek: 1-3)
    router: str = "topk"  # registered router name or "package.module:Class"
    top_k: int = 2  # experts per token (routers that take it)
    capacity_factor: float | None = None  # None = dropless
    aux_loss_coeff: float = 0.01  # load-balance loss weight (routers that take it)
    z_loss_coeff: float = 0.0  # router z-loss weight
    router_options: dict[str, Any] = field(default_factory=dict)  # router-specific build_router options
    expert_backend: str = "auto"  # auto | torch | loop | triton (see moe.experts)
    init_std: float = 0.02  # std of embeddings, projections into the residual stream, router
    # Attention variants (models.attention)
    attention: str = "gqa"  # gqa (grouped-query) | mla (DeepSeek-V2/V3 multi-head latent attention)
    attention_bias: bool = False  # gqa: a bias on wq, wk, wv (Qwen2 qkv_bias); never on wo
    qk_norm: str = "none"  # gqa: none | head (RMSNorm(D) on each q/k head, Qwen3) | unit (the same without a weight,
    #                        on the RoPE layers only: Llama 4's L2Norm) | full (RMSNorm over the
    #                        whole q [N*D] and k [K*D] projections, OLMoE); before RoPE
    qkv_clip: float = 0.0  # gqa, > 0: clamp q, k, v to [-clip, clip] after projection and norm (OLMoE clip_qkv)
    attention_out_bias: bool = False  # gqa: a bias on wo as well (gpt-oss's o_proj)
    attention_sinks: bool = False  # gqa: a learned logit per query head joins each softmax's denominator and
    #   takes no value (gpt-oss): softmax over [q.k_0, ..., q.k_j, sink_n], the sink's share dropped
    sliding_window: int = 0  # > 0: a query sees only the last sliding_window positions, itself included
    #   (transformers' kv > q - window), on the layers full_attention_every leaves sliding
    full_attention_every: int = 0  # with a window, layer i attends fully iff (i + 1) % n == 0 (gpt-oss 2: layers
    #   1, 3, ... full, 0, 2, ... sliding; Gemma-3 6); 0 = every layer slides (Mistral-7B v0.1). With
    #   linear_attention the same rule picks the softmax-attention layers among linear ones (Qwen3.5: 4)
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {} = plain RoPE; else transformers'
    #   rope_parameters without rope_theta: {"rope_type": "linear" | "yarn" | "llama3", "factor": ..., ...}
    partial_rotary_factor: float = 1.0  # gqa: the fraction of each q/k head RoPE rotates, first channels (GLM-4.5 0.5)
    rope_pairs: str = "half"  # gqa: the channels RoPE rotates together: half (i with i + R/2: Llama, Qwen, Mixtral)
      # or adjacent (2i with 2i + 1: ERNIE 4.5, GPT-J); MLA's is rope_interleave
    attention_output_gate: bool = False  # gqa: each head's output is multiplied by sigmoid of a gate that wq also
    #   emits, stored per head after its query rows ([q_n | gate_n], Qwen3-Next / Qwen3.5 gated attention)
    # Llama 4: interleaved RoPE / NoPE layers, chunked attention, a query temperature, input-weighted top-1 experts
    nope_every: int = 0  # > 0: layer i has no RoPE (NoPE) iff (i + 1) % nope_every == 0 (Llama 4: 4); 0: RoPE on
    #   every layer
    attention_chunk: int = 0  # > 0: the RoPE layers attend within chunks of this many positions, causally (query i
    #   sees key j iff j <= i and j // chunk == i // chunk; Llama 4: 8192); the NoPE layers attend to everything
    attn_temperature_floor: int = 0  # > 0: the NoPE layers scale each query at position p by
    #   1 + attn_temperature_scale * log(1 + floor((p + 1) / floor)) (Llama 4: 8192, 0.1: 1 below position 8191)
    attn_temperature_scale: float = 0.1  # the strength of that temperature (Llama 4: attn_scale 0.1)
    router_weight_on_input: bool = False  # MoE, top-1: the router's weight scales the token before its expert, not
    #   the expert's output (Llama 4; Megatron's moe_apply_probs_on_input)
    norm_zero_centered: bool = False  # every RMSNorm of the residual stream and q/k stores w - 1 and scales by 1 + w
    #   (Qwen3-Next / Qwen3.5): initialised at 0, so weight decay pulls toward the identity
    # Linear attention (models.linear_attention): Gated DeltaNet layers (Qwen3-Next, Qwen3.5), every layer that
    # full_attention_every leaves linear (0: every layer); the others keep softmax attention (gqa)
    linear_attention: str = "none"  # none | gated_deltanet (Qwen3-Next / Qwen3.5) on the layers full_attention_every
    #   leaves linear: with full_attention_every 4, layers 3, 7, ... keep softmax attention (0: every layer linear)
    linear_num_key_heads: int = 0  # query / key heads of a linear layer (Qwen3.5-35B-A3B: 16)
    linear_num_value_heads: int = 0  # value heads, a multiple of the key heads (32); each owns a state [dk, dv]
    linear_key_head_dim: int = 0  # dk (128)
    linear_value_head_dim: int = 0  # dv (128)
    linear_conv_kernel: int = 4  # width of the causal depthwise convolution over q, k, v
    linear_chunk: int = 64  # positions per chunk of the chunked delta rule (speed only: any value gives the same math)
    linear_recompute: bool = True  # training keeps only the rule's inputs and runs its chunks again in backward
    #   (the chunks' tensors are ~5x those bytes; the rule is a few % of the layer's FLOPs); false keeps them all
    # MLA only (attention = "mla"); 0 where unused. num_kv_heads and head_dim are unused by MLA.
    q_lora_rank: int = 0  # 0 = full-rank query projection wq (DeepSeek-V2-Lite); else wq_a -> norm -> wq_b
    kv_lora_rank: int = 0  # compressed key/value width (wkv_a -> norm -> wkv_b)
    qk_nope_head_dim: int = 0  # per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0  # per-head query dims with RoPE; the rotated key part is shared by all heads
    v_head_dim: int = 0  # per-head value dim
    rope_interleave: bool = True  # MLA: the rope dims are stored as interleaved pairs (DeepSeek-V3)
    # Multi-token prediction (DeepSeek-V3; models.mtp): mtp_layers modules after the last block, module k
    # predicting the token k + 1 places past the next one; their mean loss, times mtp_loss_coeff, joins the
    # training loss (the reported loss stays the next-token one)
    mtp_layers: int = 0  # D prediction depths (DeepSeek-V3: 1); 0 = off
    mtp_loss_coeff: float = 0.3  # lambda: DeepSeek-V3 used 0.3 for its first 10T tokens, then 0.1
    # LoRA adapters for fine-tuning (models.lora): training then updates the adapters only (and what
    # --train.trainable names); exports fold them into the weights
    lora_rank: int = 0  # r > 0: a rank-r adapter on each targeted weight; 0 = none
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
    lora_rslora: bool = False  # scale by lora_alpha / sqrt(lora_rank) instead (rank-stabilized LoRA, Kalajdzievski
    #   2023: the update's size no longer shrinks as the rank grows, so large ranks keep learning; PEFT's use_rslora)
    lora_dropout: float = 0.0  # share of each adapter's input zeroed while training (PEFT's lora_dropout; 0 = none)
    lora_targets: str = "all"  # comma-separated patterns over weight names (layers.N.attn.wq.weight,
    #   layers.N.ffn.experts.w_in, *.attn.*, *.experts.*), or all: every block projection and expert stack except
    #   the routers and one-wide gates

    @property
    def attn_head_dim(self) -> int:
        """GQA head dim D (hidden_size // num_heads unless head_dim is set); for MLA see the two below."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def attn_qk_head_dim(self) -> int:
        """Per-head query / key width: D, or MLA's qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def attn_v_head_dim(self) -> int:
        """Per-head value width: D, or MLA's v_head_dim."""
        return self.v_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head: partial_rotary_factor * D (transformers rounds down), or MLA's
        qk_rope_head_dim."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.attn_head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, i: int) -> bool:
        """Whether layer i is a linear-attention layer (linear_attention; MTP depths, i >= num_layers, never are)."""
        if self.linear_attention == "none" or i >= self.num_layers:
            return False
        return not (self.full_attention_every and (i + 1) % self.full_attention_every == 0)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_layers))

    def uses_rope(self, i: int) -> bool:
        """Whether layer i rotates its queries and keys (nope_every leaves every n-th layer without RoPE)."""
        return not (self.nope_every and (i + 1) % self.nope_every == 0)

    def attention_chunk_of(self, i: int) -> int:
        """Layer i's attention chunk (attention_chunk on the RoPE layers), 0 = no chunking."""
        return self.attention_chunk if self.uses_rope(i) else 0

    def attention_window(self, i: int) -> int:
        """Layer i's sliding window (positions a query sees, itself included), 0 = full causal attention."""
        if not self.sliding_window or (self.full_attention_every and (i + 1) % self.full_attention_every == 0):
            return 0
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        if self.num_experts == 0 or i < self.first_dense_layers:
            return False
        return (i - self.first_dense_layers) % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first bad field, its value and the fix; return self."""
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len",
                    "ffn_hidden_size", "moe_ffn_hidden_size", "moe_every", "top_k")
        for name in positive:
            _check_int(f"model.{name}", getattr(self, name), 1)
        for name in ("head_dim", "num_experts", "shared_ffn_hidden_size", "first_dense_layers", "mtp_layers",
                     "lora_rank"):
            _check_int(f"model.{name}", getattr(self, name), 0)
        for name, strict in (("rope_theta", True), ("norm_eps", True), ("init_std", True),
                             ("aux_loss_coeff", False), ("z_loss_coeff", False), ("mtp_loss_coeff", False)):
            _check_float(f"model.{name}", getattr(self, name), strict)
        if self.capacity_factor is not None:
            _check_float("model.capacity_factor", self.capacity_factor, strict=True,
                         hint="; use a positive number, or none for dropless routing")
        from moekit.moe.lora_dropout import check_dropout

        if check_dropout(self.lora_dropout, "model.lora_dropout") and not self.lora_rank:
            raise ValueError(f"model.lora_dropout={self.lora_dropout!r} drops LoRA adapters' inputs, and "
                             f"model.lora_rank is 0 (no adapters); set model.lora_rank (e.g. 8) or drop lora_dropout")
        if self.lora_rank:
            _check_float("model.lora_alpha", self.lora_alpha, strict=True)
            if not isinstance(self.lora_targets, str) or not self.lora_targets.strip():
                raise ValueError(f"model.lora_targets={self.lora_targets!r} is invalid; give comma-separated weight "
                                 f"patterns (e.g. '*.attn.*,*.experts.*') or 'all'")
            if self.expert_backend == "float8" and self.num_experts:
                raise ValueError("model.expert_backend='float8' has no LoRA adapter path; with model.lora_rank > 0 "
                                 "use 'auto', 'torch' or 'loop'")
        for name in ("name", "activation", "router", "expert_backend"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is invalid; it must be a string")
        for name in ("tie_embeddings", "shared_expert_gate", "attention_bias", "rope_interleave", "moe_ffn_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is invalid; it must be true or false")
        from moekit.moe.activations import ACTIVATIONS  # the one table (imports torch: only when validating)

        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r} is invalid; choose one of {sorted(ACTIVATIONS)}")
        self._validate_attention()
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")
        if self.num_experts and not self.num_moe_layers:
            raise ValueError(f"model.num_experts={self.num_experts}, but no layer is an MoE layer (num_layers="
                             f"{self.num_layers}, first_dense_layers={self.first_dense_layers}, moe_every="
                             f"{self.moe_every}); lower first_dense_layers / moe_every, or set num_experts 0 for a "
                             f"dense model")
        if not isinstance(self.router_options, dict):
            raise ValueError(f"model.router_options must be a table of router options, got {self.router_options!r}")
        return self

    def _validate_attention(self) -> None:
        for name in ("attention", "qk_norm", "rope_pairs"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is invalid; it must be a string")
        for name in ("attention_out_bias", "attention_sinks", "attention_output_gate", "norm_zero_centered",
                     "linear_recompute"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is invalid; it must be true or false")
        _check_int("model.sliding_window", self.sliding_window, 0)
        _check_int("model.full_attention_every", self.full_attention_every, 0)
        self._validate_linear_attention()
        self._validate_llama4()
        if self.full_attention_every and not self.sliding_window and self.linear_attention == "none":
            raise ValueError(f"model.full_attention_every={self.full_attention_every} picks the layers that attend "
                             f"fully among sliding-window ones, but model.sliding_window is 0 (no window); set a "
                             f"window (gpt-oss: 128) or full_attention_every 0")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention={self.attention!r} is invalid; choose one of {list(ATTENTIONS)}")
        if self.rope_pairs not in ROPE_PAIRS:
            raise ValueError(f"model.rope_pairs={self.rope_pairs!r} is invalid; choose one of {list(ROPE_PAIRS)} "
                             f"(half: Llama, Qwen, Mixtral; adjacent: ERNIE 4.5)")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r} is invalid; choose one of {list(QK_NORMS)} (head: "
                             f"Qwen3's per-head norm, full: OLMoE's norm over the whole projection, unit: Llama 4's "
                             f"per-head norm without a weight, on the RoPE layers)")
        _check_float("model.qkv_clip", self.qkv_clip, strict=False, hint="; 0 turns clipping off")
        _check_float("model.partial_rotary_factor", self.partial_rotary_factor, strict=True,
                     hint="; 1 rotates the whole head, 0.5 its first half (GLM-4.5)")
        if self.partial_rotary_factor > 1:
            raise ValueError(f"model.partial_rotary_factor={self.partial_rotary_factor} is above 1; RoPE rotates at "
                             f"most the whole head: use a value in (0, 1]")
        mla_fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in mla_fields:
            _check_int(f"model.{name}", getattr(self, name), 0)
        if self.attention == "mla":
            missing = [n for n in mla_fields[1:] if getattr(self, n) == 0]
            if missing:
                raise ValueError(f"model.attention='mla' needs {', '.join(f'model.{n}' for n in missing)} > 0 "
                                 f"(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, "
                                 f"v_head_dim 128); set them or use attention='gqa'")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
            for name, off in (("attention_bias", False), ("qk_norm", "none"), ("qkv_clip", 0.0),
                              ("attention_output_gate", False), ("linear_attention", "none"),
                              ("partial_rotary_factor", 1.0), ("attention_out_bias", False),
                              ("attention_sinks", False), ("sliding_window", 0), ("rope_pairs", "half")):
                if getattr(self, name) != off:
                    raise ValueError(f"model.{name}={getattr(self, name)!r} applies to attention='gqa' only; MLA has "
                                     f"its own latent norms: set model.{name}={off!r} with attention='mla'")
        else:
            set_mla = [n for n in mla_fields if getattr(self, n)]
            if set_mla:
                raise ValueError(f"{', '.join(f'model.{n}' for n in set_mla)} only apply to attention='mla'; set "
                                 f"model.attention='mla' or leave them 0")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}")
            if not self.head_dim and self.hidden_size % self.num_heads:
                raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads="
                                 f"{self.num_heads}; change one or set model.head_dim")
            if self.attn_head_dim % 2:
                raise ValueError(f"head dim {self.attn_head_dim} must be even for RoPE; set model.head_dim")
            if self.rope_dim < 2 or self.rope_dim % 2:
                raise ValueError(f"model.partial_rotary_factor={self.partial_rotary_factor} rotates "
                                 f"{self.rope_dim} of the head's {self.attn_head_dim} channels; RoPE needs an even "
                                 f"number >= 2: choose a factor such as 0.5 or 1")
        _check_rope_scaling(self.rope_scaling)

    def _validate_llama4(self) -> None:
        """nope_every, attention_chunk, the NoPE layers' temperature, qk_norm 'unit', router_weight_on_input."""
        _check_int("model.nope_every", self.nope_every, 0)
        _check_int("model.attention_chunk", self.attention_chunk, 0)
        _check_int("model.attn_temperature_floor", self.attn_temperature_floor, 0)
        _check_float("model.attn_temperature_scale", self.attn_temperature_scale, strict=False,
                     hint="; Llama 4 uses 0.1")
        if not isinstance(self.router_weight_on_input, bool):
            raise ValueError(f"model.router_weight_on_input={self.router_weight_on_input!r} is invalid; it must be "
                             f"true or false")
        used = [n for n in ("nope_every", "attention_chunk", "attn_temperature_floor") if getattr(self, n)]
        if used and self.attention != "gqa":
            raise ValueError(f"{', '.join(f'model.{n}' for n in used)} apply to attention='gqa' (Llama 4); "
                             f"leave them 0 with attention={self.attention!r}")
        if self.attention_chunk and self.sliding_window:
            raise ValueError(f"model.attention_chunk={self.attention_chunk} and model.sliding_window="
                             f"{self.sliding_window}: a layer attends within chunks or within a window, not both; "
                             f"set one of them 0")
        if self.attn_temperature_floor and not self.nope_every:
            raise ValueError(f"model.attn_temperature_floor={self.attn_temperature_floor} scales the queries of the "
                             f"NoPE layers, but model.nope_every is 0 (every layer has RoPE); set nope_every (Llama 4: "
                             f"4) or attn_temperature_floor 0")
        if self.nope_every == 1 and self.qk_norm == "unit":
            raise ValueError("model.qk_norm='unit' normalises the RoPE layers' queries and keys, but model.nope_every=1 "
                             "leaves no layer with RoPE; use qk_norm 'none' or a larger nope_every")
        if self.router_weight_on_input and self.num_experts and self.top_k != 1:
            raise ValueError(f"model.router_weight_on_input scales each token by its one expert's weight before the "
                             f"expert, which needs top-1 routing, but model.top_k={self.top_k}; set top_k 1 (Llama 4) "
                             f"or router_weight_on_input false")

    def _validate_linear_attention(self) -> None:
        fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        for name in fields:
            _check_int(f"model.{name}", getattr(self, name), 0)
        _check_int("model.linear_conv_kernel", self.linear_conv_kernel, 1)
        _check_int("model.linear_chunk", self.linear_chunk, 1)
        if not isinstance(self.linear_attention, str) or self.linear_attention not in LINEAR_ATTENTIONS:
            raise ValueError(f"model.linear_attention={self.linear_attention!r} is invalid; choose one of "
                             f"{list(LINEAR_ATTENTIONS)} (gated_deltanet: Qwen3-Next / Qwen3.5)")
        if self.linear_attention == "none":
            set_ = [n for n in fields if getattr(self, n)]
            if set_:
                raise ValueError(f"{', '.join(f'model.{n}' for n in set_)} only apply to linear attention; set "
                                 f"model.linear_attention='gated_deltanet' or leave them 0")
            return
        missing = [n for n in fields if not getattr(self, n)]
        if missing:
            raise ValueError(f"model.linear_attention={self.linear_attention!r} needs "
                             f"{', '.join(f'model.{n}' for n in missing)} > 0 (Qwen3.5-35B-A3B: 16 key heads, 32 "
                             f"value heads, both of 128)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"model.linear_num_key_heads={self.linear_num_key_heads} must divide "
                             f"model.linear_num_value_heads={self.linear_num_value_heads} (each key head serves "
                             f"value heads / key heads value heads)")
        if self.sliding_window:
            raise ValueError(f"model.sliding_window={self.sliding_window} with linear_attention: "
                             f"full_attention_every picks softmax layers among linear ones, so no layer would slide; "
                             f"set sliding_window 0")

    # Router configuration: the one place that decides what build_router gets and what a router change resets.

    def router_kwargs(self) -> dict[str, Any]:
        """The build_router options for ``self.router``: each common field the router accepts, then
        ``router_options`` as given (they must all be accepted; build_router says which are not).

        Common fields go only where accepted, so the router can change family without editing the
        preset (e.g. "switch" is top-1 by definition and takes no top_k).
        """
        passed, _ = _split_common_router_fields(self)
        return {**passed, **self.router_options}

    def unused_router_fields(self) -> list[str]:
        """Common fields ``self.router`` takes no option for although their value is not "off" (to warn about)."""
        return _split_common_router_fields(self)[1]

    def set_router(self, name: str) -> None:
        """Choose the router family. A different family drops ``router_options``: they belong to the old
        one (e.g. switch's jitter) and the new one starts from its defaults. Common fields carry over."""
        if name != self.router:
            self.router_options = {}
        self.router = name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; fields are {sorted(names)}")
        return cls(**d)


def _split_common_router_fields(config: ModelConfig) -> tuple[dict[str, Any], list[str]]:
    """({field: value} the router accepts, [fields it does not accept whose value is not "off"])."""
    from moekit.moe.router import router_class  # imports torch: only when a router is resolved

    params = inspect.signature(router_class(config.router).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    passed, unused = {}, []
    for name, off in COMMON_ROUTER_FIELDS.items():
        if takes_any or name in params:
            passed[name] = getattr(config, name)
        elif getattr(config, name) != off:
            unused.append(name)
    return passed, unused


ATTENTIONS = ("gqa", "mla")
LINEAR_ATTENTIONS = ("none", "gated_deltanet")
QK_NORMS = ("none", "head", "full", "unit")
ROPE_PAIRS = ("half", "adjacent")  # ModelConfig.rope_pairs
# rope_scaling: rope_type -> (required keys, optional keys) besides rope_type; the meaning of each is
# transformers' (modeling_rope_utils); models.rope.rope_frequencies computes them.
ROPE_SCALINGS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}


def _check_rope_scaling(rs) -> None:
    where = "model.rope_scaling"
    if not isinstance(rs, dict):
        raise ValueError(f"{where}={rs!r} is invalid; it must be a table ({{}} for plain RoPE)")
    if not rs:
        return
    kind = rs.get("rope_type")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{where}.rope_type={kind!r} is invalid; choose one of {list(ROPE_SCALINGS)} (or an "
                         f"empty table for plain RoPE)")
    required, optional = ROPE_SCALINGS[kind]
    missing = [k for k in required if k not in rs]
    unknown = sorted(set(rs) - {"rope_type", *required, *optional})
    if missing:
        raise ValueError(f"{where} with rope_type={kind!r} needs {missing}; it takes {list(required)} and optionally "
                         f"{list(optional)}")
    if unknown:
        raise ValueError(f"{where} with rope_type={kind!r} has unknown key(s) {unknown}; it takes {list(required)} "
                         f"and optionally {list(optional)} (model.rope_theta is the base)")
    for key, value in rs.items():
        if key == "rope_type":
            continue
        name = f"{where}.{key}"
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid; it must be true or false")
        elif key == "original_max_position_embeddings":
            _check_int(name, value, 1)
        elif value is None and key in optional:  # transformers writes null for an unset optional key
            continue
        else:
            _check_float(name, value, strict=key not in ("mscale", "mscale_all_dim"))
    if kind == "llama3" and not rs["high_freq_factor"] >= rs["low_freq_factor"]:  # equal: no blended band (Llama 4)
        raise ValueError(f"{where}.high_freq_factor={rs['high_freq_factor']!r} must be at least low_freq_factor="
                         f"{rs['low_freq_factor']!r}")


def _check_int(name: str, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= {lo}")


def _check_float(name: str, value, strict: bool, hint: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (strict and value == 0):
        raise ValueError(f"{name}={value!r} is invalid; it must be a finite number {'>' if strict else '>='} 0{hint}")


# ---------------------------------------------------------------------------------------------------
# Presets. The tiny ones train on a laptop CPU in minutes on byte-level data (vocab 256); the real
# sizes are for parameter / FLOP accounting on the meta device (see models.transformer.model_stats).
# ---------------------------------------------------------------------------------------------------

# The chunk of the chunked delta rule in the GPU-sized Gated DeltaNet presets. The rule's chunks run one after
# another as torch ops, so on a GPU fewer, larger chunks win: at Qwen3.5-35B-A3B's layer sizes (H200, bf16, fwd + bwd)
# 128 ran 1.8x faster than 64 at 4096 and 16384 positions (docs/benchmarks.md, fifth GPU round). On a CPU the
# smaller chunk is faster (64: 0.92x the time of 128 at 2048 positions, fp32), so the tiny presets and the default keep 64.
GPU_LINEAR_CHUNK = 128

PRESETS: dict[str, ModelConfig] = {
    # Mixtral: SwiGLU experts, top-2 softmax renormalised over the two, dropless, GQA, RoPE, RMSNorm.
    "mixtral-tiny": ModelConfig(
        name="mixtral-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=256,
        ffn_hidden_size=512, num_experts=8, moe_ffn_hidden_size=256, top_k=2, router="topk",
        aux_loss_coeff=0.01, router_options={"normalize": True},
    ),
    # Switch Transformer: top-1, capacity factor 1.25, MoE every other layer, ReLU experts, input jitter.
    "switch-tiny": ModelConfig(
        name="switch-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=256,
        ffn_hidden_size=512, activation="relu", num_experts=8, moe_ffn_hidden_size=512, moe_every=2,
        router="switch", top_k=1, capacity_factor=1.25, aux_loss_coeff=0.01, router_options={"jitter": 0.01},
        tie_embeddings=True,
    ),
    # DeepSeek-V3: many fine-grained experts + a shared expert, sigmoid scores, group-limited top-k,
    # aux-loss-free bias balancing (with a tiny sequence-wise aux loss: balance "sequence"), first layer dense.
    "deepseek-tiny": ModelConfig(
        name="deepseek-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=256,
        ffn_hidden_size=512, num_experts=16, moe_ffn_hidden_size=64, shared_ffn_hidden_size=128,
        first_dense_layers=1, router="topk", top_k=4, aux_loss_coeff=0.0001,
        router_options={"score": "sigmoid", "num_groups": 4, "group_top_k": 2, "bias_update_rate": 0.001,
                        "scaling": 1.0, "balance": "sequence"},
    ),
    # gpt-oss's architecture at test size: attention sinks, q/k/v/o biases, a 64-position window on every other
    # layer, a biased gate (softmax over the top-k logits), experts with biases and gpt-oss's clamped SwiGLU.
    "gpt-oss-tiny": ModelConfig(
        name="gpt-oss-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        max_seq_len=256, ffn_hidden_size=256, num_experts=8, moe_ffn_hidden_size=256, top_k=2, aux_loss_coeff=0.01,
        attention_bias=True, attention_out_bias=True, attention_sinks=True, sliding_window=64, full_attention_every=2,
        activation="swiglu_oai", moe_ffn_bias=True, router_options={"normalize": True, "gate_bias": True},
    ),
    # Qwen3.5-MoE's architecture at test size: Gated DeltaNet linear attention on three of every four layers, gated
    # GQA (q/k norms, RoPE on a quarter of each head) on the fourth, zero-centered norms, softmax top-k experts
    # plus a sigmoid-gated shared expert.
    "qwen3.5-tiny": ModelConfig(
        name="qwen3.5-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=256,
        norm_eps=1e-6, partial_rotary_factor=0.25, qk_norm="head", attention_output_gate=True,
        norm_zero_centered=True, linear_attention="gated_deltanet", full_attention_every=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, ffn_hidden_size=128,
        num_experts=8, moe_ffn_hidden_size=128, shared_ffn_hidden_size=128, shared_expert_gate=True, top_k=2,
        aux_loss_coeff=0.001, router_options={"normalize": True},
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        max_seq_len=32768, rope_theta=1e6, ffn_hidden_size=14336, num_experts=8, moe_ffn_hidden_size=14336,
        top_k=2, router_options={"normalize": True},
    ),
    # DeepSeek-V3's MoE shape (671B total, 37B active there) with GQA attention in place of MLA, so
    # attention parameters differ from the paper; experts, groups and dense layers match.
    "deepseek-v3-like": ModelConfig(
        name="deepseek-v3-like", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=128, max_seq_len=4096, ffn_hidden_size=18432, num_experts=256,
        moe_ffn_hidden_size=2048, shared_ffn_hidden_size=2048, first_dense_layers=3, top_k=8, aux_loss_coeff=0.0001,
        router_options={"score": "sigmoid", "num_groups": 8, "group_top_k": 4, "bias_update_rate": 0.001,
                        "scaling": 2.5},
    ),
    # Qwen3-30B-A3B's shape: 128 experts of width 768, top-8 renormalised, no shared expert, GQA 32/4.
    "qwen3-moe-30b-a3b": ModelConfig(
        name="qwen3-moe-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6, ffn_hidden_size=6144,
        num_experts=128, moe_ffn_hidden_size=768, top_k=8, aux_loss_coeff=0.001, router_options={"normalize": True},
    ),
    # GLM-4.5-Air's shape (106B total, 12B active besides the embeddings): GQA 96/8 with q/k/v biases, RoPE on
    # half of each head, 128 experts of width 1408, top-8 sigmoid with selection bias, one shared expert, one
    # dense first layer. Its checkpoint imports as glm4_moe (models/hf).
    "glm-4.5-air": ModelConfig(
        name="glm-4.5-air", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
        head_dim=128, max_seq_len=131072, rope_theta=1e6, norm_eps=1e-5, ffn_hidden_size=10944, num_experts=128,
        moe_ffn_hidden_size=1408, shared_ffn_hidden_size=1408, first_dense_layers=1, top_k=8, attention_bias=True,
        partial_rotary_factor=0.5, aux_loss_coeff=0.0,
        router_options={"score": "sigmoid", "expert_bias": True, "normalize": True, "bias_update_rate": 0.001},
    ),
    # DeepSeek-V3 itself (671B total, 37B active; the multi-token-prediction layer not counted): MLA with a
    # 1536-rank query and 512-rank key/value compression, 256 experts of width 2048 in 8 groups (top-4 groups
    # by their top-2 scores), top-8 sigmoid with selection bias scaled by 2.5, one shared expert, 3 dense first
    # layers, YaRN x40 from 4k. Its checkpoint imports as deepseek_v3 (models/hf), fp8 included.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=0, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        ffn_hidden_size=18432, num_experts=256, moe_ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
        first_dense_layers=3, top_k=8, aux_loss_coeff=0.0,
        router_options={"score": "sigmoid", "expert_bias": True, "normalize": True, "num_groups": 8,
                        "group_top_k": 4, "group_score_top": 2, "scaling": 2.5, "bias_update_rate": 0.001},
    ),
    # OpenAI's gpt-oss-20b (2025; 20.9B total, 3.6B active): 24 layers alternating a 128-position window and full
    # attention, 64 query / 8 key-value heads of 64 with sinks and biases, 32 experts of width 2880, top-4 of a
    # biased gate, clamped SwiGLU, YaRN x32 from 4k. gpt-oss-120b: 36 layers, 128 experts. Their checkpoints
    # (MXFP4 experts) import as gpt_oss (models/hf).
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
        head_dim=64, max_seq_len=131072, rope_theta=150000.0, norm_eps=1e-5,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        ffn_hidden_size=2880, num_experts=32, moe_ffn_hidden_size=2880, top_k=4, aux_loss_coeff=0.001,
        attention_bias=True, attention_out_bias=True, attention_sinks=True, sliding_window=128, full_attention_every=2,
        activation="swiglu_oai", moe_ffn_bias=True, router_options={"normalize": True, "gate_bias": True},
    ),
    # DeepSeek-V2-Lite (DeepSeek-AI 2024; 15.7B total, 2.4B active without the embedding): MLA with a full-rank
    # query, 64 experts of width 1408 top-6 by softmax, never renormalised, 2 shared experts, one dense first layer,
    # YaRN x40 from 4k. Its checkpoint imports as deepseek_v2 (models/hf).
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=0, attention="mla", q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_seq_len=163840, norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        ffn_hidden_size=10944, num_experts=64, moe_ffn_hidden_size=1408, shared_ffn_hidden_size=2816,
        first_dense_layers=1, top_k=6, aux_loss_coeff=0.001,
        router_options={"normalize": False, "scaling": 1.0, "balance": "sequence"},
    ),
    # MiniMax-M2 (MiniMax 2025; 229B total, 10B active without the embedding and the head): 62 layers of GQA 48/8
    # heads of 128 with q/k RMSNorm over the whole projection and RoPE on half of each head, 256 experts of width
    # 1536, top-8 sigmoid with a selection bias, renormalised. Its checkpoint (fp8) imports as minimax_m2.
    "minimax-m2": ModelConfig(
        name="minimax-m2", vocab_size=200064, hidden_size=3072, num_layers=62, num_heads=48, num_kv_heads=8,
        head_dim=128, max_seq_len=196608, rope_theta=5e6, norm_eps=1e-6, partial_rotary_factor=0.5, qk_norm="full",
        ffn_hidden_size=1536, num_experts=256, moe_ffn_hidden_size=1536, top_k=8, aux_loss_coeff=0.0,
        router_options={"score": "sigmoid", "expert_bias": True, "normalize": True, "bias_update_rate": 0.001},
    ),
    # ERNIE-4.5-21B-A3B (Baidu 2025; 21B total, 3B active): 28 layers of GQA 20/4 heads of 128 whose RoPE rotates
    # adjacent channel pairs, a tied head, a dense first layer, 64 experts of width 1536 (top-6 softmax chosen with a
    # selection bias, renormalised) plus 2 shared ones. Its checkpoint imports as ernie4_5_moe.
    "ernie-4.5-21b-a3b": ModelConfig(
        name="ernie-4.5-21b-a3b", vocab_size=103424, hidden_size=2560, num_layers=28, num_heads=20, num_kv_heads=4,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, rope_pairs="adjacent", tie_embeddings=True,
        ffn_hidden_size=12288, num_experts=64, moe_ffn_hidden_size=1536, shared_ffn_hidden_size=3072,
        first_dense_layers=1, top_k=6, aux_loss_coeff=0.001,
        router_options={"normalize": True, "expert_bias": True, "bias_update_rate": 0.001},
    ),
    # Kimi K2 (Moonshot AI; 1T total, 32B active): DeepSeek-V3's architecture with 64 heads, 384 experts in
    # one group, routed scaling 2.827, one dense first layer, YaRN x32 from 4k. Its checkpoint (model_type
    # kimi_k2) imports as deepseek_v3.
    "kimi-k2": ModelConfig(
        name="kimi-k2", vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64, num_kv_heads=64,
        head_dim=0, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_seq_len=131072, rope_theta=50000.0, norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        ffn_hidden_size=18432, num_experts=384, moe_ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
        first_dense_layers=1, top_k=8, aux_loss_coeff=0.0,
        router_options={"score": "sigmoid", "expert_bias": True, "normalize": True, "scaling": 2.827,
                        "bias_update_rate": 0.001},
    ),
    # Qwen3.5-35B-A3B (Qwen 2026): 40 layers, 30 of them Gated DeltaNet (16 key heads and 32 value heads of 128)
    # and every fourth gated GQA 16/2 heads of 256 with RoPE on 64 of them; 256 experts of width 512, top-8
    # renormalised, plus a gated shared expert of 512. Its checkpoint imports as qwen3_5_moe (the language model).
    # Llama 4's architecture at a CPU's size: NoPE on every other layer (queries with the temperature from position
    # 63), 64-position chunks on the others, MoE on every other layer (top-1 sigmoid, weight on the input, a
    # shared expert), wider dense MLPs between them (Maverick's interleaving)
    "llama4-tiny": ModelConfig(
        name="llama4-tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=256,
        rope_theta=500000.0, norm_eps=1e-5, rope_pairs="adjacent", qk_norm="unit", nope_every=2, attention_chunk=64,
        attn_temperature_floor=64, attn_temperature_scale=0.1, ffn_hidden_size=256, num_experts=8, moe_every=2,
        moe_ffn_hidden_size=128, shared_ffn_hidden_size=128, top_k=1, router_weight_on_input=True,
        aux_loss_coeff=0.001, router_options={"score": "sigmoid", "normalize": False},
    ),
    # meta-llama/Llama-4-Scout-17B-16E (config.json's text_config): 107.8B parameters (the release's 109B with its
    # vision tower), 17.2B active
    "llama-4-scout": ModelConfig(
        name="llama-4-scout", vocab_size=202048, hidden_size=5120, num_layers=48, num_heads=40, num_kv_heads=8,
        head_dim=128, max_seq_len=262144, rope_theta=500000.0, norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192},
        rope_pairs="adjacent", qk_norm="unit", nope_every=4, attention_chunk=8192, attn_temperature_floor=8192,
        attn_temperature_scale=0.1, ffn_hidden_size=16384, num_experts=16, moe_ffn_hidden_size=8192,
        shared_ffn_hidden_size=8192, top_k=1, router_weight_on_input=True, aux_loss_coeff=0.001,
        router_options={"score": "sigmoid", "normalize": False},
    ),
    "qwen3.5-35b-a3b": ModelConfig(
        name="qwen3.5-35b-a3b", vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_dim=256, max_seq_len=262144, rope_theta=1e7, norm_eps=1e-6, partial_rotary_factor=0.25, qk_norm="head",
        attention_output_gate=True, norm_zero_centered=True, linear_attention="gated_deltanet",
        full_attention_every=4, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, ffn_hidden_size=512, num_experts=256, moe_ffn_hidden_size=512,
        shared_ffn_hidden_size=512, shared_expert_gate=True, top_k=8, aux_loss_coeff=0.001,
        router_options={"normalize": True}, linear_chunk=GPU_LINEAR_CHUNK,
    ),
    # 1.02B total / 0.34B active, Mixtral-style (8 experts top-2, F = 3H), sized to train on one 80 GB GPU
    # (tools/bench/train_mfu.py). Shapes favour GPU efficiency: every width a multiple of 128, head dim
    # 128, and wide experts, because the per-token glue (norms, RoPE, dispatch, combine) grows with H
    # and k while the expert FLOPs grow with H*F*k: a wide F keeps the memory-bound work a small share.
    # MHA (kv heads = heads) keeps every SDPA backend eligible; enable_gqa runs on flash attention only.
    "mixtral-1b": ModelConfig(
        name="mixtral-1b", vocab_size=32000, hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=8,
        head_dim=128, max_seq_len=4096, rope_theta=1e6, ffn_hidden_size=3072, num_experts=8,
        moe_ffn_hidden_size=3072, top_k=2, router_options={"normalize": True},
    ),
    # Qwen3.5's architecture at 0.95B total / 0.26B active (with the embedding), for one GPU (tools/bench/train_mfu.py
    # --preset qwen3.5-1b): 16 layers, 12 of them Gated DeltaNet with 4 key / 8 value heads of 128 (Qwen3.5's head
    # width), every fourth gated GQA 8/2 heads of 128; 32 experts of 512, top-4, a gated shared expert of 512.
    "qwen3.5-1b": ModelConfig(
        name="qwen3.5-1b", vocab_size=32000, hidden_size=1024, num_layers=16, num_heads=8, num_kv_heads=2,
        head_dim=128, max_seq_len=4096, rope_theta=1e7, norm_eps=1e-6, partial_rotary_factor=0.25, qk_norm="head",
        attention_output_gate=True, norm_zero_centered=True, linear_attention="gated_deltanet",
        full_attention_every=4, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
        linear_value_head_dim=128, ffn_hidden_size=512, num_experts=32, moe_ffn_hidden_size=512,
        shared_ffn_hidden_size=512, shared_expert_gate=True, top_k=4, aux_loss_coeff=0.001,
        router_options={"normalize": True}, linear_chunk=GPU_LINEAR_CHUNK,
    ),
}
# meta-llama/Llama-4-Maverick-17B-128E: 128 experts on every other layer, no q/k norm, no RoPE scaling: 400B, 17B active
PRESETS["llama-4-maverick"] = dataclasses.replace(PRESETS["llama-4-scout"], name="llama-4-maverick", num_experts=128,
                                                  moe_every=2, qk_norm="none", rope_scaling={})
PRESETS["gpt-oss-120b"] = dataclasses.replace(PRESETS["gpt-oss-20b"], name="gpt-oss-120b", num_layers=36,
                                              num_experts=128)  # 116.8B total, 5.1B active


def preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset (mutating it never changes PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name].to_dict())
