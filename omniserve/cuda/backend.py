"""The one place that decides which Triton kernel runs each elementwise layer of a CUDA model.

Layers compute through torch by default and expose a hook (``RMSNorm.kernel`` and
``.add_kernel``, ``QKRotary.kernel``, ``SiluAndMul.kernel``); ``apply_cuda_backend`` sets them
on a loaded bf16 or fp16 model. fp32 stays on torch, where its outputs are transformers' to the
bit (the kernels differ from torch in the order of a norm's sum of squares and in the hardware's
approximate rsqrt and exp, which rounding to bf16 or fp16 hides but fp32 would show; compiled on an
H200, bf16 and fp16 outputs were within one unit of torch's, the rotation bit-equal).
``OMNISERVE_CUDA_KERNELS=torch`` leaves the model untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from omniserve import envs
from omniserve.cuda import kernels
from omniserve.layers.activation import SiluAndMul
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.placement import KernelPlacement
from omniserve.layers.rotary_embedding import QKRotary

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class TritonRMSNorm:
    """An ``RMSNorm`` layer's forward and add-then-norm, one kernel each."""

    def __init__(self, layer: RMSNorm) -> None:
        self.weight, self.eps = layer.weight, layer.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)[1]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


def apply_cuda_backend(model: nn.Module, dtype: torch.dtype) -> KernelPlacement:
    """Give the elementwise layers of a loaded ``dtype`` model their Triton kernels (none in
    fp32)."""
    report = KernelPlacement("CUDA")
    if envs.layer_kernels("cuda") == "torch" or dtype not in KERNEL_DTYPES:
        return report
    for module in model.modules():
        if isinstance(module, RMSNorm):
            if module.weight.dtype != dtype:  # kept in another dtype: torch promotes, we don't
                continue
            kernel = TritonRMSNorm(module)
            module.kernel, module.add_kernel = kernel, kernel.add
            kind = "RMSNorm (+ residual add): Triton"
        elif isinstance(module, QKRotary):
            module.kernel = kernels.qk_norm_rope
            kind = "q/k norm + RoPE: Triton"
        elif isinstance(module, SiluAndMul):
            module.kernel = kernels.silu_and_mul
            kind = "SiLU-and-mul: Triton"
        else:
            continue
        report.placements[kind] += 1
    return report
