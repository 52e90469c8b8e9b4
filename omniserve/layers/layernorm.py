"""RMSNorm with Hugging Face's numerics, so bf16 outputs agree bit for bit with transformers."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dimension of x."""
    if x.dtype == weight.dtype == torch.float32:
        # In fp32 the casts are no-ops and torch's fused kernel gives the same floats in one
        # pass instead of five (it matters on per-head q/k norms over a whole prefill).
        return F.rms_norm(x, weight.shape, weight, eps)
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


class RMSNormKernel(Protocol):
    """A backend's implementation of ``RMSNorm.forward`` for one layer."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class AddRMSNormKernel(Protocol):
    """A backend's ``RMSNorm.add_forward``: the residual add and the norm in one pass."""

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    """Normalise over the last dimension in fp32, cast back, then scale (the order HF uses); a
    device backend may give it a ``kernel`` with the same rounding points."""

    kernel: RMSNormKernel | None = None
    add_kernel: AddRMSNormKernel | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return rms_norm(x, self.weight, self.variance_epsilon)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))``: the residual add a pre-norm layer does before
        this norm, which a backend may fuse into it."""
        if self.add_kernel is not None:
            return self.add_kernel(x, residual)
        summed = residual + x
        return summed, self(summed)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
