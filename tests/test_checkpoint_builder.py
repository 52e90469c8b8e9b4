"""The tiny-checkpoint builder: real HF layouts, offline loading, determinism and caching."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
)

from omniserve.checkpoint_builder import SUPPORTED_ARCHITECTURES, build_tiny_checkpoint
from omniserve.checkpoint_builder import builder as builder_module

MULTIBYTE_TEXT = "Café über naïve 日本語のテキスト 🚀✨ and €5"
# Names the real checkpoints use for the layer-0 weights that are specific to each family.
FAMILY_WEIGHTS = {
    "Qwen2ForCausalLM": ["model.layers.0.self_attn.q_proj.bias", "model.norm.weight"],
    "Qwen3ForCausalLM": ["model.layers.0.self_attn.q_norm.weight", "lm_head.weight"],
    "LlamaForCausalLM": ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"],
    "Qwen3MoeForCausalLM": [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.7.down_proj.weight",
        "lm_head.weight",
    ],
}  # fmt: skip
# Real Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen2-Audio checkpoint names (transformers 5 saves
# the hub layout).
MULTIMODAL_WEIGHTS = {
    "Qwen2VLForConditionalGeneration": [
        "model.embed_tokens.weight", "lm_head.weight", "visual.patch_embed.proj.weight",
        "visual.blocks.1.attn.qkv.weight", "visual.merger.mlp.2.weight",
    ],
    "Qwen2_5_VLForConditionalGeneration": [
        "model.embed_tokens.weight", "lm_head.weight", "visual.blocks.1.mlp.gate_proj.weight",
        "visual.blocks.0.norm1.weight", "visual.merger.ln_q.weight",
    ],
    # Qwen3-VL's hub layout is transformers' module layout (tied: no lm_head).
    "Qwen3VLForConditionalGeneration": [
        "model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight",
        "model.visual.pos_embed.weight", "model.visual.deepstack_merger_list.2.linear_fc2.weight",
        "model.language_model.layers.1.self_attn.k_norm.weight",
    ],
    # transformers saves the experts fused as it keeps them ([E, 2I, H]; the hub's are [E, H, 2I]).
    "Qwen3VLMoeForConditionalGeneration": [
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.1.mlp.experts.down_proj",
        "model.language_model.layers.0.mlp.gate.weight", "lm_head.weight",
    ],
    "Qwen2AudioForConditionalGeneration": [
        "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
        "audio_tower.conv1.weight", "audio_tower.embed_positions.weight",
        "multi_modal_projector.linear.weight",
    ],
}  # fmt: skip
EOS_TOKENS = {
    "Qwen2ForCausalLM": ["<|im_end|>", "<|endoftext|>"],
    "Qwen3ForCausalLM": ["<|im_end|>", "<|endoftext|>"],
    "LlamaForCausalLM": ["<|eot_id|>", "<|end_of_text|>"],
    "Qwen3MoeForCausalLM": ["<|im_end|>", "<|endoftext|>"],
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weight_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_table_covers_the_requested_architectures():
    from tests.test_checkpoint_builder_omni import OMNI_ARCHS

    expected = set(FAMILY_WEIGHTS) | set(MULTIMODAL_WEIGHTS) | set(OMNI_ARCHS)
    assert set(SUPPORTED_ARCHITECTURES) == expected


@pytest.mark.parametrize("arch", list(FAMILY_WEIGHTS))
def test_builds_loads_offline_and_generates(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.architectures == [arch]
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    assert config.tie_word_embeddings == (arch == "Qwen2ForCausalLM")
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        2, 4, 2,
    )  # fmt: skip

    names = _weight_names(path)
    assert set(FAMILY_WEIGHTS[arch]) <= names
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)

    eos_ids = tokenizer.convert_tokens_to_ids(EOS_TOKENS[arch])
    assert GenerationConfig.from_pretrained(path).eos_token_id == eos_ids
    assert tokenizer.eos_token_id == eos_ids[0] == config.eos_token_id

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    outputs = []
    for prompt in ("The capital of France is", "def compute(x):", "日本語のテキスト"):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, num_prompt_tokens]
        with torch.no_grad():
            out = model.generate(input_ids, max_new_tokens=16, do_sample=False)
        new_ids = out[0, input_ids.shape[1] :].tolist()
        assert len(new_ids) == 16 and not set(new_ids) & set(eos_ids)
        assert max(new_ids) < len(tokenizer)  # padding rows never win
        assert len(set(new_ids)) > 4  # not one token repeated forever
        outputs.append(new_ids)
    assert len({tuple(ids) for ids in outputs}) == len(outputs)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_tokenizer_round_trips_multibyte_text(tiny_checkpoint, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(arch))
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert len(tokenizer) < 2100
    # Some tokens end inside a UTF-8 character: incremental detokenizers must handle that.
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


def test_qwen_chat_template(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen2ForCausalLM"))
    messages = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert encoded["input_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert encoded["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")

    parts = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What is this?"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert (
        "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
        "What is this?<|im_end|>"
    ) in text
    special = "<|vision_pad|> <|video_pad|> <|AUDIO|> <|IMAGE|> <|VIDEO|> <|audio_bos|>".split()
    assert all(len(tokenizer.encode(token)) == 1 for token in special)


def test_qwen3_template_renders_tools_and_the_thinking_switch(tiny_checkpoint):
    """As Qwen3's own template: tools listed in the system turn, assistant calls as hermes
    <tool_call> blocks (arguments given as an object or as JSON text), consecutive tool results
    in one user turn, and enable_thinking=False closing an empty thinking block."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen3ForCausalLM"))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        },
        {
            "id": "b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    plain = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_llama_chat_template_and_bos(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("LlamaForCausalLM"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id  # Llama 3 prepends bos
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert encoded["input_ids"].count(tokenizer.bos_token_id) == 1


def test_same_seed_same_bytes(tmp_path):
    arch = "Qwen3MoeForCausalLM"
    first = build_tiny_checkpoint(arch, tmp_path / "a", seed=0)
    second = build_tiny_checkpoint(arch, tmp_path / "b", seed=0)
    other = build_tiny_checkpoint(arch, tmp_path / "c", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(first / name) == _sha256(second / name)
    assert _sha256(first / "model.safetensors") != _sha256(other / "model.safetensors")
    assert _sha256(first / "tokenizer.json") == _sha256(other / "tokenizer.json")


def test_tokenizer_training_is_deterministic():
    from omniserve.checkpoint_builder.specs import QWEN_TOKENIZER
    from omniserve.checkpoint_builder.tokenizer import train_tokenizer

    assert train_tokenizer(QWEN_TOKENIZER).to_str() == train_tokenizer(QWEN_TOKENIZER).to_str()


def test_build_leaves_caller_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_cache_reuses_the_built_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE_DIR", str(tmp_path))
    path = build_tiny_checkpoint("Qwen2ForCausalLM", overrides={"num_hidden_layers": 1})
    assert path.parent == tmp_path / "checkpoints"
    assert path.name.startswith("Qwen2ForCausalLM-tiny-s0-")
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 1

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached checkpoint was rebuilt")

    monkeypatch.setattr(builder_module, "_write_checkpoint", no_rebuild)
    assert build_tiny_checkpoint("Qwen2ForCausalLM", overrides={"num_hidden_layers": 1}) == path
    with pytest.raises(AssertionError, match="rebuilt"):
        build_tiny_checkpoint("Qwen2ForCausalLM", overrides={"num_hidden_layers": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]  # no temp dirs


def test_losing_a_build_race_returns_the_winner(tmp_path, monkeypatch):
    """A concurrent builder publishes first; ours must discard its copy and return the winner's."""
    monkeypatch.setenv("OMNISERVE_CACHE_DIR", str(tmp_path))
    real_write = builder_module._write_checkpoint
    winner: list[Path] = []

    def racing_write(*args, **kwargs):
        monkeypatch.setattr(builder_module, "_write_checkpoint", real_write)
        winner.append(build_tiny_checkpoint("Qwen3ForCausalLM"))  # the other process finishes
        real_write(*args, **kwargs)

    monkeypatch.setattr(builder_module, "_write_checkpoint", racing_write)
    path = build_tiny_checkpoint("Qwen3ForCausalLM")
    assert winner == [path]
    assert json.loads((path / builder_module.BUILD_INFO_FILE).read_text())["seed"] == 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]


def test_bench_size_has_tens_of_millions_of_params(tmp_path):
    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "bench", size="bench")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert 10_000_000 < num_params < 100_000_000
    config = AutoConfig.from_pretrained(path)
    assert config.dtype == torch.bfloat16
    assert len(AutoTokenizer.from_pretrained(path)) == len(
        AutoTokenizer.from_pretrained(build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "tiny"))
    )


