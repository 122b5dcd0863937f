"""The gated delta rule (Yang et al. 2025, "Gated Delta Networks"): the state recurrence of Gated DeltaNet's
linear attention (models.linear_attention) and its chunked forms.

Shape legend: B batch, S positions, N heads (value heads: q and k come expanded to them), dk / dv the key / value
widths, L the chunk length. Per head, a state S [dk, dv] and for each position t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

``gated_delta_steps`` runs it position by position (decoding; the tests' reference). ``gated_delta_rule`` runs it
in chunks: within a chunk of L positions the L corrections solve a unit lower-triangular system (the WY / UT form
of the delta rule), so a chunk is a handful of [L, L] and [L, d] matmuls and the state crosses chunks once per
chunk. Every exponent in it is a log decay difference <= 0 (masked before exp), so nothing overflows.
``gated_delta_rule_affine`` keeps the starting state symbolic (context parallelism), ``RecomputedRule`` keeps only
the inputs for backward. Document masking (``segments``) starts the state from zero at every document.

The per-chunk terms are batched torch ops over all chunks at once (``_chunk_terms``); the scan that carries the
state from chunk to chunk is sequential. On CUDA (``TRITON_SCAN``, below) it runs as two Triton kernels,
moe.kernels.delta_scan: one launch forward, one backward, each program holding a head's state columns in registers
across the chunks (docs/kernels.md, "Delta-rule scan"); elsewhere, and for float64, as a torch loop over the chunks
(a few small kernels per chunk: launch-bound on a GPU).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.moe.kernel_choice import mode_from_env, mode_problem, why_not_cached

# Where gated_delta_rule's scan over the chunks runs as the Triton kernels (moe.kernels.delta_scan: one launch
# forward, one backward, instead of a handful of small launches per chunk): "auto" on CUDA float32 terms (not while
# torch.compile traces); "always" on CPU tensors too, in the Triton interpreter (TRITON_INTERPRET=1: tests), raising
# instead of falling back; "never": the torch loop everywhere (the benchmark's reference). float64 inputs always run
# the loop (the tests' references), and so does gated_delta_rule_affine (context parallelism). It starts as the
# environment variable MOEKIT_DELTA_SCAN says (a benchmark's A / B in separate processes); unset, "never" for now:
# the kernels have not run on a GPU yet (the interpreter and the sm90 compile check only; they spill ~1.1 KB of
# registers a thread there), so MOEKIT_DELTA_SCAN=auto opts in until the GPU tier's
# test_gated_delta_rule_on_device_matches_float64[scan] passes and tools/bench/linear_attention.py shows them faster.
DELTA_SCAN_ENV = "MOEKIT_DELTA_SCAN"
TRITON_SCAN = mode_from_env(DELTA_SCAN_ENV, "never")
_SCAN_OK: dict = {}  # CUDA device -> why_not_delta_scan's answer
_BUILD_FAILURE: list[str] = []  # why the kernels could not be built here, once they failed (then: the loop)


def delta_scan_problem() -> str:
    """"" or what is wrong with TRITON_SCAN (set from MOEKIT_DELTA_SCAN)."""
    return mode_problem("models.delta_rule.TRITON_SCAN", TRITON_SCAN, DELTA_SCAN_ENV)


def _scan_path(x: Tensor) -> bool:
    """Whether gated_delta_rule's scan on inputs like ``x`` runs as the Triton kernels (TRITON_SCAN above)."""
    if delta_scan_problem():
        raise ValueError(delta_scan_problem())
    mode, device = TRITON_SCAN, x.device
    if mode == "never" or x.dtype == torch.float64:
        return False
    if mode == "auto" and (device.type != "cuda" or torch.compiler.is_compiling() or _BUILD_FAILURE):
        return False
    reason = why_not_cached(_SCAN_OK, device, device, "delta_scan", "why_not_delta_scan", device)
    if reason and mode == "always":
        raise ValueError(f"gated_delta_rule with models.delta_rule.TRITON_SCAN='always': the Triton scan cannot run: "
                         f"{reason} (set it to 'auto' or 'never')")
    return not reason


