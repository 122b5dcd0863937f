"""The one table of FFN activations: every backend (the experts' loop / torch / triton, the dense MLP,
the kernels' reference and fused epilogues) reads its activation here, so they cannot disagree.

An ``Activation`` maps the first projection's output to the second projection's input:

    gated (SwiGLU):  h [..., 2F] = [gate | up]  ->  unit(gate) * up  [..., F]
    plain (GELU):    h [..., F]                 ->  unit(h)          [..., F]

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


@dataclass(frozen=True)
class Activation:
    name: str
    fn: Callable[[Tensor], Tensor]  # first projection's output [..., F_in] -> [..., F]
    unit: Callable[[Tensor], Tensor]  # the elementwise nonlinearity (applied to the gate when gated)
    gated: bool  # F_in = 2F laid out [gate | up]
    kernel_code: int  # ACT in moe.kernels.expert_mlp's fused kernels

    def __call__(self, h: Tensor) -> Tensor:
        return self.fn(h)

    def in_features(self, ffn_hidden_size: int) -> int:
        """Width of the first projection: a gated activation needs a gate and an up projection."""
        return 2 * ffn_hidden_size if self.gated else ffn_hidden_size


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("swiglu", swiglu, F.silu, gated=True, kernel_code=0),
        Activation("gelu", F.gelu, F.gelu, gated=False, kernel_code=1),  # exact erf form (approximate="none")
        Activation("relu", F.relu, F.relu, gated=False, kernel_code=2),
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
