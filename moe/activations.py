"""The one table of FFN activations: every backend (the experts' loop / torch / triton, the dense MLP,
the kernels' reference and fused epilogues) reads its activation here, so they cannot disagree.

An ``Activation`` maps the first projection's output to the second projection's input:

    gated (SwiGLU):  h [..., 2F] = [gate | up]  ->  unit(gate) * up_fn(up)  [..., F]   (up_fn = identity for swiglu)
    plain (GELU):    h [..., F]                 ->  unit(h)                 [..., F]

``swiglu_oai`` is gpt-oss's clamped SwiGLU (OpenAI's reference code, vLLM's "swigluoai"): with g = min(gate, limit)
and u = clamp(up, -limit, limit), ``(u + 1) * g * sigmoid(alpha * g)``; alpha = 1.702, limit = 7.0. Its
derivative is the composite's under autograd, clamp's included: zero outside the range, passed at the bounds
(torch's clamp backward keeps ``min <= x <= max``).

``kernel_code`` is the ``ACT`` constexpr of moe.kernels.expert_mlp's fused kernels, whose epilogues
hard-code each activation's forward and derivative (gelu is the exact erf form there and here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over h = [gate | up]; backward writes both halves of dh in place (no cat).

    Double backward (``torch.autograd.grad(..., create_graph=True)``, e.g. a gradient penalty): the
    backward then runs in grad mode and computes dh with differentiable ops, so autograd differentiates
    it like the composite ``silu(gate) * up``.
    """

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        if torch.is_grad_enabled():  # create_graph: out= and the fused silu_backward are not differentiable
            sig = torch.sigmoid(gate)
            d_gate = grad * up * sig * (1 + gate * (1 - sig))  # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
            return torch.cat([d_gate, grad * gate * sig], dim=-1)
        dh = torch.empty_like(h)
        d_gate, d_up = dh.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=d_up)
        # d gate = (grad * up) * silu'(gate), with torch's fused silu derivative
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return dh


def swiglu(h: Tensor) -> Tensor:
    """[..., 2F] laid out [gate | up] -> silu(gate) * up [..., F]."""
    return _SwiGLU.apply(h)


# gpt-oss (transformers' GptOssExperts, OpenAI's reference): the sigmoid's slope and the clamp of gate and up
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


def oai_unit(gate: Tensor) -> Tensor:
    """The gate half of swiglu_oai: g * sigmoid(alpha * g) with g = min(gate, limit)."""
    g = gate.clamp(max=OAI_LIMIT)
    return g * torch.sigmoid(OAI_ALPHA * g)


def oai_up(up: Tensor) -> Tensor:
    """The up half of swiglu_oai: clamp(up, -limit, limit) + 1."""
    return up.clamp(-OAI_LIMIT, OAI_LIMIT) + 1


class _SwiGLUOAI(torch.autograd.Function):
    """oai_unit(gate) * oai_up(up) over h = [gate | up], saving h alone (not the clamped copies) and writing
    the derivative by hand: d gate = grad * (u + 1) * (s + alpha * g * s * (1 - s)) where gate <= limit, else 0;
    d up = grad * g * s where -limit <= up <= limit, else 0 (s = sigmoid(alpha * g)): autograd's values for the
    composite expression. Its backward is differentiable ops, so a double backward works as for _SwiGLU."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return oai_unit(gate) * oai_up(up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        g, u = gate.clamp(max=OAI_LIMIT), up.clamp(-OAI_LIMIT, OAI_LIMIT)
        s = torch.sigmoid(OAI_ALPHA * g)
        d_gate = grad * (u + 1) * (s + OAI_ALPHA * g * s * (1 - s))
        d_up = grad * g * s
        d_gate = torch.where(gate <= OAI_LIMIT, d_gate, 0.0)
        d_up = torch.where((up >= -OAI_LIMIT) & (up <= OAI_LIMIT), d_up, 0.0)
        return torch.cat([d_gate, d_up], dim=-1)


def swiglu_oai(h: Tensor) -> Tensor:
    """[..., 2F] laid out [gate | up] -> gpt-oss's clamped SwiGLU [..., F] (module docstring)."""
    return _SwiGLUOAI.apply(h)


# The loop backend's per-expert epilogues (moe.experts): written into preallocated blocks with one scratch tensor,
# no autograd, so an expert's block stays in cache between its GEMMs and nothing is allocated per expert.


