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
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK = 8192  # tokens per chunk: 8192 x 32000 fp32 logits = 1 GB at a time
IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index; HF's label masking)


def _compute_dtype(t: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, dtype: torch.dtype) -> Tensor:
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        kept = targets != IGNORE_INDEX  # [n] the positions that count
        count = kept.sum().clamp_min(1).float()  # a tensor: no host sync (all ignored: loss 0, no gradient)
        for s in range(0, n, chunk):
            h = hidden[s:s + chunk].to(dtype)
            keep = kept[s:s + chunk]
            y = targets[s:s + chunk].masked_fill(~keep, 0)[:, None]  # [c, 1] an ignored position reads id 0
            logits = (h @ w.t()).float()  # [c, V]
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
        ctx.save_for_backward(dh if need_h else None, dw.to(weight.dtype) if need_w else None)
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad.to(dh.dtype),
                None if dw is None else dw * grad.to(dw.dtype), None, None, None)


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


def chunked_lm_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """Mean cross-entropy of ``hidden`` [..., H] through the LM head ``weight`` [V, H] against ``targets``
    [...] (token ids in [0, V), or IGNORE_INDEX for a position that does not count: the mean is over the
    others, as F.cross_entropy's; all ignored gives 0), without keeping the logits (module docstring)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: targets must have "
                         f"hidden's shape without its last dimension")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, H={hidden.shape[-1]}]")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    h = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLMLoss.apply(h, weight, targets.reshape(-1), int(chunk), _compute_dtype(h))
