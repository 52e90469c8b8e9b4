"""--kv-cache-dtype fp8 end to end: a cache in fp8 holds twice a bf16 cache's tokens in the same
memory and the engine answers with it (a speaking model's talker too); a checkpoint's KV-cache
scales and --calculate-kv-scales' reach the layers. The kernels' exactness on fp8 caches is
checked in test_attention.py and test_triton_attention.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.attention import get_attention_layers
from omniserve.engine.arg_utils import EngineArgs
from omniserve.entrypoints.cli import build_parser
from tests.hf_reference import make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _run(path: str, kv_cache_dtype: str) -> tuple[dict[str, Any], list[Any]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory="8MiB",
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    try:
        info = llm.llm_engine.engine_core.call_utility("get_model_info")
        prompts = [{"prompt_token_ids": p} for p in make_prompts(path, [40, 7, 90])]
        return info, [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_holds_twice_the_tokens_and_answers(
    tiny_checkpoint: Any, kv_cache_dtype: str
) -> None:
    path = str(tiny_checkpoint("Qwen3ForCausalLM"))
    base_info, base = _run(path, "auto")
    info, outs = _run(path, kv_cache_dtype)
    assert (
        info["kv_cache_dtype"]
        == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_cache_dtype]
    )
    assert info["num_kv_tokens"] == 2 * base_info["num_kv_tokens"]
    assert info["kv_cache_bytes"] == base_info["kv_cache_bytes"]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    # A whole prompt's prefill attends its fresh keys: the first token of the 40- and 90-token
    # prompts is the same, log-probability and all. Tokens after it read the rounded cache (as
    # does the 7-token prompt, whose short chunk the decode kernel takes): while the greedy
    # paths agree, their log-probabilities move by under 0.6 (measured: up to 0.5 with
    # e5m2's 2 mantissa bits on this tiny random model, whose flat logits then let the paths
    # drift apart, as any change of rounding may).
    for i in (0, 2):
        assert outs[i].token_ids[0] == base[i].token_ids[0]
        token = outs[i].token_ids[0]
        assert outs[i].logprobs[0][token].logprob == base[i].logprobs[0][token].logprob
    for out, ref in zip(outs, base, strict=True):
        for t, (token, want) in enumerate(zip(out.token_ids, ref.token_ids, strict=True)):
            if token != want:
                break
            assert abs(out.logprobs[t][token].logprob - ref.logprobs[t][token].logprob) < 0.6


def test_kv_cache_dtype_settings(tiny_checkpoint: Any) -> None:
    model = str(tiny_checkpoint("Qwen3ForCausalLM"))
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--model", model, "--kv-cache-dtype", "fp8_e4m3"])
    parsed.check_flags(parser, parsed)
    assert EngineArgs.from_cli_args(parsed).create_config().cache_config.cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineArgs(model=model, kv_cache_dtype="int8").create_config()


def _with_scales(source: Path, target: Path, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint ``source`` with ``extra`` tensors added."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    save_file({**tensors, **extra}, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def _layers(llm: LLM) -> list[Any]:
    model = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model
    return get_attention_layers(model)


def test_checkpoint_kv_scales_reach_the_layers(
    tiny_checkpoint: Any, tmp_path: Path, caplog
) -> None:
    """llm-compressor's KV-cache scales (``self_attn.k_scale`` / ``v_scale``, or its older
    ``k_proj.output_scale``): each attention layer takes its own; an fp8 cache applies them, a
    bf16 one says it does not; a scale that names no layer, or is not positive, is refused."""
    source = tiny_checkpoint("Qwen3ForCausalLM")
    num_layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    scales = {}
    for i in range(num_layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.5 + i])
    path = _with_scales(source, tmp_path / "scaled", scales)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level("INFO"):
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory="4MiB",
                  kv_cache_dtype="fp8")  # fmt: skip
        assert [a.kv_scales for a in _layers(llm)] == [
            (pytest.approx(0.01 * (i + 1)), 0.5 + i) for i in range(num_layers)]  # fmt: skip
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 5}], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        llm.llm_engine.shutdown()
        assert f"gives {num_layers} attention layers KV-cache scales; the float8_e4m3fn KV " \
               "cache applies them" in caplog.text  # fmt: skip
        llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory="4MiB")
        llm.llm_engine.shutdown()
        assert "the bfloat16 KV cache does not use them" in caplog.text
        for key, value, message in (
            ("model.layers.99.self_attn.k_scale", torch.tensor(1.0), "matches no attention"),
            ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), r"is \[0.0\]: expected one"),
        ):
            bad = _with_scales(source, tmp_path / f"bad{len(key)}{float(value)}", {key: value})
            with pytest.raises(ValueError, match=f"KV-cache scale '{key}' {message}"):
                LLM(bad, dtype="bfloat16", max_model_len=256, kv_cache_memory="4MiB")


def test_compressed_tensors_kv_cache_scheme_is_read() -> None:
    from omniserve.config import QuantizationConfig

    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "channel"}}},
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False, "symmetric": True}}  # fmt: skip
    assert QuantizationConfig.from_hf(config).method == "fp8"


def test_calculate_kv_scales_takes_them_from_the_first_step() -> None:
    """vLLM's --calculate-kv-scales: a layer's scales are its first real step's largest key
    and value magnitudes over 200 and 100, from the rows that write a slot only (a warm-up's
    padding rows write none), and fixed from then on."""
    from omniserve.attention import Attention
    from omniserve.attention.layer import K_SCALE_CONSTANT, V_SCALE_CONSTANT

    layer = Attention(2, 16, 0.25, num_kv_heads=1)
    layer.calculate_kv_scales = True
    k, v = torch.randn(3, 16), torch.randn(3, 16)
    k[2], v[2] = 1e3, -1e3  # the padding row's: never a scale
    layer._calculate_kv_scales(k, v, torch.tensor([-1, -1, -1]))  # all padding: nothing learnt
    assert layer.calculate_kv_scales and layer.kv_scales == (1.0, 1.0)
    layer._calculate_kv_scales(k, v, torch.tensor([8, 9, -1]))
    want = (
        float(k[:2].abs().max()) / K_SCALE_CONSTANT,
        float(v[:2].abs().max()) / V_SCALE_CONSTANT,
    )
    assert layer.kv_scales == pytest.approx(want) and not layer.calculate_kv_scales


def test_calculate_kv_scales_end_to_end(tiny_checkpoint: Any) -> None:
    path = str(tiny_checkpoint("Qwen3ForCausalLM"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory="4MiB",
                  kv_cache_dtype="fp8", calculate_kv_scales=True)  # fmt: skip
    try:
        layers = _layers(llm)
        assert all(a.calculate_kv_scales and a.kv_scales == (1.0, 1.0) for a in layers)
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 5}], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert all(not a.calculate_kv_scales and 0 < min(a.kv_scales) and a.kv_scales != (1.0, 1.0)
                   for a in layers)  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="calculate_kv_scales scales an fp8 KV cache"):
        EngineArgs(model=path, calculate_kv_scales=True).create_config()


def test_a_speaking_model_with_an_fp8_cache(tiny_checkpoint: Any) -> None:
    """The talker's KV cache takes --kv-cache-dtype too (and --calculate-kv-scales' scales): a
    full omni checkpoint answers in words and audio with both caches in fp8."""
    model_dir = str(tiny_checkpoint("Qwen3OmniMoeForConditionalGeneration"))
    speech = {"voice": "ethan", "temperature": 0.0, "max_tokens": 20}
    params = SamplingParams(temperature=0.0, max_tokens=6, output_modalities=["text", "audio"],
                            speech=speech)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
                  kv_cache_dtype="fp8", calculate_kv_scales=True)  # fmt: skip
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
        template = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
        )
        (out,) = llm.generate({"prompt": template}, params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 6
        assert out.outputs[0].audio is not None and out.outputs[0].audio.size
        talker_caches = runner.talker_runner.kv_caches
        assert talker_caches and all(c.dtype == torch.float8_e4m3fn for c in talker_caches)
        assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
        talker_layers = get_attention_layers(runner.talker_runner.talker)
        assert all(not a.calculate_kv_scales and a.kv_scales != (1.0, 1.0) for a in talker_layers)
    finally:
        llm.shutdown()
