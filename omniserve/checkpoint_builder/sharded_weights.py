"""Random weights for a model too big to materialise, streamed into sharded safetensors.

The tensors to write come from a meta-device instance of the transformers class, passed through
the same steps `save_pretrained` takes (drop tied copies, revert the load-time conversions such as
fused MoE experts), so names and shapes match what transformers would save. Each tensor is drawn
on its own, from a generator seeded by the build seed and the tensor's saved name, so the bytes
do not depend on the order or sharding (and two models sharing a tensor's name and shape share
its values); peak memory is one tensor.

How a tensor is drawn follows transformers' default `_init_weights`, by the module owning it:
  * a normalisation layer (LayerNorm, RMSNorm, GroupNorm): weight ones, bias zeros;
  * any other tensor with two or more dims (linear, conv, embedding, router, experts):
    normal(0, initializer_range), the range of the nearest sub-model's config, as
    transformers takes it (a vision tower uses vision_config's);
  * any other 1-D tensor (biases): zeros.
Persistent buffers are refused: none of the builder's architectures saves one (they hold rotary
tables and offsets as non-persistent buffers), and a random draw would corrupt a computed value.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

INDEX_FILE = "model.safetensors.index.json"
Init = Literal["normal", "ones", "zeros"]
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor as `save_pretrained` would name and shape it, and how to draw it."""

    name: str
    shape: tuple[int, ...]
    init: Init
    std: float
    num_rows_kept: int | None = None
    """For the embedding and lm_head: rows from this index on (ids the tokenizer lacks) are
    zeroed, as the tiny builder does."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan_tensors(model: PreTrainedModel, num_tokens: int) -> list[TensorPlan]:
    """The tensors `model.save_pretrained` would write, in its order, for a meta-device model."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    embeddings = _embedding_keys(model)
    plans: dict[str, TensorPlan] = {}
    for key, tensor in state.items():
        if key not in parameters:
            raise ValueError(f"{key} is a persistent buffer; the builder has no rule to fill it")
        init, std = _init_rule(model, key, tensor.ndim)
        kept_rows = num_tokens if key in embeddings else None
        # Reverting one tensor at a time tells which saved tensors each parameter becomes.
        for name, saved in revert_weight_conversion(model, {key: tensor}).items():
            plans[name] = TensorPlan(name, tuple(saved.shape), init, std, kept_rows)
    saved_names = list(revert_weight_conversion(model, state))
    if set(saved_names) != set(plans):
        raise RuntimeError("save_pretrained's conversion does not map tensors one by one")
    return [plans[name] for name in saved_names]


def _init_rule(model: PreTrainedModel, key: str, ndim: int) -> tuple[Init, float]:
    import torch

    module_name, _, param_name = key.rpartition(".")
    module = model.get_submodule(module_name)
    kind = type(module).__name__
    if isinstance(module, torch.nn.GroupNorm) or "LayerNorm" in kind or "RMSNorm" in kind:
        return ("ones" if param_name == "weight" else "zeros"), 0.0
    if ndim >= 2:
        return "normal", _initializer_range(model, module_name)
    return "zeros", 0.0


def _initializer_range(model: PreTrainedModel, module_name: str) -> float:
    """The range transformers' init uses: that of the innermost sub-model owning the module."""
    from transformers import PreTrainedModel

    parts = module_name.split(".")
    for depth in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        if isinstance(owner, PreTrainedModel):
            return getattr(owner.config, "initializer_range", None) or 0.02
    raise AssertionError("unreachable: the model itself is a PreTrainedModel")


def _embedding_keys(model: PreTrainedModel) -> set[str]:
    modules = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return {
        f"{name}.weight"
        for name, module in model.named_modules(remove_duplicate=False)
        if id(module) in modules
    }


def write_shards(
    path: Path, plans: list[TensorPlan], *, dtype: torch.dtype, seed: int, max_shard_bytes: int
) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors files and their index."""
    itemsize = dtype.itemsize
    shards: list[list[TensorPlan]] = [[]]
    shard_bytes = 0
    for plan in plans:  # a tensor that does not fit starts the next shard, as in transformers
        num_bytes = plan.numel * itemsize
        if shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(plan)
        shard_bytes += num_bytes
    if len(shards) == 1:
        _write_safetensors(path / "model.safetensors", shards[0], dtype, seed)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(path / file_name, shard, dtype, seed)
        weight_map.update(dict.fromkeys((plan.name for plan in shard), file_name))
    total_parameters = sum(plan.numel for plan in plans)
    index = {
        "metadata": {
            "total_parameters": total_parameters,
            "total_size": total_parameters * itemsize,
        },
        "weight_map": weight_map,
    }
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_safetensors(file: Path, plans: list[TensorPlan], dtype: torch.dtype, seed: int) -> None:
    """One safetensors file, written tensor by tensor (the header lists the offsets up front)."""
    import torch

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in plans:
        end = offset + plan.numel * dtype.itemsize
        header[plan.name] = {
            "dtype": _SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")],
            "shape": list(plan.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    with file.open("wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for plan in plans:
            tensor = draw_tensor(plan, dtype, seed)
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def draw_tensor(plan: TensorPlan, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The tensor's values: a function of the build seed, its name and its plan only."""
    import torch

    if plan.init == "ones":
        return torch.ones(plan.shape, dtype=dtype)
    if plan.init == "zeros":
        return torch.zeros(plan.shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}/{plan.name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    # normal_ draws bf16 directly on CPU, as fast as fp32 and without a second copy.
    tensor = torch.empty(plan.shape, dtype=dtype).normal_(0.0, plan.std, generator=generator)
    if plan.num_rows_kept is not None:
        tensor[plan.num_rows_kept :] = 0  # [vocab_size - num_tokens, hidden_size]
    return tensor
