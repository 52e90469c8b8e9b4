"""What a quantized checkpoint's ``quantization_config`` says, checked for what omniserve runs
(4-bit AWQ and GPTQ; FP8 weights, block-scaled as Qwen publishes them or in llm-compressor's
compressed-tensors format; the tensors' side is ``layers/quantization.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                        "fp8": "fp8", "compressed-tensors": "compressed-tensors"}  # fmt: skip
"""``--quantization`` values (vLLM's names) -> the checkpoint format they read; the Marlin names
are vLLM's GPU kernels for the same checkpoints."""


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's ``quantization_config`` (config.json), checked for what omniserve runs."""

    method: str
    """"awq" or "gptq" (the checkpoint's 4-bit packing), or "fp8" (e4m3 weights)."""
    group_size: int
    """Input features per scale (FP8: 0 for all of them)."""
    row_block: int = 1
    """Output features per scale (FP8's ``weight_block_size[0]``, 0 for all of them; 4-bit scales
    are per row)."""
    scale_name: str = "weight_scale_inv"
    """The name of an FP8 matrix's scales beside its ``weight`` (compressed-tensors:
    ``weight_scale``)."""
    gptq_v1_zeros: bool = True
    """GPTQ's original format stores each zero point minus one (``checkpoint_format`` "gptq")."""

    @staticmethod
    def from_hf(config: dict[str, Any], requested: str | None = None) -> QuantizationConfig:
        """Parse ``quantization_config``; ``requested`` is ``--quantization``, which must name
        the checkpoint's method (or its Marlin alias). ValueError says what is unsupported."""
        method = str(config.get("quant_method", "")).lower()
        if method not in ("awq", "gptq", "fp8", "compressed-tensors"):
            raise ValueError(
                f"The checkpoint's quantization_config has quant_method {method!r}; omniserve "
                "runs 4-bit AWQ and GPTQ, FP8 and compressed-tensors FP8 checkpoints only."
            )
        if requested is not None and QUANTIZATION_METHODS.get(requested) != method:
            raise ValueError(
                f"--quantization {requested} does not match the checkpoint's quant_method "
                f"{method!r} (use --quantization {method}, or leave it out)."
            )
        if method == "fp8":
            return QuantizationConfig._fp8(config)
        if method == "compressed-tensors":
            return QuantizationConfig._compressed_tensors(config)
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

    def block(self, rows: int, cols: int) -> tuple[int, int]:
        """(output, input) features per scale of a ``[rows, cols]`` matrix."""
        return self.row_block or rows, self.group_size or cols

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
        rows, cols = _block_size(block, "FP8 checkpoint with weight_block_size")
        return QuantizationConfig("fp8", group_size=cols, row_block=rows)

    @staticmethod
    def _compressed_tensors(config: dict[str, Any]) -> QuantizationConfig:
        """llm-compressor's format, for its FP8 weight schemes (``FP8_DYNAMIC``: a scale per
        output feature; ``FP8_BLOCK``: per block; per tensor), whose activations are quantized
        on the fly or not at all: e4m3 ``weight`` and its ``weight_scale``. Which layers are
        quantized is read from the tensors, not from ``targets`` and ``ignore``."""
        for key, what in (("kv_cache_scheme", "a quantized KV cache"),
                          ("sparsity_config", "sparse weights"),
                          ("transform_config", "weight transforms")):  # fmt: skip
            if config.get(key):
                raise ValueError(
                    f"compressed-tensors checkpoint with {key} ({what}): not supported."
                )
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors checkpoint without config_groups.")
        blocks = set()
        for name, group in groups.items():
            fmt = str(group.get("format") or config.get("format") or "").lower()
            weights = group.get("weights") or {}
            kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights"
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(
                    f"compressed-tensors group {name!r} has {kind} ({fmt}): omniserve reads FP8 "
                    "weights only (llm-compressor's FP8_DYNAMIC, FP8_BLOCK, FP8 schemes)."
                )
            if fmt not in ("float-quantized", "naive-quantized"):
                raise ValueError(f"compressed-tensors group {name!r} in format {fmt!r}: "
                                 "omniserve reads float-quantized FP8.")  # fmt: skip
            inputs = group.get("input_activations")
            if inputs and not inputs.get("dynamic"):
                raise ValueError(
                    f"compressed-tensors group {name!r} quantizes activations with static "
                    "scales: not supported (dynamic ones are, as unquantized activations)."
                )
            if group.get("output_activations"):
                raise ValueError(f"compressed-tensors group {name!r} quantizes outputs.")
            if not weights.get("symmetric", True) or weights.get("actorder"):
                raise ValueError(f"compressed-tensors group {name!r}: asymmetric or act-order "
                                 "FP8 weights are not supported.")  # fmt: skip
            strategy = str(weights.get("strategy")).lower()
            if strategy == "block":
                structure = weights.get("block_structure")
                blocks.add(_block_size(structure, f"compressed-tensors group {name!r} with "
                                                  "block_structure"))  # fmt: skip
            elif strategy in ("channel", "tensor"):
                blocks.add((1 if strategy == "channel" else 0, 0))
            else:
                raise ValueError(
                    f"compressed-tensors group {name!r}: FP8 weights with strategy "
                    f"{strategy!r} are not supported (channel, block, tensor are)."
                )
        if len(blocks) > 1:
            raise ValueError(
                f"compressed-tensors groups with different FP8 scales {sorted(blocks)}: "
                "omniserve reads one scheme per checkpoint."
            )
        ((row_block, group_size),) = blocks
        return QuantizationConfig("fp8", group_size, row_block, scale_name="weight_scale")


def _block_size(value: Any, what: str) -> tuple[int, int]:
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(b, int) and b > 0 for b in value)
    ):
        raise ValueError(f"{what}={value!r}: need [rows, cols].")
    return value[0], value[1]
