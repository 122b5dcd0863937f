"""Top-k routing in one pass per direction: scores, selection, weights, per-expert counts and the logsumexp.

Shape legend: T tokens, E experts, k slots per token. Everything is float32 (the router's precision).

    forward   scores  = softmax(logits) or sigmoid(logits)                      [T, E]
              choice  = scores (+ expert_bias, selection only)
              indices = the k largest of choice per token, best first           [T, k] int64
              weights = scores[indices] (/ their sum if normalize) * scaling    [T, k]
              lse     = logsumexp(logits) per token (the z-loss's input)        [T]
              counts  = slots per expert                                        [E] int64
    backward  d logits from d weights, d scores and d lse (any of them absent), recomputing the scores
              from the logits: nothing but the logits and the indices is saved.

Why a kernel: the torch router (moe.router.TopKRouter) is ~20 launches forward and ~15 backward for
these steps (softmax, topk, gather, sum, clamp, div, mul, the counts' where / zeros / ones / scatter_add,
logsumexp, and their backward), each a pass over [T, E] or smaller. On a GPU the router was launch-bound:
2.6-3.1 ms per forward+backward at 8192 tokens on an H100 whatever E was (docs/benchmarks.md, "Second GPU
round"), against a few microseconds of memory traffic. Here one program owns BLOCK_T tokens x all E
experts (E <= MAX_EXPERTS, one register tile per row), selects the k best by k rounds of argmax with the
winner masked out (ties go to the lower expert id), and adds its tokens' counts to the [E] total with one
vector of integer atomics (exact, so still deterministic). moe.router keeps the torch version as the
reference and as the path for everything this does not cover (groups, float64, E > MAX_EXPERTS).
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from . import _common
from ._common import BUILD_ERRORS, Kernel, build_failure, cdiv, interpret_mode, pow2

MAX_EXPERTS = 1024  # one [BLOCK_T, pow2(E)] fp32 tile per program
MAX_TOP_K = 32  # unrolled selection rounds
SCORES = {"softmax": 0, "sigmoid": 1}
NORM_EPS = 1e-20  # the torch router's clamp_min on the selected scores' sum


def topk_route_ref(logits: torch.Tensor, top_k: int, score: str = "softmax", normalize: bool = True,
                   scaling: float = 1.0, bias: torch.Tensor | None = None):
    """The same outputs in plain torch (moe.router's own steps): (indices, weights, scores, lse, counts)."""
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(NORM_EPS)
    weights = weights * scaling
    counts = torch.bincount(indices.reshape(-1), minlength=logits.shape[1])
    return indices, weights, scores, torch.logsumexp(logits, dim=-1), counts


@triton.jit
def _scores(lg, e_mask, SCORE: tl.constexpr):
    """softmax / sigmoid of a [BLOCK_T, E_P2] logits tile (masked columns -inf), and the rows' logsumexp."""
    mx = tl.max(lg, axis=1)
    ex = tl.exp(lg - mx[:, None])  # exp(-inf) = 0 in the masked columns
    den = tl.sum(ex, axis=1)
    lse = mx + tl.log(den)
    if SCORE == 0:
        s = ex / den[:, None]
    else:
        s = tl.where(e_mask[None, :], 1.0 / (1.0 + tl.exp(-lg)), 0.0)
    return s, ex / den[:, None], lse


@triton.jit
def _logits_tile(LOGITS, T, E, stride_lt, E_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's BLOCK_T tokens x pow2(E) logits: (token offsets, token mask, expert ids, expert mask,
    their product, the tile). Padded experts read -inf (never selected); tokens past T read finite zeros."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < T
    cols = tl.arange(0, E_P2)
    e_mask = cols < E
    m = t_mask[:, None] & e_mask[None, :]
    lg = tl.load(LOGITS + offs_t[:, None] * stride_lt + cols[None, :], mask=m, other=0.0)
    return offs_t, t_mask, cols, e_mask, m, tl.where(e_mask[None, :], lg, -float("inf"))


@triton.jit
def _topk_route_fwd_kernel(
    LOGITS, BIAS, IDX, W, SCORES_OUT, LSE, COUNTS,
    T, E, stride_lt, scaling,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, SCORE: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_t, t_mask, cols, e_mask, m, lg = _logits_tile(LOGITS, T, E, stride_lt, E_P2, BLOCK_T)
    s, _, lse = _scores(lg, e_mask, SCORE)
    choice = s
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + cols, mask=e_mask, other=0.0)[None, :]
    choice = tl.where(e_mask[None, :], choice, -float("inf"))
    picked = tl.zeros((BLOCK_T, E_P2), dtype=tl.int32)
    kcols = tl.arange(0, K_P2)
    sel = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)  # the k ids, best first
    val = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)  # their scores
    # k rounds: the best remaining expert per token, then masked out (argmax takes the lowest id on ties)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)  # [BLOCK_T]
        hit = cols[None, :] == best[:, None]
        v = tl.sum(tl.where(hit, s, 0.0), axis=1)  # exact: one non-zero term
        sel = tl.where(kcols[None, :] == j, best[:, None], sel)
        val = tl.where(kcols[None, :] == j, v[:, None], val)
        picked += hit.to(tl.int32)
        choice = tl.where(hit, -float("inf"), choice)
    if NORMALIZE:  # the torch router's order: (v / max(sum, eps)) * scaling
        val = val / tl.maximum(tl.sum(val, axis=1), 1e-20)[:, None]
    val = val * scaling
    km = t_mask[:, None] & (kcols < TOP_K)[None, :]
    tl.store(IDX + offs_t[:, None] * TOP_K + kcols[None, :], sel.to(tl.int64), mask=km)
    tl.store(W + offs_t[:, None] * TOP_K + kcols[None, :], val, mask=km)
    tl.store(SCORES_OUT + offs_t[:, None] * E + cols[None, :], s, mask=m)
    tl.store(LSE + offs_t, lse, mask=t_mask)
    per_expert = tl.sum(tl.where(t_mask[:, None], picked, 0), axis=0).to(tl.int64)  # [E_P2]
    tl.atomic_add(COUNTS + cols, per_expert, mask=e_mask & (per_expert > 0))


