"""Linear-layer kernels for CPUs: oneDNN on a packed weight, or C on the checkpoint layout.

**oneDNN, packed** (``OneDnnLinear``): the layer's weight is reordered once into oneDNN's blocked
layout (``mkldnn._reorder_linear_weight``, the layout torch's own CPU inference compiler uses) and
the product runs through ``mkldnn._linear_pointwise``. On this class of CPU it streams a decode
step's weights at close to memory bandwidth (30 GB/s of 31 for one bf16 row, where ``F.linear``
gets 16) and reaches 330-420 GFLOPS in bf16 from 32 rows up. The packed copy *replaces* the
weight: the parameter becomes a meta-device placeholder (shape and dtype stay readable; any
computation with it fails loudly), so the model holds each weight once.

**C, plain layout** (``RowsLinear``): for weights another layer also reads, so they must keep
their layout (an LM head tied to the token embedding). ``csrc/linear_rows.c`` streams the weight
once for a few rows (``rows_kernel_max_rows``); more rows go to ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.cpu.build import inference_tensors, load_typed

PACK_ROWS_HINT = 64
"""oneDNN picks its blocking for this many rows; measured fast from 1 to 7k rows."""
ROWS_KERNEL_MAX_ROWS = 64
"""Up to this many rows the plain-layout kernel beats ``F.linear`` on a CPU without AMX (it
streams the weight once; measured on the 2-core EPYC)."""
AMX_ROWS_KERNEL_MAX_ROWS = 2
"""With AMX, oneDNN's plain-layout bf16 matmul (``F.linear``) runs on the tile unit and outruns
the kernel's AVX-512 dot products from 3 rows. Measured on a 2-core Xeon with AMX, on the
151,936 x 1,536 tied head: 3 rows 24.5 ms against the kernel's 27.5, 8 rows 23.5 against 42.7,
32 rows 27.0 against 97.3; 1 and 2 rows 22.7 and 24.3 against 20.0 and 23.4."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ROWS_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int)


@functools.cache
def rows_kernel_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows ``RowsLinear`` runs its kernel rather than ``F.linear`` on this CPU."""
    if dtype == torch.bfloat16 and torch.cpu.get_capabilities().get("amx_bf16"):
        return AMX_ROWS_KERNEL_MAX_ROWS
    return ROWS_KERNEL_MAX_ROWS


def _check_input(x: torch.Tensor, weight_dtype: torch.dtype, name: str) -> None:
    if not inference_tensors(x):
        raise RuntimeError(
            f"{name} runs inference on CPU tensors only (got a {x.device} tensor"
            f"{' that requires grad' if x.requires_grad else ''}); build the model without "
            "omniserve.cpu.apply_cpu_backend to train or move it."
        )
    if x.dtype != weight_dtype:
        raise TypeError(
            f"{name}: input dtype {x.dtype} does not match the weight's {weight_dtype}."
        )


def release_weight(layer: nn.Module, name: str = "weight") -> None:
    """Replace a parameter that a kernel now holds in its own layout by a meta-device placeholder
    of the same shape and dtype, freeing its memory."""
    old = getattr(layer, name)
    setattr(layer, name, nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False))


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU (its bf16 path needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT; an AVX2-only CPU keeps bf16 layers on torch)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_ROWS_HINT)
    except RuntimeError:
        return False
    return True


class OneDnnLinear:
    """``x @ weight.T + bias`` on a oneDNN-packed copy that replaces the layer's weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2
            and onednn_packs(weight.dtype)
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        _check_input(x, self.dtype, "OneDnnLinear")
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class RowsLinear:
    """``x @ weight.T + bias`` on the weight as it is (shared with another layer)."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None) -> None:
        self.weight = weight  # a reference: the layer that shares it keeps it alive
        self.max_rows = rows_kernel_max_rows(weight.dtype) if max_rows is None else max_rows
        self.kernel = load_typed(
            "linear_rows.c", "omniserve_linear_rows", weight.dtype, _ROWS_SIGNATURE, None
        )

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_contiguous()
            and load_typed("linear_rows.c", "omniserve_linear_rows", weight.dtype,
                           _ROWS_SIGNATURE, None) is not None
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.detach()
        _check_input(x, weight.dtype, "RowsLinear")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows or rows.shape[0] == 0:
            return F.linear(x, weight, bias)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.detach().to(weight.dtype).contiguous()
        out = x.new_empty(rows.shape[0], weight.shape[0])
        self.kernel(
            rows.data_ptr(), rows.shape[0], rows.stride(0), weight.data_ptr(), weight.shape[0],
            weight.shape[1], None if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*x.shape[:-1], weight.shape[0])
