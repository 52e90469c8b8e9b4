"""The one place that decides which CPU kernel runs each layer of a loaded model.

Layers compute through torch by default and expose a hook for a faster implementation
(``LinearBase.kernel``, ``FusedMoE.kernel``, ``QKRotary.kernel``, ``RMSNorm.kernel``,
``SiluAndMul.kernel``, ``GELU.kernel``, ``Attention.backend``).
``apply_cpu_backend`` walks a loaded model once and sets those hooks where a kernel covers the
layer's device, dtype and shapes; everything else stays on torch, and the report says what went
where. Weights a kernel keeps in its own layout replace the originals layer by layer, and the
freed originals go back to the OS as the walk goes (``_trim_heap``), so the peak is the model plus
a few layers. ``OMNISERVE_CPU_KERNELS=torch`` leaves the model untouched.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch import nn

from omniserve import envs
from omniserve.attention.layer import Attention
from omniserve.cpu.activation import (
    cpu_gelu,
    cpu_gelu_available,
    cpu_silu_and_mul,
    cpu_silu_and_mul_available,
)
from omniserve.cpu.attention import CpuAttentionBackend
from omniserve.cpu.linear import (
    Fp8Linear,
    Int4Linear,
    OneDnnLinear,
    RowsLinear,
    WidenedLinear,
    release_weight,
)
from omniserve.cpu.linear_amx import AmxLinear
from omniserve.cpu.moe import CpuMoE
from omniserve.cpu.norm_rope import CpuRMSNorm, qk_norm_rope
from omniserve.layers.activation import GELU, SiluAndMul
from omniserve.layers.fused_moe import FusedMoE
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import LinearBase
from omniserve.layers.placement import KernelPlacement
from omniserve.layers.quantization import QUANTIZED_PARTS
from omniserve.layers.rotary_embedding import QKRotary
from omniserve.layers.vocab_embedding import VocabParallelEmbedding

logger = logging.getLogger(__name__)


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (a tied LM head and embedding)."""
    owners: Counter[int] = Counter()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] += 1
    return {param_id for param_id, count in owners.items() if count > 1}


def _weights_name(weight_dtype: torch.dtype, dtype: torch.dtype) -> str:
    """How the report names a kernel's element types: the weights' dtype, or, for weights kept
    bf16 under fp32 activations (``keep_bf16_weights``), both."""
    if (weight_dtype, dtype) == (torch.bfloat16, torch.float32):
        return "bf16 weights, fp32 activations"
    return str(weight_dtype).removeprefix("torch.")


def keep_bf16_weights(
    model: nn.Module,
    dtype: torch.dtype,
    stored: Mapping[str, tuple[torch.Size, torch.dtype]],
) -> int:
    """Before loading, where the model computes in fp32 and every matrix of the checkpoint
    (``stored``: each tensor's shape and dtype; quantized matrices' codes and scales aside) is
    bf16: make the weights of the linear layers,
    the MoE experts and the token embeddings bf16 (a tied head's with its embedding's), at half
    the memory. The kernels then widen them in registers (torch's per-expert products of a
    prefill, one expert at a time) and the embeddings cast the rows they look up, as loading
    would have widened them, so the products stay fp32's. Returns how many weights."""
    matrices = {  # quantized matrices' tensors aside (4-bit scales are often fp16)
        d for name, (shape, d) in stored.items()
        if len(shape) > 1 and d.is_floating_point and d != torch.float8_e4m3fn
        and name.rpartition(".")[2] not in QUANTIZED_PARTS
    }  # fmt: skip
    if not (
        dtype == torch.float32
        and matrices == {torch.bfloat16}
        and envs.cpu_bf16_weights()
        and WidenedLinear.available()
    ):
        return 0
    kept: dict[int, nn.Parameter] = {}
    for layer in model.modules():
        if isinstance(layer, FusedMoE):
            names = ["gate_up_proj", "down_proj"]
        elif isinstance(layer, (LinearBase, VocabParallelEmbedding)):
            keeps = getattr(layer, "quantization", None) is not None or getattr(
                layer, "keeps_dtype", False
            )
            names = [] if keeps else ["weight"]
        else:
            continue
        for name in names:
            old = getattr(layer, name)
            if old.dtype != torch.float32:
                continue
            if id(old) not in kept:
                new = nn.Parameter(
                    torch.empty(old.shape, dtype=torch.bfloat16, device=old.device),
                    requires_grad=old.requires_grad,
                )
                new.__dict__.update(old.__dict__)  # the weight loader and its shard ids
                kept[id(old)] = new
            setattr(layer, name, kept[id(old)])
        if isinstance(layer, VocabParallelEmbedding):
            layer.output_dtype = dtype
    return len(kept)


