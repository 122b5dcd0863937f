"""The RMSNorm variants of the models: the zero-centered one of Qwen3-Next / Qwen3.5 (``ModelConfig.norm_zero_centered``)
and the helpers the model code builds and initialises norms with."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.models.config import ModelConfig


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight is cast to the input's dtype where they differ: a bf16 input (a bf16 residual stream,
    or q / k under autocast over fp32 weights) with an fp32 weight would leave torch's fused kernel for its
    mixed-dtype fallback, several passes over the input. With the weight cast it computes as FSDP's bf16
    parameters do (the normalisation in fp32, the output in the input's dtype); fp32 inputs are unchanged.

    It runs outside autocast: torch 2.12 put rms_norm on CUDA autocast's fp32 list, which would make a full fp32
    copy of a bf16 input and return fp32 (then cast back by every projection), although the kernel accumulates in
    fp32 anyway (pytorch/pytorch#188955). The dtypes match here, so nothing is lost, on any torch version."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w is not None and w.dtype != x.dtype:
            w = w.to(x.dtype)
        if x.device.type in AUTOCAST_DEVICES and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return F.rms_norm(x, self.normalized_shape, w, self.eps)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


AUTOCAST_DEVICES = ("cuda", "cpu")  # where RMSNorm checks for autocast (fake / meta tensors run as the CPU's)


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight w stores the scale minus one: y = x / rms(x) * (1 + w) (Qwen3-Next, Qwen3.5). It starts
    at 0 (``identity``), so weight decay pulls it toward the identity, not toward zero output."""

    identity = 0.0

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)  # fp32, as transformers' Qwen3-Next
        return (y * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: ModelConfig, dim: int, eps: float | None = None) -> nn.RMSNorm:
    """The RMSNorm of the residual stream and of q / k: zero-centered when config.norm_zero_centered."""
    cls = ZeroCenteredRMSNorm if config.norm_zero_centered else RMSNorm
    return cls(dim, eps=config.norm_eps if eps is None else eps)


def norm_identity(norm: nn.Module) -> float:
    """The weight value at which ``norm`` scales by one (what initialisation fills)."""
    return getattr(norm, "identity", 1.0)
