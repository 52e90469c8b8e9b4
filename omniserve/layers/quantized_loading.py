"""What a quantized checkpoint makes of a model before and while it loads: which layers hold
quantized weights (``quantize_layers``: linear layers through ``quantization.quantize_linear``,
MoE experts through ``quantize_experts``), and the quantized matrices no linear layer holds,
gathered as they stream by (``dequantize_at_load``): kept quantized for the experts, dequantized
for the rest (transformers' media towers; experts whose groups a tensor-parallel rank would
split).

Quantized experts keep each expert's matrices in ``quantization``'s layout, stacked:
``gate_up_proj`` ``[E, 2I, H / 2]`` uint8 codes (FP8: e4m3 ``[E, 2I, H]``) with buffers
``gate_up_proj_scales`` (fp32) and ``gate_up_proj_zeros`` (4-bit) ``[E, 2I, groups]``, and
``down_proj`` alike. A 30B-A3B checkpoint's experts are most of its bytes, so this is what makes
its 4-bit or FP8 checkpoint take its quantized size. They compute through
``QuantizedExpertsKernel`` (Triton on CUDA, torch elsewhere), or the CPU backend's ``CpuMoE``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omniserve.config import QuantizationConfig
from omniserve.layers.fused_moe import FusedMoE, torch_fused_experts
from omniserve.layers.linear import LinearBase
from omniserve.layers.quantization import (
    QUANTIZED_SUFFIXES,
    QuantizedMatrix,
    canonical,
    check_g_idx,
    checkpoint_name,
    fp8_row_scales,
    quantize_linear,
)
from omniserve.layers.vocab_embedding import VocabParallelEmbedding
from omniserve.layers.weight_utils import LoadedWeight, materialize, set_weight_loader


@dataclass(frozen=True)
class QuantizedModel:
    """What ``quantize_layers`` made quantized, and what loading must do with the rest."""

    linear_layers: int
    """Linear layers holding quantized weights."""
    expert_layers: int
    """MoE layers holding quantized experts (``quantize_experts``)."""
    matrices: dict[str, set[str]]
    """The quantized matrices no linear layer holds: their names (without the suffix, as
    ``quantized_weights`` yields them) and the suffixes stored for each."""
    kept: frozenset[str]
    """Those of ``matrices`` that quantized experts hold; the others are dequantized at load."""


def quantize_layers(
    model: nn.Module, config: QuantizationConfig, keys: Iterable[str]
) -> QuantizedModel:
    """Before loading, make quantized every linear layer whose checkpoint matrices are stored
    quantized (``qweight``, or FP8 beside its scales) among ``keys`` (the checkpoint's names),
    and every MoE layer whose experts all are (where this rank's share of them holds whole
    groups). The keys go through the model's own ``load_weights`` routing (with
    ``find_quantized`` set, which loads nothing), so fused layers and renamed prefixes map as
    they do when the weights are read."""
    fp8 = config.method == "fp8"
    marker = config.scale_name if fp8 else "qweight"
    parts = ("weight", config.scale_name) if fp8 else QUANTIZED_SUFFIXES
    stored: dict[str, set[str]] = {}
    for key in keys:
        stem, _, suffix = (checkpoint_name(config, key) or "").rpartition(".")
        if suffix in parts:
            stored.setdefault(stem, set()).add(suffix)
    if config.symmetric:  # made beside the scales as they are read
        for suffixes in stored.values():
            suffixes.add("qzeros")
    marked = [f"{stem}.{marker}" for stem, suffixes in stored.items() if marker in suffixes]
    quantized: set[str] = set()
    in_layers: set[str] = set()  # checkpoint names a quantized linear layer holds

    def find_quantized(ckpt_name: str, param_name: str) -> None:
        path, _, suffix = param_name.rpartition(".")
        if suffix != marker:
            return
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            return  # not a layer of omniserve's: dequantized at load
        if not isinstance(layer, LinearBase) or isinstance(layer, VocabParallelEmbedding):
            return
        in_layers.add(ckpt_name.removesuffix(f".{marker}"))
        if path not in quantized:
            quantize_linear(layer, config)
            quantized.add(path)

    _route(model, marked, find_quantized)
    if not marked:
        raise ValueError(
            f"The checkpoint's quantization_config says {config.method}, but it stores no "
            f"{marker} tensor."
        )
    elsewhere = {key.removesuffix(f".{marker}") for key in marked} - in_layers
    experts = _quantize_experts_of(model, config, elsewhere)
    return QuantizedModel(
        len(quantized),
        len(experts),
        {stem: stored[stem] for stem in elsewhere},
        frozenset(stem for stems in experts.values() for stem in stems),
    )


def _route(model: nn.Module, keys: Iterable[str], find: Any) -> None:
    """Route ``keys`` through the model's ``load_weights`` to ``find(ckpt_name, param_name)``."""
    model.find_quantized = find
    try:
        model.load_weights((key, None) for key in keys)
    finally:
        del model.find_quantized


