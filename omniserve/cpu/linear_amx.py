"""bf16 linear layers on a CPU with AMX: ``AmxLinear``, on ``csrc/linear_amx.c``'s tiles.

The CPU backend gives it every bf16 linear layer whose shapes fit the tiles. A layer's own weight
is packed into the tiles' layout (the copy replaces it, as oneDNN's does); a head tied to the
embedding runs on the shared weight as it is.
Measured (``scripts/bench_amx_linear.py``: 2-core Xeon with AMX, 2 threads, weights out of
cache; Qwen2.5-1.5B's qkv, o, gate/up and down projections) against ``OneDnnLinear``, over two
runs that the machine's speed swung between: 0.94-1.8x as fast at 1 row, 0.84-1.55x at 32,
0.9-1.12x at 512 and 0.84-0.96x at 2,048 (prefill chunks; the down projection is the weakest);
with the next group's prefetch (2026-12-02, one run each): 0.90-1.17x at 512 and 0.84-1.01x at
2,048 (gate/up 0.87x -> 1.01x, down 0.91x -> 1.01x; qkv and o unchanged within the noise);
on the tied head against ``F.linear`` on that weight, what it ran before past 2 rows, 1.35-1.5x
at 1-32 rows and 1.14-1.43x from 64 to 2,048. The whole model (``scripts/bench_realsize.py``)
decoded 18-24% faster at batch 1, 12-19% at 8 and 9-11% at 32, and prefilled 4-5% slower.
``plain_linear`` takes a bf16 MoE prefill's per-expert products: the 4-layer Qwen3-30B-A3B
prefilled 1.38-1.47x faster, and decoded 13-16% faster at batch 1 and 3-4% at 8.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from omniserve import envs
from omniserve.cpu.build import cpu_flags, inference_tensors, load_function
from omniserve.cpu.linear import check_input, thread_scratch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_AMX_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int,
                  ctypes.c_int)  # fmt: skip
_PACK_SIGNATURE = (_PTR, _I64, _I64, _PTR, ctypes.c_int)


@functools.cache
def _amx_kernels() -> tuple[Any, Any, Any] | None:
    """``csrc/linear_amx.c``'s product, its scratch size and its packing, or None where the CPU
    lacks AMX-BF16, the kernel cannot be built, or Linux refuses this process AMX's state (asked
    here, once per process, before any product runs)."""
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return None
    request = load_function("linear_amx.c", "omniserve_amx_request", (), ctypes.c_int)
    if request is None or request() != 0:
        return None
    return (
        load_function("linear_amx.c", "omniserve_linear_amx_bf16", _AMX_SIGNATURE, None),
        load_function("linear_amx.c", "omniserve_linear_amx_scratch_bytes",
                      (_I64, _I64, _I64, ctypes.c_int), _I64),
        load_function("linear_amx.c", "omniserve_pack_amx_bf16", _PACK_SIGNATURE, None),
    )  # fmt: skip


class AmxLinear:
    """``x @ weight.T + bias`` for bf16 ``x`` on AMX tiles: on a copy packed into the tiles'
    layout that replaces the layer's weight (``packed``), or on the weight as it is (one another
    layer shares; the layer keeps it)."""

    def __init__(self, weight: torch.Tensor, packed: bool) -> None:
        kernels = _amx_kernels()
        assert kernels is not None and self.supports(weight), "AmxLinear does not cover this"
        pack = kernels[2]
        self.packed, self.out_features, self.in_features = packed, *weight.shape
        if packed:
            n, k = weight.shape
            self.weight = torch.empty(-(-n // 32) * 32 * k, dtype=torch.bfloat16)
            pack(weight.detach().data_ptr(), n, k, self.weight.data_ptr(), torch.get_num_threads())
        else:
            self.weight = weight  # a reference: no copy is made

    @staticmethod
    def available() -> bool:
        """Whether this CPU and process can run the kernel at all (``OMNISERVE_CPU_AMX`` aside)."""
        return _amx_kernels() is not None

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.is_contiguous()
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % 32 == 0
            and envs.cpu_amx()
            and _amx_kernels() is not None
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_input(x, torch.bfloat16, "AmxLinear")
        return _product(x, self.weight, self.out_features, self.in_features, self.packed, bias)


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, on AMX where the kernel covers them (bf16 inference on a weight
    used as it lies: a MoE expert's matrices in a prefill), else through torch."""
    if (
        x.dtype != torch.bfloat16
        or not inference_tensors(x, weight)
        or not AmxLinear.supports(weight)
    ):
        return F.linear(x, weight)
    return _product(x, weight, *weight.shape, False, None)


def _product(
    x: torch.Tensor, weight: torch.Tensor, n: int, k: int, packed: bool, bias: torch.Tensor | None
) -> torch.Tensor:
    kernels = _amx_kernels()
    assert kernels is not None, "AmxLinear.available() is False"
    kernel, scratch_bytes, _ = kernels
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.bfloat16).contiguous()
    out = x.new_empty(rows.shape[0], n)
    scratch = thread_scratch(scratch_bytes(rows.shape[0], n, k, packed), torch.uint8)
    kernel(
        rows.data_ptr(), rows.shape[0], rows.stride(0), weight.detach().data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, scratch.data_ptr(), packed,
        torch.get_num_threads(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
