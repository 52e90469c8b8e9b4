"""The MoE expert block for CPUs: one C call per layer (``csrc/moe.c``) on the loaded experts, for
decode-sized batches (prefills take torch's per-expert GEMMs, see ``MAX_ROUTED_PER_EXPERT``).

The torch reference runs a small matmul pair per selected expert; at a decode step of a
128-expert top-8 layer that is ~250 small ops. The kernel does routing's sort, the gathers, both
projections, SiLU and the weighted combine in one parallel region, reading the stacked
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` parameters in place (no packed copy).
Each call handles at most ``TOKENS_PER_CALL`` tokens so its scratch stays bounded.
"""

from __future__ import annotations

import ctypes

import torch

from omniserve.cpu.build import KERNEL_DTYPES, inference_tensors, load_function, load_typed
from omniserve.layers.fused_moe import FusedMoE, fused_experts

TOKENS_PER_CALL = 1024
"""Scratch per call is about tokens x top_k x (3 H + I) x 4 bytes: 100 MiB at H 2048, top-8."""
MAX_ROUTED_PER_EXPERT = 4
"""Above this many routed tokens per expert on average (a prefill), torch's per-expert GEMMs
win: they read each expert's weights once for all its tokens, while the kernel's cost grows
with every token. Measured on the 2-core AVX2 EPYC (fp32): the crossover lies at 3-8 routed
tokens per expert for both the bench-size (8 experts, top-2) and the 30B's (128, top-8) shapes;
at 400 tokens the kernel took 5.5x (bench) and 3.2x (30B) the GEMMs' time."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int)
_STATUS = {-1: None, -2: "the CPU MoE kernel could not allocate its scratch buffers"}


def _kernel(dtype: torch.dtype, weight_dtype: torch.dtype) -> object:
    """The kernel for ``dtype`` activations on ``weight_dtype`` experts (None if there is none)."""
    if (dtype, weight_dtype) == (torch.float32, torch.bfloat16):  # keep_bf16_weights' experts
        return load_function("moe.c", "omniserve_moe_f32_bf16w", _SIGNATURE, ctypes.c_int)
    if dtype != weight_dtype:
        return None
    return load_typed("moe.c", "omniserve_moe", dtype, _SIGNATURE, ctypes.c_int)


class CpuMoE:
    """``fused_experts`` for one ``FusedMoE`` layer, in C; the activations are in ``dtype`` (the
    experts', or fp32 on bf16 experts)."""

    def __init__(self, layer: FusedMoE, dtype: torch.dtype | None = None) -> None:
        self.layer = layer
        self.dtype = layer.gate_up_proj.dtype if dtype is None else dtype
        self.kernel = _kernel(self.dtype, layer.gate_up_proj.dtype)

    @staticmethod
    def supports(layer: FusedMoE, dtype: torch.dtype | None = None) -> bool:
        weights = (layer.gate_up_proj, layer.down_proj)
        weight_dtype = layer.gate_up_proj.dtype
        return (
            weight_dtype in KERNEL_DTYPES
            and all(w.device.type == "cpu" and w.is_contiguous() for w in weights)
            and layer.hidden_size % 32 == 0
            and layer.intermediate_size_per_partition % 32 == 0
            and _kernel(weight_dtype if dtype is None else dtype, weight_dtype) is not None
        )

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        layer = self.layer
        gate_up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()
        num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
        if (
            x.dtype != self.dtype
            or not inference_tensors(x)
            or x.shape[0] * top_k > MAX_ROUTED_PER_EXPERT * num_experts
        ):
            return fused_experts(x, gate_up, down, topk_weights, topk_ids)
        x = x.contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], TOKENS_PER_CALL):
            count = min(TOKENS_PER_CALL, x.shape[0] - start)
            status = self.kernel(
                x[start].data_ptr(), count, x.shape[1], gate_up.data_ptr(), down.data_ptr(),
                num_experts, down.shape[2], weights[start].data_ptr(), ids[start].data_ptr(),
                top_k, out[start].data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if status == -1:
                raise ValueError(f"MoE expert ids must lie in [0, {num_experts}).")
            if status:
                raise MemoryError(f"{_STATUS.get(status, status)}.")
        return out