@triton.jit
def _topk_route_bwd_kernel(
    LOGITS, IDX, DW, DSCORES, DLSE, DLOGITS,
    T, E, stride_lt, scaling,
    TOP_K: tl.constexpr, E_P2: tl.constexpr, SCORE: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_DW: tl.constexpr, HAS_DSCORES: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_t, t_mask, cols, e_mask, m, lg = _logits_tile(LOGITS, T, E, stride_lt, E_P2, BLOCK_T)
    s, soft, _ = _scores(lg, e_mask, SCORE)
    g = tl.zeros((BLOCK_T, E_P2), dtype=tl.float32)  # d loss / d scores
    if HAS_DSCORES:
        g += tl.load(DSCORES + offs_t[:, None] * E + cols[None, :], mask=m, other=0.0)
    if HAS_DW:
        # w_j = c v_j / max(S, eps), S = sum_j v_j: d v_j = c (g_j / S - sum_l g_l v_l / S^2) while S >= eps
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        gv = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            e_j = tl.load(IDX + offs_t * TOP_K + j, mask=t_mask, other=0)
            v = tl.sum(tl.where(cols[None, :] == e_j[:, None], s, 0.0), axis=1)
            gj = tl.load(DW + offs_t * TOP_K + j, mask=t_mask, other=0.0)
            total += v
            gv += gj * v
        live = total >= 1e-20
        den = tl.maximum(total, 1e-20)
        for j in tl.static_range(TOP_K):
            e_j = tl.load(IDX + offs_t * TOP_K + j, mask=t_mask, other=0)
            gj = tl.load(DW + offs_t * TOP_K + j, mask=t_mask, other=0.0)
            if NORMALIZE:
                dv = scaling * (gj / den - tl.where(live, gv / (den * den), 0.0))
            else:
                dv = scaling * gj
            g += tl.where(cols[None, :] == e_j[:, None], dv[:, None], 0.0)
    if SCORE == 0:  # softmax: s (g - <g, s>)
        d = s * (g - tl.sum(g * s, axis=1)[:, None])
    else:  # sigmoid: g s (1 - s)
        d = g * s * (1.0 - s)
    if HAS_DLSE:  # d logsumexp / d logits = softmax
        d += tl.load(DLSE + offs_t, mask=t_mask, other=0.0)[:, None] * soft
    tl.store(DLOGITS + offs_t[:, None] * E + cols[None, :], d, mask=m)


# One config each: the tile is a launch argument (BLOCK_T tokens x pow2(E) experts, 2048 fp32 per program, 16 a
# thread: with 4096 the backward spilled 56-92 bytes a thread at E 64-1024 (ptxas, sm90); at 2048 neither spills).
_ONE = triton.Config({}, num_warps=4)
TOPK_ROUTE_FWD = Kernel(_topk_route_fwd_kernel, configs=[_ONE], interpret_config=_ONE, key=[])
TOPK_ROUTE_BWD = Kernel(_topk_route_bwd_kernel, configs=[_ONE], interpret_config=_ONE, key=[])
_TILE = 2048
_INTERPRET_BLOCK_T = 4


def _block_t(e_p2: int) -> int:
    if interpret_mode():
        return _INTERPRET_BLOCK_T
    return max(1, min(128, _TILE // e_p2))


def why_not_topk_route(logits: torch.Tensor, top_k: int, score: str, bias: torch.Tensor | None = None) -> str:
    """"" when :func:`topk_route` can run on these arguments, else the reason."""
    if logits.dim() != 2:
        return f"logits must be [T, E], got shape {tuple(logits.shape)}"
    if logits.dtype != torch.float32:
        return f"logits must be float32, got {logits.dtype}"
    if logits.device.type != "cuda" and not interpret_mode() and _common.CAPTURE is None:  # (capture: offline compile)
        return f"the kernel runs on CUDA (or the CPU under TRITON_INTERPRET=1), not on {logits.device.type}"
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        return f"{E} experts: the kernel holds a token's scores in one tile, at most {MAX_EXPERTS}"
    if not 1 <= top_k <= min(E, MAX_TOP_K):
        return f"top_k={top_k} must be in [1, min(E={E}, {MAX_TOP_K})]"
    if score not in SCORES:
        return f"score {score!r} is not one of {sorted(SCORES)}"
    if bias is not None and (bias.shape != (E,) or bias.dtype != torch.float32 or bias.device != logits.device):
        return f"expert_bias must be float32 [E={E}] on {logits.device}, got {bias.dtype} {tuple(bias.shape)}"
    return ""


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _TopKRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k: int, score: str, normalize: bool, scaling: float):
        logits = _contiguous_rows(logits)
        T, E = logits.shape
        dev = logits.device
        idx = torch.empty(T, top_k, dtype=torch.int64, device=dev)
        w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
        scores = torch.empty(T, E, dtype=torch.float32, device=dev)
        lse = torch.empty(T, dtype=torch.float32, device=dev)
        counts = torch.zeros(E, dtype=torch.int64, device=dev)
        if T > 0:
            e_p2 = pow2(E)
            bt = _block_t(e_p2)
            TOPK_ROUTE_FWD[(cdiv(T, bt),)](
                logits, bias if bias is not None else logits, idx, w, scores, lse, counts,
                T, E, logits.stride(0), float(scaling),
                TOP_K=top_k, K_P2=pow2(top_k), E_P2=e_p2, SCORE=SCORES[score], NORMALIZE=bool(normalize),
                HAS_BIAS=bias is not None, BLOCK_T=bt,
            )
        ctx.save_for_backward(logits, idx)
        ctx.cfg = (top_k, score, bool(normalize), float(scaling))
        ctx.mark_non_differentiable(idx, counts)
        ctx.set_materialize_grads(False)
        return idx, w, scores, lse, counts

    @staticmethod
    def backward(ctx, _didx, dw, dscores, dlse, _dcounts):
        logits, idx = ctx.saved_tensors
        none = (None,) * 5
        if dw is None and dscores is None and dlse is None:
            return (torch.zeros_like(logits),) + none
        if logits.shape[0] == 0:
            return (torch.empty_like(logits),) + none
        dw = _contiguous_rows(dw.float()) if dw is not None else None
        dscores = dscores.float().contiguous() if dscores is not None else None
        dlse = dlse.float().contiguous() if dlse is not None else None
        try:
            return (_backward_kernel(logits, idx, dw, dscores, dlse, ctx.cfg),) + none
        except BUILD_ERRORS as exc:  # the forward built but the backward cannot: autograd on the torch steps
            warnings.warn(f"moe.kernels.topk_route: the backward kernel failed to build here ({build_failure(exc)}); "
                          f"its torch steps run instead", stacklevel=2)
            return (backward_ref(logits, idx, dw, dscores, dlse, ctx.cfg),) + none


def backward_ref(logits, idx, dw, dscores, dlse, cfg) -> torch.Tensor:
    """d logits by autograd through the torch steps, the selection taken from ``idx`` (no top-k again)."""
    _top_k, score, normalize, scaling = cfg
    with torch.enable_grad():
        lg = logits.detach().requires_grad_(True)
        s = lg.softmax(-1) if score == "softmax" else lg.sigmoid()
        w = s.gather(1, idx)
        if normalize:
            w = w / w.sum(-1, keepdim=True).clamp_min(NORM_EPS)
        w = w * scaling
        pairs = [(o, g) for o, g in ((w, dw), (s, dscores), (torch.logsumexp(lg, -1), dlse)) if g is not None]
        return torch.autograd.grad([o for o, _ in pairs], lg, [g for _, g in pairs])[0]


def _backward_kernel(logits, idx, dw, dscores, dlse, cfg) -> torch.Tensor:
    top_k, score, normalize, scaling = cfg
    T, E = logits.shape
    dlogits = torch.empty(T, E, dtype=torch.float32, device=logits.device)
    e_p2 = pow2(E)
    bt = _block_t(e_p2)
    TOPK_ROUTE_BWD[(cdiv(T, bt),)](
        logits, idx, dw if dw is not None else logits, dscores if dscores is not None else logits,
        dlse if dlse is not None else logits, dlogits,
        T, E, logits.stride(0), scaling,
        TOP_K=top_k, E_P2=e_p2, SCORE=SCORES[score], NORMALIZE=normalize,
        HAS_DW=dw is not None, HAS_DSCORES=dscores is not None, HAS_DLSE=dlse is not None, BLOCK_T=bt,
    )
    return dlogits


def topk_route(logits: torch.Tensor, top_k: int, score: str = "softmax", normalize: bool = True,
               scaling: float = 1.0, bias: torch.Tensor | None = None):
    """(indices [T, k] int64, weights [T, k], scores [T, E], lse [T], counts [E] int64): module docstring.
    Differentiable in the logits through weights, scores and lse; ``bias`` only changes the selection."""
    reason = why_not_topk_route(logits, top_k, score, bias)
    if reason:
        raise ValueError(f"topk_route (Triton): {reason}")
    return _TopKRoute.apply(logits, bias, int(top_k), score, bool(normalize), float(scaling))
