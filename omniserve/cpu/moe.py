"""The MoE expert block for CPUs: one C call per layer (``csrc/moe.c``) on the loaded experts, for
decode-sized batches (prefills take torch's per-expert GEMMs, see ``MAX_ROUTED_PER_EXPERT``).

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
from omniserve.layers.fused_moe import FusedMoE, fused_experts, torch_fused_experts

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
_PROJECTIONS = ("gate_up_proj", "down_proj")


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


def _group_sizes(layer: FusedMoE) -> tuple[int, int]:
    """Input features per scale of gate/up and of down (0 for stored weights)."""
    if layer.quantization is None:
        return 0, 0
    local = layer.intermediate_size_per_partition
    gate_up_groups, down_groups = (getattr(layer, f"{n}_scales").shape[2] for n in _PROJECTIONS)
    return layer.hidden_size // gate_up_groups, local // down_groups


class CpuMoE:
    """``fused_experts`` for one ``FusedMoE`` layer, in C; the activations are in ``dtype`` (the
    experts', or fp32 on bf16 experts; the model's on quantized experts)."""

    def __init__(self, layer: FusedMoE, dtype: torch.dtype | None = None) -> None:
        self.layer = layer
        self.dtype = layer.gate_up_proj.dtype if dtype is None else dtype
        self.kernel = _kernel(layer, self.dtype)
        self.weights: list[int | None] = []
        for name, group in zip(_PROJECTIONS, _group_sizes(layer), strict=True):
            self.weights += [getattr(layer, name).data_ptr(), *(
                None if (t := getattr(layer, f"{name}_{part}", None)) is None else t.data_ptr()
                for part in ("zeros", "scales")
            ), group]  # fmt: skip
        self.fallback = layer.kernel  # quantized experts' torch path, else None
        fmt = _format(layer)
        # prefill-sized batches: torch's per-expert products, quantized experts decoded in C
        self.decoded = (
            None
            if fmt is None
            else tuple(_DecodedMatrices(layer, name, fmt, self.dtype) for name in _PROJECTIONS)
        )

    @staticmethod
    def supports(layer: FusedMoE, dtype: torch.dtype | None = None) -> bool:
        tensors = [getattr(layer, name) for name in _PROJECTIONS]
        if layer.quantization is not None:
            if dtype is None or None in decoded_kernels(_format(layer) or "", dtype):
                return False
            tensors += [getattr(layer, f"{name}_scales") for name in _PROJECTIONS]
        elif layer.gate_up_proj.dtype not in KERNEL_DTYPES:
            return False
        return (
            all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and layer.hidden_size % 32 == 0
            and layer.intermediate_size_per_partition % 32 == 0
            and all(group % 32 == 0 for group in _group_sizes(layer))
            and _kernel(layer, layer.gate_up_proj.dtype if dtype is None else dtype) is not None
        )

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        layer = self.layer
        num_experts, top_k = layer.num_experts, topk_ids.shape[1]
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
                raise ValueError(f"MoE expert ids must lie in [0, {num_experts}).")
            if status:
                raise MemoryError(f"{_STATUS.get(status, status)}.")
        return out

    def _per_expert(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.decoded is None:
            gate_up, down = self.layer.gate_up_proj.detach(), self.layer.down_proj.detach()
            return fused_experts(x, gate_up, down, topk_weights, topk_ids)
        if x.dtype == self.dtype and inference_tensors(x):
            return torch_fused_experts(x, *self.decoded, topk_weights, topk_ids)
        assert self.fallback is not None
        return self.fallback(x, topk_weights, topk_ids)


class _DecodedMatrices:
    """One projection of quantized experts, each expert's matrix decoded in C (``csrc/
    linear_<fmt>.c``) to the activations' dtype when asked for."""

    def __init__(self, layer: FusedMoE, name: str, fmt: str, dtype: torch.dtype) -> None:
        self.codes = getattr(layer, name)
        self.zeros = getattr(layer, f"{name}_zeros", None)
        self.scales = getattr(layer, f"{name}_scales")
        self.dtype = dtype
        self.kernel = decoded_kernels(fmt, dtype)[1]
        self.rows = self.codes.shape[1]
        self.cols = self.codes.shape[2] * (1 if fmt == "fp8" else 2)

    def __len__(self) -> int:
        return self.codes.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols, dtype=self.dtype)
        zeros = None if self.zeros is None else self.zeros[expert].data_ptr()
        self.kernel(
            self.codes[expert].data_ptr(), zeros, self.scales[expert].data_ptr(), self.rows,
            self.cols, self.cols // self.scales.shape[2], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out
