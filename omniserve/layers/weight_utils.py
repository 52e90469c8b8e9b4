"""Checked name-to-parameter weight loading.

A model routes each checkpoint key to ``(parameter name, shard args)``; the parameter's own
``weight_loader(param, tensor, *shard_args)`` (set by the layer that owns it) writes the tensor into
the right slice of this rank's partition. A fused parameter (q/k/v, gate/up, stacked experts)
declares the shard args it expects in ``param.shard_ids`` and counts as loaded only once every
shard has arrived, so a half-loaded fused weight is reported as missing.

Weights arrive as ``torch.Tensor``s or as ``LazyTensor``s (the checkpoint reader's): loaders only
read ``shape`` and call ``narrow``, so a tensor-parallel rank reads just its own slice from disk;
a replicated parameter calls ``materialize`` for the whole tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

WeightRoute = tuple[str, tuple[Any, ...]]
"""(parameter name, extra arguments for the parameter's weight_loader)."""

StackedParams = tuple[tuple[str, str, Any], ...]
"""(fused module, checkpoint module, shard id) triples, e.g. ("qkv_proj", "q_proj", "q")."""


class LazyTensor:
    """A checkpoint tensor that is read only when (and as far as) a loader asks for it.

    ``source`` is a safetensors ``safe_open`` handle; ``narrow`` reads one slice through
    ``get_slice``, ``materialize`` the whole tensor through ``get_tensor``.
    """

    def __init__(self, source: Any, name: str) -> None:
        self._source = source
        self._name = name
        self.shape = torch.Size(source.get_slice(name).get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if start == 0 and length == self.shape[dim]:
            return self.materialize()  # one rank: the whole tensor, read as before
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._source.get_slice(self._name)[index]

    def materialize(self) -> torch.Tensor:
        return self._source.get_tensor(self._name)


LoadedWeight = torch.Tensor | LazyTensor
"""What a ``weight_loader`` receives."""


def materialize(loaded: LoadedWeight) -> torch.Tensor:
    return loaded.materialize() if isinstance(loaded, LazyTensor) else loaded


def default_weight_loader(param: torch.Tensor, loaded_weight: LoadedWeight) -> None:
    """Copy a whole, unsharded tensor (casting to the parameter's dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
            f"{tuple(loaded_weight.shape)}."
        )
    param.data.copy_(materialize(loaded_weight))


def set_weight_loader(
    param: nn.Parameter, loader: Callable[..., None], shard_ids: set[tuple[Any, ...]] | None = None
) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]
    if shard_ids is not None:
        param.shard_ids = shard_ids  # type: ignore[attr-defined]


def route_stacked(name: str, stacked: StackedParams) -> WeightRoute:
    """Map ``...q_proj.weight`` to ``(...qkv_proj.weight, ("q",))``; other names pass through."""
    dotted = f".{name}"  # so a module at the top level matches as well
    for fused, ckpt, shard_id in stacked:
        part = f".{ckpt}."
        if part in dotted:
            return dotted.replace(part, f".{fused}.", 1)[1:], (shard_id,)
    return name, ()


def load_weights_by_route(
    module: nn.Module,
    weights: Iterable[tuple[str, LoadedWeight]],
    route: Callable[[str], WeightRoute | None],
) -> set[str]:
    """Load every routed tensor; return the names of fully loaded parameters.

    ``route`` returns None for keys the model deliberately ignores. Keys that route to no
    parameter are collected and raised together as one ValueError naming them.
    """
    params = dict(module.named_parameters())
    shards_seen: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        target = route(ckpt_name)
        if target is None:
            continue
        param_name, shard_args = target
        param = params.get(param_name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, *shard_args)
        except ValueError as e:
            raise ValueError(
                f"Cannot load checkpoint tensor {ckpt_name!r} into {param_name!r}: {e}"
            ) from e
        shards_seen[param_name].add(shard_args)
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else "")
        raise ValueError(
            f"{len(unexpected)} checkpoint tensor(s) match no parameter of "
            f"{type(module).__name__}: {shown}"
        )
    return {
        name
        for name, seen in shards_seen.items()
        if seen >= getattr(params[name], "shard_ids", {()})
    }