def _quantize_experts_of(
    model: nn.Module, config: QuantizationConfig, stems: Set[str]
) -> dict[str, list[str]]:
    """Quantize each MoE layer all of whose experts' matrices are among ``stems`` and whose
    groups fit this rank's share; return those layers' paths and their matrices."""
    holders: dict[str, list[str]] = {}

    def find_experts(ckpt_name: str, param_name: str) -> None:
        path, _, suffix = param_name.rpartition(".")
        if suffix in ("gate_up_proj", "down_proj"):
            holders.setdefault(path, []).append(ckpt_name.removesuffix(".weight"))

    _route(model, sorted(f"{stem}.weight" for stem in stems), find_experts)
    experts = {}
    for path, matrices in holders.items():
        layer = model.get_submodule(path)
        if (
            isinstance(layer, FusedMoE)
            and len(set(matrices)) == 3 * layer.num_experts
            and _whole_groups(layer, config)
        ):
            quantize_experts(layer, config)
            experts[path] = matrices
    return experts


def _whole_groups(layer: FusedMoE, config: QuantizationConfig) -> bool:
    """Whether each projection's groups lie whole in this rank's share of the experts."""
    group = config.group_size
    local = layer.intermediate_size_per_partition
    return not group or (layer.hidden_size % group == 0 and local % group == 0)


