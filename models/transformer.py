"""Decoder-only MoE transformer: Mixtral-, Switch- and DeepSeek-style by configuration.

Shape legend: B batch, S sequence, H hidden, V vocab, N query heads, K key/value heads, D head dim,
T = B*S tokens.

    tokens [B, S] -> embed -> L x Block -> RMSNorm -> lm_head -> logits [B, S, V]
    Block:  h = x + Attention(RMSNorm(x))          causal, RoPE, GQA or MLA, SDPA (models.attention)
            y = h + FFN(RMSNorm(h))                FFN = MoELayer or DenseMLP (config.is_moe_layer)

Single-device code: nothing here knows about ranks (DESIGN.md); comm/ parallelises a built model.
Build on the meta device, move with ``to_empty``, then ``init_weights(seed)``: every value depends on the seed,
the parameter's name and its position only (models.init), so a model parallelised on the meta device can be
initialised shard by shard.

Incremental decoding (generation): ``model(tokens [B, S_new], cache=KVCache(...))`` runs only the new
positions P .. P+S_new-1 (P = ``cache.length``): RoPE at those positions, attention over the cached keys
and values plus the new ones, MoE layers routing the new tokens only. With a router whose choice for a
token depends on that token alone (top-k / switch / hash without capacity, Sinkhorn in eval) the logits
equal a full forward of the whole sequence up to rounding. Without ``cache`` the forward is the training
one, unchanged.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from moekit.models.attention import (  # noqa: F401  (re-exported: the attention API lived here)
    Attention, KVCache, LayerKV, MLAttention, build_attention, causal_mask, document_segments)
from moekit.models.config import ModelConfig
from moekit.models.norms import make_norm
from moekit.models.loss import chunked_lm_loss
from moekit.models.mtp import LossInjector, MTPModule, MTPRecord, mtp_loss
from moekit.models.rope import (  # noqa: F401  (re-exported: the RoPE API lived here)
    apply_rope, apply_rope_interleaved, rope_angles, rope_frequencies, rope_tables)
from moekit.moe import DenseMLP, MoELayer, build_router

# The training loss from hidden states (models.loss): "auto" wherever the head's weight is a plain tensor
# (a tensor-parallel DTensor head, or a graph being traced by torch.compile, takes the logits path);
# "never": always the logits path (materialised [B, S, V] logits, then cross-entropy).
LOSS_CHUNKS = "auto"


def chunked_loss_applies(weight: Tensor) -> bool:
    if LOSS_CHUNKS not in ("auto", "never"):
        raise ValueError(f"models.transformer.LOSS_CHUNKS={LOSS_CHUNKS!r}; use 'auto' or 'never'")
    return LOSS_CHUNKS == "auto" and type(weight) in (torch.Tensor, nn.Parameter) and not torch.compiler.is_compiling()


def head_loss(x: Tensor, weight: Tensor, targets: Tensor, normalizer: float | None = None) -> Tensor:
    """Mean next-token cross-entropy of hidden states x [B, S, H] through the head ``weight`` [V, H]: in token
    chunks without keeping the logits (models.loss) where that applies, else from the whole fp32 logits.
    ``normalizer``: the sum over the counted targets divided by it instead of their mean (loss masks)."""
    if not chunked_loss_applies(weight):
        logits = F.linear(x, weight).float().flatten(0, 1)
        if normalizer is None:
            return F.cross_entropy(logits, targets.flatten())
        return F.cross_entropy(logits, targets.flatten(), reduction="sum") / normalizer
    return chunked_lm_loss(x, weight, targets, normalizer=normalizer)


def forward_positions(owner: nn.Module, tokens: Tensor, cache: KVCache | None = None) -> tuple[Tensor, Tensor,
                                                                                               Tensor | None]:
    """(cos, sin, segments) of a forward of ``owner`` (a Transformer or a pipeline stage: ``.config``,
    ``.context_parallel``, ``.document_eos``) over tokens [B, S] after ``cache``'s positions: RoPE's tables at the
    forward's positions and the documents of document masking (``sequence_segments``), after the checks that the
    whole sequence fits max_seq_len and that a KV cache meets neither context parallelism nor documents."""
    config, context, S = owner.config, owner.context_parallel, tokens.shape[1]
    start = 0 if cache is None else cache.length  # position of tokens[:, 0]
    if cache is not None and context is not None:
        raise ValueError("a context-parallel model runs whole sequences (training, evaluation); decode with a "
                         "KV cache in a model without context parallelism")
    if cache is not None and owner.document_eos is not None:
        raise ValueError("document masking (model.document_eos) is for training forwards; set it to None to "
                         "decode with a KV cache")
    length = start + S * (context.degree if context is not None else 1)
    if length > config.max_seq_len:
        raise ValueError(f"sequence length {length} exceeds model.max_seq_len={config.max_seq_len}")
    cos, sin = position_tables(config, S, tokens.device, start, context)  # [S, R/2] (R: rotated dims)
    return cos, sin, sequence_segments(owner, tokens)


def position_tables(config: ModelConfig, S: int, device, start: int = 0, context=None) -> tuple[Tensor, Tensor]:
    """RoPE's cos, sin [S, R/2] for the S positions a forward runs: start .. start+S-1, or under context
    parallelism (``context``: comm.context_parallel's strategy) this rank's zigzag share of S * cp positions."""
    if context is None:
        return rope_tables(config, S, device, start)
    cos, sin = rope_tables(config, S * context.degree, device)  # [S_global, R/2]
    positions = context.positions(S, device)
    return cos[positions], sin[positions]


def sequence_segments(owner: nn.Module, tokens: Tensor) -> Tensor | None:
    """The documents of the forward's positions when ``owner.document_eos`` is set (document masking: attention
    stays within each document of a packed sequence; models.attention.document_segments), else None. Under
    context parallelism the whole sequence's: every rank's tokens are gathered first (ids only)."""
    eos = owner.document_eos
    if eos is None:
        return None
    context = owner.context_parallel
    whole = tokens if context is None else context.gather_ids(tokens, dim=1)
    return document_segments(whole, eos)


def embed_tokens(owner: nn.Module, ids: Tensor) -> Tensor:
    """``owner.embed(ids)`` [..., H] in the residual stream's dtype: ``owner.residual_dtype`` when set (a Transformer,
    a pipeline stage: the trainer's ``train.residual_dtype``, e.g. bf16 under bf16 autocast over fp32 weights, so the
    blocks' residual adds, norms and the hidden states kept for backward are bf16 as under FSDP's bf16
    parameters), else the embedding's own dtype."""
    e = owner.embed(ids)
    dtype = getattr(owner, "residual_dtype", None)
    return e if dtype is None or e.dtype == dtype else e.to(dtype)


