"""vLLM's ``--compilation-config`` and ``-O`` optimization levels, read for what they mean here.

omniserve runs no ``torch.compile``: its speed comes from its own kernels and, on CUDA, from decode
steps replayed as whole CUDA graphs. So of vLLM's compilation settings the CUDA-graph ones take
effect (``cudagraph_mode`` NONE or ``-O0``: no graphs; ``cudagraph_capture_sizes`` /
``max_cudagraph_capture_size``: the captured batch sizes) and the ``torch.compile`` ones (``mode``,
``level``, ``backend``, passes, caches, ...) are logged as changing nothing; a key vLLM does not
have either is an error naming it, as vLLM's own check makes it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
"""vLLM's ``cudagraph_mode`` values; every one but NONE captures omniserve's decode graphs."""
_PARTIAL_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")
_TORCH_COMPILE_KEYS = frozenset({
    "mode", "level", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "pass_config", "cache_dir", "debug_dump_path",
    "compile_cache_save_format", "use_inductor_graph_partition", "compile_mm_encoder",
    "dynamic_shapes_config", "local_cache_dir", "compile_ranges_split_points",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "cudagraph_specialize_lora",
    "full_cuda_graph", "static_forward_context", "traced_files", "enabled_custom_ops",
    "disabled_custom_ops",
})  # fmt: skip
"""vLLM's keys that tune ``torch.compile`` (or graphs in ways omniserve's decode graphs always
are, ``full_cuda_graph``): accepted, logged as changing nothing."""
_GRAPH_KEYS = ("cudagraph_mode", "use_cudagraph", "cudagraph_capture_sizes",
               "max_cudagraph_capture_size")  # fmt: skip
OPTIMIZATION_LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class GraphSettings:
    """What vLLM's compilation settings say of the decode graphs (None: nothing)."""

    eager: bool = False
    """No decode graphs (``cudagraph_mode`` NONE, ``use_cudagraph`` false, ``-O0``)."""
    sizes: tuple[int, ...] | None = None
    """The captured batch sizes (``cudagraph_capture_sizes``)."""
    max_size: int | None = None
    """The ladder's top (``max_cudagraph_capture_size``)."""


def read_compilation_config(
    value: dict[str, Any] | str | int | None, optimization_level: int | None = None
) -> GraphSettings:
    """``--compilation-config`` (a JSON object, or a bare ``torch.compile`` mode) and
    ``-O``/``--optimization-level`` -> the decode graphs' settings; a ValueError names a key
    or value vLLM does not take."""
    if optimization_level is not None and optimization_level not in OPTIMIZATION_LEVELS:
        raise ValueError(f"-O/--optimization-level must be 0-3, not {optimization_level!r}.")
    config = _as_dict(value)
    unknown = sorted(set(config) - _TORCH_COMPILE_KEYS - set(_GRAPH_KEYS))
    if unknown:
        known = ", ".join(sorted({*_GRAPH_KEYS, *_TORCH_COMPILE_KEYS}))
        raise ValueError(f"--compilation-config: unknown key(s) {', '.join(unknown)} (vLLM's "
                         f"keys: {known}).")  # fmt: skip
    if ignored := sorted(set(config) & _TORCH_COMPILE_KEYS):
        logger.info("--compilation-config %s: no effect here (no torch.compile runs; decode "
                    "steps replay whole CUDA graphs).", ", ".join(ignored))  # fmt: skip
    if optimization_level:
        logger.info("-O%d: no effect here beyond the default (decode graphs on; -O0 turns them "
                    "off).", optimization_level)  # fmt: skip
    mode = config.get("cudagraph_mode", "FULL_DECODE_ONLY")
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"--compilation-config cudagraph_mode must be one of "
                         f"{', '.join(CUDAGRAPH_MODES)}, not {mode!r}.")  # fmt: skip
    if mode in _PARTIAL_MODES:
        logger.info("--compilation-config cudagraph_mode %s: decode steps replay whole graphs, "
                    "prefill runs eagerly (no piecewise graphs here).", mode)  # fmt: skip
    use_graphs = config.get("use_cudagraph", True)
    if not isinstance(use_graphs, bool):
        raise ValueError(f"--compilation-config use_cudagraph must be true or false, not "
                         f"{use_graphs!r}.")  # fmt: skip
    sizes = config.get("cudagraph_capture_sizes")
    if sizes is not None and not (
        isinstance(sizes, list) and all(_is_size(s) for s in sizes) and sizes
    ):
        raise ValueError(f"--compilation-config cudagraph_capture_sizes must be a list of batch "
                         f"sizes >= 1, not {sizes!r}.")  # fmt: skip
    top = config.get("max_cudagraph_capture_size")
    if top is not None and not _is_size(top):
        raise ValueError(f"--compilation-config max_cudagraph_capture_size must be a batch size "
                         f">= 1, not {top!r}.")  # fmt: skip
    return GraphSettings(
        eager=mode == "NONE" or not use_graphs or optimization_level == 0,
        sizes=None if sizes is None else tuple(sorted(set(sizes))),
        max_size=top,
    )


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _as_dict(value: dict[str, Any] | str | int | None) -> dict[str, Any]:
    """The settings as a dict: vLLM's bare number (``--compilation-config 3``) is a mode."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return {"mode": int(text)}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--compilation-config is not JSON: {exc}.") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"mode": value}
    if not isinstance(value, dict):
        raise ValueError(f"--compilation-config must be a JSON object, not {value!r}.")
    return value
