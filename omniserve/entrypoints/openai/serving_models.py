"""The names a request's ``model`` may take: the served model's, and its LoRA adapters'.

Adapters come from ``--default-mm-loras`` (named after their modality, as in vLLM) and
``--lora-modules`` at start-up and, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
set (vLLM's switch), from ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. Each load
gets a new id, so a name loaded again with other weights never shares prefix-cache blocks with
the old ones.
"""

from __future__ import annotations

import itertools
from http import HTTPStatus

import msgspec

from omniserve.engine.async_llm import AsyncLLM
from omniserve.entrypoints.openai.protocol import ModelCard
from omniserve.entrypoints.openai.serving_engine import ServingError
from omniserve.lora.request import LoRARequest


class OpenAIServingModels:
    """Resolves request ``model`` names and lists them (``/v1/models``)."""

    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.loras: dict[str, LoRARequest] = {
            name: msgspec.structs.replace(lora, base_model_name=self.model_name)
            for name, lora in engine.default_mm_loras.items()
        }
        self._loading: set[str] = set()
        self._ids = itertools.count(len(self.loras) + 1)

    @property
    def model_name(self) -> str:
        return self.base_names[0]

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` picks (None: the base model); 404 for an unknown name."""
        if name is None or name in self.base_names:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise ServingError(
                f"The model `{name}` does not exist.",
                HTTPStatus.NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return lora

    def response_name(self, name: str | None) -> str:
        """The ``model`` a response reports: the adapter's name, else the served model's."""
        return name if name is not None and name in self.loras else self.model_name

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Read an adapter into the engine under ``name`` (400: taken, or it does not load)."""
        if name in self.loras or name in self.base_names or name in self._loading:
            raise ServingError(f"The lora adapter '{name}' has already been loaded.",
                               param="lora_name")  # fmt: skip
        if base_model_name is not None and base_model_name not in self.base_names:
            raise ServingError(f"base_model_name {base_model_name!r} is not a served model.")
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.model_name)
        self._loading.add(name)  # a second load of the name meanwhile is refused
        try:
            await self.engine.add_lora(lora)
        except ValueError as exc:
            raise ServingError(str(exc), param="lora_path") from exc
        finally:
            self._loading.discard(name)
        self.loras[name] = lora

    async def unload(self, name: str) -> None:
        lora = self.loras.pop(name, None)
        if lora is None:
            raise ServingError(f"The lora adapter '{name}' cannot be found.",
                               HTTPStatus.NOT_FOUND, param="lora_name")  # fmt: skip
        await self.engine.remove_lora(lora.lora_int_id)

    def card(self, name: str, max_model_len: int, default_sampling: dict[str, float]) -> ModelCard:
        """``name``'s card (``GET /v1/models/{model}``, the SDK's ``models.retrieve``); 404 for
        an unknown name."""
        self.resolve(name)
        cards = self.cards(max_model_len, default_sampling)
        return next(card for card in cards if card.id == name)

    def cards(self, max_model_len: int, default_sampling: dict[str, float]) -> list[ModelCard]:
        root = self.engine.model_config.model
        base = [
            ModelCard(id=name, root=root, max_model_len=max_model_len,
                      default_sampling_params=default_sampling)
            for name in self.base_names
        ]  # fmt: skip
        adapters = [
            ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name,
                      max_model_len=max_model_len, default_sampling_params=default_sampling)
            for lora in self.loras.values()
        ]  # fmt: skip
        return base + adapters
