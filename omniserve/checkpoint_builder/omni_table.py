"""Table rows for the omni models: Qwen2.5-Omni and Qwen3-Omni-MoE, as thinkers and full models.

A thinker row is a multimodal row with three towers' worth of inputs (vision, audio, text). The full
model row wraps the same thinker (same config, same weights for the same seed) with the smallest
talker and vocoder transformers accepts, so its checkpoint has the real "thinker.*", "talker.*",
"token2wav.*" / "code2wav.*" key layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omniserve.checkpoint_builder.specs import (
    QWEN2_5_OMNI_TOKENIZER,
    QWEN3_OMNI_TOKENIZER,
    ArchSpec,
    MultiModalSpec,
    ProcessorSpec,
    SpeechSpec,
    TowerSpec,
    frozen_mapping,
)


def _media_components(vision_unit: int) -> dict[str, tuple[str, Any]]:
    """Image, video and audio components; images get the VL rows' small limits.

    An image becomes 4..64 merged tokens of `vision_unit`² pixels. Each pair of video frames
    becomes 128..768: the omni processors pass these bounds to the video processor on every call
    (class-level `videos_kwargs`), so saving them keeps a direct video-processor call in agreement.
    Audio is binned like Whisper-large-v3 (128 mels) and padded or cut to 30 s.
    """
    return {
        "image_processor": ("Qwen2VLImageProcessor", frozen_mapping(dict(
            min_pixels=4 * vision_unit**2, max_pixels=64 * vision_unit**2,
        ))),
        "video_processor": ("Qwen2VLVideoProcessor", frozen_mapping(dict(
            min_pixels=128 * vision_unit**2, max_pixels=768 * vision_unit**2, fps=2.0, min_frames=2,
            max_frames=16, do_sample_frames=False, cap_pixels_per_frame=False,
        ))),
        "feature_extractor": ("WhisperFeatureExtractor", frozen_mapping(dict(
            feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400,
            padding_value=0.0, return_attention_mask=True,
        ))),
    }  # fmt: skip


# --- Qwen2.5-Omni (7B shapes: Qwen2.5-VL vision tower, Whisper-style audio tower, Qwen2 text) ----

_QWEN2_5_OMNI_VISION = TowerSpec(
    kwargs=dict(
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        hidden_act="silu",
    ),
    size_kwargs={
        "tiny": dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1],
            initializer_range=0.2,
        ),
        "bench": dict(
            depth=8, hidden_size=256, intermediate_size=704, num_heads=4,
            fullatt_block_indexes=[3, 7], initializer_range=0.07,
        ),
    },
    text_links={"out_hidden_size": "hidden_size"},
)  # fmt: skip
# Conv + attention in 2 * n_window = 200-frame (2 s) chunks as in the 7B model.
_QWEN2_5_OMNI_AUDIO = TowerSpec(
    kwargs=dict(num_mel_bins=128, max_source_positions=1500, n_window=100),
    size_kwargs={
        "tiny": dict(
            d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
            initializer_range=0.2,
        ),
        "bench": dict(
            d_model=256, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=1024,
            initializer_range=0.07,
        ),
    },
    text_links={"output_dim": "hidden_size"},
)  # fmt: skip

QWEN2_5_OMNI_THINKER = ArchSpec(
    "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniThinkerConfig",
    QWEN2_5_OMNI_TOKENIZER,
    config_kwargs=dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    multimodal=MultiModalSpec(
        towers={"vision_config": _QWEN2_5_OMNI_VISION, "audio_config": _QWEN2_5_OMNI_AUDIO},
        token_ids=frozen_mapping({
            "image_token_index": "<|IMAGE|>",
            "video_token_index": "<|VIDEO|>",
            "audio_token_index": "<|AUDIO|>",
            "vision_start_token_id": "<|vision_bos|>",
            "vision_end_token_id": "<|vision_eos|>",
            "audio_start_token_id": "<|audio_bos|>",
            "audio_end_token_id": "<|audio_eos|>",
            "user_token_id": "user",
        }),
        processor=ProcessorSpec("Qwen2_5OmniProcessor", frozen_mapping(_media_components(28))),
        outer_kwargs={
            "tie_word_embeddings": False, "position_id_per_seconds": 25, "seconds_per_chunk": 2,
        },
        mrope_section=(16, 24, 24),
        outer_text_links={"initializer_range": "initializer_range"},
    ),
)  # fmt: skip

# Talker (a Qwen2 decoder over 8448 codec ids) and token2wav (DiT + BigVGAN) at their smallest.
_QWEN2_5_OMNI_TALKER = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
    tts_codec_pad_token_id=120, tts_codec_start_token_id=121, tts_codec_end_token_id=122,
    tts_codec_mask_token_id=124,
    # Text-side tts markers live in the thinker's padded vocabulary rows (2018..2047), as the 7B's
    # 151859..151861 lie past its 151665-token tokenizer (the builder checks they are padding).
    tts_text_pad_token_id=2045, tts_text_start_token_id=2046, tts_text_end_token_id=2047,
    rope_parameters={
        "rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3],
    },
)  # fmt: skip
_QWEN2_5_OMNI_TOKEN2WAV = dict(
    dit_config=dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2,
        emb_dim=16, num_embeds=128, mel_dim=16, enc_emb_dim=16, enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8,
        look_ahead_layers=[1], look_backward_layers=[0],
    ),
    bigvgan_config=dict(
        mel_dim=16, upsample_initial_channel=64, resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
        upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
    ),
)  # fmt: skip

QWEN2_5_OMNI_FULL = dataclasses.replace(
    QWEN2_5_OMNI_THINKER,
    architecture="Qwen2_5OmniForConditionalGeneration",
    config_class="Qwen2_5OmniConfig",
    speech=SpeechSpec(
        thinker_architecture=QWEN2_5_OMNI_THINKER.architecture,
        submodels={
            "talker_config": {"tiny": _QWEN2_5_OMNI_TALKER, "bench": _QWEN2_5_OMNI_TALKER},
            "token2wav_config": {"tiny": _QWEN2_5_OMNI_TOKEN2WAV, "bench": _QWEN2_5_OMNI_TOKEN2WAV},
        },
        # The 7B's two voices; their bos ids sit in padded vocabulary rows like the tts markers.
        speakers={"Chelsie": 2043, "Ethan": 2044},
        thinker_links={
            "talker_config.embedding_size": "text_config.hidden_size",
            **{
                f"talker_config.{key}": key
                for key in (
                    "audio_token_index", "image_token_index", "video_token_index",
                    "vision_start_token_id", "vision_end_token_id", "audio_start_token_id",
                    "audio_end_token_id", "position_id_per_seconds", "seconds_per_chunk",
                )
            },
        },
    ),
)  # fmt: skip


# --- Qwen3-Omni-MoE (30B-A3B shapes: Qwen3-VL vision with DeepStack, chunked audio, MoE text) ----

# Qwen3-VL's vision tower, which Qwen3-Omni shares (the Qwen3-VL rows in table.py use it too).

QWEN3_VISION = TowerSpec(
    kwargs=dict(
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, hidden_act="gelu_pytorch_tanh",
    ),
    size_kwargs={
        # DeepStack taps layers 1..3 of 4 (the 30B taps 8, 16, 24 of 27): layer 0 is not tapped.
        "tiny": dict(
            depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
            deepstack_visual_indexes=[1, 2, 3], num_position_embeddings=256,
            initializer_range=0.2,
        ),
        "bench": dict(
            depth=8, hidden_size=256, intermediate_size=704, num_heads=4,
            deepstack_visual_indexes=[2, 4, 6], num_position_embeddings=2304,
            initializer_range=0.07,
        ),
    },
    text_links={"out_hidden_size": "hidden_size"},
)  # fmt: skip
# Conv in 2 * n_window = 100-frame blocks (13 tokens each), attention over n_window_infer = 800
# frames, conv batches of conv_chunksize blocks: the 30B model's values, so long audio takes the
# windowed path.
_QWEN3_OMNI_AUDIO = TowerSpec(
    kwargs=dict(
        num_mel_bins=128, max_source_positions=1500, n_window=50, n_window_infer=800,
        conv_chunksize=500,
    ),
    size_kwargs={
        "tiny": dict(
            d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
            downsample_hidden_size=16, initializer_range=0.2,
        ),
        "bench": dict(
            d_model=256, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=1024,
            downsample_hidden_size=64, initializer_range=0.07,
        ),
    },
    text_links={"output_dim": "hidden_size"},
)  # fmt: skip

QWEN3_OMNI_THINKER = ArchSpec(
    "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerConfig",
    QWEN3_OMNI_TOKENIZER,
    # Routing as in the 30B (renormalised top-k, every layer sparse); interleaved M-RoPE.
    config_kwargs=dict(
        rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0, "interleaved": True,
            "mrope_interleaved": True,
        },
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    size_kwargs={
        "tiny": dict(head_dim=32, moe_intermediate_size=32),
        "bench": dict(head_dim=128, moe_intermediate_size=256),
    },
    multimodal=MultiModalSpec(
        towers={"vision_config": QWEN3_VISION, "audio_config": _QWEN3_OMNI_AUDIO},
        token_ids=frozen_mapping({
            "image_token_id": "<|image_pad|>",
            "video_token_id": "<|video_pad|>",
            "audio_token_id": "<|audio_pad|>",
            "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>",
            "audio_start_token_id": "<|audio_start|>",
            "audio_end_token_id": "<|audio_end|>",
            "user_token_id": "user",
        }),
        processor=ProcessorSpec("Qwen3OmniMoeProcessor", frozen_mapping(_media_components(32))),
        # 13 position ids per second, as the 30B config and Qwen3OmniMoeProcessor's default.
        outer_kwargs={
            "tie_word_embeddings": False, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
        },
        mrope_section=(24, 20, 20),
        outer_text_links={"initializer_range": "initializer_range"},
    ),
)  # fmt: skip

# Talker: a small MoE decoder over codec ids plus a code predictor; code2wav: the codec decoder.
# As in the 30B, the talker's vocabulary is the 64-code codebook (the 30B: 2048) followed by 1024
# control ids: full-model generate suppresses the last 1024 ids but codec_eos, so it must be so.
_QWEN3_OMNI_TALKER = dict(
    text_config=dict(
        vocab_size=64 + 1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        initializer_range=0.2,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0, "interleaved": True,
            "mrope_section": [3, 3, 2],
        },
    ),
    code_predictor_config=dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_code_groups=4,
        max_position_embeddings=2048,
    ),
    num_code_groups=4, accept_hidden_layer=1, codec_pad_id=164, codec_bos_id=165,
    codec_eos_token_id=166, codec_nothink_id=171, codec_think_bos_id=172, codec_think_eos_id=173,
    speaker_id={"ethan": 300, "chelsie": 301},
)  # fmt: skip
_QWEN3_OMNI_CODE2WAV = dict(
    codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
    intermediate_size=64, num_hidden_layers=1, num_quantizers=4, upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2], decoder_dim=32, sliding_window=72, max_position_embeddings=8000,
)  # fmt: skip

# Bench size: the 30B's codebook (2048 codes, 16 groups) and control ids, a 2-layer MoE talker, a
# 2-layer code predictor and a 2-layer code2wav, so the speech stages cost what they do relative
# to each other in the real model (the predictor runs 15 passes per frame).
_QWEN3_OMNI_TALKER_BENCH = dict(
    text_config=dict(
        vocab_size=2048 + 1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=512,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0, "interleaved": True,
            "mrope_section": [12, 10, 10],
        },
    ),
    code_predictor_config=dict(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_code_groups=16,
        max_position_embeddings=8192,
    ),
    num_code_groups=16, accept_hidden_layer=1, codec_pad_id=2148, codec_bos_id=2149,
    codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156,
    codec_think_eos_id=2157, speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
)  # fmt: skip
_QWEN3_OMNI_CODE2WAV_BENCH = dict(
    codebook_size=2048, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=512, num_hidden_layers=2, num_quantizers=16, upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2], decoder_dim=256, sliding_window=72, max_position_embeddings=8000,
)  # fmt: skip

QWEN3_OMNI_FULL = dataclasses.replace(
    QWEN3_OMNI_THINKER,
    architecture="Qwen3OmniMoeForConditionalGeneration",
    config_class="Qwen3OmniMoeConfig",
    speech=SpeechSpec(
        thinker_architecture=QWEN3_OMNI_THINKER.architecture,
        submodels={
            "talker_config": {"tiny": _QWEN3_OMNI_TALKER, "bench": _QWEN3_OMNI_TALKER_BENCH},
            "code2wav_config": {"tiny": _QWEN3_OMNI_CODE2WAV,
                                "bench": _QWEN3_OMNI_CODE2WAV_BENCH},
        },
        token_ids=frozen_mapping({
            "im_start_token_id": "<|im_start|>",
            "im_end_token_id": "<|im_end|>",
            "tts_pad_token_id": "<|tts_pad|>",
            "tts_bos_token_id": "<|tts_text_bos|>",
            "tts_eos_token_id": "<|tts_text_eod|>",
            "system_token_id": "system",
            "user_token_id": "user",
            "assistant_token_id": "assistant",
        }),
        thinker_links={
            "talker_config.thinker_hidden_size": "text_config.hidden_size",
            "talker_config.spatial_merge_size": "vision_config.spatial_merge_size",
            **{
                f"talker_config.{key}": key
                for key in (
                    "audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
                    "audio_start_token_id", "position_id_per_seconds",
                )
            },
        },
    ),
)  # fmt: skip

OMNI_ARCH_SPECS: tuple[ArchSpec, ...] = (
    QWEN2_5_OMNI_THINKER, QWEN3_OMNI_THINKER, QWEN2_5_OMNI_FULL, QWEN3_OMNI_FULL,
)  # fmt: skip
