"""Build a multimodal checkpoint's Hugging Face processor offline, from its classes.

The processor's geometry comes from the model config, not the table: patch, temporal patch and
merge sizes from `vision_config`, mel bins from `audio_config`. A config override (say
`vision_config.patch_size`) then can never leave a processor that disagrees with the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omniserve.checkpoint_builder.specs import ProcessorSpec

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase, ProcessorMixin


def build_hf_processor(
    spec: ProcessorSpec,
    tokenizer: PreTrainedTokenizerBase,
    config: PreTrainedConfig,
) -> ProcessorMixin:
    """The processor with its media components, the tokenizer and the tokenizer's chat template."""
    import transformers

    components = {
        name: getattr(transformers, class_name)(**{**kwargs, **_linked_kwargs(name, config)})
        for name, (class_name, kwargs) in spec.components.items()
    }
    processor_cls = getattr(transformers, spec.processor_class)
    return processor_cls(tokenizer=tokenizer, chat_template=tokenizer.chat_template, **components)


def _linked_kwargs(component: str, config: PreTrainedConfig) -> dict[str, Any]:
    """Component kwargs that must equal the model's: how pixels are cut and mels are binned."""
    if component in ("image_processor", "video_processor"):
        vision = config.vision_config
        return {
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
        }
    if component == "feature_extractor":
        return {"feature_size": config.audio_config.num_mel_bins}
    return {}
