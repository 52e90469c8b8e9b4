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
    """"awq", "gptq" or "pack-quantized" (compressed-tensors; the checkpoint's 4-bit packing), or
    "fp8" (e4m3 weights, in Qwen's format or compressed-tensors')."""
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
    symmetric: bool = False
    """pack-quantized: no zero points are stored (every one is 8)."""

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
        """llm-compressor's format, for its weight schemes omniserve runs: FP8 (``FP8_DYNAMIC``:
        a scale per output feature; ``FP8_BLOCK``: per block; per tensor), whose activations are
        quantized on the fly or not at all (e4m3 ``weight`` and its ``weight_scale``), and 4-bit
        integers in groups (``W4A16``, ``pack-quantized``: ``weight_packed``, ``weight_scale``,
        ``weight_zero_point`` when asymmetric). Which layers are quantized is read from the
        tensors, not from ``targets`` and ``ignore``; every group must use one scheme. A
        ``kv_cache_scheme`` of static 8-bit floats per tensor stores each layer's ``k_scale`` and
        ``v_scale``, which ``--kv-cache-dtype fp8`` applies (``model_loader.kv_scales_taken``)."""
        kv = config.get("kv_cache_scheme")
        static_fp8 = kv and kv.get("num_bits") == 8 and kv.get("type") == "float"
        if kv and not (static_fp8 and kv.get("strategy", "tensor") == "tensor"
                       and not kv.get("dynamic")):  # fmt: skip
            raise ValueError(f"compressed-tensors checkpoint with kv_cache_scheme {kv}: omniserve "
                             "reads static fp8 KV-cache scales per tensor only.")  # fmt: skip
        for key, what in (("sparsity_config", "sparse weights"),
                          ("transform_config", "weight transforms")):  # fmt: skip
            if config.get(key):
                raise ValueError(
                    f"compressed-tensors checkpoint with {key} ({what}): not supported."
                )
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors checkpoint without config_groups.")
        schemes = {
            _compressed_tensors_scheme(name, group, group.get("format") or config.get("format"))
            for name, group in groups.items()
        }
        if len(schemes) > 1:
            raise ValueError(
                f"compressed-tensors groups with different schemes {sorted(map(str, schemes))}: "
                "omniserve reads one scheme per checkpoint."
            )
        return schemes.pop()


def _block_size(value: Any, what: str) -> tuple[int, int]:
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(b, int) and b > 0 for b in value)
    ):
        raise ValueError(f"{what}={value!r}: need [rows, cols].")
    return value[0], value[1]


def _compressed_tensors_scheme(name: str, group: dict[str, Any], fmt: Any) -> QuantizationConfig:
    """One compressed-tensors config group's scheme (see ``_compressed_tensors``)."""
    fmt = str(fmt or "").lower()
    weights = group.get("weights") or {}
    kind = (weights.get("type"), weights.get("num_bits"))
    what = f"compressed-tensors group {name!r}"
    if kind not in (("float", 8), ("int", 4)):
        raise ValueError(
            f"{what} has {kind[0]} {kind[1]}-bit weights ({fmt}): omniserve reads FP8 weights "
            "(FP8_DYNAMIC, FP8_BLOCK, FP8) and 4-bit integer ones (W4A16) only."
        )
    if group.get("output_activations"):
        raise ValueError(f"{what} quantizes outputs: not supported.")
    if weights.get("actorder"):
        raise ValueError(f"{what} has act-order weights (actorder): not supported.")
    strategy = str(weights.get("strategy")).lower()
    inputs = group.get("input_activations")
    if kind == ("int", 4):
        if fmt != "pack-quantized":
            raise ValueError(f"{what}: 4-bit weights in format {fmt!r}, not pack-quantized.")
        if inputs:
            raise ValueError(f"{what} quantizes activations (W4A8): omniserve runs W4A16 only.")
        group_size = weights.get("group_size")
        if strategy != "group" or not isinstance(group_size, int) or group_size % 32:
            raise ValueError(
                f"{what}: 4-bit weights with strategy {strategy!r} and group_size "
                f"{group_size!r}: omniserve runs groups of a multiple of 32 features."
            )
        return QuantizationConfig(
            "pack-quantized", group_size, symmetric=bool(weights.get("symmetric", True))
        )
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{what}: FP8 weights in format {fmt!r}, not float-quantized.")
    if inputs and not inputs.get("dynamic"):
        raise ValueError(
            f"{what} quantizes activations with static scales: not supported (dynamic ones "
            "are, as unquantized activations)."
        )
    if not weights.get("symmetric", True):
        raise ValueError(f"{what}: asymmetric FP8 weights are not supported.")
    if strategy == "block":
        rows, cols = _block_size(weights.get("block_structure"), f"{what} with block_structure")
        return QuantizationConfig("fp8", cols, rows, scale_name="weight_scale")
    if strategy in ("channel", "tensor"):
        row_block = 1 if strategy == "channel" else 0
        return QuantizationConfig("fp8", 0, row_block, scale_name="weight_scale")
    raise ValueError(
        f"{what}: FP8 weights with strategy {strategy!r} are not supported (channel, block, "
        "tensor are)."
    )