def _kernel_scan(U0, W, q_start, scores, k_end, carry, state, final_state):
    """(o [B, N, n, L, dv], final state or None) from the Triton scan; None, with one warning, when this machine's
    Triton cannot build it ("always": the error is raised instead)."""
    from moekit.moe.kernels._common import BUILD_ERRORS, record_build_failure
    from moekit.moe.kernels.delta_scan import delta_scan

    try:
        return delta_scan(U0, W, q_start, scores, k_end, carry,
                          None if state is None else state.to(torch.float32), final_state,
                          strict=TRITON_SCAN == "always", failures=_BUILD_FAILURE)
    except BUILD_ERRORS as exc:
        if TRITON_SCAN == "always":
            raise
        record_build_failure(exc, _BUILD_FAILURE, "models.delta_rule", "Triton delta-rule scan", "the torch loop runs",
                             "models.delta_rule.TRITON_SCAN")
        return None


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the eps inside the root, as the FLA kernels and transformers)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                     chunk: int = 64, final_state: bool = True,
                     segments: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over S positions, chunked (module docstring), in float32.

    q, k [B, S, N, dk] (already normalised and scaled, one per value head), v [B, S, N, dv], g and beta [B, S, N],
    ``state`` [B, N, dk, dv] before the first position (None: zeros). Returns (o [B, S, N, dv], the state after
    the last position, or None without ``final_state``: training skips that last update), in float32 (float64 for
    float64 inputs).

    Within a chunk, with G_i the cumulative log decay up to position i and S0 the state at the chunk's start, the
    corrections u_j = beta_j (v_j - (decayed state before j)^T k_j) satisfy (I + A) U = beta V - beta e^G K S0 with
    A_jm = beta_j e^(G_j - G_m) k_j . k_m for m < j; then o_i = e^(G_i) S0^T q_i + sum_{j <= i} e^(G_i - G_j)
    (q_i . k_j) u_j and the next chunk's state is e^(G_L) S0 + sum_j e^(G_L - G_j) k_j u_j^T.

    ``segments`` [B, S] (document masking: each position's document in a packed sequence, contiguous runs): the
    state starts from zero at every document's first position. Within a chunk the pairs (i, j) of different
    documents drop out of A and of the scores, and S0 reaches only the positions of the document that was running
    when the chunk began (``state`` belongs to the first position's).
    """
    B, S, N, dk = q.shape
    dv = v.shape[-1]
    if _scan_path(q):
        U0, W, q_start, scores, k_end, carry, n, L = _chunk_terms(q, k, v, g, beta, chunk, segments, stacked=True)
        o = _kernel_scan(U0, W, q_start, scores, k_end, carry, state, final_state)
        if o is not None:
            o, s = o
            return o.reshape(B, N, n * L, dv)[:, :, :S].transpose(1, 2), s
        # the kernel could not be built here: the loop below, on the same (stacked) terms, unbound per chunk
        U0, W, q_start, scores, k_end = (t.unbind(2) for t in (U0, W, q_start, scores, k_end))
        carry = carry[..., None, None].unbind(2)
    else:
        U0, W, q_start, scores, k_end, carry, n, L = _chunk_terms(q, k, v, g, beta, chunk, segments)
    s = q_start[0].new_zeros(B, N, dk, dv) if state is None else state.to(q_start[0].dtype)
    outs = []
    for c in range(n):
        u = U0[c] - W[c] @ s  # [B, N, L, dv]
        outs.append(q_start[c] @ s + scores[c] @ u)
        if c + 1 < n or final_state:
            s = s * carry[c] + k_end[c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, N, n * L, dv)[:, :, :S]
    return o.transpose(1, 2), (s if final_state else None)


class RecomputedRule(torch.autograd.Function):
    """``gated_delta_rule`` (no final state) that keeps only its inputs for backward and runs the chunks again
    there: the chunk tensors (decays, the triangular systems' solutions, the per-chunk states) are ~5x the inputs'
    bytes, and the rule is a small share of the layer's FLOPs (module docstring of GatedDeltaNet)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunk, segments):
        ctx.chunk = chunk
        ctx.save_for_backward(q, k, v, g, beta, segments)
        with torch.no_grad():
            return gated_delta_rule(q, k, v, g, beta, chunk=chunk, final_state=False, segments=segments)[0]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta, segments = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v, g, beta), ctx.needs_input_grad)]
        with torch.enable_grad():
            o = gated_delta_rule(*inputs, chunk=ctx.chunk, final_state=False, segments=segments)[0]
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(o, wanted, grad) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


