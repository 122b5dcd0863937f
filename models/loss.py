"""Next-token cross-entropy straight from the final hidden states, in token chunks: no [N, V] logits kept.

    loss = mean_t [ logsumexp(h_t W^T) - (h_t W^T)[y_t] ]       h [N, H], W [V, H] (the LM head), y [N]

The plain way (``F.cross_entropy(F.linear(h, W).float(), y)``) materialises the logits in the compute
dtype, an fp32 copy, the fp32 log-softmax autograd saves, and in backward an fp32 and a compute-dtype
gradient of the same [N, V] size: for 32768 tokens and a 32000 vocabulary that is 4-5 copies of 2-4 GB.
Here each chunk of ``chunk`` tokens makes its logits, reduces them to the chunk's losses and, when a
gradient is wanted, turns them at once into the chunk's dh and its share of dW (the softmax minus the
one-hot, divided by N), then drops them. Autograd keeps dh [N, H] and dW [V, H] (fp32) and its backward
only scales them by the incoming gradient: the loss must be the value that gets differentiated (as the
trainer's loss is; a second use of the same loss scales the same saved gradients, which is still right,
but double backward is not supported). The head's FLOPs are unchanged (forward GEMM, dh GEMM, dW GEMM per
chunk), with no recomputation.

The matmuls run in the autocast dtype when autocast is on (as F.linear would), the softmax and the sums in
float32, the weight gradient accumulated in float32 and returned in the weight's dtype.

Between the chunk's forward GEMM and its two gradient GEMMs sit the elementwise steps: logsumexp, the target's
logit, softmax minus the one-hot, the per-token scale and the cast back. In torch that is ~7 passes over the
[chunk, V] logits in fp32 (an fp32 copy, logsumexp's kernels, sub, exp, the one-hot index, mul, the downcast):
on an H200 ~18 ms of a 192 ms mixtral-1b step (32768 tokens, V 32000). On CUDA one Triton kernel
(moe.kernels.cross_entropy) does them instead, straight on the compute-dtype logits: it reads each row twice
(an online max and sum of exponentials in fp32, then the gradient) and writes the gradient once, in place, in
the compute dtype, which the two GEMMs then read; no fp32 copy of the chunk exists. Same arithmetic in float32
up to the summation order of the logsumexp. ``fused`` chooses per call (None: TRITON_LM_LOSS below; True: the
kernel, also on CPU under TRITON_INTERPRET=1, or a ValueError saying why it cannot run; False: torch). The torch
passes stay the reference and the path everywhere else (CPU, no triton, torch.compile tracing, float64).

Targets outside [0, V) that are not IGNORE_INDEX are not checked (that would be a host sync): the torch path's
gather raises on CPU and stops the process with a device-side assert on CUDA; the kernel never forms an address
from them and makes their loss NaN instead (so the mean loss is NaN).
"""
from __future__ import annotations


import torch
from torch import Tensor

from moekit.moe.kernel_choice import mode_from_env, mode_problem, why_not_cached
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK = 8192  # tokens per chunk: 8192 x 32000 logits, 0.5 GB in bf16 (fused), 1 GB more in fp32 (torch)
IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index; HF's label masking)

# Where the fused Triton kernel (moe.kernels.cross_entropy) replaces the torch passes over each chunk's logits:
# "auto" on CUDA tensors it takes (float32/bfloat16/float16; not while torch.compile traces); "always" on CPU
# tensors too, in the Triton interpreter (TRITON_INTERPRET=1: tests), raising instead of falling back; "never":
# the torch passes everywhere (the benchmark's reference). chunked_lm_loss(fused=True / False) overrides it.
# It starts as the environment variable MOEKIT_LM_LOSS says (a benchmark's A / B in separate processes).
LM_LOSS_ENV = "MOEKIT_LM_LOSS"
TRITON_LM_LOSS = mode_from_env(LM_LOSS_ENV, "auto")
_FUSED_OK: dict = {}  # (device, compute dtype) -> why_not_cross_entropy's answer, CUDA only
_BUILD_FAILURE: list[str] = []  # why the kernel could not be built here, once it failed (then: torch)


