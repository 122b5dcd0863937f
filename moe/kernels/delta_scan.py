"""The inter-chunk scan of the chunked gated delta rule (models.delta_rule.gated_delta_rule), one kernel each way.

Per (batch, head) the chunked rule carries a state S [dk, dv] across its n chunks; chunk c (of L positions)
brings its per-chunk terms (models.delta_rule._chunk_terms): U0 [L, dv], W [L, dk], q_start [L, dk],
scores [L, L], k_end [L, dk] and the scalar carry, and

    u_c   = U0_c - W_c S_c                                  [L, dv]  the chunk's corrections
    o_c   = q_start_c S_c + scores_c u_c                     [L, dv]  its outputs
    S_c+1 = carry_c S_c + k_end_c^T u_c                      [dk, dv] the next chunk's starting state

Backward, in reverse, with dS the gradient of S_c+1 (zero after the last chunk unless the final state has one):

    du = scores^T dO_c + k_end dS;   dU0_c = du;   dW_c = -du S_c^T;   dq_start_c = dO_c S_c^T
    dscores_c = dO_c u_c^T;   dk_end_c = u_c dS^T;   dcarry_c = sum(S_c * dS)
    dS <- q_start^T dO_c - W^T du + carry_c dS                       (the gradient of S_c; after chunk 0: dS_0)

Design:
  * grid (B * N, cdiv(dv, BLOCK_V)): a program owns one head's state columns [dk, BLOCK_V] in fp32 registers and
    walks the n chunks in order (forward) or in reverse (backward); the columns of S are independent in every
    product above except the ones that contract over dv (dW, dq_start, dscores, dk_end, dcarry): each column tile
    writes its own partial sum of those into a [T, ...] buffer (T tiles) that the wrapper adds (deterministic).
  * the forward stores each chunk's starting state S_c [B, N, n, dk, dv] (only when a gradient will be taken):
    the backward reads them instead of rerunning the scan. Same bytes as the states the torch loop keeps.
  * tl.dot needs every dim >= 16 (and tiles are powers of two): L, dk and the column tile are padded up to
    powers of two >= 16 by masked loads (zero rows / columns change no product), so any L, dk, dv run.
  * fp32 throughout, ``input_precision=PRECISION`` (TF32 would lose ~3 digits against the torch loop's fp32).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._common import BUILD_ERRORS, Kernel, cdiv, check_triton_tensors, interpret_mode, pow2, record_build_failure

# Column tiles: fp32 FMA dots keep their operands in registers, so the tiles stay small (sm90 offline compile, dk =
# 128, L = 64: docs/kernels.md "Delta-rule scan"). The interpreter takes 16 so dv = 32 gets two tiles (the
# backward's partial sums). Not yet tuned on a GPU.
_FWD_BLOCK_V, _BWD_BLOCK_V, _INTERPRET_BLOCK_V = 16, 16, 16
_INTERPRET = interpret_mode()
PRECISION = "ieee"


@triton.jit
def _tile_offsets(tile, L, DK, DV, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Offsets and masks of a program's tiles, column tile ``tile`` of dv: the state [dk, BLOCK_V], the chunk terms
    [L, dk] (W, q_start, k_end), [L, BLOCK_V] (U0, o) and [L, L] (scores), within one head's chunk."""
    rl = tl.arange(0, BLOCK_L)
    rk = tl.arange(0, BLOCK_K)
    rv = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    lm, km, vm = rl < L, rk < DK, rv < DV
    s_off = rk[:, None] * DV + rv[None, :]
    s_mask = km[:, None] & vm[None, :]
    lk = rl[:, None] * DK + rk[None, :]
    lv = rl[:, None] * DV + rv[None, :]
    ll = rl[:, None] * L + rl[None, :]
    return (s_off, s_mask, lk, lm[:, None] & km[None, :], lv, lm[:, None] & vm[None, :], ll,
            lm[:, None] & lm[None, :])