def gated_delta_rule_affine(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int = 64,
                            segments: Tensor | None = None,
                            before_first: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rule over a segment whose starting state S_in is not known yet (context parallelism: it is the previous
    ranks' segments' result). Everything is affine in S_in, so this returns (o0 [B, S, N, dv], o_in [B, S, N, dk],
    M [B, N, dk, dk], b [B, N, dk, dv]) with o = o0 + o_in S_in and the end state M S_in + b; ``gated_delta_rule``'s
    recurrence over the chunks, run on the zero state (o0, b) and on the identity map (o_in, M). With ``segments``,
    ``before_first`` [B] is the document S_in belongs to (that of the position before the segment)."""
    B, S, N, dk = q.shape
    dv = v.shape[-1]
    U0, W, q_start, scores, k_end, carry, n, L = _chunk_terms(q, k, v, g, beta, chunk, segments, before_first)
    s = q_start[0].new_zeros(B, N, dk, dv)
    M = torch.eye(dk, dtype=s.dtype, device=s.device).expand(B, N, dk, dk)
    outs, outs_in = [], []
    for c in range(n):
        u, u_in = U0[c] - W[c] @ s, -W[c] @ M  # [B, N, L, dv], [B, N, L, dk]
        outs.append(q_start[c] @ s + scores[c] @ u)
        outs_in.append(q_start[c] @ M + scores[c] @ u_in)
        s = s * carry[c] + k_end[c].transpose(-1, -2) @ u
        M = M * carry[c] + k_end[c].transpose(-1, -2) @ u_in
    o, o_in = (torch.stack(t, dim=2).reshape(B, N, n * L, -1)[:, :, :S].transpose(1, 2) for t in (outs, outs_in))
    return o, o_in, M, s


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int, segments: Tensor | None,
                 before_first: Tensor | None = None, stacked: bool = False):
    """The per-chunk tensors of the chunked rule (``gated_delta_rule``'s docstring), each unbound into its n chunks:
    U0, W, q_start, scores, k_end, carry; then n and the chunk length L. ``before_first`` [B]: the document of the
    position before the first (context parallelism: the starting state's; None: the first position's own).
    ``stacked``: the tensors whole instead, [B, N, n, L, *] and carry [B, N, n] (the Triton scan's inputs)."""
    B, S, N, dk = q.shape
    dv, acc = v.shape[-1], _accumulator(q)
    L = max(1, min(chunk, S))
    pad = (-S) % L
    # [B, N, S, d] in float32; padded positions have k = q = v = 0, beta = 0 and g = 0: they change nothing
    q, k, v = (_pad(t.to(acc).transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (_pad(t.to(acc).transpose(1, 2), (0, pad)) for t in (g, beta))
    n = (S + pad) // L
    q, k, v = (t.reshape(B, N, n, L, -1) for t in (q, k, v))  # [B, N, n, L, d]
    g, beta = (t.reshape(B, N, n, L) for t in (g, beta))
    G = g.cumsum(-1)  # [B, N, n, L]
    gap = G[..., :, None] - G[..., None, :]  # [.., L, L]: G_i - G_j, <= 0 where j <= i
    ones = torch.ones(L, L, dtype=torch.bool, device=q.device)
    visible = ones.tril()  # [L, L], or per chunk [B, 1, n, L, L] with documents
    start = end = None  # with documents: which positions the starting state reaches / which the final keeps
    if segments is not None:
        seg = segments.to(torch.int64)
        seg = torch.cat((seg, seg[:, -1:].expand(-1, pad)), dim=1).view(B, 1, n, L)  # padding joins the last
        first = seg[:, :, :1, 0] if before_first is None else before_first.to(torch.int64).view(B, 1, 1)
        before = torch.cat((first, seg[:, :, :-1, -1]), dim=2)  # [B, 1, n]: running at each chunk start
        visible = visible & (seg[..., :, None] == seg[..., None, :])
        start = (seg == before[..., None]).to(acc)  # [B, 1, n, L]
        end = (seg == seg[..., -1:]).to(acc)
    decay = gap.masked_fill(~visible, float("-inf")).exp()  # e^(G_i - G_j) for visible j <= i, else 0
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # the strictly lower part is used (unitriangular solve)
    system = A.masked_fill(~ones.tril(-1), 0.0)
    from_start = G.exp() if start is None else G.exp() * start  # [B, N, n, L]
    # one triangular solve for both right-hand sides: the corrections without the starting state (U0) and what the
    # starting state takes from them (W)
    rhs = torch.cat((v * beta[..., None], kb * from_start[..., None]), dim=-1)
    U0, W = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay  # [.., L, L]
    q_start = q * from_start[..., None]  # reads the chunk's starting state
    to_end = (G[..., -1:] - G).exp() if end is None else (G[..., -1:] - G).exp() * end
    k_end = k * to_end[..., None]  # writes into the chunk's final state
    carry = G[..., -1].exp() if start is None else G[..., -1].exp() * start[..., -1]
    if stacked:
        return U0, W, q_start, scores, k_end, carry, n, L
    carry = carry[..., None, None]  # [B, N, n, 1, 1]
    # per chunk views by unbind: its backward stacks the chunks' gradients once, where indexing [:, :, c] would
    # scatter each into a zero tensor of the whole (n^2 memory traffic: most of the layer's time on a CPU)
    return (*(t.unbind(2) for t in (U0, W, q_start, scores, k_end, carry)), n, L)


def _pad(x: Tensor, pad: tuple[int, ...]) -> Tensor:
    """F.pad, skipped when nothing is padded (so eager and the planner's fake run keep the same tensors)."""
    return F.pad(x, pad) if any(pad) else x


def _accumulator(x: Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' references)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gated_delta_steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      state: Tensor | None = None, segments: Tensor | None = None,
                      trace: list | None = None) -> tuple[Tensor, Tensor]:
    """The same rule position by position (the recurrence in the module docstring): decoding, and the tests'
    reference. Arguments and results as ``gated_delta_rule``; with ``segments`` the state is zeroed where a new
    document begins; ``trace``: a list the state after each position is appended to."""
    B, S, N, dk = q.shape
    acc = _accumulator(q)
    s = q.new_zeros(B, N, dk, v.shape[-1], dtype=acc) if state is None else state.to(acc)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    outs = []
    for t in range(S):
        if segments is not None and t > 0:  # a document's first position starts from an empty state
            s = s * (segments[:, t] == segments[:, t - 1]).to(acc)[:, None, None, None]
        s = s * g[:, t, :, None, None].exp()
        err = v[:, t] - torch.einsum("bnkv,bnk->bnv", s, k[:, t])  # [B, N, dv]
        s = s + k[:, t, :, :, None] * (beta[:, t, :, None] * err)[:, :, None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", s, q[:, t]))
        if trace is not None:
            trace.append(s)
    return torch.stack(outs, dim=1), s
