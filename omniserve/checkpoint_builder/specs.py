"""The one table of model families the tiny-checkpoint builder knows.

A family is an `ArchSpec`: the transformers config class, the config kwargs that make it small, and
its `TokenizerFamily` (special tokens, pre-tokenizer, chat template, eos ids). Adding an
architecture is adding one row. Multimodal rows add a `MultiModalSpec`: the media towers'
sub-configs, the config keys holding placeholder token ids, and the HF processor to save. They reuse
the Qwen tokenizer family, whose special tokens already carry the vision/audio markers.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omniserve.checkpoint_builder.templates import (
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    QWEN2_AUDIO_TEMPLATE,
)

# Qwen2's pre-tokenizer split (numbers one digit at a time).
_QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's pre-tokenizer split (numbers in groups of up to three digits).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerFamily:
    """How one model family tokenizes: everything but the learned BPE merges."""

    tokenizer_class: str
    """The transformers class the real checkpoints name (v5 may save an alias of it)."""
    pretokenize_regex: str
    nfc_normalize: bool
    special_tokens: tuple[str, ...]
    """Added after the learned vocabulary, in this order (as real checkpoints do)."""
    bos_token: str | None
    eos_token: str
    """The tokenizer's eos: the token that ends an assistant turn."""
    pad_token: str | None
    generation_eos_tokens: tuple[str, ...]
    """generation_config.json `eos_token_id`, in order; the first equals `eos_token`."""
    add_bos_token: bool
    """Prepend `bos_token` on encode (Llama 3 does, through its post-processor)."""
    chat_template: str


QWEN_TOKENIZER = TokenizerFamily(
    tokenizer_class="Qwen2Tokenizer",
    pretokenize_regex=_QWEN_REGEX,
    nfc_normalize=True,
    special_tokens=tuple(
        "<|endoftext|> <|im_start|> <|im_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
        "<|image_pad|> <|video_pad|> <|audio_start|> <|audio_end|> <|audio_pad|> <|AUDIO|> "
        "<|IMAGE|> <|VIDEO|> <|audio_bos|> <|audio_eos|>".split()
    ),
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    generation_eos_tokens=("<|im_end|>", "<|endoftext|>"),
    add_bos_token=False,
    chat_template=CHATML_TEMPLATE,
)

QWEN2_AUDIO_TOKENIZER = dataclasses.replace(QWEN_TOKENIZER, chat_template=QWEN2_AUDIO_TEMPLATE)
"""The Qwen tokenizer (same vocabulary and ids) with Qwen2-Audio's chat template."""

LLAMA3_TOKENIZER = TokenizerFamily(
    tokenizer_class="PreTrainedTokenizerFast",
    pretokenize_regex=_LLAMA3_REGEX,
    nfc_normalize=False,
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token=None,
    generation_eos_tokens=("<|eot_id|>", "<|end_of_text|>"),
    add_bos_token=True,
    chat_template=LLAMA3_TEMPLATE,
)


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


# Shared shapes per size; a family adds or overrides keys in `ArchSpec.size_kwargs`.
# initializer_range is ~3.2 / sqrt(hidden_size), far above the usual 0.02: a final-norm output of
# unit RMS then gives logits with std ~3, so next-token distributions are peaked (mean top-1
# probability ~0.25 over 2k tokens, measured) and greedy decoding has clear winners instead of
# near-ties. With 0.02-0.1 the distribution is near uniform and tied models repeat one token.
BASE_SIZES: Mapping[str, Mapping[str, Any]] = _frozen({
    "tiny": _frozen(dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.4,
        dtype="float32",
    )),
    "bench": _frozen(dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.14,
        dtype="bfloat16",
    )),
})  # fmt: skip


@dataclass(frozen=True)
class TowerSpec:
    """One media encoder's sub-config (e.g. `vision_config`), sized like the text part."""

    kwargs: Mapping[str, Any]
    """Sub-config kwargs for every size."""
    size_kwargs: Mapping[str, Mapping[str, Any]]
    """Per-size kwargs merged over `kwargs`."""
    text_links: Mapping[str, str] = field(default_factory=dict)
    """Sub-config key -> text-config key whose value it must equal (the projector's output)."""