@triton.jit
def _delta_scan_fwd_kernel(
    U0, W, QS, P, KE, CARRY, S0, O, STATES, SFIN,
    n, L, DK, DV,
    HAS_S0: tl.constexpr, SAVE_STATES: tl.constexpr, FINAL: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    bn = tl.program_id(0).to(tl.int64)
    s_off, s_mask, lk, lk_mask, lv, lv_mask, ll, ll_mask = _tile_offsets(tl.program_id(1), L, DK, DV, BLOCK_L,
                                                                         BLOCK_K, BLOCK_V)
    if HAS_S0:
        s = tl.load(S0 + bn * DK * DV + s_off, mask=s_mask, other=0.0)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for c in range(n):
        chunk = bn * n + c
        if SAVE_STATES:
            tl.store(STATES + chunk * DK * DV + s_off, s, mask=s_mask)
        w = tl.load(W + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        u = tl.load(U0 + chunk * L * DV + lv, mask=lv_mask, other=0.0) - tl.dot(w, s, input_precision=PRECISION)
        qs = tl.load(QS + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        p = tl.load(P + chunk * L * L + ll, mask=ll_mask, other=0.0)
        o = tl.dot(qs, s, input_precision=PRECISION) + tl.dot(p, u, input_precision=PRECISION)
        tl.store(O + chunk * L * DV + lv, o, mask=lv_mask)
        ke = tl.load(KE + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        a = tl.load(CARRY + chunk)
        s = s * a + tl.dot(tl.trans(ke), u, input_precision=PRECISION)
    if FINAL:
        tl.store(SFIN + bn * DK * DV + s_off, s, mask=s_mask)


@triton.jit
def _delta_scan_bwd_kernel(
    U0, W, QS, P, KE, CARRY, STATES, DO, DSFIN,
    DU0, DW, DQS, DP, DKE, DCARRY, DS0,
    n, L, DK, DV, NBN,
    HAS_DSFIN: tl.constexpr, NEED_DS0: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    bn = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    part = tile.to(tl.int64) * NBN * n  # this column tile's slice of the partial-sum buffers, in chunks
    s_off, s_mask, lk, lk_mask, lv, lv_mask, ll, ll_mask = _tile_offsets(tile, L, DK, DV, BLOCK_L, BLOCK_K, BLOCK_V)
    if HAS_DSFIN:
        ds = tl.load(DSFIN + bn * DK * DV + s_off, mask=s_mask, other=0.0)
    else:
        ds = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for i in range(n):
        chunk = bn * n + (n - 1 - i)
        s = tl.load(STATES + chunk * DK * DV + s_off, mask=s_mask, other=0.0)
        do = tl.load(DO + chunk * L * DV + lv, mask=lv_mask, other=0.0)
        w = tl.load(W + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        u = tl.load(U0 + chunk * L * DV + lv, mask=lv_mask, other=0.0) - tl.dot(w, s, input_precision=PRECISION)
        p = tl.load(P + chunk * L * L + ll, mask=ll_mask, other=0.0)
        ke = tl.load(KE + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        du = tl.dot(tl.trans(p), do, input_precision=PRECISION) + tl.dot(ke, ds, input_precision=PRECISION)
        tl.store(DU0 + chunk * L * DV + lv, du, mask=lv_mask)
        # the partial sums over this tile's dv columns
        s_t = tl.trans(s)
        tl.store(DW + (part + chunk) * L * DK + lk, -tl.dot(du, s_t, input_precision=PRECISION), mask=lk_mask)
        tl.store(DQS + (part + chunk) * L * DK + lk, tl.dot(do, s_t, input_precision=PRECISION), mask=lk_mask)
        tl.store(DP + (part + chunk) * L * L + ll, tl.dot(do, tl.trans(u), input_precision=PRECISION), mask=ll_mask)
        tl.store(DKE + (part + chunk) * L * DK + lk, tl.dot(u, tl.trans(ds), input_precision=PRECISION),
                 mask=lk_mask)
        tl.store(DCARRY + part + chunk, tl.sum(tl.sum(s * ds, axis=1), axis=0))
        qs = tl.load(QS + chunk * L * DK + lk, mask=lk_mask, other=0.0)
        a = tl.load(CARRY + chunk)
        ds = (tl.dot(tl.trans(qs), do, input_precision=PRECISION) - tl.dot(tl.trans(w), du, input_precision=PRECISION)
              + a * ds)
    if NEED_DS0:
        tl.store(DS0 + bn * DK * DV + s_off, ds, mask=s_mask)


# One config each, block sizes chosen in Python (_blocks): nothing to autotune; the wrapper still checks the Triton
# mode and counts launches.
DELTA_SCAN_FWD = Kernel(_delta_scan_fwd_kernel, configs=[triton.Config({}, num_warps=8, num_stages=1)],
                        interpret_config=triton.Config({}, num_warps=1), key=[])
DELTA_SCAN_BWD = Kernel(_delta_scan_bwd_kernel, configs=[triton.Config({}, num_warps=16, num_stages=1)],
                        interpret_config=triton.Config({}, num_warps=1), key=[])


def _blocks(L: int, dk: int, dv: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_L, BLOCK_K, BLOCK_V): powers of two >= 16 (tl.dot's minimum), the column tile at most the cap."""
    cap = _INTERPRET_BLOCK_V if _INTERPRET else (_BWD_BLOCK_V if backward else _FWD_BLOCK_V)
    return max(16, pow2(L)), max(16, pow2(dk)), min(max(16, pow2(dv)), cap)


def _on_device(t: torch.Tensor):
    """Launch on t's GPU even when another one is current (Triton launches on the current device)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def why_not_delta_scan(device: torch.device) -> str:
    """"" when :func:`delta_scan` can run on float32 tensors of this device, else the reason."""
    from ._common import why_not_triton_tensors

    return why_not_triton_tensors(torch.empty(0, device=device, dtype=torch.float32))


def _check(what: str, U0, W, q_start, scores, k_end, carry, state):
    if U0.dim() != 5:
        raise ValueError(f"{what}: U0 must be [B, N, n, L, dv], got shape {tuple(U0.shape)}")
    B, N, n, L, dv = U0.shape
    dk = W.shape[-1]
    want = {"W": (B, N, n, L, dk), "q_start": (B, N, n, L, dk), "scores": (B, N, n, L, L),
            "k_end": (B, N, n, L, dk), "carry": (B, N, n)}
    for name, t in zip(want, (W, q_start, scores, k_end, carry)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{what}: {name} must be {list(want[name])}, got {list(t.shape)}")
    if state is not None and tuple(state.shape) != (B, N, dk, dv):
        raise ValueError(f"{what}: state must be {[B, N, dk, dv]}, got {list(state.shape)}")
    tensors = [U0, W, q_start, scores, k_end, carry] + ([state] if state is not None else [])
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError(f"{what}: the chunk terms must be float32, got {sorted({str(t.dtype) for t in tensors})}")
    check_triton_tensors(what, *tensors)
    return B, N, n, L, dk, dv


def delta_scan_fwd(U0, W, q_start, scores, k_end, carry, state=None, *, final_state=True, save_states=False):
    """(o [B, N, n, L, dv], the state after the last chunk [B, N, dk, dv] or None, the state at each chunk's
    start [B, N, n, dk, dv] or None): the forward scan (module docstring) over float32 chunk terms (any layout:
    made contiguous here). ``state``: the first chunk's starting state (None: zeros)."""
    what = "delta_scan (Triton)"
    B, N, n, L, dk, dv = _check(what, U0, W, q_start, scores, k_end, carry, state)
    U0, W, q_start, scores, k_end, carry = (t.contiguous() for t in (U0, W, q_start, scores, k_end, carry))
    state = state.contiguous() if state is not None else None
    o = U0.new_empty(B, N, n, L, dv)
    sfin = U0.new_empty(B, N, dk, dv) if final_state else None
    states = U0.new_empty(B, N, n, dk, dv) if save_states else None
    if B * N * n == 0:
        if sfin is not None:
            sfin.copy_(state if state is not None else torch.zeros_like(sfin))
        return o, sfin, states
    bl, bk, bv = _blocks(L, dk, dv, backward=False)
    with _on_device(U0):
        DELTA_SCAN_FWD[(B * N, cdiv(dv, bv))](
            U0, W, q_start, scores, k_end, carry, state if state is not None else o, o,
            states if states is not None else o, sfin if sfin is not None else o,
            n, L, dk, dv,
            HAS_S0=state is not None, SAVE_STATES=save_states, FINAL=final_state,
            BLOCK_L=bl, BLOCK_K=bk, BLOCK_V=bv, PRECISION=PRECISION,
        )
    return o, sfin, states


def delta_scan_bwd(U0, W, q_start, scores, k_end, carry, states, grad_o, grad_final=None, *, need_state_grad=False):
    """The gradients (dU0, dW, dq_start, dscores, dk_end, dcarry, dstate or None) of the forward scan's o (and final
    state, ``grad_final``) given the states ``delta_scan_fwd(save_states=True)`` returned."""
    what = "delta_scan backward (Triton)"
    B, N, n, L, dk, dv = _check(what, U0, W, q_start, scores, k_end, carry, None)
    U0, W, q_start, scores, k_end, carry, states, grad_o = (
        t.contiguous() for t in (U0, W, q_start, scores, k_end, carry, states, grad_o))
    grad_final = grad_final.contiguous() if grad_final is not None else None
    bl, bk, bv = _blocks(L, dk, dv, backward=True)
    T = cdiv(dv, bv)
    dU0 = torch.empty_like(U0)
    dW, dqs, dke = (U0.new_empty(T, B, N, n, L, dk) for _ in range(3))
    dP = U0.new_empty(T, B, N, n, L, L)
    dcarry = U0.new_empty(T, B, N, n)
    ds0 = U0.new_empty(B, N, dk, dv) if need_state_grad else None
    if B * N * n > 0:
        with _on_device(U0):
            DELTA_SCAN_BWD[(B * N, T)](
                U0, W, q_start, scores, k_end, carry, states, grad_o, grad_final if grad_final is not None else U0,
                dU0, dW, dqs, dP, dke, dcarry, ds0 if ds0 is not None else U0,
                n, L, dk, dv, B * N,
                HAS_DSFIN=grad_final is not None, NEED_DS0=need_state_grad,
                BLOCK_L=bl, BLOCK_K=bk, BLOCK_V=bv, PRECISION=PRECISION,
            )
    elif ds0 is not None:
        ds0.copy_(grad_final if grad_final is not None else torch.zeros_like(ds0))
    sums = [t[0] if T == 1 else t.sum(0) for t in (dW, dqs, dP, dke, dcarry)]
    return (dU0, sums[0], sums[1], sums[2], sums[3], sums[4], ds0)


def delta_scan_ref(U0, W, q_start, scores, k_end, carry, state=None, final_state=True):
    """(o, the final state or None): the forward scan as a torch loop over the chunks (the tests' reference)."""
    B, N, n, L, dv = U0.shape
    s = U0.new_zeros(B, N, W.shape[-1], dv) if state is None else state
    outs = []
    for c in range(n):
        u = U0[:, :, c] - W[:, :, c] @ s
        outs.append(q_start[:, :, c] @ s + scores[:, :, c] @ u)
        s = s * carry[:, :, c, None, None] + k_end[:, :, c].transpose(-1, -2) @ u
    return torch.stack(outs, dim=2), (s if final_state else None)


class DeltaScan(torch.autograd.Function):
    """The scan as one forward and one backward kernel: (o [B, N, n, L, dv], final state or None).

    A backward kernel this machine's Triton cannot build (the forward one built) differentiates the torch loop
    over the saved chunk starts instead, after one warning, and is named in ``failures`` (the caller's list, so
    its later calls take the loop from the start); with ``strict`` the build error is raised."""

    @staticmethod
    def forward(ctx, U0, W, q_start, scores, k_end, carry, state, final_state, need_grad, strict, failures):
        o, sfin, states = delta_scan_fwd(U0, W, q_start, scores, k_end, carry, state, final_state=final_state,
                                         save_states=need_grad)
        if need_grad:
            ctx.save_for_backward(U0, W, q_start, scores, k_end, carry, states)
        ctx.has_state, ctx.strict, ctx.failures = state is not None, strict, failures
        if sfin is None:
            return o, None
        return o, sfin

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        U0, W, q_start, scores, k_end, carry, states = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros_like(U0)
        need_state = ctx.has_state and ctx.needs_input_grad[6]
        try:
            grads = delta_scan_bwd(U0, W, q_start, scores, k_end, carry, states, grad_o, grad_final,
                                   need_state_grad=need_state)
        except BUILD_ERRORS as exc:
            if ctx.strict:
                raise
            record_build_failure(exc, ctx.failures, "moe.kernels.delta_scan", "backward delta-rule scan kernel",
                                 "the torch loop is differentiated (and runs from the next call on)",
                                 "models.delta_rule.TRITON_SCAN")
            grads = _loop_backward(U0, W, q_start, scores, k_end, carry, states, grad_o, grad_final, need_state)
        return (*grads, None, None, None, None, None)


def _loop_backward(U0, W, q_start, scores, k_end, carry, states, grad_o, grad_final, need_state):
    """delta_scan_bwd's gradients by autograd through delta_scan_ref, from the first chunk's saved start state."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (U0, W, q_start, scores, k_end, carry)]
        s0 = states[:, :, 0].detach().requires_grad_(need_state) if states.shape[2] else None
        o, sfin = delta_scan_ref(*leaves, s0, final_state=grad_final is not None)
        outs, cotangents = [o], [grad_o]
        if grad_final is not None:
            outs.append(sfin)
            cotangents.append(grad_final)
        wrt = leaves + ([s0] if need_state and s0 is not None else [])
        grads = list(torch.autograd.grad(outs, wrt, cotangents, allow_unused=True))
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    if need_state and s0 is None:  # no chunks: the final state is the initial one
        grads.append(grad_final.clone() if grad_final is not None else None)
    return (*grads[:6], grads[6] if need_state else None)


_BACKWARD_FAILURES: list[str] = []  # delta_scan's default list for DeltaScan's failures


def delta_scan(U0, W, q_start, scores, k_end, carry, state=None, final_state=True, *, strict: bool = False,
               failures: list | None = None):
    """Differentiable :func:`delta_scan_fwd` (module docstring): (o [B, N, n, L, dv], final state [B, N, dk, dv] or
    None). Float32 chunk terms on CUDA, or CPU under TRITON_INTERPRET=1. ``strict``, ``failures``: what a backward
    kernel that fails to build does (DeltaScan)."""
    inputs = (U0, W, q_start, scores, k_end, carry) + ((state,) if state is not None else ())
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if not need_grad:
        o, sfin, _ = delta_scan_fwd(U0, W, q_start, scores, k_end, carry, state, final_state=final_state)
        return o, sfin
    return DeltaScan.apply(U0, W, q_start, scores, k_end, carry, state, final_state, True, strict,
                           _BACKWARD_FAILURES if failures is None else failures)
