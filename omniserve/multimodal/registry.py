"""MULTIMODAL_REGISTRY: a model class carries its processor, so registering a model registers
its multimodal processing too (vllm-v1-notes §3.6).

    @MULTIMODAL_REGISTRY.register_processor(Qwen2VLMultiModalProcessor,
                                            info=Qwen2VLProcessingInfo,
                                            dummy_inputs=Qwen2VLDummyInputsBuilder)
    class Qwen2VLForConditionalGeneration(nn.Module): ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from omniserve.config import ModelConfig
from omniserve.multimodal.cache import ProcessorCache
from omniserve.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    InputProcessingContext,
)

_T = TypeVar("_T", bound=type)

_FACTORY_ATTR = "_processor_factory"


@dataclass(frozen=True)
class ProcessorFactories:
    info: type[BaseProcessingInfo]
    dummy_inputs: type[BaseDummyInputsBuilder]
    processor: type[BaseMultiModalProcessor]


class MultiModalRegistry:
    def register_processor(
        self,
        processor_cls: type[BaseMultiModalProcessor],
        *,
        info: type[BaseProcessingInfo],
        dummy_inputs: type[BaseDummyInputsBuilder],
    ) -> Callable[[_T], _T]:
        """Class decorator for a model class: attach its processor, info and dummy builder."""

        def wrapper(model_cls: _T) -> _T:
            setattr(model_cls, _FACTORY_ATTR, ProcessorFactories(info, dummy_inputs, processor_cls))
            return model_cls

        return wrapper

    @staticmethod
    def factories_of_model(model_cls: type) -> ProcessorFactories | None:
        """What ``register_processor`` attached to ``model_cls`` (or a base class), if any."""
        return getattr(model_cls, _FACTORY_ATTR, None)

    @staticmethod
    def factories_of_processor(processor_cls: type[BaseMultiModalProcessor]) -> ProcessorFactories:
        """A processor registered on its own (``omniserve register-model --processor``) names
        its companions in the class attributes ``info_cls`` and ``dummy_inputs_cls``."""
        return ProcessorFactories(
            processor_cls.info_cls,  # type: ignore[attr-defined]
            processor_cls.dummy_inputs_cls,  # type: ignore[attr-defined]
            processor_cls,
        )

    def get_factories(self, model_config: ModelConfig) -> ProcessorFactories | None:
        """The model's processor classes, or None for a text-only architecture. A processor
        registered with the architecture wins over the one attached to the model class."""
        from omniserve.plugins import load_plugins
        from omniserve.registry import ModelRegistry

        load_plugins()
        processor_cls = ModelRegistry.resolve_processor_cls(model_config.architecture)
        if processor_cls is not None:
            return self.factories_of_processor(processor_cls)
        model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
        return self.factories_of_model(model_cls)

    def supports_multimodal(self, model_config: ModelConfig) -> bool:
        return self.get_factories(model_config) is not None

    def create_processor(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        *,
        cache: ProcessorCache | None = None,
        limit_mm_per_prompt: Mapping[str, int] | None = None,
        profile_sizes: Mapping[str, Mapping[str, int]] | None = None,
        mm_processor_kwargs: Mapping[str, object] | None = None,
        enable_mm_embeds: bool = False,
        max_audio_seconds: float | None = None,
        video_pruning_rate: float = 0.0,
    ) -> BaseMultiModalProcessor | None:
        """The model's multimodal processor (None for text-only architectures).

        ``limit_mm_per_prompt`` (with ``profile_sizes``, its object form's sizes) and
        ``mm_processor_kwargs`` are ``--limit-mm-per-prompt`` and ``--mm-processor-kwargs``
        (defaults for every request), ``video_pruning_rate`` ``--video-pruning-rate``.
        """
        factories = self.get_factories(model_config)
        if factories is None:
            return None
        ctx = InputProcessingContext(
            model_config,
            tokenizer,
            mm_processor_kwargs=mm_processor_kwargs,
            limit_mm_per_prompt=limit_mm_per_prompt,
            profile_sizes=profile_sizes,
            enable_mm_embeds=enable_mm_embeds,
            max_audio_seconds=max_audio_seconds,
            video_pruning_rate=video_pruning_rate,
        )
        info = factories.info(ctx)
        return factories.processor(info, factories.dummy_inputs(info), cache=cache)


MULTIMODAL_REGISTRY = MultiModalRegistry()
