"""The MoE expert block for CPUs: one C call per layer (``csrc/moe.c``) on the loaded experts, for
decode-sized batches (prefills take per-expert GEMMs, see ``MAX_ROUTED_PER_EXPERT``: on AMX in
bf16, ``linear_amx.plain_linear`` on the experts as loaded).

The torch reference runs a small matmul pair per selected expert; at a decode step of a
128-expert top-8 layer that is ~250 small ops. The kernel does routing's sort, the gathers, both
projections, SiLU and the weighted combine in one parallel region, reading the stacked
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` parameters in place (no packed copy), or
decoding quantized experts' codes (``layers.quantized_loading.quantize_experts``) a tile at a
time. Each call handles at most ``TOKENS_PER_CALL`` tokens so its scratch stays bounded.
"""

from __future__ import annotations

import ctypes

import torch

from omniserve.cpu.build import KERNEL_DTYPES, inference_tensors, load_function, load_typed
from omniserve.cpu.linear import decoded_kernels
from omniserve.cpu.linear_amx import plain_linear
from omniserve.layers.fused_moe import FusedMoE, torch_fused_experts
from omniserve.layers.quantization import QuantizedMatrix
from omniserve.layers.quantized_loading import DequantizedExperts, expert_codes

TOKENS_PER_CALL = 1024
"""Scratch per call is about tokens x top_k x (3 H + I) x 4 bytes: 100 MiB at H 2048, top-8."""
MAX_ROUTED_PER_EXPERT = 4
"""Above this many routed tokens per expert on average (a prefill), torch's per-expert GEMMs
win: they read each expert's weights once for all its tokens, while the kernel's cost grows
with every token. Measured on the 2-core AVX2 EPYC (fp32): the crossover lies at 3-8 routed
tokens per expert for both the bench-size (8 experts, top-2) and the 30B's (128, top-8) shapes;
at 400 tokens the kernel took 5.5x (bench) and 3.2x (30B) the GEMMs' time."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_WEIGHTS = (_PTR, _PTR, _PTR, _I64)  # codes, zero points, scales, group size
_SIGNATURE = (_PTR, _I64, _I64, *_WEIGHTS, *_WEIGHTS, _I64, _I64, _PTR, _PTR, _I64, _PTR,
              ctypes.c_int)  # fmt: skip
_STATUS = {-1: None, -2: "the CPU MoE kernel could not allocate its scratch buffers"}


def _format(layer: FusedMoE) -> str | None:
    """The experts' codes as ``csrc`` names them (None: weights stored as they are)."""
    if layer.quantization is None:
        return None
    return "fp8" if layer.quantization.method == "fp8" else "int4"


def _kernel(layer: FusedMoE, dtype: torch.dtype) -> object:
    """The kernel for ``dtype`` activations on the layer's experts (None if there is none)."""
    weight_dtype, fmt = layer.gate_up_proj.dtype, _format(layer)
    if fmt is not None:
        return load_typed("moe.c", f"omniserve_moe_{fmt}", dtype, _SIGNATURE, ctypes.c_int)
    if (dtype, weight_dtype) == (torch.float32, torch.bfloat16):  # keep_bf16_weights' experts
        return load_function("moe.c", "omniserve_moe_f32_bf16w", _SIGNATURE, ctypes.c_int)
    if dtype != weight_dtype:
        return None
    return load_typed("moe.c", "omniserve_moe", dtype, _SIGNATURE, ctypes.c_int)


def _weights(layer: FusedMoE) -> list[int | None]:
    """The kernel's arguments for the gate/up and down projections: the weights' (or codes')
    address, and the zero points', the scales' and the group size (None, None, 0 when stored)."""
    if layer.quantization is None:
        return [layer.gate_up_proj.data_ptr(), None, None, 0,
                layer.down_proj.data_ptr(), None, None, 0]  # fmt: skip
    weights: list[int | None] = []
    for codes in expert_codes(layer):
        zeros = None if codes.zeros is None else codes.zeros.data_ptr()
        group = codes.shape[2] // codes.scales.shape[2]
        weights += [codes.codes.data_ptr(), zeros, codes.scales.data_ptr(), group]
    return weights


