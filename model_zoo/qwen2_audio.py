"""Qwen2-Audio: transformers' Whisper-style audio encoder and projector, our Qwen2 decoder.

Every item's log-mel features are padded to the encoder's fixed window (30 s); its
``feature_attention_mask`` says how many frames are real. Items of a call are stacked into one
encoder batch with the key-padding mask transformers builds, so padding never leaks into an
item's embeddings; an item then keeps the first ``output_length`` pooled frames (two stride-2
reductions of its real frame count), one per expanded ``<|AUDIO|>`` token. Positions are 1-D.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.qwen2_audio.modeling_qwen2_audio import (
    Qwen2AudioEncoder,
    Qwen2AudioMultiModalProjector,
)

from model_zoo.multimodal import MultiModalDecoderBase, on_device
from model_zoo.qwen2 import Qwen2ForCausalLM
from model_zoo.towers import adopt_tower
from omniserve.multimodal.inputs import host_data
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen2_audio import (
    Qwen2AudioDummyInputsBuilder,
    Qwen2AudioMultiModalProcessor,
    Qwen2AudioProcessingInfo,
)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2AudioMultiModalProcessor,
    info=Qwen2AudioProcessingInfo,
    dummy_inputs=Qwen2AudioDummyInputsBuilder,
)
class Qwen2AudioForConditionalGeneration(MultiModalDecoderBase):
    text_family = Qwen2ForCausalLM
    tower_modalities = {"audio_tower": ("audio",), "multi_modal_projector": ("audio",)}
    # hub layout (language model nested) and transformers' module names -> ours
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.audio_tower = adopt_tower(Qwen2AudioEncoder(config.audio_config))
        self.multi_modal_projector = adopt_tower(Qwen2AudioMultiModalProjector(config))

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str:
        """What Qwen2-Audio's chat template renders for the i-th audio (one pad token)."""
        if modality != "audio":
            raise ValueError(f"{cls.__name__} takes audio inputs, not {modality!r}.")
        return f"Audio {i + 1}: <|audio_bos|><|AUDIO|><|audio_eos|>"

    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        if modality != "audio":
            raise ValueError(f"{type(self).__name__} encodes audio, not {modality!r}.")
        features = [item["input_features"] for item in items]
        num_frames = {f.shape[-1] for f in features}
        if len(num_frames) != 1:
            raise ValueError(
                f"Audio items have feature lengths {sorted(num_frames)}; all must be "
                "padded to the encoder window."
            )
        (num_frames,) = num_frames
        # [num_items, num_mel_bins, num_frames]
        input_features = torch.cat([f.reshape(-1, *f.shape[-2:]) for f in features])
        feature_mask = torch.cat(
            [host_data(item)["feature_attention_mask"].reshape(-1, num_frames) for item in items]
        )  # [num_items, num_frames], on the host: lengths are read without waiting for the device
        tower = self.audio_tower
        conv_lengths, output_lengths = tower._get_feat_extract_output_lengths(feature_mask.sum(-1))
        max_conv_length = (num_frames - 2) // 2 + 1
        frame_ids = torch.arange(max_conv_length)
        valid = (frame_ids[None, :] < conv_lengths[:, None]).long()  # [num_items, max_conv_len]
        dtype = self.model.embed_tokens.activation_dtype
        attention_mask = create_bidirectional_mask(  # on the host too (it tests the mask's values)
            config=tower.config,
            inputs_embeds=torch.zeros(len(items), max_conv_length, 1, dtype=dtype),
            attention_mask=valid,
        )
        if attention_mask is not None:  # None: no padding to mask
            attention_mask = on_device(input_features.device, mask=attention_mask)["mask"]
        hidden = tower(input_features, attention_mask=attention_mask).last_hidden_state
        embeds = self.multi_modal_projector(hidden)  # [num_items, max_conv_len // 2, hidden]
        return [embeds[i, :n] for i, n in enumerate(output_lengths.tolist())]
