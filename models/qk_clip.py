"""QK-clip (Kimi K2's MuonClip, Kimi Team 2025): keep every attention head's largest logit q . k under a threshold
by rescaling its query and key weights after each optimizer step (``--train.qk_clip TAU``, 0 = off).

Muon (and AdamW) can grow attention logits without bound in a model with no q / k norm (MLA cannot normalise its
decoupled keys), and an exploding logit is a loss spike. QK-clip watches each head's maximum pre-softmax logit over
the step's training forwards, S_h = max_(i, j) scale q_i . k_j over the causal pairs (within a sliding window or an
attention chunk where the layer has one), and where S_h > tau multiplies the head's weights so that its logits shrink
by gamma_h = tau / S_h. The head's next logits are then about tau; heads under tau are not touched:

    GQA (N query heads share K < N key heads)   query rows of head h (and their bias) x gamma_h; keys untouched,
                                                since another head shares them
    MHA (K = N)                                 query rows and key rows of head h (biases too) x sqrt(gamma_h)
    MLA (DeepSeek-V3, Kimi K2)                  q's nope rows x sqrt(gamma_h), its rope rows x gamma_h (wq or wq_b);
                                                the head's key nope rows of wkv_b x sqrt(gamma_h); the rope key
                                                (shared by every head) untouched

RoPE, an attention temperature and the head's gated output commute with the scaling, so the logit of every pair
scales by exactly gamma_h. Under document masking (--data.document_mask) only the pairs within a document count, as
only they reach the softmax.

Cost: one extra q k^T per attention layer and training forward (no_grad, blocks of queries: at most
``BLOCK_ELEMENTS`` logits at once), about a quarter of the attention's forward + backward FLOPs, and one all-reduce
(max) of every head's maximum over the pipeline stage's ranks per step. Models with q / k norms (qk_norm "head",
"full", "unit") are refused: the norms bound the logits already, and scaling the projections would not move them.

Layouts: under tensor parallelism a rank computes and records its contiguous block of heads (its place in the "tp"
mesh dim of the query weight); every rank's maxima sit at their heads' global indices in one vector per stage,
reduced by max over the stage's ranks (data, context and tensor parallel ranks hold the same layers). The scaling
reads each weight's own rows (``models.hf.sharded.shard_box``: FSDP's and TP's shards alike).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

BLOCK_ELEMENTS = 1 << 24  # logits computed at once when a layer's maximum is taken (~64 MB in fp32)


def tracked_modules(model: nn.Module) -> list[nn.Module]:
    """The softmax attention modules (models.attention's Attention and MLAttention) of ``model``, a pipeline rank's
    stages included, in a fixed order."""
    from moekit.models.attention import Attention, MLAttention

    roots = (model, *getattr(model, "stages", ()))
    seen, out = set(), []
    for root in roots:
        for m in root.modules():
            if isinstance(m, (Attention, MLAttention)) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def check_model(config) -> str:
    """"" when QK-clip can run on this model (a models.config.ModelConfig), else why not."""
    if getattr(config, "qk_norm", "none") != "none":
        return (f"model.qk_norm={config.qk_norm!r}: the q / k norms bound the attention logits already, and scaling "
                f"the projections would not move them; use QK-clip on models without q / k norms (MLA, GQA)")
    if config.linear_attention != "none" and all(config.is_linear_layer(i) for i in range(config.num_layers)):
        return "every layer is linear attention (no softmax logits to clip)"
    return ""


def track(model: nn.Module, on: bool = True) -> None:
    """Start (or stop) recording each attention head's largest logit in training forwards: a buffer of this rank's
    heads per module (``logit_max``, -inf until a forward records), reset by ``clip``. Call it on the model as it
    will train (parallelised, on its device)."""
    for m in tracked_modules(model):
        m.logit_track = on
        offset, local = head_block(m)
        m.logit_heads = (offset, local)
        buf = torch.full((local,), -math.inf, device=_weight(m).device) if on else None
        m.register_buffer("logit_max", buf, persistent=False)


def reset(model: nn.Module) -> None:
    """Forget the logits recorded since the last ``clip`` (a skipped step's)."""
    for m in tracked_modules(model):
        if getattr(m, "logit_max", None) is not None:
            m.logit_max.fill_(-math.inf)


def head_block(m: nn.Module) -> tuple[int, int]:
    """(first head, heads) this rank computes in attention module ``m``: its block of the "tp" mesh dim of the query
    weight under tensor parallelism, all of them otherwise."""
    n = m.num_heads
    w = _weight(m)
    mesh = getattr(w, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" not in names:
        return 0, n
    tp, r = mesh.size(names.index("tp")), mesh.get_local_rank(names.index("tp"))
    return r * (n // tp), n // tp


def _weight(m: nn.Module) -> Tensor:
    """The query projection's weight (wq, or MLA's wq_b)."""
    return (m.wq if hasattr(m, "wq") else m.wq_b).weight


@torch.no_grad()
def record(m: nn.Module, q: Tensor, k: Tensor, scale: float, q_pos: Tensor, segments: Tensor | None = None) -> None:
    """Raise ``m.logit_max`` [heads] to this forward's per-head maximum of scale q . k over the pairs the layer lets
    attend (causal; within ``m.window`` / ``m.chunk`` where set; within a document where ``segments`` [B, >= P], the
    document of every position, is given). q [B, N, S, D] at the global positions ``q_pos`` [S], k [B, K, P, D] at
    positions 0 .. P - 1 (K divides N: each key head serves N / K query heads)."""
    B, N, S, _ = q.shape
    K, P = k.shape[1], k.shape[2]
    if K != N:
        k = k.repeat_interleave(N // K, dim=1)
    window, chunk = getattr(m, "window", 0) or 0, getattr(m, "chunk", 0) or 0
    k_pos = torch.arange(P, device=q.device)
    block = max(1, BLOCK_ELEMENTS // max(1, B * N * P))
    best = torch.full((N,), -math.inf, device=q.device)
    kt = k.transpose(-1, -2)
    for s0 in range(0, S, block):
        qp = q_pos[s0 : s0 + block, None]  # [b, 1]
        allowed = k_pos[None, :] <= qp
        if window:
            allowed &= qp - k_pos[None, :] < window
        if chunk:
            allowed &= qp // chunk == k_pos[None, :] // chunk
        if segments is not None:  # [B, 1, b, P]: the pairs within one document
            same = segments[:, q_pos[s0 : s0 + block], None] == segments[:, None, :P]
            allowed = (allowed & same)[:, None]
        logits = torch.matmul(q[:, :, s0 : s0 + block], kt).float() * scale  # [B, N, b, P]
        logits = logits.masked_fill(~allowed, -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)))
    m.logit_max.copy_(torch.maximum(m.logit_max, best))


def recording(m: nn.Module) -> bool:
    """Whether ``m``'s forward records its logits now: tracking on, a training forward with gradients (not an
    evaluation, not a decoding step), not a checkpointed block's recompute in backward (it saw those logits
    already; a compiled block replays its graph, record included, which only repeats a maximum)."""
    if not (getattr(m, "logit_track", False) and m.training and torch.is_grad_enabled()):
        return False
    if torch.compiler.is_compiling():
        return True
    from moekit.moe.load import in_backward

    return not in_backward()


def _row_factors(rows: int, per_head: int, parts: list[tuple[int, int, Tensor]]) -> Tensor:
    """[rows] factors of a weight whose rows hold ``per_head`` rows per head: for each (start, stop, f [N]) rows
    start .. stop - 1 of head h's block times f[h]; 1 elsewhere."""
    n = rows // per_head
    out = torch.ones(n, per_head, device=parts[0][2].device)
    for start, stop, f in parts:
        out[:, start:stop] = f[:, None]
    return out.reshape(rows)


@torch.no_grad()
def _scale_rows(param: Tensor | None, factors: Tensor) -> None:
    """param's rows (dim 0: a weight [rows, in] or a bias [rows]) times factors [rows], on the rows this rank holds."""
    if param is None:
        return
    from moekit.models.hf.sharded import shard_box

    rows = shard_box(param, "qk_clip")[0]
    local = param.to_local() if hasattr(param, "to_local") else param
    f = factors[rows.start : rows.stop].to(local.dtype)
    local.mul_(f.view(-1, *([1] * (local.dim() - 1))))


@torch.no_grad()
def clip(model: nn.Module, tau: float, group=None) -> dict:
    """After an optimizer step: every head's largest logit since the last call, reduced by max over ``group`` (the
    pipeline stage's ranks; None: this process alone), and the heads over ``tau`` rescaled (module docstring).
    Returns {"max_logit": the largest over every head of this rank's layers (a float), "clipped_heads": how many were
    rescaled}; resets the record."""
    mods = tracked_modules(model)
    mods = [m for m in mods if getattr(m, "logit_max", None) is not None]
    if not mods:
        return {"max_logit": None, "clipped_heads": 0}
    device = mods[0].logit_max.device
    whole = torch.full((sum(m.num_heads for m in mods),), -math.inf, device=device)
    at = 0
    for m in mods:
        offset, local = m.logit_heads
        whole[at + offset : at + offset + local] = m.logit_max
        at += m.num_heads
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=group)
    gamma = torch.where(whole > tau, tau / whole, torch.ones_like(whole))  # -inf (never attended): 1
    at = 0
    for m in mods:
        g = gamma[at : at + m.num_heads]
        at += m.num_heads
        _rescale(m, g)
        m.logit_max.fill_(-math.inf)
    finite = whole[torch.isfinite(whole)]
    return {"max_logit": float(finite.max()) if finite.numel() else None, "clipped_heads": int((whole > tau).sum())}


def _rescale(m: nn.Module, gamma: Tensor) -> None:
    """Head h's query (and key) rows times the factors that shrink its logits by gamma[h] (module docstring)."""
    if (gamma == 1).all():
        return
    root = gamma.sqrt()
    if hasattr(m, "wkv_b"):  # MLA: q nope x sqrt, q rope x gamma; the key nope rows of wkv_b x sqrt
        nope, rope, v = m.nope, m.rope, m.v_dim
        wq = m.wq if hasattr(m, "wq") else m.wq_b
        f = _row_factors(m.num_heads * (nope + rope), nope + rope, [(0, nope, root), (nope, nope + rope, gamma)])
        _scale_rows(wq.weight, f)
        _scale_rows(m.wkv_b.weight, _row_factors(m.num_heads * (nope + v), nope + v, [(0, nope, root)]))
        return
    D, N, K = m.head_dim, m.num_heads, m.num_kv_heads
    per_head = 2 * D if m.output_gate else D  # a gated query head's rows: [q | gate]
    shared = K != N
    fq = _row_factors(N * per_head, per_head, [(0, D, gamma if shared else root)])
    _scale_rows(m.wq.weight, fq)
    _scale_rows(m.wq.bias, fq)
    if not shared:
        fk = _row_factors(K * D, D, [(0, D, root)])
        _scale_rows(m.wk.weight, fk)
        _scale_rows(m.wk.bias, fk)
