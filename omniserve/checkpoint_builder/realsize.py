"""Random-weight checkpoints in the published shapes of real ones, for benchmarks.

`build_realsize_checkpoint("qwen2.5-1.5b")` writes what `build_tiny_checkpoint` writes (config,
generation config, the locally trained tokenizer with the family's specials and chat template,
the HF processor) but at the published shapes, vocabulary and media limits, with weights streamed
shard by shard from a meta-device model (sharded_weights.py), so building never holds the model.

Each `REALSIZE_MODELS` entry states every config value its builder row would otherwise supply,
so the table below is the list of published numbers used (dtype bfloat16, initializer_range
0.02, rms_norm_eps 1e-6 and rope_theta 1e6 throughout). Where they were checked:
  * qwen2.5-1.5b: the Qwen2.5-1.5B-Instruct card and config (28 layers, 12 Q / 2 KV heads,
    32768 positions, tied); the table gives its 1,543,714,304 parameters (card: 1.54B, 1.31B
    non-embedding).
  * qwen3-1.7b: the Qwen3-1.7B card and config (28 layers, 16 Q / 8 KV heads of 128, 40960
    positions, tied); 1,720,574,976 parameters, 1.41B non-embedding (card: 1.7B / 1.4B).
  * qwen3-30b-a3b-4l: Qwen3-30B-A3B's config.json as quoted in citsjtu2020/LLM-Prof
    (sglang/Model_Config.md); at its 48 layers the table gives 30,532,122,624 parameters, the
    count keras-hub lists for it.
  * qwen2.5-vl-3b: Qwen2.5-VL-3B-Instruct's config.json, quoted verbatim in a public model dump
    (vision: depth 32, 1280 wide, 3420 MLP, 16 heads, full attention in blocks 7/15/23/31,
    tokens_per_second 2; M-RoPE 16/24/24); 3,754,622,976 parameters (card: 3.75B).
  * qwen3-vl-2b: Qwen3-VL-2B-Instruct's config.json as quoted in public parser tests and
    configs (text: 28 layers of 2048, 16 Q / 8 KV heads of 128, 6144 MLP, rope_theta 5e6,
    interleaved M-RoPE 24/20/20, tied; vision: 24 blocks of 1024, 4096 MLP, 16 heads, 16 px
    patches, 2304 position embeddings, DeepStack from blocks 5/11/17); the processors' limits
    (images 65536..16777216 pixels, videos 4096..25165824 pixels in all, 2 fps, 4..768 frames)
    from its preprocessor configs.
  * qwen2.5-omni-3b-thinker: text numbers from a transcription of the 3B's config.json (Tyr's
    torch.qwen25omni); towers as published for Qwen2.5-Omni (vision = Qwen2.5-VL's, audio =
    Whisper-large-v3's 32 x 1280 encoder, n_window 100), outputs at the 2048 text width.
    tie_word_embeddings=False is the thinker config's default and the 7B's value; no source
    showing the 3B's own value was found.
  * qwen3-omni-30b-a3b-thinker-4l: the released config.json as quoted in a Rust parser's test
    and a Megatron-Bridge toy config derived from it. Its vocabulary is 152064, not 151936: at
    48 layers the table then gives exactly the 31,719,205,488 parameters printed from the real
    thinker (ai-bot-pro/achatbot PR 196), which also confirms every tower shape.
  * Processors: min_pixels 3136 / max_pixels 12845056 and, for the omni models, Whisper features
    of up to 300 s (chunk_length 300), from the published preprocessor_config.json files.

Padding rows (ids past the ~2k-token local tokenizer) of the embedding and lm_head are zeroed, as
in tiny checkpoints: greedy decoding then stays on ids the tokenizer can decode (random rows
would win most steps among 150k of them), while shapes and compute are the real model's. Random
sampling still mostly picks padding ids, whose logits (0) are near the real rows' at this init.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniserve import envs
from omniserve.checkpoint_builder.builder import (
    build_key,
    build_once,
    make_config_and_tokenizer,
    make_generation_config,
    save_tokenizer_or_processor,
)
from omniserve.checkpoint_builder.sharded_weights import plan_tensors, write_shards
from omniserve.checkpoint_builder.specs import ArchSpec, ProcessorSpec, frozen_mapping
from omniserve.checkpoint_builder.table import ARCH_SPECS

REALSIZE_VERSION = 1
"""Bump when this module's output changes, so cached real-size checkpoints are rebuilt."""

DEFAULT_MAX_SHARD_BYTES = 2 << 30

# The row's size whose defaults the published values replace; every default is overridden
# (tests/test_checkpoint_builder_realsize.py checks), so which size is named does not matter.
_SIZE = "bench"