def test_rejects_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="no tiny checkpoint recipe"):
        build_tiny_checkpoint("GPT2LMHeadModel", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown size"):
        build_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "x", overrides={"vocab_size": 100})
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_checkpoint("Qwen2ForCausalLM", occupied)


# --- multimodal checkpoints -------------------------------------------------------------------

VL_ARCHS = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]
PLACEHOLDER_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def _image(seed: int, width: int = 112, height: int = 112) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tone(freq: float, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)  # [num_samples]


def _greedy(model: torch.nn.Module, inputs: dict, num_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _load_multimodal(path: Path, arch: str):
    model_cls = getattr(transformers, arch)
    model, info = model_cls.from_pretrained(path, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    return AutoProcessor.from_pretrained(path), model


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vision_checkpoint_processes_images_and_videos_offline(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    processor, model = _load_multimodal(path, arch)
    config, tokenizer = model.config, processor.tokenizer
    assert type(processor).__name__ == arch.replace("ForConditionalGeneration", "Processor")
    assert set(MULTIMODAL_WEIGHTS[arch]) <= _weight_names(path)
    assert type(AutoModelForImageTextToText.from_pretrained(path)) is type(model)
    for key, token in PLACEHOLDER_TOKENS.items():
        assert getattr(config, key) == tokenizer.convert_tokens_to_ids(token)
    text_config, vision = config.text_config, config.vision_config
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    assert text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert sum(text_config.rope_parameters["mrope_section"]) == head_dim // 2
    assert (vision.depth, vision.patch_size, vision.spatial_merge_size) == (2, 14, 2)
    for media_processor in (processor.image_processor, processor.video_processor):
        assert media_processor.patch_size == vision.patch_size
        assert media_processor.merge_size == vision.spatial_merge_size
        assert media_processor.temporal_patch_size == vision.temporal_patch_size
    assert processor.image_processor.size == {"shortest_edge": 4 * 784, "longest_edge": 64 * 784}

    parts = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>" in text
    outputs = []
    for seed in (0, 1):  # same size, different pixels: the model must look at the image
        inputs = processor(text=[text], images=[_image(seed)], return_tensors="pt")
        assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
        assert (inputs["input_ids"] == config.image_token_id).sum() == 16  # 8 * 8 / 2**2
        new_ids = _greedy(model, inputs)
        assert max(new_ids) < len(tokenizer)
        outputs.append(new_ids)
    assert outputs[0] != outputs[1]
    big, small = _image(2, 1000, 700), _image(3, 20, 20)
    grids = processor.image_processor(images=[big, small], return_tensors="pt")["image_grid_thw"]
    assert [int(grid.prod()) // 4 for grid in grids] == [54, 4]  # clamped into 4..64 tokens

    vparts = [{"type": "video"}, {"type": "text", "text": "And this?"}]
    vtext = processor.apply_chat_template([{"role": "user", "content": vparts}], tokenize=False)
    assert "<|vision_start|><|video_pad|><|vision_end|>And this?" in vtext
    frames = np.random.default_rng(4).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    inputs = processor(text=[vtext], videos=[frames], return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 6]]  # 4 frames -> 2 temporal patches
    assert (inputs["input_ids"] == config.video_token_id).sum() == 12
    assert len(_greedy(model, inputs)) == 8


def test_audio_checkpoint_processes_audio_offline(tiny_checkpoint):
    arch = "Qwen2AudioForConditionalGeneration"
    path = tiny_checkpoint(arch)
    processor, model = _load_multimodal(path, arch)
    config, tokenizer = model.config, processor.tokenizer
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    assert set(MULTIMODAL_WEIGHTS[arch]) <= _weight_names(path)
    assert config.audio_token_index == tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    extractor = processor.feature_extractor
    assert extractor.feature_size == config.audio_config.num_mel_bins == 128
    assert (extractor.sampling_rate, config.audio_config.max_source_positions) == (16000, 1500)

    parts = [
        {"type": "audio"}, {"type": "text", "text": "Compare"}, {"type": "audio"},
    ]  # fmt: skip
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith(
        "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nCompare"
        "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\n<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = processor(
        text=[text], audio=[_tone(440), _tone(660, 2.0)], sampling_rate=16000, return_tensors="pt"
    )
    assert (inputs["input_ids"] == config.audio_token_index).sum() == 25 + 50  # 40 ms per token
    assert len(_greedy(model, inputs)) == 8

    one = processor.apply_chat_template(
        [{"role": "user", "content": parts[:1]}], add_generation_prompt=True, tokenize=False
    )
    outputs = [
        _greedy(model, processor(text=[one], audio=[_tone(freq)], sampling_rate=16000,
                                 return_tensors="pt"))
        for freq in (220, 880)
    ]  # fmt: skip
    assert outputs[0] != outputs[1]  # the model listens to the audio


def test_multimodal_build_is_deterministic(tmp_path):
    arch = "Qwen2_5_VLForConditionalGeneration"
    first = build_tiny_checkpoint(arch, tmp_path / "a")
    second = build_tiny_checkpoint(arch, tmp_path / "b")
    names = ["model.safetensors", "config.json", "processor_config.json", "tokenizer.json"]
    for name in [*names, "chat_template.jinja"]:
        assert _sha256(first / name) == _sha256(second / name)


def test_tower_overrides_stay_consistent(tmp_path):
    """A tower override merges into its sub-config; text-linked sizes and mrope follow the text."""
    path = build_tiny_checkpoint(
        "Qwen2VLForConditionalGeneration",
        tmp_path / "wide",
        overrides={"hidden_size": 128, "vision_config": {"depth": 1, "embed_dim": 64}},
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.vision_config.depth, config.vision_config.embed_dim) == (1, 64)
    assert config.vision_config.hidden_size == config.text_config.hidden_size == 128
    assert config.text_config.rope_parameters["mrope_section"] == [4, 6, 6]  # head_dim 32
    info = json.loads((path / builder_module.BUILD_INFO_FILE).read_text())
    assert info["overrides"]["vision_config"] == {"depth": 1, "embed_dim": 64}


def test_scale_mrope_section():
    assert builder_module.scale_mrope_section((16, 24, 24), 128) == [16, 24, 24]
    assert builder_module.scale_mrope_section((16, 24, 24), 64) == [8, 12, 12]
    assert builder_module.scale_mrope_section((16, 24, 24), 16) == [2, 3, 3]
    with pytest.raises(ValueError, match="even"):
        builder_module.scale_mrope_section((16, 24, 24), 15)
