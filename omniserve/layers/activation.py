"""Activations a backend has kernels for: gated ones over a fused ``[gate | up]`` projection, and
GELU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in torch (the reference a kernel must match)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of width 2d: the SwiGLU of Llama/Qwen MLPs; a
    device backend may give it a ``kernel`` that does it in one pass."""

    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return silu_and_mul(x)


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """torch's GELU (``approximate``: "none", the erf form, or "tanh"), the kernels' reference."""
    return F.gelu(x, approximate=approximate)


class GELU(nn.Module):
    """``F.gelu`` as a layer a device backend may give a ``kernel``."""

    kernel: Callable[[torch.Tensor, str], torch.Tensor] | None = None

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate={approximate!r}: 'none' or 'tanh'.")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.approximate)
        return gelu(x, self.approximate)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``; only SwiGLU so far."""
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu').")
    return SiluAndMul()