@dataclass(frozen=True)
class RealSizeSpec:
    """A published checkpoint's shapes, built on one of the builder's rows."""

    mirrors: str
    """The published checkpoint, and how this one differs from it."""
    architecture: str
    """The builder row (table.py, omni_table.py): tokenizer family, chat template, processor."""
    overrides: Mapping[str, Any]
    """Every config value the row would otherwise supply, as published: text-config keys, and
    each tower's sub-config under its name (build_tiny_checkpoint's override format)."""
    processor_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Processor component -> kwargs merged over the row's: the published media limits."""

    def arch_spec(self) -> ArchSpec:
        """The builder row, its processor saved with the published media limits."""
        spec = ARCH_SPECS[self.architecture]
        if spec.multimodal is None:
            return spec
        processor = spec.multimodal.processor
        components = {
            name: (cls, frozen_mapping({**kwargs, **self.processor_overrides.get(name, {})}))
            for name, (cls, kwargs) in processor.components.items()
        }
        processor = ProcessorSpec(processor.processor_class, frozen_mapping(components))
        return dataclasses.replace(
            spec, multimodal=dataclasses.replace(spec.multimodal, processor=processor)
        )


_QWEN_VOCAB = 151_936
_ROPE_THETA = 1_000_000.0
_DENSE_TEXT = dict(
    vocab_size=_QWEN_VOCAB, rms_norm_eps=1e-6, initializer_range=0.02, dtype="bfloat16",
    rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA},
)  # fmt: skip
_QWEN3_MOE_TEXT = dict(
    _DENSE_TEXT, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    tie_word_embeddings=False,
)  # fmt: skip
# Qwen2.5-VL's vision tower, shared by Qwen2.5-VL-3B and Qwen2.5-Omni (out_hidden_size follows
# the text hidden size through the row's text_links).
_QWEN2_5_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", initializer_range=0.02,
)  # fmt: skip
# Whisper-large-v3's encoder: 32 layers of 1280, 20 heads, 128 mel bins, 30 s of positions.
_WHISPER_LARGE_AUDIO = dict(
    d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
    num_mel_bins=128, max_source_positions=1500, initializer_range=0.02,
)  # fmt: skip
_PUBLISHED_IMAGE_LIMITS = {"min_pixels": 3136, "max_pixels": 12845056}
# Frame bounds used when a caller asks for frame sampling: the video processor's own defaults.
_FRAME_BOUNDS = {"min_frames": 4, "max_frames": 768}
_OMNI_PROCESSOR = {
    "image_processor": _PUBLISHED_IMAGE_LIMITS,
    # Per-frame pixels stay the row's: the omni processors' own video bounds, passed on each call.
    "video_processor": _FRAME_BOUNDS,
    "feature_extractor": {"chunk_length": 300},
}

REALSIZE_MODELS: Mapping[str, RealSizeSpec] = frozen_mapping({
    "qwen2.5-1.5b": RealSizeSpec(
        "Qwen/Qwen2.5-1.5B-Instruct", "Qwen2ForCausalLM",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True,
        )),
    ),
    "qwen2.5-7b": RealSizeSpec(
        "Qwen/Qwen2.5-7B-Instruct", "Qwen2ForCausalLM",
        frozen_mapping(dict(
            _DENSE_TEXT, vocab_size=152_064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            max_position_embeddings=32768, tie_word_embeddings=False,
        )),
    ),
    "qwen3-0.6b": RealSizeSpec(
        "Qwen/Qwen3-0.6B (Qwen3-Reranker-0.6B and Qwen3-Embedding-0.6B have its shapes)",
        "Qwen3ForCausalLM",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, tie_word_embeddings=True,
        )),
    ),
    "qwen3-1.7b": RealSizeSpec(
        "Qwen/Qwen3-1.7B", "Qwen3ForCausalLM",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, tie_word_embeddings=True,
        )),
    ),
    "qwen3-30b-a3b-4l": RealSizeSpec(
        "Qwen/Qwen3-30B-A3B's decoder layers, 4 of its 48", "Qwen3MoeForCausalLM",
        frozen_mapping(dict(_QWEN3_MOE_TEXT, num_hidden_layers=4, max_position_embeddings=40960)),
    ),
    "qwen2.5-vl-3b": RealSizeSpec(
        "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen2_5_VLForConditionalGeneration",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default", "rope_theta": _ROPE_THETA, "mrope_section": [16, 24, 24],
            },
            vision_config=dict(_QWEN2_5_VISION, tokens_per_second=2),
        )),
        # Without a video_preprocessor_config.json, the checkpoint's video processor reads the
        # image processor's file, so frames get the image limits.
        frozen_mapping({
            "image_processor": _PUBLISHED_IMAGE_LIMITS,
            "video_processor": {**_PUBLISHED_IMAGE_LIMITS, **_FRAME_BOUNDS},
        }),
    ),
    "qwen3-vl-2b": RealSizeSpec(
        "Qwen/Qwen3-VL-2B-Instruct", "Qwen3VLForConditionalGeneration",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=262144, tie_word_embeddings=True, attention_bias=False,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
            },
            vision_config=dict(
                depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh",
                initializer_range=0.02,
            ),
        )),
        frozen_mapping({
            "image_processor": {"min_pixels": 65536, "max_pixels": 16777216},
            "video_processor": {
                "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2.0,
                "min_frames": 4, "max_frames": 768,
            },
        }),
    ),
    "qwen2.5-omni-3b-thinker": RealSizeSpec(
        "The thinker of Qwen/Qwen2.5-Omni-3B", "Qwen2_5OmniThinkerForConditionalGeneration",
        frozen_mapping(dict(
            _DENSE_TEXT, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=False, position_id_per_seconds=25, seconds_per_chunk=2,
            rope_parameters={
                "rope_type": "default", "rope_theta": _ROPE_THETA, "mrope_section": [16, 24, 24],
            },
            vision_config=_QWEN2_5_VISION,
            audio_config=dict(_WHISPER_LARGE_AUDIO, n_window=100),
        )),
        frozen_mapping(_OMNI_PROCESSOR),
    ),
    "qwen3-omni-30b-a3b-thinker-4l": RealSizeSpec(
        "The thinker of Qwen/Qwen3-Omni-30B-A3B-Instruct, 4 of its 48 text decoder layers",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        frozen_mapping(dict(
            _QWEN3_MOE_TEXT, vocab_size=152_064, intermediate_size=768, num_hidden_layers=4,
            max_position_embeddings=65536, position_id_per_seconds=13, seconds_per_chunk=2,
            rope_parameters={
                "rope_type": "default", "rope_theta": _ROPE_THETA, "interleaved": True,
                "mrope_interleaved": True, "mrope_section": [24, 20, 20],
            },
            vision_config=dict(
                depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh",
                initializer_range=0.02,
            ),
            audio_config=dict(
                _WHISPER_LARGE_AUDIO, n_window=50, n_window_infer=800, conv_chunksize=500,
                downsample_hidden_size=480,
            ),
        )),
        frozen_mapping(_OMNI_PROCESSOR),
    ),
})  # fmt: skip


