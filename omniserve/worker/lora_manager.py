"""The worker's LoRA adapters: the decoder layers' slots, adapters read into host memory (LRU),
which adapter each slot holds, and each step's mapping of tokens to slots."""

from __future__ import annotations

import collections
import logging

import numpy as np
import torch
from torch import nn

from omniserve.config import LoRAConfig
from omniserve.cpu.lora import MAX_ROWS as CPU_LORA_MAX_ROWS
from omniserve.cpu.lora import CpuLoRA
from omniserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from omniserve.layers.lora import LoRAMapping, LoRASlots
from omniserve.lora.adapter import read_adapter
from omniserve.lora.request import LoRARequest
from omniserve.transfers import upload

logger = logging.getLogger(__name__)

_DECODER_LAYERS = "model.layers."
"""Adapters apply to the language model's layers (not the media towers nor the talker)."""


HostAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Layer name -> its slot's host copy, for the layers an adapter adapts."""


class LoRAManager:
    """The model's adapted layers, adapters read into host memory (LRU), and which adapter
    each device slot holds."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if name.startswith(_DECODER_LAYERS) and isinstance(
                module, (ColumnParallelLinear, RowParallelLinear)
            ):
                module.lora = self.layers[name] = LoRASlots(module, config, dtype, device)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no layers LoRA adapters can adapt.")
        if device.type == "cpu":  # decode-sized products in one C call per layer
            kernel = CpuLoRA(dtype)
            for slots in self.layers.values():
                if CpuLoRA.supports(slots.a, slots.bt):
                    slots.kernel = kernel
        self.host: collections.OrderedDict[int, tuple[LoRARequest, HostAdapter]] = (
            collections.OrderedDict()
        )
        self.max_host = config.max_cpu_loras or config.max_loras
        self.slot_ids: list[int | None] = [None] * config.max_loras

    def kernels(self) -> dict[str, int]:
        """How many adapted layers compute their products where (for ``get_model_info``)."""
        with_kernel = sum(slots.kernel is not None for slots in self.layers.values())
        label = f"C kernel up to {CPU_LORA_MAX_ROWS} rows"
        return {label: with_kernel, "torch": len(self.layers) - with_kernel}

    @property
    def slot_bytes(self) -> int:
        return sum(s.a.nbytes + s.bt.nbytes for s in self.layers.values())

    def add(self, lora: LoRARequest) -> None:
        """Read and place ``lora`` (ValueError when it does not fit this model), keeping it."""
        cached = self.host.get(lora.lora_int_id)
        if cached is not None and cached[0] == lora:
            self.host.move_to_end(lora.lora_int_id)
            return
        placed = self._place(lora)
        self.remove(lora.lora_int_id)
        self.host[lora.lora_int_id] = (lora, placed)
        while len(self.host) > self.max_host:
            self.host.popitem(last=False)

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (its slot, if any, is refilled before it is used again)."""
        self.host.pop(lora_int_id, None)
        self.slot_ids = [None if i == lora_int_id else i for i in self.slot_ids]

    def _place(self, lora: LoRARequest) -> HostAdapter:
        placed: HostAdapter = {}
        for module, pair in read_adapter(lora, self.config.max_lora_rank).items():
            route = self.model.route_weight(f"{module}.weight")
            name = route[0].removesuffix(".weight") if route is not None else ""
            slots = self.layers.get(name)
            if slots is None or route is None or not route[0].endswith(".weight"):
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r} adapts {module}, which omniserve does "
                    "not: adapters apply to the language model's attention and MLP "
                    "projections (not the media towers, the MoE experts or the head)."
                )
            if name not in placed:
                placed[name] = slots.empty()
            try:
                slots.place(*placed[name], pair, tuple(route[1]))
            except ValueError as exc:
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r} does not fit this model at {module}: {exc}"
                ) from exc
        return placed

    def prepare(
        self, loras: list[LoRARequest | None], query_lens: np.ndarray
    ) -> LoRAMapping | None:
        """The step's mapping for requests with ``loras`` computing ``query_lens`` tokens each
        (in step order), with their adapters in slots; None when no token has one."""
        ids = np.array([lora.lora_int_id if lora else 0 for lora in loras], np.int64)
        if not ids.any():
            return None
        token_ids = np.repeat(ids, query_lens)
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        slots = [self._slot_for(lora, set(wanted)) for lora in wanted.values()]
        rows = [np.flatnonzero(token_ids == lora_id) for lora_id in wanted]
        if len(rows) == 1 and rows[0].size == token_ids.size:  # every token, one adapter
            return LoRAMapping([(slots[0], None)])
        return LoRAMapping(list(zip(slots, upload(self.device, rows), strict=True)))

    def _slot_for(self, lora: LoRARequest, wanted: set[int]) -> int:
        if lora.lora_int_id in self.slot_ids:
            return self.slot_ids.index(lora.lora_int_id)
        free = [i for i, held in enumerate(self.slot_ids) if held is None or held not in wanted]
        if not free:
            raise RuntimeError(
                f"More adapters in one step than --max-loras {len(self.slot_ids)} slots."
            )
        slot = free[0]
        self.add(lora)  # read again if it left host memory
        _, placed = self.host[lora.lora_int_id]
        for name, slots in self.layers.items():
            slots.load(slot, placed.get(name))
        self.slot_ids[slot] = lora.lora_int_id
        logger.debug("LoRA adapter %r in slot %d", lora.lora_name, slot)
        return slot
