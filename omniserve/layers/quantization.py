"""Weight-only quantized checkpoints: 4-bit AWQ, GPTQ and compressed-tensors' pack-quantized (as
AutoAWQ / GPTQModel / llm-compressor save them) and FP8 (block-scaled as Qwen and DeepSeek
publish it, ``Qwen3-*-FP8``, or in compressed-tensors).

A 4-bit linear layer keeps its weight as 4-bit codes with one scale and one zero point per
``group_size`` input features: ``w[n, k] = (code[n, k] - zero[n, k // g]) * scale[n, k // g]``.
The three checkpoint formats pack those numbers differently (compressed-tensors' under other names,
``PACKED_NAMES``, and without zero points when symmetric); on loading, each tensor is turned into
one layout, oriented like a plain weight (output features first), so the layers' own weight
loaders shard it for tensor parallelism exactly as they shard a plain weight:

- ``qweight``: uint8 ``[N, K / 2]``, feature ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in
  the high one;
- ``qzeros``: uint8 ``[N, K / g]`` (0..15);
- ``scales``: fp32 ``[N, K / g]`` (the checkpoint's fp16 / bf16 scales, exactly);
- ``g_idx`` (GPTQ only): int32 ``[K]``, each feature's group, which must be ``k // g``: a
  checkpoint that reorders features (``desc_act`` with a permuted ``g_idx``) is refused.

An FP8 layer keeps the checkpoint's e4m3 ``weight`` ``[N, K]`` (a byte per weight) and its scales
(``weight_scale_inv`` in Qwen's format, ``weight_scale`` in compressed-tensors), one per
``row_block x group_size`` block (per block, per output feature, or one per matrix), widened to
one fp32 scale per row and group, ``[N, K / g]``: the 4-bit layout's, so the same loaders shard
it and the same kernels read it, ``w[n, k] = weight[n, k] * scale[n, k // g]``.

A linear layer becomes quantized when the checkpoint stores its matrices as ``qweight`` or
beside FP8 scales (``quantize_linear``, called by ``quantized_loading.quantize_layers``, which
also quantizes MoE experts); the others (media towers, the LM head, ``modules_to_not_convert``)
stay in the model's dtype. A layer's product runs through ``layer.kernel``: here a torch one that
dequantizes the weight on each call (CUDA, and CPUs without the C kernels); the CPU backend swaps
in ``cpu.linear.Int4Linear`` / ``Fp8Linear``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.config import QuantizationConfig
from omniserve.layers.linear import LinearBase
from omniserve.layers.weight_utils import (
    LoadedWeight,
    copy_weight,
    materialize,
    set_weight_loader,
)

QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")
"""What an FP8 matrix's scales are called beside its ``weight`` (Qwen's block-scaled format,
compressed-tensors); ``QuantizationConfig.scale_name`` says which a checkpoint uses."""
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing: nibble ``i`` of an int32 holds column ``_AWQ_ORDER[i]`` of its eight."""


def canonical(
    config: QuantizationConfig, suffix: str, loaded: LoadedWeight, rows: int = 0
) -> torch.Tensor:
    """One checkpoint tensor of a quantized layer in the layout of the module docstring (``rows``:
    the matrix's output features, which pack-quantized zero points pad to a multiple of 8)."""
    tensor = materialize(loaded)
    if config.method == "pack-quantized":
        return _canonical_packed(config, suffix, tensor, rows)
    if suffix == "scales":
        return tensor.t().float().contiguous()  # [groups, N] -> [N, groups]
    if suffix == "g_idx":
        return tensor.to(torch.int32)
    if suffix == "qzeros":  # both formats pack zeros along N
        zeros = unpack_int32(tensor, awq_order=config.method == "awq")  # [groups, N]
        if config.method == "gptq" and config.gptq_v1_zeros:
            zeros = (zeros + 1) & 0xF
        return zeros.t().contiguous()
    if config.method == "awq":  # [K, N / 8]
        codes = unpack_int32(tensor, awq_order=True).t()
    else:  # GPTQ packs eight input features per int32: [K / 8, N]
        codes = unpack_int32(tensor.t().contiguous(), awq_order=False)
    return pack_nibbles(codes)


def _canonical_packed(
    config: QuantizationConfig, suffix: str, tensor: torch.Tensor, rows: int
) -> torch.Tensor:
    """compressed-tensors' pack-quantized tensors (renamed by ``quantized_weights``): codes
    offset by 8 packed eight to an int32 along K, ``[N, K / 8]``; scales ``[N, groups]``; zero
    points (offset by 8) packed along N, ``[ceil(N / 8), groups]``, or 8 each when symmetric."""
    if suffix == "scales":
        return tensor.float().contiguous()
    if suffix == "qzeros":
        if tensor.dtype == torch.uint8:  # a symmetric checkpoint's, made by quantized_weights
            return tensor
        return unpack_int32(tensor.t().contiguous(), awq_order=False).t()[:rows].contiguous()
    return pack_nibbles(unpack_int32(tensor, awq_order=False))


