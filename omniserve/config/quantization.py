"""What a quantized checkpoint's ``quantization_config`` says, checked for what omniserve runs
(4-bit AWQ and GPTQ; the tensors' side is ``layers/quantization.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}
"""``--quantization`` values (vLLM's names) -> the checkpoint format they read; the Marlin names
are vLLM's GPU kernels for the same checkpoints."""


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's ``quantization_config`` (config.json), checked for what omniserve runs."""

    method: str
    """"awq" or "gptq": the checkpoint's packing."""
    group_size: int
    gptq_v1_zeros: bool = True
    """GPTQ's original format stores each zero point minus one (``checkpoint_format`` "gptq")."""

    @staticmethod
    def from_hf(config: dict[str, Any], requested: str | None = None) -> QuantizationConfig:
        """Parse ``quantization_config``; ``requested`` is ``--quantization``, which must name
        the checkpoint's method (or its Marlin alias). ValueError says what is unsupported."""
        method = str(config.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(
                f"The checkpoint's quantization_config has quant_method {method!r}; omniserve "
                "runs 4-bit AWQ and GPTQ checkpoints only."
            )
        if requested is not None and QUANTIZATION_METHODS.get(requested) != method:
            raise ValueError(
                f"--quantization {requested} does not match the checkpoint's quant_method "
                f"{method!r} (use --quantization {method}, or leave it out)."
            )
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
