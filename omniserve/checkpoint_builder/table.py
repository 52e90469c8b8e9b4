"""The one table of architectures the tiny-checkpoint builder knows; adding one is adding a row.

Multimodal rows reuse the Qwen tokenizer family, whose special tokens already carry the
vision/audio markers. The omni rows live in omni_table.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from omniserve.checkpoint_builder.omni_table import OMNI_ARCH_SPECS, QWEN3_VISION
from omniserve.checkpoint_builder.specs import (
    LLAMA3_TOKENIZER,
    QWEN2_AUDIO_TOKENIZER,
    QWEN3_TOKENIZER,
    QWEN3_VL_TOKENIZER,
    QWEN_TOKENIZER,
    ArchSpec,
    MultiModalSpec,
    ProcessorSpec,
    TowerSpec,
    frozen_mapping,
)

_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}

# An image becomes 4..64 merged tokens (28x28 pixels each) and each pair of video frames 4..16, so
# multimodal tests stay fast (real checkpoints: 4..16384). Callers pass size={...} for larger media.
_QWEN_VL_PROCESSOR_COMPONENTS = frozen_mapping({
    "image_processor": ("Qwen2VLImageProcessor", frozen_mapping(dict(
        min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28,
    ))),
    # Frames are taken as given (do_sample_frames=False, as in the real checkpoints); fps and the
    # frame bounds apply when a caller asks for sampling. No whole-video pixel cap, as before v5.22.
    "video_processor": ("Qwen2VLVideoProcessor", frozen_mapping(dict(
        min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28, fps=2.0, min_frames=2, max_frames=16,
        do_sample_frames=False, cap_pixels_per_frame=False,
    ))),
})  # fmt: skip
# Qwen3-VL's processors at the same small limits, in 32-pixel units (16-pixel patches, 2x2
# merge). Its video processor bounds the whole video's pixels (all frames together), not a
# frame's: 8..256 merged tokens per video.
_QWEN3_VL_PROCESSOR_COMPONENTS = frozen_mapping({
    "image_processor": ("Qwen2VLImageProcessor", frozen_mapping(dict(
        min_pixels=4 * 32 * 32, max_pixels=64 * 32 * 32, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ))),
    "video_processor": ("Qwen3VLVideoProcessor", frozen_mapping(dict(
        size={"shortest_edge": 16 * 32 * 32, "longest_edge": 512 * 32 * 32}, fps=2.0,
        min_frames=2, max_frames=16, do_sample_frames=False, cap_pixels_per_frame=False,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ))),
})  # fmt: skip
_QWEN_VL_TOKEN_IDS = frozen_mapping({
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
})  # fmt: skip
_QWEN3_VL_TEXT = frozen_mapping(dict(
    rope_parameters={**_QWEN_ROPE, "mrope_interleaved": True}, attention_bias=False,
))  # fmt: skip
# Qwen3-VL's multimodal part (the dense 2B/4B tie their embeddings; the MoE rows do not).
_QWEN3_VL_MM = MultiModalSpec(
    towers={"vision_config": QWEN3_VISION},
    token_ids=_QWEN_VL_TOKEN_IDS,
    processor=ProcessorSpec("Qwen3VLProcessor", _QWEN3_VL_PROCESSOR_COMPONENTS),
    outer_kwargs=frozen_mapping({"tie_word_embeddings": True}),
    mrope_section=(24, 20, 20),
)
# Media towers use a larger init than transformers' 0.02 (scaled by 1/sqrt(width) like the text
# part's): with 0.02 the encoders are near-linear and every audio gives the same first tokens. With
# these, six different images (or audios) gave six different 8-token greedy continuations.
_QWEN2_VL_VISION = TowerSpec(
    kwargs=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=4),
    size_kwargs={
        "tiny": dict(depth=2, embed_dim=32, num_heads=2, initializer_range=0.2),
        "bench": dict(depth=8, embed_dim=256, num_heads=4, initializer_range=0.07),
    },
    text_links={"hidden_size": "hidden_size"},
)  # fmt: skip
# Window attention as in Qwen2.5-VL-7B: 112-pixel windows (4x4 merged tokens), full attention in
# the last block of each group; the tiny size has one windowed and one full block.
_QWEN2_5_VL_VISION = TowerSpec(
    kwargs=dict(
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        tokens_per_second=2,
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
_QWEN2_AUDIO_ENCODER = TowerSpec(
    # 128 mel bins and 1500 positions (30 s) as in Qwen2-Audio-7B; the projector maps to the text.
    kwargs=dict(num_mel_bins=128, max_source_positions=1500, activation_function="gelu"),
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
)  # fmt: skip
_QWEN2_AUDIO_PROCESSOR = ProcessorSpec(
    "Qwen2AudioProcessor",
    frozen_mapping({
        "feature_extractor": ("WhisperFeatureExtractor", frozen_mapping(dict(
            feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400,
            padding_value=0.0, return_attention_mask=True,
        ))),
    }),
)  # fmt: skip

ARCH_SPECS: Mapping[str, ArchSpec] = frozen_mapping({
    spec.architecture: spec
    for spec in (
        ArchSpec(
            "Qwen2ForCausalLM", "Qwen2Config", QWEN_TOKENIZER,
            # Tied like Qwen2.5-0.5B, so the tied-embedding path is covered by tests.
            config_kwargs=dict(tie_word_embeddings=True, rope_parameters=_QWEN_ROPE),
        ),
        ArchSpec(
            "Qwen3ForCausalLM", "Qwen3Config", QWEN3_TOKENIZER,
            config_kwargs=dict(tie_word_embeddings=False, rope_parameters=_QWEN_ROPE),
            # head_dim != hidden_size / num_heads, as in the real Qwen3 models.
            size_kwargs={"tiny": dict(head_dim=32), "bench": dict(head_dim=128)},
        ),
        ArchSpec(
            "LlamaForCausalLM", "LlamaConfig", LLAMA3_TOKENIZER,
            config_kwargs=dict(
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
            ),
        ),
        ArchSpec(
            "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_TOKENIZER,
            # Routing as in Qwen3-30B-A3B (renormalised top-k, every layer sparse).
            config_kwargs=dict(
                tie_word_embeddings=False, rope_parameters=_QWEN_ROPE, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
            size_kwargs={
                "tiny": dict(head_dim=32, moe_intermediate_size=32),
                "bench": dict(head_dim=128, moe_intermediate_size=256),
            },
        ),
        ArchSpec(
            "Qwen2VLForConditionalGeneration", "Qwen2VLConfig", QWEN_TOKENIZER,
            config_kwargs=dict(rope_parameters=_QWEN_ROPE),
            multimodal=MultiModalSpec(
                towers={"vision_config": _QWEN2_VL_VISION},
                token_ids=_QWEN_VL_TOKEN_IDS,
                processor=ProcessorSpec("Qwen2VLProcessor", _QWEN_VL_PROCESSOR_COMPONENTS),
                outer_kwargs={"tie_word_embeddings": False},
                mrope_section=(16, 24, 24),
            ),
        ),
        ArchSpec(
            "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", QWEN_TOKENIZER,
            config_kwargs=dict(rope_parameters=_QWEN_ROPE),
            multimodal=MultiModalSpec(
                towers={"vision_config": _QWEN2_5_VL_VISION},
                token_ids=_QWEN_VL_TOKEN_IDS,
                processor=ProcessorSpec("Qwen2_5_VLProcessor", _QWEN_VL_PROCESSOR_COMPONENTS),
                outer_kwargs={"tie_word_embeddings": False},
                mrope_section=(16, 24, 24),
            ),
        ),
        ArchSpec(
            "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", QWEN3_VL_TOKENIZER,
            # Qwen3-VL-2B/4B/8B: a Qwen3 text part with interleaved M-RoPE, tied in the 2B/4B.
            config_kwargs=_QWEN3_VL_TEXT,
            size_kwargs={"tiny": dict(head_dim=32), "bench": dict(head_dim=128)},
            multimodal=_QWEN3_VL_MM,
        ),
        ArchSpec(
            "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", QWEN3_VL_TOKENIZER,
            # Qwen3-VL-30B-A3B's routing (renormalised top-k, every layer sparse); its experts
            # are one fused tensor per projection. 2 * moe_intermediate_size != hidden_size, so
            # a transposed layout cannot pass for the right one.
            config_kwargs=dict(
                _QWEN3_VL_TEXT, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
            size_kwargs={
                "tiny": dict(head_dim=32, moe_intermediate_size=48),
                "bench": dict(head_dim=128, moe_intermediate_size=256),
            },
            multimodal=dataclasses.replace(
                _QWEN3_VL_MM, outer_kwargs=frozen_mapping({"tie_word_embeddings": False})
            ),
        ),
        ArchSpec(
            "Qwen2AudioForConditionalGeneration", "Qwen2AudioConfig", QWEN2_AUDIO_TOKENIZER,
            # The text part is a plain Qwen2 (1-D RoPE, theta 1e4) as in Qwen2-Audio-7B.
            config_kwargs=dict(
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            ),
            multimodal=MultiModalSpec(
                towers={"audio_config": _QWEN2_AUDIO_ENCODER},
                token_ids={"audio_token_index": "<|AUDIO|>"},
                processor=_QWEN2_AUDIO_PROCESSOR,
                text_model_type="qwen2",
            ),
        ),
        *OMNI_ARCH_SPECS,
    )
})  # fmt: skip

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCH_SPECS)