def quantize_experts(layer: FusedMoE, config: QuantizationConfig) -> None:
    """Replace a MoE layer's stacked expert weights by quantized ones: ``gate_up_proj`` and
    ``down_proj`` hold the codes, ``[E, N, K / 2]`` uint8 (FP8: e4m3 ``[E, N, K]``), beside
    buffers ``<name>_scales`` (fp32 ``[E, N, groups]``) and, 4-bit, ``<name>_zeros``, each
    expert's rows in the layout of the module docstring. Their loaders take
    ``QuantizedMatrix``s and keep this rank's share as ``FusedMoE.weight_loader`` does; the
    experts compute through ``QuantizedExpertsKernel`` (in the model's dtype, which the stacked
    weights being replaced have) until a backend gives them another kernel."""
    fp8 = config.method == "fp8"
    local, hidden = layer.intermediate_size_per_partition, layer.hidden_size
    for name, rows, cols in (("gate_up_proj", 2 * local, hidden), ("down_proj", hidden, local)):
        old = getattr(layer, name)
        groups = cols // (config.group_size or cols)
        shape = (layer.num_local_experts, rows, cols if fp8 else cols // 2)
        codes = torch.empty(shape, dtype=torch.float8_e4m3fn if fp8 else torch.uint8,
                            device=old.device)  # fmt: skip
        param = nn.Parameter(codes, requires_grad=False)
        set_weight_loader(param, _expert_loader(layer, name), old.shard_ids)
        setattr(layer, name, param)
        extra = {"scales": torch.float32, "zeros": torch.uint8}
        for suffix, dtype in list(extra.items())[: 1 if fp8 else 2]:
            buffer = torch.empty(layer.num_local_experts, rows, groups, dtype=dtype,
                                 device=old.device)  # fmt: skip
            layer.register_buffer(f"{name}_{suffix}", buffer, persistent=False)
    layer.quantization = config
    layer.kernel = QuantizedExpertsKernel(layer, old.dtype)


def _expert_loader(layer: FusedMoE, name: str) -> Any:
    def load(param: nn.Parameter, loaded: Any, expert_id: int, proj: str) -> None:
        if not isinstance(loaded, QuantizedMatrix):
            raise ValueError(f"expert {expert_id} {proj} is stored unquantized where the other "
                             "experts are quantized.")  # fmt: skip
        expected = layer.expert_shape(proj)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"Shape mismatch for expert {expert_id} {proj}: expected "
                             f"{expected}, got {tuple(loaded.shape)}.")  # fmt: skip
        if loaded.g_idx is not None:
            check_g_idx(loaded.g_idx, layer.quantization.group_size)  # type: ignore[union-attr]
        if (index := layer.local_expert(expert_id)) is None:
            return  # another rank's expert (expert parallelism)
        local, start = layer.intermediate_size_per_partition, layer.shard_start
        for suffix, source in (("", loaded.codes), ("_scales", loaded.scales),
                               ("_zeros", loaded.zeros)):  # fmt: skip
            if source is None:
                continue
            dest = (getattr(layer, name + suffix) if suffix else param.data)[index]
            if proj == "down_proj":  # this rank's input features (their groups; all of one)
                width = source.shape[1] * local // layer.intermediate_size
                source = source.narrow(1, start * width // local, width) if width else source
            else:  # this rank's rows, in the gate or the up half
                dest = dest.narrow(0, 0 if proj == "gate_proj" else local, local)
                source = source.narrow(0, start, local)
            if dest.shape != source.shape:
                raise ValueError(
                    f"expert {expert_id} {proj}: {suffix or 'codes'} of shape "
                    f"{tuple(source.shape)}, expected {tuple(dest.shape)}."
                )
            dest.copy_(source)

    return load


def expert_codes(layer: FusedMoE) -> tuple[QuantizedMatrix, QuantizedMatrix]:
    """A quantized MoE layer's gate/up and down projections, stacked (``quantize_experts``'
    tensors)."""
    return tuple(  # type: ignore[return-value]
        QuantizedMatrix(getattr(layer, name), getattr(layer, f"{name}_zeros", None),
                        getattr(layer, f"{name}_scales"))
        for name in ("gate_up_proj", "down_proj")
    )  # fmt: skip


class QuantizedExpertsKernel:
    """``fused_experts`` on quantized experts, on any device: on CUDA the Triton grouped GEMMs
    decode the codes tile by tile (no host reads: CUDA graphs hold it), elsewhere torch
    dequantizes each selected expert when its tokens come. ``dtype``: the activations'."""

    def __init__(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        self.layer = layer
        self.dtype = dtype

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        codes = expert_codes(self.layer)
        if x.is_cuda:
            from omniserve.layers.triton_fused_moe import triton_fused_experts

            return triton_fused_experts(x, *codes, topk_weights, topk_ids)
        gate_up, down = (DequantizedExperts(c) for c in codes)
        return torch_fused_experts(x, gate_up, down, topk_weights, topk_ids)

    def warm_up(self) -> None:
        """Compile the Triton kernel's variants before serving (CUDA)."""
        if self.layer.gate_up_proj.is_cuda:
            from omniserve.layers.triton_fused_moe import warm_up

            warm_up(*expert_codes(self.layer), self.layer.top_k, self.dtype)


class DequantizedExperts:
    """One projection of quantized experts, indexed by expert as a stacked weight is: each
    expert's matrix dequantized (here by torch, in fp32) when asked for."""

    def __init__(self, stack: QuantizedMatrix) -> None:
        self.stack = stack

    def __len__(self) -> int:
        return self.stack.codes.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        return self.stack[expert].dequantize(torch.float32)


def dequantize_at_load(
    weights: Iterator[tuple[str, LoadedWeight]],
    matrices: dict[str, set[str]],
    config: QuantizationConfig,
    kept: Set[str] = frozenset(),
) -> Iterator[tuple[str, LoadedWeight | QuantizedMatrix]]:
    """The checkpoint's tensors (as ``quantized_weights`` yields them) with each quantized
    matrix of ``matrices`` (name -> its stored suffixes) replaced by ``name.weight`` when all
    its tensors have been read (they are usually next to one another): a ``QuantizedMatrix``
    for those in ``kept``, the others dequantized to fp32 (the parameter each fills rounds it
    once)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stem, _, suffix = name.rpartition(".")
        if suffix not in matrices.get(stem, ()):
            yield name, tensor
            continue
        parts = pending.setdefault(stem, {})
        parts[suffix] = materialize(tensor)
        if len(parts) == len(matrices[stem]):
            matrix = _matrix(config, stem, pending.pop(stem))
            yield f"{stem}.weight", matrix if stem in kept else matrix.dequantize(torch.float32)
    if pending:
        stem, parts = next(iter(pending.items()))
        raise ValueError(f"The checkpoint lacks {sorted(matrices[stem] - parts.keys())} of the "
                         f"quantized matrix {stem!r}.")  # fmt: skip


def _matrix(
    config: QuantizationConfig, stem: str, parts: dict[str, torch.Tensor]
) -> QuantizedMatrix:
    """One quantized matrix's stored tensors in the layout of the module docstring."""
    if config.method == "fp8":
        weight, grid = parts["weight"], parts[config.scale_name]
        rows, cols = weight.shape if weight.dim() == 2 else (0, 0)
        row_block, group_size = config.block(rows, cols)
        if not rows or grid.numel() != -(-rows // row_block) * -(-cols // group_size):
            raise ValueError(
                f"Checkpoint tensor {stem}.weight of shape {tuple(weight.shape)} does not match "
                f"its scales {tuple(grid.shape)} in blocks of {row_block} x {group_size}."
            )
        grid = grid.reshape(-(-rows // row_block), -1)
        return QuantizedMatrix(weight, None, fp8_row_scales(grid, rows, row_block))
    qweight = canonical(config, "qweight", parts["qweight"])
    rows, cols = qweight.shape[0], 2 * qweight.shape[1]
    zeros = canonical(config, "qzeros", parts["qzeros"], rows)
    scales = canonical(config, "scales", parts["scales"])
    if zeros.shape != scales.shape or scales.shape[0] != rows or cols % scales.shape[1]:
        raise ValueError(f"The 4-bit tensors of {stem!r} do not match: codes {(rows, cols)}, "
                         f"zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}.")  # fmt: skip
    g_idx = canonical(config, "g_idx", parts["g_idx"]) if "g_idx" in parts else None
    return QuantizedMatrix(qweight, zeros, scales, g_idx)
