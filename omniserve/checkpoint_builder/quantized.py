"""A 4-bit AWQ or GPTQ copy of a checkpoint, as AutoAWQ / GPTQModel save one, a block-scaled FP8
one, as Qwen publishes its ``-FP8`` models, or, in llm-compressor's compressed-tensors, an FP8
one with a scale per output feature (``fp8-dynamic``: its ``FP8_DYNAMIC``) or a 4-bit one
(``w4a16``: its ``W4A16``, symmetric groups), for tests and benchmarks, with its dequantized twin
for transformers.

Every attention and dense MLP projection of the language model, and every per-expert MoE
projection (as AutoAWQ and Qwen's FP8 checkpoints quantize them), is quantized by round-to-nearest
in groups of ``group_size`` input features (AWQ: asymmetric, a zero point per group; GPTQ and
W4A16: symmetric, zero point 8, which GPTQ stores minus one as ``checkpoint_format`` "gptq" does
and W4A16 does not store); FP8 rounds to e4m3 in ``group_size x group_size`` blocks
(``fp8-dynamic``: per output feature), each scaled so its largest weight is e4m3's largest
(448). The towers, the embeddings, the head and fused (3-D) expert tensors keep their weights.
What AWQ and
GPTQ add over rounding (calibrated scaling, error feedback) changes the codes, not the format, so
a rounded checkpoint exercises the same loading and arithmetic. The twin stores the dequantized
weights in the source's dtype under the original names: what a model quantized this way
computes, which transformers runs without any quantization library.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from omniserve.checkpoint_builder.builder import BUILD_INFO_FILE, build_key, build_once
from omniserve.checkpoint_builder.lora import is_decoder_projection
from omniserve.config import QuantizationConfig
from omniserve.layers.quantization import (
    QuantizedMatrix,
    dequantize,
    dequantize_fp8,
    fp8_row_scales,
    pack_int32,
    pack_nibbles,
)
from omniserve.layers.weight_utils import SafetensorsFile
from omniserve.worker.model_loader import INDEX_FILE, checkpoint_files

METHODS = ("awq", "gptq", "fp8", "fp8-dynamic", "w4a16")
FP8_MAX = 448.0
"""e4m3's largest finite value."""
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