def training_loss(owner: nn.Module, x: Tensor, weight: Tensor, emb: Tensor, tokens: Tensor, targets: Tensor,
                  cos: Tensor, sin: Tensor, segments: Tensor | None = None) -> Tensor:
    """The loss a forward with targets returns: the next-token loss of the final normed hidden states ``x``
    [B, S, H] through the head ``weight``, carrying the multi-token-prediction objective into backward when
    ``owner`` (a Transformer, or a pipeline's last stage: ``.mtp``, ``.mtp_record``, ``.config``) has depths and
    trains (models.mtp); ``owner.mtp_in_eval`` (the trainer's validation) runs them outside training as well, to
    record their loss only. ``emb``: embed(tokens) [B, S, H], which the depths read."""
    training = owner.training and torch.is_grad_enabled()
    # a step with loss masks: every micro-batch's counted targets over one count (the trainer's loss_normalizer),
    # each multi-token-prediction depth's over its own (mtp_normalizers)
    loss = head_loss(x, weight, targets, getattr(owner, "loss_normalizer", None) if training else None)
    if len(owner.mtp) and (training or getattr(owner, "mtp_in_eval", False)):  # models.mtp
        extra = mtp_loss(owner, x, emb, tokens, targets, cos, sin, lambda h, t, n=None: head_loss(h, weight, t, n),
                         segments, getattr(owner, "mtp_normalizers", None) if training else None)
        if extra is not None:
            owner.mtp_record.add(extra)
            if training:
                loss = LossInjector.apply(loss, extra, owner.config.mtp_loss_coeff)
    return loss


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        H = config.hidden_size
        self.attn_norm = make_norm(config, H)
        self.attn = build_attention(config, layer_id)
        self.ffn_norm = make_norm(config, H)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            router = build_router(config.router, H, config.num_experts, **config.router_kwargs())
            self.ffn = MoELayer(H, config.moe_ffn_hidden_size, config.num_experts, router, config.activation,
                                config.shared_ffn_hidden_size, shared_expert_gate=config.shared_expert_gate,
                                backend=config.expert_backend, ffn_bias=config.moe_ffn_bias,
                                weight_on_input=config.router_weight_on_input)
        else:
            self.ffn = DenseMLP(H, config.ffn_hidden_size, config.activation)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, tokens: Tensor, kv: LayerKV | None = None,
                segments: Tensor | None = None, ffn_spans: list[tuple[int, int]] | None = None,
                aux_weight: float = 1.0) -> Tensor:
        """``segments``: the documents of the positions (document masking), or None: models.attention.
        ``ffn_spans``: the position ranges [start, end) whose FFN / MoE rows are computed (the others add none:
        a multi-token-prediction depth's positions with no token ahead under context parallelism, models.mtp);
        None: all. ``aux_weight`` multiplies the MoE layer's aux-loss gradient for this call."""
        h = x + self.attn(self.attn_norm(x), cos, sin, kv=kv, segments=segments)  # [B, S, H]
        f = self.ffn_norm(h)
        if ffn_spans is not None and ffn_spans != [(0, h.shape[1])]:
            return h + self._ffn_on_spans(f, tokens, ffn_spans, aux_weight)
        if not self.is_moe:  # read here, not only in _ffn: under torch.compile see below
            return h + self.ffn(f)  # [B, S, H]
        # The MoE layer breaks the compiled graph inside _ffn, so this frame's graph ends at the call and guards only
        # on what it read before: without the branch above it would guard nothing that tells a dense block from an
        # MoE one, and a dense block's recompute under activation checkpointing, run after an MoE block compiled,
        # took the MoE blocks' split graphs instead of the whole one its forward ran (a CheckpointError on the
        # first step of every mixed dense / MoE model: DeepSeek's first dense layers, moe_every > 1).
        return h + self._ffn(f, tokens, aux_weight)

    def _ffn(self, f: Tensor, tokens: Tensor, aux_weight: float = 1.0) -> Tensor:
        if not self.is_moe:
            return self.ffn(f)
        if aux_weight == 1.0:
            return self.ffn(f, token_ids=tokens)
        return self.ffn(f, token_ids=tokens, aux_weight=aux_weight)

    def _ffn_on_spans(self, f: Tensor, tokens: Tensor, spans: list[tuple[int, int]], aux_weight: float) -> Tensor:
        """The FFN of the positions in ``spans`` (every rank of an expert-parallel group still calls the MoE
        layer, with no rows if need be: its all-to-alls are collective), zeros elsewhere. [B, S, H]."""
        from moekit.models.mtp import take_spans

        rows = take_spans(f, spans) if spans else f[:, :0]
        ids = take_spans(tokens, spans) if spans else tokens[:, :0]
        y = self._ffn(rows, ids, aux_weight)  # [B, kept, H]
        parts, at, used = [y[:, :0]], 0, 0  # y joins the graph even with no rows (every parameter gets a gradient)
        for a, b in spans:
            parts += [y.new_zeros(y.shape[0], a - at, y.shape[2]), y[:, used : used + b - a]]
            at, used = b, used + b - a
        parts.append(y.new_zeros(y.shape[0], f.shape[1] - at, y.shape[2]))
        return torch.cat(parts, dim=1)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        # Tied: the output projection reads embed.weight directly, so there is one Parameter and no
        # tie to restore after to_empty() or a checkpoint load.
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # multi-token prediction depths (models.mtp): empty unless model.mtp_layers > 0
        self.mtp = nn.ModuleList(MTPModule(config, config.num_layers + k) for k in range(config.mtp_layers))
        if config.lora_rank:  # fine-tuning adapters (models.lora): after every projection exists
            from moekit.models.lora import add_lora

            add_lora(self, config.lora_rank, config.lora_alpha, config.lora_targets, rslora=config.lora_rslora,
                     dropout=config.lora_dropout)
        self.mtp_record = MTPRecord()  # MTP losses of the training forwards since pop_mtp_loss
        self.mtp_in_eval = False  # the depths also run (recording only) in eval forwards with targets
        # comm.context_parallel: tokens are this rank's share of each sequence (RoPE at their positions)
        self.context_parallel = None
        # document masking (the trainer's train.document_mask): attention stays within the documents that this
        # end-of-document id separates in a packed sequence; None: every position sees all earlier ones
        self.document_eos: int | None = None
        # the residual stream's dtype (embed_tokens): None keeps the embedding's (fp32 parameters: fp32 even under
        # autocast, whose bf16 outputs the residual adds promote back); the trainer sets train.residual_dtype's
        self.residual_dtype: torch.dtype | None = None
        # the trainer's count of a step's counted targets per micro-batch and rank, when the data has loss masks:
        # training forwards divide their summed loss by it (training_loss); None: each forward's own mean
        self.loss_normalizer: float | None = None
        # the same for each multi-token-prediction depth's targets (k ahead: fewer of them), depth 1 first
        self.mtp_normalizers: tuple[float, ...] | None = None

    def forward(self, tokens: Tensor, cache: KVCache | None = None, targets: Tensor | None = None,
                return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """tokens [B, S] int64 -> logits [B, S, V] float32; with ``targets`` [B, S], the mean next-token
        cross-entropy instead, computed from the final hidden states in token chunks without keeping the
        logits (models.loss.chunked_lm_loss: the trainer's loss, GBs less activation memory at large
        vocabularies). The same value as ``F.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten())``
        up to the order of float sums.

        ``cache``: incremental decoding (module docstring): tokens are the positions after the cached ones,
        whose keys and values are appended to it. ``return_hidden`` (no targets): (logits, the final normed
        hidden states [B, S, H]), which multi-token-prediction drafting reads (moekit.train.decoding)."""
        _check_ids("tokens", tokens)
        if targets is not None:
            _check_ids("targets", targets)
            if targets.shape != tokens.shape:
                raise ValueError(f"targets {tuple(targets.shape)} must have the tokens' shape {tuple(tokens.shape)}")
        B, S = tokens.shape
        if B * S == 0:  # nothing to run: the empty logits (a loss over no tokens has no value)
            if targets is not None:
                raise ValueError(f"tokens {tuple(tokens.shape)} hold no token to compute a loss over")
            return torch.zeros(B, S, self.config.vocab_size, device=tokens.device)
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"KV cache has {len(cache.layers)} layers, the model {len(self.layers)}; build it with "
                             f"KVCache(model.config)")
        cos, sin, segments = forward_positions(self, tokens, cache)  # [S, R/2] x 2, [B, S] or None
        x = emb = embed_tokens(self, tokens)  # [B, S, H]
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, cos, sin, tokens, segments=segments)  # [B, S, H]
            else:
                x = layer(x, cos, sin, tokens, cache.layers[i])  # [B, S, H]
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight  # [V, H]
        if targets is not None:
            return training_loss(self, x, weight, emb, tokens, targets, cos, sin, segments)
        logits = F.linear(x, weight).float()  # [B, S, V]
        return (logits, x) if return_hidden else logits

    def pop_mtp_loss(self) -> Tensor | None:
        """The mean multi-token-prediction loss (models.mtp) of the training forwards since the last call, a
        detached device tensor (no sync), or None when none ran; resets the running mean."""
        return self.mtp_record.pop()

    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter and buffer from ``seed`` alone, device and layout independent (models.init: each
        value is a function of the seed, the parameter's name and its position; a parallelised model fills only
        what each rank holds)."""
        from moekit.models.init import init_weights

        init_weights(self, seed)


def _check_ids(name: str, ids) -> None:
    """A [B, S] tensor of integer ids (their range is not checked: that would read them, a device sync)."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        what = (f"a {ids.dim()}-d {ids.dtype} tensor {tuple(ids.shape)}" if isinstance(ids, Tensor)
                else type(ids).__name__)
        raise TypeError(f"{name} must be a [batch, seq] tensor of integer token ids (torch.long), got {what}")


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
    for bias in (getattr(ffn.router, "bias", None), getattr(ffn.experts, "b_in", None),
                 getattr(ffn.experts, "b_out", None)):  # gpt-oss's gate and expert biases start at 0
        if bias is not None:
            bias.zero_()
    if ffn.shared_expert is not None:
        init_ffn(ffn.shared_expert, normal_, std, std_out)
    for _, buf in ffn.router.named_buffers():  # e.g. the aux-loss-free expert_bias and its pending load
        buf.zero_()


