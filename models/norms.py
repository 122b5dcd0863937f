"""The RMSNorm variants of the models: the zero-centered one of Qwen3-Next / Qwen3.5 (``ModelConfig.norm_zero_centered``)
and the helpers the model code builds and initialises norms with."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from moekit.models.config import ModelConfig


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight w stores the scale minus one: y = x / rms(x) * (1 + w) (Qwen3-Next, Qwen3.5). It starts
    at 0 (``identity``), so weight decay pulls it toward the identity, not toward zero output."""

    identity = 0.0

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)  # fp32, as transformers' Qwen3-Next
        return (y * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: ModelConfig, dim: int, eps: float | None = None) -> nn.RMSNorm:
    """The RMSNorm of the residual stream and of q / k: zero-centered when config.norm_zero_centered."""
    cls = ZeroCenteredRMSNorm if config.norm_zero_centered else nn.RMSNorm
    return cls(dim, eps=config.norm_eps if eps is None else eps)


def norm_identity(norm: nn.Module) -> float:
    """The weight value at which ``norm`` scales by one (what initialisation fills)."""
    return getattr(norm, "identity", 1.0)