def swiglu_oai_into(gate: Tensor, up: Tensor, out: Tensor, tmp: Tensor) -> Tensor:
    """out = oai_unit(gate) * oai_up(up), every operand [n, F]; ``tmp`` is scratch of that shape. (u + 1) * glu
    is one addcmul, glu + glu * u: the same value to a rounding."""
    torch.clamp(gate, max=OAI_LIMIT, out=out)  # g
    torch.mul(out, OAI_ALPHA, out=tmp).sigmoid_()  # s
    out.mul_(tmp)  # glu = g * s
    torch.clamp(up, -OAI_LIMIT, OAI_LIMIT, out=tmp)  # u
    return torch.addcmul(out, out, tmp, out=out)


def swiglu_oai_backward_into(da: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor,
                             tmp: Tensor) -> None:
    """_SwiGLUOAI's derivative for one block: d_gate, d_up [n, F] from the gradient ``da`` and h's halves, with
    one scratch ``tmp`` [n, F]; ``da`` is read only. Past a clamp's bound the gradient is 0, at a bound it passes,
    as torch's clamp backward does (a NaN gate's d_gate stays NaN: its forward value is NaN anyway)."""
    torch.clamp(gate, max=OAI_LIMIT, out=d_up)  # g
    torch.mul(d_up, OAI_ALPHA, out=tmp).sigmoid_()  # s
    # d gate / (grad * (u + 1)) = s + alpha * g * s * (1 - s) = s * (1 + alpha * (g - g * s))
    torch.addcmul(d_up, d_up, tmp, value=-1, out=d_gate).mul_(OAI_ALPHA).add_(1).mul_(tmp)
    d_up.mul_(tmp)  # glu = g * s
    d_gate.masked_fill_(gate > OAI_LIMIT, 0)  # torch's test: gate <= limit passes
    torch.clamp(up, -OAI_LIMIT, OAI_LIMIT, out=tmp)  # u
    d_gate.mul_(da)
    torch.addcmul(d_gate, d_gate, tmp, out=d_gate)  # * (u + 1)
    d_up.mul_(da).masked_fill_(tmp != up, 0)  # clamped (or NaN) up: no gradient


def _identity(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class Activation:
    name: str
    fn: Callable[[Tensor], Tensor]  # first projection's output [..., F_in] -> [..., F]
    unit: Callable[[Tensor], Tensor]  # the elementwise nonlinearity (applied to the gate when gated)
    gated: bool  # F_in = 2F laid out [gate | up]
    kernel_code: int  # ACT in moe.kernels.expert_mlp's fused kernels
    up_fn: Callable[[Tensor], Tensor] = _identity  # gated: what multiplies unit(gate) is up_fn(up)

    def __call__(self, h: Tensor) -> Tensor:
        return self.fn(h)

    def combine(self, gate: Tensor, up: Tensor) -> Tensor:
        """A gated activation from separate gate and up tensors (the dense MLP's two Linears): the composite
        ``unit(gate) * up_fn(up)``, the same function as ``fn`` on [gate | up]."""
        return self.unit(gate) * self.up_fn(up)

    def in_features(self, ffn_hidden_size: int) -> int:
        """Width of the first projection: a gated activation needs a gate and an up projection."""
        return 2 * ffn_hidden_size if self.gated else ffn_hidden_size


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("swiglu", swiglu, F.silu, gated=True, kernel_code=0),
        Activation("gelu", F.gelu, F.gelu, gated=False, kernel_code=1),  # exact erf form (approximate="none")
        Activation("relu", F.relu, F.relu, gated=False, kernel_code=2),
        Activation("swiglu_oai", swiglu_oai, oai_unit, gated=True, kernel_code=3, up_fn=oai_up),  # gpt-oss
    )
}


def get_activation(name: str) -> Activation:
    """The table entry for ``name``; ValueError listing the known names otherwise."""
    act = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act is None:
        raise ValueError(f"activation={name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return act


def check_activation(name: str) -> None:
    get_activation(name)


def ffn_in_features(name: str, ffn_hidden_size: int) -> int:
    """Width of the first projection for activation ``name`` (2F when gated, else F)."""
    return get_activation(name).in_features(ffn_hidden_size)