@dataclass(frozen=True)
class ProcessorSpec:
    """The HF processor saved beside the weights, built offline from its classes."""

    processor_class: str
    components: Mapping[str, tuple[str, Mapping[str, Any]]]
    """Processor __init__ argument -> (transformers class, its kwargs)."""


@dataclass(frozen=True)
class MultiModalSpec:
    """What a multimodal row adds to the text part: towers, placeholder ids and a processor."""

    towers: Mapping[str, TowerSpec]
    """Outer-config key ("vision_config", "audio_config") -> the tower's sub-config."""
    token_ids: Mapping[str, str]
    """Outer-config key -> the special token whose id it holds (e.g. image_token_id)."""
    processor: ProcessorSpec
    outer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Kwargs of the outer config rather than of `text_config` (e.g. tie_word_embeddings)."""
    text_model_type: str | None = None
    """`text_config["model_type"]`, for outer configs that cannot infer it."""
    mrope_section: tuple[int, ...] | None = None
    """The real checkpoint's M-RoPE sections (for head_dim 128), scaled to the tiny head_dim."""

    def tower_kwargs_for(self, name: str, size: str) -> dict[str, Any]:
        tower = self.towers[name]
        return copy.deepcopy({**tower.kwargs, **tower.size_kwargs[size]})


@dataclass(frozen=True)
class ArchSpec:
    """One buildable architecture: its config class, small shapes and tokenizer family."""

    architecture: str
    """The config.json "architectures" entry and the transformers model class to instantiate."""
    config_class: str
    tokenizer: TokenizerFamily
    config_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Config kwargs for every size (rope theta, tied embeddings, MoE routing...)."""
    size_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-size kwargs merged over `BASE_SIZES[size]` (e.g. head_dim, expert width)."""
    multimodal: MultiModalSpec | None = None
    """Set for image/video/audio models; then the kwargs above describe `text_config`."""

    def config_kwargs_for(self, size: str) -> dict[str, Any]:
        if size not in BASE_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(BASE_SIZES)}")
        # deepcopy: configs keep references to list/dict values, and this table must stay intact.
        merged = {**BASE_SIZES[size], **self.size_kwargs.get(size, {}), **self.config_kwargs}
        return copy.deepcopy(merged)


_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}

# An image becomes 4..64 merged tokens (28x28 pixels each) and each pair of video frames 4..16, so
# multimodal tests stay fast (real checkpoints: 4..16384). Callers pass size={...} for larger media.
_QWEN_VL_PROCESSOR_COMPONENTS = _frozen({
    "image_processor": ("Qwen2VLImageProcessor", _frozen(dict(
        min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28,
    ))),
    # Frames are taken as given (do_sample_frames=False, as in the real checkpoints); fps and the
    # frame bounds apply when a caller asks for sampling. No whole-video pixel cap, as before v5.22.
    "video_processor": ("Qwen2VLVideoProcessor", _frozen(dict(
        min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28, fps=2.0, min_frames=2, max_frames=16,
        do_sample_frames=False, cap_pixels_per_frame=False,
    ))),
})  # fmt: skip
_QWEN_VL_TOKEN_IDS = _frozen({
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
})  # fmt: skip
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
    _frozen({
        "feature_extractor": ("WhisperFeatureExtractor", _frozen(dict(
            feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400,
            padding_value=0.0, return_attention_mask=True,
        ))),
    }),
)  # fmt: skip

ARCH_SPECS: Mapping[str, ArchSpec] = _frozen({
    spec.architecture: spec
    for spec in (
        ArchSpec(
            "Qwen2ForCausalLM", "Qwen2Config", QWEN_TOKENIZER,
            # Tied like Qwen2.5-0.5B, so the tied-embedding path is covered by tests.
            config_kwargs=dict(tie_word_embeddings=True, rope_parameters=_QWEN_ROPE),
        ),
        ArchSpec(
            "Qwen3ForCausalLM", "Qwen3Config", QWEN_TOKENIZER,
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
            "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN_TOKENIZER,
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
    )
})  # fmt: skip

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCH_SPECS)