def build_realsize_checkpoint(
    name: str,
    *,
    seed: int = 0,
    out_dir: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write (or reuse) the real-size checkpoint `name` of REALSIZE_MODELS and return its path.

    `overrides` are merged over the entry's (text keys replace, a tower's dict is merged into the
    tower's), e.g. to build a small model with the real vocabulary. Without `out_dir` it lives in
    `envs.cache_dir()/checkpoints` as `realsize-<name>-s<seed>-<key>`, built once, atomically.
    """
    try:
        real = REALSIZE_MODELS[name]
    except KeyError:
        raise ValueError(f"no real-size model {name!r}; known: {sorted(REALSIZE_MODELS)}") from None
    import torch

    spec = real.arch_spec()
    user_overrides = copy.deepcopy(overrides or {})
    merged = _merged_overrides(spec, real.overrides, user_overrides)
    key = build_key(REALSIZE_VERSION, torch.__version__, repr(spec), merged, seed, max_shard_bytes)
    if out_dir is None:
        target = envs.cache_dir() / "checkpoints" / f"realsize-{name}-s{seed}-{key}"
    else:
        target = Path(out_dir)
    info = {
        "realsize": name,
        "architecture": real.architecture,
        "seed": seed,
        "overrides": user_overrides,
        "max_shard_bytes": max_shard_bytes,
    }
    return build_once(
        target,
        key,
        info,
        lambda path: _write_checkpoint(spec, path, merged, seed, max_shard_bytes),
    )


def _merged_overrides(
    spec: ArchSpec, base: Mapping[str, Any], update: dict[str, Any]
) -> dict[str, Any]:
    towers = spec.multimodal.towers if spec.multimodal else {}
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        merged[key] = {**merged.get(key, {}), **value} if key in towers else value
    return merged


def _write_checkpoint(
    spec: ArchSpec, path: Path, overrides: dict[str, Any], seed: int, max_shard_bytes: int
) -> None:
    import torch
    import transformers

    config, tokenizer = make_config_and_tokenizer(spec, _SIZE, overrides)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype)
    with torch.device("meta"):  # shapes and names only: no memory, no init
        model = getattr(transformers, spec.architecture)(config)
    plans = plan_tensors(model, num_tokens=len(tokenizer))
    config.dtype = str(dtype).removeprefix("torch.")  # as save_pretrained records it
    config.save_pretrained(path)
    if model.can_generate():
        make_generation_config(spec, tokenizer, config).save_pretrained(path)
    save_tokenizer_or_processor(spec, path, tokenizer, config)
    write_shards(path, plans, dtype=dtype, seed=seed, max_shard_bytes=max_shard_bytes)
