"""Qwen2-Audio: Whisper log-mel features, one ``<|AUDIO|>`` expanded per clip.

Each clip is padded to the feature extractor's 30 s window (``padding="max_length"``, as
``Qwen2AudioProcessor`` does), so a clip's features never depend on the other clips in the batch
and can be cached per item. The token count comes from the valid mel frames through the
encoder's two stride-2 stages, with the exact formula of the HF processor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omniserve.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from omniserve.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    MultiModalFieldConfig,
    PromptReplacement,
    PromptUpdate,
)


def get_audio_num_tokens(num_mel_frames: int) -> int:
    """Audio-encoder outputs for ``num_mel_frames`` valid frames (conv stride 2, then pool 2)."""
    return (((num_mel_frames - 1) // 2 + 1) - 2) // 2 + 1


class Qwen2AudioProcessingInfo(BaseProcessingInfo):
    model_bound_kwargs = frozenset({"feature_size", "sampling_rate", "hop_length", "n_fft"})

    def get_feature_extractor(self) -> Any:
        return self.get_hf_processor().feature_extractor

    def get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(
            target_sr=self.get_feature_extractor().sampling_rate,
            max_audio_seconds=self.max_audio_seconds,
        )

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": None}

    def get_audio_window_seconds(self) -> float | None:
        extractor = self.get_feature_extractor()
        return extractor.n_samples / extractor.sampling_rate

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        # Longer clips are truncated to the extractor's window.
        return {"audio": get_audio_num_tokens(self.get_feature_extractor().nb_max_frames)}


class Qwen2AudioDummyInputsBuilder(BaseDummyInputsBuilder):
    info: Qwen2AudioProcessingInfo

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        hf_processor = self.info.get_hf_processor()
        placeholder = (
            f"{hf_processor.audio_bos_token}{hf_processor.audio_token}"
            f"{hf_processor.audio_eos_token}"
        )
        return placeholder * mm_counts.get("audio", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> dict[str, Any]:
        extractor = self.info.get_feature_extractor()
        return {
            "audio": self._get_dummy_audios(
                extractor.n_samples, extractor.sampling_rate, mm_counts.get("audio", 0)
            )
        }


class Qwen2AudioMultiModalProcessor(BaseMultiModalProcessor):
    info: Qwen2AudioProcessingInfo

    def _call_hf_processor(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, Any]:
        # Qwen2AudioProcessor cannot run without text, so call its feature extractor the way
        # its `_process_audio` does: same merged audio kwargs, same forced padding and mask.
        hf_processor = self.info.get_hf_processor()
        extractor = hf_processor.feature_extractor
        audio_kwargs = hf_processor._merge_kwargs(
            tokenizer_init_kwargs=hf_processor.tokenizer.init_kwargs, **mm_kwargs
        )["audio_kwargs"]
        audio_kwargs.update(
            return_attention_mask=True,
            padding="max_length",
            sampling_rate=extractor.sampling_rate,
            return_tensors="pt",
        )
        outputs = dict(extractor(mm_data["audio"], **audio_kwargs))
        outputs["feature_attention_mask"] = outputs.pop("attention_mask")
        return outputs

    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {
            "input_features": MultiModalFieldConfig.batched("audio"),  # [1, num_mels, frames]
            "feature_attention_mask": MultiModalFieldConfig.batched("audio"),  # [1, frames]
        }

    def _embeds_fields(self, modality: str, embeds: dict[str, Any]) -> dict[str, Any]:
        """Audio embeddings (the projected encoder output): one placeholder token per row."""
        if modality != "audio":
            return super()._embeds_fields(modality, embeds)
        return {"audio_embeds": embeds["audio_embeds"]}

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        hf_processor = self.info.get_hf_processor()
        token_id = hf_processor.audio_token_id

        def replacement(i: int) -> list[int]:
            data = out_items["audio"][i]
            if "audio_embeds" in data:  # precomputed: one placeholder per row
                return [token_id] * data["audio_embeds"].shape[0]
            num_frames = int(data["feature_attention_mask"].sum())
            return [token_id] * get_audio_num_tokens(num_frames)

        return [PromptReplacement("audio", hf_processor.audio_token, replacement)]
