"""Picks each attention layer's backend by device, dtype and head size (``--attention-backend``
or ``OMNISERVE_ATTENTION_BACKEND`` overrides "auto").

Layers are built with the torch backend (the reference, right everywhere); once the model is
loaded on its device the worker hands every layer the chosen one. "auto" means Triton on CUDA
and, on CPU, whatever the CPU backend placed (its C decode kernel, or torch).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from omniserve.attention.base import AttentionBackend
from omniserve.attention.torch_backend import TorchAttentionBackend

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRITON_MAX_HEAD_SIZE = 256
"""Beyond this a prefill tile's fp32 accumulator no longer fits the registers well."""


@functools.cache
def get_attention_backend() -> AttentionBackend:
    """The process-wide torch backend every layer starts with (one instance: its per-step plan
    is shared by all layers)."""
    return TorchAttentionBackend()


def triton_supports(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether the Triton kernel runs this layer: CUDA (or the Triton interpreter), a float
    dtype it accumulates in fp32, a head it keeps in registers."""
    try:
        from omniserve.triton_utils import INTERPRETED
    except ImportError:  # triton is a dependency only on Linux x86_64
        return False
    return ((device.type == "cuda" or INTERPRETED) and dtype in TRITON_DTYPES
            and head_size <= TRITON_MAX_HEAD_SIZE)  # fmt: skip


def apply_attention_backend(model: nn.Module, requested: str, device: torch.device,
                            dtype: torch.dtype) -> dict[str, int]:  # fmt: skip
    """Give every attention layer of ``model`` its backend; returns layers per backend name.

    "triton" asked for where the kernel cannot run is an error naming why; "auto" falls back to
    torch layer by layer."""
    from omniserve.attention.layer import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if requested == "auto" and device.type == "cpu":
        return _count(layers)  # the CPU backend's placement stands
    triton_backend = None
    for layer in layers:
        if requested == "torch":
            layer.backend = get_attention_backend()
            continue
        if not triton_supports(device, dtype, layer.head_size):
            if requested == "triton":
                raise ValueError(
                    f"--attention-backend triton cannot run a {dtype} layer with head size "
                    f"{layer.head_size} on {device.type} (it needs CUDA or TRITON_INTERPRET=1, "
                    f"one of {TRITON_DTYPES}, head size <= {TRITON_MAX_HEAD_SIZE})."
                )
            layer.backend = get_attention_backend()
            continue
        if triton_backend is None:
            from omniserve.attention.triton_backend import TritonAttentionBackend

            triton_backend = TritonAttentionBackend()
        layer.backend = triton_backend
    return _count(layers)


def _count(layers: list[nn.Module]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.backend.name] = counts.get(layer.backend.name, 0) + 1
    return counts