class _NoInitOnMeta(TorchFunctionMode):
    """``torch.nn.init`` and the in-place random fills do nothing to a meta tensor: it holds no values. Without
    this the modules' constructors run them anyway, and torch's meta path for a random fill (a Python reference
    wrapped to keep dynamo out) imports torch._dynamo: ~1.3 s at a process's first build (generate, convert,
    eval, dry runs, config checks; a trainer pays it anyway when it builds AdamW)."""

    FILLS = frozenset({"normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
                       "bernoulli_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        initialising = getattr(func, "__module__", None) == "torch.nn.init" or name in self.FILLS
        if initialising and isinstance(target, Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device():
    """``torch.device("meta")`` for building a model's skeleton (shapes, no memory), its modules' weight init
    skipped: ``init_weights(seed)`` fills every parameter once the model is materialised."""
    with torch.device("meta"), _NoInitOnMeta():
        yield


def build_model(config: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build on the meta device (no memory, no init), materialise on ``device``, init from ``seed``."""
    if not isinstance(config, ModelConfig):
        hint = f"; for a preset: build_model(preset({config!r}))" if isinstance(config, str) else (
            "; from a dict: build_model(ModelConfig.from_dict(d))" if isinstance(config, dict) else "")
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}{hint}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r} is invalid; it must be an integer in [0, 2**63)")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is invalid; use 'cpu', 'cuda', 'cuda:N' or a torch.device") from None
    with meta_device():
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
