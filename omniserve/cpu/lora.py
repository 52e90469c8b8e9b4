"""LoRA products for decode-sized steps in one C call per layer (``csrc/lora.c``).

torch runs an adapted layer's two small matmuls (shrink to the rank, expand back) at ~30-90 us
of fixed cost each, more than their arithmetic: on the real-size Qwen2.5-1.5B with a rank-16
adapter on every projection that was ~20 ms of a batch-8 decode step. Up to ``MAX_ROWS`` rows
the kernel does both in one call; larger steps (prefills) keep torch's GEMMs, which run on AMX
where the CPU has it. Measured on that model's four adapted layers (2 cores, AMX, bf16, rank 16,
weights in cache), all 28 layers' products per step: 1 row 2.1 ms against torch's 11.0, 8 rows
4.8 against 14.4, 32 rows 16.2 against 20.0; at 64 rows torch's 21.8 wins.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omniserve.cpu.build import inference_tensors, load_typed

MAX_ROWS = 32
"""More rows go to torch (the measured crossover; csrc/lora.c takes up to 64)."""
MAX_WIDTH = 512
"""csrc/lora.c's LORA_MAX_WIDTH: the widest slot (slices x rank) it takes."""
COLS = 64
"""csrc/lora.c's COLS: the expand matrix is packed in blocks of this many output columns."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, ctypes.c_int)


def _kernel(dtype: torch.dtype) -> Any:
    return load_typed("lora.c", "omniserve_lora", dtype, _SIGNATURE, None)


class CpuLoRA:
    """``y += (x @ a.T) @ bt`` for a slot's ``a`` ``[W, K]`` and ``bt`` ``[W, N]``, the latter
    packed once per adapter (``pack``)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kernel = _kernel(dtype)

    @staticmethod
    def supports(a: torch.Tensor, bt: torch.Tensor) -> bool:
        width, in_features = a.shape[-2:]
        return (
            a.device.type == "cpu"
            and _kernel(a.dtype) is not None
            and in_features % 32 == 0
            and width <= MAX_WIDTH
            and bt.dtype == a.dtype
        )

    @staticmethod
    def pack(bt: torch.Tensor) -> torch.Tensor:
        """``[W, N]`` -> ``[ceil(N / COLS), W, COLS]``, zero-padded: each block of output
        columns one contiguous read."""
        width, n = bt.shape
        blocks = -(-n // COLS)
        padded = bt.new_zeros(width, blocks * COLS)
        padded[:, :n] = bt
        return padded.view(width, blocks, COLS).transpose(0, 1).contiguous()

    def add(self, x: torch.Tensor, a: torch.Tensor, packed: torch.Tensor, y: torch.Tensor) -> bool:
        """Add the product into ``y`` (rows of ``x``, contiguous rows); False: left to torch
        (too many rows, or tensors the kernel does not take)."""
        rows_ok = x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and y.stride(-1) == 1
        if not rows_ok or x.dtype != a.dtype or y.dtype != a.dtype or not inference_tensors(x, y):
            return False
        width, in_features = a.shape
        self.kernel(
            x.data_ptr(), x.shape[0], x.stride(0), a.data_ptr(), width, in_features,
            packed.data_ptr(), y.shape[1], y.data_ptr(), y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return True