def _place_linear(layer: LinearBase, shared: set[int], dtype: torch.dtype) -> str:
    if layer.quantization is not None:
        activations = f"{str(dtype).removeprefix('torch.')} activations"
        if layer.quantization.method == "fp8":
            fp8 = (layer.weight, getattr(layer, layer.quantization.scale_name))
            if not Fp8Linear.supports(*fp8, dtype):
                return "torch FP8 (dequantized per call)"
            layer.kernel = Fp8Linear(*fp8, dtype)
            return f"C FP8, {activations}"
        parts = (layer.qweight, layer.qzeros, layer.scales)
        if not Int4Linear.supports(*parts, dtype):
            return "torch 4-bit (dequantized per call)"
        layer.kernel = Int4Linear(*parts, dtype)
        return f"C 4-bit, {activations}"
    weight = layer.weight
    widened = (weight.dtype, dtype) == (torch.bfloat16, torch.float32)  # keep_bf16_weights'
    name = _weights_name(weight.dtype, dtype)
    if id(weight) in shared:
        if dtype == torch.bfloat16 and AmxLinear.supports(weight):
            layer.kernel = AmxLinear(weight, packed=False)
            return f"C AMX {name} (shared weight)"
        if RowsLinear.supports(weight, dtype):
            layer.kernel = RowsLinear(weight, dtype)
            return f"C plain-layout {name} (shared weight)"
        if widened:  # F.linear on the weight widened piece by piece
            layer.kernel = RowsLinear(weight, dtype, max_rows=0)
            return f"torch, {name} (shared weight)"
        return "torch (shared weight)"
    if widened:
        layer.kernel = WidenedLinear(weight)
        release_weight(layer)
        return f"C {name}"
    if dtype == torch.bfloat16 and AmxLinear.supports(weight):
        layer.kernel = AmxLinear(weight, packed=True)
        release_weight(layer)
        return f"C AMX packed {name}"
    if OneDnnLinear.supports(weight):
        layer.kernel = OneDnnLinear(weight)
        release_weight(layer)
        return f"oneDNN packed {name}"
    return "torch"


def _place_moe(layer: FusedMoE, dtype: torch.dtype) -> str:
    quantized = {"fp8": "FP8"}.get(layer.quantization.method, "4-bit") if layer.quantization else ""
    if not CpuMoE.supports(layer, dtype):
        return f"torch {quantized} (dequantized per call)" if quantized else "torch"
    layer.kernel = CpuMoE(layer, dtype)
    if quantized:
        return f"C {quantized}, {str(dtype).removeprefix('torch.')} activations"
    return f"C {_weights_name(layer.gate_up_proj.dtype, dtype)}"


TRIM_EVERY_BYTES = 256 << 20
"""Weight bytes replaced by kernels' own copies between two heap trims."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS. glibc keeps the freed originals of weights
    below its mmap threshold in its heap, where the packed copies of later layers do not fit
    them, so without this the process grew by ~40% of the weights while packing and shrank
    only afterwards (Qwen2.5-Omni-3B's thinker: 13.5 GiB at the peak against 9.8 after)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _param_bytes(module: nn.Module) -> int:
    """Bytes of the module's own parameters in memory (meta placeholders hold none)."""
    return sum(p.nbytes for p in module.parameters(recurse=False) if p.device.type != "meta")


def apply_cpu_backend(model: nn.Module, dtype: torch.dtype) -> KernelPlacement:
    """Give every layer of a loaded CPU model the fastest kernel that covers it; ``dtype`` is
    the activations' (the model's: a 4-bit layer's, an activation's, which have no weight of
    that dtype to tell, and a kept bf16 weight's)."""
    report = KernelPlacement("CPU")
    if envs.layer_kernels("cpu") == "torch":
        return report
    shared = _shared_parameters(model)
    attention_backend = CpuAttentionBackend()
    released = 0  # weight bytes freed since the last trim
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase | FusedMoE):
                held = _param_bytes(module)
                if isinstance(module, LinearBase):
                    kind = f"linear: {_place_linear(module, shared, dtype)}"
                else:
                    kind = f"MoE: {_place_moe(module, dtype)}"
                released += held - _param_bytes(module)
                if released >= TRIM_EVERY_BYTES:
                    _trim_heap()
                    released = 0
            elif isinstance(module, Attention):
                module.backend = attention_backend
                kind = "attention: C decode + SDPA prefill"
            elif isinstance(module, QKRotary):
                module.kernel = qk_norm_rope
                kind = "q/k norm + RoPE: C"
            elif isinstance(module, RMSNorm):
                if not CpuRMSNorm.supports(module):
                    continue  # fp32: torch's fused F.rms_norm already makes one pass
                kernel = CpuRMSNorm(module)
                module.kernel, module.add_kernel = kernel, kernel.add
                kind = "RMSNorm (+ residual add): C bfloat16"
            elif isinstance(module, SiluAndMul):
                if not (dtype == torch.bfloat16 and cpu_silu_and_mul_available()):
                    continue
                module.kernel = cpu_silu_and_mul
                kind = "SiLU-and-mul: C bfloat16"
            elif isinstance(module, GELU):
                tanh = module.approximate == "tanh"  # torch's erf form is as fast as C
                if not (tanh and dtype == torch.bfloat16 and cpu_gelu_available()):
                    continue
                module.kernel = cpu_gelu
                kind = "GELU (tanh form): C bfloat16"
            else:
                continue
            report.placements[kind] += 1
    _trim_heap()
    return report
