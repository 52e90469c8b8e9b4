"""Real-size checkpoints: the published-shape table, and the streamed sharded weights it builds.

No full-size checkpoint is built here: one small model with the real vocabulary stands in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from omniserve.checkpoint_builder import REALSIZE_MODELS, build_realsize_checkpoint
from omniserve.checkpoint_builder import realsize as realsize_module
from omniserve.checkpoint_builder.builder import make_config_and_tokenizer
from omniserve.checkpoint_builder.sharded_weights import TensorPlan, draw_tensor, plan_tensors
from omniserve.checkpoint_builder.specs import BASE_SIZES
from omniserve.checkpoint_builder.table import ARCH_SPECS

SMALL = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip
SHARD_BYTES = 64 << 20  # the small model's ~160 MB then spans three shards


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen2.5-1.5b cut to 2 narrow layers, real vocabulary kept, built into a fresh cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return build_realsize_checkpoint(
            "qwen2.5-1.5b", overrides=SMALL, max_shard_bytes=SHARD_BYTES
        )


@pytest.mark.parametrize("name", list(REALSIZE_MODELS))
def test_entries_state_every_value_their_row_would_supply(name):
    real = REALSIZE_MODELS[name]
    spec = ARCH_SPECS[real.architecture]
    assert spec.speech is None
    assert real.overrides["vocab_size"] in (151_936, 152_064)  # Qwen3-Omni's is 152064
    assert real.overrides["dtype"] == "bfloat16"
    assert real.overrides["initializer_range"] == 0.02
    size = realsize_module._SIZE
    text_keys = {*BASE_SIZES[size], *spec.size_kwargs.get(size, {}), *spec.config_kwargs}
    if spec.multimodal is not None:
        text_keys |= set(spec.multimodal.outer_kwargs)
        for tower_name, tower in spec.multimodal.towers.items():
            tower_keys = {*tower.kwargs, *tower.size_kwargs[size]} - set(tower.text_links)
            assert tower_keys <= set(real.overrides[tower_name]), tower_name
    assert text_keys <= set(real.overrides)


@pytest.mark.slow
def test_table_reproduces_the_published_parameter_count():
    """The 48-layer Qwen3-Omni thinker from this table has the real checkpoint's parameter count
    (31,719,205,488, as printed from it in ai-bot-pro/achatbot PR 196): every text, vision and
    audio shape and the 152064-row vocabulary agree."""
    name = "qwen3-omni-30b-a3b-thinker-4l"
    real = REALSIZE_MODELS[name]
    spec = real.arch_spec()
    overrides = realsize_module._merged_overrides(spec, real.overrides, {"num_hidden_layers": 48})
    config, tokenizer = make_config_and_tokenizer(spec, realsize_module._SIZE, overrides)
    with torch.device("meta"):
        model = getattr(transformers, spec.architecture)(config)
    plans = plan_tensors(model, num_tokens=len(tokenizer))
    assert sum(plan.numel for plan in plans) == 31_719_205_488


def test_media_limits_are_published_and_tiny_rows_keep_theirs():
    components = REALSIZE_MODELS["qwen2.5-vl-3b"].arch_spec().multimodal.processor.components
    assert components["image_processor"][1]["max_pixels"] == 12845056
    assert components["video_processor"][1]["min_pixels"] == 3136
    tiny = ARCH_SPECS["Qwen2_5_VLForConditionalGeneration"].multimodal.processor.components
    assert tiny["image_processor"][1]["max_pixels"] == 64 * 28 * 28


@pytest.mark.parametrize("name", list(REALSIZE_MODELS))
def test_planned_tensors_are_what_save_pretrained_writes(name, tiny_checkpoint):
    """Names and shapes planned from a meta model equal a tiny checkpoint's saved tensors."""
    architecture = REALSIZE_MODELS[name].architecture
    path = tiny_checkpoint(architecture)
    with torch.device("meta"):
        model = getattr(transformers, architecture)(AutoConfig.from_pretrained(path))
    planned = {plan.name: plan.shape for plan in plan_tensors(model, num_tokens=1)}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    assert planned == saved


def test_draws_depend_on_seed_and_name_only():
    plan = TensorPlan("model.layers.0.mlp.up_proj.weight", (64, 32), "normal", 0.02)
    first = draw_tensor(plan, torch.bfloat16, seed=0)
    assert torch.equal(first, draw_tensor(plan, torch.bfloat16, seed=0))
    assert not torch.equal(first, draw_tensor(plan, torch.bfloat16, seed=1))
    renamed = TensorPlan("model.layers.1.mlp.up_proj.weight", (64, 32), "normal", 0.02)
    assert not torch.equal(first, draw_tensor(renamed, torch.bfloat16, seed=0))
    assert abs(first.float().std().item() - 0.02) < 0.002


def test_small_build_is_sharded_like_real_checkpoints(small_checkpoint):
    index = json.loads((small_checkpoint / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total_size = 0
    for file in files:
        with safe_open(str(small_checkpoint / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert index["weight_map"][key] == file
                total_size += f.get_tensor(key).nbytes
    assert index["metadata"]["total_size"] == total_size
    config = AutoConfig.from_pretrained(small_checkpoint)
    assert (config.vocab_size, config.hidden_size, config.rope_parameters["rope_theta"]) == (
        151_936, 256, 1_000_000.0,
    )  # fmt: skip


def test_small_build_loads_runs_and_resaves_the_same_keys(small_checkpoint, tmp_path):
    model, info = AutoModelForCausalLM.from_pretrained(
        small_checkpoint, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    logits = model(torch.arange(1, 9)[None]).logits  # [1, 8, vocab_size]
    assert logits.shape == (1, 8, 151_936) and torch.isfinite(logits).all()
    embed = model.get_input_embeddings().weight  # [vocab_size, hidden_size]
    num_tokens = len(transformers.AutoTokenizer.from_pretrained(small_checkpoint))
    assert not embed[num_tokens:].any()  # ids past the tokenizer: zero rows
    assert abs(embed[:num_tokens].float().std().item() - 0.02) < 0.002
    assert (model.model.norm.weight == 1).all()
    model.save_pretrained(tmp_path, max_shard_size="10GB")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        resaved = set(f.keys())
    index = json.loads((small_checkpoint / "model.safetensors.index.json").read_text())
    assert resaved == set(index["weight_map"])


def test_cached_build_is_reused_and_keyed_by_its_inputs(small_checkpoint, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE_DIR", str(small_checkpoint.parents[1]))
    assert small_checkpoint.name.startswith("realsize-qwen2.5-1.5b-s0-")

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(realsize_module, "_write_checkpoint", no_rebuild)
    build = build_realsize_checkpoint
    assert build("qwen2.5-1.5b", overrides=SMALL, max_shard_bytes=SHARD_BYTES) == small_checkpoint
    with pytest.raises(AssertionError, match="rebuilt"):
        build("qwen2.5-1.5b", seed=1, overrides=SMALL, max_shard_bytes=SHARD_BYTES)
    with pytest.raises(AssertionError, match="rebuilt"):
        build("qwen2.5-1.5b", overrides={**SMALL, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="no real-size model"):
        build("qwen9-1b")