PACKED_NAMES = {"weight_packed": "qweight", "weight_scale": "scales",
                "weight_zero_point": "qzeros", "weight_shape": None}  # fmt: skip
"""compressed-tensors' pack-quantized tensor names -> the 4-bit layout's (None: not kept, the
matrix's shape is the layer's)."""
QUANTIZED_PARTS = frozenset((*QUANTIZED_SUFFIXES, *FP8_SCALE_NAMES, *PACKED_NAMES))
"""The last names of a quantized matrix's stored tensors in every format but an FP8 matrix's own
``weight`` (its dtype, e4m3, tells it)."""


def checkpoint_name(config: QuantizationConfig, name: str) -> str | None:
    """The name a quantized checkpoint's tensor loads under (None: not loaded)."""
    if config.method != "pack-quantized":
        return name
    stem, _, suffix = name.rpartition(".")
    if suffix not in PACKED_NAMES:
        return name
    renamed = PACKED_NAMES[suffix]
    return None if renamed is None else f"{stem}.{renamed}"


def quantized_weights(
    weights: Iterator[tuple[str, LoadedWeight]], config: QuantizationConfig
) -> Iterator[tuple[str, LoadedWeight]]:
    """A quantized checkpoint's tensors under the names they load as (``checkpoint_name``), with
    a symmetric pack-quantized matrix's zero points (8 each) after its scales."""
    for name, tensor in weights:
        renamed = checkpoint_name(config, name)
        if renamed is None:
            continue
        yield renamed, tensor
        if config.symmetric and renamed.endswith(".scales"):
            zeros = torch.full(tuple(tensor.shape), 8, dtype=torch.uint8)
            yield f"{renamed.removesuffix('.scales')}.qzeros", zeros