def build_quantized_checkpoint(
    model_dir: str | Path, method: str = "awq", group_size: int = 128
) -> tuple[Path, Path]:
    """``(quantized, dequantized)`` directories next to ``model_dir`` (built once per inputs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    source = Path(model_dir)
    key = build_key(method, group_size, _source_key(source))
    stem = source.parent / f"{source.name}-{method}-g{group_size}"
    info = {"source": str(source), "method": method, "group_size": group_size}
    quantized = build_once(
        stem, key, info, lambda path: _write(source, path, method, group_size, dequantized=False)
    )
    twin = build_once(
        stem.with_name(f"{stem.name}-dequantized"), key, info,
        lambda path: _write(source, path, method, group_size, dequantized=True),
    )  # fmt: skip
    return quantized, twin


def _source_key(source: Path) -> str:
    """What identifies the source's weights: its build key, else its files' sizes and times."""
    info = source / BUILD_INFO_FILE
    if info.is_file():
        return json.loads(info.read_text()).get("key", "")
    files = checkpoint_files(source)
    return repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def quantize_rtn(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> codes uint8 ``[N, K]``, zeros uint8 ``[N, K / g]``, fp16 scales
    ``[N, K / g]``, rounding each group to 16 levels."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} input features do not split into groups of {group_size}.")
    groups = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = groups.abs().amax(-1) * 2 / 15
        zeros = torch.full_like(scales, 8)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = (high - low) / 15
        zeros = (-low / scales.clamp(min=1e-8)).round().clamp(0, 15)
    scales = scales.clamp(min=1e-6).half()
    codes = (groups / scales.float().unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> e4m3 ``[N, K]`` and its scales ``[ceil(N / block[0]), ceil(K / block[1])]``
    (bf16 for a bf16 weight, as Qwen stores them, else fp32), each block scaled so its largest
    magnitude is about ``FP8_MAX``."""
    n, k = weight.shape
    block_rows, block_cols = block
    rows, cols = -(-n // block_rows), -(-k // block_cols)
    padded = torch.zeros(rows * block_rows, cols * block_cols)
    padded[:n, :k] = weight.float()
    blocks = padded.reshape(rows, block_rows, cols, block_cols)
    scale_dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
    grid = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    scaled = (blocks / grid.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.reshape(rows * block_rows, cols * block_cols)[:n, :k].to(torch.float8_e4m3fn)
    return codes.contiguous(), grid


def quantized_matrix(weight: torch.Tensor, config: QuantizationConfig) -> QuantizedMatrix:
    """``weight`` rounded as ``config`` says (4-bit: asymmetric groups), in the layout it loads
    as: what a quantized layer holds, without a checkpoint in between."""
    if config.method != "fp8":
        codes, zeros, scales = quantize_rtn(weight, config.group_size, symmetric=False)
        return QuantizedMatrix(pack_nibbles(codes), zeros, scales.float())
    row_block, group = config.block(*weight.shape)
    codes, grid = quantize_fp8(weight, (row_block, group))
    return QuantizedMatrix(codes, None, fp8_row_scales(grid.float(), weight.shape[0], row_block))


def _quantized_tensors(
    stem: str, weight: torch.Tensor, method: str, group_size: int, dequantized: bool
) -> dict[str, torch.Tensor]:
    if method.startswith("fp8"):
        block = (group_size, group_size) if method == "fp8" else (1, weight.shape[1])
        codes8, grid = quantize_fp8(weight, block)
        if dequantized:
            scales8 = fp8_row_scales(grid, weight.shape[0], block[0])
            return {f"{stem}.weight": dequantize_fp8(codes8, scales8, weight.dtype)}
        scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"
        return {f"{stem}.weight": codes8, f"{stem}.{scale_name}": grid}
    codes, zeros, scales = quantize_rtn(weight, group_size, symmetric=method != "awq")
    if method == "w4a16":  # scales stored in the weight's dtype, as llm-compressor does
        scales = scales.to(weight.dtype)
    if dequantized:
        w = dequantize(pack_nibbles(codes), zeros, scales.float(), weight.dtype)
        return {f"{stem}.weight": w}
    if method == "w4a16":
        return {
            f"{stem}.weight_packed": pack_int32(codes, awq_order=False),
            f"{stem}.weight_scale": scales.contiguous(),
            f"{stem}.weight_shape": torch.tensor(weight.shape),
        }
    if method == "awq":
        return {
            f"{stem}.qweight": pack_int32(codes.t(), awq_order=True),
            f"{stem}.qzeros": pack_int32(zeros.t(), awq_order=True),
            f"{stem}.scales": scales.t().contiguous(),
        }
    return {
        f"{stem}.qweight": pack_int32(codes, awq_order=False).t().contiguous(),
        f"{stem}.qzeros": pack_int32((zeros - 1).t(), awq_order=False),
        f"{stem}.scales": scales.t().contiguous(),
        f"{stem}.g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // group_size,
    }


def _write(source: Path, target: Path, method: str, group_size: int, dequantized: bool) -> None:
    files = checkpoint_files(source)
    for item in source.iterdir():
        if item.is_file() and item not in files and item.name != INDEX_FILE:
            shutil.copy2(item, target / item.name)
    weight_map: dict[str, str] = {}
    targets: list[str] = []
    total_size = 0
    for file in files:
        tensors: dict[str, torch.Tensor] = {}
        with SafetensorsFile(file) as f:
            for name in f.keys():
                tensor = f.tensor(name).materialize()
                stem = name.removesuffix(".weight")
                quantized = is_decoder_projection(stem) or _EXPERT.search(stem) is not None
                if name.endswith(".weight") and tensor.dim() == 2 and quantized:
                    targets.append(stem)
                    tensors.update(
                        _quantized_tensors(stem, tensor, method, group_size, dequantized)
                    )
                else:
                    tensors[name] = tensor
        save_file(tensors, target / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
    if (source / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=1))
    if not dequantized:
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = _quantization_config(method, group_size, targets)
        (target / "config.json").write_text(json.dumps(config, indent=2))


def _quantization_config(method: str, group_size: int, targets: list[str]) -> dict[str, object]:
    """config.json's entry, as AutoAWQ (GEMM) / GPTQModel / Qwen's FP8 models / llm-compressor
    write it (``targets``: the quantized modules, which compressed-tensors names)."""
    if method in ("fp8-dynamic", "w4a16"):
        fp8 = method == "fp8-dynamic"
        weights = (
            {"num_bits": 8, "type": "float", "strategy": "channel"}
            if fp8
            else {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size}
        )
        fmt = "float-quantized" if fp8 else "pack-quantized"
        group = {
            "targets": sorted(targets),
            "format": fmt,
            "weights": {**weights, "symmetric": True, "dynamic": False},
        }
        if fp8:  # FP8_DYNAMIC: activations rounded to FP8 per token by vLLM's GPU kernels
            group["input_activations"] = {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            }
        return {"quant_method": "compressed-tensors", "format": fmt,
                "quantization_status": "compressed", "config_groups": {"group_0": group},
                "ignore": [], "kv_cache_scheme": None, "sparsity_config": {}}  # fmt: skip
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group_size, group_size]}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "version": "gemm", "zero_point": True}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
