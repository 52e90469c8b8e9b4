"""The one table of model families the tiny-checkpoint builder knows.

A family is an `ArchSpec`: the transformers config class, the config kwargs that make it small, and
its `TokenizerFamily` (special tokens, pre-tokenizer, chat template, eos ids). Adding an
architecture is adding one row; multimodal thinkers (Qwen2-VL, Qwen2.5-Omni, ...) reuse the Qwen
tokenizer family, whose special tokens and chat template already carry the vision/audio markers.
"""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

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

# ChatML as Qwen2-VL / Qwen3-Omni render it: string content, or a list of typed parts where media
# parts become their placeholder spans (the processor later expands the pad token per item).
# Every tag opens with "-" so the newlines and indents here never reach the rendered prompt.
_CHATML_TEMPLATE = textwrap.dedent("""
    {%- for message in messages %}
        {%- if loop.first and message['role'] != 'system' %}
            {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
        {%- endif %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {%- if part['type'] in ('image', 'image_url') %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('video', 'video_url') %}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('audio', 'audio_url', 'input_audio') %}
                    {{- '<|audio_start|><|audio_pad|><|audio_end|>' }}
                {%- elif part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}
""").strip()

_LLAMA3_TEMPLATE = textwrap.dedent("""
    {{- bos_token }}
    {%- for message in messages %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- else %}
            {%- for part in message['content'] if part['type'] == 'text' %}
                {{- part['text'] | trim }}
            {%- endfor %}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- endif %}
""").strip()


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
    chat_template=_CHATML_TEMPLATE,
)

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
    chat_template=_LLAMA3_TEMPLATE,
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

    def config_kwargs_for(self, size: str) -> dict[str, Any]:
        if size not in BASE_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(BASE_SIZES)}")
        # deepcopy: configs keep references to list/dict values, and this table must stay intact.
        merged = {**BASE_SIZES[size], **self.size_kwargs.get(size, {}), **self.config_kwargs}
        return copy.deepcopy(merged)


_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}

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
    )
})  # fmt: skip

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCH_SPECS)
