"""LoRA dropout (PEFT's ``lora_dropout``): while training, each adapter reads its input with every element zeroed
at rate p and the rest scaled by 1 / (1 - p); the base projection reads the input untouched:

    y = x W^T + s ((x * keep / (1 - p)) A^T) B^T,     keep ~ Bernoulli(1 - p) per element of x

Each adapter draws its own mask (as PEFT's one ``nn.Dropout`` per adapted module). Evaluation, generation and
``model.eval()`` use none.

Where the masks come from. Each dropped product draws one 62-bit number from the CPU's default generator (one
draw, whatever the shape) and seeds a generator on the input's device from it and the input's *stream*: the
lowest rank among those holding the same values of the input. So

- ranks that hold the same input draw the same mask: tensor parallelism's replicated inputs (a DTensor:
  its mesh's ranks; the mask is drawn whole and each rank keeps its own slice of a sharded input, so a
  row-wise projection's shards read disjoint parts of one mask), Gated DeltaNet's replicated projection input;
- ranks holding different tokens (data / context parallelism, TP's token split of the MoE layer, the routed
  experts' rows under EP) draw different ones;
- the default generator advances the same on every rank whatever the token counts (expert rows differ by rank),
  so tensor-parallel ranks, seeded alike (train.trainer), stay in step; a TP run draws the masks a one-process
  run draws for the same inputs;
- activation checkpointing restores the generator before it recomputes (torch.utils.checkpoint's
  preserve_rng_state): the recomputed masks are the forward's, and so the gradients are those of the mask
  the forward used; a checkpoint's saved CPU generator state resumes the stream.

This module is single-device code (it imports nothing of torch.distributed): the caller names the stream. A
plain tensor's is ``process_stream()``, this process's rank, which models.lora plugs in (``set_stream_source``;
0 until then); models.lora draws a DTensor's mask and slices it, and Gated DeltaNet names its TP group's.

Memory: ``masked_product`` saves the input (which the base projection saves anyway: one storage) and a one-byte
mask per element, and forms ``x * keep / (1 - p)`` again in backward (one more r-wide product), instead of
keeping a dropped copy of the input per adapter as an ``nn.Dropout`` before the product does.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_M64 = (1 << 64) - 1
_stream_source: Callable[[], int] = lambda: 0  # noqa: E731  (models.lora: this process's rank)


def set_stream_source(source: Callable[[], int]) -> None:
    """Where ``process_stream`` reads this process's stream (models.lora plugs in the rank)."""
    global _stream_source
    _stream_source = source


def process_stream() -> int:
    """The stream of tensors this process alone holds (its rank; 0 in one process)."""
    return _stream_source()


def check_dropout(p, what: str = "lora_dropout") -> float:
    """``p`` as a float in [0, 1), else ValueError naming it and the fix."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{what}={p!r} is invalid; it must be a number in [0, 1) (the share of each adapter's "
                         f"input zeroed while training; PEFT's lora_dropout, commonly 0.05 or 0.1; 0 = none)")
    return float(p)


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser over each part in turn)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _M64
        h ^= h >> 29
    return h >> 1


def keep_mask(shape, p: float, device, stream: int) -> Tensor:
    """A bool mask of ``shape`` on ``device``, True with probability 1 - p (module docstring: its seed). Inside a
    compiled block it runs eagerly (a generator seeded per call; dynamo breaks the graph around it); the decorator
    is applied there only, so building a model imports no dynamo."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_keep_mask)(shape, p, device, stream)
    return _keep_mask(shape, p, device, stream)


def _keep_mask(shape, p: float, device, stream: int) -> Tensor:
    draw = int(torch.randint(0, 1 << 62, (1,)).item())  # the CPU default generator: one draw per mask
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix(draw, stream))
    if sys.byteorder != "little":
        return torch.rand(tuple(shape), generator=gen, device=device) >= p
    # Three 16-bit uniforms from each 63-bit draw (random_ fills int64 with [0, 2^63): its low 48 bits are uniform;
    # the top 16-bit lane, missing its sign bit, is dropped): a third of torch.rand's draws, which on the CPU
    # (mt19937, ~4.7 ns each) were the cost of dropout. p is rounded to 1/65536.
    n = math.prod(shape)
    bits = torch.empty((n + 2) // 3, dtype=torch.int64, device=device).random_(generator=gen)
    lanes = bits.view(torch.int16).view(-1, 4)[:, :3].reshape(-1)[:n]
    return (lanes >= round(p * 65536) - 32768).view(tuple(shape))


def dropped(x: Tensor, keep: Tensor, p: float) -> Tensor:
    """x * keep / (1 - p): the adapter's input (one formula for every path, so they round alike)."""
    return x * keep * (1.0 / (1.0 - p))


class _DroppedProduct(torch.autograd.Function):
    """``product(dropped(x, keep, p), a)`` saving x, a and the bool mask (not the dropped copy); backward forms
    the dropped input again and differentiates the product (module docstring)."""

    @staticmethod
    def forward(ctx, x, a, keep, p, product):
        ctx.p, ctx.product = p, product
        device = x.device.type
        # backward forms the product again under the forward's autocast (it casts a again: a transient, not a
        # copy kept from forward to backward)
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, a, keep)
        return product(dropped(x, keep, p), a)

    @staticmethod
    def backward(ctx, grad):
        x, a, keep = ctx.saved_tensors
        need_x, need_a = ctx.needs_input_grad[:2]
        create = torch.is_grad_enabled()  # create_graph: differentiate the composite on the saved inputs themselves
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            xs = x if create else x.detach().requires_grad_(need_x)
            as_ = a if create else a.detach().requires_grad_(need_a)
            u = ctx.product(dropped(xs, keep, ctx.p), as_)
        wanted = [t for t, need in ((xs, need_x), (as_, need_a)) if need]
        got = iter(torch.autograd.grad(u, wanted, grad, create_graph=create, allow_unused=True) if wanted else ())
        return (next(got) if need_x else None), (next(got) if need_a else None), None, None, None


def masked_product(x: Tensor, a: Tensor, keep: Tensor, p: float, product=F.linear) -> Tensor:
    """``product(dropped(x, keep, p), a)``, saving the bool ``keep`` rather than the dropped input for backward."""
    if not (torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)):
        return product(dropped(x, keep, p), a)
    return _DroppedProduct.apply(x, a, keep, p, product)
