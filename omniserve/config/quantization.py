"""What a quantized checkpoint's ``quantization_config`` says, checked for what omniserve runs
(4-bit AWQ and GPTQ, block-scaled FP8; the tensors' side is ``layers/quantization.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                        "fp8": "fp8"}  # fmt: skip
"""``--quantization`` values (vLLM's names) -> the checkpoint format they read; the Marlin names
are vLLM's GPU kernels for the same checkpoints."""


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's ``quantization_config`` (config.json), checked for what omniserve runs."""

    method: str
    """"awq" or "gptq" (the checkpoint's 4-bit packing), or "fp8" (e4m3 weights)."""
    group_size: int
    """Input features per scale."""
    row_block: int = 1
    """Output features per scale (FP8's ``weight_block_size[0]``; 4-bit scales are per row)."""
    gptq_v1_zeros: bool = True
    """GPTQ's original format stores each zero point minus one (``checkpoint_format`` "gptq")."""

    @staticmethod
    def from_hf(config: dict[str, Any], requested: str | None = None) -> QuantizationConfig:
        """Parse ``quantization_config``; ``requested`` is ``--quantization``, which must name
        the checkpoint's method (or its Marlin alias). ValueError says what is unsupported."""
        method = str(config.get("quant_method", "")).lower()
        if method not in ("awq", "gptq", "fp8"):
            raise ValueError(
                f"The checkpoint's quantization_config has quant_method {method!r}; omniserve "
                "runs 4-bit AWQ and GPTQ and block-scaled FP8 checkpoints only."
            )
        if requested is not None and QUANTIZATION_METHODS.get(requested) != method:
            raise ValueError(
                f"--quantization {requested} does not match the checkpoint's quant_method "
                f"{method!r} (use --quantization {method}, or leave it out)."
            )
        if method == "fp8":
            return QuantizationConfig._fp8(config)
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        if bits != 4:
            raise ValueError(f"{method} checkpoint with bits={bits}: omniserve runs 4-bit only.")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
            raise ValueError(
                f"{method} checkpoint with group_size={group_size}: omniserve needs a positive "
                "even group size (a per-channel group_size of -1 is not supported)."
            )
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r}: omniserve reads the GEMM packing only.")
            if not config.get("zero_point", True):
                raise ValueError("AWQ without zero points: omniserve reads zero_point=true only.")
            return QuantizationConfig("awq", group_size)
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: omniserve reads gptq and gptq_v2.")
        return QuantizationConfig("gptq", group_size, gptq_v1_zeros=fmt == "gptq")

    @staticmethod
    def _fp8(config: dict[str, Any]) -> QuantizationConfig:
        """The fine-grained FP8 format Qwen and DeepSeek publish (``Qwen3-*-FP8``): e4m3 weights
        with one fp32 / bf16 ``weight_scale_inv`` per ``weight_block_size`` block, activations
        left unquantized ("dynamic": quantized on the fly by GPU FP8 kernels, which omniserve
        does not use)."""
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint with fmt={fmt!r}: omniserve reads e4m3 weights only.")
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise ValueError(
                f"FP8 checkpoint with activation_scheme={scheme!r}: omniserve reads dynamic "
                "ones only (static input scales are not applied)."
            )
        if str(config.get("scale_fmt", "float")).lower() not in ("float", "float32"):
            raise ValueError(
                f"FP8 checkpoint with scale_fmt={config['scale_fmt']!r}: omniserve reads "
                "floating-point weight scales only."
            )
        block = config.get("weight_block_size")
        if block is None:
            raise ValueError(
                "FP8 checkpoint without weight_block_size (one scale per tensor): omniserve "
                "reads block-scaled FP8 only."
            )
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(f"FP8 checkpoint with weight_block_size={block!r}: need [rows, cols].")
        return QuantizationConfig("fp8", group_size=block[1], row_block=block[0])