def _compute_dtype(t: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def lm_loss_problem() -> str:
    """"" or what is wrong with TRITON_LM_LOSS (set from MOEKIT_LM_LOSS): the trainer checks it at start-up."""
    return mode_problem("models.loss.TRITON_LM_LOSS", TRITON_LM_LOSS, LM_LOSS_ENV)


def _fused_path(device: torch.device, dtype: torch.dtype, fused: bool | None) -> bool:
    """Whether the chunks' elementwise steps run as the Triton kernel (``fused`` / TRITON_LM_LOSS above)."""
    if fused is None:
        mode = TRITON_LM_LOSS
        if lm_loss_problem():
            raise ValueError(lm_loss_problem())
    else:
        mode = "always" if fused else "never"
    if mode == "never" or (mode == "auto" and (device.type != "cuda" or torch.compiler.is_compiling()
                                               or _BUILD_FAILURE)):
        return False
    reason = why_not_cached(_FUSED_OK, (device, dtype), device, "cross_entropy", "why_not_cross_entropy", device, dtype)
    if reason and mode == "always":
        how = "fused=True" if fused else "models.loss.TRITON_LM_LOSS='always'"
        raise ValueError(f"chunked_lm_loss {how}: the fused cross-entropy kernel cannot run: {reason} "
                         f"(pass fused=None or False)")
    return not reason


def _fused_chunk(logits: Tensor, targets: Tensor, scale: Tensor, need_grad: bool, out: Tensor, strict: bool) -> bool:
    """The kernel on one chunk (loss rows into ``out``, the gradient over ``logits``); False, with one warning,
    when this machine's Triton cannot build it (then the torch passes run, now and from then on; ``strict``:
    the error is raised instead)."""
    from moekit.moe.kernels._common import BUILD_ERRORS, record_build_failure
    from moekit.moe.kernels.cross_entropy import cross_entropy_rows

    try:
        cross_entropy_rows(logits, targets, scale, need_grad=need_grad, out=out, ignore_index=IGNORE_INDEX)
        return True
    except BUILD_ERRORS as exc:
        if strict:
            raise
        record_build_failure(exc, _BUILD_FAILURE, "models.loss", "fused cross-entropy kernel", "the torch passes run",
                             "models.loss.TRITON_LM_LOSS")
        return False


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, dtype: torch.dtype,
                fused: bool, strict: bool, normalizer: float | None) -> Tensor:
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        kept = targets != IGNORE_INDEX  # [n] the positions that count
        if normalizer is None:  # the mean over the kept tokens; a tensor: no host sync (all ignored: loss 0)
            count = kept.sum().clamp_min(1).float()
        else:  # their sum over a given count (a step's token-weighted mean: chunked_lm_loss)
            count = torch.tensor(float(normalizer), dtype=torch.float32, device=hidden.device)
        rows = scale = None
        if fused:
            rows = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # each token's loss (0: ignored)
            scale = kept / count  # [n] d mean / d token loss: 1 / count where kept, else 0
        for s in range(0, n, chunk):
            h = hidden[s:s + chunk].to(dtype)
            logits = h @ w.t()  # [c, V] in the compute dtype
            if fused and _fused_chunk(logits, targets[s:s + chunk], scale[s:s + chunk], need_h or need_w,
                                      rows[s:s + chunk], strict):
                g = logits  # the kernel wrote the gradient (already scaled, in dtype) over the logits
            else:
                fused = False  # a kernel that failed to build: the torch passes for this chunk and the rest
                keep = kept[s:s + chunk]
                y = targets[s:s + chunk].masked_fill(~keep, 0)[:, None]  # [c, 1] an ignored position reads id 0
                logits = logits.float()  # [c, V]
                lse = torch.logsumexp(logits, dim=-1)
                total += ((lse - logits.gather(1, y).squeeze(1)) * keep).sum()
                if need_h or need_w:
                    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                    g[torch.arange(g.shape[0], device=g.device), y.squeeze(1)] -= 1.0  # minus the one-hot
                    del logits  # g holds that buffer; once cast, the fp32 one is freed before the two GEMMs
                    # d loss / d logits for the mean over the kept tokens; ignored rows get 0 (one pass, as /n was)
                    g = g.mul_((keep / count)[:, None]).to(dtype)
            if need_h:
                dh[s:s + chunk] = (g @ w).to(hidden.dtype)
            if need_w:
                _accumulate_mm(dw, g.t(), h)
        if rows is not None:
            total += rows.sum()
        ctx.save_for_backward(dh if need_h else None, dw.to(weight.dtype) if need_w else None)
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad.to(dh.dtype),
                None if dw is None else dw * grad.to(dw.dtype), None, None, None, None, None, None)


_FP32_OUT: dict = {}  # device type -> whether torch.mm(..., out_dtype=float32) runs there


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (float32) += a @ b. Low-precision products go straight into float32 where torch's mm takes
    out_dtype (CUDA); elsewhere the chunk's product is rounded to a's dtype once, then added in float32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    kind = a.device.type
    if _FP32_OUT.get(kind, True):
        try:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
            _FP32_OUT[kind] = True
            return
        except Exception:  # an older torch or another backend: round once per chunk instead (a real error
            _FP32_OUT[kind] = False  # in a or b raises again just below)
    acc.add_(a @ b)


def chunked_lm_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = DEFAULT_CHUNK,
                    fused: bool | None = None, normalizer: float | None = None) -> Tensor:
    """Mean cross-entropy of ``hidden`` [..., H] through the LM head ``weight`` [V, H] against ``targets``
    [...] (token ids in [0, V), or IGNORE_INDEX for a position that does not count: the mean is over the
    others, as F.cross_entropy's; all ignored gives 0), without keeping the logits (module docstring).
    ``normalizer`` > 0: the sum over the counted tokens divided by it instead (a training step with loss masks
    divides every micro-batch by one count, so that the step's loss is the mean over all its counted tokens).

    ``fused``: None follows TRITON_LM_LOSS ("auto": the Triton kernel on CUDA, torch elsewhere); True runs the
    kernel (CUDA, or CPU under TRITON_INTERPRET=1) or raises a ValueError saying why it cannot; False: torch."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: targets must have "
                         f"hidden's shape without its last dimension")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, H={hidden.shape[-1]}]")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused={fused!r} must be None (auto), True or False")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer={normalizer!r} must be a positive token count (or None: the mean)")
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = _compute_dtype(h)
    use = _fused_path(h.device, dtype, fused)
    strict = bool(fused) or (fused is None and TRITON_LM_LOSS == "always")
    return _ChunkedLMLoss.apply(h, weight, targets.reshape(-1), int(chunk), dtype, use, strict, normalizer)
