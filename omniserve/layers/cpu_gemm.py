"""CPU fp32 matmuls: linear layers on oneDNN-packed weights, MoE expert blocks in C.

**Linear layers.** torch's ``F.linear`` runs MKL, which on this class of CPU reads a decode
step's small-M weights at a fraction of the memory bandwidth and reaches about 60% of oneDNN's
rate on prefill shapes. Once weights are loaded, ``pack_weights_for_cpu`` gives every
``PackedLinear`` layer a oneDNN-blocked copy of its weight (``mkldnn._reorder_linear_weight``,
the layout torch's own CPU inference compiler uses), and ``PackedLinear.linear`` runs on it:
1.2-2.1x faster from 1 to 7k rows (measured on the bench shapes). The copy is made once: weights
changed after packing need ``pack_weights_for_cpu`` again. Packed copies double the host memory
of the weights they copy.

**MoE.** ``moe`` does a layer's whole expert block in one C call (``csrc/cpu_gemm.c``: no
per-expert torch ops) on a panel-packed copy of the expert weights (``pack_experts``, also made
once): 1.5-3.6x the torch reference from 7.5k to 64 tokens (3.6x at a 64-token decode batch).

Both sum in a different order from MKL: outputs agree to float rounding (about 1e-6
relative), not bit for bit. ``OMNISERVE_CPU_KERNELS=torch`` keeps everything on torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniserve import envs
from omniserve.cpu_kernels import load_function, plain_fp32

_SOURCE = Path(__file__).with_name("csrc") / "cpu_gemm.c"
_PACK_ROWS_HINT = 64
"""oneDNN picks its blocking for this many rows; measured fast from 1 to 7k rows."""


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_MOE_SIGNATURE = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int)


def _moe_kernel() -> Any:
    return load_function(_SOURCE, "omniserve_moe_f32", _MOE_SIGNATURE, ctypes.c_int)


class PackedLinear(nn.Module):
    """A layer computing ``x @ weight.T (+ bias)`` that may hold a oneDNN-packed weight copy."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        """Make the packed copy of a CPU fp32 weight; True when made."""
        if not torch.backends.mkldnn.is_available() or not plain_fp32(self.weight.detach()):
            return False
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), _PACK_ROWS_HINT
            )
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, self.weight, bias)``, on the packed copy when there is one."""
        packed = self.packed_weight
        operands = (x,) if bias is None else (x, bias)
        if packed is None or not plain_fp32(*operands) or x.numel() == 0:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weights_for_cpu(model: nn.Module) -> int:
    """Call ``pack_for_cpu`` on every module of ``model`` that has it (``PackedLinear``, the MoE
    experts) once its weights are loaded; returns how many packed. A no-op with
    ``OMNISERVE_CPU_KERNELS=torch``."""
    if envs.cpu_kernels() == "torch":
        return 0
    return sum(bool(m.pack_for_cpu()) for m in model.modules() if hasattr(m, "pack_for_cpu"))


ExpertPanels = tuple[torch.Tensor, torch.Tensor]
"""A MoE layer's expert weights in the C kernel's column panels: gate_up ``[E, 2I/16, H, 16]``,
down ``[E, H/16, I, 16]``."""


def pack_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> ExpertPanels | None:
    """The panel copy of CPU fp32 expert weights, or None where the kernel does not apply (it
    needs I % 32 == 0 and H % 64 == 0, and a compiler)."""
    num_experts, two_i, hidden = gate_up_proj.shape
    if two_i % 64 or hidden % 64 or not plain_fp32(gate_up_proj.detach(), down_proj.detach()):
        return None
    if _moe_kernel() is None:
        return None
    with torch.no_grad():
        gate_up = gate_up_proj.detach().view(num_experts, two_i // 16, 16, hidden)
        down = down_proj.detach().view(num_experts, hidden // 16, 16, two_i // 2)
        return gate_up.transpose(2, 3).contiguous(), down.transpose(2, 3).contiguous()


def moe_supported(x: torch.Tensor, panels: ExpertPanels | None) -> bool:
    """Whether ``moe`` takes this call: packed experts and CPU fp32 tokens."""
    return panels is not None and x.shape[0] > 0 and plain_fp32(x)


def moe(
    x: torch.Tensor, panels: ExpertPanels, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The expert block of ``fused_moe.fused_experts`` in one C call (check ``moe_supported``)."""
    kernel = _moe_kernel()
    assert kernel is not None, "moe called without the kernel; check moe_supported()"
    gate_up, down = panels
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    num_experts, hidden = gate_up.shape[0], gate_up.shape[2]
    status = kernel(
        x.data_ptr(),
        x.shape[0],
        hidden,
        gate_up.data_ptr(),
        down.data_ptr(),
        num_experts,
        down.shape[2],
        weights.data_ptr(),
        ids.data_ptr(),
        ids.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -1:
        raise ValueError(f"MoE expert ids must lie in [0, {num_experts}).")
    if status:
        raise MemoryError("The CPU MoE kernel could not allocate its scratch buffers.")
    return out
