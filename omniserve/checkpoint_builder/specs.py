"""The vocabulary of the builder's table (table.py): row types, tokenizer families and sizes.

A buildable architecture is an `ArchSpec`: the transformers config class, the config kwargs that
make it small, and its `TokenizerFamily` (special tokens, pre-tokenizer, chat template, eos ids).
Multimodal rows add a `MultiModalSpec`: the media towers' sub-configs, the config keys holding
placeholder token ids, and the HF processor to save. Full speech-output omni models add a
`SpeechSpec`: the thinker row they wrap and their talker / vocoder sub-configs.
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
    QWEN2_5_OMNI_TEMPLATE,
    QWEN2_AUDIO_TEMPLATE,
    QWEN3_OMNI_TEMPLATE,
    QWEN3_TEMPLATE,
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
    named_tokens: tuple[tuple[str, str], ...] = ()
    """(tokenizer attribute, token) pairs saved in tokenizer_config.json, e.g. ("image_token",
    "<|IMAGE|>"): the omni processors read their placeholders from these attributes."""


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
QWEN3_TOKENIZER = dataclasses.replace(QWEN_TOKENIZER, chat_template=QWEN3_TEMPLATE)
"""The Qwen tokenizer with Qwen3's chat template (no default system turn, the thinking switch)."""
"""The Qwen tokenizer (same vocabulary and ids) with Qwen2-Audio's chat template."""

QWEN2_5_OMNI_TOKENIZER = dataclasses.replace(
    QWEN_TOKENIZER,
    # Qwen2.5-Omni wraps images and videos in <|vision_bos|>..<|vision_eos|>; appended after the
    # shared specials, so every other id equals the Qwen family's.
    special_tokens=(*QWEN_TOKENIZER.special_tokens, "<|vision_bos|>", "<|vision_eos|>"),
    chat_template=QWEN2_5_OMNI_TEMPLATE,
    named_tokens=(
        ("image_token", "<|IMAGE|>"), ("video_token", "<|VIDEO|>"), ("audio_token", "<|AUDIO|>"),
        ("vision_bos_token", "<|vision_bos|>"), ("vision_eos_token", "<|vision_eos|>"),
        ("audio_bos_token", "<|audio_bos|>"), ("audio_eos_token", "<|audio_eos|>"),
    ),
)  # fmt: skip

QWEN3_VL_TOKENIZER = dataclasses.replace(QWEN_TOKENIZER, chat_template=QWEN3_OMNI_TEMPLATE)
"""Qwen3-VL-Instruct renders as Qwen3-Omni does: no default system turn, "Picture N: " on
request, the pads inside <|vision_start|>..<|vision_end|>."""

QWEN3_OMNI_TOKENIZER = dataclasses.replace(
    QWEN_TOKENIZER,
    # The text-to-speech markers the full model's talker reads, appended like Qwen2.5-Omni's.
    special_tokens=(
        *QWEN_TOKENIZER.special_tokens,
        "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>", "<|tts_text_bos_single|>",
    ),
    chat_template=QWEN3_OMNI_TEMPLATE,
    named_tokens=(
        ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"),
        ("audio_token", "<|audio_pad|>"), ("vision_bos_token", "<|vision_start|>"),
        ("vision_eos_token", "<|vision_end|>"), ("audio_bos_token", "<|audio_start|>"),
        ("audio_eos_token", "<|audio_end|>"),
    ),
)  # fmt: skip

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


def frozen_mapping(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy, so table rows cannot be edited by the code that reads them."""
    return MappingProxyType(dict(mapping))


# Shared shapes per size; a family adds or overrides keys in `ArchSpec.size_kwargs`.
# initializer_range is ~3.2 / sqrt(hidden_size), far above the usual 0.02: a final-norm output of
# unit RMS then gives logits with std ~3, so next-token distributions are peaked (mean top-1
# probability ~0.25 over 2k tokens, measured) and greedy decoding has clear winners instead of
# near-ties. With 0.02-0.1 the distribution is near uniform and tied models repeat one token.
BASE_SIZES: Mapping[str, Mapping[str, Any]] = frozen_mapping({
    "tiny": frozen_mapping(dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.4,
        dtype="float32",
    )),
    "bench": frozen_mapping(dict(
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
    outer_text_links: Mapping[str, str] = field(default_factory=dict)
    """Outer-config key -> text-config key whose value it copies (e.g. the omni thinkers init
    lm_head from the outer initializer_range, which must follow the text part's)."""

    def tower_kwargs_for(self, name: str, size: str) -> dict[str, Any]:
        tower = self.towers[name]
        return copy.deepcopy({**tower.kwargs, **tower.size_kwargs[size]})


@dataclass(frozen=True)
class SpeechSpec:
    """A full omni model: the thinker row it wraps plus its speech-output sub-models."""

    thinker_architecture: str
    """The thinker row whose config (and, for the same seed, weights) becomes `thinker_config`."""
    submodels: Mapping[str, Mapping[str, Mapping[str, Any]]]
    """Outer-config key ("talker_config", ...) -> size -> its sub-config kwargs."""
    token_ids: Mapping[str, str] = field(default_factory=dict)
    """Outer-config key -> the token whose id it holds (e.g. im_start_token_id)."""
    speakers: Mapping[str, int] = field(default_factory=dict)
    """Speaker -> its text bos id, saved to spk_dict.pt with random conditioning vectors and
    reference mels (Qwen2.5-Omni's from_pretrained requires the file; Qwen3-Omni has none)."""
    thinker_links: Mapping[str, str] = field(default_factory=dict)
    """Sub-config path ("talker_config.text_config.vocab_size", dots into nested dicts) -> the
    thinker config path whose value it copies: hidden sizes and placeholder ids must agree."""


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
    speech: SpeechSpec | None = None
    """Set for full omni models; the kwargs above then describe the thinker's text part."""

    def config_kwargs_for(self, size: str) -> dict[str, Any]:
        if size not in BASE_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(BASE_SIZES)}")
        # deepcopy: configs keep references to list/dict values, and this table must stay intact.
        merged = {**BASE_SIZES[size], **self.size_kwargs.get(size, {}), **self.config_kwargs}
        return copy.deepcopy(merged)
