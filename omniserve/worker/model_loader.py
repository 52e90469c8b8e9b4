"""Load a local Hugging Face safetensors checkpoint into a model, checking the mapping both ways.

Shards are read one after another and tensors one at a time, each straight into the parameter it
fills (``weight_utils.SafetensorsFile``): peak host memory is the model's own parameters plus at
most one staged tensor, never a second copy of the checkpoint, and no memory map whose resident
pages would count against the process. A tensor-parallel rank reads only the slice its layer
keeps. The model's ``load_weights`` routes every key (raising on keys it cannot place); this
module then raises on parameters that nothing filled.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from omniserve.attention import Attention
from omniserve.config import QuantizationConfig
from omniserve.layers.quantization import quantized_weights
from omniserve.layers.quantized_loading import QuantizedModel, dequantize_at_load
from omniserve.layers.weight_utils import LazyTensor, LoadedWeight, SafetensorsFile, materialize

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the sharded index's files, or model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"No {SINGLE_FILE} or {INDEX_FILE} in {model_dir}; omniserve loads "
        "safetensors checkpoints only."
    )


def checkpoint_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor's (shape, stored dtype), read from the shard headers alone."""
    shapes = {}
    for path in checkpoint_files(model_dir):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                tensor = f.tensor(name)
                shapes[name] = (tensor.shape, tensor.dtype)
    return shapes


def iterate_checkpoint_weights(
    model_dir: str | Path, progress_bar: bool = True
) -> Iterator[tuple[str, LazyTensor]]:
    """Yield ``(name, lazy tensor)`` for every checkpoint tensor, shard by shard, with a progress
    bar over the bytes (on a terminal, unless not ``progress_bar``) and one log line per shard; a
    tensor is readable until the next one is yielded."""
    files = checkpoint_files(model_dir)
    total = sum(path.stat().st_size for path in files)
    start = time.perf_counter()
    with tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True,
              disable=None if progress_bar else True) as bar:  # fmt: skip
        for i, path in enumerate(files, 1):
            with SafetensorsFile(path) as f:
                for name in f.keys():
                    tensor = f.tensor(name)
                    yield name, tensor
                    bar.update(tensor.shape.numel() * tensor.dtype.itemsize)
            logger.info(
                "Loaded shard %d/%d (%s, %.2f GiB) after %.1f s",
                i, len(files), path.name, path.stat().st_size / (1 << 30),
                time.perf_counter() - start,
            )  # fmt: skip


_KV_SCALE = re.compile(r"(.+\.self_attn)\.(?:([kv])_scale|([kv])_proj\.output_scale)")
"""llm-compressor's KV-cache scales (``self_attn.k_scale``; older: ``k_proj.output_scale``)."""


def kv_scales_taken(
    weights: Iterator[tuple[str, LoadedWeight]], model: nn.Module
) -> Iterator[tuple[str, LoadedWeight]]:
    """``weights`` without the checkpoint's KV-cache scales, each set on the ``Attention``
    layer of its ``self_attn`` (``kv_scales``, which an fp8 cache applies) instead of loaded as a
    parameter. A scale whose layer cannot be found, or that is not a positive finite number, is
    a ValueError naming it."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    rename = getattr(model, "checkpoint_to_param_name", lambda name: name)
    for name, tensor in weights:
        match = _KV_SCALE.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        owner = rename(match.group(1).removeprefix("thinker."))
        layer = layers.get(f"{owner}.attn")
        value = materialize(tensor).float().reshape(-1)
        if layer is None or value.numel() != 1 or not 0 < float(value[0]) < math.inf:
            what = "matches no attention layer" if layer is None else f"is {value.tolist()}"
            raise ValueError(f"KV-cache scale {name!r} {what}: expected one positive number "
                             f"per attention layer.")  # fmt: skip
        index = 0 if (match.group(2) or match.group(3)) == "k" else 1
        scales = list(layer.kv_scales)
        scales[index] = float(value[0])
        layer.kv_scales = (scales[0], scales[1])


def load_model_weights(
    model: nn.Module,
    model_dir: str | Path,
    quantization: QuantizationConfig | None = None,
    quantized: QuantizedModel | None = None,
    progress_bar: bool = True,
) -> None:
    """Fill every parameter of ``model`` from the checkpoint; ValueError names what did not match.
    ``quantized``: what ``layers.quantized_loading.quantize_layers`` made of the model, whose
    quantized matrices outside the linear layers are gathered as they are read. ``progress_bar``:
    one over the bytes read (on a terminal).

    Tied embeddings need nothing here: a tied ``lm_head.weight`` is the embedding's parameter, so
    it is filled through ``embed_tokens`` and the model skips an ``lm_head`` key if one is stored.
    """
    if not hasattr(model, "load_weights"):
        raise TypeError(f"{type(model).__name__} has no load_weights(weights) method.")
    weights: Iterator[tuple[str, LoadedWeight]] = kv_scales_taken(
        iterate_checkpoint_weights(model_dir, progress_bar), model
    )
    if quantization is not None:
        weights = quantized_weights(weights, quantization)
        if quantized is not None and quantized.matrices:
            weights = dequantize_at_load(weights, quantized.matrices, quantization, quantized.kept)
    with torch.no_grad():
        loaded = model.load_weights(weights)
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise ValueError(
            f"{len(missing)} parameter(s) of {type(model).__name__} were not (fully) "
            f"loaded from {model_dir}: {shown}"
        )
