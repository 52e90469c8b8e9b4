"""Linear-layer kernels for CPUs: oneDNN on a packed weight, or C on the checkpoint layout.

**oneDNN, packed** (``OneDnnLinear``): the layer's weight is reordered once into oneDNN's blocked
layout (``mkldnn._reorder_linear_weight``, the layout torch's own CPU inference compiler uses) and
the product runs through ``mkldnn._linear_pointwise``. On this class of CPU it streams a decode
step's weights at close to memory bandwidth (30 GB/s of 31 for one bf16 row, where ``F.linear``
gets 16) and reaches 330-420 GFLOPS in bf16 from 32 rows up. The packed copy *replaces* the
weight: the parameter becomes a meta-device placeholder (shape and dtype stay readable; any
computation with it fails loudly), so the model holds each weight once.

**C, AMX**: bf16 on a CPU with AMX, ``cpu/linear_amx.py``'s ``AmxLinear``.

**C, plain layout** (``RowsLinear``): for weights another layer also reads, so they must keep
their layout (an LM head tied to the token embedding). ``csrc/linear_rows.c`` streams the weight
once for a few rows (``rows_kernel_max_rows``); more rows go to ``F.linear``.

**C, bf16 weights with fp32 activations** (``WidenedLinear``): where a bf16 checkpoint runs in
fp32 (a CPU without native bf16), the weights stay bf16, packed into panels that
``csrc/linear_bf16w.c`` widens in registers: half the memory of fp32 weights and half the bytes a
decode step streams, with fp32's products. Against ``OneDnnLinear`` on the weight widened at load
(``scripts/bench_cpu_linear.py``: 2-core Xeon without AVX512-BF16, 2 threads, weights out of
cache; Qwen2.5-1.5B's qkv, gate/up and down and a 7B's gate/up): 1.7-1.9x as fast at 1 row,
1.8-2.3x at 4, 1.5-1.6x at 16, 1.0-1.1x at 64 and 0.8-0.95x at 256-1,023; from 1,024 rows
(prefill chunks, ``WIDENED_KERNEL_MAX_ROWS``) the weight is widened back piece by piece for
oneDNN: 0.9-1.05x there (Qwen3-0.6B's and Qwen2.5-1.5B's layers). Against bf16 throughout
(``--dtype bfloat16``, emulated here), 2.9-3.5x as fast at 4 rows and 3.7-5.3x from 16.

**C, 4-bit weights** (``Int4Linear``): for AWQ / GPTQ layers, on ``layers/quantization.py``'s
layout as loaded. For a few rows (``decoded_kernel_max_rows``) ``csrc/linear_int4.c`` decodes a
tile's weight rows at a time into a thread's scratch (a table lookup per 16 or 32 codes) and runs
the plain-layout tiles over it, so a decode step streams a quarter of a bf16 weight's bytes: at
one row about twice as fast as ``OneDnnLinear`` on the bf16 weight, and as fast as torch's own
int4 kernel (``scripts/bench_quantized_linear.py``). More rows, where the tiles' dot products cost
more than the bytes saved, go to ``F.linear`` on the weight decoded piece by piece (oneDNN, on
AMX where the CPU has it).

**C, FP8 weights** (``Fp8Linear``): for e4m3 layers (per block, row or matrix scales), the same
loop (``csrc/decoded_linear.h``) over ``csrc/linear_fp8.c``'s decoding (each byte's bits moved
into an fp16, which the CPU widens exactly). Up to 7 rows (bf16: 5) a kernel without the scratch
decodes straight into the dot products and scales each group's sums once: decoding into a
scratch first was compute-bound (1.1-1.15x the bf16 layer's speed at one row, where the bytes
allow 2x). Measured (2-core Xeon without AVX512-BF16, 2 threads, weights out of cache;
``scripts/bench_quantized_linear.py --format fp8``, Qwen2.5-1.5B's gate/up and down and a 7B's
gate/up):
with fp32 activations against ``WidenedLinear`` on the same weights in bf16, 1.42-1.79x as fast
at 1 row, 1.47-1.64x at 2, 1.05-1.15x at 4, 0.77-0.94x at 6, 0.65-0.86x from 8 to 64 rows
(decoding costs more than the bytes it saves) and 0.87-0.97x at 256 (decoded pieces); with bf16
activations against ``OneDnnLinear``, 1.4-1.95x at 1 row and 1.2-3.0x up to 64.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.cpu.build import cpu_flags, inference_tensors, load_function, load_typed

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

DECODED_KERNEL_MAX_ROWS = 64
"""Up to this many rows ``Int4Linear`` runs its kernel, above it ``F.linear`` on the decoded
weight. Measured in fp32 on the 2-core Xeon (2 threads, weights out of cache): at 1,536 x 17,920,
64 rows 16.1 ms against 21.6, 128 rows 32.5 against 31.5; at 8,960 x 1,536, 10.6 against 10.2
and 25.2 against 16.6. bf16 without AMX is assumed alike (oneDNN then multiplies with the
kernel's AVX-512 dot products; no such CPU was measured)."""
AMX_DECODED_KERNEL_MAX_ROWS = 16
"""bf16 with AMX: ``F.linear`` on the decoded weight runs on the tile unit and wins from about 20
rows. Measured as above: at 1,536 x 17,920, 16 rows 5.6 ms against 6.6, 24 rows 7.7 against 6.0;
at 8,960 x 1,536, 3.2 against 3.6 and 4.2 against 3.7; at 3,584 x 37,888, 25.5 against 23.6 and
36.9 against 23.1 (8 rows: 14.4 against 22.0)."""

FP8_ROWS_KERNEL_MAX_ROWS = {torch.float32: 7, torch.bfloat16: 5}
"""Up to this many rows (by activation dtype) ``Fp8Linear`` decodes straight into the dot
products (``omniserve_linear_fp8_rows``); more share each decoded tile across rows through a
scratch. Measured (2-core Xeon without AVX512-BF16, 2 threads, weights out of cache), that kernel
against the scratch one: fp32 at 1,536 x 17,920, 5 rows 2.73 ms against 2.91, 7 rows 3.13
against 3.76, 8 rows 3.36 against 3.38; at 3,584 x 37,888, 5 rows 12.8 against 16.1, 7 rows 16.1
against 18.2, 8 rows 18.8 against 17.1. bf16 (widened per row there) at 1,536 x 17,920: 5 rows
7.61 against 7.83, 6 rows 7.99 against 7.36; at 3,584 x 37,888, 5 rows 33.6 against 33.9, 6 rows
38.0 against 35.1."""

DEQUANTIZE_SCRATCH_BYTES = 32 << 20
"""Past ``max_rows`` a weight is decoded in pieces of at most this size, each multiplied by
``F.linear``, into one buffer per thread and dtype that is kept across calls: a fresh buffer for
a whole 1.5B model's gate/up projection (55 MB in bf16) cost 12 ms of page faults per call, more
than the product of 128 rows, and a 7B's (271 MB) would be held for good. Pieces help besides:
at 3,584 x 37,888, 16 to 32 rows took 23-25 ms in 32 MB pieces, 28 in 64 MB ones and 31 whole."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ROWS_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int)
_DECODED_SIGNATURE = (_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64,
                   ctypes.c_int)  # fmt: skip
_DEQUANTIZE_SIGNATURE = (_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, ctypes.c_int)
_PACK_PANELS_SIGNATURE = (_PTR, _I64, _I64, _PTR, ctypes.c_int)
_WIDENED_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int)
_UNPACK_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int)
PANEL = 32
"""Output features per panel of ``WidenedLinear``'s packed weight (``NP`` in its kernel)."""
WIDENED_KERNEL_MAX_ROWS = 1023
"""Up to this many rows ``WidenedLinear`` runs its kernel; more (prefill chunks) go to
``F.linear`` (oneDNN) on the weight widened back from the panels piece by piece, whose blocking
outruns the 14 x 32 tile there. Measured (``scripts/bench_cpu_linear.py``'s loop: 2-core Xeon
without AVX512-BF16, 2 threads, weights out of cache; kernel against pieces, ms): Qwen3-0.6B's
gate/up 1,024 x 6,144 at 512 rows 22.5 against 23.6, 1,024 rows 43.3 against 42.4, 2,048 rows
103 against 94; its down projection 3,072 x 1,024 at 1,024 rows 23.4 against 21.0, 2,048 rows
49.2 against 42.1; Qwen2.5-1.5B's gate/up 1,536 x 17,920 at 512 rows 104 against 116, 1,024 rows
207 against 209; its down 8,960 x 1,536 at 1,024 rows 102 against 95, 2,048 rows 208 against
178."""


@functools.cache
def rows_kernel_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows ``RowsLinear`` runs its kernel rather than ``F.linear`` on this CPU."""
    if dtype == torch.bfloat16 and torch.cpu.get_capabilities().get("amx_bf16"):
        return AMX_ROWS_KERNEL_MAX_ROWS
    return ROWS_KERNEL_MAX_ROWS


@functools.cache
def decoded_kernel_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows ``Int4Linear`` runs its kernel rather than ``F.linear`` on this CPU."""
    if dtype == torch.bfloat16 and torch.cpu.get_capabilities().get("amx_bf16"):
        return AMX_DECODED_KERNEL_MAX_ROWS
    return DECODED_KERNEL_MAX_ROWS


def check_input(x: torch.Tensor, weight_dtype: torch.dtype, name: str) -> None:
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
        check_input(x, self.dtype, "OneDnnLinear")
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _rows_kernel(weight_dtype: torch.dtype, dtype: torch.dtype) -> Any:
    """``csrc/linear_rows.c``'s function for ``dtype`` rows on a ``weight_dtype`` weight (None
    when there is none or it cannot be built)."""
    if (dtype, weight_dtype) == (torch.float32, torch.bfloat16):
        return load_function("linear_rows.c", "omniserve_linear_rows_f32_bf16w", _ROWS_SIGNATURE,
                             None)  # fmt: skip
    if dtype != weight_dtype:
        return None
    return load_typed("linear_rows.c", "omniserve_linear_rows", dtype, _ROWS_SIGNATURE, None)


class RowsLinear:
    """``x @ weight.T + bias`` on the weight as it is (shared with another layer); ``x`` is in
    ``dtype``, the weight's, or fp32 on a bf16 weight (widened in the kernel, or piece by piece
    for ``F.linear`` past ``max_rows``)."""

    def __init__(
        self, weight: torch.Tensor, dtype: torch.dtype | None = None, max_rows: int | None = None
    ) -> None:
        self.weight = weight  # a reference: the layer that shares it keeps it alive
        self.dtype = weight.dtype if dtype is None else dtype
        self.max_rows = rows_kernel_max_rows(self.dtype) if max_rows is None else max_rows
        self.kernel = _rows_kernel(weight.dtype, self.dtype)

    @staticmethod
    def supports(weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_contiguous()
            and _rows_kernel(weight.dtype, weight.dtype if dtype is None else dtype) is not None
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.detach()
        check_input(x, self.dtype, "RowsLinear")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows or rows.shape[0] == 0:
            if weight.dtype == self.dtype:
                return F.linear(x, weight, bias)
            widen = lambda start, end, out: out.copy_(weight[start:end])  # noqa: E731
            return product_in_pieces(x, bias, *weight.shape, widen)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.detach().to(self.dtype).contiguous()
        out = x.new_empty(rows.shape[0], weight.shape[0])
        self.kernel(
            rows.data_ptr(), rows.shape[0], rows.stride(0), weight.data_ptr(), weight.shape[0],
            weight.shape[1], None if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def _widened_kernels() -> tuple[Any, Any, Any] | None:
    """The panel packing, the product and the unpacking of ``csrc/linear_bf16w.c``, or None
    where they are not built or the CPU lacks AVX-512 (the kernel's tile needs its 32 vector
    registers)."""
    if "avx512f" not in cpu_flags():
        return None
    kernels = (
        load_function("linear_bf16w.c", "omniserve_pack_bf16_panels", _PACK_PANELS_SIGNATURE,
                      None),
        load_function("linear_bf16w.c", "omniserve_linear_bf16w", _WIDENED_SIGNATURE,
                      ctypes.c_int),
        load_function("linear_bf16w.c", "omniserve_unpack_bf16_panels", _UNPACK_SIGNATURE,
                      None),
    )  # fmt: skip
    return None if None in kernels else kernels


class WidenedLinear:
    """``x @ weight.T + bias`` for fp32 ``x`` on a bf16 weight, packed into panels of ``PANEL``
    output features that replace the layer's weight."""

    def __init__(self, weight: torch.Tensor, max_rows: int = WIDENED_KERNEL_MAX_ROWS) -> None:
        kernels = _widened_kernels()
        assert kernels is not None, "WidenedLinear.available() is False"
        pack, self.kernel, self.unpack = kernels
        self.max_rows = max_rows
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // PANEL)
        self.packed = torch.empty(panels * self.in_features * PANEL // 2, dtype=torch.int32)
        weight = weight.detach().contiguous()
        pack(
            weight.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    @staticmethod
    def available() -> bool:
        return _widened_kernels() is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_input(x, torch.float32, "WidenedLinear")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
        if rows.shape[0] > self.max_rows:
            return product_in_pieces(x, bias, self.out_features, self.in_features, self.widen)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = x.new_empty(rows.shape[0], self.out_features)
        status = self.kernel(
            rows.data_ptr(), rows.shape[0], rows.stride(0), self.packed.data_ptr(),
            self.out_features, self.in_features, None if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("The CPU bf16-weight linear kernel could not allocate its scratch.")
        return out.view(*x.shape[:-1], self.out_features)

    def widen(self, start: int, end: int, out: torch.Tensor) -> None:
        """Rows ``start:end`` of the weight in fp32, into ``out`` (contiguous)."""
        self.unpack(self.packed.data_ptr(), self.in_features, start, end, out.data_ptr(),
                    torch.get_num_threads())  # fmt: skip


def decoded_kernels(fmt: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """``csrc/linear_<fmt>.c``'s fused product and full dequantization for ``dtype`` (None each
    when they cannot be built)."""
    return (
        load_typed(f"linear_{fmt}.c", f"omniserve_linear_{fmt}", dtype, _DECODED_SIGNATURE,
                   ctypes.c_int),
        load_typed(f"linear_{fmt}.c", f"omniserve_dequantize_{fmt}", dtype,
                   _DEQUANTIZE_SIGNATURE, None),
    )  # fmt: skip


class DecodedLinear:
    """``x @ W.T + bias`` with W kept as ``codes`` (``bits`` each) and fp32 ``scales`` ``[N, K /
    g]`` (and 4-bit zero points) that ``csrc/linear_<fmt>.c`` decodes; the activations (and the
    decoded weights) are in ``dtype``, the model's."""

    fmt: str
    bits: int

    def __init__(
        self,
        codes: torch.Tensor,
        zeros: torch.Tensor | None,
        scales: torch.Tensor,
        dtype: torch.dtype,
        max_rows: int | None = None,
    ) -> None:
        # references: the layer keeps its parameters
        self.codes, self.zeros, self.scales = codes, zeros, scales
        self.dtype = dtype
        self.max_rows = decoded_kernel_max_rows(dtype) if max_rows is None else max_rows
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 8 // self.bits
        self.group_size = self.in_features // scales.shape[1]
        self.kernel, self.dequantize_kernel = decoded_kernels(self.fmt, dtype)

    @classmethod
    def _supports(cls, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
        if not (
            all(t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous()
                for t in (codes, scales))
            and scales.dtype == torch.float32
            and scales.shape[0] == codes.shape[0]
            and scales.shape[1] > 0
        ):  # fmt: skip
            return False
        in_features, groups = codes.shape[1] * 8 // cls.bits, scales.shape[1]
        return (
            in_features % 32 == 0
            and in_features % groups == 0
            and in_features // groups % 32 == 0
            and None not in decoded_kernels(cls.fmt, dtype)
        )

    def _kernel_for(self, rows: int) -> Any:
        """The C product for this many rows of x (at most ``max_rows``)."""
        return self.kernel

    def _pointers(self, start: int) -> tuple[int, int | None, int]:
        """The codes', zero points' and scales' addresses at row ``start``."""
        groups = self.scales.shape[1]
        return (
            self.codes.data_ptr() + start * self.codes.shape[1],
            None if self.zeros is None else self.zeros.data_ptr() + start * groups,
            self.scales.data_ptr() + start * groups * self.scales.element_size(),
        )

    def dequantize(
        self, start: int = 0, end: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``start:end`` of the weight in ``dtype`` (into ``out`` when given), as the torch
        reference (``layers.quantization``) dequantizes them."""
        end = self.out_features if end is None else end
        if out is None:
            out = torch.empty(end - start, self.in_features, dtype=self.dtype)
        self.dequantize_kernel(
            *self._pointers(start), end - start, self.in_features, self.group_size,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_input(x, self.dtype, type(self).__name__)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if bias is not None:
            bias = bias.detach().to(self.dtype).contiguous()
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows:
            return product_in_pieces(x, bias, self.out_features, self.in_features,
                                     self.dequantize)  # fmt: skip
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = x.new_empty(rows.shape[0], self.out_features)
        status = self._kernel_for(rows.shape[0])(
            rows.data_ptr(), rows.shape[0], rows.stride(0), *self._pointers(0),
            self.out_features, self.in_features, self.group_size,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(f"The CPU {self.fmt} linear kernel could not allocate its scratch.")
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(DecodedLinear):
    """4-bit codes, zero points and scales (``qweight`` uint8 ``[N, K / 2]``, ``qzeros`` uint8
    and ``scales`` fp32 ``[N, K / g]``)."""

    fmt, bits = "int4", 4

    @classmethod
    def supports(
        cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> bool:
        return (
            (qweight.dtype, qzeros.dtype) == (torch.uint8, torch.uint8)
            and qzeros.shape == scales.shape
            and qzeros.is_contiguous()
            and cls._supports(qweight, scales, dtype)
        )


class Fp8Linear(DecodedLinear):
    """e4m3 weights and their row scales (``weight`` ``[N, K]``, ``weight_scale_inv`` fp32 ``[N,
    K / g]``). Up to ``FP8_ROWS_KERNEL_MAX_ROWS`` rows run a kernel that decodes straight into
    the dot products (no scratch)."""

    fmt, bits = "fp8", 8

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype,
        max_rows: int | None = None,
    ) -> None:
        super().__init__(weight, None, scales, dtype, max_rows)
        self.rows_kernel = _fp8_rows_kernel(dtype)
        self.rows_kernel_max_rows = FP8_ROWS_KERNEL_MAX_ROWS[dtype]

    @classmethod
    def supports(cls, weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
        return (
            weight.dtype == torch.float8_e4m3fn
            and cls._supports(weight, scales, dtype)
            and _fp8_rows_kernel(dtype) is not None
        )

    def _kernel_for(self, rows: int) -> Any:
        return self.rows_kernel if rows <= self.rows_kernel_max_rows else self.kernel


def _fp8_rows_kernel(dtype: torch.dtype) -> Any:
    return load_typed("linear_fp8.c", "omniserve_linear_fp8_rows", dtype, _DECODED_SIGNATURE,
                      ctypes.c_int)  # fmt: skip


def product_in_pieces(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
    fill: Callable[[int, int, torch.Tensor], object],
) -> torch.Tensor:
    """``F.linear`` of ``x`` on a weight that ``fill(start, end, out)`` writes rows
    ``start:end`` of in ``x``'s dtype (decoded or widened), piece by piece into this thread's
    scratch."""
    n, k, dtype = out_features, in_features, x.dtype
    pieces = -(-n * k * dtype.itemsize // DEQUANTIZE_SCRATCH_BYTES)
    rows = -(-n // pieces)
    scratch = thread_scratch(rows * k, dtype).view(rows, k)
    if pieces == 1:
        fill(0, n, scratch[:n])
        return F.linear(x, scratch[:n], bias)
    out = x.new_empty(*x.shape[:-1], n)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        fill(start, end, scratch[: end - start])
        out[..., start:end] = F.linear(
            x, scratch[: end - start], None if bias is None else bias[start:end]
        )
    return out


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}


_SCRATCH = _Scratch()


def thread_scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of ``dtype`` (``numel`` elements of it: decoded weights, or an AMX
    product's transposed rows), kept across calls."""
    buffer = _SCRATCH.buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = _SCRATCH.buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]
