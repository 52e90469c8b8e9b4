"""RMSNorm with Hugging Face's numerics, so bf16 outputs agree bit for bit with transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalise over the last dimension in fp32, cast back, then scale (the order HF uses)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # In fp32 the casts are no-ops and torch's fused kernel gives the same floats in one
            # pass instead of five (it matters on per-head q/k norms over a whole prefill).
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
