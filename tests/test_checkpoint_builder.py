"""The tiny-checkpoint builder: real HF layouts, offline loading, determinism and caching."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

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
    assert set(SUPPORTED_ARCHITECTURES) == set(FAMILY_WEIGHTS)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
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
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen3ForCausalLM"))
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