class CpuMoE:
    """``fused_experts`` for one ``FusedMoE`` layer, in C; the activations are in ``dtype`` (the
    experts', or fp32 on bf16 experts; the model's on quantized experts)."""

    def __init__(self, layer: FusedMoE, dtype: torch.dtype | None = None) -> None:
        self.layer = layer
        self.dtype = layer.gate_up_proj.dtype if dtype is None else dtype
        self.kernel = _kernel(layer, self.dtype)
        self.weights = _weights(layer)
        self.fallback = layer.kernel  # quantized experts' torch path, else None
        fmt = _format(layer)
        # prefill-sized batches: torch's per-expert products, quantized experts decoded in C
        self.decoded = None if fmt is None else tuple(
            _DecodedExperts(codes, fmt, self.dtype) for codes in expert_codes(layer)
        )  # fmt: skip

    @staticmethod
    def supports(layer: FusedMoE, dtype: torch.dtype | None = None) -> bool:
        tensors = [layer.gate_up_proj, layer.down_proj]
        groups = [32]
        if layer.quantization is not None:
            if dtype is None or None in decoded_kernels(_format(layer) or "", dtype):
                return False
            codes = expert_codes(layer)
            tensors += [c.scales for c in codes]
            groups = [c.shape[2] // c.scales.shape[2] for c in codes]
        elif layer.gate_up_proj.dtype not in KERNEL_DTYPES:
            return False
        return (
            all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and layer.hidden_size % 32 == 0
            and layer.intermediate_size_per_partition % 32 == 0
            and all(group % 32 == 0 for group in groups)
            and _kernel(layer, layer.gate_up_proj.dtype if dtype is None else dtype) is not None
        )

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        layer = self.layer
        num_experts, top_k = layer.num_local_experts, topk_ids.shape[1]
        if (
            x.dtype != self.dtype
            or not inference_tensors(x)
            or x.shape[0] * top_k > MAX_ROUTED_PER_EXPERT * num_experts
        ):
            return self._per_expert(x, topk_weights, topk_ids)
        x = x.contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], TOKENS_PER_CALL):
            count = min(TOKENS_PER_CALL, x.shape[0] - start)
            status = self.kernel(
                x[start].data_ptr(), count, x.shape[1], *self.weights, num_experts,
                layer.intermediate_size_per_partition, weights[start].data_ptr(),
                ids[start].data_ptr(), top_k, out[start].data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if status == -1:
                raise ValueError(f"MoE expert ids must lie in [0, {num_experts}] ({num_experts}: "
                                 "another rank's expert, skipped).")  # fmt: skip
            if status:
                raise MemoryError(f"{_STATUS.get(status, status)}.")
        return out

    def _per_expert(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.decoded is None:
            gate_up, down = self.layer.gate_up_proj.detach(), self.layer.down_proj.detach()
            return torch_fused_experts(x, gate_up, down, topk_weights, topk_ids, plain_linear)
        if x.dtype == self.dtype and inference_tensors(x):
            return torch_fused_experts(x, *self.decoded, topk_weights, topk_ids, plain_linear)
        assert self.fallback is not None
        return self.fallback(x, topk_weights, topk_ids)


class _DecodedExperts(DequantizedExperts):
    """``DequantizedExperts`` decoded in C (``csrc/linear_<fmt>.c``) to the activations'
    dtype."""

    def __init__(self, stack: QuantizedMatrix, fmt: str, dtype: torch.dtype) -> None:
        super().__init__(stack)
        self.dtype = dtype
        self.kernel = decoded_kernels(fmt, dtype)[1]

    def __getitem__(self, expert: int) -> torch.Tensor:
        matrix = self.stack[expert]
        rows, cols = matrix.shape
        out = torch.empty(rows, cols, dtype=self.dtype)
        self.kernel(
            matrix.codes.data_ptr(), None if matrix.zeros is None else matrix.zeros.data_ptr(),
            matrix.scales.data_ptr(), rows, cols, cols // matrix.scales.shape[1],
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out
