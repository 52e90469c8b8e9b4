"""Load a local Hugging Face safetensors checkpoint into a model, checking the mapping both ways.

Tensors are read lazily one at a time (``safe_open``), so peak host memory is one tensor rather
than the checkpoint; each arrives as a ``LazyTensor``, so a tensor-parallel rank reads only the
slice its layer keeps (no full copy per rank). The model's ``load_weights`` routes every key
(raising on keys it cannot place); this module then raises on parameters that nothing filled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from omniserve.layers.weight_utils import LazyTensor

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


def iterate_checkpoint_weights(model_dir: str | Path) -> Iterator[tuple[str, LazyTensor]]:
    """Yield ``(name, lazy tensor)`` for every checkpoint tensor, with a progress bar; a tensor is
    readable (on the CPU) until the next one is yielded."""
    files = checkpoint_files(model_dir)
    num_tensors = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            num_tensors += len(f.keys())
    with tqdm(total=num_tensors, desc="Loading weights", unit="tensor", disable=None) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, LazyTensor(f, name)
                    bar.update(1)


def load_model_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint; ValueError names what did not match.

    Tied embeddings need nothing here: a tied ``lm_head.weight`` is the embedding's parameter, so
    it is filled through ``embed_tokens`` and the model skips an ``lm_head`` key if one is stored.
    """
    if not hasattr(model, "load_weights"):
        raise TypeError(f"{type(model).__name__} has no load_weights(weights) method.")
    with torch.no_grad():
        loaded = model.load_weights(iterate_checkpoint_weights(model_dir))
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise ValueError(
            f"{len(missing)} parameter(s) of {type(model).__name__} were not (fully) "
            f"loaded from {model_dir}: {shown}"
        )