def unpack_int32(packed: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """``[R, C]`` int32 holding eight 4-bit values each -> uint8 ``[R, 8 C]`` (AWQ's column
    order, or nibble ``i`` = column ``i``). Worked on as bytes (little-endian: nibble ``2b`` is
    byte ``b``'s low half): a 30B MoE checkpoint has ~18,000 such matrices."""
    data = packed.to(torch.int32).contiguous().view(torch.uint8)  # [R, 4 C]
    nibbles = torch.stack([data & 0xF, data >> 4], dim=-1)  # [R, 4 C, 2], in nibble order
    if awq_order:  # nibbles 0-3 hold columns 0, 2, 4, 6 and nibbles 4-7 columns 1, 3, 5, 7
        by_eight = nibbles.view(*data.shape[:-1], -1, 8)  # [R, C, 8]
        nibbles = torch.stack([by_eight[..., :4], by_eight[..., 4:]], dim=-1)  # [R, C, 4, 2]
    return nibbles.reshape(*data.shape[:-1], -1)


def pack_int32(values: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """The inverse of ``unpack_int32``: uint8 ``[R, 8 C]`` (0..15) -> int32 ``[R, C]``."""
    groups = values.to(torch.int32).unflatten(-1, (-1, 8))
    if awq_order:
        groups = groups[..., list(_AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (groups << shifts).sum(-1, dtype=torch.int64).to(torch.uint32).view(torch.int32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` codes (0..15) -> ``[N, K / 2]``, even features in the low nibbles."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype``: ``(code - zero) * scale`` of each feature's group (``k
    // g``, or GPTQ's ``g_idx``) in fp32, rounded once."""
    codes = unpack_nibbles(qweight).float()
    if g_idx is None:
        group_size = codes.shape[1] // scales.shape[1]
        zeros = qzeros.float().repeat_interleave(group_size, dim=1)
        return ((codes - zeros) * scales.repeat_interleave(group_size, dim=1)).to(dtype)
    group = g_idx.long()
    return ((codes - qzeros.float()[:, group]) * scales[:, group]).to(dtype)


def fp8_row_scales(grid: torch.Tensor, rows: int, row_block: int) -> torch.Tensor:
    """An FP8 scale grid ``[ceil(N / row_block), groups]`` (one scale: any shape) -> fp32 ``[N,
    groups]``."""
    if grid.numel() == 1:
        grid = grid.reshape(1, 1)
    if grid.dim() != 2 or grid.shape[0] != -(-rows // row_block):
        raise ValueError(
            f"FP8 scales of shape {tuple(grid.shape)} do not give one row of scales per "
            f"{row_block} of {rows} output features."
        )
    return grid.float().repeat_interleave(row_block, 0)[:rows].contiguous()


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype``: e4m3 ``weight`` times its fp32 row scales ``[N,
    ceil(K / g)]`` in fp32, rounded once (as transformers dequantizes)."""
    k = weight.shape[1]
    group_size = -(-k // scales.shape[1])
    return (weight.float() * scales.repeat_interleave(group_size, 1)[:, :k]).to(dtype)


@dataclass
class QuantizedMatrix:
    """A quantized ``[N, K]`` matrix in the layout of the module docstring (what
    ``quantized_loading.dequantize_at_load`` yields to the quantized experts), or a stack of them
    ``[E, N, K]`` (a MoE layer's projection, as its quantized experts keep it)."""

    codes: torch.Tensor
    """4-bit codes, uint8 ``[..., N, K / 2]``; or the e4m3 weight ``[..., N, K]``."""
    zeros: torch.Tensor | None
    """4-bit zero points, uint8 ``[..., N, groups]``."""
    scales: torch.Tensor
    """fp32 ``[..., N, groups]``."""
    g_idx: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        return 8 if self.codes.dtype == torch.float8_e4m3fn else 4

    @property
    def shape(self) -> torch.Size:
        """The shape of the weights the codes stand for."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 8 // self.bits))

    def __getitem__(self, index: int) -> QuantizedMatrix:
        """Matrix ``index`` of a stack."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedMatrix(self.codes[index], zeros, self.scales[index])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[N, K]`` weight in ``dtype``."""
        if self.bits == 8:
            return dequantize_fp8(self.codes, self.scales, dtype)
        assert self.zeros is not None
        return dequantize(self.codes, self.zeros, self.scales, dtype, self.g_idx)


class DequantizeLinear:
    """``x @ W.T + b`` with W dequantized on each call: torch only, so it runs anywhere."""

    def __init__(self, layer: LinearBase) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer = self.layer
        if layer.quantization is not None and layer.quantization.method == "fp8":
            matrix = QuantizedMatrix(
                layer.weight, None, getattr(layer, layer.quantization.scale_name)
            )
        else:
            matrix = QuantizedMatrix(layer.qweight, layer.qzeros, layer.scales)
        return F.linear(x, matrix.dequantize(x.dtype), bias)


def quantize_linear(layer: LinearBase, config: QuantizationConfig) -> None:
    """Replace ``layer.weight`` by the parameters of a quantized weight (see the module
    docstring), whose loaders turn checkpoint tensors into that layout and then shard them as
    the layer's own ``weight_loader`` shards a weight."""
    weight = layer.weight
    out_features, in_features = weight.shape
    group_size = config.group_size or in_features  # FP8 scales over all input features: per rank
    if in_features % group_size:
        raise ValueError(
            f"{type(layer).__name__} with {in_features} input features per rank cannot hold "
            f"groups of {group_size} (tensor parallelism must split on group bounds)."
        )
    groups = in_features // group_size
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    if config.method == "fp8":
        shapes = {
            "weight": ((out_features, in_features), torch.float8_e4m3fn),
            config.scale_name: ((out_features, groups), torch.float32),
        }
    else:
        shapes = {
            "qweight": ((out_features, in_features // 2), torch.uint8),
            "qzeros": ((out_features, groups), torch.uint8),
            "scales": ((out_features, groups), torch.float32),
        }
    if config.method == "gptq":
        shapes["g_idx"] = ((in_features,), torch.int32)
    shard_loader = getattr(weight, "weight_loader", None)
    shard_ids = getattr(weight, "shard_ids", None)
    del layer.weight
    for suffix, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=weight.device), False)
        setattr(layer, suffix, param)
        loader = _quantized_loader(config, suffix, shard_loader, layer, in_features)
        set_weight_loader(param, loader, shard_ids)
    layer.kernel = DequantizeLinear(layer)
    layer.quantization = config


def _quantized_loader(
    config: QuantizationConfig, suffix: str, shard_loader: Any, layer: LinearBase, in_features: int
) -> Any:
    def load(param: nn.Parameter, loaded: LoadedWeight, *shard: Any) -> None:
        if suffix == "weight":  # FP8: read as stored
            if loaded.dtype != torch.float8_e4m3fn:
                raise ValueError(f"an FP8 layer's weight is stored as {loaded.dtype}, not e4m3.")
            tensor: LoadedWeight = loaded
        elif suffix == config.scale_name:
            rows = layer.checkpoint_rows(*shard)
            tensor = fp8_row_scales(materialize(loaded), rows, config.row_block or rows)
            if not config.group_size:  # one column for every rank's share of the input
                tensor = tensor.repeat(1, layer.input_size // in_features)
        else:
            rows = layer.checkpoint_rows(*shard) if suffix == "qzeros" else 0
            tensor = canonical(config, suffix, loaded, rows)
        if suffix == "g_idx":  # checked whole, then each local feature's group
            check_g_idx(tensor, config.group_size)
            param.data.copy_(torch.arange(param.numel()) // config.group_size)
        elif shard_loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"Shape mismatch: {tuple(param.shape)} vs {tuple(tensor.shape)}.")
            copy_weight(param.data, tensor)
        else:
            shard_loader(param, tensor, *shard)

    return load


def check_g_idx(g_idx: torch.Tensor, group_size: int) -> None:
    """Refuse a GPTQ ``g_idx`` that reorders the input features (act-order)."""
    expected = torch.arange(g_idx.numel()) // group_size
    if not torch.equal(g_idx, expected.to(torch.int32)):
        raise ValueError(
            "g_idx reorders the input features (GPTQ desc_act): not supported; quantize "
            "without act-order."
        )
